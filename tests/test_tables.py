"""benchmarks/tables.py: the docs' result tables are what the CSVs in benchmarks/results say.

CPU only, standard library: the generated blocks of README.md and BENCHMARKS.md must match a fresh
render of their CSVs (so a number edited by hand, or a CSV replaced without ``--write``, fails here).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("kvcompile_bench_tables", os.path.join(ROOT, "benchmarks", "tables.py"))
tables = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tables  # dataclasses look their module up while the class is built
_spec.loader.exec_module(tables)


def test_docs_tables_match_the_csvs():
    assert tables.check() == {}, "run `python benchmarks/tables.py --write` (or fix the CSV named in RUNS)"


def test_every_doc_has_generated_tables_and_every_run_is_quoted():
    """Each doc holds generated blocks, and every table is quoted somewhere (no dead entries)."""
    used = set()
    for doc in tables.DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            names = [m.group("name") for m in tables.BLOCK.finditer(f.read())]
        assert names, f"{doc} has no generated table"
        used.update(names)
    assert used == set(tables.TABLES)


def _copy_docs(tmp_path):
    for doc in tables.DOCS:
        shutil.copy(os.path.join(ROOT, doc), tmp_path / doc)


def test_check_finds_a_number_edited_by_hand_and_write_restores_it(tmp_path):
    _copy_docs(tmp_path)
    readme = tmp_path / "README.md"
    text = readme.read_text()
    block = next(m for m in tables.BLOCK.finditer(text) if m.group("name") == "decode-ratios")
    body = block.group("body")
    edited = body.replace("1.72×", "1.90×", 1)
    assert edited != body
    readme.write_text(text.replace(body, edited))
    assert tables.check(str(tmp_path)) == {"README.md": ["decode-ratios"]}
    assert tables.write(str(tmp_path)) == {"README.md": ["decode-ratios"]}
    assert readme.read_text() == text and tables.check(str(tmp_path)) == {}


def test_check_finds_a_changed_csv(tmp_path):
    """A new measurement in the CSV makes the quoted table stale; the render follows the CSV."""
    results = tmp_path / "results"
    shutil.copytree(tables.RESULTS, results)
    path = results / tables.RUNS["decode"].csv
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    row = next(r for r in rows if r["provider"] == "kvcompile-fp8" and r["shape"] == "B=8 L=32768")
    sdpa = next(r for r in rows if r["provider"] == "sdpa-bf16" and r["shape"] == "B=8 L=32768")
    row["us"] = str(float(sdpa["us"]) / 2.5)
    row["vs_sdpa"] = "2.5"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    stale = tables.check(ROOT, str(results))
    assert "decode-ratios" in stale["README.md"] and "decode" in stale["BENCHMARKS.md"]
    assert "| B=8, L=32k | 2.50× |" in tables.decode_ratios(str(results))


def test_missing_csv_and_unknown_block_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="RUNS names a CSV"):
        tables.decode_ratios(str(tmp_path))
    with pytest.raises(KeyError, match="no-such-table"):
        tables.update("<!-- table:no-such-table (generated) -->\nx\n<!-- /table:no-such-table -->\n")

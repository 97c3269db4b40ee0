"""benchmarks/bench_cpu.py --smoke: every provider runs end to end on the tiny random model, and the
kvcompile rows really went through the attention pass (timings are not asserted)."""

from __future__ import annotations

import csv
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_cpu_smoke(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_cpu
    finally:
        sys.path.pop(0)
    path = tmp_path / "rows.csv"
    rows = bench_cpu.main(["--smoke", "--csv", str(path)])
    assert [(r["provider"], r["max_cache_len"]) for r in rows] == [
        ("hf-dynamic", "-"), ("hf-static", 48), ("kvcompile-int8", 48), ("kvcompile-fp8_e4m3", 48),
        ("kvcompile-q8_0", 48)]
    for r in rows:
        assert r["new_tokens"] == 8 and r["prompt_tokens"] == len(bench_cpu.SMOKE_PROMPT)  # byte tokenizer
        assert r["prefill_ms"] > 0 and math.isfinite(r["decode_tok_s"]) and r["decode_tok_s"] > 0, r
    for r in rows[2:]:  # both layers' attention, prefill and decode graphs, rewritten by the pass
        assert r["sites_found"] >= 2 * 2 and r["sites_rewritten"] == r["sites_found"], r
        assert r["warmup_s"] > 0
    with open(path) as f:
        assert [row["provider"] for row in csv.DictReader(f)] == [r["provider"] for r in rows]
    out = capsys.readouterr().out
    assert "| kvcompile-q8_0" in out and "decode tok/s" in out

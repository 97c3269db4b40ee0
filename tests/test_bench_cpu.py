"""benchmarks/bench_cpu.py --smoke: every provider runs end to end on the tiny random model, the
kvcompile rows really went through the attention pass, and the second round reuses each provider's
compiled graphs in a rotated order (timings are not asserted)."""

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
    rows = bench_cpu.main(["--smoke", "--repeats", "2", "--csv", str(path)])
    first = [("hf-dynamic", "-"), ("hf-static", 48), ("kvcompile-int8", 48), ("kvcompile-fp8_e4m3", 48),
             ("kvcompile-q8_0", 48)]
    assert [(r["provider"], r["max_cache_len"]) for r in rows] == first + first[1:] + first[:1]
    assert [r["repeat"] for r in rows] == [0] * 5 + [1] * 5
    for r in rows:
        assert r["new_tokens"] == 8 and r["prompt_tokens"] == len(bench_cpu.SMOKE_PROMPT)  # byte tokenizer
        assert r["prefill_ms"] > 0 and math.isfinite(r["decode_tok_s"]) and r["decode_tok_s"] > 0, r
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0, r
    compiled = [r for r in rows if r["provider"] != "hf-dynamic"]
    for r in compiled:
        assert r["warmup_s"] > 0
    # one warm-up per provider, shared by both rounds, and no graph compiled by a timed row
    by_provider = {}
    for r in compiled:
        by_provider.setdefault(r["provider"], set()).add(r["warmup_s"])
    assert all(len(w) == 1 for w in by_provider.values()), by_provider
    assert len({r["graphs_compiled"] for r in rows}) == 1, [r["graphs_compiled"] for r in rows]
    for r in rows:
        if r["provider"].startswith("kvcompile"):  # both layers' attention, prefill and decode graphs
            assert r["sites_found"] >= 2 * 2 and r["sites_rewritten"] == r["sites_found"], r
    with open(path) as f:
        assert [row["provider"] for row in csv.DictReader(f)] == [r["provider"] for r in rows]
    summary = {(s["provider"], s["max_cache_len"]): s for s in bench_cpu.summarize(rows)}
    assert summary[("hf-static", "48")]["vs_hf_static"] == 1.0 and summary[("kvcompile-q8_0", "48")]["runs"] == 2
    assert summary[("kvcompile-q8_0", "48")]["vs_own_shortest_drift"] == 1.0  # one phase: no drift to remove
    out = capsys.readouterr().out
    assert "| kvcompile-q8_0" in out and "decode tok/s" in out and "median step" in out


def test_summary_removes_the_drift_between_phases():
    """Rounds at 8192 on a machine 25% slower than during the rounds at 128: every provider, the eager
    reference too, takes 1.25x the steps. Against its own rate at 128 a provider reads 0.80; against
    hf-dynamic's drift, 1.00. A provider that is itself 10% slower at 8192 reads 0.73 / 0.91."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_cpu
    finally:
        sys.path.pop(0)
    step = {("hf-dynamic", "-"): 70.0, ("hf-static", 128): 60.0, ("kvcompile-int8", 128): 62.0,
            ("hf-static", 8192): 240.0, ("kvcompile-int8", 8192): 62.0, ("kvcompile-q8_0", 128): 64.0,
            ("kvcompile-q8_0", 8192): 64.0 * 1.1}
    rows = []
    for phase, slow in ((128, 1.0), (8192, 1.25)):
        for rep in range(3):
            for (prov, L), ms in step.items():
                if L in ("-", phase):
                    rows.append(dict(phase=phase, repeat=rep, provider=prov, max_cache_len=L, decode_tok_s=1.0,
                                     prefill_ms=100.0, step_ms=ms * slow * (1 + 0.01 * rep)))
    s = {(r["provider"], r["max_cache_len"], r["phase"]): r for r in bench_cpu.summarize(rows)}
    assert set(k for k in s if k[0] == "hf-dynamic") == {("hf-dynamic", "-", 128), ("hf-dynamic", "-", 8192)}
    int8 = s[("kvcompile-int8", "8192", 8192)]
    assert math.isclose(int8["vs_own_shortest"], 0.8) and math.isclose(int8["vs_own_shortest_drift"], 1.0)
    q8 = s[("kvcompile-q8_0", "8192", 8192)]
    assert math.isclose(q8["vs_own_shortest"], 0.8 / 1.1) and math.isclose(q8["vs_own_shortest_drift"], 1 / 1.1)
    assert math.isclose(s[("kvcompile-int8", "128", 128)]["vs_hf_static"], 60 / 62)
    assert math.isclose(s[("kvcompile-int8", "8192", 8192)]["vs_hf_dynamic"], 70 / 62)  # the same rounds' eager

"""benchmarks/bench_kv.py's smoke subject (the launches gpu_check.sh's SANITIZE step runs under
compute-sanitizer) must get through every format on the CPU.

The smoke is the GPU's only memcheck of the kernels, and a script broken in its own argument passing
looks on the device like a crash, not a finding. Here ``kernels`` is swapped for :mod:`kvcompile.reference`,
whose store_kv / dequantize / attention take the same positional arguments: every call the smoke makes
(masks, causal, windows, softcap, sinks, both V layouts, K-only and K+V rotation) reaches an op with the
arguments the Triton launchers get on the GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

from kvcompile import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("kvcompile_bench_kv", os.path.join(ROOT, "benchmarks", "bench_kv.py"))
bench_kv = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench_kv
_spec.loader.exec_module(bench_kv)


def test_smoke_runs_every_format(monkeypatch, capsys):
    monkeypatch.setattr(bench_kv, "DEVICE", "cpu")
    monkeypatch.setattr(bench_kv, "kernels", reference)
    monkeypatch.setenv("KVCOMPILE_PREFILL", "fused")  # restored even if the smoke raises before it pops it
    calls = []
    attention = reference.attention

    def counted(*args, **kwargs):
        calls.append(tuple(a is not None for a in args[12:14]))  # (K rotated, V rotated)
        return attention(*args, **kwargs)

    monkeypatch.setattr(reference, "attention", counted)
    torch.manual_seed(0)
    bench_kv.smoke(argparse.Namespace(formats=list(bench_kv.FORMATS)))
    assert "smoke done" in capsys.readouterr().out
    # each format: 2 V layouts x (3 query lengths x 4 calls + the dense prefill)
    assert len(calls) == len(bench_kv.FORMATS) * 2 * (3 * 4 + 1)
    # the rotated formats reach attention with their rotations: +rot both sides, +krot K only
    assert {(True, True), (True, False), (False, False)} <= set(calls)

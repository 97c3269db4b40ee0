"""Error of the fused prefill's modes on the GPU, by cached length: each output against float64
attention over the original (unquantized) K and V, Llama-3-8B heads, random bf16 q / K / V.

    python benchmarks/err_prefill_q.py --L 4096,16384,65536 --tq 1024 --acc 0,32,tile --out err.csv

Rows per format and cached length: the dense path (dequantize + SDPA), the fused kernel exact, and
each mode (``q8``: q quantized per row; ``q8+p8``: and P in V's code type; plan.LaunchPlan.q_quant /
p_fp8 / p_int8) at each ``--acc`` (plan.LaunchPlan.fp8_acc: the fp8 dots promote their sums to fp32
every N products; 0: Triton's default; ``tile``: once per dot, P V's once per key tile). ``vs dense``
is the row's error over the dense path's (the fused kernel's target: at most 1.25). Random keys
make attention nearly uniform, the hardest case for a reduced-precision sum (every one of the L terms
counts), so these rows bound what a model's peaked attention sees.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kv as bk  # noqa: E402  (the benchmark caches: formats, rotations, the store)

from kvcompile import kernels  # noqa: E402
from kvcompile.kernels import plan as plan_mod  # noqa: E402

MODES = {"q8": dict(q_quant=True), "q8+p8": dict(q_quant=True, p_fp8=True, p_int8=True)}  # P: V's code type


def reference(q, k, v):
    """float64 causal attention of the Tq queries at the end of the L keys (GQA), one head at a time."""
    Hq, Tq, D = q.shape[1:]
    L, g = k.shape[2], q.shape[1] // k.shape[1]
    qpos = torch.arange(L - Tq, L, device=q.device)
    hide = torch.arange(L, device=q.device)[None, :] > qpos[:, None]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for h in range(Hq):
        s = (q[0, h].double() @ k[0, h // g].double().T) / math.sqrt(D)
        out[0, h] = torch.softmax(s.masked_fill(hide, float("-inf")), -1) @ v[0, h // g].double()
    return out


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--L", default="4096,16384,65536", help="cached lengths (the new tokens are the last --tq)")
    p.add_argument("--tq", type=int, default=1024)
    p.add_argument("--formats", default="fp8,int8+krot")
    p.add_argument("--acc", default="0,32,tile", help="plan.LaunchPlan.fp8_acc values (tile: once per dot)")
    p.add_argument("--out", default="err_prefill_q.csv")
    args = p.parse_args()
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    rows = []
    for L in map(int, args.L.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(L)
        q = torch.randn(1, bk.HQ, args.tq, bk.D, device="cuda", dtype=torch.bfloat16, generator=gen)
        kv_len = torch.tensor(L, device="cuda")
        for fname in args.formats.split(","):
            R = bk.rot(fname)
            c, (k, v) = bk.make_cache(*bk.FORMATS[fname], 1, L, R=R)
            ref = reference(q, k, v)

            def run():
                return kernels.attention(q, *c, kv_len, None, True, None, 0, 0.0, None, *R, **bk.fmts_of(*c))

            found = {}
            for path in ("dense", "fused"):
                os.environ["KVCOMPILE_PREFILL"] = path
                found[path] = rel_err(run(), ref)
            for mode, fields in MODES.items():
                for acc in args.acc.split(","):
                    with plan_mod.override(**fields, fp8_acc=plan_mod.FP8_ACC_PER_DOT if acc == "tile" else int(acc)):
                        found[f"{mode} acc{acc}"] = rel_err(run(), ref)
            os.environ.pop("KVCOMPILE_PREFILL")
            for name, err in found.items():
                rows.append(dict(format=fname, L=L, tq=args.tq, variant=name, rel_err=err,
                                 vs_dense=err / found["dense"]))
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("\n| format | L | variant | rel err | vs dense |")
    print("|---|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['L']} | {r['variant']} | {r['rel_err']:.3e} | {r['vs_dense']:.3f} |")


if __name__ == "__main__":
    main()

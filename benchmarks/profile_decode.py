"""One split-K decode launch under Nsight Compute (ncu), for a fixed shape and launch-plan fields.

    ncu --clock-control none --profile-from-start off -k regex:_attention_kernel \
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        python benchmarks/profile_decode.py --shape 8x32768 --set v_pin=0

Compiles and warms up first, then profiles exactly one call (cudaProfilerStart/Stop around it).
Llama-3-8B attention shape (32 q heads, 8 kv heads, head_dim 128), bf16 q, fp8 token cache.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvcompile import kernels  # noqa: E402
from kvcompile.kernels import plan as plan_mod  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_kv import HQ, fmts_of, make_cache  # noqa: E402



def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8x32768", help="BxL")
    p.add_argument("--kv-dtype", default="fp8_e4m3")
    p.add_argument("--granularity", default="token")
    p.add_argument("--set", default="", help="launch-plan fields (kernels/plan.py LaunchPlan), NAME=int,...")
    args = p.parse_args()
    fields = {}
    for item in filter(None, args.set.split(",")):
        name, value = item.split("=")
        if name not in {f.name for f in plan_mod.dataclasses.fields(plan_mod.LaunchPlan)}:
            raise SystemExit(f"LaunchPlan has no field {name}")
        fields[name] = int(value) if name in ("splits", "split_len", "resident") else bool(int(value))
    B, L = (int(x) for x in args.shape.split("x"))
    (kc, ks, vc, vs), _ = make_cache(args.kv_dtype, args.granularity, B, L)
    q = torch.randn(B, HQ, 1, kc.shape[-1], device="cuda", dtype=torch.bfloat16)
    kv_len = torch.full((B,), L, device="cuda", dtype=torch.long)
    with plan_mod.override(**fields):
        for _ in range(3):
            kernels.attention(q, kc, ks, vc, vs, kv_len, None, False, None, **fmts_of(kc, ks, vc, vs))
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        kernels.attention(q, kc, ks, vc, vs, kv_len, None, False, None, **fmts_of(kc, ks, vc, vs))
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()

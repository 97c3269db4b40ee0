"""Generate with an 8-bit KV cache under tensor parallelism: transformers shards the model
(``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``, which needs
accelerate, in kvcompile's ``examples`` extra), each rank's ``QuantizedCache`` stores its own kv
heads, and each rank compiles its own graph with ``kvcompile.backend()``.

    torchrun --nproc-per-node 2 examples/generate_tp.py --tiny                 # CPU (gloo) or GPUs (nccl)
    torchrun --nproc-per-node 2 examples/generate_tp.py --model meta-llama/Llama-3.1-8B-Instruct

The kv heads must divide among the processes (Llama-3.1-8B: 8; SmolLM2-135M, the other examples'
default, has 3, so it is not the default here). Each rank runs on ``cuda:LOCAL_RANK`` when CUDA is
available (transformers binds it), else on the CPU with gloo. Rank 0 prints the text; every rank
prints its heads, its cache and its compiler pass report. ``--tiny``: a random 2-layer Llama, saved
to a temporary directory so that ``from_pretrained`` can shard it (the text is noise).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import kvcompile  # noqa: E402

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="HF causal-LM path or hub id whose kv heads divide among the processes")
    which.add_argument("--tiny", action="store_true", help="a tiny random Llama (tests; the text is noise)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--kv-dtype", default=None,
                   help=f"one of {list(kvcompile.KV_DTYPES)} (default: {kvcompile.DEFAULT_KV_DTYPE})")
    p.add_argument("--calibration", default=None, help="a whole-model calibration file (each rank takes its heads)")
    p.add_argument("--no-compile", action="store_true", help="run eagerly (the cache dequantizes for attention)")
    p.add_argument("--dtype", default="auto", help="weights dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    return p.parse_args(argv)


def load(args, rank: int):
    """(model, tokenizer): the model sharded by transformers over every process of this torchrun."""
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    if not args.tiny:
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=DistributedConfig(tp_plan="auto"),
                                                     dtype=dtype)
        return model.eval(), tok
    model, tok = _common.tiny_model()  # the same weights on every rank (seeded)
    with tempfile.TemporaryDirectory(prefix=f"kvcompile-tp{rank}-") as d:
        model.save_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, distributed_config=DistributedConfig(tp_plan="auto"), dtype=dtype)
        return model.eval(), tok


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node 2 examples/generate_tp.py --tiny")
    _common._require_examples_extra("transformers' tensor-parallel loading", modules=("accelerate",))
    model, tok = load(args, int(os.environ["RANK"]))  # initializes torch.distributed (nccl on CUDA, gloo on CPU)
    rank, device = dist.get_rank(), model.device
    ids = torch.tensor([tok.encode(args.prompt)], device=device)
    T = ids.shape[1]
    # tp_size: this rank's kv heads, allocated now on its device (static addresses for CUDA graphs)
    cache = kvcompile.QuantizedCache(model.config, max_batch_size=1, max_cache_len=T + args.max_new_tokens,
                                     kv_dtype=args.kv_dtype, calibration=args.calibration, device=device,
                                     tp_size=model.tp_size)
    backend = None
    if not args.no_compile:
        backend = kvcompile.backend(kv_dtype=args.kv_dtype)
        model.forward = torch.compile(model.forward, backend=backend)
    gen_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, disable_compile=True,
                  pad_token_id=getattr(tok, "eos_token_id", None) or 0)
    if getattr(tok, "eos_token_id", None) is None:
        gen_kw["eos_token_id"] = None
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **{_common.cache_kwarg(model): cache}, **gen_kw)
    seconds = time.perf_counter() - t0  # compile included
    layer = cache.layers[0]
    first = layer.tp_shard.rank * layer.num_heads
    lines = [f"rank {rank}/{model.tp_size} on {device}: kv heads {first}..{first + layer.num_heads - 1} of "
             f"{model.config.num_key_value_heads}, {cache!r}, {cache.nbytes / 2**20:.3f} MiB"]
    if backend is not None:
        lines.append(f"rank {rank}: pass report {backend.report()}")
    print("\n".join(lines), flush=True)
    dist.barrier()
    if rank == 0:
        new = out[0, T:].tolist()
        print("-" * 60 + "\n" + tok.decode(new, skip_special_tokens=True) + "\n" + "-" * 60)
        print(f"{len(new)} new tokens in {seconds:.1f} s (compile included)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to first token of a long prompt, per KV cache, on Llama-3-8B-shaped layers (random bf16 weights).

A prompt of P tokens (batch 1) is prefilled either in one forward or in chunks of N tokens the way
``generate(prefill_chunk_size=N)`` runs them (each chunk one forward over the cache, the attention
mask spanning every token so far), and the first token's logits are computed (``logits_to_keep=1``,
as generate does). Timed with CUDA events around the whole prefill, median of ``--repeat`` runs after
one untimed run (which compiles); a fresh cache each run, so the peak memory (``max_memory_allocated``
over the timed runs, weights included) counts the cache as a user pays for it.

Providers:

  hf-dynamic-eager      transformers' DynamicCache, eager SDPA (what a user has by default)
  hf-static-compiled    transformers' StaticCache, torch.compile (Inductor)
  kvc-<fmt>             kvcompile.QuantizedCache(kv_dtype=<fmt>) + kvcompile.backend
  kvc-<fmt>@<mode>      the same with KVCOMPILE_PREFILL_Q=<mode> (int8 / fp8 / p8: the fused prefill's
                        quantized scores, opt-in) while it runs

``attn TFLOP`` counts the visible query-key pairs of causal attention (4 * D * Hq flops a pair, all
layers); bench_kv.py --subjects prefill times the attention alone.

    python benchmarks/bench_ttft.py --layers 8 --prompts 8192,32768 --chunks 0,2048 --out ttft.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_e2e import make_model  # noqa: E402

import kvcompile  # noqa: E402
from kvcompile.hf import cache_kwarg  # noqa: E402

PROVIDERS = "hf-dynamic-eager,hf-static-compiled,kvc-int8,kvc-fp8_e4m3"


def kvc_provider(name: str) -> tuple[str, str | None]:
    """(kv_dtype, KVCOMPILE_PREFILL_Q mode or None) of a ``kvc-<fmt>[@<mode>]`` provider."""
    fmt, _, mode = name.split("-", 1)[1].partition("@")
    return fmt, mode or None


def make_cache(name: str, cfg, max_len: int, device):
    from transformers import DynamicCache, StaticCache

    if name == "hf-dynamic-eager":
        return DynamicCache(config=cfg)
    if name == "hf-static-compiled":
        return StaticCache(config=cfg, max_cache_len=max_len)
    return kvcompile.QuantizedCache(cfg, max_batch_size=1, max_cache_len=max_len, kv_dtype=kvc_provider(name)[0],
                                    device=device)


def make_forward(name: str, model):
    if name == "hf-dynamic-eager":
        return model.forward
    if name == "hf-static-compiled":
        return torch.compile(model.forward)
    return torch.compile(model.forward, backend=kvcompile.backend(kv_dtype=kvc_provider(name)[0]))


VIA_GENERATE = False  # --via-generate


def prefill(fwd, model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """The prompt through ``fwd`` in one forward (chunk 0) or chunks; the first token's logits.
    ``--via-generate``: ``model.generate(max_new_tokens=1, prefill_chunk_size=chunk)`` with ``fwd`` as
    the model's forward (transformers then builds each later chunk's 4-D mask outside the graph)."""
    kw = cache_kwarg(model)
    if VIA_GENERATE:
        forward = model.forward
        model.forward = fwd
        try:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **{kw: cache}, max_new_tokens=1,
                                 do_sample=False, prefill_chunk_size=chunk or None, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        finally:
            model.forward = forward
        return out.logits[0][:, None]
    P = ids.shape[1]
    step = chunk or P
    with torch.no_grad():
        for start in range(0, P, step):
            end = min(start + step, P)
            mask = torch.ones(1, end, dtype=torch.long, device=ids.device)
            out = fwd(input_ids=ids[:, start:end], attention_mask=mask, **{kw: cache}, use_cache=True,
                      logits_to_keep=1)
    return out.logits


def run(name: str, model, P: int, chunk: int, repeat: int, device) -> dict:
    cfg = model.config
    fwd = make_forward(name, model)
    ids = torch.randint(0, cfg.vocab_size, (1, P), device=device, generator=torch.Generator(device).manual_seed(0))
    t0 = time.perf_counter()
    first = prefill(fwd, model, ids, make_cache(name, cfg, P + 64, device), chunk)  # compiles
    compile_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        cache = make_cache(name, cfg, P + 64, device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        logits = prefill(fwd, model, ids, cache, chunk)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        del cache
    peak = torch.cuda.max_memory_allocated() / 2**30
    if PROFILE:
        profile_prefill(name, lambda: prefill(fwd, model, ids, make_cache(name, cfg, P + 64, device), chunk))
    Hq, D, layers = cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers
    attn_tflop = 4 * D * Hq * layers * P * (P + 1) / 2 / 1e12
    return dict(provider=name, prompt=P, chunk=chunk, ms=statistics.median(times), peak_gib=peak,
                attn_tflop=attn_tflop, compile_s=compile_s, top1=int(logits[0, -1].argmax()),
                first_top1=int(first[0, -1].argmax()))


PROFILE = False  # --profile


def profile_prefill(name: str, fn) -> None:
    """The GPU kernels of one prefill by total device time (torch.profiler): where a provider's time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- {name}: GPU kernels of one prefill ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompts", default="8192,32768")
    p.add_argument("--chunks", default="0,2048", help="0: the whole prompt in one forward")
    p.add_argument("--providers", default=PROVIDERS)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default="bench_ttft.csv")
    p.add_argument("--profile", action="store_true", help="print the GPU kernels of one prefill per provider")
    p.add_argument("--via-generate", action="store_true",
                   help="run each prefill as generate(max_new_tokens=1, prefill_chunk_size=N)")
    args = p.parse_args(argv)
    global PROFILE, VIA_GENERATE
    PROFILE, VIA_GENERATE = args.profile, args.via_generate
    if not torch.cuda.is_available():
        sys.exit("bench_ttft needs a CUDA device")
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    device = torch.device("cuda")
    model = make_model(args.layers, args.vocab, device, torch.bfloat16)
    rows = []
    for P in map(int, args.prompts.split(",")):
        for chunk in map(int, args.chunks.split(",")):
            for name in args.providers.split(","):
                torch._dynamo.reset()
                mode = kvc_provider(name)[1] if name.startswith("kvc-") else None
                outer = os.environ.get("KVCOMPILE_PREFILL_Q")
                if mode:
                    os.environ["KVCOMPILE_PREFILL_Q"] = mode
                try:
                    rows.append(run(name, model, P, chunk, args.repeat, device))
                except Exception as e:  # a provider that fails is reported, not hidden
                    print(f"[{name} P={P} chunk={chunk}] failed: {type(e).__name__}: {e}", flush=True)
                    continue
                finally:
                    if mode:  # the caller's setting back
                        os.environ.pop("KVCOMPILE_PREFILL_Q", None)
                        if outer is not None:
                            os.environ["KVCOMPILE_PREFILL_Q"] = outer
                    torch.cuda.empty_cache()
                print(rows[-1], flush=True)
    if not rows:
        sys.exit("bench_ttft: no provider ran")
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    base = {(r["prompt"], r["chunk"]): r["ms"] for r in rows if r["provider"] == "hf-dynamic-eager"}
    print("\n| prompt | chunk | provider | TTFT ms | vs DynamicCache | peak GiB | attn TFLOP |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        key = (r["prompt"], r["chunk"])
        rel = base[key] / r["ms"] if key in base else float("nan")
        print(f"| {r['prompt']} | {r['chunk'] or 'one forward'} | {r['provider']} | {r['ms']:.1f} | {rel:.2f}x | "
              f"{r['peak_gib']:.2f} | {r['attn_tflop']:.1f} |")


if __name__ == "__main__":
    main()

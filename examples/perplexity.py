"""How faithful is an 8-bit KV cache? KL, top-1, perplexity and free-running greedy agreement
against a full-precision cache, for every cache variant on the same model.

    python examples/perplexity.py       # SmolLM2-135M-Instruct, 2048 tokens of pydoc_data.topics, 24 prompts
    python examples/perplexity.py --text my.txt --tokens 4096 --variants full q8_0 int8+rot

Two measurements, every variant against the first one (``full``: a full-precision StaticCache):

* **The text** (``--text``; default: ``pydoc_data.topics``, the Python reference's topic texts that
  ship with every Python install, so the numbers need nothing outside it). Its first ``--tokens``
  tokens are prefilled in chunks of ``--chunk`` into every cache in lockstep (each chunk attends
  to the quantized past, as in serving). Per variant: KL(full || variant) of the next-token
  distributions (the low-noise measure of the harm), top-1 agreement with full precision, and
  perplexity (and its change).
* **Free-running greedy generation** from the built-in :data:`PROMPTS` (questions, instructions,
  code, lists, a story; the chat template applied when the tokenizer has one): each variant
  generates ``--new-tokens`` tokens on its own (EOS does not stop it) and is compared with full
  precision's tokens: the number of tokens before the first departure, as the median and the
  worst over the prompts, and how many prompts keep all of them. One early departure changes
  everything after it, so this is the harshest view; K/V rounded to bf16 (``bf16``) is the floor
  an 8-bit format can hope for.

Calibrated variants (``...+center``, ``.../static...``) use ``kvcompile.calibrate`` on text disjoint
from the evaluated tokens (from the middle of the text), or ``--calibration FILE``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import kvcompile  # noqa: E402

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Explain in a short paragraph why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List five fruits that are rich in vitamin C, one per line.",
    "Give three tips for staying focused while studying.",
    "Translate into French: 'The weather is nice today and I would like to go for a walk.'",
    "Write a haiku about the sea.",
    "What are the main differences between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How do I reverse a string in JavaScript? Show a code example.",
    "Name the planets of the solar system in order from the sun.",
    "Write a short email asking a colleague to move our meeting to Friday.",
    "What is photosynthesis? Explain it to a ten-year-old.",
    "Write a SQL query that counts the orders per customer in a table named orders.",
    "Give me a recipe for a simple tomato pasta sauce, as numbered steps.",
    "What causes the seasons on Earth?",
    "Write a limerick about a cat who learns to code.",
    "Compare electric cars and petrol cars: two advantages of each.",
    "Explain what a hash table is and why its lookups are fast.",
    "Write a bash command that finds all .txt files larger than 1 MB in the current directory.",
    "What are three common causes of headaches, and how can they be prevented?",
    "Continue the story: The old lighthouse keeper opened the door and saw",
    "Describe the water cycle in four steps.",
    "Write a C function that swaps two integers using pointers.",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=_common.DEFAULT_MODEL)
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (tests)")
    p.add_argument("--text", default=None, help=f"text file (default: {_common.DEFAULT_TEXT}, inside Python)")
    p.add_argument("--tokens", type=_common.positive_int, default=2048, help="evaluation tokens of the text")
    p.add_argument("--chunk", type=_common.positive_int, default=512, help="prefill chunk")
    p.add_argument("--new-tokens", "--continuation", dest="new_tokens", type=int, default=128,
                   help="greedy tokens per prompt (0: skip the greedy comparison)")
    p.add_argument("--prompts", type=_common.positive_int, default=len(PROMPTS),
                   help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--variants", nargs="+", default=list(_common.DEFAULT_VARIANTS),
                   help=f"from {list(_common.VARIANTS)} (default {list(_common.DEFAULT_VARIANTS)})")
    p.add_argument("--calibration", default=None,
                   help="safetensors calibration file, or a shipped name such as smollm2-135m-instruct "
                        "(kvcompile.calibration.shipped_calibrations()); default: calibrate now")
    p.add_argument("--calib-tokens", type=_common.positive_int, default=4096,
                   help="tokens to calibrate on (disjoint text)")
    p.add_argument("--save-calibration", default=None, help="write the calibration used to this file")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--markdown", default=None, help="append the results table to this file")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    _common.check_args(p, args)  # before the model loads
    return args


def _forward(model, ids, cache, kwarg, **kw):
    return model(input_ids=ids, use_cache=True, **{kwarg: cache}, **kw).logits


@torch.no_grad()
def evaluate(model, caches: dict, ids: torch.Tensor, chunk: int, kwarg: str, progress=None) -> dict:
    """Chunked prefill of ``ids`` [1, N] into every cache in lockstep.

    ``caches`` maps variant name -> cache; the first is the reference. Per variant: summed NLL of
    the next tokens, summed KL(reference || variant) of the next-token distributions (a low-noise
    measure of the harm: perplexity deltas of a few tenths of a percent are within the noise of
    a few thousand tokens, KL is not) and top-1 agreement with the reference.
    """
    names = list(caches)
    stats = {n: {"nll": 0.0, "kl": 0.0, "top1": 0, "n": 0} for n in names}
    N = ids.shape[1]
    for s in range(0, N, chunk):
        x = ids[:, s : s + chunk]
        tgt = ids[:, s + 1 : s + chunk + 1]
        ref_logp = None
        for name in names:
            logp = torch.log_softmax(_forward(model, x, caches[name], kwarg).float(), -1)[0]  # [T, V]
            st = stats[name]
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


def prompt_batch(tok, prompts, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` [P, T] of the prompts (chat template when there is one)."""
    rows = []
    for p in prompts:
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            rows.append(list(tok.encode(text, add_special_tokens=False)))
        else:
            rows.append(list(tok.encode(p)))
    pad = getattr(tok, "pad_token_id", None)
    pad = pad if pad is not None else (getattr(tok, "eos_token_id", None) or 0)
    T = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (T - len(r)) + r for r in rows], device=device)
    am = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, am


@torch.no_grad()
def greedy(model, cache, ids, am, steps: int, kwarg: str) -> torch.Tensor:
    """``steps`` free-running greedy tokens per row of a left-padded batch: [P, steps] (EOS does not stop)."""
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = _forward(model, ids, cache, kwarg, attention_mask=am, position_ids=pos)[:, -1]
    out = []
    for i in range(steps):
        nxt = logits.float().argmax(-1, keepdim=True)
        out.append(nxt)
        if i + 1 == steps:
            break
        am = torch.cat([am, torch.ones_like(am[:, :1])], 1)
        logits = _forward(model, nxt, cache, kwarg, attention_mask=am, position_ids=am.sum(-1, keepdim=True) - 1)[:, -1]
    return torch.cat(out, 1)


def first_departure(gen: torch.Tensor, ref: torch.Tensor) -> list[int]:
    """Per row: tokens before the first position where ``gen`` differs from ``ref`` (all: ``steps``)."""
    diff = gen != ref
    steps = ref.shape[1]
    return [int(d.nonzero()[0]) if d.any() else steps for d in diff]


def _calibration(args, model, tok, text, eval_chars, device):
    if args.calibration:
        print(f"calibration: {args.calibration}")
        return kvcompile.load_calibration(args.calibration, **_shapes(model), config=model.config)
    # Disjoint from the evaluation window: start in the middle of the text (or after the window).
    start = max(len(text) // 2, eval_chars)
    ids = torch.tensor(_common.encode(tok, text[start:])[: args.calib_tokens])
    if ids.numel() < 16:
        ids = torch.tensor(_common.encode(tok, text)[: args.calib_tokens])
    t0 = time.perf_counter()
    calib = kvcompile.calibrate(model, [ids], max_length=min(2048, args.tokens), chunk_size=args.chunk)
    print(f"calibrated on {ids.numel()} tokens from character {start} in {time.perf_counter() - t0:.1f} s")
    if args.save_calibration:
        kvcompile.save_calibration(calib, args.save_calibration)
        print(f"saved calibration to {args.save_calibration}")
    return calib


def _shapes(model):
    from kvcompile.hf import layer_shapes as _layer_shapes

    L, H, D = _layer_shapes(model.config)
    return dict(num_layers=L, num_kv_heads=H, head_dim=D)


def _bytes_per_element(name: str, model) -> float:
    opts = _common.VARIANTS[name]
    if opts is None:
        return float(next(model.parameters()).element_size())
    if "round" in opts:
        return float(torch.empty((), dtype=opts["round"]).element_size())
    from kvcompile import formats

    from kvcompile.hf import per_layer_shapes

    k, v = formats.resolve_kv_dtypes(opts.get("kv_dtype"), opts.get("k_dtype"), opts.get("v_dtype"))
    g = opts.get("granularity")
    kf, vf = formats.get_format(k, g), formats.get_format(v, g)
    # weighted by each layer's elements where the layers differ (a layer without K/V of its own: none)
    shapes = [s for s in per_layer_shapes(model.config) if s is not None]
    total = sum(h * d for h, d in shapes)
    return sum(h * d * (kf.bytes_per_element(d) + vf.bytes_per_element(d)) / 2 for h, d in shapes) / total


def run(model, tok, text: str, *, tokens=2048, chunk=512, new_tokens=128, prompts=PROMPTS, variants=None,
        calibration=None, progress=True, out=print) -> list[dict]:
    variants = list(variants or _common.DEFAULT_VARIANTS)
    unknown = [v for v in variants if v not in _common.VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(_common.VARIANTS)}")
    if "full" in variants:
        variants.remove("full")
    variants.insert(0, "full")  # the reference runs first
    device = next(model.parameters()).device
    kwarg = _common.cache_kwarg(model)
    all_ids = _common.encode(tok, text)
    if len(all_ids) < tokens + 1:
        raise SystemExit(f"the text has {len(all_ids)} tokens; need more than --tokens={tokens}")
    ids = torch.tensor([all_ids[:tokens]], device=device)

    # 1. the text: KL, top-1, perplexity (all variants in lockstep, one chunk at a time)
    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=len(variants) * tokens, unit="tok", desc="text (all variants in lockstep)", dynamic_ncols=True)
    caches = {name: _common.variant_cache(name, model, tokens, device, calibration) for name in variants}
    t0 = time.perf_counter()
    stats = evaluate(model, caches, ids, chunk, kwarg, pbar)
    del caches
    if pbar is not None:
        pbar.close()
    t_text = time.perf_counter() - t0
    rows = []
    for name in variants:
        st = stats[name]
        rows.append({"variant": name, "ppl": _common.ppl_from_nll(st["nll"], st["n"]), "tokens": st["n"],
                     "kl": st["kl"] / max(st["n"], 1), "next_top1": st["top1"] / max(st["n"], 1),
                     "bytes_per_element": _bytes_per_element(name, model)})
    base = rows[0]["ppl"]
    for r in rows:
        r["delta_pct"] = 100.0 * (r["ppl"] / base - 1.0)
    out(f"{len(variants)} variants: {tokens} tokens of text in {t_text:.0f} s")
    out(format_table(rows, 0))

    # 2. free-running greedy generation from the prompts (one left-padded batch per variant)
    t_greedy = 0.0
    if new_tokens and prompts:
        p_ids, p_am = prompt_batch(tok, prompts, device)
        max_len = p_ids.shape[1] + new_tokens
        t0 = time.perf_counter()
        ref = None
        it = rows
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(rows, desc=f"greedy ({len(prompts)} prompts x {new_tokens} tokens)", unit="variant",
                      dynamic_ncols=True)
        for r in it:
            cache = _common.variant_cache(r["variant"], model, max_len, device, calibration, batch=len(prompts))
            gen = greedy(model, cache, p_ids, p_am, new_tokens, kwarg)
            ref = gen if ref is None else ref
            agree = first_departure(gen, ref)
            r.update(greedy_agree=agree, greedy_median=statistics.median(agree), greedy_worst=min(agree),
                     greedy_kept=sum(a == new_tokens for a in agree), greedy_prompts=len(agree))
            out(f"greedy {r['variant']}: tokens before the first departure per prompt {agree}")
        t_greedy = time.perf_counter() - t0
        out(f"{len(prompts)} prompts x {new_tokens} greedy tokens in {t_greedy:.0f} s")
        out(format_table(rows, new_tokens))
    return rows


def format_table(rows, new_tokens) -> str:
    n = rows[0]["tokens"] if rows else 0
    head = (f"| variant | bytes/elem | KL vs full (1e-3 nats) | top-1 = full ({n} tok) | ppl | Δ ppl vs full |")
    sep = "|---|---:|---:|---:|---:|---:|"
    if new_tokens:
        P = rows[0]["greedy_prompts"]
        head += f" greedy: median tokens before departure ({P} prompts, of {new_tokens}) | worst | prompts kept {new_tokens}/{new_tokens} |"
        sep += "---:|---:|---:|"
    lines = [head, sep]
    for r in rows:
        line = (f"| {r['variant']} | {r['bytes_per_element']:.3f} | {1e3 * r['kl']:.3f} | {100 * r['next_top1']:.2f}% | "
                f"{r['ppl']:.4f} | {r['delta_pct']:+.2f}% |")
        if new_tokens:
            line += f" {r['greedy_median']:g} | {r['greedy_worst']} | {r['greedy_kept']}/{r['greedy_prompts']} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None, model=None, tok=None) -> list[dict]:
    args = parse_args(argv)
    model, tok, device, text = _common.model_and_text(args, model, tok)
    needs_calib = any(_common.VARIANTS.get(v) and _common.VARIANTS[v].get("calib") for v in args.variants)
    calib = None
    if needs_calib:
        eval_chars = len(tok.decode(_common.encode(tok, text[: 8 * args.tokens])[: args.tokens]))
        calib = _calibration(args, model, tok, text, eval_chars, device)
    print(f"model: {getattr(model.config, '_name_or_path', '') or type(model).__name__}  "
          f"weights: {next(model.parameters()).dtype}  device: {device}  text: {args.text or _common.DEFAULT_TEXT}  "
          f"tokens: {args.tokens}  chunk: {args.chunk}")
    rows = run(model, tok, text, tokens=args.tokens, chunk=args.chunk, new_tokens=args.new_tokens,
               prompts=PROMPTS[: args.prompts], variants=args.variants, calibration=calib,
               progress=not args.no_progress)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(format_table(rows, args.new_tokens if args.prompts else 0) + "\n")
    return rows


if __name__ == "__main__":
    main()

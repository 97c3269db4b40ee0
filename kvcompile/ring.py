"""Sliding-window layers stored as a ring: ``W`` slots hold the last ``W`` positions.

A layer whose attention window ``W`` is shorter than ``max_cache_len`` never reads a key more than
``W - 1`` positions behind its query, so it stores position ``p`` in slot ``p % W`` and its memory
is ``W`` positions whatever the context (transformers' sliding layers keep the window too). The
ops over a ring are composed here from the plain ops' implementations (:mod:`kvcompile.dispatch`;
:mod:`kvcompile.ops` registers both),
so they run the same Triton kernels or reference code; what this module adds is which slot holds
which position, in device tensors only (no host read: a CUDA graph replays the decode step):

* decode (one new token at position ``c``): the token goes to slot ``c % W``; the ring then holds
  exactly the window ``(c - W, c]`` in slots ``[0, min(c + 1, W))``, and attention over those
  slots is attention over the window (softmax does not care about order). A mask over absolute
  positions is permuted into slot order;
* a chunk of ``T > 1`` tokens at ``[c, c + T)`` (prefill, chunked prefill, verification): its
  first query still needs keys back to ``c - W + 1``, which the chunk's own tail may overwrite. So
  the chunk attends over a temporary linear cache of ``W - 1 + T`` positions (the ring's last
  ``W - 1`` positions, gathered, then the chunk quantized behind them) and only then is the
  chunk's tail written into the ring. Positions below 0 in that temporary (a ring not yet full)
  are masked.

Positions are absolute everywhere outside this module: masks span ``max_cache_len`` keys and the
eager :func:`dequantize` returns ``max_cache_len`` positions (zeros outside the window), so
transformers' own masks apply unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch, reference
from .buffers import v_codes_buffer
from .reference import _as_bytes, _write

__all__ = ["store_kv", "dequantize", "attention"]


def _keys_contiguous(v_codes: Tensor) -> bool:
    return v_codes.shape[2] > 1 and v_codes.stride(2) == 1


def _scratch(codes: Tensor, scale: Tensor, n: int, keys: bool) -> tuple[Tensor, Tensor]:
    """Zeroed codes ``[B, H, n, D]`` (key-contiguous when ``keys``) and scales like ``scale`` for n positions."""
    B, H, _, D = codes.shape
    c = v_codes_buffer((B, H, n, D), codes.dtype, codes.device, keys)
    if scale.dim() == 1:  # static: per head, read only
        return c, scale
    return c, scale.new_zeros((B, H, n, scale.shape[-1]))


def _put(codes: Tensor, scale: Tensor, slots: Tensor, src_codes: Tensor, src_scale: Tensor) -> None:
    """``codes[:, :, slots] = src_codes`` (and the scales, unless static: per head, not per position)."""
    _write(codes, scale, src_codes, None if scale.dim() == 1 else src_scale, slots)


def _gather(src: Tensor, slots: Tensor, dst: Tensor) -> None:
    """``dst[:, :, :len(slots)] = src[:, :, slots]`` (static scales are not per position)."""
    if src.dim() == 1:
        return
    _as_bytes(dst)[:, :, : slots.numel()].copy_(_as_bytes(src).index_select(2, slots))


def store_kv(k_cache: Tensor, k_scale: Tensor, v_cache: Tensor, v_scale: Tensor, k: Tensor, v: Tensor,
             start: Tensor, k_offset: Optional[Tensor], k_rotation: Optional[Tensor] = None,
             v_rotation: Optional[Tensor] = None, *, k_fmt, v_fmt) -> None:
    """``kvcompile::store_kv`` into a ring of ``W = k_cache.shape[2]`` slots: position ``start + t``
    goes to slot ``(start + t) % W``; of a chunk longer than the ring only the last ``W`` tokens stay."""
    W, T = k_cache.shape[2], k.shape[2]
    if T == 1:
        _store_token(k_cache, k_scale, v_cache, v_scale, k, v, start, 0, k_offset, k_rotation, v_rotation,
                     k_fmt, v_fmt)
        return
    n = min(T, W)  # quantization is per token: the tail alone gives the tail's codes
    tk, tks = _scratch(k_cache, k_scale, n, False)
    tv, tvs = _scratch(v_cache, v_scale, n, _keys_contiguous(v_cache))
    zero = torch.zeros((), dtype=torch.long, device=k.device)
    dispatch.store_kv(tk, tks, tv, tvs, k[:, :, T - n:], v[:, :, T - n:], zero, k_offset, k_rotation, v_rotation,
                      k_fmt=k_fmt, v_fmt=v_fmt)
    slots = torch.remainder(start.to(torch.long) + (T - n) + torch.arange(n, device=k.device), W)
    _put(k_cache, k_scale, slots, tk, tks)
    _put(v_cache, v_scale, slots, tv, tvs)


def _store_token(k_cache, k_scale, v_cache, v_scale, k, v, start: Tensor, shift: int, k_offset, k_rotation,
                 v_rotation, k_fmt, v_fmt) -> None:
    """One token at position ``start + shift`` into slot ``(start + shift) % W``: on the Triton path the
    store kernel takes the slot itself (no extra launch, no bound to assert: every slot is in range)."""
    W = k_cache.shape[2]
    if dispatch.kernel_backend(k.device) == "triton":
        dispatch.launchers().store_kv(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation, v_rotation,
                                shift=shift, ring=W, k_fmt=k_fmt, v_fmt=v_fmt)
    else:
        reference.store_kv(k_cache, k_scale, v_cache, v_scale, k, v, torch.remainder(start + shift, W),
                           k_offset, k_rotation, v_rotation, k_fmt=k_fmt, v_fmt=v_fmt)


def dequantize(codes: Tensor, scale: Tensor, offset: Optional[Tensor], start: Tensor, dtype: torch.dtype,
               rotation: Optional[Tensor], new: Tensor, length: int, *, fmt) -> Tensor:
    """The values attention over a ring reads when ``new`` ([B, H, T, D]) joins at ``start``:
    ``[B, H, length, D]`` in absolute positions, the ring's positions ``[start - W + 1, start)`` (read
    before the chunk is stored), the chunk at ``[start, start + T)`` quantized as the store quantizes
    it, zeros elsewhere."""
    B, H, W, D = codes.shape
    T, dev = new.shape[2], codes.device
    ring = dispatch.dequantize(codes, scale, offset, torch.full((), W, device=dev), dtype, rotation, fmt=fmt)
    tc, ts = _scratch(codes, scale, T, False)
    tc2, ts2 = _scratch(codes, scale, T, False)
    zero = torch.zeros((), dtype=torch.long, device=dev)
    # the K side is the one used
    dispatch.store_kv(tc, ts, tc2, ts2, new, new, zero, offset, rotation, rotation, k_fmt=fmt, v_fmt=fmt)
    chunk = dispatch.dequantize(tc, ts, offset, torch.full((), T, device=dev), dtype, rotation, fmt=fmt)
    src = torch.cat((ring, chunk, ring.new_zeros((B, H, 1, D))), dim=2)  # slot W + T: a zero row
    c = start.to(device=dev, dtype=torch.long)
    pos = torch.arange(length, device=dev)
    old = (pos > c - W) & (pos < c)
    fresh = (pos >= c) & (pos < c + T)
    index = torch.where(fresh, W + pos - c, torch.where(old, torch.remainder(pos, W), W + T))
    return src.index_select(2, index)


def _mask_columns(mask: Optional[Tensor], positions: Tensor) -> Optional[Tensor]:
    """The columns of a mask over absolute key positions at ``positions`` (clamped into range)."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask.index_select(-1, positions.clamp(0, mask.shape[-1] - 1))


def _hide(mask: Optional[Tensor], keep: Tensor) -> Tensor:
    """``mask`` with the keys where ``keep`` ([.., N] bool) is False hidden; bool or additive."""
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, float("-inf"))


def attention(q: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor, cache_len: Tensor,
              k: Tensor, v: Tensor, k_offset: Optional[Tensor], kv_len: Optional[Tensor],
              attn_mask: Optional[Tensor], is_causal: bool, scale: Optional[float], softcap: float = 0.0,
              sinks: Optional[Tensor] = None, k_rotation: Optional[Tensor] = None,
              v_rotation: Optional[Tensor] = None, *, k_fmt, v_fmt) -> Tensor:
    """Store ``k, v`` (the chunk at ``[cache_len - T, cache_len)``) into the ring, then attention as
    ``kvcompile::attention`` over absolute positions with window ``W`` (the ring's size) and
    ``kv_len`` (``cache_len`` when None) as the bound on the keys (module docstring)."""
    W, T, Tq, dev = k_q.shape[2], k.shape[2], q.shape[2], q.device
    cache_len = cache_len.to(device=dev, dtype=torch.long)
    if T == 1 and Tq == 1:  # decode: the token's store, then attention over the ring's slots
        mask = attn_mask
        if (attn_mask is not None and attn_mask.shape[-1] != 1) or kv_len is not None:
            # slot s holds the latest position p <= c (the token's) with p = s (mod W)
            c = cache_len - 1
            pos = c - torch.remainder(c - torch.arange(W, device=dev), W)
            mask = _mask_columns(attn_mask, pos)
            if kv_len is not None:
                mask = _hide(mask, (pos < kv_len.to(dev).reshape(-1, 1, 1, 1)))
        # the token count as the key bound: past W every slot holds a key (the op reads at most its L = W)
        if dispatch.kernel_backend(dev) == "triton":  # the kernels store the token at slot (cache_len - 1) % W
            # themselves (in the attention kernel where the plan fits it: no store launch)
            return dispatch.launchers().attention(q, k_q, k_scale, v_q, v_scale, cache_len, mask, False, scale, 0, softcap,
                                                  sinks, k_rotation, v_rotation, new_token=(k, v, k_offset),
                                                  k_fmt=k_fmt, v_fmt=v_fmt)
        _store_token(k_q, k_scale, v_q, v_scale, k, v, cache_len, -1, k_offset, k_rotation, v_rotation, k_fmt, v_fmt)
        return dispatch.attention(q, k_q, k_scale, v_q, v_scale, cache_len, mask, False, scale, 0, softcap, sinks,
                                  k_rotation, v_rotation, k_fmt=k_fmt, v_fmt=v_fmt)
    n = W - 1 + T  # the ring's last W - 1 positions, then the chunk
    tk, tks = _scratch(k_q, k_scale, n, False)
    tv, tvs = _scratch(v_q, v_scale, n, _keys_contiguous(v_q))
    base = cache_len - T - (W - 1)  # the position of scratch slot 0 (negative while the ring is not full)
    slots = torch.remainder(base + torch.arange(W - 1, device=dev), W)
    for src, dst in ((k_q, tk), (k_scale, tks), (v_q, tv), (v_scale, tvs)):
        _gather(src, slots, dst)
    dispatch.store_kv(tk, tks, tv, tvs, k, v, torch.full((), W - 1, dtype=torch.long, device=dev), k_offset,
                      k_rotation, v_rotation, k_fmt=k_fmt, v_fmt=v_fmt)
    pos = base + torch.arange(n, device=dev)
    mask = _hide(_mask_columns(attn_mask, pos), (pos >= 0).view(1, 1, 1, n))
    bound = torch.full((), n, dtype=torch.long, device=dev) if kv_len is None else \
        torch.clamp(kv_len.to(device=dev, dtype=torch.long) - base, 0, n)
    out = dispatch.attention(q, tk, tks, tv, tvs, bound, mask, is_causal, scale, W, softcap, sinks, k_rotation,
                             v_rotation, k_fmt=k_fmt, v_fmt=v_fmt)
    m = min(T, W)
    ring_slots = torch.remainder(cache_len - m + torch.arange(m, device=dev), W)
    tail = lambda t: t if t.dim() == 1 else t[:, :, n - m:]  # noqa: E731  (static scales: per head)
    _put(k_q, k_scale, ring_slots, tail(tk), tail(tks))
    _put(v_q, v_scale, ring_slots, tail(tv), tail(tvs))
    return out

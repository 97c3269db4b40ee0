"""Pure-torch reference implementations of the kvcompile ops.

Used as the CPU fallback (``KVCOMPILE_KERNELS=reference`` or ``auto`` off CUDA) and by the
tests as the oracle the Triton kernels must match. Math in float32; the quantization is
the bit-exact definition in :mod:`kvcompile.formats`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import formats


def _as_bytes(t: Tensor) -> Tensor:
    # index_copy_ has no float8 kernel on every device; moving raw bytes is exact.
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _store_one(cache: Tensor, scale: Tensor, x: Tensor, pos: Tensor, offset: Optional[Tensor],
               rotation: Optional[Tensor]) -> None:
    if rotation is not None:
        x = torch.matmul(x.float(), rotation)  # float32, as the Triton launcher does
    if offset is not None:
        x = x.float() - offset.float().view(1, offset.shape[0], 1, offset.shape[1])
    if scale.dim() == 1:
        codes, _ = formats.quantize(x, cache.dtype, scale=scale)
    else:
        kv_dtype = formats.format_of(cache, scale)
        codes, s = formats.quantize(x, cache.dtype, groups=scale.shape[-1], kv_dtype=kv_dtype)
        scale.index_copy_(2, pos, s.to(scale.dtype))
    _as_bytes(cache).index_copy_(2, pos, _as_bytes(codes))


def store_kv(
    k_cache: Tensor,
    k_scale: Tensor,
    v_cache: Tensor,
    v_scale: Tensor,
    k: Tensor,
    v: Tensor,
    start: Tensor,
    k_offset: Optional[Tensor],
    k_rotation: Optional[Tensor] = None,
    v_rotation: Optional[Tensor] = None,
) -> None:
    pos = torch.arange(k.shape[2], device=k.device) + start.to(device=k.device, dtype=torch.long)
    _store_one(k_cache, k_scale, k, pos, k_offset, k_rotation)
    _store_one(v_cache, v_scale, v, pos, None, v_rotation)


def _valid_positions(kv_len: Tensor, batch: int, length: int, device) -> Tensor:
    """[B, 1, 1, L] bool: position < kv_len[b]."""
    kvl = kv_len.to(device=device, dtype=torch.long).reshape(-1)
    kvl = kvl.expand(batch) if kvl.numel() == 1 else kvl
    return torch.arange(length, device=device).view(1, 1, 1, -1) < kvl.view(-1, 1, 1, 1)


def dequantize(
    codes: Tensor, scale: Tensor, offset: Optional[Tensor], kv_len: Tensor, dtype: torch.dtype,
    rotation: Optional[Tensor] = None,
) -> Tensor:
    x = formats.dequantize(codes, scale, torch.float32)
    if offset is not None:
        x = x + offset.float().view(1, offset.shape[0], 1, offset.shape[1])
    B, _, L, _ = codes.shape
    x = torch.where(_valid_positions(kv_len, B, L, codes.device).transpose(-1, -2), x, torch.zeros((), device=x.device))
    if rotation is not None:  # back from the rotated space: x @ R^T, float32 (zeros stay zeros)
        x = torch.matmul(x.contiguous(), rotation.t())
    return x.to(dtype).contiguous()  # contiguous, as the fake kernel says, whatever the strides of codes


def _lengths(kv_len: Tensor, batch: int) -> list[int]:
    """kv_len ([] or [B]) as B Python ints (a host read: the reference op is opaque to the compiler)."""
    lens = [int(x) for x in kv_len.reshape(-1).tolist()]
    if len(lens) == 1:
        return lens * batch
    if len(lens) != batch:
        raise ValueError(f"kvcompile: kv_len must be [] or [B={batch}], got shape {tuple(kv_len.shape)}")
    return lens


def _dequantize_in(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`formats.dequantize` (fp32 products, the stored values) in fp32; in float64 the exact
    products codes * scale (an fp32 product of an int8 code and an fp32 scale may round)."""
    if dtype == torch.float32:
        return formats.dequantize(codes, scale, dtype)
    c, s = codes.to(dtype), scale.to(dtype)
    if s.dim() == 1:
        return c * s.view(1, -1, 1, 1)
    return (c.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)


def _key_slice(t: Tensor, lo: int, hi: int) -> Tensor:
    """Positions [lo, hi) of codes / scales [B, H, L, *]; a static scale ([Hkv]) as it is."""
    return t if t.dim() == 1 else t[:, :, lo:hi]


def attention(
    q: Tensor,
    k_q: Tensor,
    k_scale: Tensor,
    v_q: Tensor,
    v_scale: Tensor,
    kv_len: Tensor,
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
    k_rotation: Optional[Tensor] = None,
    v_rotation: Optional[Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Reference attention (see :func:`kvcompile.ops.attention` for the contract).

    q [B, Hq, Tq, D] over codes [B, Hkv, L, D] -> [B, Hq, Tq, D] in q.dtype. Pays for what is
    stored: it reads ``kv_len`` on the host and dequantizes only keys ``[lo, n)``, ``n`` the
    longest stored length and ``lo`` the first key any query's window can see (0 without a
    window), so its cost does not depend on ``max_cache_len``. GQA without repeating K/V: the
    ``Hq // Hkv`` query heads of one kv head are rows of one matmul against that head's keys.
    ``compute_dtype=torch.float64`` gives the oracle the tests compare kernels against.
    """
    B, Hq, Tq, D = q.shape
    Hkv, L = k_q.shape[1], k_q.shape[2]
    group = Hq // Hkv
    lens = _lengths(kv_len, B)
    n = min(max(lens), L)  # keys past the longest stored length are never visible
    # the first key any query can see: query 0 of the shortest row sits at min(lens) - Tq
    lo = min(max(min(lens) - Tq - sliding_window + 1, 0), n) if sliding_window > 0 else 0
    if n <= lo or Tq == 0:
        return torch.zeros(B, Hq, Tq, D, dtype=q.dtype, device=q.device)
    k = _dequantize_in(_key_slice(k_q, lo, n), _key_slice(k_scale, lo, n), compute_dtype)  # [B, Hkv, n', D]
    v = _dequantize_in(_key_slice(v_q, lo, n), _key_slice(v_scale, lo, n), compute_dtype)
    sm_scale = D**-0.5 if scale is None else scale
    # query head h = hk * group + g: the group's rows of one kv head, [B, Hkv, group * Tq, D]
    qc = q.to(compute_dtype)
    if k_rotation is not None:  # K's codes hold k @ R_k: (q R_k)(k R_k)^T = q k^T
        qc = torch.matmul(qc, k_rotation.to(compute_dtype))
    qg = qc.reshape(B, Hkv, group * Tq, D)
    s = torch.matmul(qg, k.transpose(-1, -2)).view(B, Hq, Tq, n - lo) * sm_scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap  # on the scaled logits, before the mask

    dev = q.device
    pos = torch.arange(lo, n, device=dev).view(1, 1, 1, -1)
    kvl = torch.tensor(lens, device=dev).view(B, 1, 1, 1)
    q_pos = kvl - Tq + torch.arange(Tq, device=dev).view(1, 1, Tq, 1)  # absolute position of each query
    valid = None  # [B, 1 or Hq, 1 or Tq, n'] where some key of [lo, n) is hidden from some row

    def hide(keep: Tensor) -> None:
        nonlocal valid
        valid = keep if valid is None else valid & keep

    if min(lens) < n:
        hide(pos < kvl)
    if is_causal and Tq > 1:  # a single query sits at kv_len - 1: the length bound says it all
        hide(pos <= q_pos)
    if sliding_window > 0 and max(lens) - sliding_window > lo:  # some row's window starts past lo
        hide(pos > q_pos - sliding_window)
    if attn_mask is not None:
        m = attn_mask if attn_mask.shape[-1] == 1 else attn_mask[..., lo:n]  # its keys [lo, n) (or broadcast)
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
        if m.dtype == torch.bool:
            hide(m)
        else:
            s = s + m.to(compute_dtype)
    if valid is not None:
        s = s.masked_fill(~valid, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    if sinks is not None:  # one more logit per head in the denominator: it joins the max too
        sink = sinks.to(device=dev, dtype=compute_dtype).view(1, Hq, 1, 1)
        row_max = torch.maximum(row_max, torch.where(torch.isneginf(row_max), row_max, sink))
    empty = torch.isneginf(row_max)  # a row with no visible key -> zeros, not NaN
    m_safe = torch.where(empty, torch.zeros_like(row_max), row_max)
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.where(empty, torch.zeros_like(denom), torch.exp(sink - m_safe))
    p = p / torch.where(empty, torch.ones_like(denom), denom)
    o = torch.matmul(p.view(B, Hkv, group * Tq, n - lo), v).view(B, Hq, Tq, D)
    if v_rotation is not None:  # V's codes hold v @ R_v: P (V R_v) R_v^T = P V
        o = torch.matmul(o, v_rotation.to(compute_dtype).t())
    return o.to(q.dtype)

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
    compute_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Reference attention (see :func:`kvcompile.ops.attention` for the contract).

    ``compute_dtype=torch.float64`` gives the oracle the tests compare kernels against.
    """
    B, Hq, Tq, D = q.shape
    Hkv, L = k_q.shape[1], k_q.shape[2]
    group = Hq // Hkv
    k = formats.dequantize(k_q, k_scale, compute_dtype).repeat_interleave(group, dim=1)
    v = formats.dequantize(v_q, v_scale, compute_dtype).repeat_interleave(group, dim=1)
    sm_scale = D**-0.5 if scale is None else scale
    s = torch.matmul(q.to(compute_dtype), k.transpose(-1, -2)) * sm_scale  # [B, Hq, Tq, L]

    valid = _valid_positions(kv_len, B, L, q.device)  # [B, 1, 1, L]
    if is_causal:
        kvl = kv_len.to(device=q.device, dtype=torch.long).reshape(-1).expand(B) if kv_len.numel() == 1 \
            else kv_len.to(device=q.device, dtype=torch.long)
        q_pos = kvl.view(-1, 1, 1, 1) - Tq + torch.arange(Tq, device=q.device).view(1, 1, -1, 1)
        valid = valid & (torch.arange(L, device=q.device).view(1, 1, 1, -1) <= q_pos)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            valid = valid & attn_mask
        else:
            s = s + attn_mask.to(compute_dtype)
    s = s.masked_fill(~valid, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(row_max)  # a row with no visible key -> zeros, not NaN
    p = torch.exp(s - torch.where(empty, torch.zeros_like(row_max), row_max))
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(empty, torch.ones_like(denom), denom)
    out = torch.matmul(p, v)
    return out.to(q.dtype)

"""Pure-torch reference implementations of the kvcompile ops.

Used as the CPU fallback (``KVCOMPILE_KERNELS=reference`` or ``auto`` off CUDA) and by the
tests as the oracle the Triton kernels must match. Math in float32; the quantization is
the bit-exact definition in :mod:`kvcompile.formats`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import formats


def _as_bytes(t: Tensor) -> Tensor:
    # index_copy_ has no float8 kernel on every device; moving raw bytes is exact.
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _f32(t: Tensor) -> Tensor:
    # the CPU op runs once per layer and step: even a no-op .float() call is worth skipping
    return t if t.dtype == torch.float32 else t.float()


def _per_head(offset: Tensor) -> Tensor:
    """A K offset [H, D] as float32 [H, 1, D]: it broadcasts over [..., H, T, D]."""
    return _f32(offset).view(offset.shape[0], 1, offset.shape[1])


def _rotate_center(x: Tensor, offset: Optional[Tensor], rotation: Optional[Tensor]) -> Tensor:
    """``x @ R - offset`` in float32 (each step only when given)."""
    x = _f32(x)
    if rotation is not None:
        x = torch.matmul(x, rotation)  # float32, as the Triton launcher does
    if offset is not None:
        x = x - _per_head(offset)
    return x


def _quantize_as(fmt: formats.KVFormat, scale: Tensor, x: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """(codes, scales, or None for static ones) of ``x`` [..., D] in format ``fmt`` (``scale``: the
    static scales it reads)."""
    if fmt.is_static:
        return formats.quantize(x, fmt.code_dtype, scale=scale, kv_dtype=fmt.kv_dtype)[0], None
    codes, s = formats.quantize(x, fmt.code_dtype, groups=fmt.groups(x.shape[-1]), kv_dtype=fmt.kv_dtype)
    return codes, s if s.dtype == scale.dtype else s.to(scale.dtype)


def _write(cache: Tensor, scale: Tensor, codes: Tensor, s: Optional[Tensor], where) -> None:
    """Codes (and scales) into positions ``where``: a slice (CPU) or an index tensor."""
    if isinstance(where, slice):  # narrow + copy_: a third of a Python slice assignment's cost
        _as_bytes(cache).narrow(2, where.start, where.stop - where.start).copy_(_as_bytes(codes))
        if s is not None:
            scale.narrow(2, where.start, where.stop - where.start).copy_(s)
        return
    _as_bytes(cache).index_copy_(2, where, _as_bytes(codes))
    if s is not None:
        scale.index_copy_(2, where, s)


def _one_format(k_fmt: formats.KVFormat, v_fmt: formats.KVFormat, k: Tensor, v: Tensor) -> bool:
    """Whether K and V are stored in one format (once rotated, each by its own matrix, they can be
    quantized as one tensor). Static scales never are (K's and V's scales differ)."""
    return k_fmt == v_fmt and not k_fmt.is_static and k.shape == v.shape


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
    *,
    k_fmt: formats.KVFormat,
    v_fmt: formats.KVFormat,
) -> None:
    T = k.shape[2]
    if k.device.type == "cpu":  # the host read is free: a slice instead of an index tensor
        s0 = int(start)
        where = slice(s0, s0 + T)
    else:
        where = torch.arange(T, device=k.device) + start.to(device=k.device, dtype=torch.long)
    if _one_format(k_fmt, v_fmt, k, v):
        # K and V quantized as one [2, B, H, T, D] tensor: half the ops, the same values
        if k_rotation is not None and k_rotation is v_rotation:  # one matrix: one product for both
            x = _rotate_center(torch.stack((k, v)), None, k_rotation)
            if k_offset is not None:
                x[0] -= _per_head(k_offset)  # K only
        else:
            x = torch.stack((_rotate_center(k, k_offset, k_rotation), _rotate_center(v, None, v_rotation)))
        codes, s = _quantize_as(k_fmt, k_scale, x)
        _write(k_cache, k_scale, codes[0], None if s is None else s[0], where)
        _write(v_cache, v_scale, codes[1], None if s is None else s[1], where)
        return
    for fmt, cache, scale, x, off, rot in ((k_fmt, k_cache, k_scale, k, k_offset, k_rotation),
                                           (v_fmt, v_cache, v_scale, v, None, v_rotation)):
        codes, s = _quantize_as(fmt, scale, _rotate_center(x, off, rot))
        _write(cache, scale, codes, s, where)


def _valid_positions(kv_len: Tensor, batch: int, length: int, device) -> Tensor:
    """[B, 1, 1, L] bool: position < kv_len[b]."""
    kvl = kv_len.to(device=device, dtype=torch.long).reshape(-1)
    kvl = kvl.expand(batch) if kvl.numel() == 1 else kvl
    return torch.arange(length, device=device).view(1, 1, 1, -1) < kvl.view(-1, 1, 1, 1)


def dequantize(
    codes: Tensor, scale: Tensor, offset: Optional[Tensor], kv_len: Tensor, dtype: torch.dtype,
    rotation: Optional[Tensor] = None,
    *,
    fmt: formats.KVFormat,
) -> Tensor:
    """codes in ``fmt`` -> values (the reference reads ``code * scale`` for every registered format)."""
    x = formats.dequantize(codes, scale, torch.float32)
    if offset is not None:
        x = x + _per_head(offset)
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


def key_range(kv_len: Tensor, batch: int, length: int, tq: int, sliding_window: int) -> tuple[list[int], int, int]:
    """(the B stored lengths, ``lo``, ``n``): keys ``[lo, n)`` are the only ones any of ``tq`` queries
    can see, ``n`` the longest stored length within the ``length`` positions and ``lo`` the first key
    a window lets through (0 without one). A host read of ``kv_len``."""
    lens = _lengths(kv_len, batch)
    n = min(max(lens), length)  # keys past the longest stored length are never visible
    # the first key any query can see: query 0 of the shortest row sits at min(lens) - tq
    lo = min(max(min(lens) - tq - sliding_window + 1, 0), n) if sliding_window > 0 else 0
    return lens, lo, n


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
    return t if t.dim() == 1 else t.narrow(2, lo, hi - lo)


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
    *,
    k_fmt: formats.KVFormat,
    v_fmt: formats.KVFormat,
) -> Tensor:
    """Reference attention (see :func:`kvcompile.ops._attention` for the contract), K in ``k_fmt``,
    V in ``v_fmt`` (the reference reads ``code * scale`` for every registered format).

    q [B, Hq, Tq, D] over codes [B, Hkv, L, D] -> [B, Hq, Tq, D] in q.dtype. Pays for what is
    stored: it reads ``kv_len`` on the host and dequantizes only keys ``[lo, n)``, ``n`` the
    longest stored length and ``lo`` the first key any query's window can see (0 without a
    window), so its cost does not depend on ``max_cache_len``. GQA without repeating K/V. In
    float32 without softcap, sinks or an additive mask (the CPU's everyday call) it is one SDPA
    call with the visibility as its bool mask; otherwise the softmax is written out
    (:func:`_explicit_softmax`). ``compute_dtype=torch.float64`` gives the oracle the tests
    compare kernels against (always written out).
    """
    B, Hq, Tq, D = q.shape
    Hkv = k_q.shape[1]
    group = Hq // Hkv
    lens, lo, n = key_range(kv_len, B, k_q.shape[2], Tq, sliding_window)
    if n <= lo or Tq == 0:
        return torch.zeros(B, Hq, Tq, D, dtype=q.dtype, device=q.device)
    k = _dequantize_in(_key_slice(k_q, lo, n), _key_slice(k_scale, lo, n), compute_dtype)  # [B, Hkv, n', D]
    v = _dequantize_in(_key_slice(v_q, lo, n), _key_slice(v_scale, lo, n), compute_dtype)
    sm_scale = D**-0.5 if scale is None else scale
    qc = q if q.dtype == compute_dtype else q.to(compute_dtype)  # (a no-op .to() still costs a call)
    if k_rotation is not None:  # K's codes hold k @ R_k: (q R_k)(k R_k)^T = q k^T
        qc = torch.matmul(qc, k_rotation if k_rotation.dtype == compute_dtype else k_rotation.to(compute_dtype))

    valid, additive = _visibility(lens, lo, n, Tq, is_causal, sliding_window, attn_mask, q.device, compute_dtype)

    if compute_dtype == torch.float32 and softcap == 0 and sinks is None and additive is None:
        o, careful = _sdpa(qc, k, v, valid, sm_scale, group)
    else:
        o = _explicit_softmax(qc, k, v, valid, additive, sm_scale, softcap, sinks, group)
        # P.V multiplies a hidden key's NaN value by its 0 weight: a masked call whose output holds a NaN
        # or an Inf (one sum, a host read) is done again, those values kept to the rows that see them
        careful = (valid is not None or additive is not None) and not math.isfinite(float(o.sum()))
    if careful:  # the rare call with a non-finite value: written out, the policy exactly (README)
        o = _explicit_softmax(qc, k, v, valid, additive, sm_scale, softcap, sinks, group, nonfinite=True)
    if v_rotation is not None:  # V's codes hold v @ R_v: P (V R_v) R_v^T = P V
        o = torch.matmul(o, v_rotation.to(compute_dtype).t())
    return o if o.dtype == q.dtype else o.to(q.dtype)


def _visibility(lens: list, lo: int, n: int, Tq: int, is_causal: bool, sliding_window: int,
                attn_mask: Optional[Tensor], dev: torch.device, compute_dtype: torch.dtype
                ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Which of keys ``[lo, n)`` each query row sees: ``valid`` [B, 1 or Hq, 1 or Tq, n'] (None where
    every row sees every key) from the stored lengths, causality, the window and a bool mask, and an
    additive mask's keys [lo, n) in ``compute_dtype`` (None without one)."""
    valid = None

    def hide(keep: Tensor) -> None:
        nonlocal valid
        valid = keep if valid is None else valid & keep

    hide_len = min(lens) < n
    hide_causal = is_causal and Tq > 1  # a single query sits at kv_len - 1: the length bound says it all
    hide_window = sliding_window > 0 and max(lens) - sliding_window > lo  # some row's window starts past lo
    if hide_len or hide_causal or hide_window:
        pos = torch.arange(lo, n, device=dev).view(1, 1, 1, -1)
        kvl = torch.tensor(lens, device=dev).view(len(lens), 1, 1, 1)
        q_pos = kvl - Tq + torch.arange(Tq, device=dev).view(1, 1, Tq, 1)  # absolute position of each query
        if hide_len:
            hide(pos < kvl)
        if hide_causal:
            hide(pos <= q_pos)
        if hide_window:
            hide(pos > q_pos - sliding_window)
    additive = None
    if attn_mask is not None:
        m = attn_mask if attn_mask.shape[-1] == 1 else attn_mask[..., lo:n]  # its keys [lo, n) (or broadcast)
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
        if m.dtype == torch.bool:
            hide(m)
        else:
            additive = m.to(compute_dtype)
    return valid, additive


def _sdpa(qc: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], sm_scale: float, group: int
          ) -> tuple[Tensor, bool]:
    """The CPU's common case in a few ops: one fused SDPA call (grouped-query, the visibility as its bool
    mask); a row with no visible key gives NaN there and zeros here. Contiguous operands: the CPU's fused
    kernel needs unit stride along head_dim (key-contiguous V codes dequantize to keys-contiguous values),
    else SDPA falls back to its math path (SmolLM2 decode, 2 cores: 315 -> <100 us per call).

    Also whether the output may break the non-finite policy (README), then :func:`_explicit_softmax` redoes
    it: SDPA on the CPU gives zeros for a row whose every score is NaN (a NaN in every key: an Inf bias made
    NaN by RoPE), and its bool mask, added as -inf, keeps a hidden key's NaN score (as 0 x NaN keeps a hidden
    NaN value). So: a row that sees a key and is all zeros or holds a NaN (one host read). Unmasked (a decode
    step), every row sees a key: any zero or NaN output value (|o|'s min, +3 us on SmolLM2's decode shape)."""
    o = F.scaled_dot_product_attention(qc.contiguous(), k.contiguous(), v.contiguous(), attn_mask=valid,
                                       scale=sm_scale, enable_gqa=group > 1)
    if valid is None:
        return o, not float(o.abs().amin()) > 0
    has_key = valid.any(dim=-1, keepdim=True)
    row_max = torch.where(has_key, o.abs().amax(dim=-1, keepdim=True), 1.0)  # 0: all zeros, NaN: holds a NaN
    o = torch.where(has_key, o, torch.zeros((), dtype=o.dtype, device=o.device))
    return o, not float(row_max.min()) > 0


def _explicit_softmax(qc: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor], additive: Optional[Tensor],
                      sm_scale: float, softcap: float, sinks: Optional[Tensor], group: int,
                      nonfinite: bool = False) -> Tensor:
    """Softmax attention written out (float64 oracle, softcap, sinks, additive masks): the query
    heads of one kv head are rows of one matmul against its keys (no repeated K/V).

    ``nonfinite``: a NaN or an Inf in V reaches exactly the rows that see its key (a hidden key's
    value is not multiplied by its 0 weight). A NaN score is hidden by a bool mask (``masked_fill``)."""
    B, Hq, Tq, D = qc.shape
    Hkv, n = k.shape[1], k.shape[2]
    s = torch.matmul(qc.reshape(B, Hkv, group * Tq, D), k.transpose(-1, -2)).view(B, Hq, Tq, n) * sm_scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap  # on the scaled logits, before the mask
    if additive is not None:
        s = s + additive
    if valid is not None:
        s = s.masked_fill(~valid, float("-inf"))
    row_max = s.amax(dim=-1, keepdim=True)
    if sinks is not None:  # one more logit per head in the denominator: it joins the max too
        sink = sinks.to(device=qc.device, dtype=qc.dtype).view(1, Hq, 1, 1)
        row_max = torch.maximum(row_max, torch.where(torch.isneginf(row_max), row_max, sink))
    empty = torch.isneginf(row_max)  # a row with no visible key -> zeros, not NaN
    m_safe = torch.where(empty, torch.zeros_like(row_max), row_max)
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.where(empty, torch.zeros_like(denom), torch.exp(sink - m_safe))
    p = p / torch.where(empty, torch.ones_like(denom), denom)
    p = p.view(B, Hkv, group * Tq, n)
    bad_v = ~torch.isfinite(v) if nonfinite else None
    if bad_v is None or not bad_v.any():
        return torch.matmul(p, v).view(B, Hq, Tq, D)
    # the finite values as they are, and NaN where a row sees (a score above -inf) a non-finite value
    o = torch.matmul(p, torch.where(bad_v, torch.zeros_like(v), v))
    seen = (~torch.isneginf(s)).to(v.dtype).view(B, Hkv, group * Tq, n)
    o = torch.where(torch.matmul(seen, bad_v.to(v.dtype)) > 0, torch.full_like(o, float("nan")), o)
    return o.view(B, Hq, Tq, D)

"""Launcher of ``kvcompile::attention``: picks split-K decode, fused prefill or dense-dequant prefill.

Paths (``KVCOMPILE_PREFILL=auto|fused|dense`` forces the prefill path; read per call):

* ``decode``: q_len <= 16 (decode, speculative verification). Split-K over the cache with a
  number of splits fixed by ``max_cache_len`` and the batch shape (never by the current length:
  graph safe, no host sync); splits past ``kv_len`` exit at once; an LSE merge kernel combines.
* ``fused``: one pass of the fused kernel over the codes, one program per query block.
* ``dense`` (:mod:`kvcompile.kernels.dense`): dequantize the live prefix once, then the best
  SDPA. Needs one host sync, so never used while a CUDA graph is being captured; auto sends
  windowed prefills to the fused kernel, which skips the tiles below the window. SDPA has no
  softcap and no sinks: calls with either always take the fused kernel.

Sliding window, softcap and sinks are constexpr switches of the kernel (``HAS_WINDOW``,
``HAS_SOFTCAP``, ``HAS_SINKS``): off, it compiles to the code it had without them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Optional

import torch
from torch import Tensor

from .. import tiles
from . import _attention_kernel as _k
from ._attention_kernel import _attention_kernel
from ._merge_kernel import _merge_kernel
from . import dense
from .common import device_cc, interpreting, kv_len_arg, next_pow2, sm_count
from .rotate import ROT_CHUNK, rotate_rows
from .store import triton_cdiv

# the kernel's mode constants (tl.constexpr there) as plain ints here
SCALE_TOKEN, SCALE_BLOCK, SCALE_STATIC = (int(c.value) for c in (_k.SCALE_TOKEN, _k.SCALE_BLOCK, _k.SCALE_STATIC))
MASK_NONE, MASK_BOOL, MASK_ADD = (int(c.value) for c in (_k.MASK_NONE, _k.MASK_BOOL, _k.MASK_ADD))

__all__ = ["attention", "decode_splits", "prefill_path", "DECODE_MAX_Q", "DENSE_MIN_Q", "DECODE_WAVES"]

DECODE_MAX_Q = 16  # query blocks up to this length go to the split-K decode kernel
# auto: prefills of at least this many new tokens use the dense-dequant path. H200, 16k prefix
# (BENCHMARKS.md, session 5): the fused kernel is faster up to 2048 (1933 vs 2072 us), dense from
# 4096 (3192 vs 3593 us); 3072 lies between the two measured points.
DENSE_MIN_Q = 3072
# split-K: the split count whose equal-work programs fill whole waves of the resident programs
# best, at most this many waves (H200, BENCHMARKS.md session 6: a launch a few programs past a
# whole wave runs that wave nearly empty, up to 12% slower)
DECODE_WAVES = 2
DECODE_PROGRAMS_PER_SM_SMALL = 2  # ... when batch * kv heads is small (<= 16): fewer splits, less merge
FP16_DOTS = True  # 16-bit q: both dots in fp16 (a query block beyond fp16 range is scaled by a power of two)
BCAST_SCALE = True  # block32 scales: broadcast to the tile (True: 1.9x faster q8_0 decode on the H200) or reshape it
# V widened to fp16 by pinned inline PTX before its shared-memory transpose (see
# _codes.codes_to_f16_pinned); off: Triton places the convert (8-bit transposed reads)
V_PIN = True
# int8 tiles (q8_0) widened to fp16 by inline PTX four codes at a time, unpinned (_codes.codes_to);
# off: Triton's per-code arithmetic (same values)
INT8_PTX = True
INTERPRET_FP16 = False  # tests: run the interpreter's dots in fp16 to exercise the fp16 path
_PATHS = ("auto", "fused", "dense")
# FMA contraction on, explicitly: Triton 3.9 warns that its default turns off in 3.10 (the store
# and dequantize kernels turn it off themselves for exact rounding; attention wants the FMAs)
_FP_FUSION = {} if interpreting() else {"enable_fp_fusion": True}


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def prefill_path(q: Tensor, window_hides: bool = False, dense_ok: bool = True) -> str:
    """"decode", "fused" or "dense" for a query of this shape (see the module docstring).

    ``window_hides``: a sliding window shorter than the cache; auto then takes the fused kernel,
    which skips the key tiles below the window (SDPA would read them all under a mask).
    ``dense_ok`` False (softcap, sinks: SDPA has neither) takes the fused kernel even when
    ``KVCOMPILE_PREFILL=dense`` asks for the dense path.
    """
    Tq = q.shape[2]
    if Tq <= DECODE_MAX_Q:
        return "decode"
    choice = os.environ.get("KVCOMPILE_PREFILL", "auto").strip().lower() or "auto"
    if choice not in _PATHS:
        raise ValueError(f"KVCOMPILE_PREFILL={choice!r} is not one of {list(_PATHS)}")
    if not dense_ok:
        return "fused"
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if choice == "dense":
        if capturing:
            raise RuntimeError(
                "kvcompile: KVCOMPILE_PREFILL=dense needs a host sync and cannot run inside CUDA graph capture; "
                "use KVCOMPILE_PREFILL=auto or fused"
            )
        return "dense"
    if choice == "fused" or capturing or not q.is_cuda or window_hides:
        return "fused"
    return "dense" if Tq >= DENSE_MIN_Q else "fused"


def decode_splits(programs: int, max_len: int, block_n: int, sms: int, resident: int = 1) -> tuple[int, int]:
    """(number of splits, keys per split) from static shapes only.

    ``programs`` per split (batch * kv heads * query blocks); ``resident`` programs of the tile fit
    one SM at once, so ``resident * sms`` run per wave. Every program of a launch reads one split
    (the last may be shorter), so a launch a few programs past a whole wave ends with that wave
    nearly empty: the count chosen fills its waves best (ties: more waves), at most ``DECODE_WAVES``
    of them; with at least one block of keys per split. When batch * kv heads is small (<= 16)
    a split per program cannot fill a wave anyway: ``DECODE_PROGRAMS_PER_SM_SMALL`` programs per SM.
    """
    return _decode_splits(programs, max_len, block_n, sms, max(1, resident), DECODE_WAVES,
                          DECODE_PROGRAMS_PER_SM_SMALL)


@functools.lru_cache(maxsize=4096)
def _decode_splits(programs, max_len, block_n, sms, resident, waves_max, pps_small):
    blocks = triton_cdiv(max_len, block_n)

    def plan(want: int) -> tuple[int, int]:
        split_len = triton_cdiv(triton_cdiv(max_len, want), block_n) * block_n
        return triton_cdiv(max_len, split_len), split_len

    if programs <= 16:
        return plan(max(1, min(triton_cdiv(pps_small * sms, programs), blocks)))
    slots = resident * sms
    best, best_fill = plan(1), 0.0
    for want in range(1, blocks + 1):
        splits, split_len = plan(want)
        if splits != want:  # not reachable with whole blocks per split
            continue
        waves = math.ceil(programs * splits / slots)
        if waves > waves_max:
            break
        # the programs of the last split (launched last) are shorter: a last wave of only those
        # takes their length
        last_len = max_len - (splits - 1) * split_len
        tail = last_len if programs * (splits - 1) <= (waves - 1) * slots else split_len
        fill = programs * max_len / (slots * ((waves - 1) * split_len + tail))
        if fill >= best_fill - 0.01:
            best, best_fill = (splits, split_len), max(fill, best_fill)
    return best


def int8_ptx(code_dtype: torch.dtype, dot_dtype: torch.dtype) -> bool:
    """Whether int8 tiles are widened by inline PTX (GPU, fp16 dots; see ``INT8_PTX``)."""
    return INT8_PTX and code_dtype == torch.int8 and dot_dtype == torch.float16 and not interpreting()


def v_keys_contiguous(v: Tensor) -> bool:
    """True when V's codes are key-contiguous (``stride(2) == 1``, e.g. a transposed ``[B, H, D, L]``
    buffer seen as ``[B, H, L, D]``) AND its storage extends to the 16-rounded key length.

    The kernel then loads V like K (the reduced dim contiguous: no transpose on the way to the
    PV dot) in whole 16-key chunks, which may read up to 15 keys past ``L`` inside each
    ``(b, h, d)`` row; they must lie in the tensor's storage (``QuantizedCache`` pads its V
    buffer for this). A key-contiguous V without that room takes the generic path.
    """
    B, H, L, D = v.shape
    if L == 0 or D < 2 or v.stride(2) != 1 or v.stride(3) < L:
        return False
    last = v.storage_offset() + (B - 1) * v.stride(0) + (H - 1) * v.stride(1) + (D - 1) * v.stride(3)
    return last + triton_cdiv(L, 16) * 16 <= v.untyped_storage().nbytes() // v.element_size()


def scale_bytes(scale: Tensor) -> int:
    """Bytes of scales the kernel loads per key (for K or for V): 0 for static scales."""
    return 0 if scale.dim() == 1 else scale.element_size() * scale.shape[-1]


def _scale_kind(k_scale: Tensor, v_scale: Tensor, head_dim: int) -> tuple[int, int]:
    def kind(s: Tensor) -> tuple[int, int]:
        if s.dim() == 1:
            return SCALE_STATIC, head_dim
        if s.shape[-1] == 1:
            return SCALE_TOKEN, head_dim
        return SCALE_BLOCK, head_dim // s.shape[-1]

    kk, vk = kind(k_scale), kind(v_scale)
    if kk[0] == SCALE_BLOCK and (kk[1] & (kk[1] - 1) or kk[1] < 16):
        raise ValueError(
            f"kvcompile.attention (triton): scale groups of {kk[1]} values (head_dim={head_dim}, "
            f"{k_scale.shape[-1]} groups) are not supported; use granularity 'token' or 'block32'"
        )
    if kk != vk:
        raise ValueError(
            "kvcompile.attention (triton): K and V scales must have one granularity, got "
            f"{tuple(k_scale.shape)} and {tuple(v_scale.shape)}"
        )
    return kk


def _mask_arg(attn_mask: Optional[Tensor], B: int, Hq: int, Tq: int, L: int, like: Tensor):
    if attn_mask is None:
        return like, (0, 0, 0, 0), MASK_NONE
    m = attn_mask
    if m.dim() > 4:
        raise ValueError(f"kvcompile.attention: attn_mask must broadcast to [B, Hq, Tq, L], got {tuple(m.shape)}")
    m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)).expand(B, Hq, Tq, L)  # stride 0 where broadcast
    if m.dtype == torch.bool:
        return m.view(torch.uint8), m.stride(), MASK_BOOL
    return m, m.stride(), MASK_ADD


def _fused(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, sm_scale, decode: bool,
           window: int = 0, softcap: float = 0.0, sinks: Optional[Tensor] = None,
           v_rotation: Optional[Tensor] = None, q_dtype: Optional[torch.dtype] = None) -> Tensor:
    """The fused kernels. ``q`` may arrive rotated in fp32; ``q_dtype``: the caller's q dtype, which
    picks the dot types and the output dtype (default q.dtype)."""
    B, Hq, Tq, D = q.shape
    q_dtype = q.dtype if q_dtype is None else q_dtype
    Hkv, L = k_q.shape[1], k_q.shape[2]
    group = Hq // Hkv
    dev = q.device
    cc = device_cc(dev)
    # K and V each: e4m3 codes go in as uint8 bits where Triton has no fp8 type (their code types may differ)
    k_fp8_bits = k_q.dtype == torch.float8_e4m3fn and not interpreting() and not tiles.has_native_fp8(cc)
    v_fp8_bits = v_q.dtype == torch.float8_e4m3fn and not interpreting() and not tiles.has_native_fp8(cc)
    kc = k_q.view(torch.uint8) if k_fp8_bits else k_q
    vc = v_q.view(torch.uint8) if v_fp8_bits else v_q
    scale_kind, group_size = _scale_kind(k_scale, v_scale, D)
    ks = k_scale.view(1, -1, 1, 1) if k_scale.dim() == 1 else k_scale
    vs = v_scale.view(1, -1, 1, 1) if v_scale.dim() == 1 else v_scale
    kvl, kvl_stride = kv_len_arg(kv_len, B, dev)
    mask, mstride, mask_kind = _mask_arg(attn_mask, B, Hq, Tq, L, q)

    if interpreting():  # numpy underneath: no bf16 dot; small tiles so tests cross block edges
        dot_dtype = pv_dtype = torch.float16 if INTERPRET_FP16 else torch.float32
    elif q_dtype == torch.float32:
        dot_dtype = pv_dtype = torch.float32
    elif FP16_DOTS:
        # e4m3 -> fp16 is one convert per two values and int8 -> fp16 a magic-number add; the
        # bf16 route costs more per element and decode is bound by those instructions
        dot_dtype = pv_dtype = torch.float16
    else:
        dot_dtype, pv_dtype = q_dtype, torch.bfloat16  # P * s_v needs bf16's range
    v_keys = v_keys_contiguous(vc)
    # V widened by pinned PTX (GPU, fp16 PV dot, 8-bit codes the PTX decodes: int8 or native e4m3)
    v_pin = (V_PIN and not v_keys and not interpreting() and pv_dtype == torch.float16 and not v_fp8_bits
             and v_q.dtype in (torch.int8, torch.float8_e4m3fn))
    if v_pin and v_q.dtype == torch.float8_e4m3fn:
        vc = v_q.view(torch.uint8)  # the PTX takes the code bits
    qb = torch.empty((), dtype=dot_dtype).element_size()
    rows = Tq * group
    sb = max(scale_bytes(k_scale), scale_bytes(v_scale))  # e.g. fp8/block32 K (fp32) with q8_0 V (fp16)
    if decode:
        tile = tiles.decode_tile(cc, D, qb, kc.element_size(), vc.element_size(), rows, v_keys, sb)
    else:
        tile = tiles.prefill_tile(cc, D, qb, kc.element_size(), vc.element_size(), v_keys, sb)
    if interpreting():
        tile = dataclasses.replace(tile, block_m=min(tile.block_m, 32), block_n=16)
    window = window if 0 < window < L else 0  # a window of L or more keys hides none
    features = (window > 0, softcap > 0, sinks is not None, v_rotation is not None, q.dtype)
    key = (decode, cc, D, dot_dtype, k_q.dtype, v_q.dtype, scale_kind, mask_kind, bool(is_causal),
           rows if decode else 0, v_pin, v_keys, features)
    tile = _SHRUNK.get(key, tile)
    out = torch.empty((B, Hq, Tq, D), dtype=q_dtype, device=dev)
    args = (q, kc, vc, ks, vs, kvl, kvl_stride, mask, mstride, mask_kind, out, sm_scale, is_causal,
            group, group_size, scale_kind, (k_fp8_bits, v_fp8_bits), dot_dtype, pv_dtype, decode, v_pin, v_keys,
            int8_ptx(kc.dtype, dot_dtype) or int8_ptx(vc.dtype, dot_dtype), window, float(softcap), sinks,
            None if v_rotation is None else v_rotation.contiguous())
    from triton.runtime.errors import OutOfResources

    while True:
        # programs of this tile one SM holds at once: the decode split count fills whole waves of them
        resident = tiles.programs_per_sm(
            tile, cc, tiles.smem_bytes(tile, D, qb, kc.element_size(), vc.element_size(), v_keys, sb)) if decode else 1
        try:
            _launch(tile, *args, resident=resident)
            return out
        except OutOfResources:
            # the shared-memory model in tiles.py is an estimate; Triton has the last word
            smaller = _shrink(tile)
            if smaller is None:
                raise
            tile = _SHRUNK[key] = smaller


_SHRUNK: dict = {}  # tiles that Triton refused for lack of shared memory -> the one that compiled


def _shrink(tile: tiles.Tile):
    if tile.num_stages > 2:
        return dataclasses.replace(tile, num_stages=tile.num_stages - 1)
    if tile.block_n > 16:
        return dataclasses.replace(tile, block_n=tile.block_n // 2)
    if tile.block_m > 16:
        return dataclasses.replace(tile, block_m=tile.block_m // 2)
    return None


def _maxnreg(tile: tiles.Tile) -> dict:
    return {} if tile.maxnreg is None or interpreting() else {"maxnreg": tile.maxnreg}


def _launch(tile, q, kc, vc, ks, vs, kvl, kvl_stride, mask, mstride, mask_kind, out, sm_scale, is_causal,
            group, group_size, scale_kind, fp8_bits, dot_dtype, pv_dtype, decode, v_pin=False, v_keys=False,
            int8_ptx=False, window=0, softcap=0.0, sinks=None, v_rotation=None, resident=1):
    """One launch of the attention kernel (+ the merge when split). ``fp8_bits``: (K's, V's);
    ``window`` > 0 only when it hides keys (< L); ``v_rotation``: R_V (contiguous) or None."""
    B, Hq, Tq, D = q.shape
    Hkv, L = kc.shape[1], kc.shape[2]
    dev = q.device
    rows = Tq * group
    m_blocks = triton_cdiv(rows, tile.block_m)
    k_fp8_bits, v_fp8_bits = fp8_bits
    if decode:
        # with a window, the splits cover the keys query 0 can see (from its window's first key,
        # rounded down to a tile) instead of the whole cache: at most window + Tq - 1 keys plus the
        # rounding, so a sliding layer plans (and runs) like a full layer of the window's length
        span = min(L, window + Tq - 1 + tile.block_n - 1) if window else L
        splits, split_len = decode_splits(B * Hkv * m_blocks, span, tile.block_n, sm_count(dev), resident)
    else:
        splits, split_len = 1, triton_cdiv(L, tile.block_n) * tile.block_n

    if splits > 1:
        op = torch.empty((B, Hq, Tq, splits, D), dtype=torch.float32, device=dev)
        lse = torch.empty((B, Hq, Tq, splits), dtype=torch.float32, device=dev)
    else:
        op, lse = out, out  # unused
    op_strides = op.stride()[:4] if splits > 1 else (0, 0, 0, 0)
    lse_strides = lse.stride() if splits > 1 else (0, 0, 0, 0)
    sink_arg, sink_stride = (sinks, sinks.stride(0)) if sinks is not None else (q, 0)  # q: a dummy pointer
    r_v = v_rotation
    r_v_arg = r_v if r_v is not None else q  # q: a dummy pointer
    # a rotated V, unsplit: the kernel writes fp32, one launch multiplies by R_V^T into ``out`` (one
    # rounding); split: the merge does it
    o_buf = torch.empty(out.shape, dtype=torch.float32, device=dev) if r_v is not None and splits == 1 else out

    grid = (m_blocks, B * Hkv, splits)
    _attention_kernel[grid](
        q, *q.stride(),
        kc, *kc.stride(), vc, *vc.stride(),
        ks, *ks.stride(), vs, *vs.stride(),
        kvl, kvl_stride,
        mask, *mstride,
        sink_arg, sink_stride,
        o_buf, *o_buf.stride(),
        op, *op_strides,
        lse, *lse_strides,
        Hkv, Tq, D, float(sm_scale), split_len, int(window), float(softcap),
        GROUP=group, GROUP_SIZE=group_size, SCALE_KIND=scale_kind, MASK_KIND=mask_kind,
        IS_CAUSAL=bool(is_causal), HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
        SPLIT_OUTPUT=splits > 1, K_FP8_BITS=k_fp8_bits, V_FP8_BITS=v_fp8_bits,
        DOT_DTYPE=_tl_dtype(dot_dtype), PV_DTYPE=_tl_dtype(pv_dtype), BCAST_SCALE=BCAST_SCALE,
        V_PIN=v_pin, V_KEYS_CONTIG=v_keys, INT8_PTX=int8_ptx,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_D=next_pow2(D),
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_FP_FUSION, **_maxnreg(tile),
    )
    if splits > 1:
        _merge_kernel[(B * Hq * Tq, triton_cdiv(D, ROT_CHUNK) if r_v is not None else 1)](
            op, *op.stride()[:4], lse, *lse.stride(), out, *out.stride(), kvl, kvl_stride,
            vs, vs.stride(1), sink_arg, sink_stride, r_v_arg, Hq, Tq, D, split_len, splits, int(window),
            GROUP=group, STATIC_SCALE=scale_kind == SCALE_STATIC, HAS_WINDOW=window > 0, HAS_SINKS=sinks is not None,
            HAS_V_ROT=r_v is not None, ROT_CHUNK=ROT_CHUNK,
            SPLITS_P2=next_pow2(splits), BLOCK_N=tile.block_n, BLOCK_D=next_pow2(D), num_warps=4, **_FP_FUSION,
        )
    elif r_v is not None:
        out.copy_(rotate_rows(o_buf, r_v, transpose=True, dtype=out.dtype))


def attention(
    q: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor, kv_len: Tensor,
    attn_mask: Optional[Tensor], is_causal: bool, scale: Optional[float],
    sliding_window: int = 0, softcap: float = 0.0, sinks: Optional[Tensor] = None,
    k_rotation: Optional[Tensor] = None, v_rotation: Optional[Tensor] = None,
) -> Tensor:
    """``kvcompile::attention`` on the Triton kernels (arguments and shapes: :func:`kvcompile.ops.attention`)."""
    B, Hq, Tq, D = q.shape
    tiles.check_head_dim(D)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"kvcompile.attention (triton): q must be fp16, bf16 or fp32, got {q.dtype}")
    if Tq == 0 or k_q.shape[2] == 0:
        return torch.zeros_like(q)
    sm_scale = D**-0.5 if scale is None else float(scale)
    L = k_q.shape[2]
    # the dense path's SDPA has no softcap and no sinks, and its one-launch dequantize decodes e4m3
    # bits for K and V alike (archs without an fp8 type): those calls take the fused kernel
    dense_ok = (softcap == 0 and sinks is None
                and (k_q.dtype == v_q.dtype or tiles.has_native_fp8(device_cc(q.device))))
    path = prefill_path(q, window_hides=0 < sliding_window < L, dense_ok=dense_ok)
    q_dtype = q.dtype
    if k_rotation is not None:  # scores against K's rotated codes: (q R)(k R)^T = q k^T, q rotated once
        # fp32 for the fused kernel (it rounds q once, into its dot type); the dense path's SDPA takes q's dtype
        q = rotate_rows(q, k_rotation, dtype=q_dtype if path == "dense" else torch.float32)
    if path == "dense":
        return dense.attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, sm_scale,
                               sliding_window, v_rotation)
    return _fused(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, sm_scale, decode=path == "decode",
                  window=sliding_window, softcap=softcap, sinks=sinks, v_rotation=v_rotation, q_dtype=q_dtype)

"""Launcher of ``kvcompile::attention``: executes the plan :mod:`kvcompile.kernels.plan` makes.

Paths (``plan.prefill_path``): ``decode`` (q_len <= 16: split-K over the cache with a split count
fixed by static shapes, splits past ``kv_len`` exit at once, an LSE merge kernel combines),
``fused`` (one pass of the fused kernel over the codes, one program per query block) and ``dense``
(:mod:`kvcompile.kernels.dense`: dequantize the live prefix once, then the best SDPA; one host sync,
so never inside CUDA graph capture). Sliding window, softcap and sinks are constexpr switches of
the kernel; off, it compiles to the code it had without them. Nothing here decides anything the
plan does not say (the path, the tile and its smaller fallback when Triton refuses one for lack of
shared memory are the plan's); what stays here is reading the call off its tensors and launching.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import rotation, tiles
from . import dense, plan as plan_mod
from ._attention_kernel import _attention_kernel
from ._merge_kernel import _merge_kernel
from .common import device_cc, interpreting, kv_len_arg, next_pow2, rot_scale, sm_count
from .plan import (DECODE_MAX_Q, MASK_ADD, MASK_BOOL, MASK_NONE, ROT_CHUNK, ROT_MATRIX, ROT_NONE, ROT_SYLVESTER,
                   SCALE_STATIC, scale_bytes, scale_layout)
from .rotate import rotate_rows
from .store import _as_bits as as_bits, store_kv, triton_cdiv

__all__ = ["attention", "call_of", "plan_of", "v_keys_contiguous", "scale_bytes", "DECODE_MAX_Q"]

# FMA contraction on, explicitly: Triton 3.9 warns that its default turns off in 3.10 (the store
# and dequantize kernels turn it off themselves for exact rounding; attention wants the FMAs)
_FP_FUSION = {} if interpreting() else {"enable_fp_fusion": True}


def prefill_path(q: Tensor, window_hides: bool = False, dense_ok: bool = True, call=None) -> str:
    """:func:`plan.prefill_path` for the query ``q`` [B, Hq, Tq, D] on its device; ``call`` (a
    :class:`plan.Call` of the fused kernel), where given, says whether its plan quantizes the scores."""
    p = plan_of(call) if call is not None else None
    return plan_mod.prefill_path(q.shape[2], q.is_cuda, q.is_cuda and torch.cuda.is_current_stream_capturing(),
                                 window_hides, dense_ok, quantized_scores=p is not None and (p.q_int8 or p.q_fp8))


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


def _rot_kind(r: Optional[Tensor]) -> int:
    if r is None:
        return ROT_NONE
    return ROT_SYLVESTER if rotation.is_shared_sylvester(r) else ROT_MATRIX


def call_of(q, k_q, k_scale, v_q, v_scale, attn_mask=None, is_causal=False, decode=True, window=0, softcap=0.0,
            sinks=None, k_rotation=None, v_rotation=None, new_token=None, *, k_fmt, v_fmt) -> plan_mod.Call:
    """The :class:`plan.Call` of a call with these tensors in formats ``k_fmt`` / ``v_fmt``
    (``window`` > 0 only when it hides keys)."""
    B, Hq, Tq, D = q.shape
    Hkv, L = k_q.shape[1], k_q.shape[2]
    dev = q.device
    kind, group_size = scale_layout(k_fmt, v_fmt, D)
    return plan_mod.Call(
        cc=tuple(device_cc(dev)), sms=sm_count(dev), interpret=interpreting(), B=B, Hq=Hq, Hkv=Hkv, Tq=Tq, L=L, D=D,
        q_dtype=q.dtype, k_code=k_fmt.code_dtype, v_code=v_fmt.code_dtype, scale_kind=kind, group_size=group_size,
        # e.g. fp8/block32 K (fp32 scales) with q8_0 V (fp16)
        scale_bytes=max(scale_bytes(k_fmt, D), scale_bytes(v_fmt, D)),
        mask_kind=MASK_NONE if attn_mask is None else (MASK_BOOL if attn_mask.dtype == torch.bool else MASK_ADD),
        is_causal=bool(is_causal), window=int(window) if 0 < window < L else 0, softcap=softcap > 0,
        sinks=sinks is not None, k_rot=_rot_kind(k_rotation), v_rot=_rot_kind(v_rotation),
        v_keys=v_keys_contiguous(v_q), decode=decode,
        store=new_token is not None, store_offset=new_token is not None and new_token[2] is not None,
        k_kind=k_fmt.spec.id, v_kind=v_fmt.spec.id,
    )


_SHRUNK = plan_mod._SHRUNK  # the plan's tile fallback (benchmarks print and clear it)
plan_of = plan_mod.plan_of


def _fused(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, sm_scale, decode: bool, window=0,
           softcap=0.0, sinks=None, k_rotation=None, v_rotation=None, new_token=None, *, k_fmt, v_fmt,
           call=None) -> Tensor:
    """The fused kernels: plan, then run (with a smaller tile when Triton refuses the planned one).
    ``call``: the call's :class:`plan.Call`, where the path choice already built it."""
    from triton.runtime.errors import OutOfResources

    if call is None:
        call = call_of(q, k_q, k_scale, v_q, v_scale, attn_mask, is_causal, decode, window, softcap, sinks,
                       k_rotation, v_rotation, new_token, k_fmt=k_fmt, v_fmt=v_fmt)
    while True:
        p = plan_of(call)
        try:
            return _run(p, q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, sm_scale, softcap, sinks,
                        k_rotation, v_rotation, new_token, fmts=(k_fmt, v_fmt))
        except OutOfResources:
            if not plan_mod.shrink(call, p.tile):  # the plan's smaller tile, if one is left
                raise


def _run(p: plan_mod.LaunchPlan, q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, sm_scale, softcap, sinks,
         k_rotation, v_rotation, new_token=None, fmts=None) -> Tensor:
    """One launch of the attention kernel as planned (+ the merge when split, + the rotations and the
    token's store the plan puts in launches of their own)."""
    c = p.call
    B, Hq, Tq, D = q.shape
    dev = q.device
    if p.store == "launch":
        store_kv(k_q, k_scale, v_q, v_scale, *new_token[:2], kv_len, new_token[2], k_rotation, v_rotation, shift=-1,
                 ring=c.L, k_fmt=fmts[0], v_fmt=fmts[1])
    if p.store == "kernel":
        k_new, v_new, k_offset = new_token
        kw, vw = as_bits(k_q), as_bits(v_q)
        off = k_offset if k_offset is not None else q
        store_args = (k_new, *k_new.stride(), v_new, *v_new.stride(), kw, *kw.stride(), vw, *vw.stride(),
                      off, *((k_offset.stride(0), k_offset.stride(1)) if k_offset is not None else (0, 0)))
    else:  # unused pointers (q) and strides
        store_args = (q, 0, 0, 0, 0) * 4 + (q, 0, 0)
    q_dtype = q.dtype
    if p.q_rotation == "launch":  # fp32: the kernel rounds q once, into its dot type
        q = rotate_rows(q, k_rotation, dtype=torch.float32)
    k_bits, v_bits = p.codes_as_bits
    kc = k_q.view(torch.uint8) if k_bits else k_q
    vc = v_q.view(torch.uint8) if v_bits else v_q
    ks = k_scale.view(1, -1, 1, 1) if k_scale.dim() == 1 else k_scale
    vs = v_scale.view(1, -1, 1, 1) if v_scale.dim() == 1 else v_scale
    kvl, kvl_stride = kv_len_arg(kv_len, B, dev)
    mask, mstride, _ = _mask_arg(attn_mask, B, Hq, Tq, c.L, q)
    out = torch.empty((B, Hq, Tq, D), dtype=q_dtype, device=dev)
    splits = p.splits
    if splits > 1:
        op = torch.empty((B, Hq, Tq, splits, D), dtype=torch.float32, device=dev)
        lse = torch.empty((B, Hq, Tq, splits), dtype=torch.float32, device=dev)
        op_strides, lse_strides = op.stride()[:4], lse.stride()
    else:
        op = lse = out  # unused
        op_strides = lse_strides = (0, 0, 0, 0)
    sink_arg, sink_stride = (sinks, sinks.stride(0)) if sinks is not None else (q, 0)  # q: a dummy pointer
    r_v = v_rotation.contiguous() if p.o_rotation in ("merge", "launch") else None
    # the output rotated by one more launch: the kernel writes fp32, rotate_rows rounds once
    o_buf = torch.empty(out.shape, dtype=torch.float32, device=dev) if p.o_rotation == "launch" else out
    t = p.tile
    grid = (triton_cdiv(Tq * (Hq // c.Hkv), t.block_m), B * c.Hkv, splits)
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
        c.Hkv, Tq, D, float(sm_scale), p.split_len, int(c.window), float(softcap), rot_scale(D), c.L,
        *store_args,
        **p.constexprs(), num_warps=t.num_warps, num_stages=t.num_stages, **_FP_FUSION, **_maxnreg(t),
    )
    if splits > 1:
        _merge_kernel[(B * Hq * Tq, triton_cdiv(D, ROT_CHUNK) if r_v is not None else 1)](
            op, *op.stride()[:4], lse, *lse.stride(), out, *out.stride(), kvl, kvl_stride,
            vs, vs.stride(1), sink_arg, sink_stride, r_v if r_v is not None else q, rot_scale(D), Hq, Tq, D,
            p.split_len, splits, int(c.window), c.L, GROUP=Hq // c.Hkv, STATIC_SCALE=c.scale_kind == SCALE_STATIC,
            HAS_WINDOW=c.window > 0, HAS_SINKS=sinks is not None, HAS_V_ROT=r_v is not None, ROT_CHUNK=ROT_CHUNK,
            R_SYLVESTER=c.v_rot == ROT_SYLVESTER,
            SPLITS_P2=next_pow2(splits), BLOCK_N=t.block_n, BLOCK_D=next_pow2(D), num_warps=4, **_FP_FUSION,
        )
    elif p.o_rotation == "launch":
        out.copy_(rotate_rows(o_buf, r_v, transpose=True, dtype=out.dtype))
    return out


def _maxnreg(tile: tiles.Tile) -> dict:
    return {} if tile.maxnreg is None or interpreting() else {"maxnreg": tile.maxnreg}


def attention(
    q: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor, kv_len: Tensor,
    attn_mask: Optional[Tensor], is_causal: bool, scale: Optional[float],
    sliding_window: int = 0, softcap: float = 0.0, sinks: Optional[Tensor] = None,
    k_rotation: Optional[Tensor] = None, v_rotation: Optional[Tensor] = None,
    new_token: Optional[tuple[Tensor, Tensor, Optional[Tensor]]] = None, *, k_fmt, v_fmt,
) -> Tensor:
    """``kvcompile::attention`` on the Triton kernels (arguments and shapes: :func:`kvcompile.dispatch.attention`;
    ``k_fmt`` / ``v_fmt``: the caches' :class:`kvcompile.formats.KVFormat`).

    ``new_token`` ``(k, v, k_offset)``, k and v ``[B, Hkv, 1, D]``, with one query: store that token
    first, at position ``kv_len - 1`` (a 0-d tensor) in slot ``(kv_len - 1) % L`` (a sliding layer's
    ring, :mod:`kvcompile.ring`), as :func:`store.store_kv` does, then attend. The plan puts the store
    in the attention kernel (no launch of its own) or in a store launch before it."""
    B, Hq, Tq, D = q.shape
    tiles.check_head_dim(D)
    if new_token is not None and (Tq != 1 or kv_len.dim() != 0 or new_token[0].shape != (B, k_q.shape[1], 1, D)
                                  or new_token[1].shape != new_token[0].shape):
        raise ValueError(
            f"kvcompile.attention (triton): new_token takes one query and one token [B, Hkv, 1, D] stored at a "
            f"0-d kv_len - 1, got q {tuple(q.shape)}, kv_len {tuple(kv_len.shape)}, "
            f"k {tuple(new_token[0].shape)}, v {tuple(new_token[1].shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"kvcompile.attention (triton): q must be fp16, bf16 or fp32, got {q.dtype}")
    if Tq == 0 or k_q.shape[2] == 0:
        return torch.zeros_like(q)
    sm_scale = D**-0.5 if scale is None else float(scale)
    L = k_q.shape[2]
    dense_ok = plan_mod.dense_ok(softcap > 0, sinks is not None, k_fmt.code_dtype, v_fmt.code_dtype, device_cc(q.device))
    call = None  # the fused kernel's call, where its plan may quantize the scores (KVCOMPILE_PREFILL_Q)
    if plan_mod.DENSE_MIN_Q <= Tq <= plan_mod.QUANT_FUSED_MAX_Q and plan_mod.prefill_q(False):
        call = call_of(q, k_q, k_scale, v_q, v_scale, attn_mask, is_causal, False, sliding_window, softcap, sinks,
                       k_rotation, v_rotation, new_token, k_fmt=k_fmt, v_fmt=v_fmt)
    path = prefill_path(q, window_hides=0 < sliding_window < L, dense_ok=dense_ok, call=call)
    if path == "dense":
        return dense.attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, sm_scale,
                               sliding_window, k_rotation, v_rotation, k_fmt=k_fmt, v_fmt=v_fmt)
    return _fused(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, sm_scale, path == "decode",
                  sliding_window, softcap, sinks, k_rotation, v_rotation, new_token, k_fmt=k_fmt, v_fmt=v_fmt,
                  call=call)

"""The ``kvcompile`` torch.library ops: ``store_kv``, ``dequantize``, ``attention``, and for a sliding
layer's ring (:mod:`kvcompile.ring`, which implements them) ``dequantize_ring`` and ``attention_ring``.

This module holds the registration: each op is defined on a ``torch.library.Library``
(:func:`_register`) from its implementation and its fake, right below each other. The plain ops'
implementations (their docstrings are the ops' contracts), the input checks and the one dispatch
point, ``kernel_backend`` (Triton, native C or the reference per call, from ``KVCOMPILE_KERNELS``),
are in :mod:`kvcompile.dispatch`; a ring's in :mod:`kvcompile.ring`, composed from the plain ones.

Opaque ops (not ``triton_op``) on purpose: Inductor does not look inside, so the same compiled
graph runs on CPU CI with the reference and on a GPU with Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch, ring as ring_ops
from .dispatch import _check_attention, _check_codes_scale, _check_rotation, format_arg, kernel_backend, sizing_advice

__all__ = ["store_kv", "dequantize", "attention", "dequantize_ring", "attention_ring", "kernel_backend",
           "sizing_advice"]

# Every op takes the caches' formats as ints (``k_format`` / ``v_format``, or ``format``: the cache's
# ``KVFormat.id``, kvcompile.formats.spec), last, so existing positional arguments keep their places; the
# schemas default them to -1 (a positional argument after defaulted ones needs a default), which every
# op refuses with the fix (dispatch.format_arg): the format is never read off the tensors.


# ---------------------------------------------------------------------------------------------
# registration: torch.library.Library, not custom_op
# ---------------------------------------------------------------------------------------------

_LIB = torch.library.Library("kvcompile", "DEF")


class _NoBackward(torch.autograd.Function):
    """An op's output where an input requires grad: the forward stands, a backward names the fix."""

    @staticmethod
    def forward(ctx, name: str, out: Tensor, *inputs: Tensor) -> Tensor:
        ctx.name = name
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"kvcompile::{ctx.name} has no backward: the 8-bit KV cache serves inference. Run the model under "
            "torch.no_grad() or torch.inference_mode(), or train without the cache (use_cache=False)"
        )


def _register(schema: str, impl, fake):
    """Define ``kvcompile::<name>`` by ``schema``: ``impl`` on every device (it picks Triton or the
    reference, :func:`kernel_backend`), ``fake`` for tracing, and an autograd kernel that runs the
    op below autograd and gives it no backward. Returns the op (calling it dispatches).

    Why not ``torch.library.custom_op``: its Python wrappers (autograd redispatch, ADInplaceOrView,
    default filling, a Dynamo-disabled backend call) cost 57 us per ``attention`` call and 120 per
    ``store_kv`` on two CPU cores, two calls per layer and step; this costs ~5. Inductor still treats
    the op as opaque, so one compiled graph runs the reference on CPU and the kernels on a GPU.
    """
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    op = getattr(torch.ops.kvcompile, name)
    overload = op.default

    def autograd_kernel(*args, **kwargs):
        if not torch.is_grad_enabled() and torch._C._len_torch_dispatch_stack() == 0 and all(
                type(a) is Tensor for a in (*args, *kwargs.values()) if isinstance(a, Tensor)):
            # plain tensors, no mode, no grad: the redispatch below would land in ``impl`` with the same
            # arguments; calling it here saves a Python -> C++ -> Python round trip (~10 us on CPU)
            return impl(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            out = overload(*args, **kwargs)
        if isinstance(out, Tensor) and torch.is_grad_enabled():
            tracked = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.requires_grad]
            if tracked:
                out = _NoBackward.apply(name, out, *tracked)
        return out

    _LIB.impl(name, autograd_kernel, "Autograd")
    torch.library.register_fake(f"kvcompile::{name}", fake, lib=_LIB)
    return op


# ---------------------------------------------------------------------------------------------
# store_kv, dequantize, attention (implementations: kvcompile.dispatch)
# ---------------------------------------------------------------------------------------------


def _store_kv(k_cache: Tensor, k_scale: Tensor, v_cache: Tensor, v_scale: Tensor, k: Tensor, v: Tensor,
              start: Tensor, k_offset: Optional[Tensor], k_rotation: Optional[Tensor] = None,
              v_rotation: Optional[Tensor] = None, ring: bool = False, k_format: int = -1, v_format: int = -1) -> None:
    """:func:`kvcompile.dispatch.store_kv`; ``ring``: the caches are a sliding layer's ring of
    ``W = L`` slots (:mod:`kvcompile.ring`): position ``p`` goes to slot ``p % W`` and of a chunk
    longer than W only its last W tokens stay."""
    fmts = dict(k_fmt=format_arg(k_format, "store_kv", "k_format"), v_fmt=format_arg(v_format, "store_kv", "v_format"))
    store = ring_ops.store_kv if ring else dispatch.store_kv
    store(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation, v_rotation, **fmts)


def _store_kv_fake(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation=None, v_rotation=None,
                   ring=False, k_format=-1, v_format=-1) -> None:
    return None


store_kv = _register(
    "store_kv(Tensor(a0!) k_cache, Tensor(a1!) k_scale, Tensor(a2!) v_cache, Tensor(a3!) v_scale, Tensor k, "
    "Tensor v, Tensor start, Tensor? k_offset, Tensor? k_rotation=None, Tensor? v_rotation=None, "
    "bool ring=False, int k_format=-1, int v_format=-1) -> ()",
    _store_kv, _store_kv_fake)


def _dequantize(codes, scale, offset, kv_len, dtype, rotation=None, sliding_window=0, format=-1) -> Tensor:
    """:func:`kvcompile.dispatch.dequantize` (its docstring: the op's contract) of codes in ``format``."""
    return dispatch.dequantize(codes, scale, offset, kv_len, dtype, rotation, sliding_window,
                               fmt=format_arg(format, "dequantize", "format"))


def _dequantize_fake(codes, scale, offset, kv_len, dtype, rotation=None, sliding_window=0, format=-1):
    return codes.new_empty(codes.shape, dtype=dtype)


dequantize = _register(
    "dequantize(Tensor codes, Tensor scale, Tensor? offset, Tensor kv_len, ScalarType dtype, Tensor? rotation=None, "
    "SymInt sliding_window=0, int format=-1) -> Tensor",
    _dequantize, _dequantize_fake)


def _attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale, sliding_window=0, softcap=0.0,
               sinks=None, k_rotation=None, v_rotation=None, k_format=-1, v_format=-1) -> Tensor:
    """:func:`kvcompile.dispatch.attention` (its docstring: the op's contract), K in ``k_format``, V in ``v_format``."""
    return dispatch.attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale, sliding_window,
                              softcap, sinks, k_rotation, v_rotation, k_fmt=format_arg(k_format, "attention", "k_format"),
                              v_fmt=format_arg(v_format, "attention", "v_format"))


def _attention_fake(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale, sliding_window=0,
                    softcap=0.0, sinks=None, k_rotation=None, v_rotation=None, k_format=-1, v_format=-1):
    _check_attention(q, k_q, k_scale, v_q, v_scale, sliding_window, softcap, sinks, k_rotation, v_rotation,
                     format_arg(k_format, "attention", "k_format"), format_arg(v_format, "attention", "v_format"))  # errors at trace time
    # dense [B, Hq, Tq, D] whatever q's strides (HF's q is a transposed view): the kernels and
    # the reference both write a contiguous output
    return q.new_empty(q.shape)


attention = _register(
    "attention(Tensor q, Tensor k_q, Tensor k_scale, Tensor v_q, Tensor v_scale, Tensor kv_len, Tensor? attn_mask, "
    "bool is_causal, float? scale, SymInt sliding_window=0, float softcap=0., Tensor? sinks=None, "
    "Tensor? k_rotation=None, Tensor? v_rotation=None, int k_format=-1, int v_format=-1) -> Tensor",
    _attention, _attention_fake)


# ---------------------------------------------------------------------------------------------
# a sliding layer's ring (kvcompile.ring): read before write
# ---------------------------------------------------------------------------------------------


def _dequantize_ring(
    codes: Tensor,
    scale: Tensor,
    offset: Optional[Tensor],
    kv_len: Tensor,
    dtype: torch.dtype,
    rotation: Optional[Tensor],
    sliding_window: int,
    new: Tensor,
    length: int,
    format: int = -1,
) -> Tensor:
    """A ring of ``W = L`` slots plus ``new`` [B, Hkv, T, D] (raw values, about to be stored at
    ``kv_len``, the tokens stored so far) -> values [B, Hkv, ``length``, D] in ``dtype`` at absolute
    positions: the ring's positions ``[kv_len - W + 1, kv_len)``, ``new`` at ``[kv_len, kv_len + T)``
    quantized as ``store_kv`` quantizes it, zeros elsewhere. The arguments before ``new`` are
    :func:`_dequantize`'s (``sliding_window`` is W, the ring's size). The eager path of a sliding
    layer's ring; the compiler pass replaces attention over it by :func:`_attention_ring`.
    """
    fmt = format_arg(format, "dequantize_ring", "format")
    _check_codes_scale("dequantize_ring", codes, scale, fmt)
    _check_rotation("rotation", rotation, codes)
    if sliding_window != codes.shape[2]:
        raise ValueError(f"kvcompile.dequantize_ring: a ring of {codes.shape[2]} slots serves a window of as many "
                         f"positions, got sliding_window={sliding_window}")
    if new.dim() != 4 or new.shape[:2] != codes.shape[:2] or new.shape[3] != codes.shape[3]:
        raise ValueError(f"kvcompile.dequantize_ring: new {tuple(new.shape)} does not fit the ring {tuple(codes.shape)}")
    return ring_ops.dequantize(codes, scale, offset, kv_len, dtype, rotation, new, length, fmt=fmt)


def _dequantize_ring_fake(codes, scale, offset, kv_len, dtype, rotation, sliding_window, new, length, format=-1):
    B, H, _, D = codes.shape
    return codes.new_empty((B, H, length, D), dtype=dtype)


dequantize_ring = _register(
    "dequantize_ring(Tensor codes, Tensor scale, Tensor? offset, Tensor kv_len, ScalarType dtype, Tensor? rotation, "
    "SymInt sliding_window, Tensor new, SymInt length, int format=-1) -> Tensor",
    _dequantize_ring, _dequantize_ring_fake)


def _check_attention_ring(q, k_q, k_scale, v_q, v_scale, k, v, softcap, sinks, k_rotation, v_rotation, k_fmt,
                          v_fmt) -> None:
    _check_attention(q, k_q, k_scale, v_q, v_scale, k_q.shape[2], softcap, sinks, k_rotation, v_rotation, k_fmt,
                     v_fmt)
    if k.shape != v.shape or k.dim() != 4 or k.shape[:2] != k_q.shape[:2] or k.shape[3] != k_q.shape[3]:
        raise ValueError(f"kvcompile.attention_ring: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the ring "
                         f"{tuple(k_q.shape)}")


def _attention_ring(
    q: Tensor,
    k_q: Tensor,
    k_scale: Tensor,
    v_q: Tensor,
    v_scale: Tensor,
    cache_len: Tensor,
    k: Tensor,
    v: Tensor,
    k_offset: Optional[Tensor],
    kv_len: Optional[Tensor],
    attn_mask: Optional[Tensor],
    is_causal: bool,
    scale: Optional[float],
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
    k_rotation: Optional[Tensor] = None,
    v_rotation: Optional[Tensor] = None,
    k_format: int = -1,
    v_format: int = -1,
) -> Tensor:
    """Store ``k, v`` [B, Hkv, T, D] into a sliding layer's ring at ``[cache_len - T, cache_len)``
    (``cache_len``: the tokens stored once they are in; as ``store_kv(ring=True)``), then return
    :func:`_attention` over the absolute positions with ``sliding_window`` W (the ring's size) and
    ``kv_len`` (``cache_len`` when None) as the key bound; ``attn_mask`` spans absolute positions.
    One op for both because a chunk's tail may overwrite keys its first queries see
    (:mod:`kvcompile.ring`).
    """
    fmts = dict(k_fmt=format_arg(k_format, "attention_ring", "k_format"),
                v_fmt=format_arg(v_format, "attention_ring", "v_format"))
    _check_attention_ring(q, k_q, k_scale, v_q, v_scale, k, v, softcap, sinks, k_rotation, v_rotation, *fmts.values())
    return ring_ops.attention(q, k_q, k_scale, v_q, v_scale, cache_len, k, v, k_offset, kv_len, attn_mask, is_causal,
                              scale, softcap, sinks, k_rotation, v_rotation, **fmts)


def _attention_ring_fake(q, k_q, k_scale, v_q, v_scale, cache_len, k, v, k_offset, kv_len, attn_mask, is_causal,
                         scale, softcap=0.0, sinks=None, k_rotation=None, v_rotation=None, k_format=-1, v_format=-1):
    _check_attention_ring(q, k_q, k_scale, v_q, v_scale, k, v, softcap, sinks, k_rotation, v_rotation,
                          format_arg(k_format, "attention_ring", "k_format"),
                          format_arg(v_format, "attention_ring", "v_format"))
    return q.new_empty(q.shape)


attention_ring = _register(
    "attention_ring(Tensor q, Tensor(a0!) k_q, Tensor(a1!) k_scale, Tensor(a2!) v_q, Tensor(a3!) v_scale, "
    "Tensor cache_len, Tensor k, Tensor v, Tensor? k_offset, Tensor? kv_len, Tensor? attn_mask, bool is_causal, "
    "float? scale, float softcap=0., Tensor? sinks=None, Tensor? k_rotation=None, Tensor? v_rotation=None, "
    "int k_format=-1, int v_format=-1) -> Tensor",
    _attention_ring, _attention_ring_fake)

"""The ``kvcompile`` torch.library ops: ``store_kv``, ``dequantize``, ``attention``, and for a sliding
layer's ring (:mod:`kvcompile.ring`, which implements them) ``dequantize_ring`` and ``attention_ring``.

Each op is defined on a ``torch.library.Library`` (:func:`_register`) from its implementation and
its fake, right below each other; the implementation's docstring is the op's contract. It goes
through one dispatch point, :func:`kernel_backend`, which picks the Triton launchers in
:mod:`kvcompile.kernels` or the pure-torch reference in :mod:`kvcompile.reference` per call:

``KVCOMPILE_KERNELS=auto`` (default)  Triton on CUDA tensors, "native" on the CPU where it builds,
                                      reference elsewhere;
``KVCOMPILE_KERNELS=triton``          Triton always (CPU tensors need ``TRITON_INTERPRET=1``);
``KVCOMPILE_KERNELS=native``          CPU tensors only: the reference, with decode attention in one C
                                      call where it applies (:mod:`kvcompile.native`);
``KVCOMPILE_KERNELS=reference``       the reference always.

Opaque ops (not ``triton_op``) on purpose: Inductor does not look inside, so the same compiled
graph runs on CPU CI with the reference and on a GPU with Triton.

Shapes (``B`` batch, ``Hq``/``Hkv`` query/kv heads, ``L`` max_cache_len, ``D`` head_dim,
``G`` scale groups per token):

* codes ``[B, Hkv, L, D]`` float8_e4m3fn or int8;
* scales ``[B, Hkv, L, G]`` (G = 1 or D/32) written by ``store_kv``, or static ``[Hkv]``;
* ``k_offset`` ``[Hkv, D]`` float32 (K centering) or None;
* ``k_rotation`` / ``v_rotation`` / ``rotation``: an orthonormal ``[D, D]`` float32 matrix R
  (:mod:`kvcompile.rotation`) or None. A rotated side stores ``quantize(x @ R - offset)`` (the
  offset then lives in rotated space); ``dequantize`` returns ``(codes * scale + offset) @ R^T``.
  ``attention`` takes the same R of a rotated side and works in its space: scores use ``q @ R_k``
  (``(q R)(k R)^T = q k^T``) and the output is multiplied by ``R_v^T``; on the Triton path the launch
  plan says where (``kernels/plan.py``: q in the decode kernel's prologue and the output in its
  split-K merge for the caches' shared matrix);
* ``kv_len``: int tensor, ``[]`` or ``[B]``: how many positions of the cache hold data.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from . import native, reference, ring as ring_ops

__all__ = ["store_kv", "dequantize", "attention", "dequantize_ring", "attention_ring", "kernel_backend"]

_BACKENDS = ("auto", "triton", "native", "reference")


def sizing_advice(start: int, length: int) -> str:
    """The fix for a write of ``length`` positions at ``start`` past ``max_cache_len``. A write of several
    positions after the first (a later prompt chunk, a speculative step) may also be
    ``generate(use_cache=False)`` with a cache: it feeds the whole sequence again each step, so no
    ``max_cache_len`` is enough."""
    advice = f"build the cache with max_cache_len>={start + length} (for generate(): prompt tokens + max_new_tokens)"
    if start > 0 and length > 1:
        advice += ("; if this is generate(use_cache=False), it feeds the whole sequence again each step and "
                   "fills any cache: pass no cache, or leave use_cache on")
    return advice


def kernel_backend(device: torch.device) -> str:
    """"triton", "native" or "reference" for tensors on ``device``, from ``KVCOMPILE_KERNELS`` (read
    per call). "native" is the reference with the CPU's C decode attention (:mod:`kvcompile.native`)."""
    choice = os.environ.get("KVCOMPILE_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _BACKENDS:
        raise ValueError(f"KVCOMPILE_KERNELS={choice!r} is not one of {list(_BACKENDS)}")
    if choice == "auto":
        if device.type == "cuda":
            return "triton"
        return "native" if device.type == "cpu" and native.available() else "reference"
    if choice == "native":
        if device.type != "cpu":
            raise RuntimeError(f"KVCOMPILE_KERNELS=native runs on CPU tensors only, got {device.type} tensors; "
                               "use KVCOMPILE_KERNELS=auto")
        if not native.available():
            raise RuntimeError(f"KVCOMPILE_KERNELS=native: {native.status()}")
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "KVCOMPILE_KERNELS=triton on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing triton, or use KVCOMPILE_KERNELS=reference"
        )
    return choice


def _kernels():
    from . import kernels  # lazy: triton is imported only when a kernel runs

    return kernels


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
# input checks shared by the ops (metadata only: no host sync)
# ---------------------------------------------------------------------------------------------


def _check_codes_scale(name: str, codes: Tensor, scale: Tensor) -> None:
    if codes.dtype not in (torch.float8_e4m3fn, torch.int8):
        raise TypeError(f"kvcompile: {name} codes must be float8_e4m3fn or int8, got {codes.dtype}")
    if codes.dim() != 4:
        raise ValueError(f"kvcompile: {name} codes must be [B, Hkv, L, D], got shape {tuple(codes.shape)}")
    B, H, L, D = codes.shape
    if scale.dim() == 1:
        if scale.shape[0] != H:
            raise ValueError(f"kvcompile: static {name} scale must be [Hkv={H}], got {tuple(scale.shape)}")
    elif scale.dim() == 4:
        if tuple(scale.shape[:3]) != (B, H, L) or D % scale.shape[3] != 0:
            raise ValueError(
                f"kvcompile: {name} scale must be [B, Hkv, L, G] with G dividing D={D} for codes "
                f"{tuple(codes.shape)}, got {tuple(scale.shape)}"
            )
    else:
        raise ValueError(f"kvcompile: {name} scale must be [Hkv] or [B, Hkv, L, G], got {tuple(scale.shape)}")


def _check_rotation(name: str, rotation: Optional[Tensor], codes: Tensor) -> None:
    if rotation is None:
        return
    D = codes.shape[-1]
    if rotation.shape != (D, D) or rotation.dtype != torch.float32 or rotation.device != codes.device:
        raise ValueError(
            f"kvcompile: {name} must be a float32 [D, D] = [{D}, {D}] matrix on {codes.device}, got "
            f"{rotation.dtype} {tuple(rotation.shape)} on {rotation.device}"
        )


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------


def _store_kv(
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
    ring: bool = False,
) -> None:
    """Quantize ``k, v`` [B, Hkv, T, D] into the caches at positions ``start + arange(T)``.

    ``start`` is a 0-d int tensor (the cache's current length). Static scales ([Hkv]) are read,
    not written. ``k_rotation`` / ``v_rotation`` ([D, D]) rotate K / V first (``x @ R``, float32);
    ``k_offset`` ([Hkv, D], in K's rotated space when K is rotated) is then subtracted from K.
    K and V may use different formats that share one scale granularity.
    Writing past the end of the cache fails (a device-side assert on CUDA; no host sync).
    ``ring``: the caches are a sliding layer's ring of ``W = L`` slots (:mod:`kvcompile.ring`):
    position ``p`` goes to slot ``p % W`` and of a chunk longer than W only its last W tokens stay.
    """
    if ring:
        ring_ops.store_kv(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation, v_rotation)
        return
    backend = kernel_backend(k.device)
    if backend == "native" and native.store_kv(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation,
                                               v_rotation):
        return  # kvcompile.native takes only inputs it has checked; the checks below name what it declined
    _check_codes_scale("k", k_cache, k_scale)
    _check_codes_scale("v", v_cache, v_scale)
    _check_rotation("k_rotation", k_rotation, k_cache)
    _check_rotation("v_rotation", v_rotation, v_cache)
    if k.shape[:2] != k_cache.shape[:2] or k.shape[3] != k_cache.shape[3] or k.shape != v.shape:
        raise ValueError(
            f"kvcompile.store_kv: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit caches "
            f"{tuple(k_cache.shape)} (need [B, Hkv, T, D] with the cache's B, Hkv and D)"
        )
    if k.device.type == "cpu":  # a host read is free here (and the reference reads start anyway)
        first = int(start)
        end = first + k.shape[2]
        if end > k_cache.shape[2]:
            raise RuntimeError(  # the error type the device assert raises
                f"kvcompile.store_kv: positions {first}..{end - 1} do not fit max_cache_len={k_cache.shape[2]}; "
                + sizing_advice(first, k.shape[2]))
    else:  # a device assert: its message is fixed when the op is traced
        past_end = "kvcompile.store_kv: writing past max_cache_len; build the cache with a larger max_cache_len"
        torch._assert_async(start + k.shape[2] <= k_cache.shape[2], past_end)
    if backend == "triton":
        _kernels().store_kv(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation, v_rotation)
    else:
        reference.store_kv(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation, v_rotation)


def _store_kv_fake(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation=None, v_rotation=None,
                   ring=False) -> None:
    return None


store_kv = _register(
    "store_kv(Tensor(a0!) k_cache, Tensor(a1!) k_scale, Tensor(a2!) v_cache, Tensor(a3!) v_scale, Tensor k, "
    "Tensor v, Tensor start, Tensor? k_offset, Tensor? k_rotation=None, Tensor? v_rotation=None, "
    "bool ring=False) -> ()",
    _store_kv, _store_kv_fake)


# ---------------------------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------------------------


def _dequantize(
    codes: Tensor,
    scale: Tensor,
    offset: Optional[Tensor],
    kv_len: Tensor,
    dtype: torch.dtype,
    rotation: Optional[Tensor] = None,
    sliding_window: int = 0,
) -> Tensor:
    """codes [B, Hkv, L, D] -> values [B, Hkv, L, D] in ``dtype``; positions >= kv_len are zeros.

    ``offset`` ([Hkv, D], K centering) is added back and ``rotation`` R ([D, D]) undone:
    ``(codes * scale + offset) @ R^T`` (float32), so the result is the value that was stored, in
    the model's own space. ``sliding_window`` is the layer's attention window (0 = full attention):
    metadata for the compiler pass only; it does not change the result (in eager mode the model's
    mask applies the window). This is the eager path of :class:`kvcompile.QuantizedCache`; the
    compiler pass replaces attention over its result by :func:`attention`, which reads the codes
    directly.
    """
    _check_codes_scale("dequantize", codes, scale)
    _check_rotation("rotation", rotation, codes)
    if sliding_window < 0:
        raise ValueError(f"kvcompile.dequantize: sliding_window must be >= 0 (0 = full attention), got {sliding_window}")
    if kernel_backend(codes.device) == "triton":
        return _kernels().dequantize(codes, scale, offset, kv_len, dtype, rotation)
    return reference.dequantize(codes, scale, offset, kv_len, dtype, rotation)


def _dequantize_fake(codes, scale, offset, kv_len, dtype, rotation=None, sliding_window=0):
    return codes.new_empty(codes.shape, dtype=dtype)


dequantize = _register(
    "dequantize(Tensor codes, Tensor scale, Tensor? offset, Tensor kv_len, ScalarType dtype, Tensor? rotation=None, "
    "SymInt sliding_window=0) -> Tensor",
    _dequantize, _dequantize_fake)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def _check_window_softcap(sliding_window: int, softcap: float) -> None:
    if sliding_window < 0:
        raise ValueError(
            f"kvcompile.attention: sliding_window must be >= 0 (the number of keys a query sees, 0 = full "
            f"attention), got {sliding_window}"
        )
    if not softcap >= 0 or math.isinf(softcap):
        raise ValueError(
            f"kvcompile.attention: softcap must be a finite number >= 0 (Gemma 2's attn_logit_softcapping, "
            f"0 = none), got {softcap}"
        )


def _check_attention(q: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor,
                     sliding_window: int, softcap: float, sinks: Optional[Tensor],
                     k_rotation: Optional[Tensor] = None, v_rotation: Optional[Tensor] = None) -> None:
    """Shapes and the window / softcap / sinks / rotation arguments of ``attention`` (metadata only)."""
    _check_codes_scale("k", k_q, k_scale)
    _check_codes_scale("v", v_q, v_scale)
    _check_rotation("k_rotation", k_rotation, k_q)
    _check_rotation("v_rotation", v_rotation, v_q)
    if q.dim() != 4 or q.shape[0] != k_q.shape[0] or q.shape[3] != k_q.shape[3]:
        raise ValueError(
            f"kvcompile.attention: q {tuple(q.shape)} does not fit cache {tuple(k_q.shape)} "
            "(need q [B, Hq, Tq, D] with the cache's B and D)"
        )
    if q.shape[1] % k_q.shape[1] != 0:
        raise ValueError(
            f"kvcompile.attention: {q.shape[1]} query heads are not a multiple of {k_q.shape[1]} kv heads"
        )
    if v_q.shape != k_q.shape:
        raise ValueError(f"kvcompile.attention: v codes {tuple(v_q.shape)} differ from k codes {tuple(k_q.shape)}")
    _check_window_softcap(sliding_window, softcap)
    if sinks is not None:
        if not sinks.dtype.is_floating_point or sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
            raise ValueError(
                f"kvcompile.attention: sinks must be a floating tensor [Hq={q.shape[1]}] (one logit per query "
                f"head), got {sinks.dtype} {tuple(sinks.shape)}; pass the attention module's `sinks` parameter"
            )
        if sinks.device != q.device:
            raise ValueError(
                f"kvcompile.attention: sinks are on {sinks.device} and q on {q.device}; move them to q's device"
            )


def _attention(
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
) -> Tensor:
    """Attention of ``q`` [B, Hq, Tq, D] over the 8-bit cache, output [B, Hq, Tq, D] in q.dtype.

    * keys at positions >= ``kv_len[b]`` are excluded; a ``kv_len[b]`` above L makes all L keys
      visible (the bound a ring past its window passes: its token count);
    * GQA/MQA: query head h reads kv head ``h // (Hq // Hkv)`` (as repeat_kv / enable_gqa);
    * ``attn_mask``: bool (True = attend) or additive float, broadcastable to [B, Hq, Tq, L];
    * ``is_causal``: query i sits at absolute position ``kv_len - Tq + i`` (the new tokens are
      the last Tq of the cache) and sees keys at positions <= its own;
    * ``scale``: softmax scale, default ``D ** -0.5``;
    * ``sliding_window`` W > 0: the query at position p (the alignment ``is_causal`` uses) sees
      only keys at positions > p - W (HF: ``kv_idx > q_idx - W``); a lower bound only, the upper
      bound comes from is_causal / the mask / kv_len. 0 = no window;
    * ``softcap`` c > 0: each scaled logit s becomes ``c * tanh(s / c)`` before the mask is
      added (Gemma 2's ``attn_logit_softcapping``). 0 = none;
    * ``sinks`` [Hq] float or None: one extra logit per query head in the softmax denominator
      (``exp(sink - max)``), with no value (gpt-oss);
    * a query row with no visible key returns zeros (with sinks too);
    * K and V may hold different code types (e4m3 / int8) with the same scale granularity;
    * K centering offsets never enter: softmax is invariant to a per-query constant;
    * ``k_rotation`` / ``v_rotation`` ([D, D] float32 or None): the side's codes hold ``x @ R``
      (the cache's rotation); the result is attention over the un-rotated K / V, computed in the
      rotated space (``q @ R_k`` in float32, the output times ``R_v^T``).
    """
    backend = kernel_backend(q.device)
    if backend == "native" and q.dim() == 4:  # reads only the stored keys; None where C does not apply
        _check_window_softcap(sliding_window, softcap)
        out = native.attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal,
                               q.shape[-1] ** -0.5 if scale is None else scale, sliding_window, softcap, sinks,
                               k_rotation, v_rotation)
        if out is not None:  # kvcompile.native takes only inputs it has checked
            return out
    _check_attention(q, k_q, k_scale, v_q, v_scale, sliding_window, softcap, sinks, k_rotation, v_rotation)
    if backend == "triton":
        return _kernels().attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale,
                                    sliding_window, softcap, sinks, k_rotation, v_rotation)
    return reference.attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale,
                               sliding_window, softcap, sinks, k_rotation, v_rotation)


def _attention_fake(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale, sliding_window=0,
                    softcap=0.0, sinks=None, k_rotation=None, v_rotation=None):
    _check_attention(q, k_q, k_scale, v_q, v_scale, sliding_window, softcap, sinks,
                     k_rotation, v_rotation)  # errors at trace time
    # dense [B, Hq, Tq, D] whatever q's strides (HF's q is a transposed view): the kernels and
    # the reference both write a contiguous output
    return q.new_empty(q.shape)


attention = _register(
    "attention(Tensor q, Tensor k_q, Tensor k_scale, Tensor v_q, Tensor v_scale, Tensor kv_len, Tensor? attn_mask, "
    "bool is_causal, float? scale, SymInt sliding_window=0, float softcap=0., Tensor? sinks=None, "
    "Tensor? k_rotation=None, Tensor? v_rotation=None) -> Tensor",
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
) -> Tensor:
    """A ring of ``W = L`` slots plus ``new`` [B, Hkv, T, D] (raw values, about to be stored at
    ``kv_len``, the tokens stored so far) -> values [B, Hkv, ``length``, D] in ``dtype`` at absolute
    positions: the ring's positions ``[kv_len - W + 1, kv_len)``, ``new`` at ``[kv_len, kv_len + T)``
    quantized as ``store_kv`` quantizes it, zeros elsewhere. The arguments before ``new`` are
    :func:`_dequantize`'s (``sliding_window`` is W, the ring's size). The eager path of a sliding
    layer's ring; the compiler pass replaces attention over it by :func:`_attention_ring`.
    """
    _check_codes_scale("dequantize_ring", codes, scale)
    _check_rotation("rotation", rotation, codes)
    if sliding_window != codes.shape[2]:
        raise ValueError(f"kvcompile.dequantize_ring: a ring of {codes.shape[2]} slots serves a window of as many "
                         f"positions, got sliding_window={sliding_window}")
    if new.dim() != 4 or new.shape[:2] != codes.shape[:2] or new.shape[3] != codes.shape[3]:
        raise ValueError(f"kvcompile.dequantize_ring: new {tuple(new.shape)} does not fit the ring {tuple(codes.shape)}")
    return ring_ops.dequantize(codes, scale, offset, kv_len, dtype, rotation, new, length)


def _dequantize_ring_fake(codes, scale, offset, kv_len, dtype, rotation, sliding_window, new, length):
    B, H, _, D = codes.shape
    return codes.new_empty((B, H, length, D), dtype=dtype)


dequantize_ring = _register(
    "dequantize_ring(Tensor codes, Tensor scale, Tensor? offset, Tensor kv_len, ScalarType dtype, Tensor? rotation, "
    "SymInt sliding_window, Tensor new, SymInt length) -> Tensor",
    _dequantize_ring, _dequantize_ring_fake)


def _check_attention_ring(q, k_q, k_scale, v_q, v_scale, k, v, softcap, sinks, k_rotation, v_rotation) -> None:
    _check_attention(q, k_q, k_scale, v_q, v_scale, k_q.shape[2], softcap, sinks, k_rotation, v_rotation)
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
) -> Tensor:
    """Store ``k, v`` [B, Hkv, T, D] into a sliding layer's ring at ``[cache_len - T, cache_len)``
    (``cache_len``: the tokens stored once they are in; as ``store_kv(ring=True)``), then return
    :func:`_attention` over the absolute positions with ``sliding_window`` W (the ring's size) and
    ``kv_len`` (``cache_len`` when None) as the key bound; ``attn_mask`` spans absolute positions.
    One op for both because a chunk's tail may overwrite keys its first queries see
    (:mod:`kvcompile.ring`).
    """
    _check_attention_ring(q, k_q, k_scale, v_q, v_scale, k, v, softcap, sinks, k_rotation, v_rotation)
    return ring_ops.attention(q, k_q, k_scale, v_q, v_scale, cache_len, k, v, k_offset, kv_len, attn_mask, is_causal,
                              scale, softcap, sinks, k_rotation, v_rotation)


def _attention_ring_fake(q, k_q, k_scale, v_q, v_scale, cache_len, k, v, k_offset, kv_len, attn_mask, is_causal,
                         scale, softcap=0.0, sinks=None, k_rotation=None, v_rotation=None):
    _check_attention_ring(q, k_q, k_scale, v_q, v_scale, k, v, softcap, sinks, k_rotation, v_rotation)
    return q.new_empty(q.shape)


attention_ring = _register(
    "attention_ring(Tensor q, Tensor(a0!) k_q, Tensor(a1!) k_scale, Tensor(a2!) v_q, Tensor(a3!) v_scale, "
    "Tensor cache_len, Tensor k, Tensor v, Tensor? k_offset, Tensor? kv_len, Tensor? attn_mask, bool is_causal, "
    "float? scale, float softcap=0., Tensor? sinks=None, Tensor? k_rotation=None, Tensor? v_rotation=None) -> Tensor",
    _attention_ring, _attention_ring_fake)

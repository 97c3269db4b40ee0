"""The implementations behind the ``kvcompile`` ops (:mod:`kvcompile.ops` registers them) and their
one dispatch point, :func:`kernel_backend`, which picks the Triton launchers in
:mod:`kvcompile.kernels` or the pure-torch reference in :mod:`kvcompile.reference` per call:

``KVCOMPILE_KERNELS=auto`` (default)  Triton on CUDA tensors, "native" on the CPU where it builds,
                                      reference elsewhere;
``KVCOMPILE_KERNELS=triton``          Triton always (CPU tensors need ``TRITON_INTERPRET=1``);
``KVCOMPILE_KERNELS=native``          CPU tensors only: the reference, with decode attention in one C
                                      call where it applies (:mod:`kvcompile.native`);
``KVCOMPILE_KERNELS=reference``       the reference always.

Each implementation's docstring is its op's contract; the input checks they share (metadata only:
no host sync) are here too. A sliding layer's ring (:mod:`kvcompile.ring`) is composed from these
plain implementations; nothing here imports the ring or the registration.

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

from . import formats, native, reference
from .formats import KVFormat

__all__ = ["store_kv", "dequantize", "attention", "kernel_backend", "launchers", "sizing_advice"]

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


def launchers():
    """:mod:`kvcompile.kernels`, the Triton launchers (imported late: triton loads only when a kernel runs)."""
    from . import kernels

    return kernels


# ---------------------------------------------------------------------------------------------
# input checks shared by the ops (metadata only: no host sync)
# ---------------------------------------------------------------------------------------------


def format_arg(format_id: int, op: str, arg: str) -> KVFormat:
    """The :class:`KVFormat` an op's ``k_format`` / ``v_format`` / ``format`` argument names: the
    cache's ``KVFormat.id`` (the cache and the compiler pass always give it). The schemas default it
    to -1 only because a positional argument after defaulted ones needs a default; -1 is refused:
    the format is never read off the tensors."""
    if format_id == -1:
        raise ValueError(
            f"kvcompile.{op}: pass {arg}=KVFormat.id, the id of the format the codes hold (a cache layer's "
            f"k_fmt.id / v_fmt.id, or kvcompile.formats.get_format(kv_dtype, granularity).id); kvcompile does "
            "not read a format off the tensors")
    return formats.from_id(format_id)


def _check_codes_scale(name: str, codes: Tensor, scale: Tensor, fmt: KVFormat) -> None:
    """Codes and scales are what format ``fmt`` stores (checked, never inferred)."""
    if codes.dtype != fmt.code_dtype:
        raise TypeError(f"kvcompile: {name} codes in {fmt.name} must be {fmt.code_dtype}, got {codes.dtype}")
    if codes.dim() != 4:
        raise ValueError(f"kvcompile: {name} codes must be [B, Hkv, L, D], got shape {tuple(codes.shape)}")
    B, H, L, D = codes.shape
    want = (H,) if fmt.is_static else (B, H, L, fmt.groups(D))
    if tuple(scale.shape) != want or scale.dtype != (torch.float32 if fmt.is_static else fmt.scale_dtype):
        raise ValueError(
            f"kvcompile: {name} scale in {fmt.name} must be {'float32' if fmt.is_static else fmt.scale_dtype} "
            f"{list(want)} for codes {tuple(codes.shape)}, got {scale.dtype} {tuple(scale.shape)}"
        )


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
# store_kv, dequantize, attention
# ---------------------------------------------------------------------------------------------


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
    k_fmt: KVFormat,
    v_fmt: KVFormat,
) -> None:
    """Quantize ``k, v`` [B, Hkv, T, D] into the caches at positions ``start + arange(T)``, in the
    formats ``k_fmt`` / ``v_fmt`` (the op's ``k_format`` / ``v_format`` ids).

    ``start`` is a 0-d int tensor (the cache's current length). Static scales ([Hkv]) are read,
    not written. ``k_rotation`` / ``v_rotation`` ([D, D]) rotate K / V first (``x @ R``, float32);
    ``k_offset`` ([Hkv, D], in K's rotated space when K is rotated) is then subtracted from K.
    K and V may use different formats that share one scale granularity.
    Writing past the end of the cache fails (a device-side assert on CUDA; no host sync).
    """
    backend = kernel_backend(k.device)
    if backend == "native" and native.store_kv(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation,
                                               v_rotation, k_fmt, v_fmt):
        return  # kvcompile.native takes only inputs it has checked; the checks below name what it declined
    _check_codes_scale("k", k_cache, k_scale, k_fmt)
    _check_codes_scale("v", v_cache, v_scale, v_fmt)
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
        launchers().store_kv(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation, v_rotation,
                             k_fmt=k_fmt, v_fmt=v_fmt)
    else:
        reference.store_kv(k_cache, k_scale, v_cache, v_scale, k, v, start, k_offset, k_rotation, v_rotation,
                           k_fmt=k_fmt, v_fmt=v_fmt)


def dequantize(
    codes: Tensor,
    scale: Tensor,
    offset: Optional[Tensor],
    kv_len: Tensor,
    dtype: torch.dtype,
    rotation: Optional[Tensor] = None,
    sliding_window: int = 0,
    *,
    fmt: KVFormat,
) -> Tensor:
    """codes [B, Hkv, L, D] in format ``fmt`` -> values [B, Hkv, L, D] in ``dtype``; positions >= kv_len are zeros.

    ``offset`` ([Hkv, D], K centering) is added back and ``rotation`` R ([D, D]) undone:
    ``(codes * scale + offset) @ R^T`` (float32), so the result is the value that was stored, in
    the model's own space. ``sliding_window`` is the layer's attention window (0 = full attention):
    metadata for the compiler pass only; it does not change the result (in eager mode the model's
    mask applies the window). This is the eager path of :class:`kvcompile.QuantizedCache`; the
    compiler pass replaces attention over its result by ``kvcompile::attention``, which reads the codes
    directly.
    """
    _check_codes_scale("dequantize", codes, scale, fmt)
    _check_rotation("rotation", rotation, codes)
    if sliding_window < 0:
        raise ValueError(f"kvcompile.dequantize: sliding_window must be >= 0 (0 = full attention), got {sliding_window}")
    if kernel_backend(codes.device) == "triton":
        return launchers().dequantize(codes, scale, offset, kv_len, dtype, rotation, fmt=fmt)
    return reference.dequantize(codes, scale, offset, kv_len, dtype, rotation, fmt=fmt)


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
                     k_rotation: Optional[Tensor], v_rotation: Optional[Tensor], k_fmt: KVFormat,
                     v_fmt: KVFormat) -> None:
    """Shapes, formats and the window / softcap / sinks / rotation arguments of ``attention`` (metadata only)."""
    _check_codes_scale("k", k_q, k_scale, k_fmt)
    _check_codes_scale("v", v_q, v_scale, v_fmt)
    formats.check_pair(k_fmt, v_fmt)
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
    *,
    k_fmt: KVFormat,
    v_fmt: KVFormat,
) -> Tensor:
    """Attention of ``q`` [B, Hq, Tq, D] over the 8-bit cache (K in ``k_fmt``, V in ``v_fmt``: the
    op's ``k_format`` / ``v_format`` ids), output [B, Hq, Tq, D] in q.dtype.

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
                               k_rotation, v_rotation, k_fmt, v_fmt)
        if out is not None:  # kvcompile.native takes only inputs it has checked
            return out
    _check_attention(q, k_q, k_scale, v_q, v_scale, sliding_window, softcap, sinks, k_rotation, v_rotation,
                     k_fmt, v_fmt)
    if backend == "triton":
        return launchers().attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale,
                                    sliding_window, softcap, sinks, k_rotation, v_rotation, k_fmt=k_fmt, v_fmt=v_fmt)
    return reference.attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale,
                               sliding_window, softcap, sinks, k_rotation, v_rotation, k_fmt=k_fmt, v_fmt=v_fmt)

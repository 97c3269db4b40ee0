"""The CPU's decode step as C calls (``attend.c``), built at first use: the store and the attention.

On the CPU a decode step's store and attention over the 8-bit cache are small (SmolLM2-135M: 3 kv
heads x 64 dims per new token, 9 query heads over the stored keys), and the reference's dozens of
torch calls cost more than the arithmetic: each runs cold between two layers' weight streams (in
SmolLM2-135M's decode on two cores, ~300 us per op call against ~100 for SDPA).

* :func:`store_kv` quantizes and writes the new tokens in one call, bit for bit the reference's
  codes and scales; a rotated side within one code step (the rotation's sums run in C's order).
  It covers float32 K/V into every format but static scales.
* :func:`attention` dequantizes the stored keys of each kv head once (the reference's fp32 values)
  and runs float32 attention for the head's query rows. It covers float32 queries with bool or no
  masks, every format, K/V rotations, windows, softcap and sinks.

Each declines (returns False / None, and the caller runs :mod:`kvcompile.reference`) outside what
it covers and for work above :data:`MAX_WORK` multiply-adds (prefill chunks, long contexts), where
torch's threaded kernels are faster.

The library is compiled with the system C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``:
what Inductor needs on the CPU anyway) into ``$KVCOMPILE_CACHE_DIR`` (default
``~/.cache/kvcompile``), keyed by the source, the compiler and the host's CPU, in well under a second.
Where no compiler works, :func:`status` says why and the reference runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

import torch
from torch import Tensor

__all__ = ["attention", "store_kv", "available", "status", "MAX_WORK"]

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attend.c")
# Above this many multiply-adds per call (attention: keys x query heads x queries x head_dim, for
# scores and values each; store: the rotations' products) torch over two or more threads beats one
# C thread: prefill chunks, long contexts.
MAX_WORK = 1 << 22

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded function, or "error": why there is none


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


_FLAGS = (["-O3", "-march=native", "-fopenmp-simd"], ["-O3", "-fopenmp-simd"], ["-O2"])


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    with open(_SRC, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + cc.encode() + _cpu_key().encode() + platform.machine().encode()).hexdigest()[:16]
    root = os.environ.get("KVCOMPILE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvcompile")
    path = os.path.join(root, f"attend-{key}.so")
    if not os.path.exists(path):
        os.makedirs(root, exist_ok=True)
        errors = []
        for flags in _FLAGS:  # -march=native or -fopenmp-simd may be unknown to this compiler
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
            os.close(fd)
            cmd = [cc, *flags, "-std=c11", "-shared", "-fPIC", _SRC, "-o", tmp, "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(tmp, path)  # atomic: another process may be building the same file
                break
            os.unlink(tmp)
            errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[-500:]}")
        else:
            raise RuntimeError("the C compiler failed:\n" + "\n".join(errors))
    lib = ctypes.CDLL(path)
    fn = lib.kvc_attend
    i, i64, p, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    side = [p, i64, i64, i64, i64, i, p, i64, i64, i64, i64, i, i]
    fn.argtypes = [i, i, i, i, i, i64, i64, p, i64, i64, i64, p, *side, *side,
                   p, p, i64, i64, i64, i64, i, i64, f32, f32, p, p, p]
    fn.restype = i
    store = lib.kvc_store
    store_side = [p, i64, i64, i64, i64, i, p, i64, i64, i64, i64, i]
    store.argtypes = [i, i, i, i, i64, p, i64, i64, i64, p, i64, i64, i64, *store_side, *store_side, p, p, p]
    store.restype = None
    return fn, store


def _load():
    lib = _state.get("lib")
    if lib is not None or "error" in _state:
        return lib
    with _lock:
        if "lib" not in _state and "error" not in _state:
            try:
                _state["lib"] = _build()
            except Exception as e:  # noqa: BLE001 - any failure means: run the reference
                _state["error"] = f"{type(e).__name__}: {e}"
    return _state.get("lib")


def available() -> bool:
    """Whether the C decode attention is built and loaded (builds it on the first call)."""
    return _load() is not None


def status() -> str:
    """One line for ``python -m kvcompile info``: the library's path, or why it is not used."""
    if _load() is not None:
        return "C decode path (store and attention, kvcompile/native/attend.c) built"
    return f"C decode path unavailable, the torch reference runs: {_state['error']}"


def _side(codes: Tensor, scale: Tensor) -> list:
    if scale.dim() == 1:
        kind, ss = 2, (0, scale.stride(0), 0, 0)
    else:
        kind, ss = (0 if scale.shape[-1] == 1 else 1), scale.stride()
    return [codes.data_ptr(), *codes.stride(), 0 if codes.dtype == torch.int8 else 1,
            scale.data_ptr(), *ss, kind, 1 if scale.dtype == torch.float16 else 0]


def _mask_strides(mask: Tensor, B: int, Hq: int, Tq: int, hi: int) -> Optional[tuple[int, ...]]:
    """Strides of a bool mask read as [B, Hq, Tq, keys] (0 where it broadcasts), or None if it does not fit."""
    shape, strides = list(mask.shape), list(mask.stride())
    if mask.dim() > 4:
        return None
    shape, strides = [1] * (4 - len(shape)) + shape, [0] * (4 - len(strides)) + strides
    out = []
    for size, stride, want in zip(shape, strides, (B, Hq, Tq, hi)):
        if size == 1:
            out.append(0)
        elif size == want or (want == hi and size >= hi):
            out.append(stride)
        else:
            return None
    return tuple(out)


def attention(q: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor, lens: list[int], lo: int,
              hi: int, attn_mask: Optional[Tensor], is_causal: bool, sm_scale: float, sliding_window: int,
              softcap: float, sinks: Optional[Tensor], k_rotation: Optional[Tensor],
              v_rotation: Optional[Tensor]) -> Optional[Tensor]:
    """The reference's result over keys ``[lo, hi)`` (lengths ``lens`` read already), or None
    where this path does not apply (see the module docstring); arguments checked by the op."""
    B, Hq, Tq, D = q.shape
    if (q.dtype != torch.float32 or q.stride(3) != 1 or k_q.stride(3) != 1 or Tq == 0
            or 2 * (hi - lo) * Hq * Tq * D > MAX_WORK
            or (attn_mask is not None and attn_mask.dtype != torch.bool)
            or (sinks is not None and (sinks.dtype != torch.float32 or sinks.stride(0) != 1))
            or any(r is not None and (r.dtype != torch.float32 or not r.is_contiguous()) for r in (k_rotation, v_rotation))):
        return None
    mask_strides = (0, 0, 0, 0)
    if attn_mask is not None:
        mask_strides = _mask_strides(attn_mask, B, Hq, Tq, hi)
        if mask_strides is None:
            return None
    lib = _load()
    if lib is None:
        return None
    out = torch.empty(B, Hq, Tq, D, dtype=torch.float32)
    rc = lib[0](B, Hq, k_q.shape[1], Tq, D, lo, hi, q.data_ptr(), *q.stride()[:3], out.data_ptr(),
            *_side(k_q, k_scale), *_side(v_q, v_scale), (ctypes.c_int64 * B)(*lens),
            None if attn_mask is None else attn_mask.data_ptr(), *mask_strides,
            int(is_causal), sliding_window, sm_scale, softcap, None if sinks is None else sinks.data_ptr(),
            None if k_rotation is None else k_rotation.data_ptr(), None if v_rotation is None else v_rotation.data_ptr())
    return out if rc == 0 else None


def _f32_matrix(t: Optional[Tensor]) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous())


def _store_side(codes: Tensor, scale: Tensor, D: int) -> Optional[list]:
    """The C store's arguments for one side, or None for static scales (kept by the reference)."""
    if scale.dim() != 4:
        return None
    if codes.dtype == torch.float8_e4m3fn:
        kind = 1
    else:
        kind = 2 if scale.dtype == torch.float16 else 0  # q8_0 / int8 (formats.format_of)
    if scale.dtype != (torch.float16 if kind == 2 else torch.float32):
        return None
    return [codes.data_ptr(), *codes.stride(), kind, scale.data_ptr(), *scale.stride(), D // scale.shape[-1]]


def store_kv(k_cache: Tensor, k_scale: Tensor, v_cache: Tensor, v_scale: Tensor, k: Tensor, v: Tensor, start: int,
             k_offset: Optional[Tensor], k_rotation: Optional[Tensor], v_rotation: Optional[Tensor]) -> bool:
    """Quantize and write ``k, v`` at positions ``start + t`` as the reference does, in one C call;
    False (nothing written) where this path does not apply: other than float32 inputs with unit
    stride along head_dim, static scales, or above :data:`MAX_WORK`. Bounds and shapes are checked
    by the op."""
    B, H, T, D = k.shape
    rotated = k_rotation is not None or v_rotation is not None
    if (2 * B * H * T * D * (D if rotated else 1) > MAX_WORK or k.dtype != torch.float32 or v.dtype != torch.float32
            or k.stride(3) != 1 or v.stride(3) != 1 or D > 1024
            or not (_f32_matrix(k_offset) and _f32_matrix(k_rotation) and _f32_matrix(v_rotation))):
        return False
    ks, vs = _store_side(k_cache, k_scale, D), _store_side(v_cache, v_scale, D)
    lib = _load()
    if ks is None or vs is None or lib is None:
        return False
    lib[1](B, H, T, D, start, k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3], *ks, *vs,
           None if k_offset is None else k_offset.data_ptr(), None if k_rotation is None else k_rotation.data_ptr(),
           None if v_rotation is None else v_rotation.data_ptr())
    return True

"""The CPU's decode step as C calls (``attend.c``), built at first use: the store and the attention.

On the CPU a decode step's store and attention over the 8-bit cache are small (SmolLM2-135M: 3 kv
heads x 64 dims per new token, 9 query heads over the stored keys), and the reference's dozens of
torch calls cost more than the arithmetic: each runs cold between two layers' weight streams (in
SmolLM2-135M's decode on two cores, ~300 us per op call against ~100 for SDPA).

* :func:`store_kv` quantizes and writes the new tokens in one call, bit for bit the reference's
  codes and scales; a rotated side within one code step (the rotation's sums run in C's order).
  It covers float32 K/V into every format but static scales.
* :func:`attention` reads only the stored keys (it takes ``kv_len`` as the op does), each key and
  value once per kv head for all of the head's query rows, and computes the reference's float32
  attention over the stored values (code times scale). It covers float32 queries with bool or no
  masks, every format, K/V rotations, windows, softcap and sinks.

Each declines (returns False / None, and the caller runs :mod:`kvcompile.reference`) outside what
it covers and for work above :data:`MAX_WORK` multiply-adds (prefill chunks; attention of more
than :data:`MAX_QUERIES` queries over long contexts), where torch's threaded kernels are faster.
What either accepts is valid input: a call it takes needs no other check (the op's own checks run
where it declines, and name the problem).

A layer's cache reaches C as one struct of pointers and strides (a *plan*), built the first time
the cache's tensors are seen and reused while the same tensor objects hold the same memory (weak
references: a plan keeps no cache alive and leaves with it). A decode step's call passes the plan,
the query and the per-call arguments: about twenty, where the cache's forty would cost more than
the arithmetic.

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
import weakref
from typing import Optional, Union

import torch
from torch import Tensor

from .. import formats
from ..formats.spec import GRANULARITY_IDS

__all__ = ["attention", "store_kv", "available", "status", "MAX_WORK", "MAX_QUERIES"]

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attend.c")
# Above this many multiply-adds per call (attention: keys x query heads x queries x head_dim, for
# scores and values each; store: the rotations' products) torch over two or more threads beats one
# C thread: prefill chunks, long contexts.
MAX_WORK = 1 << 22
# An attention call of at most this many queries runs in C at any length (decode steps, short
# verify chunks): its cost is converting each stored key once, which the reference pays too, in
# more passes. Measured on 2 cores at SmolLM2's shape: C 3x torch at 4096 keys and 4 queries,
# torch 2x C at 1024 keys and 16.
MAX_QUERIES = 4

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


def defines() -> list[str]:
    """The ids attend.c knows the formats by, from the registry (one numbering: kvcompile.formats.spec):
    ``-DKVC_CODE_<NAME>=<FormatSpec.id>`` per format and ``-DKVC_SCALE_<GRANULARITY>=<id>``; attend.c
    refuses to build without them."""
    codes = [f"-DKVC_CODE_{s.name.upper()}={s.id}" for s in formats.specs()]
    return codes + [f"-DKVC_SCALE_{g.upper()}={i}" for g, i in GRANULARITY_IDS.items()]


class _Side(ctypes.Structure):
    """attend.c's side_t: one side (K or V) of a layer's cache."""

    _fields_ = [("codes", ctypes.c_void_p), ("cb", ctypes.c_int64), ("ch", ctypes.c_int64), ("cl", ctypes.c_int64),
                ("cd", ctypes.c_int64), ("scale", ctypes.c_void_p), ("sb", ctypes.c_int64), ("sh", ctypes.c_int64),
                ("sl", ctypes.c_int64), ("sg", ctypes.c_int64), ("code_kind", ctypes.c_int32),
                ("scale_kind", ctypes.c_int32), ("scale_f16", ctypes.c_int32), ("group", ctypes.c_int32)]


class _Cache(ctypes.Structure):
    """attend.c's cache_t: a layer's K and V sides, rotations and sizes."""

    _fields_ = [("k", _Side), ("v", _Side), ("k_rot", ctypes.c_void_p), ("v_rot", ctypes.c_void_p),
                ("B", ctypes.c_int64), ("H", ctypes.c_int64), ("L", ctypes.c_int64), ("D", ctypes.c_int64)]


def _build() -> tuple:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    with open(_SRC, "rb") as f:
        src = f.read()
    ids = defines()
    key = hashlib.sha256(src + cc.encode() + _cpu_key().encode() + platform.machine().encode()
                         + " ".join(ids).encode()).hexdigest()[:16]
    root = os.environ.get("KVCOMPILE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvcompile")
    path = os.path.join(root, f"attend-{key}.so")
    if not os.path.exists(path):
        os.makedirs(root, exist_ok=True)
        errors = []
        for flags in _FLAGS:  # -march=native or -fopenmp-simd may be unknown to this compiler
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
            os.close(fd)
            cmd = [cc, *flags, *ids, "-std=c11", "-shared", "-fPIC", _SRC, "-o", tmp, "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(tmp, path)  # atomic: another process may be building the same file
                break
            os.unlink(tmp)
            errors.append(f"{' '.join(cmd)}: {r.stderr.strip()[-500:]}")
        else:
            raise RuntimeError("the C compiler failed:\n" + "\n".join(errors))
    lib = ctypes.CDLL(path)
    i, i64, p, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    attend = lib.kvc_attend
    attend.argtypes = [p, i, i, i, p, i64, i64, i64, p, p, i, p, i64, i64, i64, i64, i64, i, i64, f32, f32, p, i64, i]
    attend.restype = i
    store = lib.kvc_store
    store.argtypes = [p, i, i, p, i64, i64, i64, p, i64, i64, i64, p, p]
    store.restype = i
    return attend, store


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


# ---------------------------------------------------------------------------------------------
# plans: a layer's cache as the C calls read it, built once per cache
# ---------------------------------------------------------------------------------------------


def _no_tensor() -> None:
    return None


def _ref(t: Optional[Tensor]):
    return _no_tensor if t is None else weakref.ref(t)


class _Plan:
    """A layer's :class:`_Cache` and what the C calls can do with it. Valid while the same tensor
    objects (weak references: a plan keeps no cache alive) hold the same memory."""

    __slots__ = ("refs", "ptrs", "cache", "addr", "B", "H", "D", "attend", "store", "fmts", "__weakref__")

    def matches(self, tensors: tuple) -> bool:
        refs = self.refs
        return (refs[0]() is tensors[0] and refs[1]() is tensors[1] and refs[2]() is tensors[2]
                and refs[3]() is tensors[3] and refs[4]() is tensors[4] and refs[5]() is tensors[5]
                and self.ptrs == (tensors[0].data_ptr(), tensors[1].data_ptr(), tensors[2].data_ptr(),
                                  tensors[3].data_ptr()))


_plans: dict[int, _Plan] = {}  # id(k codes) -> its plan; an entry leaves with its k codes


def _side(codes: Tensor, scale: Tensor, D: int, fmt: formats.KVFormat) -> tuple[_Side, bool, bool]:
    """(the side's struct, whether the attention reads it, whether the store writes it) of codes in ``fmt``:
    its code kind is ``fmt.spec.id``, its scale kind ``fmt.scale_mode`` (attend.c's ids: :func:`defines`)."""
    # static: one scale per kv head, read not written
    ss = (0, scale.stride(0), 0, 0) if fmt.is_static else scale.stride()
    side = _Side(codes.data_ptr(), *codes.stride(), scale.data_ptr(), *ss, fmt.spec.id, fmt.scale_mode,
                 int(fmt.scale_dtype == torch.float16), fmt.group_size(D))
    fits = codes.dtype == fmt.code_dtype and (scale.dtype == torch.float32 if fmt.is_static else
                                              scale.dtype == fmt.scale_dtype and scale.shape[3] == fmt.groups(D))
    readable = fits and (codes.stride(3) == 1 or codes.stride(2) == 1)
    return side, readable, fits and not fmt.is_static


def _new_plan(k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor, k_rotation: Optional[Tensor],
              v_rotation: Optional[Tensor], k_fmt: formats.KVFormat, v_fmt: formats.KVFormat) -> _Plan:
    plan = _Plan()
    plan.attend = plan.store = False
    rots = [r for r in (k_rotation, v_rotation) if r is not None]
    B, H, L, D = k_q.shape if k_q.dim() == 4 else (0, 0, 0, 0)
    usable = (k_q.dim() == 4 and all(t.device.type == "cpu" for t in (k_q, k_scale, v_q, v_scale, *rots))
              and all(t.dtype == torch.float32 and t.is_contiguous() and t.shape == (D, D) for t in rots)
              and k_q.dtype in (torch.int8, torch.float8_e4m3fn) and v_q.dtype in (torch.int8, torch.float8_e4m3fn)
              and v_q.shape == k_q.shape and 0 < D <= 1024
              and all(s.dim() == 1 and s.shape[0] == H or s.dim() == 4 and s.shape[:3] == (B, H, L)
                      and s.shape[3] > 0 and D % s.shape[3] == 0 for s in (k_scale, v_scale)))
    if usable:
        plan.B, plan.H, plan.D = B, H, D
        ks, k_read, k_write = _side(k_q, k_scale, D, k_fmt)
        vs, v_read, v_write = _side(v_q, v_scale, D, v_fmt)
        plan.cache = _Cache(ks, vs, None if k_rotation is None else k_rotation.data_ptr(),
                            None if v_rotation is None else v_rotation.data_ptr(), B, H, L, D)
        plan.addr = ctypes.addressof(plan.cache)
        plan.attend = k_read and v_read and k_q.stride(3) == 1  # K is read head_dim-contiguous
        plan.store = k_write and v_write
    tensors = (k_q, k_scale, v_q, v_scale, k_rotation, v_rotation)
    plan.refs = tuple(map(_ref, tensors))
    plan.ptrs = tuple(t.data_ptr() for t in tensors[:4])
    key = id(k_q)
    plan_ref = weakref.ref(plan)
    # the entry leaves with k_q; the check keeps a dying k_q from removing a newer plan for a new tensor
    weakref.finalize(k_q, lambda: _plans.get(key) is plan_ref() and _plans.pop(key, None))
    _plans[key] = plan
    return plan


def _plan(tensors: tuple, k_fmt: formats.KVFormat, v_fmt: formats.KVFormat) -> Optional[_Plan]:
    """The plan of (k codes, k scale, v codes, v scale, k rotation, v rotation) in formats ``k_fmt`` /
    ``v_fmt``, built on a miss; None where the library does not load."""
    plan = _plans.get(id(tensors[0]))
    if plan is not None and plan.matches(tensors) and plan.fmts == (k_fmt, v_fmt):
        return plan
    if _load() is None:
        return None
    plan = _new_plan(*tensors, k_fmt, v_fmt)
    plan.fmts = (k_fmt, v_fmt)
    return plan


# ---------------------------------------------------------------------------------------------
# the calls
# ---------------------------------------------------------------------------------------------


def _mask_strides(mask: Tensor, B: int, Hq: int, Tq: int) -> Optional[tuple[int, ...]]:
    """A bool mask read as [B, Hq, Tq, keys]: its strides (0 where it broadcasts) and its key count, or
    None where it does not fit. C declines a key count below the keys it reads."""
    if mask.dim() > 4 or mask.dtype != torch.bool or mask.device.type != "cpu":
        return None
    shape, strides = (1,) * (4 - mask.dim()) + tuple(mask.shape), (0,) * (4 - mask.dim()) + mask.stride()
    out = []
    for size, stride, want in zip(shape[:3], strides[:3], (B, Hq, Tq)):
        if size != 1 and size != want:
            return None
        out.append(0 if size == 1 else stride)
    return (*out, 0 if shape[3] == 1 else strides[3], shape[3])


def attention(q: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor, kv_len: Tensor,
              attn_mask: Optional[Tensor], is_causal: bool, sm_scale: float, sliding_window: int, softcap: float,
              sinks: Optional[Tensor], k_rotation: Optional[Tensor], v_rotation: Optional[Tensor],
              k_fmt: formats.KVFormat, v_fmt: formats.KVFormat) -> Optional[Tensor]:
    """``kvcompile::attention``'s result, reading only the stored keys (``kv_len``, int64 [] or [B]),
    or None where this path does not apply (see the module docstring)."""
    plan = _plan((k_q, k_scale, v_q, v_scale, k_rotation, v_rotation), k_fmt, v_fmt)
    if plan is None or not plan.attend:
        return None
    if q.dim() != 4:
        return None
    B, Hq, Tq, D = q.shape
    n_len = kv_len.numel()
    if (q.dtype != torch.float32 or q.stride(3) != 1 or q.device.type != "cpu" or Tq == 0 or B != plan.B
            or D != plan.D or Hq % plan.H or kv_len.dtype != torch.int64 or kv_len.device.type != "cpu"
            or (n_len != 1 and (n_len != B or kv_len.stride(-1) != 1))
            or (sinks is not None and (sinks.dtype != torch.float32 or sinks.stride(0) != 1 or sinks.shape != (Hq,)
                                       or sinks.device.type != "cpu"))):
        return None
    mask = (0, 0, 0, 0, 0)
    if attn_mask is not None:
        mask = _mask_strides(attn_mask, B, Hq, Tq)
        if mask is None:
            return None
    out = torch.empty(B, Hq, Tq, D, dtype=torch.float32)
    qs = q.stride()
    rc = _state["lib"][0](plan.addr, B, Hq, Tq, q.data_ptr(), qs[0], qs[1], qs[2], out.data_ptr(),
                          kv_len.data_ptr(), n_len, None if attn_mask is None else attn_mask.data_ptr(), *mask,
                          is_causal, sliding_window, sm_scale, softcap, None if sinks is None else sinks.data_ptr(),
                          MAX_WORK, MAX_QUERIES)
    return out if rc == 0 else None


def store_kv(k_cache: Tensor, k_scale: Tensor, v_cache: Tensor, v_scale: Tensor, k: Tensor, v: Tensor,
             start: Union[Tensor, int], k_offset: Optional[Tensor], k_rotation: Optional[Tensor],
             v_rotation: Optional[Tensor], k_fmt: formats.KVFormat, v_fmt: formats.KVFormat) -> bool:
    """Quantize and write ``k, v`` at positions ``start + t`` as the reference does, in one C call;
    True when written. False (nothing written) where this path does not apply: other than float32
    inputs with unit stride along head_dim, static scales, above :data:`MAX_WORK`, or a start
    outside ``[0, max_cache_len - T]`` (the caller raises)."""
    plan = _plan((k_cache, k_scale, v_cache, v_scale, k_rotation, v_rotation), k_fmt, v_fmt)
    if plan is None or not plan.store:
        return False
    if k.dim() != 4:
        return False
    B, H, T, D = k.shape
    rotated = k_rotation is not None or v_rotation is not None
    if (k.dtype != torch.float32 or v.dtype != torch.float32 or k.stride(3) != 1 or v.stride(3) != 1
            or v.shape != k.shape or B != plan.B or H != plan.H or D != plan.D
            or k.device.type != "cpu" or v.device.type != "cpu"
            or 2 * B * H * T * D * (D if rotated else 1) > MAX_WORK
            or (k_offset is not None and (k_offset.dtype != torch.float32 or not k_offset.is_contiguous()
                                          or k_offset.shape != (H, D) or k_offset.device.type != "cpu"))):
        return False
    if isinstance(start, Tensor) and start.dtype == torch.int64 and start.numel() == 1 and start.device.type == "cpu":
        start_at = start.data_ptr()
    else:
        start_at = ctypes.byref(ctypes.c_int64(int(start)))
    ks, vs = k.stride(), v.stride()
    rc = _state["lib"][1](plan.addr, B, T, k.data_ptr(), ks[0], ks[1], ks[2], v.data_ptr(), vs[0], vs[1], vs[2],
                          start_at, None if k_offset is None else k_offset.data_ptr())
    return rc == 0

"""Hadamard rotations of the head dimension, for caches that store ``quantize(x @ R - mu)``.

With ``R`` orthonormal (``R @ R.T == I``), rotating K and V changes nothing attention computes:
``q . k == (q R) . (k R)`` and ``P V == (P (V R)) R^T``. What it changes is what a per-token scale
sees: a few outlier channels (large in every token) set ``amax`` and leave the other channels a
handful of int8 steps; after a Hadamard rotation every rotated channel mixes all channels of its
block, so the energy spreads and ``amax`` falls towards the vector's RMS (QuaRot, SpinQuant;
llama.cpp rotates K before quantizing for the same reason).

The matrix (:func:`hadamard`), fixed and deterministic, for ``head_dim`` D:

* D a power of two: the Sylvester Hadamard matrix ``H_D`` (``H_1 = [1]``,
  ``H_2n = [[H_n, H_n], [H_n, -H_n]]``) divided by ``sqrt(D)``;
* otherwise (80, 96, 112, 160, 192, ...): block-diagonal, one normalized Sylvester block per
  set bit of D, largest first (80 = 64 + 16, 96 = 64 + 32, 112 = 64 + 32 + 16, 160 = 128 + 32).
  Channels mix within their block only.

D must be a multiple of 8 (every block then has at least 8 channels): a block of 1, 2 or 4
channels would rotate almost nothing. Every head_dim the attention kernels serve qualifies.

Exactness: the ±1 blocks are integers, so ``A @ A.T == n I`` holds exactly; the normalized
matrix is built in float64, where ``R @ R.T`` equals ``I`` up to float64 rounding (exactly for
blocks of 4^k channels, whose ``1/sqrt(n)`` is a power of two), and stored as float32. The
matrix is symmetric (``R == R.T``), but the ops always write ``R^T`` where the math has it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["hadamard", "hadamard_blocks", "check_head_dim", "prebuild", "shared", "is_shared_sylvester", "MIN_BLOCK"]

MIN_BLOCK = 8  # smallest Hadamard block: head_dim must be a multiple of it


def check_head_dim(head_dim: int) -> None:
    """Raise ``ValueError`` (naming the fix) when no rotation is defined for ``head_dim``."""
    if not isinstance(head_dim, int) or head_dim < MIN_BLOCK or head_dim % MIN_BLOCK:
        raise ValueError(
            f"kvcompile rotation: head_dim={head_dim} has no Hadamard rotation (it needs a multiple of "
            f"{MIN_BLOCK}: blocks of fewer channels would rotate almost nothing); build the cache with "
            "rotate=False"
        )


def hadamard_blocks(head_dim: int) -> list[int]:
    """Block sizes of :func:`hadamard` (the set bits of ``head_dim``, largest first)."""
    check_head_dim(head_dim)
    return [1 << b for b in range(head_dim.bit_length() - 1, -1, -1) if head_dim >> b & 1]


def _sylvester(n: int) -> torch.Tensor:
    """The ±1 Sylvester Hadamard matrix of order n (a power of two), as int64."""
    h = torch.ones(1, 1, dtype=torch.int64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


_F64: dict = {}  # head_dim -> the float64 matrix (a plain dict: Dynamo reads it as a constant when a
# cache allocates lazily inside a compiled graph; an lru_cache there makes it warn and re-trace the build)


def _hadamard_f64(head_dim: int) -> torch.Tensor:
    t = _F64.get(head_dim)
    if t is None:
        t = _F64[head_dim] = _build_f64(head_dim)
    return t


def prebuild(head_dim: int) -> None:
    """Build the matrices of ``head_dim`` now: caches call this at construction, outside any graph.
    A cache that allocates lazily does so inside the first compiled graph, where Dynamo guards on
    what :func:`shared` finds in ``_SHARED``: were the matrix built there, the next cache's first
    call would fail that guard and recompile. So the float32 matrix is built for the CPU and for the
    current CUDA device when CUDA is already in use (a lazy cache on a device CUDA had not reached
    at construction still works, at the cost of that one recompile)."""
    _hadamard_f64(head_dim)
    shared(head_dim, "cpu")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        shared(head_dim, "cuda")


def _build_f64(head_dim: int) -> torch.Tensor:
    out = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    i = 0
    for n in hadamard_blocks(head_dim):
        out[i : i + n, i : i + n] = _sylvester(n).to(torch.float64) / math.sqrt(n)
        i += n
    return out


def hadamard(head_dim: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The orthonormal ``[head_dim, head_dim]`` rotation (see the module docstring), a new tensor."""
    return _hadamard_f64(head_dim).to(dtype=dtype, device=device, copy=True)


_SHARED: dict = {}  # (head_dim, device) -> the float32 matrix every cache layer of that head_dim holds


def shared(head_dim: int, device) -> torch.Tensor:
    """The float32 rotation of ``head_dim`` on ``device``, one tensor per (head_dim, device) shared by
    every cache (16 KiB at head_dim 64, once instead of per layer). Read-only: the kernels take it
    for the Sylvester matrix without reading it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (head_dim, str(device))
    t = _SHARED.get(key)
    if t is None:
        t = _SHARED[key] = hadamard(head_dim, torch.float32, device)
    return t


def is_shared_sylvester(r: torch.Tensor) -> bool:
    """Whether ``r`` is :func:`shared`'s matrix for a power-of-two head_dim (the Sylvester matrix
    ``H_D / sqrt(D)``): same storage, shape and strides. Graph safe (no read of the values)."""
    if r.dim() != 2 or r.shape[0] != r.shape[1]:
        return False
    d = r.shape[0]
    if d & (d - 1) or r.dtype != torch.float32:
        return False
    t = _SHARED.get((d, str(r.device)))
    return t is not None and r.data_ptr() == t.data_ptr() and r.stride() == t.stride()

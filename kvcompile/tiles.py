"""All arch and tile choices of the kvcompile kernels, in one place.

A tile is picked from a table keyed by (compute capability, head_dim, q dtype, REAL bytes per
element of K and of V). Shared memory is billed at the bytes each operand really has: a 1-byte
cache stages 1-byte tiles, so it fits a larger tile where a 16-bit cache cannot. Candidates
that would not fit the arch's shared memory per block are pruned (Triton tutorial 06 ``keep()``).

Shared-memory model of one program (bytes; what Triton 3.6 allocates for these kernels on
sm_90, checked against the compiled kernels' metadata, e.g. 108,544 B for the fp8 decode tile
16x128, 3 stages, head_dim 128):

* the Q tile, ``BLOCK_M * D * q_bytes`` (kept resident);
* ``num_stages - 1`` pipelined K and V tiles in flight at their real size,
  ``BLOCK_N * D * (k_bytes + v_bytes)``, and their scales (``scale_bytes`` per key for K and for
  V: 4 for an fp32 token scale, D / 8 for fp32 block32 scales, D / 16 for q8_0's fp16 ones, 0 for
  static scales; callers that do not say are billed ``max(4, D / 16)``);
* an 8-bit V tile widened to fp16 before the P @ V dot goes through shared memory for its
  transpose (``ldmatrix.trans``): ``BLOCK_N * D * 2``. An 8-bit K tile is widened in registers;
* the 16-bit P tile, ``BLOCK_M * BLOCK_N * 2``.

Decode is bound by memory latency, so what counts is how many programs one SM holds: by shared
memory (from sm_80 on an SM has ``SMEM_BYTES`` + 1 KB, and each resident block takes 1 KB of it
besides its own allocation) and by its 64K registers. Each decode candidate names the programs
per SM it is meant to run at, and is taken only where that many fit; a candidate may cap its
registers (``Tile.maxnreg``) to make room.
Measured on the H200 (docs/perf-log.md): the fp8 tile 16x128 with 4 stages at one program per SM
is 1.37x slower than 3 stages at two; with V key-contiguous, 3 stages capped at 168 registers
run three programs per SM and are 1.10-1.14x faster than two at B*L >= 256k.

Nothing here imports triton or touches a GPU; the launchers call :func:`prefill_tile` /
:func:`decode_tile` with the device's capability.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

__all__ = [
    "SMEM_BYTES",
    "SUPPORTED_HEAD_DIMS",
    "Tile",
    "smem_bytes",
    "prefill_tile",
    "prefill_candidates",
    "decode_tile",
    "has_native_fp8",
    "programs_per_sm",
    "check_head_dim",
]

# Largest dynamic shared memory one block may opt into, per compute capability (CUDA C
# Programming Guide, "Technical Specifications per Compute Capability").
SMEM_BYTES: dict[tuple[int, int], int] = {
    (7, 0): 96 * 1024,
    (7, 5): 64 * 1024,
    (8, 0): 163 * 1024,
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024,
    (12, 0): 99 * 1024,
}

# An SM's shared memory is the per-block maximum plus, from sm_80 on, 1 KB that the hardware
# reserves for each resident block (same source: 228 KB per SM and 227 KB per block on sm_90).
SMEM_BLOCK_RESERVE = 1024
REGISTERS_PER_SM = 64 * 1024  # 32-bit registers, every arch here

# head_dim values the fused kernels serve (padded to the next power of two inside the kernel).
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256)


@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # register cap per thread (ptxas ``.maxnreg``), so more programs fit one SM; None: ptxas decides
    maxnreg: Optional[int] = None


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"kvcompile: the Triton attention kernels support head_dim in {list(SUPPORTED_HEAD_DIMS)}, got "
            f"{head_dim}; set KVCOMPILE_KERNELS=reference for this model"
        )


def has_native_fp8(cc: tuple[int, int]) -> bool:
    """Triton has the e4m3 type (``tl.float8e4nv``) from sm_89 on; below that, decode by bits."""
    return tuple(cc) >= (8, 9)


def _closest_known(cc: tuple[int, int]) -> tuple[int, int]:
    # unknown arch: the closest known one at or below it (newer archs never have less)
    cc = tuple(cc)
    if cc in SMEM_BYTES:
        return cc
    known = [c for c in SMEM_BYTES if c <= cc]
    return max(known) if known else min(SMEM_BYTES)


def _smem_limit(cc: tuple[int, int]) -> int:
    return SMEM_BYTES[_closest_known(cc)]


def programs_per_sm(tile: Tile, cc: tuple[int, int], smem: int) -> int:
    """How many programs of this tile one SM holds, by shared memory (``smem`` bytes each) and, for
    a tile with a register cap, by registers (without one the compiler decides: not modelled)."""
    cc = _closest_known(cc)
    if smem > SMEM_BYTES[cc]:
        return 0
    reserve = SMEM_BLOCK_RESERVE if cc >= (8, 0) else 0
    n = (SMEM_BYTES[cc] + reserve) // (smem + reserve)
    if tile.maxnreg is not None:
        n = min(n, REGISTERS_PER_SM // (tile.maxnreg * 32 * tile.num_warps))
    return n


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def smem_bytes(tile: Tile, head_dim: int, q_bytes: int, k_bytes: int, v_bytes: int, v_keys: bool = False,
               scale_bytes: Optional[int] = None) -> int:
    """Shared memory one program of this tile needs (see the module docstring); ``v_keys``: V is
    key-contiguous, so an 8-bit V tile is widened in registers like K and not staged;
    ``scale_bytes``: bytes of scales per key, for K and for V each."""
    d = _pow2(head_dim)
    if scale_bytes is None:
        scale_bytes = max(4, d // 16)
    in_flight = max(1, tile.num_stages - 1)
    total = tile.block_m * d * q_bytes
    total += in_flight * tile.block_n * (d * (k_bytes + v_bytes) + 2 * scale_bytes)
    total += tile.block_n * d * 2 * (v_bytes < 2 and not v_keys)  # the widened 8-bit V tile, transposed via smem
    total += tile.block_m * tile.block_n * 2  # P
    return total


# Candidates in order of preference (largest first); the first that fits is taken.
# Prefill: compute bound, big M and N tiles; more stages when the loads are small. No 128x128 / 8 warps:
# on sm_90 it spilled and ran 1.4x slower than the measured tile below. It spills in the key loops of
# every arch that would take it (Triton 3.9 SASS, int8 K rotated, D=128: sm_80, sm_87 and sm_100 have
# 336, 327 and 371 local loads and stores there), and 128x64 / 8 warps / 3 stages has none.
_PREFILL_CANDIDATES = (
    Tile(128, 64, 8, 3),
    Tile(128, 64, 4, 3),
    Tile(128, 64, 4, 2),
    Tile(64, 64, 4, 2),
    Tile(64, 32, 4, 2),
    Tile(32, 32, 4, 2),
    Tile(16, 16, 4, 2),
)
# Measured first choices per compute capability (docs/perf-log.md), for head_dim <= 128. H200, fp8
# cache, D=128, 16k and 1k new tokens: 64x128, 4 warps, 2 stages runs the fused prefill 1.4x faster
# than 128x128 / 8 warps / 3 stages (which spills on sm_90).
_PREFILL_MEASURED = {(9, 0): Tile(64, 128, 4, 2)}
# Decode: memory bound; M is the (padded) rows of one kv head's query group, N as large as
# fits with deep pipelining so many bytes are in flight per SM. Each tile with the programs per
# SM it needs (the first whose programs fit is taken; else the first that fits one per SM).
_DECODE_CANDIDATES = (
    # three per SM where an 8-bit V tile needs no staging (V key-contiguous): 168 registers x 128
    # threads x 3 <= 64K. Uncapped the compiler takes 184 and two fit (Triton 3.6, sm_90, fp8)
    (Tile(16, 128, 4, 3, maxnreg=168), 3),
    (Tile(16, 128, 4, 4), 2),
    (Tile(16, 128, 4, 3), 2),
    (Tile(16, 64, 4, 4), 2),
    (Tile(16, 64, 4, 3), 2),
    (Tile(16, 64, 4, 2), 2),
    (Tile(16, 32, 4, 2), 2),
    (Tile(16, 16, 4, 2), 2),
)


def _pick_prefill(cands, cc, head_dim, q_bytes, k_bytes, v_bytes, v_keys=False, scale_bytes=None) -> Tile:
    """The first candidate that fits one program per SM."""
    for t in cands:
        if programs_per_sm(t, cc, smem_bytes(t, head_dim, q_bytes, k_bytes, v_bytes, v_keys, scale_bytes)) >= 1:
            return t
    raise ValueError(
        f"kvcompile: no attention tile fits sm_{cc[0]}{cc[1]} shared memory ({_smem_limit(cc)} B) for "
        f"head_dim={head_dim}"
    )


@functools.lru_cache(maxsize=None)
def prefill_tile(cc: tuple[int, int], head_dim: int, q_bytes: int, k_bytes: int, v_bytes: int,
                 v_keys: bool = False, scale_bytes: Optional[int] = None, fp8_bits: bool = False) -> Tile:
    """Tile of the prefill/extend kernel. ``*_bytes`` are the real bytes per element (1 for 8-bit);
    ``v_keys``: V is key-contiguous; ``scale_bytes``: per key, for K and V each (see :func:`smem_bytes`);
    ``fp8_bits``: e4m3 codes widened by integer ops (no fp8 type for the arch)."""
    check_head_dim(head_dim)
    return _pick_prefill(prefill_candidates(cc, head_dim, fp8_bits), tuple(cc), head_dim, q_bytes, k_bytes, v_bytes,
                         v_keys, scale_bytes)


# e4m3 widened by integer ops (below sm_89): the larger tiles spill. Triton 3.9 SASS, fp8 token scales,
# D=128, sm_80: 128x128 / 8 warps / 3 stages 7088 B of stack and 17918 local loads and stores in the
# key loops, 64x128 / 4 / 2 688 B and 470, this tile none; sm_86: 128x64 / 8 / 3 1016 B and 934, this
# tile 16 B outside the loops. Chosen by the compiled code alone: never timed on such a GPU.
_PREFILL_FP8_BITS = Tile(64, 64, 4, 3)


def prefill_candidates(cc: tuple[int, int], head_dim: int, fp8_bits: bool = False) -> tuple[Tile, ...]:
    """Prefill tiles in order of preference for this arch and head_dim (before the smem check)."""
    cands = _PREFILL_CANDIDATES
    if fp8_bits:
        cands = (_PREFILL_FP8_BITS,) + tuple(t for t in cands if t.block_m * t.block_n <= 64 * 64)
    elif tuple(cc) in _PREFILL_MEASURED and head_dim <= 128:
        cands = (_PREFILL_MEASURED[tuple(cc)],) + cands
    if head_dim > 128:  # register pressure of the fp32 accumulator: keep M at 64 for big heads
        cands = tuple(t for t in cands if t.block_m <= 64)
    if tuple(cc) < (8, 0):  # Volta/Turing: no async copies to pipeline; fewer warps per tile
        cands = tuple(dataclasses.replace(t, num_stages=min(t.num_stages, 2)) for t in cands)
    return cands


@functools.lru_cache(maxsize=None)
def decode_tile(
    cc: tuple[int, int], head_dim: int, q_bytes: int, k_bytes: int, v_bytes: int, rows: int = 16,
    v_keys: bool = False, scale_bytes: Optional[int] = None,
) -> Tile:
    """Tile of the split-K decode kernel; ``rows`` = query heads per kv head * query length (M is
    padded to a power of two >= 16; when the rows do not fit, they are split over programs)."""
    check_head_dim(head_dim)
    cc = tuple(cc)
    cands = _DECODE_CANDIDATES
    if cc < (8, 0):
        cands = tuple((dataclasses.replace(t, num_stages=min(t.num_stages, 2)), n) for t, n in cands)

    def smem(t):
        return smem_bytes(t, head_dim, q_bytes, k_bytes, v_bytes, v_keys, scale_bytes)

    ms = [m for m in (128, 64, 32, 16) if m <= max(16, min(_pow2(max(rows, 16)), 128))]
    for m in ms:
        for t, want in cands:
            if t.maxnreg is not None and m != t.block_m:
                continue  # a register cap holds for the M it was measured at only
            t = dataclasses.replace(t, block_m=m)
            if programs_per_sm(t, cc, smem(t)) >= want:
                return t
    for m in ms:  # nothing leaves room for its programs: one program per SM
        for t, _ in cands:
            t = dataclasses.replace(t, block_m=m, maxnreg=None)
            if programs_per_sm(t, cc, smem(t)) >= 1:
                return t
    raise ValueError(
        f"kvcompile: no attention tile fits sm_{cc[0]}{cc[1]} shared memory ({_smem_limit(cc)} B) for "
        f"head_dim={head_dim}"
    )

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
  ``BLOCK_N * D * (k_bytes + v_bytes)``, and their scales (at most ``max(4, D / 16)`` bytes per
  key for K and for V: one fp32 per token, or one fp16 per 32 values);
* an 8-bit V tile widened to fp16 before the P @ V dot goes through shared memory for its
  transpose (``ldmatrix.trans``): ``BLOCK_N * D * 2``. An 8-bit K tile is widened in registers;
* the 16-bit P tile, ``BLOCK_M * BLOCK_N * 2``.

Decode is bound by memory latency: a tile must leave room for ``DECODE_MIN_PROGRAMS_PER_SM``
programs on one SM (one program of 4 warps cannot keep enough loads in flight; measured on the
H200: 16x128 with 4 stages runs one program per SM and is 1.37x slower than 3 stages).

Nothing here imports triton or touches a GPU; the launchers call :func:`prefill_tile` /
:func:`decode_tile` with the device's capability.
"""

from __future__ import annotations

import dataclasses
import functools

__all__ = [
    "SMEM_BYTES",
    "SUPPORTED_HEAD_DIMS",
    "Tile",
    "smem_bytes",
    "prefill_tile",
    "prefill_candidates",
    "decode_tile",
    "has_native_fp8",
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

# head_dim values the fused kernels serve (padded to the next power of two inside the kernel).
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256)


@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"kvcompile: the Triton attention kernels support head_dim in {list(SUPPORTED_HEAD_DIMS)}, got "
            f"{head_dim}; set KVCOMPILE_KERNELS=reference for this model"
        )


def has_native_fp8(cc: tuple[int, int]) -> bool:
    """Triton has the e4m3 type (``tl.float8e4nv``) from sm_89 on; below that, decode by bits."""
    return tuple(cc) >= (8, 9)


def _smem_limit(cc: tuple[int, int]) -> int:
    cc = tuple(cc)
    if cc in SMEM_BYTES:
        return SMEM_BYTES[cc]
    # unknown arch: the closest known one at or below it (newer archs never have less)
    known = [c for c in SMEM_BYTES if c <= cc]
    return SMEM_BYTES[max(known)] if known else min(SMEM_BYTES.values())


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def smem_bytes(tile: Tile, head_dim: int, q_bytes: int, k_bytes: int, v_bytes: int, v_keys: bool = False) -> int:
    """Shared memory one program of this tile needs (see the module docstring); ``v_keys``: V is
    key-contiguous, so an 8-bit V tile is widened in registers like K and not staged."""
    d = _pow2(head_dim)
    in_flight = max(1, tile.num_stages - 1)
    total = tile.block_m * d * q_bytes
    total += in_flight * tile.block_n * (d * (k_bytes + v_bytes) + 2 * max(4, d // 16))
    total += tile.block_n * d * 2 * (v_bytes < 2 and not v_keys)  # the widened 8-bit V tile, transposed via smem
    total += tile.block_m * tile.block_n * 2  # P
    return total


# Candidates in order of preference (largest first); the first that fits is taken.
# Prefill: compute bound, big M and N tiles; more stages when the loads are small.
_PREFILL_CANDIDATES = (
    Tile(128, 128, 8, 3),
    Tile(128, 64, 8, 3),
    Tile(128, 64, 4, 3),
    Tile(128, 64, 4, 2),
    Tile(64, 64, 4, 2),
    Tile(64, 32, 4, 2),
    Tile(32, 32, 4, 2),
    Tile(16, 16, 4, 2),
)
# Measured first choices per compute capability (BENCHMARKS.md), for head_dim <= 128. H200, fp8
# cache, D=128, 16k and 1k new tokens: 64x128, 4 warps, 2 stages runs the fused prefill 1.4x faster
# than 128x128 / 8 warps / 3 stages (which spills on sm_90).
_PREFILL_MEASURED = {(9, 0): Tile(64, 128, 4, 2)}
# Decode: memory bound; M is the (padded) rows of one kv head's query group, N as large as
# fits with deep pipelining so many bytes are in flight per SM.
_DECODE_CANDIDATES = (
    Tile(16, 128, 4, 4),
    Tile(16, 128, 4, 3),
    Tile(16, 64, 4, 4),
    Tile(16, 64, 4, 3),
    Tile(16, 64, 4, 2),
    Tile(16, 32, 4, 2),
    Tile(16, 16, 4, 2),
)


DECODE_MIN_PROGRAMS_PER_SM = 2


def _pick(cands, cc, head_dim, q_bytes, k_bytes, v_bytes, block_m=None, programs_per_sm=1, v_keys=False) -> Tile:
    # decode: M is the query rows of one kv head; when they do not fit, split them over programs
    ms = [None] if block_m is None else [m for m in (128, 64, 32, 16) if m <= max(16, min(block_m, 128))]
    # the first candidate that leaves room for programs_per_sm programs; else one program per SM
    for per_sm in sorted({programs_per_sm, 1}, reverse=True):
        limit = _smem_limit(cc) // per_sm
        for m in ms:
            for t in cands:
                if m is not None:
                    t = dataclasses.replace(t, block_m=m)
                if smem_bytes(t, head_dim, q_bytes, k_bytes, v_bytes, v_keys) <= limit:
                    return t
    raise ValueError(
        f"kvcompile: no attention tile fits sm_{cc[0]}{cc[1]} shared memory ({_smem_limit(cc)} B) for "
        f"head_dim={head_dim}"
    )


@functools.lru_cache(maxsize=None)
def prefill_tile(cc: tuple[int, int], head_dim: int, q_bytes: int, k_bytes: int, v_bytes: int,
                 v_keys: bool = False) -> Tile:
    """Tile of the prefill/extend kernel. ``*_bytes`` are the real bytes per element (1 for 8-bit);
    ``v_keys``: V is key-contiguous (see :func:`smem_bytes`)."""
    check_head_dim(head_dim)
    return _pick(prefill_candidates(cc, head_dim), tuple(cc), head_dim, q_bytes, k_bytes, v_bytes, v_keys=v_keys)


def prefill_candidates(cc: tuple[int, int], head_dim: int) -> tuple[Tile, ...]:
    """Prefill tiles in order of preference for this arch and head_dim (before the smem check)."""
    cands = _PREFILL_CANDIDATES
    if tuple(cc) in _PREFILL_MEASURED and head_dim <= 128:
        cands = (_PREFILL_MEASURED[tuple(cc)],) + cands
    if head_dim > 128:  # register pressure of the fp32 accumulator: keep M at 64 for big heads
        cands = tuple(t for t in cands if t.block_m <= 64)
    if tuple(cc) < (8, 0):  # Volta/Turing: no async copies to pipeline; fewer warps per tile
        cands = tuple(dataclasses.replace(t, num_stages=min(t.num_stages, 2)) for t in cands)
    return cands


@functools.lru_cache(maxsize=None)
def decode_tile(
    cc: tuple[int, int], head_dim: int, q_bytes: int, k_bytes: int, v_bytes: int, rows: int = 16,
    v_keys: bool = False,
) -> Tile:
    """Tile of the split-K decode kernel; ``rows`` = query heads per kv head * query length."""
    check_head_dim(head_dim)
    cands = _DECODE_CANDIDATES
    if tuple(cc) < (8, 0):
        cands = tuple(dataclasses.replace(t, num_stages=min(t.num_stages, 2)) for t in cands)
    return _pick(cands, tuple(cc), head_dim, q_bytes, k_bytes, v_bytes, block_m=_pow2(max(rows, 16)),
                 programs_per_sm=DECODE_MIN_PROGRAMS_PER_SM, v_keys=v_keys)

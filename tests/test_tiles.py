"""kvcompile.tiles: the arch/tile table (pure Python, no GPU)."""

from __future__ import annotations

import pytest

from kvcompile import tiles

ARCHS = [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
HEAD_DIMS = [64, 80, 96, 128, 256]
Q_BYTES = [2, 4]


def area(t: tiles.Tile) -> int:
    return t.block_m * t.block_n


@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("qb", Q_BYTES)
def test_tiles_fit_and_fp8_is_never_smaller(cc, D, qb):
    limit = tiles.SMEM_BYTES[cc]
    for pick, extra in ((tiles.prefill_tile, ()), (tiles.decode_tile, (16,)), (tiles.decode_tile, (64,))):
        t16 = pick(cc, D, qb, 2, 2, *extra)
        t8 = pick(cc, D, qb, 1, 1, *extra)
        for t, kb in ((t16, 2), (t8, 1)):
            assert tiles.smem_bytes(t, D, qb, kb, kb) <= limit, (pick.__name__, t, kb)
        # a 1-byte cache is billed at 1 byte: its tile is at least as large as the 16-bit one
        assert area(t8) >= area(t16) and t8.block_n >= t16.block_n, (pick.__name__, t8, t16)


def _pick_billing_16bit_only(cands, cc, D, qb):
    """The choice a 16-bit-only table makes: first candidate that fits at 2 bytes per K/V element."""
    for t in cands:
        if tiles.smem_bytes(t, D, qb, 2, 2) <= tiles.SMEM_BYTES[cc]:
            return t


@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("D", [64, 128])
def test_16bit_choices_unchanged_by_fp8_accounting(cc, D):
    # widened-operand terms only apply to 8-bit operands: the 16-bit pick equals the plain table's
    cands = tiles.prefill_candidates(cc, D)
    assert tiles.prefill_tile(cc, D, 2, 2, 2) == _pick_billing_16bit_only(cands, cc, D, 2)


def test_one_byte_cache_gets_the_larger_tile_where_16bit_does_not_fit():
    # H200 decode, head_dim 128: two programs per SM fit 128 keys of 1-byte K/V, not of 2-byte
    assert tiles.decode_tile((9, 0), 128, 2, 1, 1, 4).block_n > tiles.decode_tile((9, 0), 128, 2, 2, 2, 4).block_n
    # sm_86 prefill, head_dim 64 (99 KB of shared memory), between 128x128 (not a candidate of the table,
    # whose largest is 128x64: it spills) and 128x64
    cands = (tiles.Tile(128, 128, 8, 3), tiles.Tile(128, 64, 8, 3))
    assert area(tiles._pick_prefill(cands, (8, 6), 64, 2, 1, 1)) > area(tiles._pick_prefill(cands, (8, 6), 64, 2, 2, 2))


@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("v_keys", [False, True])
def test_decode_tile_leaves_room_for_the_programs_it_is_meant_for(cc, D, v_keys):
    t = tiles.decode_tile(cc, D, 2, 1, 1, 4, v_keys)
    smem = tiles.smem_bytes(t, D, 2, 1, 1, v_keys)
    fits_two = any(tiles.programs_per_sm(c, cc, tiles.smem_bytes(c, D, 2, 1, 1, v_keys)) >= 2
                   for c, _ in tiles._DECODE_CANDIDATES)
    if fits_two:  # else the fallback: one program per SM
        assert tiles.programs_per_sm(t, cc, smem) >= 2, t
    if t.maxnreg is not None:  # a capped tile is only taken where its three programs fit
        assert tiles.programs_per_sm(t, cc, smem) >= 3, t
        assert 3 * t.maxnreg * 32 * t.num_warps <= tiles.REGISTERS_PER_SM


def test_h200_fp8_decode_tile_is_the_measured_best():
    # docs/perf-log.md (decode tile sweep, pinned V, a785dad): 16x128, 4 warps, 3 stages; 4 stages runs one
    # program per SM and is 1.37x slower at B=8, L=32k
    assert tiles.decode_tile((9, 0), 128, 2, 1, 1, 4) == tiles.Tile(16, 128, 4, 3)
    # V key-contiguous, fp32 token scales (4 B per key): no widened V tile in shared memory, so
    # 3 stages fit three programs per SM at 168 registers (bench_kv.py, H200, 45b913a: 1.10-1.14x
    # faster than two programs at B*L >= 256k)
    t = tiles.decode_tile((9, 0), 128, 2, 1, 1, 4, True, 4)
    assert t == tiles.Tile(16, 128, 4, 3, maxnreg=168)
    # what Triton 3.6 allocates for it on sm_90 (the compiled kernel's metadata): 75,776 B
    assert tiles.smem_bytes(t, 128, 2, 1, 1, True, 4) == 75776
    assert tiles.programs_per_sm(t, (9, 0), 75776) == 3
    # the cap is only taken at M = 16 (it was measured there): 8 query heads x 4 queries
    assert tiles.decode_tile((9, 0), 128, 2, 1, 1, 32, True, 4).maxnreg is None


def test_programs_per_sm_counts_the_per_block_reserve_and_registers():
    t = tiles.Tile(16, 128, 4, 3)
    # sm_90: 228 KB per SM, 1 KB reserved per block
    assert tiles.programs_per_sm(t, (9, 0), 76 * 1024 - 1024) == 3
    assert tiles.programs_per_sm(t, (9, 0), 76 * 1024 - 1023) == 2
    assert tiles.programs_per_sm(t, (9, 0), tiles.SMEM_BYTES[(9, 0)] + 1) == 0  # over the per-block limit
    assert tiles.programs_per_sm(tiles.Tile(16, 128, 4, 3, maxnreg=255), (9, 0), 1024) == 2  # 255 x 128 x 2 <= 64K
    assert tiles.programs_per_sm(t, (7, 5), 32 * 1024) == 2  # no reserve before sm_80


def test_native_fp8_from_sm89():
    assert [tiles.has_native_fp8(c) for c in ARCHS] == [False, False, False, False, True, True, True, True]


def test_unsupported_head_dim_is_refused_clearly():
    with pytest.raises(ValueError, match="head_dim"):
        tiles.prefill_tile((9, 0), 48, 2, 1, 1)
    with pytest.raises(ValueError, match="KVCOMPILE_KERNELS=reference"):
        tiles.decode_tile((9, 0), 100, 2, 1, 1)


def test_unknown_newer_arch_uses_closest_known():
    assert tiles._smem_limit((9, 5)) == tiles.SMEM_BYTES[(9, 0)]
    assert tiles.prefill_tile((11, 0), 128, 2, 1, 1) == tiles.prefill_tile((10, 0), 128, 2, 1, 1)


@pytest.mark.parametrize("cc", ARCHS, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_e4m3_by_bits_prefills_in_small_tiles(cc, D):
    """Where e4m3 is widened by integer ops (below sm_89) the fused prefill takes a tile of at most
    64 x 64 (the larger ones spill: tests/test_sass.py); 64 x 64 / 4 warps when it fits. Other codes
    keep the table's tile, larger where it fits."""
    t = tiles.prefill_tile(cc, D, 2, 1, 1, True, 4, fp8_bits=True)
    assert t.block_m * t.block_n <= 64 * 64, t
    if D <= 128:
        assert (t.block_m, t.block_n, t.num_warps) == (64, 64, 4), t
    if cc in ((8, 0), (9, 0)) and D == 128:
        assert area(tiles.prefill_tile(cc, D, 2, 1, 1, True, 4)) > 64 * 64

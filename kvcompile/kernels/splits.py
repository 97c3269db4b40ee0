"""Split-K of the decode kernel: how many splits of how many keys (:func:`decode_splits`), from
static shapes only. Part of the launch plan (:mod:`kvcompile.kernels.plan` calls it and re-exports
its names); apart because its wave-fill search and its measured constants are a unit of their own."""

from __future__ import annotations

import functools
import math

__all__ = ["decode_splits", "DECODE_SMALL_PROGRAMS", "DECODE_WAVES", "DECODE_MIN_SPLIT_TILES",
           "DECODE_PROGRAMS_PER_SM_SMALL"]

DECODE_SMALL_PROGRAMS = 16  # programs per split at most: no full wave (latency-bound), no int8 bias
# Split-K: the split count whose equal-work programs fill whole waves of the resident programs
# best, at most this many waves (bench_kv.py --splits, H200, aecdf70: 1-4 within 1% at B=8 L=32k and B=4 L=128k;
# 1 loses 7% at B=32 L=32k, 6 loses 4-8%).
DECODE_WAVES = 2
# ... but splits shorter than this many key tiles: their per-program fixed cost (prologue, q, partial
# output) outweighs the waves' fill, and one wave of DECODE_PROGRAMS_PER_SM_SMALL programs per SM
# wins (bench_kv.py --splits, H200, c2148e7 and 7300928, fp8 / int8 us: B=8 L=4k 26.1 / 29.5 with
# 4 splits against 30.6 / 34.3 with the fill's 11, B=4 L=8k 25.9 / 28.9 with 8 against 31.5 / 35.7
# with 22, B=4 L=4k 17.7 / 19.7 with 8 against 18.7 / 21.0 with 11; 128-key tiles).
DECODE_MIN_SPLIT_TILES = 8
# ... when there are at most DECODE_SMALL_PROGRAMS a split per program cannot fill a wave anyway: this
# many programs per SM (bench_kv.py --sweep, H200, aecdf70: 3 instead of 2 at B=1 L=32k, 27.3 vs 26.0 us fp8, 49.6 vs
# 38.2 q8_0).
DECODE_PROGRAMS_PER_SM_SMALL = 2


def decode_splits(programs: int, max_len: int, block_n: int, sms: int, resident: int = 1) -> tuple[int, int]:
    """(number of splits, keys per split) from static shapes only (never the current length: graph
    safe, no host sync).

    ``programs`` per split (batch * kv heads * query blocks); ``resident`` programs of the tile fit
    one SM at once, so ``resident * sms`` run per wave. Every program of a launch reads one split
    (the last may be shorter), so a launch a few programs past a whole wave ends with that wave
    nearly empty: the count chosen fills its waves best (ties: fewer waves), at most ``DECODE_WAVES``
    of them; with at least one block of keys per split. With at most ``DECODE_SMALL_PROGRAMS``
    a split per program cannot fill a wave anyway, and when the best fill needs splits shorter than
    ``DECODE_MIN_SPLIT_TILES`` blocks their fixed costs outweigh it: then one wave of
    ``DECODE_PROGRAMS_PER_SM_SMALL`` programs per SM.
    """
    return _decode_splits(programs, max_len, block_n, sms, max(1, resident), DECODE_WAVES,
                          DECODE_PROGRAMS_PER_SM_SMALL, DECODE_MIN_SPLIT_TILES)


@functools.lru_cache(maxsize=4096)
def _decode_splits(programs, max_len, block_n, sms, resident, waves_max, pps_small, min_tiles):
    blocks = -(-max_len // block_n)

    def split(want: int) -> tuple[int, int]:
        split_len = -(-(-(-max_len // want)) // block_n) * block_n
        return -(-max_len // split_len), split_len

    if programs <= DECODE_SMALL_PROGRAMS:
        return split(max(1, min(-(-(pps_small * sms) // programs), blocks)))
    slots = resident * sms
    best, best_fill = split(1), 0.0
    for want in range(1, blocks + 1):
        splits, split_len = split(want)
        if splits != want:  # not reachable with whole blocks per split
            continue
        waves = math.ceil(programs * splits / slots)
        if waves > waves_max:
            break
        # the programs of the last split (launched last) are shorter: a last wave of only those
        # takes their length
        last_len = max_len - (splits - 1) * split_len
        tail = last_len if programs * (splits - 1) <= (waves - 1) * slots else split_len
        fill = programs * max_len / (slots * ((waves - 1) * split_len + tail))
        if fill > best_fill + 0.01:  # ties: fewer waves (fewer programs, each one's fixed cost paid fewer times)
            best, best_fill = (splits, split_len), fill
    if best[1] < min_tiles * block_n:  # short splits: one wave of pps_small programs per SM instead
        return split(max(1, min(round(pps_small * sms / programs), blocks)))
    return best

"""The pieces of ``_attention_kernel`` a tile step is built from: its mode constants, the tile loads
(K and V codes, their scales), the int8 split of q for K's int8 MMAs, the group-scale broadcast, the
opaque move that keeps a tile's staging at its use, fp32 tanh for softcap, and the per-program key
range and base pointers. The online-softmax step and the kernel itself are in ``_attention_kernel.py``."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln(2): exp(x) = exp2(x * LOG2E)
# fp16 P * s_v / max(s_v) is <= 1: times 2^14 (exact) it stays <= 16384 < 65504, and a key whose
# scale is 1e-6 of the tile's largest keeps fp16's full precision instead of going subnormal
# (below 2^-14) and losing it, e.g. when the large-scale keys are masked for this row
PV_HEADROOM = tl.constexpr(16384.0)
# e4m3 P (P_FP8): P * s_v / max(s_v) <= 1 times 2^8 (exact) stays under e4m3's largest finite 448, and
# keeps its 3 mantissa bits down to 2^-14 of the tile's largest p * s_v (e4m3 is normal from 2^-6)
P_FP8_HEADROOM = tl.constexpr(256.0)

SCALE_TOKEN = tl.constexpr(0)
SCALE_BLOCK = tl.constexpr(1)
SCALE_STATIC = tl.constexpr(2)

MASK_NONE = tl.constexpr(0)
MASK_BOOL = tl.constexpr(1)
MASK_ADD = tl.constexpr(2)


@triton.jit
def _tanh(x):
    """tanh in fp32 from one exp2 (Triton has no tanh): sign(x) (1 - e) / (1 + e), e = exp(-2|x|) <= 1.

    No overflow for any x; absolute error about one fp32 ulp of 1 (the 1 - e cancellation near 0),
    so c * tanh(s / c) is off by ~c * 6e-8 at most, below an ulp of a logit of magnitude c.
    """
    e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23


@triton.jit
def _q_int8_halves(q):
    """q [BLOCK_M, BLOCK_D] -> (hi, lo, t, nan_rows): int8 tiles with q = t (254 hi + lo) to within t / 2
    per element, t = amax / 32258 (~2^-15 of the block's largest |q|): no more than an fp16 rounding
    (2^-11 relative) for every value above 1/32 of amax, and t is one per program, so that it folds into
    the softmax scale. hi = round(q / (254 t)); lo rounds the remainder, at most half a step of hi.
    A row holding a NaN or an infinity (which no int8 holds) is scored as zeros and ``nan_rows`` is NaN
    there (0 elsewhere), added to its output: NaN, as the reference gives that row, the others untouched."""
    q = q.to(tl.float32)
    row_max = tl.max(tl.where(q == q, tl.abs(q), float("inf")), axis=1)  # inf: the row holds a NaN or an inf
    nan_rows = tl.where(row_max < float("inf"), 0.0, float("nan"))
    q = tl.where(tl.abs(q) < float("inf"), q, 0.0)
    amax = tl.max(tl.where(row_max < float("inf"), row_max, 0.0), axis=0)
    amax = tl.where(amax > 0, amax, 1.0)
    inv = 127.0 / amax
    # x + 1.5 * 2^23 rounds x (|x| < 2^22) to an integer n, held as 0x4B400000 + n: its low byte is n as an
    # int8. |q| <= amax puts q * inv within 127 (+ one rounding), and the remainder within half a step of
    # hi, so lo within 127 too: both fit without a clamp.
    hr = tl.fma(q, inv, _ROUND_MAGIC)
    hi_f = hr - _ROUND_MAGIC
    lr = tl.fma(tl.fma(hi_f, -amax / 127.0, q), 254.0 * inv, _ROUND_MAGIC)
    hi = hr.to(tl.int32, bitcast=True).to(tl.int8)
    lo = lr.to(tl.int32, bitcast=True).to(tl.int8)
    return hi, lo, amax / 32258.0, nan_rows  # 32258 = 127 * 254


@triton.jit
def _e4m3(x, E4M3_RNE: tl.constexpr):
    """fp32 ``x`` (|x| <= 448) to e4m3, rounded to nearest even: by the cast (the GPU's cvt.rn), or
    (``E4M3_RNE``: the interpreter, whose cast mis-rounds when the carry reaches an odd exponent) rounded
    at 3 mantissa bits in fp32 first, the carry bumping the exponent, so that the cast is exact (below
    e4m3's normal range, 2^-6, the cast still rounds: an error under 2^-9 absolute)."""
    if E4M3_RNE:
        b = x.to(tl.int32, bitcast=True)
        x = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def _fp8_dot(a, b, acc, FP8_ACC: tl.constexpr):
    """``tl.dot`` of two e4m3 tiles into fp32 (``acc`` added, or None). sm_90's fp8 MMAs sum in reduced
    precision; ``FP8_ACC`` > 0 adds each FP8_ACC products to the fp32 result apart (Triton's
    max_num_imprecise_acc), 0 leaves Triton's default (sm_90: the whole sum, ``acc`` included, stays there)."""
    if FP8_ACC > 0:
        return tl.dot(a, b, acc, max_num_imprecise_acc=FP8_ACC)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _q_rows(q, FP8: tl.constexpr, E4M3_RNE: tl.constexpr):
    """q [BLOCK_M, BLOCK_D] -> (codes, row_scale, nan_rows): each row's codes at its own scale, q ~
    row_scale * codes, for one 8-bit dot against K's codes (``Q_INT8`` / ``Q_FP8``). int8: scale amax / 127
    of the row, codes rounded to nearest even (|error| <= amax / 254 per element). e4m3 (``FP8``): scale
    amax / 448, each value rounded to nearest even by :func:`_e4m3` (relative error <= 2^-4 in e4m3's
    normal range, from 2^-6 / 448 = 3.5e-5 of the row's largest).
    Rows with a NaN or an infinity: as :func:`_q_int8_halves`."""
    q = q.to(tl.float32)
    row_max = tl.max(tl.where(q == q, tl.abs(q), float("inf")), axis=1)
    nan_rows = tl.where(row_max < float("inf"), 0.0, float("nan"))
    q = tl.where(tl.abs(q) < float("inf"), q, 0.0)
    amax = tl.where((row_max < float("inf")) & (row_max > 0), row_max, 1.0)
    if FP8:
        codes = _e4m3(q * (448.0 / amax)[:, None], E4M3_RNE)
        scale = amax / 448.0
    else:
        r = tl.fma(q, (127.0 / amax)[:, None], _ROUND_MAGIC)  # within 127 (+ one rounding): no clamp
        codes = r.to(tl.int32, bitcast=True).to(tl.int8)
        scale = amax / 127.0
    return codes, scale, nan_rows


@triton.jit
def _p_rows_int8(x):
    """P [BLOCK_M, BLOCK_N] (p * s_v / max s_v: in [0, 1]) -> (codes, row_scale): int8 codes at amax / 127
    of each row, rounded to nearest even (|error| <= amax / 254 per element), for one int32 dot against
    V's int8 codes (``P_INT8``). The row's own amax: a bound from p alone (exp(max s - m)) ignores
    s_v / max s_v and costs the small-scale keys their precision (SmolLM2 KL 2.86e-3 against 0.73e-3,
    benchmarks/kl_prefill_q.py). A row of zeros (no visible key in the tile) takes scale 1 / 127. A NaN
    in x gives no NaN code: the caller carries it (the row sum of p, the V scales' sum)."""
    amax = tl.max(x, axis=1)
    amax = tl.where(amax > 0, amax, 1.0)
    r = tl.fma(x, (127.0 / amax)[:, None], _ROUND_MAGIC)  # within 127 (+ one rounding): no clamp
    return r.to(tl.int32, bitcast=True).to(tl.int8), amax / 127.0


@triton.jit
def _q_in_fp16_range(q):
    """(q, unscale) for fp16 dots: fp16 holds |x| < 65504, bf16 / fp32 queries may not: a block whose
    largest |q| reaches 2^15 is scaled by 2^-shift (exact), and 2^shift goes into the softmax scale
    (shift = 0 otherwise). The largest finite |q|: an Inf in one row must not flush the block's other
    rows to zero (its own row stays Inf, its scores Inf or NaN, as in the reference). One select, once."""
    q = q.to(tl.float32)
    qa = tl.where(tl.abs(q) < float("inf"), tl.abs(q), 0.0)
    amax_exp = ((tl.max(tl.max(qa, axis=1), axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF)
    q_shift = tl.maximum(amax_exp - 141, 0)  # |q| < 2^(e - 126) <= 2^15 once e - shift <= 141 (127 + 14)
    q = q * ((127 - q_shift) << 23).to(tl.float32, bitcast=True)
    return q, ((127 + q_shift) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_groups(x, s, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """x [BLOCK_N, BLOCK_D] * s [BLOCK_N, BLOCK_D // GROUP_SIZE], each scale over its GROUP_SIZE
    columns: the scales broadcast to the tile's shape (reshaping the tile instead ran q8_0 decode
    1.9x slower on the H200: docs/perf-log.md)."""
    sb = tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_D // GROUP_SIZE, GROUP_SIZE))
    return x * tl.reshape(sb, (BLOCK_N, BLOCK_D))


@triton.jit
def _finite_v(v, n_ok, SCALE_KIND: tl.constexpr, P_FP8: tl.constexpr):
    """A masked key-contiguous e4m3 V tile (its codes ``v``, widened to fp16 / fp32 or, ``P_FP8``, as
    they are), safe for the PV dot: codes past n_hi (read in whole 16-key chunks) may be NaN, and p = 0
    does not cancel NaN. max() returns its non-NaN operand: NaN becomes the lowest finite value (finite
    values pass) and 0 * it = 0. (An unmasked tile reads no codes past n_hi: a NaN there is the data's,
    as in the reference.) A NaN code below n_hi is the data's too (a NaN or an Inf stored, formats.py).
    Token scales: its token's scale is NaN as well, and reaches P, so every NaN code can go (the max()
    costs what it did; e4m3 codes, which have no max, are zeroed past n_hi as bits). Static scales: the
    code is the only marker, so the bound is NaN below n_hi, where max(x, NaN) = x keeps a NaN code NaN.
    The per-key bound costs fp8/static decode about 2% (H100) where the masked tile is a large share of
    the work; built from n_ok, as a bound from a fresh arange spilled 136 B on sm_80's bit-decoded path
    (docs/perf-log.md, non-finite values)."""
    if P_FP8:
        v = tl.where(n_ok[:, None], v.to(tl.uint8, bitcast=True), 0).to(tl.float8e4nv, bitcast=True)
    else:
        lowest = -65504.0 if v.dtype == tl.float16 else -3.0e38
        if SCALE_KIND == SCALE_TOKEN:
            v = tl.maximum(v, tl.full([1, 1], lowest, v.dtype))
        else:
            v = tl.maximum(v, tl.where(n_ok, float("nan"), lowest).to(v.dtype)[:, None])
    return v


@triton.jit
def _held(x):
    """``x`` unchanged, through an opaque move (inline PTX with side effects), where it is used. Triton
    stages a loaded tile for the dot (its shared-memory store, ldmatrix) right after the load, and that
    store waits for the data; passed through this at its use, the tile's staging stays there, so the
    program issues its other reads (q) and runs q's prologue while the tile is in flight."""
    b = x.to(tl.int8, bitcast=True)
    b = tl.inline_asm_elementwise(asm="mov.b32 $0, $1;", constraints="=r,r", args=[b], dtype=tl.int8, is_pure=False,
                                  pack=4)
    return b.to(x.dtype, bitcast=True)


@triton.jit
def _load_k(start_n, n_hi, d, d_ok, k_base, stride_kn, stride_kd, MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """One BLOCK_N-key tile's K codes."""
    n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        kc = tl.load(k_base + n[:, None] * stride_kn + d[None, :] * stride_kd, mask=(n < n_hi)[:, None] & d_ok[None, :],
                     other=0.0)
    else:
        kc = tl.load(k_base + n[:, None] * stride_kn + d[None, :] * stride_kd, mask=d_ok[None, :], other=0.0)
    return kc


@triton.jit
def _load_v(start_n, n_hi, d, d_ok, v_base, stride_vn, stride_vd, V_KEYS_CONTIG: tl.constexpr, MASKED: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """One BLOCK_N-key tile's V codes."""
    n = start_n + tl.arange(0, BLOCK_N)
    v_ptrs = v_base + n[:, None] * stride_vn + d[None, :] * stride_vd
    if V_KEYS_CONTIG:
        # Keys are the contiguous (and the reduced) dim of this tile, as D is for K: it feeds the
        # dot without a transpose. Mask whole 16-key chunks so the loads stay 16-byte vectors
        # (the launcher checked the storage extends to the 16-rounded length); p is 0 past n_hi,
        # and the V values read there are made finite in _attend_tile.
        tl.static_assert(BLOCK_N % 16 == 0)  # tiles start at multiples of 16: the chunks align
        if MASKED:
            chunk_ok = tl.max_constancy((n // 16) * 16 < n_hi, 16)
            vc = tl.load(v_ptrs, mask=chunk_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            vc = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    elif MASKED:
        vc = tl.load(v_ptrs, mask=(n < n_hi)[:, None] & d_ok[None, :], other=0.0)
    else:
        vc = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    return vc


@triton.jit
def _load_scales(start_n, n_hi, D, s_base, stride_sn, stride_sg, GROUP_SIZE: tl.constexpr, SCALE_KIND: tl.constexpr,
                 MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One BLOCK_N-key tile's K or V scales: token [BLOCK_N]; block [BLOCK_N, groups]; static none (0.0)."""
    n = start_n + tl.arange(0, BLOCK_N)
    s = 0.0
    if SCALE_KIND == SCALE_BLOCK:  # [BLOCK_N, groups] scales, broadcast over each group's columns
        gi = tl.arange(0, BLOCK_D // GROUP_SIZE)
        gs_ok = (gi * GROUP_SIZE < D)[None, :]
        if MASKED:
            gs_ok = (n < n_hi)[:, None] & gs_ok
        s = tl.load(s_base + n[:, None] * stride_sn + gi[None, :] * stride_sg, mask=gs_ok, other=0.0)
    elif SCALE_KIND == SCALE_TOKEN:
        if MASKED:
            s = tl.load(s_base + n * stride_sn, mask=n < n_hi, other=0.0)
        else:
            s = tl.load(s_base + n * stride_sn)
    return s


@triton.jit
def _keys_end(kv_len, kv_end, n_lo, split_len, Tq, last_q, IS_CAUSAL: tl.constexpr):
    """The end of the keys a program reads: its split's, cut at kv_len and (causal) at its last query."""
    n_hi = tl.minimum(kv_end, n_lo + split_len)
    if IS_CAUSAL:
        n_hi = tl.minimum(n_hi, kv_len - Tq + last_q + 1)
    return n_hi


@triton.jit
def _kv_bases(K, V, KS, VS, b, hk, stride_kb, stride_kh, stride_vb, stride_vh, stride_ksb, stride_ksh, stride_vsb,
              stride_vsh):
    """K's, V's and their scales' pointers at batch ``b``, kv head ``hk``."""
    return (K + b * stride_kb + hk * stride_kh, V + b * stride_vb + hk * stride_vh,
            KS + b * stride_ksb + hk * stride_ksh, VS + b * stride_vsb + hk * stride_vsh)

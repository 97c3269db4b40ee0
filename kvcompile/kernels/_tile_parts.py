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
def _scale_groups(x, s, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """x [BLOCK_N, BLOCK_D] * s [BLOCK_N, BLOCK_D // GROUP_SIZE], each scale over its GROUP_SIZE
    columns: the scales broadcast to the tile's shape (reshaping the tile instead ran q8_0 decode
    1.9x slower on the H200: docs/perf-log.md)."""
    sb = tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_D // GROUP_SIZE, GROUP_SIZE))
    return x * tl.reshape(sb, (BLOCK_N, BLOCK_D))


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

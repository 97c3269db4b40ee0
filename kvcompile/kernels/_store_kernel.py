"""@triton.jit quantize-on-store and dequantize kernels (launchers in store.py)."""

import triton
import triton.language as tl

from ._codes import FP8_MAX, Q8_MAX, codes_to_float, e4m3_encode, e4m3_encode_hw, to_store_dtype
from ..formats import fp8_e4m3, int8, q8_0
from ._rotation import hadamard_rows

# CODE constexpr of _quantize_rows: which format a side (K or V) is written in, by its FormatSpec.id
CODE_FP8 = tl.constexpr(fp8_e4m3.SPEC.id)  # any granularity
CODE_Q8_0 = tl.constexpr(q8_0.SPEC.id)  # GGUF q8_0: d = amax / 127, roundf(x * (1/d)), fp16 d
CODE_INT8 = tl.constexpr(int8.SPEC.id)  # s = amax / 127 (fp32), round-half-even(x / s)


@triton.jit
def _quantize_rows(
    X, stride_xb, stride_xh, stride_xt, stride_xd,
    C, stride_cb, stride_ch, stride_ct, stride_cd,
    S, stride_sb, stride_sh, stride_st, stride_sg,
    OFF, stride_oh, stride_od,
    b, h, t0, start, T, D, rot_scale,
    HAS_OFFSET: tl.constexpr,
    CODE: tl.constexpr,        # CODE_FP8, CODE_Q8_0 or CODE_INT8
    STATIC_SCALE: tl.constexpr,
    HW_E4M3: tl.constexpr,     # encode e4m3 by the sm_89+ convert instruction (else integer arithmetic)
    GROUPS_P2: tl.constexpr,   # scale groups per token, padded to a power of two (1 for token/static)
    GROUP_SIZE: tl.constexpr,  # values per scale group (32 for block32; padded head_dim otherwise)
    BLOCK_T: tl.constexpr,
    HADAMARD: tl.constexpr,    # store x @ H_D * rot_scale (one group of D == GROUP_SIZE; BLOCK_T >= 16)
    ROT_EXACT: tl.constexpr,   # the rotation's dots in fp32 FMAs (the interpreter)
    ROT_CHUNK: tl.constexpr,
    ONE_ROW: tl.constexpr = False,  # with HADAMARD: one token (T == 1), quantized alone after the 16-row rotation
):
    # A [BLOCK_T * GROUPS_P2, GROUP_SIZE] tile: row r is token t0 + r // GROUPS_P2, group r % GROUPS_P2.
    rows = tl.arange(0, BLOCK_T * GROUPS_P2)
    t = t0 + rows // GROUPS_P2
    g = rows % GROUPS_P2
    cols = tl.arange(0, GROUP_SIZE)
    d = g[:, None] * GROUP_SIZE + cols[None, :]
    row_ok = t < T
    ok = row_ok[:, None] & (d < D)

    if HADAMARD:  # the rotation of a cache stored rotated, in registers (no launch of its own)
        x = hadamard_rows(X + b * stride_xb + h * stride_xh + t[:, None] * stride_xt, stride_xd, row_ok[:, None],
                          rot_scale, ROT_EXACT, BLOCK_T, GROUP_SIZE, ROT_CHUNK)
        if ONE_ROW:  # rows 1.. are the dot's padding: the token's row alone goes on (a 16th of the work)
            x = tl.sum(tl.where((rows == 0)[:, None], x, 0.0), axis=0)[None, :]
            rows = tl.arange(0, 1)
            t = t0 + rows
            g = rows
            d = cols[None, :]
            row_ok = t < T
            ok = row_ok[:, None] & (d < D)
    else:
        x = tl.load(X + b * stride_xb + h * stride_xh + t[:, None] * stride_xt + d * stride_xd, mask=ok, other=0.0)
        x = x.to(tl.float32)
    if HAS_OFFSET:
        x = x - tl.load(OFF + h * stride_oh + d * stride_od, mask=ok, other=0.0).to(tl.float32)

    is_inf = tl.abs(x) == float("inf")
    is_nan = x != x
    # formats.py's non-finite policy: no format holds an Inf, so a NaN or an Inf is a NaN marker (the
    # group's scale, and fp8's NaN code for the element), never a saturated finite code
    if STATIC_SCALE:
        s = tl.load(S + h * stride_sh).to(tl.float32)
        y = tl.where(s > 0, tl.math.div_rn(x, tl.where(s > 0, s, 1.0)), 0.0)
    else:
        # scale from the finite values of each group only (formats.py's NaN/Inf policy)
        amax = tl.max(tl.where(is_inf | is_nan, 0.0, tl.abs(x)), axis=1)
        if CODE == CODE_Q8_0:
            dd = tl.math.div_rn(amax, Q8_MAX)  # d = amax / 127 (fp32, round to nearest)
            inv = tl.where(dd > 0, tl.math.div_rn(1.0, tl.where(dd > 0, dd, 1.0)), 0.0)
            y = x * inv[:, None]  # x * (1/d), as GGUF does
            y = tl.where(is_inf, tl.where(x > 0, Q8_MAX, -Q8_MAX), y)
            has_nan = tl.max((is_nan | is_inf).to(tl.int32), axis=1) > 0
            s = tl.where(has_nan, float("nan"), dd)
        else:
            if CODE == CODE_INT8:
                qmax = Q8_MAX
            else:
                qmax = FP8_MAX
            s = tl.math.div_rn(amax, qmax)  # s = amax / 448 (fp8) or amax / 127 (int8)
            # x / s per element, correctly rounded (bit-exact with formats.py; one reciprocal per row
            # with a Markstein fix-up was 1.5x faster but an ulp off on the H200: docs/perf-log.md). A
            # tiny s (possibly subnormal) and its row are first scaled by 2**64: exact, same quotient.
            up = tl.where(s < 8.673617379884035e-19, 18446744073709551616.0, 1.0)  # 2**-60, 2**64
            ss = tl.where(s > 0, s * up, 1.0)
            y = tl.math.div_rn(x * up[:, None], ss[:, None])
            y = tl.where(s[:, None] > 0, y, 0.0)
            y = tl.where(is_inf, tl.where(x > 0, qmax, -qmax), y)
            # a group holding a NaN or an Inf: a NaN scale (int8 has no NaN code; fp8 stores its NaN code too)
            has_nan = tl.max((is_nan | is_inf).to(tl.int32), axis=1) > 0
            s = tl.where(has_nan, float("nan"), s)
        tl.store(
            S + b * stride_sb + h * stride_sh + (start + t) * stride_st + g * stride_sg,
            s.to(S.dtype.element_ty),
            mask=row_ok & (g * GROUP_SIZE < D),
        )
    if CODE != CODE_FP8:
        y = tl.minimum(tl.maximum(y, -Q8_MAX), Q8_MAX)  # tl.maximum may drop a NaN: use is_nan below
        a = tl.abs(y)
        f = tl.floor(a)
        frac = a - f  # exact: no fp32 rounding of |y| + 0.5
        if CODE == CODE_Q8_0:
            r = f + tl.floor(2.0 * frac)  # C roundf: half away from zero
        else:
            # round half to even: up above one half, and at one half when floor|y| is odd
            odd = (f.to(tl.int32) & 1) == 1
            r = f + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)
        r = tl.where(y < 0, -r, r)
        code = tl.where(is_nan, 0.0, r).to(tl.int8)  # int8 has no NaN code (the scale carries it)
    else:
        # a NaN input stays NaN (also in an otherwise all-zero group), an Inf becomes NaN: e4m3 has no Inf
        y = tl.where(is_nan, x, tl.where(is_inf, float("nan"), y))
        if HW_E4M3:
            code = e4m3_encode_hw(y)  # saturates to +-448 itself
        else:
            y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
            code = e4m3_encode(y)  # uint8; C is the cache viewed as uint8
    tl.store(C + b * stride_cb + h * stride_ch + (start + t[:, None]) * stride_ct + d * stride_cd, code, mask=ok)


@triton.jit
def store_token(
    K, stride_kb, stride_kh, stride_kt, stride_kd,
    V, stride_vb, stride_vh, stride_vt, stride_vd,
    KC, stride_kcb, stride_kch, stride_kct, stride_kcd,
    VC, stride_vcb, stride_vch, stride_vct, stride_vcd,
    KS, stride_ksb, stride_ksh, stride_kst, stride_ksg,
    VS, stride_vsb, stride_vsh, stride_vst, stride_vsg,
    OFF, stride_oh, stride_od,
    b, h, slot, D, rot_scale,
    HAS_OFFSET: tl.constexpr,
    STATIC_SCALE: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,  # GROUP_SIZE-wide scale groups (block32, q8_0); else one scale per token
    HW_E4M3: tl.constexpr,
    K_HADAMARD: tl.constexpr,
    V_HADAMARD: tl.constexpr,
    ROT_EXACT: tl.constexpr,
    ROT_CHUNK: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_CODE: tl.constexpr,  # K's format (CODE_*: its FormatSpec.id); V's may differ when both share one granularity
    V_CODE: tl.constexpr,
):
    """One token (row 0 of K / V ``[B, H, 1, D]``) of kv head ``h`` into ``slot``, K and V, as
    ``_store_kv_kernel`` stores it, from inside another kernel (the attention kernel's ``STORE_NEW``):
    each side in its format (``K_CODE`` / ``V_CODE``, e4m3 codes as uint8 bits), a rotated side's 16-row
    product quantized as the token's row alone (``ONE_ROW``)."""
    GROUPS_P2: tl.constexpr = BLOCK_D // GROUP_SIZE if BLOCK_SCALES else 1
    STORE_GROUP: tl.constexpr = GROUP_SIZE if BLOCK_SCALES else BLOCK_D
    _quantize_rows(K, stride_kb, stride_kh, stride_kt, stride_kd, KC, stride_kcb, stride_kch, stride_kct, stride_kcd,
                   KS, stride_ksb, stride_ksh, stride_kst, stride_ksg, OFF, stride_oh, stride_od,
                   b, h, 0, slot, 1, D, rot_scale, HAS_OFFSET, K_CODE, STATIC_SCALE, HW_E4M3,
                   GROUPS_P2, STORE_GROUP, 16 if K_HADAMARD else 1, K_HADAMARD, ROT_EXACT, ROT_CHUNK,
                   ONE_ROW=K_HADAMARD)
    _quantize_rows(V, stride_vb, stride_vh, stride_vt, stride_vd, VC, stride_vcb, stride_vch, stride_vct, stride_vcd,
                   VS, stride_vsb, stride_vsh, stride_vst, stride_vsg, OFF, stride_oh, stride_od,
                   b, h, 0, slot, 1, D, rot_scale, False, V_CODE, STATIC_SCALE, HW_E4M3,
                   GROUPS_P2, STORE_GROUP, 16 if V_HADAMARD else 1, V_HADAMARD, ROT_EXACT, ROT_CHUNK,
                   ONE_ROW=V_HADAMARD)


@triton.jit
def _store_kv_kernel(
    K, stride_kb, stride_kh, stride_kt, stride_kd,
    V, stride_vb, stride_vh, stride_vt, stride_vd,
    KC, stride_kcb, stride_kch, stride_kct, stride_kcd,
    VC, stride_vcb, stride_vch, stride_vct, stride_vcd,
    KS, stride_ksb, stride_ksh, stride_kst, stride_ksg,
    VS, stride_vsb, stride_vsh, stride_vst, stride_vsg,
    OFF, stride_oh, stride_od,
    START, H, T, D,
    SHIFT, RING,  # the first position is START + SHIFT, taken modulo RING when RING > 0 (a ring, T == 1)
    rot_scale,    # 1 / sqrt(D) (K_HADAMARD, V_HADAMARD)
    HAS_OFFSET: tl.constexpr,
    K_CODE: tl.constexpr,  # K's format (CODE_*); V's may differ when both share one scale granularity
    V_CODE: tl.constexpr,
    STATIC_SCALE: tl.constexpr,
    HW_E4M3: tl.constexpr,
    GROUPS_P2: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    K_HADAMARD: tl.constexpr,  # K (V) stored times kvcompile.rotation's Sylvester matrix, rotated here
    V_HADAMARD: tl.constexpr,
    ROT_EXACT: tl.constexpr,
    ROT_CHUNK: tl.constexpr,
):
    """grid (cdiv(T, BLOCK_T), B * H, 2): axis 2 picks K (0) or V (1): both in one launch."""
    t0 = tl.program_id(0) * BLOCK_T
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start = tl.load(START).to(tl.int32) + SHIFT  # the first position written, from a device scalar
    if RING > 0:
        start = start % RING
    if tl.program_id(2) == 0:
        _quantize_rows(
            K, stride_kb, stride_kh, stride_kt, stride_kd,
            KC, stride_kcb, stride_kch, stride_kct, stride_kcd,
            KS, stride_ksb, stride_ksh, stride_kst, stride_ksg,
            OFF, stride_oh, stride_od,
            b, h, t0, start, T, D, rot_scale,
            HAS_OFFSET, K_CODE, STATIC_SCALE, HW_E4M3, GROUPS_P2, GROUP_SIZE, BLOCK_T, K_HADAMARD, ROT_EXACT,
            ROT_CHUNK,
        )
    else:
        _quantize_rows(
            V, stride_vb, stride_vh, stride_vt, stride_vd,
            VC, stride_vcb, stride_vch, stride_vct, stride_vcd,
            VS, stride_vsb, stride_vsh, stride_vst, stride_vsg,
            OFF, stride_oh, stride_od,
            b, h, t0, start, T, D, rot_scale,
            False, V_CODE, STATIC_SCALE, HW_E4M3, GROUPS_P2, GROUP_SIZE, BLOCK_T, V_HADAMARD, ROT_EXACT,
            ROT_CHUNK,
        )


@triton.jit
def _dequantize_rows(
    C, stride_cb, stride_ch, stride_cl, stride_cd,
    S, stride_sb, stride_sh, stride_sl, stride_sg,
    OFF, stride_oh, stride_od,
    OUT, stride_ob, stride_oh2, stride_ol, stride_od2,
    b, h, l0, kv_len, L, D, G, rot_scale,
    HAS_OFFSET: tl.constexpr,
    STATIC_SCALE: tl.constexpr,
    FP8_BITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNROTATE: tl.constexpr = False,  # codes of x @ H_D * rot_scale (Sylvester; one scale per row): write x
    EXACT: tl.constexpr = False,     # UNROTATE's dots in fp32 FMAs (the interpreter)
    RC: tl.constexpr = 32,           # UNROTATE's columns per dot (<= BLOCK_D, >= 16)
):
    """Rows l0 .. l0 + BLOCK_L of (b, h): codes * scale (+ offset); zeros at positions >= kv_len.
    ``UNROTATE``: ``(codes @ H_D^T) * scale * rot_scale``, the rotation undone on the exact codes
    before the one scaling (token or static scales: a row's scale factors out of the product)."""
    l = l0 + tl.arange(0, BLOCK_L)
    d = tl.arange(0, BLOCK_D)
    in_range = (l[:, None] < L) & (d[None, :] < D)
    live = l < kv_len
    if UNROTATE:
        x = hadamard_rows(C + b * stride_cb + h * stride_ch + l[:, None] * stride_cl, stride_cd, (l < L)[:, None],
                          1.0, EXACT, BLOCK_L, BLOCK_D, RC, CODES=True, FP8_BITS=FP8_BITS)
        if STATIC_SCALE:
            x = x * (tl.load(S + h * stride_sh).to(tl.float32) * rot_scale)
        else:
            s = tl.load(S + b * stride_sb + h * stride_sh + l * stride_sl, mask=l < L, other=0.0)
            x = x * (s.to(tl.float32) * rot_scale)[:, None]
    else:
        c = tl.load(C + b * stride_cb + h * stride_ch + l[:, None] * stride_cl + d[None, :] * stride_cd, mask=in_range,
                    other=0.0)
        x = codes_to_float(c, FP8_BITS)
        if STATIC_SCALE:
            x = x * tl.load(S + h * stride_sh).to(tl.float32)
        else:
            g = d // (D // G)  # the scale group of each column
            s = tl.load(S + b * stride_sb + h * stride_sh + l[:, None] * stride_sl + g[None, :] * stride_sg,
                        mask=in_range, other=0.0)
            x = x * s.to(tl.float32)
    if HAS_OFFSET:
        x = x + tl.load(OFF + h * stride_oh + d * stride_od, mask=d < D, other=0.0).to(tl.float32)[None, :]
    x = tl.where(live[:, None], x, 0.0)
    tl.store(OUT + b * stride_ob + h * stride_oh2 + l[:, None] * stride_ol + d[None, :] * stride_od2,
             to_store_dtype(x, OUT.dtype.element_ty), mask=in_range)


@triton.jit
def _dequantize_kernel(
    C, stride_cb, stride_ch, stride_cl, stride_cd,
    S, stride_sb, stride_sh, stride_sl, stride_sg,
    OFF, stride_oh, stride_od,
    KVLEN, stride_kvl,
    OUT, stride_ob, stride_oh2, stride_ol, stride_od2,
    H, L, D, G,
    HAS_OFFSET: tl.constexpr,
    STATIC_SCALE: tl.constexpr,
    FP8_BITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """grid (cdiv(L, BLOCK_L), B * H): codes * scale (+ offset); zeros at positions >= kv_len[b]."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kv_len = tl.load(KVLEN + b * stride_kvl)
    _dequantize_rows(
        C, stride_cb, stride_ch, stride_cl, stride_cd,
        S, stride_sb, stride_sh, stride_sl, stride_sg,
        OFF, stride_oh, stride_od,
        OUT, stride_ob, stride_oh2, stride_ol, stride_od2,
        b, h, tl.program_id(0) * BLOCK_L, kv_len, L, D, G, 1.0,
        HAS_OFFSET, STATIC_SCALE, FP8_BITS, BLOCK_L, BLOCK_D,
    )


@triton.jit
def _dequantize_kv_kernel(
    KC, stride_kcb, stride_kch, stride_kcl, stride_kcd,
    KS, stride_ksb, stride_ksh, stride_ksl, stride_ksg,
    VC, stride_vcb, stride_vch, stride_vcl, stride_vcd,
    VS, stride_vsb, stride_vsh, stride_vsl, stride_vsg,
    KVLEN, stride_kvl,
    KO, stride_kob, stride_koh, stride_kol, stride_kod,
    VO, stride_vob, stride_voh, stride_vol, stride_vod,
    H, L, D, G, rot_scale,
    STATIC_SCALE: tl.constexpr,
    K_FP8_BITS: tl.constexpr,  # per side: K and V codes may differ (fp8 K with int8 V and vice versa)
    V_FP8_BITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_UNROTATE: tl.constexpr = False,  # per side: codes of x @ H_D * rot_scale, written as x (_dequantize_rows)
    V_UNROTATE: tl.constexpr = False,
    EXACT: tl.constexpr = False,
    RC: tl.constexpr = 32,
):
    """grid (cdiv(L, BLOCK_L), B * H, 2): axis 2 picks K (0) or V (1), each in its own layout: the
    dense prefill's workspace in one launch (no offset: softmax does not see K's centering), a side
    stored rotated by the Sylvester matrix rotated back on the way."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    l0 = tl.program_id(0) * BLOCK_L
    kv_len = tl.load(KVLEN + b * stride_kvl)
    if tl.program_id(2) == 0:
        _dequantize_rows(
            KC, stride_kcb, stride_kch, stride_kcl, stride_kcd,
            KS, stride_ksb, stride_ksh, stride_ksl, stride_ksg,
            KS, 0, 0,
            KO, stride_kob, stride_koh, stride_kol, stride_kod,
            b, h, l0, kv_len, L, D, G, rot_scale,
            False, STATIC_SCALE, K_FP8_BITS, BLOCK_L, BLOCK_D, K_UNROTATE, EXACT, RC,
        )
    else:
        _dequantize_rows(
            VC, stride_vcb, stride_vch, stride_vcl, stride_vcd,
            VS, stride_vsb, stride_vsh, stride_vsl, stride_vsg,
            VS, 0, 0,
            VO, stride_vob, stride_voh, stride_vol, stride_vod,
            b, h, l0, kv_len, L, D, G, rot_scale,
            False, STATIC_SCALE, V_FP8_BITS, BLOCK_L, BLOCK_D, V_UNROTATE, EXACT, RC,
        )

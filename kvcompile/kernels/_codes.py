"""@triton.jit helpers shared by the kernels: 8-bit codes <-> fp32, bit-exact with formats.py.

No launchers here. Rounding is done in integer arithmetic on the fp32 bit pattern, so the result
never depends on how a given Triton/arch lowers an fp32 -> e4m3 cast (through fp16 with
truncation on some archs; garbage past +-448 in the interpreter).
"""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3fn value
Q8_MAX = tl.constexpr(127.0)  # GGUF q8_0
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6: below it e4m3 is subnormal, step 2**-9


@triton.jit
def e4m3_encode(y):
    """fp32 ``y`` (already clamped to [-448, 448] or NaN) -> e4m3fn code as uint8, round to nearest even."""
    ybits = y.to(tl.uint32, bitcast=True)
    sign = (ybits >> 31).to(tl.uint8)
    a = tl.abs(y)
    abits = a.to(tl.uint32, bitcast=True)
    # normal range: round the 23-bit fp32 mantissa to 3 bits at bit 20, ties to even
    # (0x7FFFF = half an e4m3 ulp minus one; the kept lsb breaks the tie). A carry into the
    # exponent is the correct rounding up to the next binade.
    lsb = (abits >> 20) & 1
    rbits = (abits + 0x7FFFF + lsb) & 0xFFF00000
    exp = (rbits >> 23).to(tl.int32) - 120  # fp32 bias 127, e4m3 bias 7
    man = ((rbits >> 20) & 7).to(tl.int32)
    normal_code = (exp << 3) | man
    # subnormal range (|y| < 2**-6): code = round_half_even(|y| * 2**9), 0..8 (8 is the first normal)
    v = a * 512.0
    fl = v.to(tl.int32)
    fr = v - fl.to(tl.float32)
    up = (fr > 0.5) | ((fr == 0.5) & ((fl & 1) == 1))
    sub_code = fl + up.to(tl.int32)
    code = tl.where(a < E4M3_MIN_NORMAL, sub_code, normal_code)
    code = tl.where(y != y, 0x7F, code)  # NaN keeps its sign: 0x7F / 0xFF
    return (code.to(tl.uint8) | (sign << 7)).to(tl.uint8)


# four fp32 in $1..$4 -> four e4m3fn codes in $0 (byte 0 <- $1). cvt's first source goes to the high byte.
_F32_TO_E4M3X4 = tl.constexpr("""{
    .reg .b16 lo, hi;
    cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
    cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
    mov.b32 $0, {lo, hi};
    }""")


@triton.jit
def e4m3_encode_hw(y):
    """fp32 ``y`` -> e4m3fn code as uint8 by the sm_89+ convert: one rounding from fp32, to nearest
    even, saturating to +-448; NaN -> 0x7F. The same codes as :func:`e4m3_encode` (NaN sign aside),
    one instruction per two values instead of ~25 integer ops per value. GPU only (inline PTX).

    Not ``y.to(tl.float8e4nv)``: how Triton lowers that cast depends on the arch (through fp16, with
    double rounding, on sm_89), and it does not saturate.
    """
    return tl.inline_asm_elementwise(asm=_F32_TO_E4M3X4, constraints="=r,r,r,r,r", args=[y], dtype=tl.uint8,
                                     is_pure=True, pack=4)


@triton.jit
def e4m3_bits_to_f16(b):
    """e4m3fn code (uint8) -> fp16, exactly, by 16-bit integer ops and one multiply (archs without
    tl.float8e4nv; every decode of e4m3 bits goes through it). Shifted left by 7, e4m3's exponent and
    mantissa bits fill fp16's exponent and mantissa fields. The fp16 value this makes, normal or
    subnormal, is the code's value times 2^-8, because fp16's exponent bias (15) is 8 more than
    e4m3's (7). Multiplying by 256 is exact. NaN (S.1111.111) is the one code this would read as 480,
    so it is taken apart."""
    b = b.to(tl.uint16)
    mag = b & 0x7F
    h = ((mag << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0
    return tl.where(mag == 0x7F, float("nan"), h)


@triton.jit
def codes_to_f16_pinned(c):
    """8-bit codes (e4m3fn as uint8 bits, or int8) -> fp16, exactly, as inline PTX that Triton
    treats as having side effects (``is_pure=False``), so the conversion stays where it is written.

    Why: a tile that feeds ``tl.dot`` as the B operand reduced over its rows (V in P @ V) is
    read k-major. Converted by ``.to(tl.float16)``, Triton sinks the convert below the shared
    memory read, into the dot-operand layout, and reads the 8-bit tile one byte per lane
    (``LDS.U8``: 128 per thread per 128x128 tile on sm_90; there is no 8-bit ldmatrix.trans).
    Pinned here, the codes are read 16 bytes at a time, widened in registers, and the fp16 tile
    goes through shared memory to ``ldmatrix.trans``. GPU only. e4m3: ``cvt.rn.f16x2.e4m3x2``
    (sm_89+; NaN codes stay NaN). int8: the magic-number trick of ``codes_to``, four at a time
    (``prmt`` puts each byte + 128 under the fp16 exponent of 1024, one ``sub.f16x2`` per pair).
    """
    if c.dtype == tl.int8:
        return _widen_four_pinned(c, _INT8_TO_F16X2)
    else:
        return _widen_four_pinned(c, _E4M3_TO_F16X2)


# four 8-bit codes in $2 -> two fp16x2 registers $0, $1 (element order: byte 0 -> low half of $0)
_INT8_TO_F16X2 = tl.constexpr("""{
    .reg .b32 x, lo, hi, m;
    xor.b32 x, $2, 0x80808080;
    prmt.b32 lo, x, 0x64646464, 0x4140;
    prmt.b32 hi, x, 0x64646464, 0x4342;
    mov.b32 m, 0x64806480;
    sub.f16x2 $0, lo, m;
    sub.f16x2 $1, hi, m;
    }""")
# ... the same without the subtraction: 1152 + code (the attention kernel corrects the dot instead)
_INT8_TO_F16X2_BIASED = tl.constexpr("""{
    .reg .b32 x;
    xor.b32 x, $2, 0x80808080;
    prmt.b32 $0, x, 0x64646464, 0x4140;
    prmt.b32 $1, x, 0x64646464, 0x4342;
    }""")
_E4M3_TO_F16X2 = tl.constexpr("""{
    .reg .b16 lo, hi;
    mov.b32 {lo, hi}, $2;
    cvt.rn.f16x2.e4m3x2 $0, lo;
    cvt.rn.f16x2.e4m3x2 $1, hi;
    }""")


@triton.jit
def _widen_four_pinned(c, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,r", args=[c], dtype=tl.float16, is_pure=False,
                                     pack=4)


@triton.jit
def codes_to_float(c, FP8_BITS: tl.constexpr):
    """Loaded codes (fp8, int8, or uint8 bits of e4m3 when FP8_BITS) -> fp32, exactly."""
    if FP8_BITS:
        return e4m3_bits_to_f16(c).to(tl.float32)
    else:
        return c.to(tl.float32)


@triton.jit
def to_store_dtype(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even (the interpreter truncates fp32 -> bf16 casts)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rne = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # RNE at bit 16; Inf stays Inf
        # a NaN keeps its sign and becomes a quiet bf16 NaN: rounding its payload could carry through
        # the exponent into the sign (the GPU's own NaN is 0x7FFFFFFF, which would read as -0.0)
        bits = tl.where(x != x, (bits >> 16) | 0x40, rne)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def codes_to(c, DTYPE: tl.constexpr, FP8_BITS: tl.constexpr, INT8_PTX: tl.constexpr = False,
             BIASED: tl.constexpr = False):
    """Loaded codes -> DTYPE, exactly. int8 -> fp16 by the magic-number trick (integer add +
    one fp16 subtract instead of a quarter-rate int->float convert): fp16 bits 0x6400 | (c + 128)
    is 1024 + 128 + c, exact since fp16 steps by 1 in [1024, 2048).

    ``INT8_PTX`` (GPU only): the same trick four codes at a time in inline PTX (one ``prmt`` pair
    and two ``sub.f16x2`` per four codes, where Triton emits a ``prmt`` and a 16-bit add per code).
    Unpinned (``is_pure=True``): Triton may still sink it below the shared-memory read into the
    dot-operand layout, which is where a K tile (reduced over its contiguous dim) wants it.

    ``BIASED`` (int8 -> fp16 only): 1152 + code, without the subtraction (one ``sub.f16x2`` per two
    codes saved; the caller corrects its dot by 1152 times the sum of the other operand).
    """
    if FP8_BITS:  # e4m3 values are exact in fp16, fp32 and bf16 alike
        return e4m3_bits_to_f16(c).to(DTYPE)
    elif INT8_PTX and c.dtype == tl.int8 and DTYPE == tl.float16:
        if BIASED:
            return tl.inline_asm_elementwise(asm=_INT8_TO_F16X2_BIASED, constraints="=r,=r,r", args=[c],
                                             dtype=tl.float16, is_pure=True, pack=4)
        return tl.inline_asm_elementwise(asm=_INT8_TO_F16X2, constraints="=r,=r,r", args=[c], dtype=tl.float16,
                                         is_pure=True, pack=4)
    elif c.dtype == tl.int8 and DTYPE == tl.float16:
        u = (c.to(tl.int16) + 0x6480).to(tl.uint16)  # 0x6400 = 1024.0, + 128 shifts [-128, 127] to [0, 255]
        if BIASED:
            return u.to(tl.float16, bitcast=True)
        return u.to(tl.float16, bitcast=True) - 1152.0
    else:
        return c.to(DTYPE)

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


@triton.jit
def e4m3_decode_bits(b):
    """e4m3fn code (uint8) -> fp32 by bit manipulation (archs without tl.float8e4nv)."""
    b = b.to(tl.uint32)
    sign = (b >> 7) << 31
    e = (b >> 3) & 0xF
    m = b & 7
    normal = ((e + 120) << 23) | (m << 20)  # rebias 7 -> 127, mantissa to the top 3 bits
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))  # 2**-9
    val = (val.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    is_nan = (e == 15) & (m == 7)
    return tl.where(is_nan, float("nan"), val)


@triton.jit
def codes_to_float(c, FP8_BITS: tl.constexpr):
    """Loaded codes (fp8, int8, or uint8 bits of e4m3 when FP8_BITS) -> fp32, exactly."""
    if FP8_BITS:
        return e4m3_decode_bits(c)
    else:
        return c.to(tl.float32)


@triton.jit
def to_store_dtype(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even (the interpreter truncates fp32 -> bf16 casts)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # RNE at bit 16; Inf/NaN stay Inf/NaN
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)

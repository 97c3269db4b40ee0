"""KV formats (kvcompile.formats) against references that do not share its code.

* fp8 e4m3: the 256 codes are decoded from their bits by hand (tests/utils.py); rounding is
  checked against a float64 nearest-value search over that table with ties to the even code,
  saturating at ±448 (never NaN for finite inputs).
* q8_0: the ``gguf`` package's ``gguf.quants`` Q8_0 (bit-exact with ggml-quants.c), bitwise.
* NaN/Inf: the policy documented in formats.py's module docstring.
"""

from __future__ import annotations

import math

import gguf  # the q8_0 oracle; a hard import so CI cannot skip it silently ([test] extra)
import numpy as np
import pytest
import torch
from gguf import quants

from kvcompile import KV_DTYPES, formats, get_format
from utils import assert_close, assert_sqnr, bits_equal, decode_codes_f64, e4m3_code_values, sqnr

FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------
# independent references
# ------------------------------------------------------------------------------------------------

_E4M3 = e4m3_code_values()
_POS_GRID = _E4M3[:127].numpy()  # codes 0x00..0x7E: +0 .. 448, ascending; 0x7F is NaN


def e4m3_rne_ref(y: np.ndarray) -> np.ndarray:
    """float64 value of the e4m3 code nearest to ``y`` (ties to the even code), saturating at ±448."""
    y = np.asarray(y, dtype=np.float64)
    out = np.empty_like(y)
    nan = np.isnan(y)
    a = np.minimum(np.abs(np.where(nan, 0.0, y)), 448.0)
    hi = np.searchsorted(_POS_GRID, a, side="left").clip(0, 126)  # first grid value >= a
    lo = (hi - 1).clip(0, 126)
    d_lo, d_hi = a - _POS_GRID[lo], _POS_GRID[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))  # code index parity = mantissa LSB
    idx = np.where(pick_hi, hi, lo)
    out = np.copysign(_POS_GRID[idx], y)
    out[nan] = np.nan
    return out


def fp8_quantize_ref(x: torch.Tensor, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-group fp8 quantization as documented: s = fp32(amax_finite / 448), y = fp32(x / s),
    ±Inf -> ±448, s == 0 -> 0; returns (code values float64 [..., D], scales float32 [..., G])."""
    x = x.float().numpy()
    xg = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    amax = np.where(np.isfinite(xg), np.abs(xg), np.float32(0)).max(axis=-1, keepdims=True)
    s = (amax / np.float32(448.0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s > 0, xg / s, np.float32(0)).astype(np.float32)
    y = np.where(np.isinf(xg), np.sign(xg) * np.float32(448.0), y)
    return e4m3_rne_ref(y).reshape(x.shape), s[..., 0]


def gguf_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float32 -> (int8 codes [..., D], fp16 d [..., D/32]) from gguf.quants."""
    rows = x.reshape(-1, x.shape[-1]).numpy().astype(np.float32)
    raw = quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)  # [N, D/32 * 34] bytes
    blocks = raw.reshape(rows.shape[0], -1, 34)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows.shape)
    return (torch.from_numpy(qs.copy()).reshape(x.shape),
            torch.from_numpy(d.copy()).reshape(*x.shape[:-1], -1))


def fp8_midpoints() -> np.ndarray:
    """Every midpoint between adjacent non-negative e4m3 values (exact in fp32), one fp32 ulp
    either side of each, and their negatives."""
    g = _POS_GRID
    mids = ((g[:-1] + g[1:]) / 2).astype(np.float32)
    below = np.nextafter(mids, np.float32(0))
    above = np.nextafter(mids, np.float32(np.inf))
    v = np.concatenate([mids, below, above])
    return np.concatenate([v, -v]).astype(np.float32)


def _adversarial_fp8_inputs() -> torch.Tensor:
    """Values fed straight to the e4m3 rounding (static scale 1.0: y = x)."""
    special = np.array(
        [0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 479.9, 480.0, 500.0, 1e4, 1e30, 3.4e38, -3.4e38,
         2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11, 2.0 ** -7 * 1.0625, 1e-30, 1e-40, 1.4e-45,
         -2.0 ** -10, -3 * 2.0 ** -10, 0.0029296875, 240.0, 248.0, 256.0, 272.0],
        dtype=np.float32,
    )
    gen = torch.Generator().manual_seed(0)
    rand = torch.cat([
        torch.randn(4096, generator=gen) * 100,
        torch.rand(4096, generator=gen) * 1e-2,  # subnormal range of e4m3 (< 2^-6)
        (torch.rand(2048, generator=gen) - 0.5) * 1000,  # beyond ±448 half the time
    ]).numpy()
    v = np.concatenate([special, fp8_midpoints(), rand]).astype(np.float32)
    n = -(-v.size // 64) * 64  # pad to whole rows of D = 64
    return torch.from_numpy(np.pad(v, (0, n - v.size))).view(1, 1, -1, 64)


# ------------------------------------------------------------------------------------------------
# e4m3 code table and rounding
# ------------------------------------------------------------------------------------------------


def test_all_256_e4m3_codes_decode_exactly():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).view(1, 1, 4, 64)
    one = torch.ones(1)  # static scale 1: dequantize returns the code values themselves
    got = formats.dequantize(codes, one, torch.float64).flatten()
    ref = _E4M3
    assert torch.equal(got.isnan(), ref.isnan()) and int(ref.isnan().sum()) == 2
    fin = ~ref.isnan()
    assert torch.equal(got[fin], ref[fin])
    assert torch.equal(got[fin].signbit(), ref[fin].signbit())  # 0x80 is -0
    assert ref[fin].max() == 448.0 and ref[fin].min() == -448.0
    assert ref[1] == 2.0 ** -9  # smallest subnormal


@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
def test_fp8_rounding_is_nearest_even_and_saturates(scale):
    x = _adversarial_fp8_inputs() * np.float32(scale)
    codes, s = formats.quantize(x, FP8, scale=torch.tensor([scale]))
    assert s.item() == scale
    y = (x.float() / torch.tensor(scale, dtype=torch.float32)).numpy()  # fp32 x / s as documented
    ref = e4m3_rne_ref(y)
    # an input that is itself infinite (scale 3: 3.4e38 * 3 overflows) is the NaN code (no Inf in e4m3)
    inf_in = np.isinf(x.flatten().numpy())
    ref = np.where(inf_in, np.nan, ref.flatten())
    got = decode_codes_f64(codes).flatten().numpy()
    same = (got == ref) & (np.signbit(got) == np.signbit(ref)) | (np.isnan(got) & np.isnan(ref))
    bad = np.nonzero(~same)[0]
    assert bad.size == 0, (
        f"{bad.size} e4m3 roundings differ from nearest-even, e.g. "
        + ", ".join(f"x/s={y.flatten()[i]!r}: got {got[i]!r} want {ref[i]!r}" for i in bad[:8])
    )
    assert not np.isnan(got[~inf_in]).any(), "finite inputs must never become NaN (saturate at ±448)"
    assert inf_in.any() == (scale == 3.0)


def test_fp8_ties_go_to_even_explicitly():
    # hand-checked ties: the even code wins, never "round half up"
    x = torch.tensor([2 ** -10, 3 * 2 ** -10, 1.0625, 1.1875, 17.0, 19.0, 464.0, -464.0, 13.0, 15.0],
                     dtype=torch.float32)
    want = [0.0, 2 ** -8, 1.0, 1.25, 16.0, 20.0, 448.0, -448.0, 13.0, 15.0]  # 13, 15 are on the grid
    x = torch.nn.functional.pad(x, (0, 32 - x.numel())).view(1, 1, 1, 32)
    codes, _ = formats.quantize(x, FP8, scale=torch.ones(1))
    assert decode_codes_f64(codes).flatten()[: len(want)].tolist() == want


@pytest.mark.parametrize("granularity", ["token", "block32"])
def test_fp8_dynamic_scales_match_reference(granularity):
    gen = torch.Generator().manual_seed(1)
    D = 128
    x = torch.randn(2, 3, 17, D, generator=gen)
    # rows spanning many magnitudes, an outlier, all-zero rows/blocks, fp32-subnormal rows
    x[0, 0] *= torch.logspace(-30, 30, 17).view(-1, 1)
    x[0, 1, 3, 5] = 1e4
    x[1, 0, 4] = 0.0
    x[1, 1, 6, :32] = 0.0
    x[1, 2, 7] = torch.randn(D, generator=gen) * 1e-39
    x[1, 2, 8] = 1.4e-45
    fmt = get_format("fp8_e4m3", granularity)
    G = fmt.groups(D)
    codes, s = formats.quantize(x, fmt.code_dtype, groups=G)
    assert codes.dtype == FP8 and s.dtype == torch.float32 and s.shape == (2, 3, 17, G)
    ref_codes, ref_s = fp8_quantize_ref(x, G)
    assert_close(s, torch.from_numpy(ref_s), atol=0, rtol=0, msg="fp8 scales")
    assert_close(decode_codes_f64(codes), torch.from_numpy(ref_codes), atol=0, rtol=0, msg="fp8 codes")
    back = formats.dequantize(codes, s, torch.float64)
    assert torch.isfinite(back).all()
    # all-zero group -> scale 0 and exact zeros
    assert (s[1, 0, 4] == 0).all() and (back[1, 0, 4] == 0).all()
    if granularity == "block32":
        assert s[1, 1, 6, 0] == 0 and (back[1, 1, 6, :32] == 0).all() and (s[1, 1, 6, 1:] > 0).all()
    # amax of every nonzero group is stored exactly (code 448 * s == amax up to the fp32 rounding of s)
    xg = x.unflatten(-1, (G, D // G)).double()
    bg = back.unflatten(-1, (G, D // G))
    normal = xg.abs().amax(-1) > 1e-30
    assert_close(bg.abs().amax(-1)[normal], xg.abs().amax(-1)[normal], atol=0, rtol=1e-6)


def test_fp8_sqnr_token_vs_block32():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 4, 64, 128, generator=gen)
    x[..., 7] *= 20  # a per-channel outlier, as real K has
    out = {}
    for g in ("token", "block32"):
        fmt = get_format("fp8_e4m3", g)
        c, s = formats.quantize(x, FP8, groups=fmt.groups(128))
        out[g] = sqnr(x, formats.dequantize(c, s))
    # e4m3 has a relative error (3 mantissa bits), so SQNR barely depends on the scale; the
    # outlier channel dominates the power. Measured: token 38.0 dB, block32 38.6 dB (plain
    # Gaussian: 32.0 dB). 35 dB leaves a 3 dB margin; truncating instead of RNE costs ~6 dB.
    assert out["token"] > 35 and out["block32"] > 35, out
    assert out["block32"] >= out["token"] - 0.1, out  # finer scales never hurt much


# ------------------------------------------------------------------------------------------------
# q8_0 vs gguf
# ------------------------------------------------------------------------------------------------


def _q8_0_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    D = 64
    x = torch.randn(2, 2, 40, D, generator=gen)
    x[0, 0] *= torch.logspace(-8, 6, 40).view(-1, 1)  # fp16 d underflows at the low end
    x[0, 1, 0] = 0.0  # all-zero token
    x[0, 1, 1, 32:] = 0.0  # all-zero block
    # exact ties of x * (1/d): amax 127 -> d = 1, id = 1
    ties = torch.tensor([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 0.49999997, -0.49999997,
                         0.50000006, 1.4999999, 3.5, 64.5, -64.5])
    x[0, 1, 2, :16] = ties
    x[0, 1, 2, 16:32] = -ties.flip(0)
    x[0, 1, 2, 32] = -127.0
    x[0, 1, 2, 33:64] = torch.arange(31) - 15.5  # halves
    # amax 63.5 -> d = 0.5, id = 2
    x[0, 1, 3, :32] = torch.linspace(-63.5, 63.5, 32)
    x[0, 1, 4] = torch.randn(D, generator=gen) * 1e-40  # fp32 subnormals
    x[1, 0, 5] = torch.randn(D, generator=gen) * 1e6  # fp16 d overflows to inf, as in gguf
    return x


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf on the fp32-subnormal row, see below
def test_q8_0_matches_gguf_bit_exactly():
    x = _q8_0_inputs()
    codes, d = formats.quantize(x, torch.int8, groups=x.shape[-1] // 32)
    ref_q, ref_d = gguf_q8_0(x)
    assert codes.dtype == torch.int8 and d.dtype == torch.float16
    assert bits_equal(d, ref_d), "q8_0 scales differ from gguf"
    # Token [0, 1, 4] holds fp32 subnormals: d = amax/127 is nonzero but 1/d overflows to inf, so
    # ggml's (int8_t)roundf(x * inf) is undefined behaviour (gguf's numpy gives 0 via a NaN cast).
    # There fp16(d) == 0, so every code dequantizes to exact zeros; only that is compared.
    ub = torch.zeros(x.shape[:-1], dtype=torch.bool)
    ub[0, 1, 4] = True
    assert (d[ub] == 0).all()
    assert (formats.dequantize(codes, d, torch.float32)[ub] == 0).all()
    codes, ref_q = codes[~ub], ref_q[~ub]
    mismatch = (codes != ref_q).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.shape[0]} q8_0 codes differ from gguf, e.g. "
        + ", ".join(f"x={x[~ub][tuple(i)].item()!r}: got {codes[tuple(i)].item()} want {ref_q[tuple(i)].item()}"
                    for i in mismatch[:8].tolist())
    )


def test_q8_0_dequantize_matches_gguf():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, 9, 96, generator=gen) * 3
    x[1, 1, 2] = 0
    codes, d = formats.quantize(x, torch.int8, groups=3)
    raw = quants.quantize(x.reshape(-1, 96).numpy(), gguf.GGMLQuantizationType.Q8_0)
    ref = quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(x.shape)
    got = formats.dequantize(codes, d, torch.float32)
    assert_close(got, torch.from_numpy(ref), atol=0, rtol=0)
    assert (got[1, 1, 2] == 0).all()
    # measured 45.6 dB (uniform 8-bit steps of amax/127 per 32 values); bound with a 2.5 dB margin
    assert_sqnr(x, got, 43.0)


def test_q8_0_is_more_accurate_than_fp8_on_gaussian_data():
    # a stable fact: 8-bit uniform codes with a per-32 scale beat e4m3's 3 mantissa bits on
    # Gaussian data; measured q8_0 45.4 dB vs fp8 32.0 dB
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 128, 64, generator=gen)
    c8, s8 = formats.quantize(x, FP8, groups=1)
    cq, sq = formats.quantize(x, torch.int8, groups=2)
    fp8_db, q8_db = sqnr(x, formats.dequantize(c8, s8)), sqnr(x, formats.dequantize(cq, sq))
    assert q8_db > fp8_db + 10, (fp8_db, q8_db)


# ------------------------------------------------------------------------------------------------
# NaN / Inf policy (formats.py docstring)
# ------------------------------------------------------------------------------------------------


def test_fp8_nan_inf_policy():
    x = torch.zeros(1, 1, 4, 32)
    x[0, 0, 0, :6] = torch.tensor([1.0, -2.0, math.inf, -math.inf, math.nan, 0.5])
    x[0, 0, 1, 0] = math.inf  # Inf in an otherwise all-zero group
    x[0, 0, 2, :2] = torch.tensor([3.0e38, -3.0e38])  # large finite: saturate, never NaN
    x[0, 0, 3, 1] = math.nan  # NaN in an otherwise all-zero group (scale 0): still NaN
    codes, s = formats.quantize(x, FP8, groups=1)
    v = decode_codes_f64(codes)[0, 0]
    # ±Inf and NaN are e4m3's NaN code, each alone (e4m3 has no Inf, and saturating would make it finite),
    # the other codes from the scale of the finite values (2 / 448), and the token's scale is NaN
    assert v[0, 2:5].isnan().all() and not v[0, :2].isnan().any() and not v[0, 5:].isnan().any()
    assert v[0, 1] == -448 and v[0, 0] == 224 and v[0, 5] == 112
    assert math.isnan(v[1, 0]) and (v[1, 1:] == 0).all() and math.isnan(v[3, 1])
    assert s[0, 0, [0, 1, 3], 0].isnan().all() and s[0, 0, 2, 0] == np.float32(3.0e38) / np.float32(448.0)
    back = formats.dequantize(codes, s, torch.float64)[0, 0]
    assert back[[0, 1, 3]].isnan().all(), "a token holding a NaN or an Inf must dequantize to NaN as a whole"
    assert torch.isfinite(back[2]).all() and back[2, 0] == pytest.approx(3.0e38, rel=1e-6)
    # static scale: out-of-range finite values saturate, ±Inf and NaN are the NaN code
    cs, _ = formats.quantize(x, FP8, scale=torch.tensor([1e-3]))
    vs = decode_codes_f64(cs)[0, 0]
    assert vs[0, 0] == 448 and vs[0, 1] == -448 and vs[2, 0] == 448 and vs[2, 1] == -448
    assert vs[0, 2:5].isnan().all() and math.isnan(vs[1, 0]) and math.isnan(vs[3, 1]) and vs.isnan().sum() == 5


def test_q8_0_nan_inf_policy():
    x = torch.randn(1, 1, 2, 64, generator=torch.Generator().manual_seed(6))
    x[0, 0, 0, 3] = math.inf
    x[0, 0, 0, 4] = -math.inf
    x[0, 0, 1, 40] = math.nan  # second block of token 1
    codes, d = formats.quantize(x, torch.int8, groups=2)
    # a block holding an Inf or a NaN: a NaN scale (q8_0 has no code for either), codes as usual
    assert d[0, 0, 0, 0].isnan() and d[0, 0, 1, 1].isnan() and not d[0, 0, 0, 1].isnan()
    assert codes[0, 0, 0, 3] == 127 and codes[0, 0, 0, 4] == -127 and codes[0, 0, 1, 40] == 0
    finite = x[0, 0, 0, :32].clone()
    finite[3:5] = 0
    want_q = torch.round(finite * (127 / finite.abs().max())).to(torch.int8)  # the other codes: amax of the finite ones
    assert (codes[0, 0, 0, :32] - want_q)[finite != 0].abs().max() <= 1
    back = formats.dequantize(codes, d, torch.float32)[0, 0]
    assert back[1, 32:].isnan().all(), "a q8_0 block holding a NaN must dequantize to NaN as a whole"
    assert back[0, :32].isnan().all(), "a q8_0 block holding an Inf must dequantize to NaN, never a finite value"
    assert torch.isfinite(back[1, :32]).all() and torch.isfinite(back[0, 32:]).all()
    # the finite blocks still agree with gguf
    ref_q, ref_d = gguf_q8_0(x[:, :, 1:, :32].contiguous())
    assert torch.equal(codes[:, :, 1:, :32], ref_q) and bits_equal(d[:, :, 1:, :1], ref_d)


# ------------------------------------------------------------------------------------------------
# static scales, granularity, bytes per element, bad formats
# ------------------------------------------------------------------------------------------------


def test_static_scale_quantize_per_kv_head():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 5, 64, generator=gen)
    scale = torch.tensor([0.01, 0.002, 0.05])
    codes, s = formats.quantize(x, FP8, scale=scale)
    assert s is scale
    y = (x / scale.view(1, -1, 1, 1)).numpy()
    assert_close(decode_codes_f64(codes), torch.from_numpy(e4m3_rne_ref(y)), atol=0, rtol=0)
    # dequantize multiplies in fp32: code (4 significant bits) * scale (24) is exact in float64,
    # so rounding that product once to fp32 is the exact expected result
    back = formats.dequantize(codes, scale, torch.float32)
    want = (decode_codes_f64(codes) * scale.double().view(1, -1, 1, 1)).float()
    assert_close(back, want, atol=0, rtol=0)


@pytest.mark.parametrize(
    "kv_dtype,granularity,D,expected",
    [
        ("fp8_e4m3", "token", 64, 1 + 4 / 64),
        ("fp8_e4m3", "token", 128, 1 + 4 / 128),
        ("fp8_e4m3", "token", 80, 1 + 4 / 80),
        ("fp8_e4m3", "block32", 128, 1.125),
        ("fp8_e4m3", "static", 128, 1.0),
        ("q8_0", None, 64, 34 / 32),  # GGUF's 8.5 bits per weight
        ("q8_0", None, 128, 34 / 32),
    ],
)
def test_bytes_per_element(kv_dtype, granularity, D, expected):
    fmt = get_format(kv_dtype, granularity)
    assert fmt.bytes_per_element(D) == pytest.approx(expected)
    if not fmt.is_static:  # the scale tensor the cache allocates has exactly that many bytes
        shape = fmt.scale_shape(2, 3, 7, D)
        n = math.prod(shape) * torch.empty((), dtype=fmt.scale_dtype).element_size()
        assert (2 * 3 * 7 * D + n) / (2 * 3 * 7 * D) == pytest.approx(expected)


def test_default_granularities_and_dtypes():
    assert "fp8_e4m3" in KV_DTYPES and "q8_0" in KV_DTYPES
    f = get_format("fp8_e4m3")
    assert (f.granularity, f.code_dtype, f.scale_dtype) == ("token", FP8, torch.float32)
    q = get_format("q8_0")
    assert (q.granularity, q.code_dtype, q.scale_dtype) == ("block32", torch.int8, torch.float16)


def test_unknown_kv_dtype_lists_accepted_names():
    with pytest.raises(ValueError) as e:
        get_format("int4")
    for name in KV_DTYPES:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="granularity"):
        get_format("fp8_e4m3", "per_channel")
    with pytest.raises(ValueError, match="block32"):
        get_format("q8_0", "token")


@pytest.mark.parametrize("D", [48, 80, 100])
def test_block_formats_refuse_head_dim_not_multiple_of_32(D):
    for fmt in (get_format("q8_0"), get_format("fp8_e4m3", "block32")):
        with pytest.raises(ValueError, match="multiple of 32"):
            fmt.check_head_dim(D)
        with pytest.raises(ValueError, match="multiple of 32"):
            fmt.bytes_per_element(D)
    get_format("fp8_e4m3").check_head_dim(D)  # per-token scales take any head_dim


def test_cpu_e4m3_lookup_equals_the_conversion():
    """The CPU's fp8 dequantize looks codes up in a 256-entry table (formats._e4m3_to_float): every code,
    NaN and -0 included, gives what ``codes.float()`` gives, in any layout (a key-contiguous slice)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(2, 2, 2, 32)
    got, want = formats._e4m3_to_float(codes), codes.float()
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().sum() == 2
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0
    keys = codes.transpose(2, 3).contiguous().transpose(2, 3)[:, :, :1]  # strided, like a V slice
    assert torch.equal(formats._e4m3_to_float(keys).nan_to_num(0.0), keys.float().nan_to_num(0.0))
    scale = torch.rand(2, 2, 2, 1) + 0.5
    assert torch.equal(formats.dequantize(codes, scale).nan_to_num(0.0), (want * scale).nan_to_num(0.0))


def test_one_id_numbering_for_python_triton_and_c():
    """The registry's ids are the store kernel's CODE constexprs and the ids attend.c is built with."""
    from kvcompile import native
    from kvcompile.formats.spec import GRANULARITY_IDS
    from kvcompile.kernels import scales

    from utils import FORMATS

    assert FORMATS[0].kv_dtype == formats.DEFAULT_KV_DTYPE and {f.kv_dtype for f in FORMATS} == set(KV_DTYPES)
    for f in FORMATS:
        assert formats.from_id(f.id) == f
    assert (scales.SCALE_TOKEN, scales.SCALE_BLOCK, scales.SCALE_STATIC) == tuple(GRANULARITY_IDS.values())
    flags = native.defines()
    for s in formats.specs():
        assert f"-DKVC_CODE_{s.name.upper()}={s.id}" in flags
    src = open(native._SRC).read()
    assert "#error" in src and all(f"KVC_CODE_{s.name.upper()}" in src for s in formats.specs())
    with pytest.raises(ValueError, match="names no format"):
        formats.from_id(99)

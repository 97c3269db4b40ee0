"""The ``int8`` format (one fp32 scale per token and kv head, round half to even, ±127) and K/V in
different formats: the reference quantizer against an independent float64/numpy computation, the
Triton store and dequantize kernels bit-exact with the reference (CPU: Triton's interpreter),
rotation through the ops, and the refusals.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from kvcompile import formats, reference, rotation
from utils import assert_close, bits_equal, fmt_of, fmts_of, id_of, ids_of, sqnr

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels on CPU need TRITON_INTERPRET=1 set before triton is imported",
)


# ------------------------------------------------------------------------------------------------
# independent reference: numpy, float32 steps as documented, rounding by np.rint (half to even)
# ------------------------------------------------------------------------------------------------


def int8_quantize_ref(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [..., D], scales float32 [..., 1]): s = fp32(amax_finite / 127), y = fp32(x / s),
    ±Inf -> ±127, s == 0 -> 0, code = rint(clip(y, -127, 127)); a token with a NaN or an Inf gets
    s = NaN (code 0 for a NaN)."""
    x = x.float().numpy()
    amax = np.where(np.isfinite(x), np.abs(x), np.float32(0)).max(axis=-1, keepdims=True)
    s = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s > 0, x / s, np.float32(0)).astype(np.float32)
    y = np.where(np.isinf(x), np.sign(x) * np.float32(127.0), y)
    codes = np.rint(np.clip(np.nan_to_num(y, nan=0.0), -127, 127)).astype(np.int8)
    s = np.where(np.isfinite(x).all(axis=-1, keepdims=True), s, np.float32(np.nan)).astype(np.float32)
    return codes, s


def int8_inputs(D=64, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 24, D, generator=gen) * 2
    x[0, 0] *= torch.logspace(-30, 30, 24).view(-1, 1)  # many magnitudes, fp32 subnormal rows
    x[0, 1, 0] = 0.0  # all-zero token
    x[0, 1, 1, 5] = 1e4  # one outlier
    # exact ties after x / s: amax 127 -> s = 1
    ties = torch.tensor([127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 0.49999997, 3.5, 64.5])
    x[0, 1, 2] = 0.0
    x[0, 1, 2, : ties.numel()] = ties
    x[0, 1, 3] = torch.randn(D, generator=gen) * 1e-40  # fp32 subnormals
    x[1, 0, 4] = 1.4e-45
    x[1, 1, 5] = torch.randn(D, generator=gen) * 5e37  # near fp32 max: still finite
    return x


def test_int8_quantize_matches_independent_reference():
    x = int8_inputs()
    codes, s = formats.quantize(x, torch.int8, kv_dtype="int8")
    assert codes.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (*x.shape[:-1], 1)
    ref_c, ref_s = int8_quantize_ref(x)
    assert bits_equal(s, torch.from_numpy(ref_s)), "int8 scales differ from amax / 127"
    bad = (codes != torch.from_numpy(ref_c)).nonzero()
    assert bad.numel() == 0, [(tuple(i), x[tuple(i)].item(), codes[tuple(i)].item()) for i in bad[:8].tolist()]
    assert codes.min() >= -127  # -128 is never written
    # hand-checked ties: half to even, never half away from zero (that is q8_0's roundf)
    assert codes[0, 1, 2, :12].tolist() == [127, 0, 0, 2, -2, 2, -2, 126, -126, 0, 4, 64]


def test_int8_error_bound_against_float64():
    # |x - dequantize(x)| <= s / 2 per element (round to nearest), up to fp32 rounding of x / s and s
    x = int8_inputs(D=96, seed=1)
    codes, s = formats.quantize(x, torch.int8, kv_dtype="int8")
    back = formats.dequantize(codes, s, torch.float64)
    x64 = x.double()
    bound = s.double() * (0.5 + 1e-5) + 1e-44
    assert ((back - x64).abs() <= bound).all()
    # the largest magnitude of every token is stored exactly (code 127 * s == amax up to s's rounding)
    amax = x64.abs().amax(-1)
    nz = amax > 1e-30
    assert_close(back.abs().amax(-1)[nz], amax[nz], atol=0, rtol=1e-6)
    assert (back[0, 1, 0] == 0).all() and (s[0, 1, 0] == 0).all()  # all-zero token: s = 0, exact zeros


def test_int8_nan_inf_policy():
    x = torch.randn(1, 1, 4, 32, generator=torch.Generator().manual_seed(2))
    x[0, 0, 0, 3], x[0, 0, 0, 4] = math.inf, -math.inf
    x[0, 0, 1, 7] = math.nan
    x[0, 0, 2] = 0.0
    x[0, 0, 2, 0] = math.inf  # Inf in an otherwise all-zero token: code 127, scale NaN
    codes, s = formats.quantize(x, torch.int8, kv_dtype="int8")
    finite = x[0, 0, 0].clone()
    finite[3:5] = 0
    # the codes from the finite values' amax (as before), the token's scale NaN: int8 holds no Inf
    want = torch.round(finite / (finite.abs().max() / torch.tensor(127.0))).to(torch.int8)
    assert torch.equal(codes[0, 0, 0, finite != 0], want[finite != 0])
    assert codes[0, 0, 0, 3] == 127 and codes[0, 0, 0, 4] == -127 and s[0, 0, 0, 0].isnan()
    assert s[0, 0, 1, 0].isnan() and codes[0, 0, 1, 7] == 0
    back = formats.dequantize(codes, s, torch.float32)[0, 0]
    assert back[1].isnan().all(), "an int8 token holding a NaN must dequantize to NaN as a whole"
    assert back[0].isnan().all() and back[2].isnan().all(), "an Inf must never dequantize to a finite value"
    assert torch.isfinite(back[3]).all()
    assert s[0, 0, 2, 0].isnan() and codes[0, 0, 2, 0] == 127


def test_int8_beats_fp8_and_rotation_helps_with_outlier_channels():
    # stable facts on Gaussian data with per-channel outliers (as real K has), per-token scales:
    # the outliers take int8's range (int8 36.0 dB, below fp8's 37.6 dB: e4m3's error is relative);
    # a Hadamard rotation spreads them, so the per-token amax shrinks: int8 + rotation 47.7 dB.
    # Without outliers int8 leads already (44.5 vs 32.0 dB). Bounds: half the measured gaps.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 128, 64, generator=gen)
    x[..., 7] *= 20
    x[..., 40] *= -12
    R = rotation.hadamard(64)
    c8, s8 = formats.quantize(x, torch.float8_e4m3fn)
    ci, si = formats.quantize(x, torch.int8, kv_dtype="int8")
    cr, sr = formats.quantize(x @ R, torch.int8, kv_dtype="int8")
    fp8_db = sqnr(x, formats.dequantize(c8, s8))
    int8_db = sqnr(x, formats.dequantize(ci, si))
    rot_db = sqnr(x, formats.dequantize(cr, sr) @ R.T)
    assert rot_db > int8_db + 5 and rot_db > fp8_db + 5, (fp8_db, int8_db, rot_db)
    plain = torch.randn(2, 4, 128, 64, generator=gen)  # no outliers: int8 ahead of fp8 already
    ci, si = formats.quantize(plain, torch.int8, kv_dtype="int8")
    c8, s8 = formats.quantize(plain, torch.float8_e4m3fn)
    assert sqnr(plain, formats.dequantize(ci, si)) > sqnr(plain, formats.dequantize(c8, s8)) + 6


# ------------------------------------------------------------------------------------------------
# format names, pairs, refusals
# ------------------------------------------------------------------------------------------------


def test_int8_format_facts():
    assert "int8" in formats.KV_DTYPES and formats.DEFAULT_KV_DTYPE in formats.KV_DTYPES
    f = formats.get_format("int8")
    assert (f.granularity, f.code_dtype, f.scale_dtype, f.qmax) == ("token", torch.int8, torch.float32, 127.0)
    assert f.name == "int8" and f.v_keys_contiguous
    assert f.bytes_per_element(64) == pytest.approx(1 + 4 / 64) and f.bytes_per_element(80) == pytest.approx(1 + 4 / 80)
    for g in ("static", "block32"):
        with pytest.raises(ValueError, match="int8 is defined with one fp32 scale per token"):
            formats.get_format("int8", g)
    with pytest.raises(ValueError, match="no static scales"):
        formats.quantize(torch.zeros(1, 1, 1, 32), torch.int8, scale=torch.ones(1), kv_dtype="int8")


def test_format_of_reads_the_tensors():
    B, H, L, D = 1, 2, 3, 64
    for kv_dtype, gran in (("fp8_e4m3", "token"), ("fp8_e4m3", "block32"), ("fp8_e4m3", "static"),
                           ("q8_0", None), ("int8", None)):
        fmt = formats.get_format(kv_dtype, gran)
        codes = torch.zeros(B, H, L, D, dtype=fmt.code_dtype)
        scale = torch.ones(H) if fmt.is_static else torch.zeros(fmt.scale_shape(B, H, L, D), dtype=fmt.scale_dtype)
        assert formats.format_of(codes, scale) == kv_dtype
    with pytest.raises(ValueError, match="no kvcompile format"):
        formats.format_of(torch.zeros(1, 1, 1, 64, dtype=torch.int8), torch.zeros(1, 1, 1, 2))  # fp32 block32
    with pytest.raises(ValueError, match="no kvcompile format"):
        formats.format_of(torch.zeros(1, 1, 1, 64, dtype=torch.float16), torch.zeros(1, 1, 1, 1))


def test_resolve_kv_dtypes_and_pairs():
    d = formats.DEFAULT_KV_DTYPE
    assert formats.resolve_kv_dtypes() == (d, d)
    assert formats.resolve_kv_dtypes("q8_0") == ("q8_0", "q8_0")
    assert formats.resolve_kv_dtypes("fp8_e4m3", k_dtype="int8") == ("int8", "fp8_e4m3")
    assert formats.resolve_kv_dtypes(k_dtype="int8", v_dtype="fp8_e4m3") == ("int8", "fp8_e4m3")
    for kw in (dict(kv_dtype="int4"), dict(k_dtype="fp8"), dict(v_dtype="bf16")):
        with pytest.raises(ValueError) as e:
            formats.resolve_kv_dtypes(**kw)
        assert all(n in str(e.value) for n in formats.KV_DTYPES) and next(iter(kw)) in str(e.value)
    for k, v in (("q8_0", "int8"), ("int8", "q8_0")):
        with pytest.raises(ValueError, match="one scale granularity"):
            formats.resolve_kv_dtypes(k_dtype=k, v_dtype=v)
    formats.check_pair(formats.get_format("int8"), formats.get_format("fp8_e4m3"))
    formats.check_pair(formats.get_format("q8_0"), formats.get_format("fp8_e4m3", "block32"))
    with pytest.raises(ValueError, match="one scale granularity"):
        formats.check_pair(formats.get_format("q8_0"), formats.get_format("fp8_e4m3"))


# ------------------------------------------------------------------------------------------------
# the Triton kernels: bit-exact with the reference
# ------------------------------------------------------------------------------------------------


def _empty(kv_dtype, B, H, L, D, gran=None):
    fmt = formats.get_format(kv_dtype, gran)
    c = torch.zeros(B, H, L, D, dtype=fmt.code_dtype, device=DEV)
    s = torch.zeros(fmt.scale_shape(B, H, L, D), dtype=fmt.scale_dtype, device=DEV)
    return c, s


def _special(x, subnormals=True):
    x = x.clone()
    flat = x.view(-1, x.shape[-1])
    flat[0] = 0.0
    flat[1, 3] = math.inf
    flat[2, 5] = -math.inf
    flat[3, 7] = math.nan
    flat[4] = 0.0
    flat[4, 1] = math.nan
    ties = torch.tensor([127.0, 0.5, 1.5, -2.5, 0.49999997, -126.5, 3.5, 64.5])
    flat[5] = ties.repeat(flat.shape[1] // 8 + 1)[: flat.shape[1]]
    if subnormals:  # fp32 inputs only: Triton's interpreter reads bf16 subnormals as 0 or garbage
        flat[6] = torch.arange(flat.shape[1], dtype=x.dtype) * 1e-40
    return x


def _codes_equal(a, b):
    a = a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
    b = b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b
    if a.dtype == torch.uint8:  # any two e4m3 NaN codes count as equal (0x7F / 0xFF)
        return bool(((a == b) | (((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F))).all())
    return torch.equal(a, b)


def _scales_equal(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))


PAIRS = [("int8", "int8", None), ("int8", "fp8_e4m3", None), ("fp8_e4m3", "int8", None),
         ("q8_0", "fp8_e4m3", "block32"), ("fp8_e4m3", "q8_0", "block32")]


@needs_triton
@pytest.mark.parametrize("k_dtype,v_dtype,gran", PAIRS, ids=[f"{k}-{v}" for k, v, _ in PAIRS])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
def test_store_kernel_bit_exact(k_dtype, v_dtype, gran, rotate):
    from kvcompile import kernels

    gen = torch.Generator().manual_seed(4)
    B, H, L, T = 2, 2, 20, 11
    dims = (64, 96) if gran == "block32" else (64, 80)
    for D in dims:
        for in_dtype in (torch.float32, torch.bfloat16):
            kc, ks = _empty(k_dtype, B, H, L, D, gran if k_dtype == "fp8_e4m3" else None)
            vc, vs = _empty(v_dtype, B, H, L, D, gran if v_dtype == "fp8_e4m3" else None)
            ref = [t.clone() for t in (kc, ks, vc, vs)]
            # fp32 subnormals: not with bf16 (see _special) nor q8_0 (1 / d overflows there: GGUF's own
            # undefined behaviour, see test_formats.test_q8_0_matches_gguf_bit_exactly)
            sub = in_dtype == torch.float32 and gran is None
            k, v = torch.randn(B, H, T, D, generator=gen) * 3, torch.randn(B, H, T, D, generator=gen)
            if not rotate:
                # NaN / Inf / subnormals unrotated only: a rotation spreads one into every channel of its
                # token (inf * 0 = NaN in the reference's matmul; the GPU's bf16-split dots give NaN by
                # inf - inf and flush subnormals), so both store a poisoned token, not the same bits
                k, v = _special(k, sub), _special(v, sub)
            k, v = k.to(in_dtype).to(DEV), v.to(in_dtype).to(DEV)
            off = (torch.randn(H, D, generator=gen) * 0.5).to(DEV)
            # a signed permutation: orthonormal with one +-1 per column, so x @ R is exact in any sum
            # order and kernel and reference must agree bit for bit (a Hadamard: the next test); not
            # symmetric, so x @ R^T would store other codes
            R = _signed_permutation(D, gen).to(DEV) if rotate else None
            start = torch.tensor(4, device=DEV)
            kernels.store_kv(kc, ks, vc, vs, k, v, start, off, R, R, **fmts_of(kc, ks, vc, vs))
            reference.store_kv(*ref, k, v, start, off, R, R, **fmts_of(*ref))
            assert _codes_equal(kc, ref[0]) and _codes_equal(vc, ref[2]), (D, in_dtype)
            assert _scales_equal(ks, ref[1]) and _scales_equal(vs, ref[3]), (D, in_dtype)
            assert not kc[:, :, :4].float().any() and not kc[:, :, 4 + T:].float().any()


def _signed_permutation(D: int, gen: torch.Generator) -> torch.Tensor:
    perm = torch.randperm(D, generator=gen)
    signs = torch.where(torch.rand(D, generator=gen) < 0.5, -1.0, 1.0)
    return torch.eye(D)[perm] * signs[:, None]


@needs_triton
@pytest.mark.parametrize("D,shared,T", [(64, False, 17), (80, False, 17), (128, False, 17), (64, True, 17),
                                        (128, True, 40), (64, True, 16), (64, True, 1), (80, True, 1)])
def test_store_kernel_hadamard_rounds_the_rotated_values(D, shared, T, monkeypatch):
    """With a Hadamard R (sums of D products) the kernel rotates in fp32 FMA dots, the reference in a
    float32 matmul: the two round their sums in different orders. Against the float64 rotation both
    must round to nearest: |code - y| <= 1/2 + slack, y = (x @ R)_float64 / s, where the slack (2e-4
    codes) covers the fp32 rotation's error (D * 2^-24 * sum|x_i R_ij| / s < 1e-4 for these rows);
    and the scale is amax / 127 of the rotated row within 8 fp32 ulps (the amax of an fp32 sum).

    ``shared``: kvcompile.rotation's shared matrix, which the store kernel rotates by itself for a
    power-of-two D and 16 tokens or more (no rotate_rows launch: counted here), and by a launch for
    D = 80 (a block-diagonal matrix) or one token (a decode step); a new copy of the matrix is always
    rotated by the launch."""
    from kvcompile import kernels
    from kvcompile.kernels import store

    gen = torch.Generator().manual_seed(9)
    B, H, L = 2, 2, T + 7
    R = rotation.shared(D, DEV) if shared else rotation.hadamard(D, device=DEV)
    launches = []
    orig = store.rotate_rows
    monkeypatch.setattr(store, "rotate_rows", lambda *a, **k: launches.append(1) or orig(*a, **k))
    x = (torch.randn(B, H, T, D, generator=gen) * torch.logspace(-3, 3, D)[torch.randperm(D, generator=gen)]).to(DEV)
    kc, ks = _empty("int8", B, H, L, D)
    vc, vs = _empty("int8", B, H, L, D)
    start = torch.tensor(3, device=DEV)
    kernels.store_kv(kc, ks, vc, vs, x, -x, start, None, R, None, **fmts_of(kc, ks, vc, vs))
    y64 = x.double().cpu() @ R.double().cpu()
    s64 = y64.abs().amax(-1, keepdim=True) / 127
    s = ks[:, :, 3:3 + T].double().cpu()
    assert ((s - s64).abs() <= 8 * 2.0**-24 * s64).all()
    err = (kc[:, :, 3:3 + T].double().cpu() - y64 / s).abs()
    assert err.max() <= 0.5 + 2e-4, err.max()
    if T > 1:
        assert err.max() > 0.45  # many values: some lie near a boundary (the check is not vacuous)
    # V was stored unrotated: its codes are those of -x, not of -x @ R
    assert not torch.equal(vc[:, :, 3:3 + T], kc[:, :, 3:3 + T].neg())
    assert launches == ([] if shared and D & (D - 1) == 0 and T >= 16 else [1])
    # both sides rotated (rotate=True): V = -x gives exactly the negated codes of K (the same sums, negated)
    kc2, ks2 = _empty("int8", B, H, L, D)
    vc2, vs2 = _empty("int8", B, H, L, D)
    kernels.store_kv(kc2, ks2, vc2, vs2, x, -x, start, None, R, R, **fmts_of(kc2, ks2, vc2, vs2))
    assert torch.equal(kc2, kc) and torch.equal(ks2, ks)
    assert torch.equal(vc2, kc.neg()) and torch.equal(vs2, ks)


@needs_triton
def test_store_kernel_int8_rounding_sweep():
    """Every half-integer of [-127, 127] and one fp32 ulp either side (amax 127: s = 1, y = x)."""
    from kvcompile import kernels

    halves = torch.arange(-254, 255, dtype=torch.float32) / 2
    vals = torch.cat([halves, torch.nextafter(halves, torch.tensor(1e9)), torch.nextafter(halves, torch.tensor(-1e9))])
    vals = vals[vals.abs() <= 127]  # amax stays 127
    D = 64
    n = -(-vals.numel() // (D - 1))
    x = torch.zeros(n * (D - 1))
    x[: vals.numel()] = vals
    x = torch.cat([x.view(n, D - 1), torch.full((n, 1), 127.0)], 1).view(1, 1, n, D).to(DEV)  # amax 127
    c, s = _empty("int8", 1, 1, n, D)
    ref = [c.clone(), s.clone(), c.clone(), s.clone()]
    c2, s2 = c.clone(), s.clone()
    start = torch.tensor(0, device=DEV)
    kernels.store_kv(c, s, c2, s2, x, -x, start, None, **fmts_of(c, s, c2, s2))
    reference.store_kv(*ref, x, -x, start, None, **fmts_of(*ref))
    assert (s == 1).all()
    assert torch.equal(c, ref[0]) and torch.equal(c2, ref[2]) and torch.equal(s, ref[1])
    want = torch.from_numpy(np.rint(x.cpu().numpy())).to(torch.int8)
    assert torch.equal(c.cpu(), want)


@needs_triton
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_dequantize_kernel_with_rotation_matches_reference(kv_dtype):
    from kvcompile import kernels

    gen = torch.Generator().manual_seed(5)
    B, H, L, D = 2, 2, 19, 80
    c, s = _empty(kv_dtype, B, H, L, D)
    c2, s2 = _empty(kv_dtype, B, H, L, D)
    R = rotation.hadamard(D, device=DEV)
    x = torch.randn(B, H, L, D, generator=gen).to(DEV)
    reference.store_kv(c, s, c2, s2, x, x, torch.tensor(0, device=DEV), None, R, None, **fmts_of(c, s, c2, s2))
    off = torch.randn(H, D, generator=gen).to(DEV)
    for kv_len in (torch.tensor(13, device=DEV), torch.tensor([19, 4], device=DEV)):
        for dtype in (torch.float32, torch.bfloat16):
            for o in (None, off):
                got = kernels.dequantize(c, s, o, kv_len, dtype, R, fmt=fmt_of(c, s))
                want = reference.dequantize(c, s, o, kv_len, dtype, R, fmt=fmt_of(c, s))
                assert torch.equal(got, want), (kv_len, dtype, o is None)
    # un-rotated: the rotated store read back with R^T is x within int8/fp8 error; without R^T it is not
    full = torch.tensor(L, device=DEV)
    back = reference.dequantize(c, s, None, full, torch.float32, R, fmt=fmt_of(c, s))
    plain = reference.dequantize(c2, s2, None, full, torch.float32, fmt=fmt_of(c2, s2))
    err = (back - x).abs().max().item()
    assert err <= 2 * (plain - x).abs().max().item() + 1e-6
    assert (reference.dequantize(c, s, None, full, torch.float32, fmt=fmt_of(c, s)) - x).abs().max() > 20 * err


@needs_triton
def test_dequantize_kv_mixed_codes():
    from kvcompile.kernels import store as store_mod

    gen = torch.Generator().manual_seed(6)
    B, H, L, D = 2, 2, 33, 64
    for k_dtype, v_dtype in (("int8", "fp8_e4m3"), ("fp8_e4m3", "int8")):
        kc, ks = _empty(k_dtype, B, H, L, D)
        vc, vs = _empty(v_dtype, B, H, L, D)
        reference.store_kv(kc, ks, vc, vs, torch.randn(B, H, L, D, generator=gen).to(DEV),
                           torch.randn(B, H, L, D, generator=gen).to(DEV), torch.tensor(0, device=DEV), None, **fmts_of(kc, ks, vc, vs))
        kv_len = torch.tensor([33, 9], device=DEV)
        k, v = store_mod.dequantize_kv(kc, ks, vc, vs, kv_len, 30, torch.float32, **fmts_of(kc, ks, vc, vs))
        assert torch.equal(k, reference.dequantize(kc[:, :, :30], ks[:, :, :30], None, kv_len, torch.float32, fmt=fmt_of(kc[:, :, :30], ks[:, :, :30])))
        assert torch.equal(v, reference.dequantize(vc[:, :, :30], vs[:, :, :30], None, kv_len, torch.float32, fmt=fmt_of(vc[:, :, :30], vs[:, :, :30])))


def test_ops_refuse_bad_rotations():
    import kvcompile  # noqa: F401  (registers the ops)

    c, s = _empty("int8", 1, 1, 4, 64)
    kv_len = torch.tensor(4, device=DEV)
    for bad in (torch.eye(32, device=DEV), torch.eye(64, dtype=torch.float64, device=DEV)):
        with pytest.raises(ValueError, match=r"float32 \[D, D\]"):
            torch.ops.kvcompile.dequantize(c, s, None, kv_len, torch.float32, bad, 0, format=id_of(c, s))
        with pytest.raises(ValueError, match="k_rotation"):
            torch.ops.kvcompile.store_kv(c, s, c.clone(), s.clone(), torch.zeros(1, 1, 1, 64, device=DEV),
                                         torch.zeros(1, 1, 1, 64, device=DEV), torch.tensor(0, device=DEV), None,
                                         bad, None, **ids_of(c, s, c, s))
    with pytest.raises(ValueError, match="sliding_window"):
        torch.ops.kvcompile.dequantize(c, s, None, kv_len, torch.float32, None, -1, format=id_of(c, s))
    # sliding_window is metadata: the result does not change
    assert torch.equal(torch.ops.kvcompile.dequantize(c, s, None, kv_len, torch.float32, None, 3, format=id_of(c, s)),
                       torch.ops.kvcompile.dequantize(c, s, None, kv_len, torch.float32, format=id_of(c, s)))


def test_lazy_cache_in_a_compiled_graph_holds_the_shared_rotation():
    """A cache built without a device allocates inside the compiled prefill (fullgraph). Its layers
    must still hold rotation.shared's matrix (the kernels generate that one instead of reading
    it), and building it there must not trip Dynamo (no lru_cache traced inside the graph)."""
    import warnings

    import kvcompile
    from models import cache_kwarg, tiny_model

    m = tiny_model("llama")
    cache = kvcompile.QuantizedCache(m.config, max_batch_size=1, max_cache_len=16, rotate=True)  # int8, lazy
    f = torch.compile(m.forward, backend=kvcompile.backend(), fullgraph=True)
    ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        f(input_ids=ids, **{cache_kwarg(m): cache}, use_cache=True)
    assert not [w for w in seen if "lru_cache" in str(w.message)], [str(w.message)[:120] for w in seen]
    for layer in cache.layers:
        assert layer.is_initialized and layer.k_rotation is layer.v_rotation  # K's and V's: one tensor
        assert rotation.is_shared_sylvester(layer.k_rotation) == (layer.head_dim & (layer.head_dim - 1) == 0)
        assert layer.k_rotation is rotation.shared(layer.head_dim, layer.device)
    torch._dynamo.reset()

"""Triton kernels against the reference: store / dequantize bit-exact, attention vs a float64 oracle.

Without CUDA these run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported); with CUDA the same tests run the compiled kernels on the GPU,
plus the ``gpu``-marked tests at the end (16-bit q, CUDA graphs, the fp8-by-bits path).

Tolerances (relative Frobenius error ||out - ref|| / ||ref|| against reference.attention in
float64 on the same codes, so quantization error is NOT part of it):

* interpreter / fp32 q: every dot is fp32 "ieee" and P stays fp32 there; the only error is fp32
  rounding of O(L) sums of exp terms: measured <= 5e-7, asserted 1e-5;
* GPU, bf16 q: codes widen to bf16 exactly, P * s_v and the output are rounded to bf16
  (2^-9 relative each, partly averaging out over the keys): measured ~3e-3, asserted 1e-2.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch

from kvcompile import formats, reference, tiles
from kvcompile.cache import v_codes_buffer

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kvcompile import kernels  # noqa: E402
from kvcompile.kernels import attention_launcher as attn_mod  # noqa: E402
from kvcompile.kernels import dense as dense_mod  # noqa: E402
from kvcompile.kernels import plan as plan_mod  # noqa: E402
from kvcompile.kernels import store as store_mod  # noqa: E402
from kvcompile.kernels._codes import codes_to, codes_to_f16_pinned, to_store_dtype  # noqa: E402
from kvcompile.kernels.store import dequantize as dequantize_launcher  # noqa: E402
import utils  # noqa: E402
from utils import FORMAT_IDS as FMT_IDS, as_format, fmt_of, fmts, fmts_of, ids_of, make_cache, rel_err  # noqa: E402

FORMATS = [(f.kv_dtype, f.granularity) for f in utils.FORMATS]  # the registry's matrix, the default format first
ATOL_REL = 1e-5 if DEV == "cpu" else 1e-5  # fp32 q on either device (see module docstring)


def as_bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def codes_equal(a, b):
    """Bitwise, except that any two e4m3 NaN codes (0x7F / 0xFF) count as equal."""
    a, b = as_bits(a), as_bits(b)
    if a.dtype == torch.uint8:
        nan_a, nan_b = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
        return bool(((a == b) | (nan_a & nan_b)).all())
    return torch.equal(a, b)


def scales_equal(a, b):
    return torch.equal(a.nan_to_num(nan=-1.0), b.nan_to_num(nan=-1.0)) and torch.equal(a.isnan(), b.isnan())


def random_cache(kv_dtype, gran, B, H, L, D, gen, v_layout="head_dim"):
    """Codes + scales as store_kv would leave them, from random K/V (via the reference store).

    ``v_layout="keys"``: V codes key-contiguous, as QuantizedCache stores them for token/static
    scales (a [B, H, D, L16] buffer, L16 = L rounded up to 16, seen as [B, H, L, D]).
    """
    kc, ks, vc, vs = make_cache((kv_dtype, gran), None, B, H, L, D, gen=gen, device=DEV, static_scale=(0.01, 0.05))
    if v_layout == "keys":
        vc = v_codes_buffer((B, H, L, D), vc.dtype, DEV, keys=True)
    k = torch.randn(B, H, L, D, generator=gen).to(DEV) * 2
    v = torch.randn(B, H, L, D, generator=gen).to(DEV)
    reference.store_kv(kc, ks, vc, vs, k, v, torch.tensor(0, device=DEV), None, **fmts((kv_dtype, gran)))
    return kc, ks, vc, vs


def poison_past(codes, kv_len):
    """Fill the codes at positions >= kv_len (and a key-contiguous buffer's padding) with NaN codes
    (e4m3 0x7F; int8 has none: -128) and return a copy for the oracle with zeros there instead."""
    root = codes._base if codes._base is not None else codes
    bits = root.view(torch.uint8) if root.dtype == torch.float8_e4m3fn else root
    full = bits.transpose(2, 3) if codes.stride(2) == 1 else bits  # [B, H, L16, D]
    clean = codes.clone()
    lens = kv_len.reshape(-1).expand(codes.shape[0]).tolist()
    for b, n in enumerate(lens):
        full[b, :, n:] = 0x7F if bits.dtype == torch.uint8 else -128
        clean[b, :, n:] = 0
        if bits.dtype == torch.uint8:  # really NaN (0 * NaN = NaN in the PV dot unless the kernel clears it)
            assert full[b, :, n:].view(torch.float8_e4m3fn).float().isnan().all()
    return clean


# ---------------------------------------------------------------------------------------------
# store_kv: bit-exact with the reference
# ---------------------------------------------------------------------------------------------


def special_values(x):
    """Sprinkle values that stress rounding: ties, subnormals, Inf, NaN, an all-zero group."""
    x = x.clone()
    flat = x.view(-1, x.shape[-1])
    flat[0, :] = 0.0  # all-zero token: scale 0, codes 0
    flat[1, 3] = float("inf")
    flat[2, 5] = float("-inf")
    flat[3, 7] = float("nan")
    flat[4, :] = 0.0
    flat[4, 1] = float("nan")  # NaN in an otherwise all-zero group keeps its NaN code (fp8)
    flat[5, :] = torch.arange(flat.shape[1], dtype=x.dtype) * 1e-3  # tiny: e4m3 subnormals
    # exact e4m3 ties after x / s with s = amax / 448: amax 448 makes s = 1
    flat[6, :] = torch.tensor([448.0, 1.0625, 1.1875, 0.0029296875, -3.25, 2.5, 0.5 + 2**-5, 17.0]).repeat(
        flat.shape[1] // 8 + 1)[: flat.shape[1]]
    flat[7, :] = torch.tensor([127.0, 0.5, 1.5, -2.5, 0.49999997, -126.5, 3.5, 64.5]).repeat(
        flat.shape[1] // 8 + 1)[: flat.shape[1]]
    return x


# e4m3 encoders: "bits" (integer arithmetic: the interpreter, archs below sm_89) everywhere, and on a
# GPU with native fp8 also "cvt" (cvt.rn.satfinite.e4m3x2.f32, the GPU default)
ENCODERS = ["bits", "cvt"] if DEV == "cuda" and tiles.has_native_fp8(torch.cuda.get_device_capability()) else ["bits"]


@pytest.fixture(params=ENCODERS)
def e4m3_encoder(request, monkeypatch):
    if request.param == "bits":  # the arch decides (store.hw_e4m3): force the integer encoder
        monkeypatch.setattr(store_mod, "hw_e4m3", lambda device: False)
    return request.param


@pytest.mark.parametrize("kv_dtype,gran", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("with_offset", [False, True], ids=["plain", "k_offset"])
def test_store_bit_exact(kv_dtype, gran, with_offset, e4m3_encoder):
    gen = torch.Generator().manual_seed(1)
    B, H, L = 2, 2, 24
    dims = (64, 96) if gran == "block32" else (64, 80)
    for D in dims:
        for in_dtype in (torch.float32, torch.bfloat16):
            kc, ks, vc, vs = make_cache((kv_dtype, gran), None, B, H, L, D, gen=gen, device=DEV,
                                        static_scale=(0.01, 0.05))
            ref = [t.clone() for t in (kc, ks, vc, vs)]
            T = 11  # not a power of two
            k = special_values(torch.randn(B, H, T, D, generator=gen) * 3).to(in_dtype).to(DEV)
            v = special_values(torch.randn(B, H, T, D, generator=gen)).to(in_dtype).to(DEV)
            off = (torch.randn(H, D, generator=gen) * 0.5).to(DEV) if with_offset else None
            start = torch.tensor(5, device=DEV)
            kernels.store_kv(kc, ks, vc, vs, k, v, start, off, **fmts((kv_dtype, gran)))
            reference.store_kv(*ref, k, v, start, off, **fmts((kv_dtype, gran)))
            assert codes_equal(kc, ref[0]) and codes_equal(vc, ref[2]), (D, in_dtype)
            assert scales_equal(ks, ref[1]) and scales_equal(vs, ref[3]), (D, in_dtype)
            # positions outside [start, start + T) are untouched
            assert not as_bits(kc)[:, :, :5].any() and not as_bits(kc)[:, :, 5 + T:].any()


def test_store_rounding_sweep(e4m3_encoder):
    """Dense sweep over e4m3 / q8_0 rounding boundaries: every midpoint, both sides, both signs."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    vals = torch.cat([e4m3, mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                      torch.nextafter(mids, torch.full_like(mids, -1e9))])
    vals = torch.cat([vals, -vals, torch.tensor([500.0, -1e6])])  # out of range: saturates
    D = 64
    n = -(-vals.numel() // D) * D
    x = torch.zeros(n)
    x[: vals.numel()] = vals
    x = x.view(1, 1, -1, D).to(DEV)
    T = x.shape[2]
    # static scale 1.0: x / 1 is x, so this tests the encoder itself on every boundary
    for kv_dtype, gran in (("fp8_e4m3", "static"), ("q8_0", "block32"), ("fp8_e4m3", "token")):
        fmt = formats.get_format(kv_dtype, gran)
        c = torch.zeros(1, 1, T, D, dtype=fmt.code_dtype, device=DEV)
        s = torch.ones(1, device=DEV) if fmt.is_static else torch.zeros(fmt.scale_shape(1, 1, T, D), dtype=fmt.scale_dtype, device=DEV)
        ref = [c.clone(), s.clone(), c.clone(), s.clone()]
        c2, s2 = c.clone(), s.clone()
        start = torch.tensor(0, device=DEV)
        kernels.store_kv(c, s, c2, s2, x, x * 0.37, start, None, **fmts_of(c, s, c2, s2))
        reference.store_kv(*ref, x, x * 0.37, start, None, **fmts_of(*ref))
        assert codes_equal(c, ref[0]) and codes_equal(c2, ref[2]), kv_dtype
        if not fmt.is_static:
            assert scales_equal(s, ref[1]) and scales_equal(s2, ref[3])


def test_e4m3_all_256_codes_by_bits():
    """The bit-manipulation e4m3 decoder (archs below sm_89) against torch on all 256 codes."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(1, 1, 8, 32).to(DEV)
    scale = torch.ones(1, device=DEV)
    kv_len = torch.tensor(8, device=DEV)
    got = dequantize_launcher(codes, scale, None, kv_len, torch.float32, fp8_bits=True, fmt=fmt_of(codes, scale))
    want = codes.float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(torch.signbit(got[~got.isnan()]), torch.signbit(want[~want.isnan()]))  # -0 stays -0
    # and the native path agrees (on the NaN codes too, except in the interpreter, which decodes
    # 0x7F / 0xFF as +-480)
    got2 = dequantize_launcher(codes, scale, None, kv_len, torch.float32, fp8_bits=False, fmt=fmt_of(codes, scale))
    finite = ~want.isnan()
    assert torch.equal(got2[finite], want[finite])
    if DEV == "cuda":
        assert torch.equal(got2.isnan(), want.isnan())


# ---------------------------------------------------------------------------------------------
# dequantize
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype,gran", FORMATS, ids=FMT_IDS)
def test_dequantize_matches_reference(kv_dtype, gran):
    gen = torch.Generator().manual_seed(2)
    B, H, L, D = 2, 3, 21, 64
    kc, ks, _, _ = random_cache(kv_dtype, gran, B, H, L, D, gen)
    off = torch.randn(H, D, generator=gen).to(DEV)
    for kv_len in (torch.tensor(13, device=DEV), torch.tensor([21, 4], device=DEV)):
        for dtype in (torch.float32, torch.bfloat16):
            for o in (None, off):
                got = kernels.dequantize(kc, ks, o, kv_len, dtype, fmt=fmts((kv_dtype, gran))["k_fmt"])
                want = reference.dequantize(kc, ks, o, kv_len, dtype, fmt=fmts((kv_dtype, gran))["k_fmt"])
                assert torch.equal(got, want), (kv_len, dtype, o is None)


@pytest.mark.parametrize("kv_dtype,gran", FORMATS, ids=FMT_IDS)
def test_dequantize_kv_matches_reference(kv_dtype, gran):
    """The dense prefill's one-launch K + V workspace: bit-exact with the reference on the first n
    positions, K and V each in its own layout (V key-contiguous where the cache stores it so)."""
    gen = torch.Generator().manual_seed(3)
    B, H, L, D = 2, 3, 45, 64
    v_layout = "head_dim" if gran == "block32" else "keys"
    kc, ks, vc, vs = random_cache(kv_dtype, gran, B, H, L, D, gen, v_layout=v_layout)
    assert (vc.stride(2) == 1) == (v_layout == "keys")
    for kv_len, n in ((torch.tensor([45, 9], device=DEV), 45), (torch.tensor([30, 17], device=DEV), 30),
                      (torch.tensor(20, device=DEV), 20)):
        for dtype in (torch.float32, torch.bfloat16):
            k, v = store_mod.dequantize_kv(kc, ks, vc, vs, kv_len, n, dtype, **fmts((kv_dtype, gran)))
            assert k.shape == v.shape == (B, H, n, D) and k.is_contiguous() and v.is_contiguous()
            sl = (lambda s: s) if ks.dim() == 1 else (lambda s: s[:, :, :n])
            assert torch.equal(k, reference.dequantize(kc[:, :, :n], sl(ks), None, kv_len, dtype,
                                                         fmt=as_format(kv_dtype, gran))), (kv_len, dtype)
            assert torch.equal(v, reference.dequantize(vc[:, :, :n], sl(vs), None, kv_len, dtype,
                                                         fmt=as_format(kv_dtype, gran))), (kv_len, dtype)
    with pytest.raises(ValueError, match="n=46"):
        store_mod.dequantize_kv(kc, ks, vc, vs, torch.tensor(45, device=DEV), L + 1, torch.float32, **fmts((kv_dtype, gran)))


# ---------------------------------------------------------------------------------------------
# attention vs the float64 oracle
# ---------------------------------------------------------------------------------------------


def check_attention(kv_dtype, gran, *, B=2, Hkv=2, group=2, Tq=1, L=37, D=64, kv_len=None, mask=None,
                    causal=False, seed=0, q_dtype=torch.float32, tol=ATOL_REL, q_transposed=False, scale=None,
                    q_mult=1.0, v_layout="head_dim"):
    gen = torch.Generator().manual_seed(seed)
    kc, ks, vc, vs = random_cache(kv_dtype, gran, B, Hkv, L, D, gen, v_layout)
    Hq = Hkv * group
    if q_transposed:  # HF: q comes as a transpose of [B, Tq, Hq, D]
        q = torch.randn(B, Tq, Hq, D, generator=gen).to(DEV).to(q_dtype).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, Tq, D, generator=gen).to(DEV).to(q_dtype)
    q = q * q_mult
    if kv_len is None:
        kv_len = torch.tensor(L, device=DEV)
    v_ref = vc
    if v_layout == "keys":  # what lies past kv_len is not part of the cache: NaN codes must not leak
        assert attn_mod.v_keys_contiguous(vc)
        v_ref = poison_past(vc, kv_len)
    out = kernels.attention(q, kc, ks, vc, vs, kv_len, mask, causal, scale, **fmts((kv_dtype, gran)))
    ref = reference.attention(q, kc, ks, v_ref, vs, kv_len, mask, causal, scale, compute_dtype=torch.float64, **fmts_of(kc, ks, v_ref, vs))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    return out, ref


@pytest.mark.parametrize("kv_dtype,gran", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("Tq,causal", [(1, False), (5, True), (24, True), (24, False)],
                         ids=["decode", "spec5", "prefill-causal", "prefill"])
@pytest.mark.parametrize("v_layout", ["head_dim", "keys"], ids=["v-d", "v-keys"])
def test_attention_formats(kv_dtype, gran, Tq, causal, v_layout):
    # per-batch lengths, neither a multiple of the block; prefill Tq fits inside the shorter one.
    # Key-contiguous V: L=40 pads to 48, and the 16-key chunk past each length holds NaN codes.
    kv_len = torch.tensor([37, 29], device=DEV)
    check_attention(kv_dtype, gran, Tq=Tq, causal=causal, kv_len=kv_len, L=40, v_layout=v_layout)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("Tq", [1, 3, 20])
@pytest.mark.parametrize("v_layout", ["head_dim", "keys"], ids=["v-d", "v-keys"])
def test_attention_gqa(group, Tq, v_layout):
    check_attention("fp8_e4m3", "token", Hkv=2, group=group, Tq=Tq, causal=Tq > 1, L=33, B=1, v_layout=v_layout)


@pytest.mark.parametrize("group", [48, 71])
@pytest.mark.parametrize("Tq", [1, 3])
def test_attention_multi_query_large_groups(group, Tq):
    """One kv head under many query heads (StarCoder's 48, falcon-7b's 71, odd): the rows of a decode
    program span several row blocks, the last one partial."""
    check_attention("fp8_e4m3", "token", Hkv=1, group=group, Tq=Tq, causal=Tq > 1, L=33, B=1, v_layout="keys")


def test_v_keys_contiguous_needs_room_for_16_key_chunks():
    """The kernel reads key-contiguous V in whole 16-key chunks: only storage that extends to the
    16-rounded length qualifies; anything else takes the generic path (still correct)."""
    padded = torch.zeros(2, 3, 64, 48, dtype=torch.int8).transpose(2, 3)
    assert attn_mod.v_keys_contiguous(padded[:, :, :37])  # L16 = 48: the padding is there
    assert attn_mod.v_keys_contiguous(padded[:1, :, :40])  # leading rows (a smaller live batch)
    tight = torch.zeros(2, 3, 64, 37, dtype=torch.int8).transpose(2, 3)
    assert not attn_mod.v_keys_contiguous(tight)  # the last row's chunk would run past the storage
    assert not attn_mod.v_keys_contiguous(torch.zeros(2, 3, 37, 64, dtype=torch.int8))  # head_dim-contiguous
    assert not attn_mod.v_keys_contiguous(padded[:, :, :0])


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("Tq", [1, 18])
def test_attention_head_dims(D, Tq):
    gran = "block32" if D % 32 == 0 and D != 64 else "token"
    check_attention("fp8_e4m3", gran, D=D, Tq=Tq, causal=True, L=26, B=1, Hkv=1, group=2)


FP16_TOL = 5e-3  # q, P and the V tile rounded to fp16 (2^-11 relative each): measured ~1e-3


@triton.jit
def _widen_pinned(C, O):
    i = tl.arange(0, 256)
    tl.store(O + i, codes_to_f16_pinned(tl.load(C + i)))


@pytest.mark.gpu
@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.int8], ids=["e4m3", "int8"])
def test_codes_to_f16_pinned_all_codes(code_dtype):
    """The pinned inline-PTX widening (V tiles on the GPU) against torch on all 256 codes."""
    if DEV != "cuda":
        pytest.skip("inline PTX needs a GPU")
    bits = torch.arange(256, dtype=torch.uint8, device=DEV)
    codes = bits if code_dtype == torch.float8_e4m3fn else bits.view(torch.int8)
    out = torch.empty(256, dtype=torch.float16, device=DEV)
    _widen_pinned[(1,)](codes, out)
    want = bits.view(code_dtype).to(torch.float16)
    assert torch.equal(out.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(out[finite], want[finite])
    assert torch.equal(torch.signbit(out[finite]), torch.signbit(want[finite]))


@triton.jit
def _store_bf16(X, O, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(O + i, to_store_dtype(tl.load(X + i), tl.bfloat16))


def test_to_store_dtype_bf16_rounds_like_torch_and_keeps_nan():
    """Every kernel's bf16 output goes through ``to_store_dtype``: round to nearest even, as torch's
    cast, and a NaN stays NaN whatever its payload. The GPU's own NaN is 0x7FFFFFFF, whose rounding
    carries into the sign bit: it once came out as -0.0 (a NaN query's attention output on an H200, before 7c6c782)."""
    specials = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0xFFBFFFFF, 0x7F800000, 0xFF800000,
                0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00000001, 0x80000000]
    rand = torch.randint(0, 1 << 31, (243,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    bits = specials + rand.tolist()
    x = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)
    x = x.to(DEV)
    out = torch.empty(256, dtype=torch.bfloat16, device=DEV)
    _store_bf16[(1,)](x, out, 256)
    want = x.to(torch.bfloat16)
    assert torch.equal(out.isnan(), x.isnan()) and x.isnan().sum() == 5
    finite = ~x.isnan()
    assert torch.equal(out[finite].view(torch.int16), want[finite].view(torch.int16))
    assert torch.equal(torch.signbit(out), torch.signbit(x))  # a NaN keeps its sign too


@pytest.mark.parametrize("kv_dtype,gran", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("Tq", [1, 20])
@pytest.mark.parametrize("v_layout", ["head_dim", "keys"], ids=["v-d", "v-keys"])
def test_attention_fp16_dot_path(kv_dtype, gran, Tq, v_layout, fp16_dots):
    """The GPU's fp16-dot path (int8 magic conversion, P * s_v / max s_v), run by the interpreter too."""
    q_dtype = torch.float32 if DEV == "cpu" else torch.float16
    check_attention(kv_dtype, gran, Tq=Tq, causal=True, L=45, kv_len=torch.tensor([45, 30], device=DEV),
                    tol=FP16_TOL, q_dtype=q_dtype, v_layout=v_layout)


@triton.jit
def _widen_e4m3_bits(C, O, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(O + i, codes_to(tl.load(C + i), tl.float16, True))


def test_e4m3_bits_widen_to_fp16_exactly():
    """Below sm_89 (A100, T4) the attention kernels take e4m3 codes as uint8 bits and widen them to
    the fp16 dots' type by integer ops (``e4m3_bits_to_f16``): every one of the 256 codes against
    torch's own conversion, subnormals, -0 and both NaNs included."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = bits.view(torch.float8_e4m3fn).to(torch.float16)
    out = torch.empty(256, dtype=torch.float16, device=DEV)
    _widen_e4m3_bits[(1,)](bits.to(DEV), out, 256)
    out = out.cpu()
    assert torch.equal(out.isnan(), want.isnan()) and want.isnan().sum() == 2
    finite = ~want.isnan()
    assert torch.equal(out[finite].view(torch.int16), want[finite].view(torch.int16))  # -0 and subnormals too


E4M3_FORMATS = [f for f in FORMATS if f[0] == "fp8_e4m3"]


@pytest.mark.parametrize("kv_dtype,gran", E4M3_FORMATS, ids=["/".join(f) for f in E4M3_FORMATS])
@pytest.mark.parametrize("Tq", [1, 20])
@pytest.mark.parametrize("v_layout", ["head_dim", "keys"], ids=["v-d", "v-keys"])
def test_attention_e4m3_by_bits_fp16_path(kv_dtype, gran, Tq, v_layout, fp16_dots, monkeypatch):
    """The attention kernel as archs below sm_89 run it: K and V codes as uint8 bits, widened by
    integer ops into the fp16 dots (the plan's ``k_fp8_bits`` / ``v_fp8_bits``, never planned on an
    H100 / H200 or in the interpreter, so forced here). Held to the float64 reference with the
    fp16 path's tolerance, and, in the interpreter, equal to the native widening (both give every
    code's exact fp16 value to the same dots)."""
    seen, orig = [], attn_mod.plan_of
    monkeypatch.setattr(attn_mod, "plan_of", lambda call: seen.append(orig(call)) or seen[-1])
    q_dtype = torch.float32 if DEV == "cpu" else torch.float16
    kw = dict(Tq=Tq, causal=True, L=45, kv_len=torch.tensor([45, 30], device=DEV), tol=FP16_TOL, q_dtype=q_dtype,
              v_layout=v_layout, seed=3)
    with plan_mod.override(k_fp8_bits=True, v_fp8_bits=True, v_pin=False):
        out, _ = check_attention(kv_dtype, gran, **kw)
    consts = seen[-1].constexprs()
    assert consts["K_FP8_BITS"] and consts["V_FP8_BITS"], seen[-1].describe()
    if DEV == "cpu":
        native, _ = check_attention(kv_dtype, gran, **kw)
        assert not seen[-1].constexprs()["K_FP8_BITS"]
        assert torch.equal(out, native)


def _fp8_token_cache_with_v_magnitudes(mag, B, v_layout, seed, Hkv=2, group=4, D=64):
    """fp8 token-scale codes of random K and of random V times ``mag`` (one magnitude per key),
    and fp16 queries on the GPU (fp32 in the interpreter) small enough for a flat softmax."""
    gen = torch.Generator().manual_seed(seed)
    L = mag.numel()
    kc, ks, vc, vs = make_cache("fp8_e4m3", None, B, Hkv, L, D, gen=gen, device=DEV)
    if v_layout == "keys":
        vc = v_codes_buffer((B, Hkv, L, D), vc.dtype, DEV, keys=True)
    k = torch.randn(B, Hkv, L, D, generator=gen).to(DEV)
    v = (torch.randn(B, Hkv, L, D, generator=gen) * mag.view(1, 1, L, 1)).to(DEV)
    reference.store_kv(kc, ks, vc, vs, k, v, torch.tensor(0, device=DEV), None, **fmts("fp8_e4m3"))
    q = torch.randn(B, Hkv * group, 1, D, generator=gen).to(DEV) * 0.2  # flat softmax: every tile counts
    return (q if DEV == "cpu" else q.half()), (kc, ks, vc, vs)


def _fp16_path_err(q, cache, kv_len, mask):
    out = kernels.attention(q, *cache, kv_len, mask, False, None, **fmts_of(*cache))
    ref = reference.attention(q, *cache, kv_len, mask, False, None, compute_dtype=torch.float64, **fmts_of(*cache))
    return rel_err(out, ref)


@pytest.mark.parametrize("v_layout", ["head_dim", "keys"], ids=["v-d", "v-keys"])
def test_attention_fp16_path_v_scales_six_orders_apart(v_layout, fp16_dots):
    """fp8 token scales on the fp16 PV path: P is scaled by s_v / max s_v of each tile and the
    accumulator carries O / max s_v of the last tile, rescaled by max_prev / max at every tile.
    V magnitudes 1, 1e-3, 1e3, 1 by 16-key block (the interpreter's tile) make those ratios 1e3-1e6
    up and down; the result must match float64 as closely as with ordinary V (FP16_TOL)."""
    L = 64
    mag = torch.tensor([1.0, 1e-3, 1e3, 1.0]).repeat_interleave(16)
    q, cache = _fp8_token_cache_with_v_magnitudes(mag, 2, v_layout, seed=3)
    vs = cache[3]
    assert vs.max() / vs.min() > 1e5  # the scales really span the range
    kv_len = torch.tensor([64, 57], device=DEV)
    assert _fp16_path_err(q, cache, kv_len, None) < FP16_TOL
    # the 1e-3 block is a visible part of the answer only relative to itself: check it alone too
    small = torch.zeros(L, dtype=torch.bool)
    small[16:32] = True
    assert _fp16_path_err(q, cache, kv_len, small.view(1, 1, 1, L).to(DEV)) < FP16_TOL


@pytest.mark.parametrize("v_layout", ["head_dim", "keys"], ids=["v-d", "v-keys"])
def test_attention_fp16_path_v_scales_six_orders_apart_in_one_tile(v_layout, fp16_dots):
    """Keys of magnitude 1e3 and 1e-3 alternate inside every tile (the GPU's 128-key tile holds the
    four blocks above at once), and a mask leaves only the small ones: P * s_v / max s_v is ~1e-6
    for every visible key. Without the kernel's PV_HEADROOM that is subnormal in fp16 (measured on
    the H200 and here: 3% error); with it, ordinary fp16 precision (FP16_TOL)."""
    L = 64
    small = (torch.arange(L) % 2).bool()
    q, cache = _fp8_token_cache_with_v_magnitudes(torch.where(small, 1e-3, 1e3), 1, v_layout, seed=4)
    assert _fp16_path_err(q, cache, torch.tensor([L], device=DEV), small.view(1, 1, 1, L).to(DEV)) < FP16_TOL


@pytest.mark.parametrize("kv_dtype,gran", [("fp8_e4m3", "token"), ("q8_0", "block32"), ("fp8_e4m3", "static")],
                         ids=["fp8", "q8_0", "fp8-static"])
@pytest.mark.parametrize("Tq", [1, 20])
def test_attention_fp16_dots_take_queries_beyond_fp16_range(kv_dtype, gran, Tq, fp16_dots):
    """|q| up to 2e5 (beyond fp16's 65504) with a softmax scale 1e-5 smaller: the scores are ordinary,
    so the result is well conditioned; the fp16-dot path must scale q into range (by a power of two,
    folded into the softmax scale), not overflow to inf/NaN. Same tolerance as the fp16 path."""
    q_dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    check_attention(kv_dtype, gran, Tq=Tq, causal=Tq > 1, L=45, kv_len=torch.tensor([45, 30], device=DEV),
                    tol=FP16_TOL, q_dtype=q_dtype, q_mult=5e4, scale=64**-0.5 / 5e4)


def test_attention_unsupported_head_dim_raises():
    gen = torch.Generator().manual_seed(0)
    kc, ks, vc, vs = random_cache("fp8_e4m3", "token", 1, 1, 8, 48, gen)
    q = torch.randn(1, 1, 1, 48, device=DEV)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.attention(q, kc, ks, vc, vs, torch.tensor(8, device=DEV), None, False, None, **fmts_of(kc, ks, vc, vs))


@pytest.mark.parametrize("Tq", [1, 4, 20])
def test_attention_left_padding_bool_mask(Tq):
    """HF's mask for a left-padded batch: [B, 1, Tq, L] bool, expanded (stride 0) over heads."""
    B, L = 2, 30
    pad = torch.tensor([0, 7])
    kv_len = 26
    pos = torch.arange(L)
    q_pos = kv_len - Tq + torch.arange(Tq)
    m = (pos.view(1, 1, 1, L) >= pad.view(B, 1, 1, 1)) & (pos.view(1, 1, 1, L) <= q_pos.view(1, 1, Tq, 1))
    m = m.expand(B, 1, Tq, L).to(DEV)
    check_attention("q8_0", "block32", B=B, Tq=Tq, L=L, kv_len=torch.tensor(kv_len, device=DEV), mask=m, causal=False)


@pytest.mark.parametrize("Tq", [1, 20])
def test_attention_additive_mask(Tq):
    gen = torch.Generator().manual_seed(5)
    B, L, Hkv, group = 2, 23, 2, 2
    m = torch.randn(B, Hkv * group, Tq, L, generator=gen)
    m[:, :, :, 3] = float("-inf")
    check_attention("fp8_e4m3", "block32", B=B, Hkv=Hkv, group=group, Tq=Tq, L=L, mask=m.to(DEV), causal=True)


def test_attention_unsupported_scale_groups_raise():
    gen = torch.Generator().manual_seed(0)
    kc, _, vc, _ = random_cache("fp8_e4m3", "token", 1, 1, 8, 96, gen)
    s = torch.ones(1, 1, 8, 2, device=DEV)  # groups of 48 values: no format's scales
    q = torch.randn(1, 1, 1, 96, device=DEV)
    fid = formats.get_format("fp8_e4m3", "block32").id
    with pytest.raises(ValueError, match="scale in fp8_e4m3/block32 must be"):
        torch.ops.kvcompile.attention(q, kc, s, vc, s, torch.tensor(8, device=DEV), None, False, None,
                                      k_format=fid, v_format=fid)
    with pytest.raises(ValueError, match="one granularity"):
        kernels.attention(q, kc, torch.ones(1, 1, 8, 1, device=DEV), vc, torch.ones(1, device=DEV),
                          torch.tensor(8, device=DEV), None, False, None,
                          **fmts(("fp8_e4m3", "token"), ("fp8_e4m3", "static")))


def test_attention_rows_without_keys_are_zero():
    B, L, Tq = 1, 16, 3
    m = torch.ones(B, 1, Tq, L, dtype=torch.bool)
    m[:, :, 1, :] = False  # query 1 sees nothing
    out, ref = check_attention("fp8_e4m3", "token", B=B, Tq=Tq, L=L, mask=m.to(DEV))
    assert torch.all(out[:, :, 1] == 0)


def test_attention_strided_q_and_scalar_scale():
    check_attention("fp8_e4m3", "token", Tq=3, causal=True, q_transposed=True, scale=0.3)
    check_attention("fp8_e4m3", "token", Tq=20, causal=True, q_transposed=True, scale=0.3)


def test_attention_kv_len_zero_gives_zeros():
    gen = torch.Generator().manual_seed(0)
    kc, ks, vc, vs = random_cache("fp8_e4m3", "token", 2, 1, 16, 64, gen)
    q = torch.randn(2, 2, 1, 64, device=DEV)
    out = kernels.attention(q, kc, ks, vc, vs, torch.tensor([0, 5], device=DEV), None, False, None, **fmts_of(kc, ks, vc, vs))
    ref = reference.attention(q, kc, ks, vc, vs, torch.tensor([0, 5], device=DEV), None, False, None,
                              compute_dtype=torch.float64, **fmts_of(kc, ks, vc, vs))
    assert torch.all(out[0] == 0) and rel_err(out[1], ref[1]) < ATOL_REL


def test_decode_splits_depend_on_shapes_only():
    s1 = plan_mod.decode_splits(programs=8, max_len=32768, block_n=64, sms=132)
    assert s1 == plan_mod.decode_splits(programs=8, max_len=32768, block_n=64, sms=132)
    splits, split_len = s1
    assert split_len % 64 == 0 and splits * split_len >= 32768 and (splits - 1) * split_len < 32768
    assert plan_mod.decode_splits(programs=8, max_len=10, block_n=64, sms=132) == (1, 64)


@pytest.mark.parametrize("programs,max_len,resident", [(256, 8192, 3), (256, 32768, 3), (64, 32768, 3),
                                                        (32, 131072, 3), (64, 32768, 2), (1024, 4096, 3),
                                                        (24, 1000, 2)])
def test_decode_splits_fill_whole_waves(programs, max_len, resident):
    """The split count fills its waves of resident programs at least as well as any other count
    within DECODE_WAVES waves (the H200 cases of docs/perf-log.md at aecdf70 among them), and covers
    the cache with whole blocks."""
    sms, block_n = 132, 128
    slots = resident * sms
    splits, split_len = plan_mod.decode_splits(programs, max_len, block_n, sms, resident)
    assert split_len % block_n == 0 and (splits - 1) * split_len < max_len <= splits * split_len

    def fill(s, sl):  # the launcher's model: a last wave of only the short last split takes its length
        waves = -(-programs * s // slots)
        last = max_len - (s - 1) * sl
        tail = last if programs * (s - 1) <= (waves - 1) * slots else sl
        return waves, programs * max_len / (slots * ((waves - 1) * sl + tail))

    waves, got = fill(splits, split_len)
    assert waves <= max(plan_mod.DECODE_WAVES, -(-programs // slots))
    for want in range(1, -(-max_len // block_n) + 1):
        sl = -(-(-(-max_len // want)) // block_n) * block_n
        s = -(-max_len // sl)
        w, f = fill(s, sl)
        if s == want and w <= plan_mod.DECODE_WAVES:
            assert got >= f - 0.01, (want, f, splits, got)


def test_decode_splits_h200_picks():
    """The counts measured best on the H200 (fp8 token tile: 3 programs per SM; bench_kv.py --splits at
    aecdf70 and 7300928, docs/perf-log.md; us are fp8 / int8 with K rotated)."""
    assert plan_mod.decode_splits(32 * 8, 8192, 128, 132, 3)[0] == 3  # was 5: 3.2 waves, 8% slower
    assert plan_mod.decode_splits(32 * 8, 32768, 128, 132, 3)[0] == 3
    assert plan_mod.decode_splits(8 * 8, 32768, 128, 132, 3)[0] == 6
    # one wave, not two of equal fill (aecdf70: within 1% of each other here)
    assert plan_mod.decode_splits(4 * 8, 131072, 128, 132, 3)[0] == 12
    assert plan_mod.decode_splits(8 * 8, 16384, 128, 132, 3)[0] == 6  # 78.3 / 82.3 us, 12: 81.4 / 85.6
    # splits under 8 tiles: one wave of two programs per SM
    assert plan_mod.decode_splits(8 * 8, 4096, 128, 132, 3)[0] == 4  # 26.1 / 29.5 us, 11: 30.6 / 34.3
    assert plan_mod.decode_splits(4 * 8, 8192, 128, 132, 3)[0] == 8  # 25.9 / 28.9 us, 22: 31.5 / 35.7
    assert plan_mod.decode_splits(4 * 8, 4096, 128, 132, 3)[0] == 8  # 17.7 / 19.7 us, 11: 18.7 / 21.0


def test_decode_many_splits_match():
    """A long cache with a short live prefix: most splits exit at once, the merge skips them."""
    check_attention("fp8_e4m3", "token", B=2, Hkv=1, group=4, L=300, Tq=2, causal=True,
                    kv_len=torch.tensor([17, 250], device=DEV))


# ---------------------------------------------------------------------------------------------
# dense-dequant prefill path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["equal-causal", "extend-causal", "ragged-mask", "extend-additive"])
def test_dense_path(case, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_PREFILL", "dense")
    if case == "equal-causal":
        check_attention("fp8_e4m3", "token", Tq=20, L=20, causal=True, group=4)
    elif case == "extend-causal":  # one length, no mask: SDPA's lower-right causal variant
        check_attention("fp8_e4m3", "token", Tq=20, L=30, causal=True, group=4)
    elif case == "ragged-mask":
        m = torch.ones(2, 1, 20, 30, dtype=torch.bool)
        m[1, :, :, :4] = False
        check_attention("q8_0", "block32", Tq=20, L=30, causal=True, kv_len=torch.tensor([30, 25], device=DEV),
                        mask=m.to(DEV))
    else:
        m = torch.randn(1, 1, 20, 40)
        check_attention("fp8_e4m3", "static", B=1, Tq=20, L=40, causal=True, kv_len=torch.tensor(33, device=DEV),
                        mask=m.to(DEV))


@pytest.mark.parametrize("case", ["keys", "keys-hiding", "causal", "causal-hiding", "causal-additive",
                                  "causal-biased"])
def test_dense_mask_that_is_causal_is_dropped(case, monkeypatch):
    """The dense path drops a mask that keeps exactly what SDPA's causal form keeps below each row's
    length: a key mask (size 1 along the queries, as the pass leaves a causal mask it took apart) that
    hides no live key, or a full [.., Tq, L] causal mask (what generate() builds for a chunk; bool, or
    additive 0 / finfo.min). SDPA then gets the lower-right causal bias, not a tensor. A mask that also
    hides a live key, or adds a bias, reaches SDPA. Every case equals the float64 reference."""
    from torch.nn.attention.bias import CausalBias

    monkeypatch.setenv("KVCOMPILE_PREFILL", "dense")
    seen = []
    real = dense_mod._sdpa
    monkeypatch.setattr(dense_mod, "_sdpa", lambda q, k, v, m, c, s, g: (seen.append(m), real(q, k, v, m, c, s, g))[1])
    Tq, L, n = 20, 30, 26
    pos, q_pos = torch.arange(L), n - Tq + torch.arange(Tq).view(Tq, 1)
    if case.startswith("keys"):
        m = (pos < n).view(1, 1, 1, L).expand(2, 1, 1, L).clone()  # past the live keys: hides none of them
        causal = True
    else:
        m = (pos <= q_pos).view(1, 1, Tq, L).expand(2, 1, Tq, L).clone()
        causal = False
    if case.endswith("hiding"):
        m[1, ..., 3] = False
    if case in ("causal-additive", "causal-biased"):
        m = torch.where(m, 0.0, torch.finfo(torch.float32).min)
        if case == "causal-biased":
            m[0, 0, 5, 2] = 0.5
    check_attention("fp8_e4m3", "token", Tq=Tq, L=L, causal=causal, kv_len=torch.tensor(n, device=DEV),
                    mask=m.to(DEV))
    (used,) = seen
    if case in ("keys", "causal", "causal-additive"):
        assert isinstance(used, CausalBias)
    else:
        assert isinstance(used, torch.Tensor) and used.shape[-2:] == (Tq, n)


def test_dense_workspace_released_when_sdpa_raises(monkeypatch):
    """Inject a failure after the workspace exists: it must be freed, not kept by the traceback."""
    monkeypatch.setenv("KVCOMPILE_PREFILL", "dense")
    refs = []

    def boom(q, k, v, attn_mask, is_causal, scale, enable_gqa):
        refs.extend([weakref.ref(k), weakref.ref(v)])
        del k, v, attn_mask
        raise RuntimeError("injected failure")

    monkeypatch.setattr(dense_mod, "_sdpa", boom)
    gen = torch.Generator().manual_seed(0)
    kc, ks, vc, vs = random_cache("fp8_e4m3", "token", 1, 1, 24, 64, gen)
    q = torch.randn(1, 2, 20, 64, device=DEV)
    with pytest.raises(RuntimeError, match="injected") as info:
        kernels.attention(q, kc, ks, vc, vs, torch.tensor(24, device=DEV), None, True, None, **fmts_of(kc, ks, vc, vs))
    assert info.value is not None  # the traceback is still alive here
    assert len(refs) == 2 and all(r() is None for r in refs), "dense workspace kept alive after a failure"


def test_prefill_path_option(monkeypatch):
    q = torch.empty(1, 1, 32, 64, device=DEV)
    monkeypatch.setenv("KVCOMPILE_PREFILL", "fused")
    assert attn_mod.prefill_path(q) == "fused"
    monkeypatch.setenv("KVCOMPILE_PREFILL", "dense")
    assert attn_mod.prefill_path(q) == "dense"
    assert attn_mod.prefill_path(q[:, :, :4]) == "decode"
    monkeypatch.setenv("KVCOMPILE_PREFILL", "bogus")
    with pytest.raises(ValueError, match="KVCOMPILE_PREFILL"):
        attn_mod.prefill_path(q)


def test_auto_prefill_path_with_quantized_scores():
    # auto on a GPU: dense from DENSE_MIN_Q new tokens, except where the fused kernel's plan quantizes
    # the scores (KVCOMPILE_PREFILL_Q), which keeps the fused kernel up to QUANT_FUSED_MAX_Q
    path, lo, hi = plan_mod.prefill_path, plan_mod.DENSE_MIN_Q, plan_mod.QUANT_FUSED_MAX_Q
    assert lo <= hi
    assert path(lo - 1, True, False) == "fused" and path(lo, True, False) == path(hi, True, False) == "dense"
    assert path(lo, True, False, quantized_scores=True) == path(hi, True, False, quantized_scores=True) == "fused"
    assert path(hi + 1, True, False, quantized_scores=True) == "dense"
    assert path(hi, True, True, quantized_scores=False) == "fused"  # capturing a CUDA graph: never dense


def test_quantized_scores_reach_the_path_choice(monkeypatch):
    # the launcher asks the fused kernel's plan: under KVCOMPILE_PREFILL_Q=int8 with 16-bit dots the plan
    # quantizes q against int8 K (q_int8), and prefill_path receives that; exact, it does not
    gen = torch.Generator().manual_seed(3)
    kc, ks, vc, vs = random_cache("int8", "token", 1, 2, 64, 64, gen)
    q = torch.randn(1, 4, plan_mod.DENSE_MIN_Q, 64, device=DEV, dtype=torch.bfloat16)
    seen = []
    real = plan_mod.prefill_path
    monkeypatch.setattr(plan_mod, "prefill_path", lambda *a, **kw: seen.append(kw["quantized_scores"]) or real(*a, **kw))
    call = attn_mod.call_of(q, kc, ks, vc, vs, None, True, False, **fmts_of(kc, ks, vc, vs))
    for choice, want in (("int8", True), ("exact", False)):
        monkeypatch.setenv("KVCOMPILE_PREFILL_Q", choice)
        with plan_mod.override(dot_dtype=torch.float16):
            attn_mod.prefill_path(q, call=call)
        assert seen[-1] is want, choice


# ---------------------------------------------------------------------------------------------
# through the ops, KVCOMPILE_KERNELS=triton
# ---------------------------------------------------------------------------------------------


def test_ops_dispatch_to_triton(monkeypatch):
    import kvcompile  # noqa: F401  (registers the ops)

    monkeypatch.setenv("KVCOMPILE_KERNELS", "triton")
    gen = torch.Generator().manual_seed(3)
    B, H, L, D = 1, 2, 16, 64
    kc, ks, vc, vs = make_cache("fp8_e4m3", None, B, H, L, D, gen=gen, device=DEV)
    k = torch.randn(B, H, 6, D, generator=gen).to(DEV)
    v = torch.randn(B, H, 6, D, generator=gen).to(DEV)
    start = torch.tensor(0, device=DEV)
    torch.ops.kvcompile.store_kv(kc, ks, vc, vs, k, v, start, None, **ids_of(kc, ks, vc, vs))
    ref = [t.clone().zero_() for t in (kc, ks, vc, vs)]
    reference.store_kv(*ref, k, v, start, None, **fmts_of(*ref))
    assert codes_equal(kc, ref[0]) and scales_equal(vs, ref[3])
    q = torch.randn(B, 4, 1, D, generator=gen).to(DEV)
    kv_len = torch.tensor(6, device=DEV)
    out = torch.ops.kvcompile.attention(q, kc, ks, vc, vs, kv_len, None, False, None, **ids_of(kc, ks, vc, vs))
    want = reference.attention(q, kc, ks, vc, vs, kv_len, None, False, None, compute_dtype=torch.float64, **fmts_of(kc, ks, vc, vs))
    assert rel_err(out, want) < ATOL_REL


# ---------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------

BF16_TOL = 1e-2  # bf16 P and output rounding (module docstring); measured ~3e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype,gran", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("Tq", [1, 8, 300])
@pytest.mark.parametrize("v_layout", ["head_dim", "keys"], ids=["v-d", "v-keys"])
def test_gpu_bf16_attention(kv_dtype, gran, Tq, v_layout):
    check_attention(kv_dtype, gran, B=3, Hkv=8, group=4, Tq=Tq, L=1000, D=128, causal=True,
                    kv_len=torch.tensor([1000, 517, 301], device=DEV), q_dtype=torch.bfloat16, tol=BF16_TOL,
                    v_layout=v_layout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["fused", "dense"])
def test_gpu_prefill_paths_bf16(path, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_PREFILL", path)
    check_attention("fp8_e4m3", "token", B=1, Hkv=8, group=4, Tq=2048, L=2048, D=128, causal=True,
                    q_dtype=torch.bfloat16, tol=BF16_TOL)
    check_attention("q8_0", "block32", B=2, Hkv=2, group=2, Tq=700, L=1500, D=128, causal=True,
                    kv_len=torch.tensor([1500, 900], device=DEV), q_dtype=torch.float16, tol=BF16_TOL)
    # an extend over one prefix length: the dense path takes SDPA's lower-right causal kernel
    check_attention("fp8_e4m3", "static", B=2, Hkv=8, group=4, Tq=300, L=1500, D=128, causal=True,
                    q_dtype=torch.bfloat16, tol=BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_in_cuda_graph():
    """Decode is graph safe: capture once, change kv_len on the device, replay: still right."""
    gen = torch.Generator().manual_seed(7)
    B, Hkv, L, D = 2, 8, 2048, 128
    kc, ks, vc, vs = random_cache("fp8_e4m3", "token", B, Hkv, L, D, gen)
    q = torch.randn(B, 32, 1, D, generator=gen).to(DEV).bfloat16()
    kv_len = torch.tensor([100, 200], device=DEV)
    kernels.attention(q, kc, ks, vc, vs, kv_len, None, False, None, **fmts_of(kc, ks, vc, vs))  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kernels.attention(q, kc, ks, vc, vs, kv_len, None, False, None, **fmts_of(kc, ks, vc, vs))
    for lens in ([100, 200], [2048, 1], [1500, 777]):
        kv_len.copy_(torch.tensor(lens))
        g.replay()
        ref = reference.attention(q, kc, ks, vc, vs, kv_len, None, False, None, compute_dtype=torch.float64, **fmts_of(kc, ks, vc, vs))
        assert rel_err(out, ref) < BF16_TOL, lens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_by_bits_path(monkeypatch):
    """Force the below-sm_89 decoder on this GPU: same results as the native e4m3 loads."""
    monkeypatch.setattr(tiles, "has_native_fp8", lambda cc: False)
    check_attention("fp8_e4m3", "token", B=2, Hkv=2, group=4, Tq=1, L=500, D=128, q_dtype=torch.bfloat16,
                    tol=BF16_TOL)
    check_attention("fp8_e4m3", "block32", B=1, Hkv=2, group=2, Tq=100, L=300, D=128, causal=True,
                    q_dtype=torch.bfloat16, tol=BF16_TOL)

"""The CPU's C decode attention (kvcompile.native) against the float64 reference.

The C path is what ``kvcompile::attention`` runs on the CPU by default; kvcompile.reference with
``compute_dtype=torch.float64`` is the oracle (its window, softcap and sink math is checked
against a scalar oracle in test_kernels_features.py). Every format, K/V rotation, GQA, per-row
lengths, windows, softcap, sinks, bool masks that broadcast, and V stored key-contiguous.
"""

from __future__ import annotations

import pytest
import torch

import kvcompile  # noqa: F401  (registers the ops)
from kvcompile import formats, get_format, native, reference, rotation
from utils import assert_close, bits_equal, fmts_of, ids_of

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C compiler here: {native.status()}")

# fp32 accumulation in another order than the float64 oracle, over <= 64 keys of O(1) values times
# scores: the measured max abs error is ~1e-6; 1e-5 is 10x that and ~1e3x below one e4m3 step
# (2^-4 relative), so a wrong key, scale, group or rotation fails by orders of magnitude.
ATOL, RTOL = 1e-5, 1e-5

FORMATS = [("int8", "token"), ("fp8_e4m3", "token"), ("fp8_e4m3", "static"), ("fp8_e4m3", "block32"),
           ("q8_0", "block32")]


def make(kv_dtype, granularity, B, Hkv, L, D, n, v_keys=False, k_rot=None, v_rot=None, seed=0):
    """A cache of n random tokens stored through the op (rotated per side), V key-contiguous if asked."""
    fmt = get_format(kv_dtype, granularity)
    gen = torch.Generator().manual_seed(seed)
    kc = torch.zeros(B, Hkv, L, D, dtype=fmt.code_dtype)
    vc = torch.zeros(B, Hkv, D, L, dtype=fmt.code_dtype).transpose(2, 3) if v_keys else torch.zeros_like(kc)
    if fmt.is_static:
        ks, vs = torch.rand(Hkv, generator=gen) * 0.01 + 0.01, torch.rand(Hkv, generator=gen) * 0.01 + 0.01
    else:
        ks = torch.zeros(fmt.scale_shape(B, Hkv, L, D), dtype=fmt.scale_dtype)
        vs = torch.zeros_like(ks)
    k = torch.randn(B, Hkv, n, D, generator=gen) * 2
    v = torch.randn(B, Hkv, n, D, generator=gen)
    torch.ops.kvcompile.store_kv(kc, ks, vc, vs, k, v, torch.tensor(0), None, k_rot, v_rot, **ids_of(kc, ks, vc, vs))
    return kc, ks, vc, vs


def both(q, cache, kv_len, mask=None, causal=True, window=0, softcap=0.0, sinks=None, k_rot=None, v_rot=None):
    """(the op's result on the CPU, the float64 reference), after checking the C path ran."""
    D = q.shape[3]
    direct = native.attention(q, *cache, kv_len, mask, causal, D**-0.5, window, softcap, sinks, k_rot, v_rot, **fmts_of(*cache))
    assert direct is not None, "the C path declined a case it covers"
    got = torch.ops.kvcompile.attention(q, *cache, kv_len, mask, causal, None, window, softcap, sinks, k_rot, v_rot, **ids_of(*cache))
    assert torch.equal(got, direct)  # the op runs the C path by default on the CPU
    want = reference.attention(q, *cache, kv_len, mask, causal, None, window, softcap, sinks, k_rot, v_rot,
                               compute_dtype=torch.float64, **fmts_of(*cache))
    return got, want


@pytest.mark.parametrize("kv_dtype,granularity", FORMATS)
@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("v_keys", [False, True], ids=["v-dims", "v-keys"])
def test_decode_matches_float64_reference(kv_dtype, granularity, rotated, v_keys):
    B, Hq, Hkv, L, D = 2, 6, 2, 48, 64
    if v_keys and granularity == "block32":
        pytest.skip("block32 V is stored head_dim-contiguous (KVFormat.v_keys_contiguous)")
    R = rotation.hadamard(D) if rotated else None
    cache = make(kv_dtype, granularity, B, Hkv, L, D, 37, v_keys, R, R)
    q = torch.randn(B, Hq, 1, D)
    got, want = both(q, cache, torch.tensor([37, 20]), k_rot=R, v_rot=R)
    assert_close(got, want, atol=ATOL, rtol=RTOL)
    if rotated:  # the rotation is undone: reading the rotated codes as plain ones gives another result
        plain = reference.attention(q, *cache, torch.tensor([37, 20]), None, True, None, compute_dtype=torch.float64, **fmts_of(*cache))
        assert (plain - want).abs().max() > 100 * ATOL


@pytest.mark.parametrize("D", [64, 96, 128])
def test_head_dims_and_queries_in_strided_layout(D):
    """HF's q is a transposed view of [B, T, Hq, D]; head dims 96 (block-diagonal rotation) and 128."""
    B, Hq, Hkv, L = 1, 4, 1, 40
    R = rotation.hadamard(D)
    cache = make("int8", "token", B, Hkv, L, D, 33, True, R, None)
    q = torch.randn(B, 3, Hq, D).transpose(1, 2)
    got, want = both(q, cache, torch.tensor(33), k_rot=R)
    assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", ["window", "softcap", "sinks", "mask", "causal-chunk", "all"])
def test_features_change_the_result_and_match(case):
    """Each feature matches the reference, and the same call without it differs (the test can tell)."""
    B, Hq, Hkv, L, D, Tq = 2, 4, 2, 64, 64, (3 if case in ("causal-chunk", "all") else 1)
    cache = make("fp8_e4m3", "token", B, Hkv, L, D, 50, True)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hq, Tq, D, generator=gen) * 2
    kv_len = torch.tensor([50, 31])
    kw = {}
    if case in ("window", "all"):
        kw["window"] = 9
    if case in ("softcap", "all"):
        kw["softcap"] = 2.0
    if case in ("sinks", "all"):
        kw["sinks"] = torch.randn(Hq, generator=gen) + 2
    if case in ("mask", "all"):
        m = torch.rand(B, 1, Tq, L, generator=gen) > 0.3  # broadcast over heads
        m[1, 0, 0] = False  # a row that sees nothing: zeros, sinks or not
        kw["mask"] = m
    got, want = both(q, cache, kv_len, **kw)
    assert_close(got, want, atol=ATOL, rtol=RTOL)
    if case == "causal-chunk":
        off, _ = both(q, cache, kv_len, causal=False)
    else:
        off, _ = both(q, cache, kv_len)
    assert (off - got).abs().max() > 100 * ATOL
    if case in ("mask", "all"):
        assert (got[1, :, 0] == 0).all()


def test_declines_what_it_does_not_cover():
    """Other query dtypes, additive masks and large work go to the torch reference (same contract)."""
    cache = make("int8", "token", 1, 2, 32, 64, 20)
    q = torch.randn(1, 4, 1, 64)
    n = torch.tensor(20)
    assert native.attention(q, *cache, n, None, True, 0.125, 0, 0.0, None, None, None, **fmts_of(*cache)) is not None
    assert native.attention(q.bfloat16(), *cache, n, None, True, 0.125, 0, 0.0, None, None, None, **fmts_of(*cache)) is None
    additive = torch.zeros(1, 1, 1, 32)
    assert native.attention(q, *cache, n, additive, True, 0.125, 0, 0.0, None, None, None, **fmts_of(*cache)) is None
    short = torch.ones(1, 1, 1, 19, dtype=torch.bool)  # fewer key columns than stored keys: not read past
    assert native.attention(q, *cache, n, short, True, 0.125, 0, 0.0, None, None, None, **fmts_of(*cache)) is None
    assert native.attention(q, *cache, n.int(), None, True, 0.125, 0, 0.0, None, None, None, **fmts_of(*cache)) is None
    assert native.attention(q, *cache, torch.tensor([20, 20]), None, True, 0.125, 0, 0.0, None, None, None, **fmts_of(*cache)) is None
    big = torch.randn(1, 4, native.MAX_WORK // (2 * 4 * 64 * 20) + 1, 64)
    assert native.attention(big, *cache, n, None, True, 0.125, 0, 0.0, None, None, None, **fmts_of(*cache)) is None


def test_decode_runs_in_c_at_any_length():
    """Up to MAX_QUERIES queries the C path takes any number of stored keys (its work above MAX_WORK):
    9000 keys against the float64 reference; a chunk of more queries over them goes to torch."""
    n = 9000
    cache = make("int8", "token", 1, 2, n, 64, n, True, seed=2)
    assert 2 * n * 4 * 64 > native.MAX_WORK
    q = torch.randn(1, 4, native.MAX_QUERIES, 64)
    got, want = both(q, cache, torch.tensor(n))
    assert_close(got, want, atol=ATOL, rtol=RTOL)
    more = torch.randn(1, 4, native.MAX_QUERIES + 1, 64)
    assert native.attention(more, *cache, torch.tensor(n), None, True, 0.125, 0, 0.0, None, None, None, **fmts_of(*cache)) is None


def test_nan_scale_propagates():
    """An int8 token holding a NaN stores a NaN scale (formats' policy): the rows that see it are NaN."""
    cache = make("int8", "token", 1, 1, 16, 64, 8)
    cache[1][0, 0, 5, 0] = float("nan")
    q = torch.randn(1, 2, 1, 64)
    got = torch.ops.kvcompile.attention(q, *cache, torch.tensor(8), None, True, None, **ids_of(*cache))
    assert torch.isnan(got).all()
    assert torch.isfinite(torch.ops.kvcompile.attention(q, *cache, torch.tensor(5), None, True, None, **ids_of(*cache))).all()


def test_kernel_choice(monkeypatch):
    """auto on the CPU runs the C path; KVCOMPILE_KERNELS=reference turns it off; native refuses CUDA."""
    from kvcompile.ops import kernel_backend

    monkeypatch.setenv("KVCOMPILE_KERNELS", "auto")
    assert kernel_backend(torch.device("cpu")) == "native"
    monkeypatch.setenv("KVCOMPILE_KERNELS", "native")
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        kernel_backend(torch.device("cuda"))
    cache = make("fp8_e4m3", "token", 1, 2, 32, 64, 20)
    q = torch.randn(1, 4, 1, 64)
    monkeypatch.setenv("KVCOMPILE_KERNELS", "reference")
    ref = torch.ops.kvcompile.attention(q, *cache, torch.tensor(20), None, True, None, **ids_of(*cache))
    assert torch.equal(ref, reference.attention(q, *cache, torch.tensor(20), None, True, None, **fmts_of(*cache)))
    monkeypatch.setenv("KVCOMPILE_KERNELS", "native")
    assert_close(torch.ops.kvcompile.attention(q, *cache, torch.tensor(20), None, True, None, **ids_of(*cache)), ref, atol=ATOL, rtol=RTOL)


def test_every_e4m3_code_reads_exactly():
    """The C path converts e4m3 codes by integer arithmetic: each finite value as torch converts it (the two
    NaN codes are left out: a hidden key's NaN would reach the other rows through a zero weight, as in
    the reference's P @ V)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~torch.isnan(codes.float())]
    n, D = codes.numel(), 16
    vc = codes.view(1, 1, n, 1).expand(1, 1, n, D).contiguous()  # key j holds code j in every channel
    kc = torch.zeros_like(vc)
    ones = torch.ones(1, 1, n, 1)
    mask = torch.eye(n, dtype=torch.bool).view(1, 1, n, n)  # query t sees key t alone: weight 1
    q = torch.randn(1, 1, n, D)
    out = native.attention(q, kc, ones, vc, ones, torch.tensor(n), mask, False, 1.0, 0, 0.0, None, None, None, **fmts_of(kc, ones, vc, ones))
    assert torch.equal(out[0, 0], codes.float().view(n, 1).expand(n, D))


# ------------------------------------------------------------------------------------------------
# the store
# ------------------------------------------------------------------------------------------------


def special_values(B, H, T, D, seed):
    """Random K/V with the values a quantizer gets wrong first: exact ties at every code step (x / s
    lands on .5), saturation, zeros, -0, subnormals, all-zero tokens, +-Inf and NaN."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=gen) * torch.logspace(-3, 3, T).view(1, 1, T, 1)
    x[0, 0, 0] = torch.arange(D) - D / 2 + 0.5  # amax = D/2 - .5: many x / s near .5 steps
    x[0, 0, 1] = 0.0
    x[0, 0, 1, 3] = -0.0
    x[0, -1, 1] = torch.randn(D, generator=gen) * 1e-40  # subnormal float32 values
    x[-1, 0, 2, :4] = torch.tensor([float("inf"), -float("inf"), 2.0, -1.0])
    x[-1, -1, 3, 5] = float("nan")
    x[-1, -1, 3, 6] = -float("nan")
    x[0, -1, 4, 40:] = 1e7  # q8_0: d = amax / 127 past float16's range -> an Inf scale
    x[-1, 0, 0] *= 1e-2  # and float16 subnormal scales (|x| ~ 1e-5)
    return x


STORE_PAIRS = [("int8", "int8", "token"), ("fp8_e4m3", "fp8_e4m3", "token"), ("int8", "fp8_e4m3", "token"),
               ("q8_0", "q8_0", "block32"), ("fp8_e4m3", "fp8_e4m3", "block32")]


@pytest.mark.parametrize("k_dtype,v_dtype,granularity", STORE_PAIRS)
@pytest.mark.parametrize("offset", [False, True], ids=["", "offset"])
def test_store_matches_reference_bit_for_bit(k_dtype, v_dtype, granularity, offset):
    """Unrotated, the C store writes the reference's codes and scales exactly, special values included."""
    B, H, L, D, T = 2, 3, 24, 64, 7
    gen = torch.Generator().manual_seed(5)
    off = torch.randn(H, D, generator=gen) if offset else None
    kf, vf = get_format(k_dtype, granularity), get_format(v_dtype, granularity)
    caches = []
    for _ in range(2):
        kc = torch.zeros(B, H, L, D, dtype=kf.code_dtype)
        vc = torch.zeros(B, H, L, D, dtype=vf.code_dtype)
        if vf.v_keys_contiguous:
            vc = torch.zeros(B, H, D, L, dtype=vf.code_dtype).transpose(2, 3)
        caches.append((kc, torch.zeros(kf.scale_shape(B, H, L, D), dtype=kf.scale_dtype), vc,
                       torch.zeros(vf.scale_shape(B, H, L, D), dtype=vf.scale_dtype)))
    k, v = special_values(B, H, T, D, 1), special_values(B, H, T, D, 2).transpose(1, 2).contiguous().transpose(1, 2)
    assert native.store_kv(*caches[0], k, v, 9, off, None, None, **fmts_of(*caches[0]))
    reference.store_kv(*caches[1], k, v, torch.tensor(9), off, **fmts_of(*caches[1]))
    for got, want in zip(caches[0], caches[1]):
        assert bits_equal(got, want)
    written = caches[0][0][:, :, 9:16]
    assert (written != 0).any() and (caches[0][0][:, :, :9] == 0).all() and (caches[0][0][:, :, 16:] == 0).all()
    assert torch.isnan(caches[0][3][-1, -1, 9 + 3]).any()  # a NaN -> a NaN scale (and fp8's NaN code)
    if k_dtype == "q8_0":  # the float16 scale's edges were reached (K's offset moves K's small values)
        assert torch.isinf(caches[0][1][0, -1, 9 + 4]).any() and torch.isinf(caches[0][3][0, -1, 9 + 4]).any()
        tiny = caches[0][3][-1, 0, 9]
        assert ((tiny > 0) & (tiny < 2**-14)).all()  # V: float16 subnormal scales


@pytest.mark.parametrize("D", [64, 96])
def test_rotated_store_within_one_code_step(D):
    """Rotated, the C store's sums run in another order than torch's matmul: codes within one step,
    scales within a few ulps, and the values the op reads back still dequantize to the same K/V."""
    B, H, L, T = 1, 2, 16, 9
    R = rotation.hadamard(D)
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(B, H, T, D, generator=gen) * 3, torch.randn(B, H, T, D, generator=gen)
    off = torch.randn(H, D, generator=gen) * 0.1
    caches = [tuple(torch.zeros(B, H, L, D, dtype=torch.int8) if i % 2 == 0 else torch.zeros(B, H, L, 1)
                    for i in range(4)) for _ in range(2)]
    assert native.store_kv(*caches[0], k, v, 3, off, R, R, **fmts_of(*caches[0]))
    reference.store_kv(*caches[1], k, v, torch.tensor(3), off, R, R, **fmts_of(*caches[1]))
    for i in (0, 2):
        assert (caches[0][i].int() - caches[1][i].int()).abs().max() <= 1
        torch.testing.assert_close(caches[0][i + 1], caches[1][i + 1], rtol=4e-7 * D ** 0.5, atol=0)
    unrotated = torch.zeros(B, H, L, D, dtype=torch.int8), torch.zeros(B, H, L, 1)
    assert native.store_kv(*unrotated, *unrotated, k, v, 3, off, None, None, **fmts_of(*unrotated, *unrotated))
    assert (caches[0][0].int() - unrotated[0].int()).abs().max() > 1  # the rotation happened


def test_store_declines_other_formats():
    """Static scales and non-float32 inputs keep the torch reference."""
    B, H, L, D = 1, 2, 8, 64
    k = torch.randn(B, H, 1, D)
    static = torch.zeros(B, H, L, D, dtype=torch.float8_e4m3fn), torch.ones(H)
    assert not native.store_kv(*static, *static, k, k, 0, None, None, None, **fmts_of(*static, *static))
    tok = torch.zeros(B, H, L, D, dtype=torch.int8), torch.zeros(B, H, L, 1)
    assert not native.store_kv(*tok, *tok, k.bfloat16(), k.bfloat16(), 0, None, None, None, **fmts_of(*tok, *tok))
    assert native.store_kv(*tok, *tok, k, k, 0, None, None, None, **fmts_of(*tok, *tok))


def test_store_op_runs_the_c_path_and_checks_bounds(monkeypatch):
    B, H, L, D = 1, 2, 8, 64
    k = torch.randn(B, H, 3, D)
    tok = torch.zeros(B, H, L, D, dtype=torch.int8), torch.zeros(B, H, L, 1)
    calls = []
    real = native.store_kv
    monkeypatch.setattr(native, "store_kv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.ops.kvcompile.store_kv(*tok, *tok, k, k, torch.tensor(5), None, **ids_of(*tok, *tok))
    assert calls and (tok[0][:, :, 5:8] != 0).any()
    with pytest.raises(RuntimeError, match=r"positions 6\.\.8 do not fit max_cache_len=8; .* max_cache_len>=9"):
        torch.ops.kvcompile.store_kv(*tok, *tok, k, k, torch.tensor(6), None, **ids_of(*tok, *tok))


def test_e4m3_rounding_at_every_step():
    """Every finite e4m3 value, the midpoints between neighbours (ties to even) and one float32 ulp
    either side of each midpoint: with the token's amax at 448 the scale is 1 and the codes are
    the conversion itself, compared with torch's."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()  # sorted, -448 .. 448
    mid = (vals[1:] + vals[:-1]) / 2
    ys = torch.cat([vals, mid, torch.nextafter(mid, torch.tensor(-1e9)), torch.nextafter(mid, torch.tensor(1e9))])
    D = 64
    ys = torch.cat([ys, torch.zeros((-ys.numel()) % (D - 1))]).view(-1, D - 1)
    x = torch.cat([ys, torch.full((ys.shape[0], 1), 448.0)], dim=1).view(1, 1, -1, D)  # amax 448: s = 1
    T = x.shape[2]
    got = torch.zeros(1, 1, T, D, dtype=torch.float8_e4m3fn), torch.zeros(1, 1, T, 1)
    assert native.store_kv(*got, *got, x, x, 0, None, None, None, **fmts_of(*got, *got))
    assert (got[1] == 1).all()
    assert bits_equal(got[0], x.to(torch.float8_e4m3fn))


def test_q8_0_scales_round_to_float16_as_torch_does():
    """4096 tokens of magnitudes 1e-9 .. 1e7: their float32 d spans float16's subnormals, normals and
    overflow, and each stored scale (and every code) equals the reference's bits."""
    gen = torch.Generator().manual_seed(11)
    T, D = 4096, 64
    x = torch.randn(1, 1, T, D, generator=gen) * 10 ** (torch.rand(1, 1, T, 1, generator=gen) * 16 - 9)
    fmt = get_format("q8_0")
    got, want = [(torch.zeros(1, 1, T, D, dtype=torch.int8), torch.zeros(fmt.scale_shape(1, 1, T, D), dtype=torch.float16))
                 for _ in range(2)]
    for i in range(0, T, 128):  # below MAX_WORK per call
        assert native.store_kv(*got, *got, x[:, :, i:i + 128], x[:, :, i:i + 128], i, None, None, None, **fmts_of(*got, *got))
    reference.store_kv(*want, *want, x, x, torch.tensor(0), None, **fmts_of(*want, *want))
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    s = got[1].float()
    assert (s == 0).any() and ((s > 0) & (s < 2**-14)).any() and torch.isinf(s).any()  # every range was reached


def test_attention_reads_only_the_stored_keys():
    """Positions at or past kv_len are never read, whatever max_cache_len: in a cache of 4096 positions
    whose unstored positions hold NaN scales (any read of them would reach the output: a NaN code
    times a zero weight is NaN), the result equals a cache of 32 positions with the same 20 tokens."""
    q = torch.randn(2, 4, 1, 64)
    small = make("int8", "token", 2, 2, 32, 64, 20, True, seed=4)
    big = make("int8", "token", 2, 2, 4096, 64, 20, True, seed=4)
    for scale in (big[1], big[3]):
        scale[:, :, 20:] = float("nan")
    kv_len = torch.tensor([20, 13])
    got, _ = both(q, big, kv_len)
    want, _ = both(q, small, kv_len)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    hidden = big[1].clone()
    big[1][:, :, 12] = float("nan")  # the control: a NaN in a stored key does reach the output
    assert torch.isnan(native.attention(q, *big, kv_len, None, True, 0.125, 0, 0.0, None, None, None, **fmts_of(*big))).any()
    big[1].copy_(hidden)


def test_plans_follow_the_tensors():
    """The C calls keep a plan per cache (its pointers and strides); a new tensor in any role (another
    rotation, another scale tensor) rebuilds it, and a plan dies with its cache."""
    D = 64
    R = rotation.hadamard(D)
    cache = make("int8", "token", 1, 2, 32, D, 20, True, R, R)
    q = torch.randn(1, 4, 1, D)
    n = torch.tensor(20)
    first, want = both(q, cache, n, k_rot=R, v_rot=R)
    assert_close(first, want, atol=ATOL, rtol=RTOL)
    # the same codes read as unrotated: the plan must not keep the rotations
    plain, want_plain = both(q, cache, n)
    assert_close(plain, want_plain, atol=ATOL, rtol=RTOL)
    assert (plain - first).abs().max() > 100 * ATOL
    # another k scale tensor of the same shape (twice the values): twice the logits
    k_scale2 = cache[1] * 2
    doubled, want_doubled = both(q, (cache[0], k_scale2, cache[2], cache[3]), n, k_rot=R, v_rot=R)
    assert_close(doubled, want_doubled, atol=ATOL, rtol=RTOL)
    assert (doubled - first).abs().max() > 100 * ATOL
    # a plan leaves with its cache (earlier tests' caches collected first, so that none leaves in between)
    import gc

    gc.collect()
    count = len(native._plans)
    tmp = make("fp8_e4m3", "token", 1, 2, 32, D, 20)
    both(q, tmp, n)
    assert len(native._plans) == count + 1
    del tmp
    gc.collect()
    assert len(native._plans) == count


def test_store_reads_start_from_the_tensor():
    """The store takes the cache's length tensor as it is (no host read), an int as well; negative or
    past-the-end starts write nothing and the op names the fix."""
    B, H, L, D = 1, 2, 8, 64
    k = torch.randn(B, H, 2, D)
    for start in (torch.tensor(3), 3):
        tok = torch.zeros(B, H, L, D, dtype=torch.int8), torch.zeros(B, H, L, 1)
        assert native.store_kv(*tok, *tok, k, k, start, None, None, None, **fmts_of(*tok, *tok))
        written = (tok[1][0, 0, :, 0] != 0).nonzero().flatten().tolist()
        assert written == [3, 4]
    for start in (7, -1):
        assert not native.store_kv(*tok, *tok, k, k, torch.tensor(start), None, None, None, **fmts_of(*tok, *tok))
    with pytest.raises(RuntimeError, match=r"positions 7\.\.8 do not fit max_cache_len=8"):
        torch.ops.kvcompile.store_kv(*tok, *tok, k, k, torch.tensor(7), None, **ids_of(*tok, *tok))
    bad_offset = torch.randn(H + 1, D)  # not [H, D]: declined (the reference names the shape)
    assert not native.store_kv(*tok, *tok, k, k, 0, bad_offset, None, None, **fmts_of(*tok, *tok))

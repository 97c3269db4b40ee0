"""``kvcompile::attention`` over rotated caches (codes of ``x @ R``, R a Hadamard): the reference
against a float64 oracle that un-rotates K and V, and the Triton kernels (split-K decode split and
unsplit, fused prefill, dense prefill) against the float64 reference, with R on K, on V and on both.
R is a random orthonormal matrix, not the cache's Hadamard: a Sylvester Hadamard is symmetric, so a
kernel that used R^T for R would pass with it.

The cache's own matrix (``kvcompile.rotation.shared``, a Sylvester Hadamard for a power-of-two
head_dim) takes another path: the decode kernel generates its +-1 entries in registers and rotates q
and the output itself; the ``sylvester`` tests run that path (and check the plan chose it), where
symmetry is no blind spot since no R is read.

The kernels rotate q (``q @ R_k``) and the output (``@ R_v^T``) in fp32 FMA dots here, so
the tolerances are those of tests/test_kernels_features.py for the same dot types (fp32 dots 1e-5,
bf16 on the GPU 1e-2): the rotations add fp32 rounding only (~1e-7 relative). Each case also runs
the kernel without the rotation it needs and asserts that the result moves by far more (a kernel
that dropped or transposed a rotation fails). Head dims 64, 128 and 80 (padded to a 128-wide tile
inside the kernel).
"""

from __future__ import annotations

import os

import pytest
import torch

import kvcompile  # noqa: F401  (registers the ops)
from kvcompile import reference, rotation

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcompile import kernels  # noqa: E402
from kvcompile.kernels import plan as plan_mod  # noqa: E402

from test_kernels_features import BF16_TOL, OFF_MIN, TOL, quantize, rel_err  # noqa: E402
from utils import fmt_of, fmts_of  # noqa: E402

SIDES = {"k": (True, False), "v": (False, True), "kv": (True, True)}


def orthonormal(D, seed):
    """A random orthonormal [D, D] float32 matrix (not symmetric, unlike a Sylvester Hadamard)."""
    q = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))[0]
    return q.float().contiguous()


def rotated_cache(B, Hkv, L, D, rot_k, rot_v, seed, kind="int8", sylvester=False):
    """Codes of K @ R (rot_k) or K, V @ R (rot_v) or V, and R: a random orthonormal matrix, or with
    ``sylvester`` the caches' shared Hadamard matrix (power-of-two D)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, L, D, generator=gen) * 2
    v = torch.randn(B, Hkv, L, D, generator=gen)
    if sylvester:
        R = rotation.shared(D, DEV)
        kc, ks = quantize(k @ R.cpu() if rot_k else k, kind, gen)
        vc, vs = quantize(v @ R.cpu() if rot_v else v, kind, gen)
        return (kc.to(DEV), ks.to(DEV), vc.to(DEV), vs.to(DEV)), R
    R = orthonormal(D, seed)
    kc, ks = quantize(k @ R if rot_k else k, kind, gen)
    vc, vs = quantize(v @ R if rot_v else v, kind, gen)
    return (kc.to(DEV), ks.to(DEV), vc.to(DEV), vs.to(DEV)), R.to(DEV)


def rotations(side, R):
    rk, rv = SIDES[side]
    return (R if rk else None), (R if rv else None)


@pytest.mark.parametrize("side", list(SIDES))
def test_reference_attends_in_the_rotated_space(side):
    """reference(q, codes of x @ R, rotations) == attention over the un-rotated dequantized K, V."""
    B, Hq, Hkv, L, D, Tq = 2, 4, 2, 21, 64, 3
    cache, R = rotated_cache(B, Hkv, L, D, *SIDES[side], seed=1)
    r_k, r_v = rotations(side, R)
    q = torch.randn(B, Hq, Tq, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEV)
    kv_len = torch.tensor([21, 12], device=DEV)
    got = reference.attention(q, *cache, kv_len, None, True, None, k_rotation=r_k, v_rotation=r_v,
                              compute_dtype=torch.float64, **fmts_of(*cache))
    kc, ks, vc, vs = cache
    k = kc.double() * ks.double()
    v = vc.double() * vs.double()
    if r_k is not None:
        k = k @ r_k.double().t()
    if r_v is not None:
        v = v @ r_v.double().t()
    group = Hq // Hkv
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * D**-0.5
    pos = torch.arange(L, device=DEV)
    q_pos = kv_len.view(B, 1, 1, 1) - Tq + torch.arange(Tq, device=DEV).view(1, 1, Tq, 1)
    s = s.masked_fill(~((pos <= q_pos) & (pos < kv_len.view(B, 1, 1, 1))), float("-inf"))
    want = torch.softmax(s, -1) @ v
    assert (got - want).abs().max() < 1e-12
    plain = reference.attention(q, *cache, kv_len, None, True, None, compute_dtype=torch.float64, **fmts_of(*cache))
    assert rel_err(plain, want) > OFF_MIN


def _check(q, cache, kv_len, R, side, causal, tol):
    r_k, r_v = rotations(side, R)
    out = kernels.attention(q, *cache, kv_len, None, causal, None, 0, 0.0, None, r_k, r_v, **fmts_of(*cache))
    ref = reference.attention(q, *cache, kv_len, None, causal, None, k_rotation=r_k, v_rotation=r_v,
                              compute_dtype=torch.float64, **fmts_of(*cache))
    assert out.dtype == q.dtype and not out.isnan().any()
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    rk_on, rv_on = SIDES[side]  # off: each rotation the case needs, dropped
    for off_k, off_v in ((None, r_v), (r_k, None)):
        if (off_k is None and rk_on) or (off_v is None and rv_on):
            moved = rel_err(kernels.attention(q, *cache, kv_len, None, causal, None, 0, 0.0, None, off_k, off_v, **fmts_of(*cache)), ref)
            assert moved > OFF_MIN, f"without a rotation the result is as close as {moved:.3g}"


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("D", [64, 80, 128])
@pytest.mark.parametrize("L", [13, 150], ids=["one-split", "split"])
def test_decode_rotated(side, D, L):
    """Tq 1 and 3 (GQA 2: rows of two heads): the unsplit epilogue and the merge each rotate back."""
    B, Hq, Hkv = 2, 4, 2
    cache, R = rotated_cache(B, Hkv, L, D, *SIDES[side], seed=3)
    for Tq in (1, 3):
        q = torch.randn(B, Hq, Tq, D, generator=torch.Generator().manual_seed(4)).to(DEV)
        kv_len = torch.tensor([L, L - 7], device=DEV)
        _check(q, cache, kv_len, R, side, causal=Tq > 1, tol=TOL)


def _plan(q, cache, R, side):
    from kvcompile.kernels import attention_launcher as launcher

    r_k, r_v = rotations(side, R)
    return launcher.plan_of(launcher.call_of(q, *cache, k_rotation=r_k, v_rotation=r_v, decode=q.shape[2] <= 16, **fmts_of(*cache)))


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("L", [13, 150], ids=["one-split", "split"])
def test_decode_rotated_sylvester(side, D, L):
    """The shared Hadamard matrix: q rotated in the kernel's prologue (H generated in registers),
    the output by the merge (H generated there too) or, unsplit, by a launch."""
    B, Hq, Hkv = 2, 4, 2
    cache, R = rotated_cache(B, Hkv, L, D, *SIDES[side], seed=9, sylvester=True)
    assert rotation.is_shared_sylvester(R)
    for Tq in (1, 3):
        q = torch.randn(B, Hq, Tq, D, generator=torch.Generator().manual_seed(10)).to(DEV)
        p = _plan(q, cache, R, side)
        rk_on, rv_on = SIDES[side]
        out_rot = ("merge" if L == 150 else "launch") if rv_on else ""
        assert (p.q_rotation, p.o_rotation) == ("kernel" if rk_on else "", out_rot)
        assert (p.splits > 1) == (L == 150)
        _check(q, cache, torch.tensor([L, L - 7], device=DEV), R, side, causal=Tq > 1, tol=TOL)
        if rk_on:  # q rotated by a launch instead (the plan's way for any other matrix), same answer
            with plan_mod.override(q_rotation="launch"):
                assert _plan(q, cache, R, side).q_rotation == "launch"
                _check(q, cache, torch.tensor([L, L - 7], device=DEV), R, side, causal=Tq > 1, tol=TOL)
    # the same values in another tensor are an ordinary matrix: read from memory, rotated by launches
    p = _plan(q, cache, R.clone(), side)
    assert "kernel" not in (p.q_rotation, p.o_rotation)


def test_shared_rotation_is_one_tensor_per_head_dim():
    a, b = rotation.shared(64, DEV), rotation.shared(64, DEV)
    assert a is b and torch.equal(a.cpu(), rotation.hadamard(64))
    assert rotation.is_shared_sylvester(a) and not rotation.is_shared_sylvester(a.clone())
    assert not rotation.is_shared_sylvester(rotation.shared(80, DEV))  # block-diagonal: read from memory


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("path,Tq", [("fused", 21), ("dense", 21), ("dense", 40)],
                         ids=["fused", "dense-rotates-q", "dense-rotates-kv"])
def test_prefill_rotated(side, path, Tq, monkeypatch):
    """Dense: with Hq * Tq <= Hkv * n (84 <= 90) q and the output are rotated, beyond (160) the
    dequantized keys and values are rotated back instead."""
    monkeypatch.setenv("KVCOMPILE_PREFILL", path)
    B, Hq, Hkv, L, D = 2, 4, 2, 45, 80
    cache, R = rotated_cache(B, Hkv, L, D, *SIDES[side], seed=5)
    q = torch.randn(B, Hq, Tq, D, generator=torch.Generator().manual_seed(6)).to(DEV)
    _check(q, cache, torch.tensor([45, 33], device=DEV), R, side, causal=True, tol=TOL)


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize("Tq", [21, 40])
def test_dense_prefill_sylvester_unrotates_in_the_dequantize(side, Tq, monkeypatch):
    """The shared Hadamard matrix in the dense path: the dequantize rotates back (no rotate_rows
    launch at all), also where the row counts would rotate q and the output (Hq * Tq = 84 <= Hkv * n
    = 90 at Tq 21: any other matrix goes there, test_prefill_rotated), and the answer is the reference's."""
    from kvcompile.kernels import dense

    monkeypatch.setenv("KVCOMPILE_PREFILL", "dense")
    B, Hq, Hkv, L, D = 2, 4, 2, 45, 64
    cache, R = rotated_cache(B, Hkv, L, D, *SIDES[side], seed=13, sylvester=True)
    launched = []
    real = dense.rotate_rows
    monkeypatch.setattr(dense, "rotate_rows", lambda *a, **k: launched.append(a[1]) or real(*a, **k))
    q = torch.randn(B, Hq, Tq, D, generator=torch.Generator().manual_seed(14)).to(DEV)
    _check(q, cache, torch.tensor([45, 33], device=DEV), R, side, causal=True, tol=TOL)
    assert not launched, "a rotate_rows launch ran: the dequantize should have rotated back"


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-static"])
@pytest.mark.parametrize("D", [16, 64, 128])
def test_dequantize_kv_unrotates_against_float64(kind, D):
    """``dequantize_kv(..., k_unrotate, v_unrotate)``: (codes * scale) @ R^T in float64, to fp32
    rounding (the codes times H's +-1 summed exactly, one scaling: ~1e-7 relative, 1e-6 allowed);
    zeros past each row's length; without the flag the rotated values come out (the control)."""
    from kvcompile.kernels.store import dequantize_kv, unrotates_in_dequantize

    B, Hkv, L, n = 2, 2, 37, 33
    cache, R = rotated_cache(B, Hkv, L, D, True, True, seed=15, kind=kind, sylvester=True)
    kc, ks, vc, vs = cache
    assert unrotates_in_dequantize(R, fmt_of(kc, ks))
    kv_len = torch.tensor([33, 20], device=DEV)
    k, v = dequantize_kv(kc, ks, vc, vs, kv_len, n, torch.float32, True, True, **fmts_of(kc, ks, vc, vs))
    for got, codes, scale in ((k, kc, ks), (v, vc, vs)):
        s = scale.double().view(1, -1, 1, 1) if scale.dim() == 1 else scale.double()
        want = (codes[:, :, :n].double() * (s if s.shape[2] == 1 else s[:, :, :n])) @ R.double().t()
        want[1, :, 20:] = 0
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-6, f"{kind} D={D}: relative error {err:.3g}"
    k_rot, _ = dequantize_kv(kc, ks, vc, vs, kv_len, n, torch.float32, **fmts_of(kc, ks, vc, vs))
    assert ((k_rot.double() - k.double()).abs().max() / k.abs().max()).item() > 0.1


@pytest.mark.skipif(DEV != "cuda", reason="bf16 dots: GPU only (the interpreter has no bf16 arithmetic)")
@pytest.mark.parametrize("Tq", [1, 4, 300])
def test_rotated_bf16_gpu(Tq):
    B, Hq, Hkv, L, D = 4, 32, 8, 4096, 128
    cache, R = rotated_cache(B, Hkv, L, D, True, True, seed=7)
    q = torch.randn(B, Hq, Tq, D, generator=torch.Generator().manual_seed(8)).to(DEV, torch.bfloat16)
    _check(q, cache, torch.tensor([4096, 3000, 1999, 4001], device=DEV), R, "kv", causal=True, tol=BF16_TOL)


@pytest.mark.skipif(DEV != "cuda", reason="bf16 / fp16 MMAs: GPU only (the interpreter has no bf16 arithmetic)")
@pytest.mark.parametrize("Tq", [1, 4])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L", [300, 4096])
@pytest.mark.parametrize("side", ["k", "kv"])  # K only: int8's default
@pytest.mark.parametrize("k_mma", [False, True], ids=["k-fp16", "k-int8mma"])  # K widened and biased, or int8 MMAs
def test_rotated_sylvester_gpu(Tq, q_dtype, L, side, k_mma):
    B, Hq, Hkv, D = 4, 32, 8, 128
    cache, R = rotated_cache(B, Hkv, L, D, *SIDES[side], seed=11, sylvester=True)
    q = torch.randn(B, Hq, Tq, D, generator=torch.Generator().manual_seed(12)).to(DEV, q_dtype)
    with plan_mod.override(int8_mma=k_mma, int8_bias=not k_mma):
        p = _plan(q, cache, R, side)
        o_rot = "" if side == "k" else "merge" if p.splits > 1 else "launch"
        assert (p.q_rotation, p.o_rotation) == ("kernel", o_rot) and p.k_bias != k_mma == p.k_mma, p.describe()
        _check(q, cache, torch.tensor([L, L - 96, L // 2 + 1, L - 1], device=DEV), R, side, causal=Tq > 1,
               tol=BF16_TOL)


@pytest.mark.skipif(DEV != "cuda", reason="bf16 / fp16 MMAs: GPU only (the interpreter has no bf16 arithmetic)")
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L", [1024, 4096])
def test_rotated_sylvester_one_tile_gpu(q_dtype, L):
    """B=1 over a short cache, int8 with K rotated as the cache stores it by default: the plan's splits
    are one tile each, read before the prologue that rotates q and splits it into int8 halves for K's
    int8 MMAs. The reference's answer, through the loops (``preload`` off) too."""
    B, Hq, Hkv, D = 1, 32, 8, 128
    cache, R = rotated_cache(B, Hkv, L, D, True, False, seed=13, sylvester=True)
    q = torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(14)).to(DEV, q_dtype)
    kv_len = torch.tensor([L - 37], device=DEV)
    p = _plan(q, cache, R, "k")
    assert p.one_tile and p.k_mma and p.q_rotation == "kernel", p.describe()
    _check(q, cache, kv_len, R, "k", causal=False, tol=BF16_TOL)
    with plan_mod.override(preload=False):
        assert not _plan(q, cache, R, "k").one_tile
        _check(q, cache, kv_len, R, "k", causal=False, tol=BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transpose", [False, True], ids=["xR", "xRT"])
@pytest.mark.parametrize("D", [64, 80, 128])
def test_rotate_rows_is_float32_accurate(dtype, transpose, D):
    """The launch that rotates q (and the dense path's output) against float64: relative error of a
    float32 matmul (<= 2e-6; the GPU's bf16-split tensor-core dots measure ~1e-7, the interpreter's fp32
    FMA dot the same), with the output rounded to ``dtype`` only when it is asked for."""
    from kvcompile.kernels.rotate import rotate_rows

    gen = torch.Generator().manual_seed(D)
    x = (torch.randn(3, 5, 7, D, generator=gen) * 10).to(dtype).to(DEV)  # 105 rows: a partial last block
    R = orthonormal(D, 7).to(DEV)
    want = x.double() @ (R.double().t() if transpose else R.double())
    got = rotate_rows(x, R, transpose=transpose)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert rel_err(got, want) < 2e-6
    assert rel_err(rotate_rows(x, R, transpose=not transpose), want) > OFF_MIN  # R and R^T differ
    if dtype != torch.float32:
        rounded = rotate_rows(x, R, transpose=transpose, dtype=dtype)
        assert rounded.dtype == dtype and torch.equal(rounded, got.to(dtype))

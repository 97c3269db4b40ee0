"""The fused prefill's quantized q and e4m3 P (``plan.LaunchPlan.q_quant`` / ``p_fp8``), which change
results: q rounded per (token, head) row to int8 at amax / 127 (int8 K) or to e4m3 at amax / 448 (e4m3
K), and P to e4m3 (times s_v / max s_v of the tile, e4m3 V). Under TRITON_INTERPRET=1 against float64
on fresh random data, three ways: (1) against the reference fed the same rounded q, tightly (what is
left is the fp16 path's own rounding of P and V); (2) against the exact reference, within the bound the
rounding of q allows; (3) a control: the error against the exact reference is far above (1)'s, so the
tests tell the mode on from off.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcompile import reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcompile import kernels  # noqa: E402
from kvcompile.kernels import attention_launcher as attn_mod  # noqa: E402
from kvcompile.kernels import plan as plan_mod  # noqa: E402
from test_kernels_features import FP16_TOL, make_q, quantized_cache as make_cache  # noqa: E402
from utils import fmts_of, rel_err  # noqa: E402

# (1): the fp16 path's P and V rounding, measured 1.9e-4 on the CPU (K_MMA's exact q: 2.2e-4,
# test_kernels_features.test_int8_k_mma), so FP16_TOL / 5 as there; the GPU's bf16 output: FP16_TOL
SAME_Q_TOL = FP16_TOL / 5 if DEV == "cpu" else FP16_TOL
# e4m3 P: each p * s_v / max s_v rounded to nearest, relative error <= 2^-4 in e4m3's normal range, so
# the output moves by at most 2^-4 of max |v| per row; in norm, random signs, measured 2.3e-2
P_FP8_TOL = 2.0**-4
# int8 P: each p * s_v / max s_v rounded within 1/254 (2^-8) of its tile row's largest, so the row's
# largest terms move by at most 2^-8 relative and every smaller one by that absolute step: the output by
# about 2^-8 of max |v| per tile row; summed in norm over a row's tiles, 2^-6 bounds it (random signs:
# measured 5.3e-3 to 5.7e-3 here, e4m3 P 2.3e-2)
P_INT8_TOL = 2.0**-6


def _round_q(q, fp8):
    """q rounded per row as ``_tile_parts._q_rows`` rounds it (int8: to nearest even at amax / 127)."""
    q64 = q.double()
    amax = q64.abs().amax(-1, keepdim=True)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    if fp8:
        return (q64 * (448 / amax)).float().to(torch.float8_e4m3fn).double() * (amax / 448)
    return torch.round(q64 * (127 / amax)) * (amax / 127)


def _q_bound(q, cache, sm_scale):
    """Per row, the largest output change that q's int8 rounding allows: the logits move by at most
    d = sm_scale * (amax / 254) * max_j ||k_j||_1, so every p_j by a factor within exp(+-2d), and the
    output by at most (exp(2d) - 1) * max_j ||v_j||."""
    kc, ks, vc, vs = cache
    k = kc.double() * ks.double()
    v = vc.double() * vs.double()
    g = q.shape[1] // k.shape[1]
    k1 = k.abs().sum(-1).amax(-1).repeat_interleave(g, 1)  # [B, Hq]
    vmax = v.norm(dim=-1).amax(-1).repeat_interleave(g, 1)
    d = sm_scale * q.double().abs().amax(-1) / 254 * k1[..., None]  # [B, Hq, Tq]
    return (torch.expm1(2 * d) * vmax[..., None]).cpu()


def _run(q, cache, kv_len, causal, **fields):
    seen, orig = [], attn_mod.plan_of

    def spy(call):
        seen.append(orig(call))
        return seen[-1]

    attn_mod.plan_of = spy
    try:
        with plan_mod.override(dot_dtype=torch.float16) if DEV == "cpu" else _nothing():
            with plan_mod.override(**fields):
                out = kernels.attention(q, *cache, kv_len, None, causal, None, **fmts_of(*cache))
    finally:
        attn_mod.plan_of = orig
    return out, seen[-1]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _case(kinds, seed, Tq=37, L=83, D=64):
    B, Hkv, group = 2, 2, 4
    cache = make_cache(*kinds, B, Hkv, L, D, seed=seed, v_layout="keys")
    q = make_q(B, Hkv * group, Tq, D, seed=seed, mult=1.5, dtype=torch.float32 if DEV == "cpu" else torch.bfloat16)
    return q, cache, torch.tensor([L, L - 21], device=DEV)  # odd lengths, the new tokens at an offset


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seed", [1, 2])
def test_q_int8_rows(causal, seed):
    q, cache, kv_len = _case(("int8", "int8"), seed)
    out, p = _run(q, cache, kv_len, causal, q_quant=True)
    assert p.q_int8 and not p.k_mma and p.constexprs()["Q_INT8"], p.describe()
    same = reference.attention(_round_q(q, False).to(q.dtype), *cache, kv_len, None, causal, None,
                               compute_dtype=torch.float64, **fmts_of(*cache))
    exact = reference.attention(q, *cache, kv_len, None, causal, None, compute_dtype=torch.float64, **fmts_of(*cache))
    err_same, err_exact = rel_err(out, same), rel_err(out, exact)
    assert err_same < SAME_Q_TOL, err_same
    # (2): per row, within q's rounding bound (+ the fp16 path's own error)
    row_err = (out.double() - exact.double()).norm(dim=-1).cpu()
    slack = SAME_Q_TOL * exact.double().norm(dim=-1).cpu() + 1e-6
    assert (row_err <= _q_bound(q, cache, q.shape[-1] ** -0.5) + slack).all()
    # (3): the control; and off (K_MMA's exact halves) is close to exact, so causal on / off is told apart too
    assert err_exact > 5 * err_same, (err_exact, err_same)
    off, p_off = _run(q, cache, kv_len, causal, q_quant=False)
    assert not p_off.q_int8 and rel_err(off, exact) < SAME_Q_TOL
    other = reference.attention(q, *cache, kv_len, None, not causal, None, compute_dtype=torch.float64, **fmts_of(*cache))
    assert rel_err(out, other) > 20 * err_exact


@pytest.mark.parametrize("p_fp8", [False, True], ids=["q-e4m3", "q-and-P-e4m3"])
def test_q_and_p_e4m3(p_fp8):
    q, cache, kv_len = _case(("fp8", "fp8"), 5)
    out, p = _run(q, cache, kv_len, True, q_quant=True, p_fp8=p_fp8)
    assert p.q_fp8 and p.pv_fp8 == p_fp8 and p.constexprs()["P_FP8"] == p_fp8, p.describe()
    same = reference.attention(_round_q(q, True).to(q.dtype), *cache, kv_len, None, True, None,
                               compute_dtype=torch.float64, **fmts_of(*cache))
    exact = reference.attention(q, *cache, kv_len, None, True, None, compute_dtype=torch.float64, **fmts_of(*cache))
    err_same = rel_err(out, same)
    assert not out.isnan().any()
    if p_fp8:
        assert SAME_Q_TOL < err_same < P_FP8_TOL, err_same  # P's rounding shows, within its bound
    else:
        assert err_same < SAME_Q_TOL, err_same
        assert rel_err(out, exact) > 5 * err_same


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("q_quant", [False, True], ids=["P-int8", "q-and-P-int8"])
def test_p_int8_rows(causal, q_quant):
    """P in int8 per row of each key tile against int8 V (P_INT8), with q exact or rounded to int8: against
    float64 over the same q, within int8 P's bound and far above the exact path's error (on from off)."""
    q, cache, kv_len = _case(("int8", "int8"), 4)
    out, p = _run(q, cache, kv_len, causal, q_quant=q_quant, p_int8=True)
    assert p.pv_int8 and p.q_int8 == q_quant and p.constexprs()["P_INT8"] and not p.v_bias, p.describe()
    same = reference.attention(_round_q(q, False).to(q.dtype) if q_quant else q, *cache, kv_len, None, causal, None,
                               compute_dtype=torch.float64, **fmts_of(*cache))
    off, _ = _run(q, cache, kv_len, causal, q_quant=q_quant)
    err, err_off = rel_err(out, same), rel_err(off, same)
    assert err < P_INT8_TOL and err > 5 * err_off, (err, err_off)
    other = reference.attention(q, *cache, kv_len, None, not causal, None, compute_dtype=torch.float64,
                                **fmts_of(*cache))
    assert rel_err(out, other) > 10 * err  # causal on / off told apart


def test_p_int8_nan_in_v_reaches_the_rows_that_see_it():
    """A NaN V scale (the int8 format's mark of a NaN or Inf stored) makes every row that sees the key
    NaN under int8 P too (its tile row's scale), and no other row."""
    q, cache, kv_len = _case(("int8", "int8"), 6, Tq=20)
    kc, ks, vc, vs = cache
    vs[1, 0, 40] = float("nan")  # batch row 1, kv head 0, key 40: below every query's position there
    out, p = _run(q, cache, kv_len, True, q_quant=True, p_int8=True)
    assert p.pv_int8
    g = q.shape[1] // kc.shape[1]
    assert out[1, :g].isnan().all()
    bad = torch.zeros(out.shape[:2], dtype=torch.bool, device=out.device)
    bad[1, :g] = True
    assert not out[~bad].isnan().any()


def test_e4m3_p_ignores_nan_codes_past_the_length():
    """Key-contiguous V is read in 16-key chunks: e4m3 NaN codes past kv_len must not reach the fp8 PV dot."""
    q, cache, kv_len = _case(("fp8", "fp8"), 7, Tq=20, L=70)
    kc, ks, vc, vs = cache
    root = vc._base if vc._base is not None else vc
    bits = root.view(torch.uint8).transpose(2, 3)  # [B, H, L16, D]
    clean = vc.clone()
    for b, n in enumerate(kv_len.tolist()):
        bits[b, :, n:] = 0x7F
        clean[b, :, n:] = 0
    out, p = _run(q, cache, kv_len, True, q_quant=True, p_fp8=True)
    assert p.pv_fp8 and not out.isnan().any()
    ref = reference.attention(_round_q(q, True).to(q.dtype), kc, ks, clean, vs, kv_len, None, True, None,
                              compute_dtype=torch.float64, **fmts_of(kc, ks, clean, vs))
    assert rel_err(out, ref) < P_FP8_TOL


def test_nonfinite_query_row_is_nan_alone():
    q, cache, kv_len = _case(("int8", "int8"), 9, Tq=20)
    q[0, 1, 3, 5] = float("nan")
    q[1, 2, 4, 0] = float("inf")
    out, p = _run(q, cache, kv_len, True, q_quant=True)
    assert p.q_int8
    assert out[0, 1, 3].isnan().all() and out[1, 2, 4].isnan().all()
    bad = torch.zeros(out.shape[:3], dtype=torch.bool, device=out.device)
    bad[0, 1, 3] = bad[1, 2, 4] = True
    assert not out[~bad].isnan().any()


def test_plan_applies_the_modes_only_where_valid():
    call = attn_mod.call_of
    q, cache, _ = _case(("int8", "int8"), 3, Tq=20)
    with plan_mod.override(q_quant=True, p_fp8=True, dot_dtype=torch.float16):
        p = attn_mod.plan_of(call(q, *cache, decode=False, **fmts_of(*cache)))
        assert p.q_int8 and not p.q_fp8 and not p.pv_fp8 and not p.pv_int8  # int8 V: P stays fp16 (exact)
    with plan_mod.override(p_int8=True, dot_dtype=torch.float16):
        assert attn_mod.plan_of(call(q, *cache, decode=False, **fmts_of(*cache))).pv_int8
        fq, fcache, _ = _case(("fp8", "fp8"), 3, Tq=20)
        assert not attn_mod.plan_of(call(fq, *fcache, decode=False, **fmts_of(*fcache))).pv_int8  # e4m3 V
    with plan_mod.override(q_quant=True, p_fp8=True, dot_dtype=torch.float32):
        p = attn_mod.plan_of(call(q, *cache, decode=False, **fmts_of(*cache)))
        assert not (p.q_int8 or p.q_fp8 or p.pv_fp8)  # fp32 dots (fp32 q): exact, never quantized


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kinds,fields", [
    (("int8", "int8"), dict(q_quant=True)),
    # Triton's fp8 x fp8 dots on sm_90 accumulate in the fp8 MMAs' reduced precision over the whole
    # reduction (its max_num_imprecise_acc defaults to 2**30 there): an H100 at f36fc4d measured 5.15e-3
    # against the 16-bit path's 5e-3 (docs/perf-log.md). Promoting the sums to fp32 every 32 products
    # (max_num_imprecise_acc=32) is the known remedy, not yet timed; until then this is a known deviation
    pytest.param(("fp8", "fp8"), dict(q_quant=True), marks=pytest.mark.xfail(
        reason="sm_90 fp8 MMAs accumulate in reduced precision (Triton's max_num_imprecise_acc default)")),
    (("fp8", "fp8"), dict(q_quant=True, p_fp8=True)),
    # the scores' sums promoted to fp32 every 32 products; P V's once per key tile (plan.LaunchPlan.fp8_acc)
    (("fp8", "fp8"), dict(q_quant=True, fp8_acc=32)),
    (("fp8", "fp8"), dict(q_quant=True, p_fp8=True, fp8_acc=plan_mod.FP8_ACC_PER_DOT)),
    (("int8", "int8"), dict(q_quant=True, p_int8=True))],
    ids=["q-int8", "q-e4m3", "q-and-P-e4m3", "q-e4m3-acc32", "q-and-P-e4m3-acc-tile", "q-and-P-int8"])
def test_gpu_quantized_prefill(kinds, fields, monkeypatch):
    """The GPU kernel (int8 / fp8 MMAs, the prefill tile) against the same rounded q in float64."""
    monkeypatch.setenv("KVCOMPILE_PREFILL", "fused")
    B, Hkv, group, L, D, Tq = 1, 2, 4, 3000, 128, 1100
    cache = make_cache(*kinds, B, Hkv, L, D, seed=11, v_layout="keys")
    q = make_q(B, Hkv * group, Tq, D, seed=11, mult=1.5, dtype=torch.bfloat16)
    kv_len = torch.tensor([L - 7], device=DEV)
    out, p = _run(q, cache, kv_len, True, **fields)
    assert (p.q_int8 or p.q_fp8) and p.pv_fp8 == bool(fields.get("p_fp8")) and not p.call.decode, p.describe()
    assert p.pv_int8 == bool(fields.get("p_int8")), p.describe()
    same = reference.attention(_round_q(q, kinds[0] == "fp8").to(torch.float32), *cache, kv_len, None, True, None,
                               compute_dtype=torch.float64, **fmts_of(*cache))
    tol = P_FP8_TOL if fields.get("p_fp8") else P_INT8_TOL if fields.get("p_int8") else FP16_TOL
    assert rel_err(out, same) < tol


def test_fp8_acc_reaches_the_fp8_dots_only():
    """plan.LaunchPlan.fp8_acc becomes each fp8 dot's promotion interval, cut to that dot's reduction
    (QK: the head dim; PV: the key tile), and 0 (Triton's default) for a dot that is not fp8 x fp8."""
    q, cache, _ = _case(("fp8", "fp8"), 3, Tq=20)
    call = attn_mod.call_of(q, *cache, decode=False, **fmts_of(*cache))
    with plan_mod.override(q_quant=True, p_fp8=True, dot_dtype=torch.float16, fp8_acc=plan_mod.FP8_ACC_PER_DOT):
        p = plan_mod.plan(call)
        c = p.constexprs()
        assert p.q_fp8 and p.pv_fp8
        assert (c["QK_FP8_ACC"], c["PV_FP8_ACC"]) == (c["BLOCK_D"], c["BLOCK_N"])
    with plan_mod.override(q_quant=True, dot_dtype=torch.float16, fp8_acc=32):
        c = plan_mod.plan(call).constexprs()
        assert (c["QK_FP8_ACC"], c["PV_FP8_ACC"]) == (32, 0)  # P stays fp16: no fp8 dot there
    q, cache, _ = _case(("int8", "int8"), 3, Tq=20)
    call = attn_mod.call_of(q, *cache, decode=False, **fmts_of(*cache))
    with plan_mod.override(q_quant=True, p_fp8=True, dot_dtype=torch.float16, fp8_acc=32):
        c = plan_mod.plan(call).constexprs()
        assert c["Q_INT8"] and (c["QK_FP8_ACC"], c["PV_FP8_ACC"]) == (0, 0)  # int8 dots sum exactly


def test_prefill_q_knob(monkeypatch):
    """KVCOMPILE_PREFILL_Q opts the fused prefill into the modes (default exact); decode never reads it."""
    q, cache, _ = _case(("fp8", "fp8"), 3, Tq=20)
    call = attn_mod.call_of(q, *cache, decode=False, **fmts_of(*cache))
    with plan_mod.override(dot_dtype=torch.float16):
        assert not (plan_mod.plan(call).q_fp8 or plan_mod.plan(call).pv_fp8)
        monkeypatch.setenv("KVCOMPILE_PREFILL_Q", "int8")
        assert plan_mod.plan(call).q_fp8 and not plan_mod.plan(call).pv_fp8
        monkeypatch.setenv("KVCOMPILE_PREFILL_Q", "fp8")
        assert plan_mod.plan(call).q_fp8 and plan_mod.plan(call).pv_fp8
        assert not plan_mod.plan(attn_mod.call_of(q[:, :, :1], *cache, **fmts_of(*cache))).q_fp8  # decode: exact
        monkeypatch.setenv("KVCOMPILE_PREFILL_Q", "p8")  # P as V's code type: e4m3 here, int8 for int8 V
        assert plan_mod.plan(call).pv_fp8 and not plan_mod.plan(call).pv_int8
        iq, icache, _ = _case(("int8", "int8"), 3, Tq=20)
        ip = plan_mod.plan(attn_mod.call_of(iq, *icache, decode=False, **fmts_of(*icache)))
        assert ip.q_int8 and ip.pv_int8 and not ip.pv_fp8
        monkeypatch.setenv("KVCOMPILE_PREFILL_Q", "bogus")
        with pytest.raises(ValueError):
            plan_mod.plan(call)

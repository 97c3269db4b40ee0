"""Launch plans (kvcompile/kernels/plan.py): one place for every decision of an attention call.

CPU only, no kernel runs: the plan is a pure function of the call, its constexprs are exactly the
kernel's, its overrides are scoped, and no module of kvcompile/kernels keeps a flag that changes
what a kernel does.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest
import torch

pytest.importorskip("triton")

import kvcompile.kernels as kernels_pkg  # noqa: E402
from kvcompile import rotation, tiles  # noqa: E402
from kvcompile.kernels import _attention_kernel as kmod  # noqa: E402
from kvcompile.kernels import attention_launcher as launcher  # noqa: E402
from kvcompile.kernels import plan as P  # noqa: E402
from utils import fmts_of  # noqa: E402


def _call(**kw) -> P.Call:
    base = dict(cc=(9, 0), sms=132, interpret=False, B=8, Hq=32, Hkv=8, Tq=1, L=32768, D=128,
                q_dtype=torch.bfloat16, k_code=torch.int8, v_code=torch.int8, scale_kind=P.SCALE_TOKEN,
                group_size=128, scale_bytes=4, v_keys=True)
    base.update(kw)
    return P.Call(**base)


def test_mode_constants_are_the_kernels():
    for name in ("SCALE_TOKEN", "SCALE_BLOCK", "SCALE_STATIC", "MASK_NONE", "MASK_BOOL", "MASK_ADD"):
        assert getattr(P, name) == getattr(kmod, name).value, name


@pytest.mark.parametrize("call", [
    _call(),
    _call(k_rot=P.ROT_SYLVESTER, v_rot=P.ROT_SYLVESTER),
    _call(Tq=1024, decode=False, is_causal=True, k_code=torch.float8_e4m3fn, v_code=torch.float8_e4m3fn),
    _call(scale_kind=P.SCALE_BLOCK, group_size=32, scale_bytes=8, v_keys=False, mask_kind=P.MASK_BOOL,
          window=1024, softcap=True, sinks=True),
], ids=["int8", "int8-rotated", "fp8-prefill", "q8_0-features"])
def test_constexprs_are_exactly_the_kernels(call):
    """Every constexpr of _attention_kernel, and nothing else, comes from the plan (aot.py compiles
    these; a kernel switch added without the plan fails here before any GPU run)."""
    fn = kmod._attention_kernel
    params = inspect.signature(getattr(fn, "fn", fn)).parameters  # JITFunction or the interpreter's wrapper
    declared = {n for n, a in params.items() if "constexpr" in str(a.annotation)}
    assert len(declared) > 20
    assert set(P.plan(call).constexprs()) == declared


def test_plan_is_pure_and_cached():
    c = _call()
    assert P.plan(c) is P.plan(_call())  # equal calls, one cached plan
    p = P.plan(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.splits = 3
    assert p.tile == tiles.decode_tile((9, 0), 128, 2, 1, 1, 4, True, 4)
    assert p.splits * p.split_len >= c.L > (p.splits - 1) * p.split_len


def test_dot_type_follows_the_query_and_the_interpreter():
    assert P.plan(_call()).dot_dtype == torch.float16
    assert P.plan(_call(q_dtype=torch.float32)).dot_dtype == torch.float32
    interp = P.plan(_call(interpret=True))
    assert interp.dot_dtype == torch.float32 and not interp.int8_ptx and not interp.v_pin
    assert (interp.tile.block_m, interp.tile.block_n) == (16, P.INTERPRET_TILE[1])


def test_rotation_places():
    syl = P.plan(_call(k_rot=P.ROT_SYLVESTER, v_rot=P.ROT_SYLVESTER))
    assert (syl.q_rotation, syl.o_rotation) == ("kernel", "merge") and syl.splits > 1
    assert syl.constexprs()["Q_HADAMARD"]
    other = P.plan(_call(k_rot=P.ROT_MATRIX, v_rot=P.ROT_MATRIX))
    assert (other.q_rotation, other.o_rotation) == ("launch", "merge") and not other.constexprs()["Q_HADAMARD"]
    prefill = P.plan(_call(Tq=64, decode=False, k_rot=P.ROT_SYLVESTER, v_rot=P.ROT_SYLVESTER))
    assert (prefill.q_rotation, prefill.o_rotation) == ("launch", "launch")
    assert (P.plan(_call()).q_rotation, P.plan(_call()).o_rotation) == ("", "")


def test_int8_bias_for_tiles_of_few_rows():
    """int8 widened to 1152 + code (corrections per score and per P element instead of a subtraction
    per two codes): planned where the tile's rows are at most a quarter of the head dim (decode) and
    enough programs run to hide the correction's latency, for an int8 V beside e4m3 K (int8 K goes to
    int8 MMAs there: the next test); not for the prefill tile, nor for a decode of one sequence. Forced,
    K and V each only when int8 with token / static scales."""
    mixed = P.plan(_call(k_code=torch.float8_e4m3fn))
    assert mixed.int8_bias and mixed.v_bias and not mixed.k_bias and mixed.constexprs()["V_BIAS"]
    assert not P.plan(_call(B=1, k_code=torch.float8_e4m3fn)).int8_bias  # 8 programs per split <= DECODE_SMALL_PROGRAMS
    pre = P.plan(_call(Tq=1024, decode=False, is_causal=True))
    assert pre.tile.block_m * 4 > 128 and not (pre.k_bias or pre.v_bias)
    with P.override(int8_bias=True, int8_mma=False):  # forced: still only where it is valid
        dec = P.plan(_call())
        assert dec.k_bias and dec.v_bias
        assert not P.plan(_call(k_code=torch.float8_e4m3fn, v_code=torch.float8_e4m3fn)).v_bias
        q8 = P.plan(_call(scale_kind=P.SCALE_BLOCK, group_size=32, scale_bytes=8, v_keys=False))
        assert not (q8.k_bias or q8.v_bias)
        assert not P.plan(_call(q_dtype=torch.float32)).k_bias  # fp32 dots widen exactly


def test_int8_k_by_int8_mma_where_the_bias_runs():
    """int8 K unwidened into int8 MMAs (q in two int8 halves): planned for decode tiles with more than
    DECODE_SMALL_PROGRAMS programs, where it replaces K's bias, and V's bias goes too (it no longer
    pays beside it); an int8 V beside e4m3 K keeps its bias. Planned for the fused prefill tile too,
    with nothing biased. Only for int8 K with token / static scales and fp16 dots, forced or not."""
    dec = P.plan(_call())
    assert dec.k_mma and not (dec.k_bias or dec.v_bias) and dec.constexprs()["K_MMA"], dec.describe()
    assert "int8 K by int8 MMA" in dec.describe()
    assert not P.plan(_call(B=1)).k_mma and P.plan(_call(B=1)).constexprs()["K_MMA"] is False
    pre = P.plan(_call(Tq=1024, decode=False, is_causal=True))
    assert pre.k_mma and not (pre.k_bias or pre.v_bias) and pre.constexprs()["K_MMA"], pre.describe()
    assert not P.plan(_call(Tq=1024, decode=False, is_causal=True, q_dtype=torch.float32)).k_mma
    assert not P.plan(_call(Tq=1024, decode=False, is_causal=True, k_code=torch.float8_e4m3fn)).k_mma
    fp8_k = P.plan(_call(k_code=torch.float8_e4m3fn))
    assert fp8_k.int8_mma and not fp8_k.k_mma and fp8_k.v_bias  # e4m3 K: widened by cvt as ever
    with P.override(int8_mma=True):
        assert not P.plan(_call(scale_kind=P.SCALE_BLOCK, group_size=32, scale_bytes=8, v_keys=False)).k_mma
        assert not P.plan(_call(q_dtype=torch.float32)).k_mma  # fp32 dots: q has no int8 halves there
        assert P.plan(_call(B=1)).k_mma  # forced where it is not planned: still valid


def test_no_int8_mma_below_sm_80():
    """Triton lowers an int8 dot to MMAs from sm_80 on; on Turing (T4) its fallback takes no int8
    operands and the kernel fails to compile, so K is widened there wherever sm_80 would take MMAs
    (tests/test_sass.py compiles both for sm_75)."""
    for kw in (dict(), dict(Tq=1024, decode=False, is_causal=True)):
        assert P.plan(_call(cc=(8, 0), **kw)).k_mma, kw
        turing = P.plan(_call(cc=(7, 5), **kw))
        assert not turing.k_mma and turing.constexprs()["K_MMA"] is False, turing.describe()


def test_override_is_scoped_and_kept_valid():
    c = _call(k_rot=P.ROT_SYLVESTER, v_rot=P.ROT_SYLVESTER)
    with P.override(splits=1):
        p = P.plan(c)
        assert p.splits == 1 and p.split_len >= c.L
        assert p.o_rotation == "launch"  # no merge to rotate in
        with P.override(q_rotation="launch", int8_bias=False):
            inner = P.plan(c)
            assert (inner.splits, inner.q_rotation, inner.int8_bias) == (1, "launch", False)
    assert P.plan(c) == P.plan(_call(k_rot=P.ROT_SYLVESTER, v_rot=P.ROT_SYLVESTER))
    assert P.plan(c).splits > 1
    with P.override(q_rotation="kernel", o_rotation="merge"):  # the generated matrix only for Sylvester
        p = P.plan(_call(k_rot=P.ROT_MATRIX))
        assert (p.q_rotation, p.o_rotation) == ("launch", "")
    with P.override(tile=tiles.Tile(16, 64, 4, 2)):  # a forced tile is planned for its splits
        p = P.plan(_call())
        assert p.tile.block_n == 64 and p.split_len % 64 == 0


def test_launcher_reads_the_call_off_its_tensors():
    D, L = 64, 40
    q = torch.randn(2, 4, 1, D)
    kc = torch.zeros(2, 2, L, D, dtype=torch.int8)
    ks = torch.ones(2, 2, L, 1)
    R = rotation.shared(D, "cpu")
    c = launcher.call_of(q, kc, ks, kc, ks, k_rotation=R, v_rotation=R.clone(), **fmts_of(kc, ks, kc, ks))
    assert (c.k_rot, c.v_rot) == (P.ROT_SYLVESTER, P.ROT_MATRIX)
    assert (c.B, c.Hq, c.Hkv, c.Tq, c.L, c.D, c.scale_kind) == (2, 4, 2, 1, L, D, P.SCALE_TOKEN)
    assert launcher.call_of(q, kc, ks, kc, ks, window=L, **fmts_of(kc, ks, kc, ks)).window == 0  # a window of L keys hides none


def test_no_module_flag_changes_a_kernel():
    """No module of kvcompile.kernels holds a bool switch (a flag benchmarks or tests would flip):
    decisions are plan fields, or functions of the arch."""
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        mod = importlib.import_module(f"kvcompile.kernels.{info.name}")
        flags = [n for n, v in vars(mod).items() if n.isupper() and isinstance(v, bool)]
        assert not flags, (info.name, flags)


def test_token_store_placement():
    """A decode that also stores its token (a ring's step) stores it in the attention kernel when one
    program per split and kv head holds the token's slot and the store's rotation runs in registers;
    otherwise by a store launch before the kernel. A call that stores nothing has neither."""
    assert P.plan(_call()).store == ""
    assert P.plan(_call()).constexprs()["STORE_NEW"] is False
    p = P.plan(_call(store=True, k_rot=P.ROT_SYLVESTER))
    assert p.store == "kernel"
    assert p.constexprs()["STORE_NEW"] and p.constexprs()["STORE_K_HADAMARD"]
    assert not p.constexprs()["STORE_V_HADAMARD"] and not p.constexprs()["STORE_OFFSET"]
    assert P.plan(_call(store=True, store_offset=True)).constexprs()["STORE_OFFSET"]
    assert P.plan(_call(store=True, k_rot=P.ROT_MATRIX)).store == "launch"  # R read from memory
    assert P.plan(_call(store=True, Tq=2)).store == "launch"  # two queries: not one program's slot
    assert P.plan(_call(store=True, Hq=8 * 256)).store == "launch"  # 256 query heads per kv head: >1 query block
    p = P.plan(_call(store=True, scale_kind=P.SCALE_STATIC, scale_bytes=0, k_rot=P.ROT_SYLVESTER))
    assert p.store == "launch"  # the store's in-register rotation takes token scales
    with P.override(tile=tiles.Tile(16, 64, 4, 2)):  # a forced tile whose block_m no longer holds the group
        assert P.plan(_call(store=True, Hq=8 * 32)).store == "launch"
    assert "token stored by kernel" in P.plan(_call(store=True)).describe()

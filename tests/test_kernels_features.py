"""Sliding window, logit softcap, attention sinks, int8 token codes and mixed K/V code types:
the Triton kernels (fused prefill, split-K decode + merge, dense prefill) against the float64
reference, the reference against a per-row float64 oracle written here, and the op's checks.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
the interpreter's key tile is 16 and its decode launch assumes 4 SMs, so the small shapes here
cross tile edges and split the cache several ways. Tolerances as in tests/test_kernels.py
(relative Frobenius error against reference.attention in float64 on the same codes): fp32 dots
1e-5 (measured <= 1e-6), fp16 dots 5e-3, bf16 on the GPU 1e-2. Each feature test also runs the
kernel with the feature off and asserts the result moves by far more than the tolerance, so a
kernel that ignored the feature would fail.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import kvcompile  # noqa: F401  (registers the ops)
from kvcompile import formats, reference
from kvcompile.cache import v_codes_buffer

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)
pytest.importorskip("triton")

from kvcompile import kernels  # noqa: E402
from kvcompile.kernels import attention_launcher as attn_mod  # noqa: E402
from kvcompile.kernels import dense as dense_mod  # noqa: E402
from kvcompile.kernels import plan as plan_mod  # noqa: E402
from utils import fmts_of, ids_of, rel_err  # noqa: E402

OPS = torch.ops.kvcompile
TOL = 1e-5  # fp32 dots (interpreter, or fp32 q on the GPU): measured <= 1e-6
FP16_TOL = 5e-3  # the GPU's fp16-dot path run by the interpreter: q, P, V rounded to fp16
BF16_TOL = 1e-2  # bf16 q on the GPU: measured ~3e-3 in tests/test_kernels.py
OFF_MIN = 1e-2  # a feature switched off moves the result by at least this much (>> every tolerance)

# code type, scale granularity, scale dtype of each stored tensor kind the kernels read
KINDS = {
    "fp8": (torch.float8_e4m3fn, "token", torch.float32),
    "int8": (torch.int8, "token", torch.float32),  # the int8 format: amax / 127 per token, fp32
    "fp8-b32": (torch.float8_e4m3fn, "block32", torch.float32),
    "q8_0": (torch.int8, "block32", torch.float16),
    "fp8-static": (torch.float8_e4m3fn, "static", torch.float32),
}


def quantize(x, kind, gen):
    """x [B, H, L, D] -> (codes, scales) of one kind (the int8 token format rounds half to even)."""
    code_dtype, gran, scale_dtype = KINDS[kind]
    if gran == "static":
        s = (x.abs().amax(dim=(0, 2, 3)) / formats.FP8_E4M3_MAX) * (1 + torch.rand(x.shape[1], generator=gen) * 0.1)
        return formats.quantize(x, code_dtype, scale=s)[0], s
    if kind == "int8":
        s = x.abs().amax(dim=-1, keepdim=True) / 127.0
        codes = torch.where(s > 0, x / s, torch.zeros_like(x)).round().clamp(-127, 127).to(torch.int8)
        return codes, s
    codes, s = formats.quantize(x, code_dtype, groups=1 if gran == "token" else x.shape[-1] // formats.BLOCK)
    return codes, s.to(scale_dtype)


def quantized_cache(k_kind, v_kind, B, Hkv, L, D, seed, v_layout="head_dim"):
    """(k codes, k scales, v codes, v scales) from random K (std 2) and V (std 1), on DEV."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, Hkv, L, D, generator=gen) * 2
    v = torch.randn(B, Hkv, L, D, generator=gen)
    kc, ks = quantize(k, k_kind, gen)
    vc, vs = quantize(v, v_kind, gen)
    kc, ks, vs = kc.to(DEV), ks.to(DEV), vs.to(DEV)
    if v_layout == "keys":
        buf = v_codes_buffer((B, Hkv, L, D), vc.dtype, DEV, keys=True)
        buf.copy_(vc.to(DEV))
        vc = buf
        assert attn_mod.v_keys_contiguous(vc)
    else:
        vc = vc.to(DEV)
    return kc, ks, vc, vs


def make_q(B, Hq, Tq, D, seed, dtype=torch.float32, mult=1.0):
    gen = torch.Generator().manual_seed(seed + 1000)
    return (torch.randn(B, Hq, Tq, D, generator=gen) * mult).to(DEV).to(dtype)


def lengths(kv_len, B):
    return kv_len.reshape(-1).expand(B).tolist()


def run(q, cache, kv_len, mask=None, causal=False, window=0, softcap=0.0, sinks=None, tol=TOL, off=None,
        ref_cache=None):
    """Kernel vs the float64 reference; with ``off`` (a dict of arguments that switch the feature off),
    also assert the kernel's result without the feature is far from the reference with it."""
    out = kernels.attention(q, *cache, kv_len, mask, causal, None, window, softcap, sinks, **fmts_of(*cache))
    ref = reference.attention(q, *(ref_cache or cache), kv_len, mask, causal, None, window, softcap, sinks,
                              compute_dtype=torch.float64, **fmts_of(*ref_cache or cache))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any(), "NaN in the kernel's output"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    if off is not None:
        args = {**dict(window=window, softcap=softcap, sinks=sinks), **off}
        out_off = kernels.attention(q, *(ref_cache or cache), kv_len, mask, causal, None, args["window"],
                                    args["softcap"], args["sinks"], **fmts_of(*ref_cache or cache))
        moved = rel_err(out_off, ref)
        assert moved > OFF_MIN, f"the result without {sorted(off)} is as close as {moved:.3g}: the test cannot tell"
    return out, ref


# ---------------------------------------------------------------------------------------------
# the reference against a per-row float64 oracle written here
# ---------------------------------------------------------------------------------------------


def oracle(q, kc, ks, vc, vs, kv_len, mask, causal, scale, window=0, softcap=0.0, sinks=None):
    """float64 attention one (batch, head, query) at a time, straight from the contract."""
    B, Hq, Tq, D = q.shape
    Hkv, L = kc.shape[1], kc.shape[2]

    def deq(c, s):
        c = c.cpu().to(torch.float64)
        s = s.cpu().double()
        if s.dim() == 1:
            return c * s.view(1, -1, 1, 1)
        return c * s.repeat_interleave(D // s.shape[-1], dim=-1)

    k, v = deq(kc, ks), deq(vc, vs)
    sm = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, Hq, Tq, D, dtype=torch.float64)
    if mask is not None:
        mask = mask.cpu().expand(B, Hq, Tq, L)
    for b, n in enumerate(lengths(kv_len, B)):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Tq):
                p = n - Tq + i
                logits, vals = [], []
                for j in range(min(n, L)):
                    if causal and j > p:
                        continue
                    if window and not j > p - window:
                        continue
                    if mask is not None and mask.dtype == torch.bool and not mask[b, h, i, j]:
                        continue
                    s = float(q[b, h, i].cpu().double() @ k[b, hk, j]) * sm
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if mask is not None and mask.dtype != torch.bool:
                        s += float(mask[b, h, i, j])
                    if s == -math.inf:
                        continue
                    logits.append(s)
                    vals.append(v[b, hk, j])
                if not logits:
                    continue  # no visible key: zeros (sinks or not)
                m = max(logits + ([float(sinks[h])] if sinks is not None else []))
                w = [math.exp(s - m) for s in logits]
                den = sum(w) + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
                out[b, h, i] = sum(wi * vi for wi, vi in zip(w, vals)) / den
    return out


REF_CASES = [
    # (Tq, kv_len, causal, mask, window, softcap, sinks)
    (1, [13, 7], False, None, 5, 0.0, False),
    (4, [13, 9], True, None, 3, 0.0, False),
    (4, [13], False, "bool", 6, 2.0, True),
    (3, [12, 5], True, "add", 0, 1.5, False),
    (3, [13, 2], True, None, 0, 0.0, True),
    (5, [11], True, "bool", 1, 0.0, True),
]


@pytest.mark.parametrize("Tq,kv_len,causal,mask,window,softcap,sinks", REF_CASES)
def test_reference_matches_oracle(Tq, kv_len, causal, mask, window, softcap, sinks):
    B, Hkv, group, L, D = 2, 2, 2, 13, 32
    cache = [t.cpu() for t in quantized_cache("fp8", "int8", B, Hkv, L, D, seed=Tq)]
    q = make_q(B, Hkv * group, Tq, D, seed=Tq).cpu()
    gen = torch.Generator().manual_seed(5)
    m = None
    if mask == "bool":
        m = torch.rand(B, 1, Tq, L, generator=gen) > 0.3
        m[0, 0, 0] = False  # a row with no visible key: zeros, with sinks too
    elif mask == "add":
        m = torch.randn(B, 1, Tq, L, generator=gen)
        m[..., 2] = -math.inf
    sk = torch.randn(Hkv * group, generator=gen) if sinks else None
    kvl = torch.tensor(kv_len[0]) if len(kv_len) == 1 else torch.tensor(kv_len)
    want = oracle(q, *cache, kvl, m, causal, None, window, softcap, sk)
    for dtype in (torch.float64, torch.float32):  # (the output comes in q's dtype)
        got = reference.attention(q.to(dtype), *cache, kvl, m, causal, None, window, softcap, sk, compute_dtype=dtype, **fmts_of(*cache))
        tol = 1e-12 if dtype == torch.float64 else 2e-6  # fp32: O(16) sums of O(1) terms
        assert (got.double() - want).abs().max() < tol
    if mask == "bool":
        assert (got[0, :, 0] == 0).all()


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op, output shapes) of every op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and not _views_the_e4m3_table(t)]
        self.seen.append((str(func), shapes))
        return out


def _views_the_e4m3_table(t: torch.Tensor) -> bool:
    """A view of formats' 256-entry e4m3 value table (the CPU's fp8 decode looks codes up in it): a
    constant, whose 256 entries are code values, not cache positions."""
    table = formats._E4M3_TABLE.get("cpu")
    return table is not None and t.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()


@pytest.mark.parametrize("Tq,window,mask", [(1, 0, False), (6, 0, True), (1, 9, False), (6, 9, True)])
def test_reference_cost_does_not_depend_on_max_cache_len(Tq, window, mask):
    """The same stored tokens (20 and 17 of them) in caches of 32 and of 4096 positions: the
    reference runs the same ops on tensors of the same shapes, and no tensor spans more positions
    than are stored (with a window: than some query's window can see)."""
    B, Hkv, group, D, n = 2, 2, 2, 8, 20  # every other dim (D, group * Tq, B, H) stays below the bound
    small = [t.cpu() for t in quantized_cache("fp8", "fp8", B, Hkv, 32, D, seed=1)]
    big = [torch.zeros((B, Hkv, 4096) + t.shape[3:], dtype=t.dtype) for t in small]
    for s, b in zip(small, big):
        b[:, :, :32] = s
    q = make_q(B, Hkv * group, Tq, D, seed=1).cpu()
    kv_len = torch.tensor([n, n - 3])
    reference.attention(q, *small, kv_len, None, True, None, window, **fmts_of(*small))  # lazily built tables (e4m3's): not per call
    runs = []
    for cache in (small, big):
        L = cache[0].shape[2]
        m = (torch.arange(L) % 3 != 0).expand(B, 1, Tq, L) if mask else None
        with _Shapes() as rec:
            out = reference.attention(q, *cache, kv_len, m, True, None, window, **fmts_of(*cache))
        runs.append((rec.seen, out))
    assert runs[0][0] == runs[1][0], "the reference's work depends on max_cache_len"
    assert torch.equal(runs[0][1], runs[1][1])
    # keys [lo, n): lo the first key query 0 of the shorter row sees
    bound = n - (max(n - 3 - Tq - window + 1, 0) if window else 0)
    assert bound < n or not window
    widest = max(d for _, shapes in runs[1][0] for s in shapes for d in s)
    assert widest <= bound, f"a tensor spans {widest} positions; only {bound} can be visible"


# ---------------------------------------------------------------------------------------------
# the op: arguments, checks, opcheck
# ---------------------------------------------------------------------------------------------


def test_op_schema_has_the_new_arguments_with_defaults():
    schema = str(OPS.attention.default._schema)
    for arg in ("sliding_window=0", "softcap=0.", "Tensor? sinks=None"):
        assert arg in schema, schema


@pytest.mark.parametrize("k_kind,v_kind", [("fp8", "int8"), ("int8", "int8"), ("q8_0", "fp8-b32")])
def test_opcheck_attention_features(k_kind, v_kind, fp8_safe_schema_check, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_KERNELS", "reference")
    cache = [t.cpu() for t in quantized_cache(k_kind, v_kind, 2, 2, 16, 64, seed=3)]
    q = torch.randn(2, 4, 3, 64)
    sinks = torch.randn(4)
    for args in ((torch.tensor(9), None, True, None, 5, 0.0, None),
                 (torch.tensor([9, 6]), None, False, 0.3, 0, 2.0, sinks),
                 (torch.tensor(16), torch.rand(2, 1, 3, 16) > 0.3, True, None, 4, 3.0, sinks)):
        torch.library.opcheck(OPS.attention.default, (q, *cache, *args), ids_of(*cache))


def test_op_rejects_bad_window_softcap_sinks():
    cache = [t.cpu() for t in quantized_cache("fp8", "fp8", 1, 2, 8, 64, seed=0)]
    q = torch.randn(1, 4, 1, 64)
    kvl = torch.tensor(8)
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        OPS.attention(q, *cache, kvl, None, False, None, -1, **ids_of(*cache))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
            OPS.attention(q, *cache, kvl, None, False, None, 0, bad, **ids_of(*cache))
    for bad in (torch.zeros(3), torch.zeros(4, 1), torch.zeros(4, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"sinks must be a floating tensor \[Hq=4\]"):
            OPS.attention(q, *cache, kvl, None, False, None, 0, 0.0, bad, **ids_of(*cache))
    # and at trace time (the fake): the same message before any kernel runs
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fc = mode.from_tensor(q), [mode.from_tensor(t) for t in cache]
        with pytest.raises(ValueError, match="sliding_window must be >= 0"):
            OPS.attention(fq, *fc, mode.from_tensor(kvl), None, False, None, -4, **ids_of(*fc))


def test_op_features_dispatch_to_triton(monkeypatch):
    monkeypatch.setenv("KVCOMPILE_KERNELS", "triton")
    cache = quantized_cache("fp8", "int8", 2, 2, 40, 64, seed=4, v_layout="keys")
    q = make_q(2, 4, 1, 64, seed=4)
    sinks = torch.randn(4, device=DEV)
    kvl = torch.tensor([40, 23], device=DEV)
    out = OPS.attention(q, *cache, kvl, None, False, None, 13, 2.5, sinks, **ids_of(*cache))
    ref = reference.attention(q, *cache, kvl, None, False, None, 13, 2.5, sinks, compute_dtype=torch.float64, **fmts_of(*cache))
    assert rel_err(out, ref) < TOL


# ---------------------------------------------------------------------------------------------
# sliding window
# ---------------------------------------------------------------------------------------------

WINDOW_CASES = [
    # (Tq, causal, mask, kv_len, window, V layout): odd lengths, windows off the 16-key tile
    (1, False, None, [100, 61], 21, "head_dim"),  # decode, split-K
    (1, False, None, [100, 61], 21, "keys"),
    (1, True, None, [100, 30], 37, "keys"),  # second row shorter than the window: it hides nothing there
    (1, False, None, [77], 1, "head_dim"),  # the query sees its own key only
    (5, True, None, [97, 64], 19, "head_dim"),  # speculative verification over a window
    (5, True, None, [97, 64], 19, "keys"),
    (16, True, None, [98], 20, "keys"),  # decode path, two query blocks: a split can lie below the second's window
    (24, True, None, [100, 71], 21, "head_dim"),  # fused prefill: partial, full and causal tiles
    (24, True, None, [100, 71], 21, "keys"),
    (24, False, None, [100, 71], 33, "keys"),  # window without causal: an upper bound of kv_len only
    (24, True, "bool", [100, 71], 21, "head_dim"),  # with a user mask every tile is masked
    (1, False, "add", [100, 61], 21, "keys"),
]


@pytest.mark.parametrize("Tq,causal,mask,kv_len,window,v_layout", WINDOW_CASES)
def test_window(Tq, causal, mask, kv_len, window, v_layout):
    B, Hkv, group, L, D = len(kv_len), 1 if Tq == 16 else 2, 4 if Tq == 16 else 2, 100, 64
    cache = quantized_cache("fp8", "fp8", B, Hkv, L, D, seed=Tq + window, v_layout=v_layout)
    q = make_q(B, Hkv * group, Tq, D, seed=Tq)
    kvl = torch.tensor(kv_len, device=DEV) if B > 1 else torch.tensor(kv_len[0], device=DEV)
    m = None
    gen = torch.Generator().manual_seed(9)
    if mask == "bool":
        m = (torch.rand(B, 1, Tq, L, generator=gen) > 0.2).to(DEV)
    elif mask == "add":
        m = torch.randn(B, Hkv * group, Tq, L, generator=gen).to(DEV)
    run(q, cache, kvl, m, causal, window=window, off=dict(window=0))


@pytest.mark.parametrize("Tq,causal", [(1, False), (5, True), (24, True)], ids=["decode", "spec5", "prefill"])
def test_window_skips_tiles_below_it(Tq, causal):
    """Codes and scales of every tile wholly below the window's first tile are NaN: a kernel that
    read any of them (masked or not; V head_dim-contiguous, where 0 * NaN stays NaN) would return
    NaN. And the decode launch plans its splits for the window's span, not the cache's length."""
    B, Hkv, group, L, D, window = 2, 2, 2, 400, 64, 23
    kv_len = [400, 300]  # whole tiles lie below the window for the GPU's 128-key tiles too
    cache = quantized_cache("fp8", "fp8", B, Hkv, L, D, seed=Tq)
    q = make_q(B, Hkv * group, Tq, D, seed=Tq)
    kvl = torch.tensor(kv_len, device=DEV)
    p = attn_mod.plan_of(attn_mod.call_of(q, *cache, is_causal=causal, decode=Tq <= attn_mod.DECODE_MAX_Q,
                                          window=window, **fmts_of(*cache)))
    block_n = p.tile.block_n
    if p.call.decode:  # splits cover the window's span (it ends a tile past query 0's first key), not the cache
        span = window + Tq - 1 + block_n - 1
        assert (p.splits - 1) * p.split_len < span <= p.splits * p.split_len, "decode splits planned for the cache"
    kc, ks, vc, vs = (t.clone() for t in cache)
    for b, n in enumerate(kv_len):
        below = max(n - Tq - window + 1, 0) // block_n * block_n  # the first tile a query can see
        assert below > 0
        kc.view(torch.uint8)[b, :, :below] = 0x7F
        vc.view(torch.uint8)[b, :, :below] = 0x7F
        ks[b, :, :below] = float("nan")
        vs[b, :, :below] = float("nan")
    run(q, (kc, ks, vc, vs), kvl, None, causal, window=window, ref_cache=cache)


def test_window_decode_splits_below_the_window_exit():
    """Decode with 16 queries in two query blocks (the interpreter's 32-row tile, 4 heads per kv
    head) and 16-key splits from the window of query 0: with kv_len 98 the first split lies wholly
    below the second block's window. Its programs exit, and the merge must skip the split for those
    rows (an unwritten LSE would be garbage), while the first block's rows use it."""
    B, Hkv, group, L, D, window = 1, 1, 4, 120, 64, 20
    cache = quantized_cache("fp8", "fp8", B, Hkv, L, D, seed=11)
    q = make_q(B, Hkv * group, 16, D, seed=11)
    kvl = torch.tensor(98, device=DEV)
    for _ in range(2):  # the partial outputs hold garbage from the first run on the second
        run(q, cache, kvl, None, True, window=window, off=dict(window=0))


@pytest.mark.parametrize("case", ["extend-window", "ragged-window-mask", "window-hides-nothing"])
def test_dense_path_window(case, monkeypatch):
    """The dense path expresses the window in SDPA's mask and dequantizes only the keys some query
    can see."""
    monkeypatch.setenv("KVCOMPILE_PREFILL", "dense")
    got = []
    real = dense_mod.dequantize_kv
    monkeypatch.setattr(dense_mod, "dequantize_kv", lambda *a, **kw: (got.append(a[5]), real(*a, **kw))[1])
    B, Hkv, group, L, D = 2, 2, 2, 60, 64
    cache = quantized_cache("fp8", "fp8", B, Hkv, L, D, seed=5, v_layout="keys")
    q = make_q(B, Hkv * group, 20, D, seed=5)
    if case == "extend-window":
        kvl, window, m = torch.tensor(57, device=DEV), 13, None
        run(q, cache, kvl, m, True, window=window, off=dict(window=0))
        assert got[0] == 57 - (57 - 20 - 13 + 1)  # keys [25, 57) only
    elif case == "ragged-window-mask":
        kvl, window = torch.tensor([57, 44], device=DEV), 17
        m = (torch.rand(B, 1, 20, L, generator=torch.Generator().manual_seed(2)) > 0.2).to(DEV)
        run(q, cache, kvl, m, True, window=window, off=dict(window=0))
        assert got[0] == 57 - (44 - 20 - 17 + 1)
    else:  # every query sits below the window: the fast unmasked SDPA call, all keys
        kvl, window = torch.tensor(30, device=DEV), 40
        run(q, cache, kvl, None, True, window=window)
        assert got[0] == 30


def test_prefill_path_routes_features(monkeypatch):
    q = torch.empty(1, 1, 32, 64, device=DEV)
    monkeypatch.setenv("KVCOMPILE_PREFILL", "dense")
    assert attn_mod.prefill_path(q, window_hides=True) == "dense"  # forced: the window goes into SDPA's mask
    assert attn_mod.prefill_path(q, dense_ok=False) == "fused"  # softcap / sinks: SDPA has neither
    assert attn_mod.prefill_path(q[:, :, :1], dense_ok=False) == "decode"


# ---------------------------------------------------------------------------------------------
# softcap and sinks
# ---------------------------------------------------------------------------------------------

FEATURE_CASES = [
    # (Tq, causal, kv_len, Hkv, mask): split-K decode (several splits), unsplit decode (8 programs
    # fill the interpreter's 4 SMs x 2: one split), spec decode, fused prefill, masks
    (1, False, [45, 30], 2, None),
    (1, False, [45, 30, 17, 44], 2, None),
    (5, True, [45, 30], 2, None),
    (20, True, [45, 30], 2, None),
    (20, True, [45, 30], 2, "add"),
    (1, False, [45, 30], 2, "bool"),
]


def _mask(kind, B, Hq, Tq, L, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "bool":
        m = torch.rand(B, 1, Tq, L, generator=gen) > 0.3
        m[0, :, 0] = False  # a row with no visible key: zeros, with sinks too
        return m.to(DEV)
    if kind == "add":
        return (torch.randn(B, Hq, Tq, L, generator=gen) * 2).to(DEV)
    return None


@pytest.mark.parametrize("Tq,causal,kv_len,Hkv,mask", FEATURE_CASES)
def test_softcap(Tq, causal, kv_len, Hkv, mask):
    """q scaled up (logits of std ~8) so both caps bend them: tanh is nowhere near linear."""
    B, group, L, D = len(kv_len), 2, 45, 64
    cache = quantized_cache("fp8", "fp8", B, Hkv, L, D, seed=Tq, v_layout="keys")
    q = make_q(B, Hkv * group, Tq, D, seed=Tq, mult=4.0)
    m = _mask(mask, B, Hkv * group, Tq, L, seed=Tq)
    softcap = 2.0 if Tq % 2 else 13.0  # a hard cap and one that bends the largest logits only
    out, _ = run(q, cache, torch.tensor(kv_len, device=DEV), m, causal, softcap=softcap, off=dict(softcap=0.0))
    if mask == "bool":
        assert (out[0, :, 0] == 0).all()


@pytest.mark.parametrize("Tq,causal,kv_len,Hkv,mask", FEATURE_CASES)
def test_sinks(Tq, causal, kv_len, Hkv, mask):
    """Sinks of std 3 around the logits' scale: they take a large share of the denominator."""
    B, group, L, D = len(kv_len), 2, 45, 64
    cache = quantized_cache("fp8", "fp8", B, Hkv, L, D, seed=Tq + 1)
    q = make_q(B, Hkv * group, Tq, D, seed=Tq + 1)
    sinks = (torch.randn(Hkv * group, generator=torch.Generator().manual_seed(7)) * 3 + 2).to(DEV)
    m = _mask(mask, B, Hkv * group, Tq, L, seed=Tq)
    out, _ = run(q, cache, torch.tensor(kv_len, device=DEV), m, causal, sinks=sinks, off=dict(sinks=None))
    if mask == "bool":
        assert (out[0, :, 0] == 0).all()


def test_sinks_split_and_unsplit_decode_agree():
    """The sink joins the denominator once per row: in the merge when the cache is split, in the
    epilogue when it is not. Both give the reference's answer."""
    B, Hkv, group, L, D = 2, 2, 4, 400, 64  # 400 keys: two splits of the GPU's 128-key tile too
    cache = quantized_cache("int8", "int8", B, Hkv, L, D, seed=3, v_layout="keys")
    q = make_q(B, Hkv * group, 1, D, seed=3)
    sinks = torch.linspace(-2, 4, Hkv * group).to(DEV)
    kvl = torch.tensor([400, 190], device=DEV)
    for forced in (1, 2):
        with plan_mod.override(splits=forced):
            assert attn_mod.plan_of(attn_mod.call_of(q, *cache, sinks=sinks, **fmts_of(*cache))).splits == forced
            run(q, cache, kvl, None, False, sinks=sinks, off=dict(sinks=None))


@pytest.mark.parametrize("v_layout", ["head_dim", "keys"], ids=["v-d", "v-keys"])
@pytest.mark.parametrize("Tq", [1, 20])
def test_window_softcap_sinks_together(Tq, v_layout):
    B, Hkv, group, L, D = 2, 2, 2, 70, 64
    cache = quantized_cache("fp8", "int8", B, Hkv, L, D, seed=Tq, v_layout=v_layout)
    q = make_q(B, Hkv * group, Tq, D, seed=Tq, mult=3.0)
    sinks = torch.randn(Hkv * group, generator=torch.Generator().manual_seed(1)).to(DEV)
    kvl = torch.tensor([70, 47], device=DEV)
    run(q, cache, kvl, None, True, window=27, softcap=5.0, sinks=sinks,
        off=dict(window=0, softcap=0.0, sinks=None))


@pytest.mark.parametrize("Tq", [1, 20])
@pytest.mark.parametrize("kinds", [("fp8", "fp8"), ("int8", "int8"), ("q8_0", "q8_0")], ids=["fp8", "int8", "q8_0"])
def test_features_fp16_dot_path(Tq, kinds, fp16_dots):
    """The GPU's fp16 dots (int8 magic conversion, P * s_v / max s_v for token scales), run by the
    interpreter: window, softcap and sinks together."""
    B, Hkv, group, L, D = 2, 2, 2, 45, 64
    cache = quantized_cache(*kinds, B, Hkv, L, D, seed=2, v_layout="keys" if kinds[0] != "q8_0" else "head_dim")
    q = make_q(B, Hkv * group, Tq, D, seed=2, mult=3.0)
    sinks = torch.randn(Hkv * group, generator=torch.Generator().manual_seed(2)).to(DEV)
    run(q, cache, torch.tensor([45, 30], device=DEV), None, Tq > 1, window=19, softcap=4.0, sinks=sinks,
        tol=FP16_TOL, off=dict(window=0, softcap=0.0, sinks=None))


# ---------------------------------------------------------------------------------------------
# int8 token codes, and K and V of different code types
# ---------------------------------------------------------------------------------------------

PAIRS = [("int8", "int8"), ("fp8", "int8"), ("int8", "fp8"), ("q8_0", "fp8-b32"), ("fp8-b32", "q8_0")]
PAIR_IDS = ["int8", "fp8K-int8V", "int8K-fp8V", "q8_0K-fp8b32V", "fp8b32K-q8_0V"]


# token scales in both V layouts; block32 in the head_dim layout QuantizedCache gives it
CODE_CASES = ([(kinds, layout) for kinds in PAIRS[:3] for layout in ("head_dim", "keys")]
              + [(kinds, "head_dim") for kinds in PAIRS[3:]])
CODE_IDS = [f"{PAIR_IDS[PAIRS.index(k)]}-v-{'d' if lay == 'head_dim' else 'keys'}" for k, lay in CODE_CASES]


@pytest.mark.parametrize("kinds,v_layout", CODE_CASES, ids=CODE_IDS)
@pytest.mark.parametrize("Tq,causal", [(1, False), (24, True)], ids=["decode", "prefill"])
def test_code_types(kinds, v_layout, Tq, causal):
    B, Hkv, group, L, D = 2, 2, 2, 40, 64
    cache = quantized_cache(*kinds, B, Hkv, L, D, seed=Tq, v_layout=v_layout)
    q = make_q(B, Hkv * group, Tq, D, seed=Tq)
    run(q, cache, torch.tensor([37, 29], device=DEV), None, causal)


@pytest.mark.parametrize("kinds", PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("Tq", [1, 20])
def test_code_types_fp16_dot_path(kinds, Tq, fp16_dots):
    B, Hkv, group, L, D = 2, 2, 2, 45, 64
    cache = quantized_cache(*kinds, B, Hkv, L, D, seed=Tq, v_layout="keys")
    q = make_q(B, Hkv * group, Tq, D, seed=Tq)
    run(q, cache, torch.tensor([45, 30], device=DEV), None, Tq > 1, tol=FP16_TOL)


@pytest.mark.parametrize("kinds", PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("Tq", [1, 20])
def test_int8_bias_is_exact(kinds, Tq, fp16_dots, monkeypatch):
    """With fp16 dots a plan may widen each int8 side to 1152 + code and correct the product instead
    (``plan.int8_bias``, planned for decode tiles: the scores by 1152 sum(q) per row, the PV product by
    1152 rowsum(P)); forced on here for the prefill kernel too. The result equals the exact widening's (``int8_bias=False``) up to fp32 rounding of the biased sums,
    which are 10-20x the unbiased ones here (1152 sum(q) against q . k): an fp32 ulp of them moves a
    logit by ~1e-5, measured 2e-5 relative at most; 1e-4 bounds it, 50x under FP16_TOL (the fp16
    path's own error), so a wrong correction cannot pass."""
    B, Hkv, group, L, D = 2, 2, 2, 45, 64
    cache = quantized_cache(*kinds, B, Hkv, L, D, seed=Tq, v_layout="keys")
    q = make_q(B, Hkv * group, Tq, D, seed=Tq, mult=2.0, dtype=torch.float32 if DEV == "cpu" else torch.float16)
    kv_len = torch.tensor([45, 30], device=DEV)
    seen, orig = [], attn_mod.plan_of
    monkeypatch.setattr(attn_mod, "plan_of", lambda call: seen.append(orig(call)) or seen[-1])
    with plan_mod.override(int8_bias=True, int8_mma=False):  # K widened (int8 MMAs score it unwidened)
        biased = kernels.attention(q, *cache, kv_len, None, Tq > 1, None, **fmts_of(*cache))
    assert (seen[-1].k_bias, seen[-1].v_bias) == (kinds[0] == "int8", kinds[1] == "int8")
    with plan_mod.override(int8_bias=False, int8_mma=False):
        exact = kernels.attention(q, *cache, kv_len, None, Tq > 1, None, **fmts_of(*cache))
    assert not (seen[-1].k_bias or seen[-1].v_bias)
    # GPU: fp16 outputs, where a value moved by 1e-5 may round one ulp (4.9e-4) the other way
    assert rel_err(biased, exact) < (1e-4 if DEV == "cpu" else 1e-3)
    ref = reference.attention(q, *cache, kv_len, None, Tq > 1, None, compute_dtype=torch.float64, **fmts_of(*cache))
    assert rel_err(biased, ref) < FP16_TOL


def test_code_types_dense_path(monkeypatch):
    monkeypatch.setenv("KVCOMPILE_PREFILL", "dense")
    for kinds in (("fp8", "int8"), ("int8", "int8")):
        cache = quantized_cache(*kinds, 2, 2, 40, 64, seed=1, v_layout="keys")
        q = make_q(2, 4, 20, 64, seed=1)
        run(q, cache, torch.tensor([40, 29], device=DEV), None, True)


def test_int8_token_v_past_the_length_needs_no_clearing():
    """int8 has no NaN code: the most negative code fills V past kv_len (and the key-contiguous
    buffer's padding); p = 0 there, so the result is the reference's on the clean cache."""
    B, Hkv, group, L, D = 2, 2, 2, 40, 64
    cache = quantized_cache("int8", "int8", B, Hkv, L, D, seed=6, v_layout="keys")
    kc, ks, vc, vs = cache
    clean = vc.clone()
    root = vc._base.transpose(2, 3)  # [B, H, L16, D]
    for b, n in enumerate([37, 21]):
        root[b, :, n:] = -128
        clean[b, :, n:] = 0
    q = make_q(B, Hkv * group, 1, D, seed=6)
    run(q, (kc, ks, vc, vs), torch.tensor([37, 21], device=DEV), None, False, ref_cache=(kc, ks, clean, vs))


# (kinds, V layout, Tq, mask, window, softcap, sinks): every way a split's one tile is cut
ONE_TILE_CASES = [
    (("fp8", "fp8"), "keys", 1, None, 0, 0.0, False),  # kv_len inside the last split's tile
    (("int8", "int8"), "keys", 1, None, 27, 5.0, True),  # a window's edge inside a tile, softcap, sinks
    (("q8_0", "q8_0"), "head_dim", 4, "bool", 0, 0.0, False),  # causal rows (spec decode), a user mask
    (("fp8", "int8"), "keys", 1, "add", 0, 0.0, False),
]


@pytest.mark.parametrize("kinds,v_layout,Tq,mask,window,softcap,sinks", ONE_TILE_CASES,
                         ids=["fp8", "int8-window-softcap-sinks", "q8_0-causal-mask", "fp8K-int8V-add"])
def test_one_tile_splits(kinds, v_layout, Tq, mask, window, softcap, sinks):
    """Decode splits of one key tile each (``LaunchPlan.one_tile``): the kernel reads the tile before q's
    prologue and scores it on the masked path, which has to serve whatever cuts the tile (the length,
    a window's edge, causal rows, a user mask). The float64 reference's answer, the same answer the
    loops give (``preload`` off); with a window, softcap and sinks on, the answer without them told apart."""
    B, Hkv, group, D = 2, 2, 2, 64
    L = 70 if DEV == "cpu" else 300  # a few tiles of the interpreter's 16 keys or of the GPU's 128
    cache = quantized_cache(*kinds, B, Hkv, L, D, seed=Tq + window, v_layout=v_layout)
    q = make_q(B, Hkv * group, Tq, D, seed=Tq + window, mult=3.0)
    m = _mask(mask, B, Hkv * group, Tq, L, seed=Tq)
    s = torch.randn(Hkv * group, generator=torch.Generator().manual_seed(2)).to(DEV) if sinks else None
    kvl = torch.tensor([L, L - 27], device=DEV)
    off = dict(window=0, softcap=0.0, sinks=None) if window else None  # the features on: each turned off
    call = attn_mod.call_of(q, *cache, m, Tq > 1, window=window, softcap=softcap, sinks=s, **fmts_of(*cache))
    with plan_mod.override(splits=64):  # as many splits as tiles: one tile each
        p = attn_mod.plan_of(call)
        assert p.one_tile and p.splits > 1 and p.constexprs()["ONE_TILE"], p.describe()
        out, ref = run(q, cache, kvl, m, Tq > 1, window, softcap, s, off=off)
        with plan_mod.override(preload=False):
            assert not attn_mod.plan_of(call).one_tile
            loops = kernels.attention(q, *cache, kvl, m, Tq > 1, None, window, softcap, s, **fmts_of(*cache))
    assert rel_err(loops, ref) < TOL and rel_err(out, loops) < TOL


# ---------------------------------------------------------------------------------------------
# GPU: the same features at Llama-3-8B head shapes, bf16 queries, the real tiles (128 keys)
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_KINDS = [("fp8", "fp8"), ("q8_0", "q8_0"), ("int8", "int8"), ("fp8", "int8"), ("int8", "fp8")]
GPU_KIND_IDS = ["fp8", "q8_0", "int8", "fp8K-int8V", "int8K-fp8V"]


def _gpu_case(kinds, Tq, seed, B=3, L=5000):
    layout = "head_dim" if "q8_0" in kinds else "keys"  # as QuantizedCache lays V out
    cache = quantized_cache(*kinds, B, 8, L, 128, seed=seed, v_layout=layout)
    q = make_q(B, 32, Tq, 128, seed=seed, dtype=torch.bfloat16, mult=2.0)
    return q, cache


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kinds", GPU_KINDS, ids=GPU_KIND_IDS)
@pytest.mark.parametrize("Tq", [1, 8, 300])
@pytest.mark.parametrize("window", [1000, 4095])
def test_gpu_window(kinds, Tq, window):
    q, cache = _gpu_case(kinds, Tq, seed=Tq)
    kvl = torch.tensor([5000, 1517, 4301], device=DEV)
    run(q, cache, kvl, None, True, window=window, tol=BF16_TOL, off=dict(window=0))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kinds", GPU_KINDS, ids=GPU_KIND_IDS)
@pytest.mark.parametrize("L,window", [(1024, 0), (4096, 0), (4096, 1000)])
def test_gpu_one_tile_decode(kinds, L, window):
    """B=1 over a short cache (or a window of it): the plan's splits are one tile each, read before q's
    prologue (int8 K by int8 MMAs there). The reference's answer, through the loops too."""
    q, cache = _gpu_case(kinds, 1, seed=L + window, B=1, L=L)
    kvl = torch.tensor([L - 37], device=DEV)
    call = attn_mod.call_of(q, *cache, window=window, **fmts_of(*cache))
    p = attn_mod.plan_of(call)
    assert p.one_tile and p.k_mma == (kinds[0] == "int8"), p.describe()
    out, ref = run(q, cache, kvl, None, False, window=window, tol=BF16_TOL, off=dict(window=0) if window else None)
    with plan_mod.override(preload=False):
        assert not attn_mod.plan_of(call).one_tile
        loops = kernels.attention(q, *cache, kvl, None, False, None, window, **fmts_of(*cache))
    assert rel_err(loops, ref) < BF16_TOL


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kinds", GPU_KINDS, ids=GPU_KIND_IDS)
@pytest.mark.parametrize("Tq", [1, 8, 300])
def test_gpu_softcap_sinks(kinds, Tq):
    q, cache = _gpu_case(kinds, Tq, seed=Tq + 1)
    kvl = torch.tensor([5000, 1517, 4301], device=DEV)
    # logits of std ~4 over ~5000 keys: log of the denominator ~ log(5000) + 4^2 / 2 ~ 16.5, so
    # sinks near 15 take a real share of it
    sinks = (torch.randn(32, generator=torch.Generator().manual_seed(3)) * 2 + 15).to(DEV)
    run(q, cache, kvl, None, True, softcap=10.0, off=dict(softcap=0.0), tol=BF16_TOL)
    run(q, cache, kvl, None, True, sinks=sinks, off=dict(sinks=None), tol=BF16_TOL)
    run(q, cache, kvl, None, True, window=777, softcap=10.0, sinks=sinks, tol=BF16_TOL,
        off=dict(window=0, softcap=0.0, sinks=None))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["fused", "dense"])
def test_gpu_window_prefill_paths(path, monkeypatch):
    """A 2048-token prefill at the end of a 6k cache with a 1024 window, by both prefill paths
    (dense: the window in SDPA's mask, only the visible keys dequantized)."""
    monkeypatch.setenv("KVCOMPILE_PREFILL", path)
    q, cache = _gpu_case(("fp8", "fp8"), 2048, seed=5, B=1, L=6144)
    run(q, cache, torch.tensor(6000, device=DEV), None, True, window=1024, tol=BF16_TOL, off=dict(window=0))


@pytest.mark.gpu
@needs_cuda
def test_gpu_window_decode_in_cuda_graph():
    """Decode with a window is graph safe: capture once, move kv_len on the device, replay."""
    q, cache = _gpu_case(("fp8", "fp8"), 1, seed=7, B=2, L=8192)
    kvl = torch.tensor([100, 200], device=DEV)
    sinks = torch.randn(32, device=DEV)
    kernels.attention(q, *cache, kvl, None, False, None, 1000, 30.0, sinks, **fmts_of(*cache))  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kernels.attention(q, *cache, kvl, None, False, None, 1000, 30.0, sinks, **fmts_of(*cache))
    for lens in ([100, 200], [8192, 1], [5000, 1001], [1000, 7777]):
        kvl.copy_(torch.tensor(lens))
        g.replay()
        ref = reference.attention(q, *cache, kvl, None, False, None, 1000, 30.0, sinks, compute_dtype=torch.float64, **fmts_of(*cache))
        assert rel_err(out, ref) < BF16_TOL, lens


@pytest.mark.parametrize("kinds", PAIRS[:3:2], ids=PAIR_IDS[:3:2])
@pytest.mark.parametrize("Tq,D", [(1, 64), (1, 96), (20, 64), (1, 32), (1, 256)])
def test_int8_k_mma(kinds, Tq, D, fp16_dots, monkeypatch):
    """int8 K scored unwidened on the int8 tensor cores (``plan.int8_mma``): the prologue splits q into
    two int8 halves, q = t (254 hi + lo) to within t / 2, t = 2^-15 of the block's largest |q|, and the
    two int32 dots sum exactly. Heads of very different sizes share a block (one per program, 80x
    apart here): the small head is held to the reference too.

    Tolerance: the q halves are finer than the fp16 q they replace (the kernel's output is measured
    2.2e-4 from the float64 reference on the CPU, the fp16 widening's 4.7e-4), so FP16_TOL / 5 holds on
    the CPU; on the GPU a bf16 output's own rounding (2^-9) takes FP16_TOL. The high half alone (lo
    dropped) is measured 0.8-1.7e-2 away: both bounds tell it apart."""
    B, Hkv, group, L = 2, 2, 4, 45
    cache = quantized_cache(*kinds, B, Hkv, L, D, seed=Tq + D, v_layout="keys")
    q_dtype = torch.float32 if DEV == "cpu" else torch.bfloat16  # GPU: a 16-bit q (fp32 q takes fp32 dots)
    q = make_q(B, Hkv * group, Tq, D, seed=Tq + D, mult=3.0, dtype=q_dtype)
    q = q * torch.tensor([1.0, 1 / 80, 0.5, 2.0] * Hkv, device=DEV, dtype=q.dtype).view(1, -1, 1, 1)
    kv_len = torch.tensor([45, 30], device=DEV)
    seen, orig = [], attn_mod.plan_of
    monkeypatch.setattr(attn_mod, "plan_of", lambda call: seen.append(orig(call)) or seen[-1])
    with plan_mod.override(int8_mma=True):
        out = kernels.attention(q, *cache, kv_len, None, Tq > 1, None, **fmts_of(*cache))
    assert seen[-1].k_mma and seen[-1].constexprs()["K_MMA"] and not seen[-1].k_bias, seen[-1].describe()
    ref = reference.attention(q, *cache, kv_len, None, Tq > 1, None, compute_dtype=torch.float64, **fmts_of(*cache))
    tol = FP16_TOL / 5 if DEV == "cpu" else FP16_TOL
    assert rel_err(out, ref) < tol
    small = slice(1, None, group)  # the heads 80x below the block's largest
    assert rel_err(out[:, small], ref[:, small]) < tol


def test_int8_k_mma_query_halves_at_their_extremes(fp16_dots):
    """q's int8 halves at the ends of their range: every row holds the block's largest |q| (hi = +-127)
    and values half a step of hi apart from it, so the remainder the low half rounds sits at half a
    step too (lo = +-127). The prologue rounds both without a clamp; a half that wrapped to -128 would
    be off by more than the whole low half, which alone is measured 0.8-1.7e-2 away
    (``test_int8_k_mma``), far outside the tolerance (that test's, for the same reason)."""
    B, Hkv, group, L, D = 1, 2, 4, 40, 64
    cache = quantized_cache("int8", "int8", B, Hkv, L, D, seed=11, v_layout="keys")
    amax = 3.0
    steps = torch.arange(D, dtype=torch.float64) - D // 2 + 0.5  # k + 1/2 steps of hi: ties of its rounding
    q = (amax / 127 * steps).repeat(B, Hkv * group, 1, 1)
    q = q * torch.tensor([1.0, -1.0] * (Hkv * group // 2), dtype=torch.float64).view(1, -1, 1, 1)
    q[..., 0] = amax
    q[:, 1::2, :, 1] = -amax
    q_dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    q = q.to(DEV, q_dtype)
    kv_len = torch.tensor([40], device=DEV)
    with plan_mod.override(int8_mma=True):
        assert attn_mod.plan_of(attn_mod.call_of(q, *cache, **fmts_of(*cache))).k_mma
        out = kernels.attention(q, *cache, kv_len, None, False, None, **fmts_of(*cache))
    ref = reference.attention(q, *cache, kv_len, None, False, None, compute_dtype=torch.float64, **fmts_of(*cache))
    assert rel_err(out, ref) < (FP16_TOL / 5 if DEV == "cpu" else FP16_TOL)


@pytest.mark.parametrize("Tq", [1, 20])
def test_int8_k_mma_with_window_softcap_sinks(Tq, fp16_dots):
    """The scores of int8 MMAs through the masked window-edge, interior and tail loops, softcap and
    sinks: the reference's answer, and each feature's absence is told apart."""
    B, Hkv, group, L, D = 2, 2, 2, 70, 64
    cache = quantized_cache("int8", "int8", B, Hkv, L, D, seed=Tq + 3, v_layout="keys")
    q_dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    q = make_q(B, Hkv * group, Tq, D, seed=Tq + 3, mult=3.0, dtype=q_dtype)
    sinks = torch.randn(Hkv * group, generator=torch.Generator().manual_seed(3)).to(DEV)
    with plan_mod.override(int8_mma=True):
        assert attn_mod.plan_of(attn_mod.call_of(q, *cache, window=27, softcap=5.0, sinks=sinks, **fmts_of(*cache))).k_mma
        run(q, cache, torch.tensor([70, 47], device=DEV), None, Tq > 1, window=27, softcap=5.0, sinks=sinks,
            tol=FP16_TOL, off=dict(window=0, softcap=0.0, sinks=None))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_int8_k_mma_nonfinite_query(bad, fp16_dots):
    """A NaN or an infinity in q (no int8 holds either): that row's output is NaN, as the reference's
    is, never a silently finite answer; the other rows of its block keep theirs."""
    B, Hkv, group, L, D = 1, 1, 4, 40, 64
    cache = quantized_cache("int8", "int8", B, Hkv, L, D, seed=5, v_layout="keys")
    q = make_q(B, Hkv * group, 1, D, seed=5, dtype=torch.float32 if DEV == "cpu" else torch.bfloat16)
    q[0, 1, 0, 3] = bad
    kv_len = torch.tensor([40], device=DEV)
    with plan_mod.override(int8_mma=True):
        out = kernels.attention(q, *cache, kv_len, None, False, None, **fmts_of(*cache))
    ref = reference.attention(q, *cache, kv_len, None, False, None, compute_dtype=torch.float64, **fmts_of(*cache))
    assert ref[0, 1].isnan().all() and out[0, 1].isnan().all()
    rest = [0, 2, 3]
    assert rel_err(out[:, rest], ref[:, rest]) < FP16_TOL

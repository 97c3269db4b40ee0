"""A sliding layer's ring (kvcompile/ring.py): ``W`` slots that hold the last ``W`` positions.

The ring ops are checked against a linear cache holding every position, fed the same tokens:

* after every update the ring's slots hold, bit for bit, the linear cache's codes and scales of
  the last ``W`` positions (slot ``p % W``);
* ``attention_ring`` (store, then attend) equals ``reference.attention`` in float64 over the linear
  cache with window ``W``: decode steps that wrap the ring, chunks shorter than the ring, a chunk
  that wraps it and one longer than it, with a left-padding mask, an additive mask, a mask that
  hides a key inside the window (so a mask permuted wrongly into slot order fails), softcap,
  sinks, K rotation, GQA, and ``W`` not a multiple of the kernels' 16-key tile;
* ``dequantize_ring`` returns the values the linear cache dequantizes inside the window, zeros
  outside.

Each case also checks a control: the same attention without the window differs from the ring's
result by far more than the tolerance, so the test can tell a ring that attends outside its window.
Tolerance: fp32 queries, so both the reference and the kernels (interpreter or GPU) take fp32 dots
on bit-identical codes; relative Frobenius error measured <= 1e-6, asserted < 1e-5 (as
tests/test_kernels_features.py).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import kvcompile
from kvcompile import ops, reference, rotation
from kvcompile.cache import v_codes_buffer

from models import tiny_config
from utils import fmts_of, id_of, ids_of  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5
OFF_MIN = 1e-2
B, HQ, HKV, D, W = 2, 4, 2, 32, 6
SCHEDULE = [4, 1, 1, 1, 5, 1, 1, 9, 1]  # new tokens per update: fills, wraps, a wrapping chunk, one longer than W
L = sum(SCHEDULE)

# kv_dtype -> (code dtype, scale groups per token (0: static), scale dtype, V key-contiguous)
KINDS = {
    "fp8_e4m3": (torch.float8_e4m3fn, 1, torch.float32, True),
    "int8": (torch.int8, 1, torch.float32, True),
    "q8_0": (torch.int8, D // 32, torch.float16, False),
    "fp8_static": (torch.float8_e4m3fn, 0, torch.float32, True),
}


def _backends():
    out = [pytest.param("reference", id="reference")]
    if DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        out.append(pytest.param("triton", id="triton"))
    return out


def _buffers(kind: str, n: int, d: int = D):
    code, groups, sdtype, keys = KINDS[kind]
    groups = d // 32 if kind == "q8_0" else groups
    kc = torch.zeros(B, HKV, n, d, dtype=code, device=DEV)
    vc = v_codes_buffer((B, HKV, n, d), code, DEV, keys)
    if groups == 0:  # static per-head scales, shared by both caches
        ks = torch.tensor([0.02, 0.03], device=DEV)
        return [kc, ks, vc, ks.clone() * 0.5]
    return [kc, torch.zeros(B, HKV, n, groups, dtype=sdtype, device=DEV), vc,
            torch.zeros(B, HKV, n, groups, dtype=sdtype, device=DEV)]


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _masks(kind: str):
    """Absolute-position masks [B, 1, 1, L] (decode) builders: None, bool, additive."""
    if kind == "none":
        return None
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool, device=DEV)
    keep[0, ..., :2] = False  # row 0: two left pads
    keep[1, ..., 16] = False  # row 1: a key inside later windows
    if kind == "bool":
        return keep
    return torch.zeros(B, 1, 1, L, device=DEV).masked_fill(~keep, torch.finfo(torch.float32).min)


def _chunk_mask(mask, c, T):
    """The mask for queries [c, c + T): the absolute mask broadcast over the queries, and causal."""
    if mask is None:
        return None
    q_pos = torch.arange(c, c + T, device=DEV).view(1, 1, T, 1)
    causal = torch.arange(L, device=DEV).view(1, 1, 1, L) <= q_pos
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind,rotate,mask,feature", [
    ("fp8_e4m3", False, "bool", None),
    ("int8", True, "none", None),
    ("int8", True, "additive", "softcap"),
    ("q8_0", False, "bool", "sinks"),
    ("fp8_static", False, "none", None),
])
def test_ring_attention_equals_a_linear_cache_with_the_window(backend, kind, rotate, mask, feature, monkeypatch):
    monkeypatch.setenv("KVCOMPILE_KERNELS", backend)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, rotate, mask, feature)).encode()))
    ring, lin = _buffers(kind, W), _buffers(kind, L)
    if kind == "fp8_static":
        lin[1], lin[3] = ring[1], ring[3]
    R = rotation.shared(D, torch.device(DEV)) if rotate else None
    softcap = 20.0 if feature == "softcap" else 0.0
    sinks = (torch.randn(HQ, generator=gen) + 1.0).to(DEV) if feature == "sinks" else None
    amask = _masks(mask)
    n_len = torch.zeros((), dtype=torch.long, device=DEV)
    moved = 0.0
    c = 0
    for T in SCHEDULE:
        k = (torch.randn(B, HKV, T, D, generator=gen) * 2).to(DEV)
        v = torch.randn(B, HKV, T, D, generator=gen).to(DEV)
        q = (torch.randn(B, HQ, T, D, generator=gen) * 2).to(DEV)
        ops.store_kv(*lin, k, v, n_len, None, R, None, **ids_of(*lin))
        n_len += T
        m = _chunk_mask(amask, c, T) if T > 1 else amask
        out = ops.attention_ring(q, *ring, n_len, k, v, None, None, m, T > 1, None, softcap, sinks, R, None, **ids_of(*ring))
        ref = reference.attention(q, *lin, n_len, m, T > 1, None, W, softcap, sinks, R, None,
                                  compute_dtype=torch.float64, **fmts_of(*lin))
        err = _rel(out, ref)
        assert err < TOL, f"update of {T} at {c}: relative error {err:.3g}"
        full = reference.attention(q, *lin, n_len, m, T > 1, None, 0, softcap, sinks, R, None,
                                   compute_dtype=torch.float64, **fmts_of(*lin))
        moved = max(moved, _rel(full, ref))
        c += T
        # the ring holds the last W positions in slot p % W, bit for bit; K rotated, as the store rotates
        # it up to the order of the rotation's fp32 sums (the Triton decode rotates the token in the
        # attention kernel, the linear store by a launch): a code at most one step and a scale (the
        # row's amax / 127) a few ulps apart
        pos = torch.arange(max(0, c - W), c, device=DEV)
        for i, (r, lt) in enumerate(zip(ring, lin)):
            if r.dim() == 1:
                continue
            got, want = _bytes(r)[:, :, pos % W], _bytes(lt)[:, :, pos]
            if R is not None and i < 2:
                step = (got.double() - want.double()).abs().max().item()
                assert step <= (1 if i == 0 else 1e-6 * want.abs().max().item()), f"K after {c} positions: {step}"
            else:
                assert torch.equal(got, want), f"slots after {c} positions"
    assert moved > OFF_MIN, f"without the window the result moved only {moved:.3g}: the test cannot tell"


@pytest.mark.skipif(_backends()[-1].values[0] != "triton", reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind,rotate,offset,d", [
    ("fp8_e4m3", False, True, D),
    ("int8", True, False, D),
    ("int8", "kv", True, D),
    ("q8_0", False, False, D),
    ("fp8_static", False, False, D),
    ("fp8_e4m3", False, False, 96),  # a head_dim that is not a power of two: masked columns
    ("q8_0", False, False, 96),  # ... and three scale groups padded to four
])
def test_ring_decode_stores_its_token_in_the_attention_kernel(kind, rotate, offset, d, monkeypatch):
    """A ring's decode step stores its token inside the attention kernel (the plan's ``store ==
    "kernel"``; no store launch): the ring's codes and scales after each step, and the output, are
    those of the store launched before the kernel (``store="launch"``), bit for bit, through a fill
    and two wraps; and the step is right (against the float64 reference over a linear cache)."""
    from kvcompile.kernels import attention_launcher, plan

    monkeypatch.setenv("KVCOMPILE_KERNELS", "triton")
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, rotate, offset, d)).encode()))
    fused, launched, lin = _buffers(kind, W, d), _buffers(kind, W, d), _buffers(kind, L, d)
    if kind == "fp8_static":
        lin[1], lin[3] = fused[1], fused[3]
        launched[1], launched[3] = fused[1], fused[3]
    R = rotation.shared(d, torch.device(DEV)) if rotate else None
    Rv = R if rotate == "kv" else None
    off = (torch.randn(HKV, d, generator=gen) * 0.5).to(DEV) if offset else None
    n_len = torch.zeros((), dtype=torch.long, device=DEV)
    for step in range(2 * W + 3):
        k = (torch.randn(B, HKV, 1, d, generator=gen) * 2).to(DEV)
        v = torch.randn(B, HKV, 1, d, generator=gen).to(DEV)
        q = (torch.randn(B, HQ, 1, d, generator=gen) * 2).to(DEV)
        ops.store_kv(*lin, k, v, n_len, off, R, Rv, **ids_of(*lin))
        n_len += 1
        call = attention_launcher.call_of(q, *fused[:4], k_rotation=R, v_rotation=Rv, new_token=(k, v, off), **fmts_of(*fused[:4]))
        assert attention_launcher.plan_of(call).store == "kernel"
        out = ops.attention_ring(q, *fused, n_len, k, v, off, None, None, False, None, 0.0, None, R, Rv, **ids_of(*fused))
        with plan.override(store="launch"):
            want = ops.attention_ring(q, *launched, n_len, k, v, off, None, None, False, None, 0.0, None, R, Rv, **ids_of(*launched))
        if R is None:
            assert torch.equal(out, want), f"step {step}"
            for a, b_ in zip(fused, launched):
                assert torch.equal(_bytes(a), _bytes(b_)), f"ring after step {step}"
        else:  # the kernel's rotation and the launch's sum in another order (fp32): a scale a few ulps
            # apart, a code on a rounding boundary one step; the output within fp32 rounding of that
            assert _rel(out, want) < 1e-5, f"step {step}"
            for i, (a, b_) in enumerate(zip(fused, launched)):
                diff = (a.double() - b_.double()).abs().max().item()
                assert diff <= (1 if i % 2 == 0 else 1e-6 * b_.abs().max().item()), f"ring after step {step}: {i}"
        ref = reference.attention(q, *lin, n_len, None, False, None, W, 0.0, None, R, Rv, compute_dtype=torch.float64, **fmts_of(*lin))
        assert _rel(out, ref) < TOL, f"step {step}"


@pytest.mark.parametrize("backend", _backends())
def test_ring_decode_with_a_key_bound(backend, monkeypatch):
    """``kv_len`` below the cache length (a graph that slices K): keys at or past it are not seen."""
    monkeypatch.setenv("KVCOMPILE_KERNELS", backend)
    gen = torch.Generator().manual_seed(5)
    ring, lin = _buffers("fp8_e4m3", W), _buffers("fp8_e4m3", L)
    n_len = torch.zeros((), dtype=torch.long, device=DEV)
    for T in (9, 1):
        k = torch.randn(B, HKV, T, D, generator=gen).to(DEV)
        v = torch.randn(B, HKV, T, D, generator=gen).to(DEV)
        ops.store_kv(*lin, k, v, n_len, None, **ids_of(*lin))
        n_len += T
        q = torch.randn(B, HQ, T, D, generator=gen).to(DEV)
        bound = n_len - 1
        out = ops.attention_ring(q, *ring, n_len, k, v, None, bound, None, T > 1, None, **ids_of(*ring))
    # decode at position 9 over keys < 9: the ring holds 4..9, so keys 4..8 (window W - 1 from 8)
    ref = reference.attention(q, *lin, bound, None, False, None, W - 1, compute_dtype=torch.float64, **fmts_of(*lin))
    assert _rel(out, ref) < TOL
    unbounded = reference.attention(q, *lin, n_len, None, False, None, W, compute_dtype=torch.float64, **fmts_of(*lin))
    assert _rel(unbounded, ref) > OFF_MIN


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8", "q8_0"])
def test_attention_key_bound_above_the_cache_reads_every_key(backend, kind, monkeypatch):
    """``kv_len`` above L (a ring's token count, passed by its decode) reads the L keys and no further:
    the result equals ``kv_len = L`` bit for bit, on every row (per-row bounds, one past L and one far
    past). A split decode (L = 80 > one tile) runs the merge, which must also ignore splits past L. The
    control: a bound below L changes the result."""
    monkeypatch.setenv("KVCOMPILE_KERNELS", backend)
    gen = torch.Generator().manual_seed(11)
    n = 80
    buf = _buffers(kind, n)
    k = torch.randn(B, HKV, n, D, generator=gen).to(DEV)
    v = torch.randn(B, HKV, n, D, generator=gen).to(DEV)
    ops.store_kv(*buf, k, v, torch.zeros((), dtype=torch.long, device=DEV), None, **ids_of(*buf))
    q = torch.randn(B, HQ, 1, D, generator=gen).to(DEV)
    full = ops.attention(q, *buf, torch.full((B,), n, device=DEV), None, False, None, **ids_of(*buf))
    over = ops.attention(q, *buf, torch.tensor([n + 1, 10 * n], device=DEV), None, False, None, **ids_of(*buf))
    assert torch.equal(over, full)
    ref = reference.attention(q, *buf, torch.tensor(n, device=DEV), None, False, None, compute_dtype=torch.float64, **fmts_of(*buf))
    assert _rel(full, ref) < TOL
    short = ops.attention(q, *buf, torch.full((B,), n - 7, device=DEV), None, False, None, **ids_of(*buf))
    assert _rel(short, full) > OFF_MIN


@pytest.mark.parametrize("kind", ["fp8_e4m3", "q8_0"])
def test_dequantize_ring_is_the_window_of_a_linear_cache(kind):
    gen = torch.Generator().manual_seed(7)
    ring, lin = _buffers(kind, W), _buffers(kind, L)
    n_len = torch.zeros((), dtype=torch.long, device=DEV)
    c = 0
    for T in SCHEDULE:
        k = torch.randn(B, HKV, T, D, generator=gen).to(DEV)
        v = torch.randn(B, HKV, T, D, generator=gen).to(DEV)
        got = ops.dequantize_ring(ring[0], ring[1], None, n_len, torch.float32, None, W, k, L, format=id_of(ring[0], ring[1]))
        ops.store_kv(*ring, k, v, n_len, None, ring=True, **ids_of(*ring))
        ops.store_kv(*lin, k, v, n_len, None, **ids_of(*lin))
        n_len += T
        want = ops.dequantize(lin[0], lin[1], None, n_len, torch.float32, format=id_of(lin[0], lin[1]))
        lo = max(0, c - W + 1)  # the oldest key the chunk's first query sees
        assert torch.equal(got[:, :, lo:c + T], want[:, :, lo:c + T]), f"update of {T} at {c}"
        assert not got[:, :, :lo].any() and not got[:, :, c + T:].any()
        c += T


def test_ring_op_refuses_a_window_that_is_not_the_ring():
    ring = _buffers("fp8_e4m3", W)
    x = torch.randn(B, HKV, 1, D, device=DEV)
    with pytest.raises(ValueError, match="ring of 6 slots"):
        ops.dequantize_ring(ring[0], ring[1], None, torch.tensor(0, device=DEV), torch.float32, None, W + 1, x, L, format=id_of(ring[0], ring[1]))


# ---------------------------------------------------------------------------------------------
# the cache: memory follows the window; cropping past it is refused with the fix
# ---------------------------------------------------------------------------------------------


def _gemma3(window=4):
    return tiny_config("gemma3", sliding_window=window)  # layers: sliding, full


def test_sliding_layers_hold_only_their_window():
    cfg = _gemma3(window=64)
    ring = kvcompile.QuantizedCache(cfg, max_cache_len=4096, kv_dtype="fp8_e4m3", device="meta")
    full = kvcompile.QuantizedCache(cfg, max_cache_len=4096, kv_dtype="fp8_e4m3", device="meta", ring=False)
    sliding, glob = ring.planned_nbytes(per_layer=True)
    assert glob == full.planned_nbytes(per_layer=True)[1]
    assert [layer.slots for layer in ring.layers] == [64, 4096]
    assert sliding < glob / 32  # 64 of 4096 positions (plus the per-layer length)
    assert ring.bf16_nbytes() < full.bf16_nbytes()
    assert "(ring)" in repr(ring.layers[0])


def test_crop_past_the_window_names_the_fix():
    cfg = _gemma3(window=4)
    cache = kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3", device="cpu")
    layer = cache.layers[0]
    k = torch.randn(1, cfg.num_key_value_heads, 3, cfg.head_dim)
    layer.update(k, k)
    layer.crop(-2)  # 3 tokens in a ring of 4: nothing overwritten
    layer.update(torch.randn(1, cfg.num_key_value_heads, 5, cfg.head_dim), k[:, :, :1].expand(-1, -1, 5, -1))
    layer.crop(-1)  # one token: the window of the shorter cache is still held
    with pytest.raises(RuntimeError, match="ring=False"):
        layer.crop(-2)
    plain = kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3", device="cpu", ring=False)
    plain.layers[0].update(torch.randn(1, cfg.num_key_value_heads, 8, cfg.head_dim),
                           torch.randn(1, cfg.num_key_value_heads, 8, cfg.head_dim))
    plain.layers[0].crop(-3)
    assert int(plain.layers[0].cumulative_length) == 5


def test_ring_must_be_a_bool():
    with pytest.raises(TypeError, match="ring must be True or False"):
        kvcompile.QuantizedCache(_gemma3(), max_cache_len=16, ring="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8", "q8_0"])
def test_gpu_ring_decode_in_cuda_graph(kind):
    """A ring of 1000 slots (not a multiple of the 16-key tile) after a 1500-token prefill: decode
    captured once, then replayed as the length moves on the device and the ring wraps, each step
    against the linear cache with the window (Llama-3-8B's heads, fp32 q: fp32 dots, TOL)."""
    b, hq, hkv, d, w, prompt = 2, 32, 8, 128, 1000, 1500
    code, groups, sdtype, keys = KINDS[kind]
    groups = d // 32 if kind == "q8_0" else groups

    def buffers(n):
        return [torch.zeros(b, hkv, n, d, dtype=code, device=DEV), torch.zeros(b, hkv, n, groups, dtype=sdtype, device=DEV),
                v_codes_buffer((b, hkv, n, d), code, DEV, keys), torch.zeros(b, hkv, n, groups, dtype=sdtype, device=DEV)]

    gen = torch.Generator().manual_seed(11)
    R = rotation.shared(d, torch.device(DEV)) if kind == "int8" else None
    ring, lin = buffers(w), buffers(prompt + 8)
    n_len = torch.zeros((), dtype=torch.long, device=DEV)
    k, v, q = (torch.randn(b, h, prompt, d, generator=gen).to(DEV) for h in (hkv, hkv, hq))
    ops.store_kv(*lin, k, v, n_len, None, R, None, **ids_of(*lin))
    n_len += prompt
    ops.attention_ring(q, *ring, n_len, k, v, None, None, None, True, None, 0.0, None, R, None, **ids_of(*ring))
    k1, v1, q1 = (torch.zeros(b, h, 1, d, device=DEV) for h in (hkv, hkv, hq))
    n_len += 1
    ops.attention_ring(q1, *ring, n_len, k1, v1, None, None, None, False, None, 0.0, None, R, None, **ids_of(*ring))  # warm up
    n_len -= 1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.attention_ring(q1, *ring, n_len, k1, v1, None, None, None, False, None, 0.0, None, R, None, **ids_of(*ring))
    for _ in range(8):
        for t, h in ((k1, hkv), (v1, hkv), (q1, hq)):
            t.copy_(torch.randn(b, h, 1, d, generator=gen))
        ops.store_kv(*lin, k1, v1, n_len, None, R, None, **ids_of(*lin))
        n_len += 1
        g.replay()
        ref = reference.attention(q1, *lin, n_len, None, False, None, w, 0.0, None, R, None,
                                  compute_dtype=torch.float64, **fmts_of(*lin))
        assert _rel(out, ref) < TOL, int(n_len)


def test_repr_says_how_sliding_layers_store():
    """The cache's repr names what a sliding layer holds: a ring of the window, or (ring=False) every
    position."""
    cfg = tiny_config("mistral", num_hidden_layers=2, sliding_window=4)
    ring = repr(kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3"))
    flat = repr(kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3", ring=False))
    assert "sliding window 4 on 2 of 2 layers" in ring and "a ring of its window" in ring
    assert "stores max_cache_len positions" in flat and "max_cache_len positions" not in ring

"""The ``torch.ops.kvcompile`` ops on CPU (reference path): opcheck, store/dequantize
semantics, and attention against a float64 oracle written here, independently of
kvcompile.reference (its own e4m3 decoding, explicit per-batch loops, GQA by repeat_interleave).
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcompile  # noqa: F401  (registers the ops)
from kvcompile import formats
from utils import FORMATS, FORMAT_IDS, as_format, assert_close, bits_equal, decode_codes_f64, ids, make_cache

OPS = torch.ops.kvcompile

def fill(fmt, kc, ks, vc, vs, n, seed=1, offset=None):
    """Store n random tokens at position 0 through the op (codes in ``fmt``); returns the K/V written."""
    gen = torch.Generator().manual_seed(seed)
    B, H, _, D = kc.shape
    k = torch.randn(B, H, n, D, generator=gen)
    v = torch.randn(B, H, n, D, generator=gen)
    OPS.store_kv(kc, ks, vc, vs, k, v, torch.tensor(0), offset, **ids(fmt))
    return k, v


def deq_oracle(codes, scale):
    """float64 values of a cache, from the hand-decoded codes and the scales."""
    c = decode_codes_f64(codes)
    s = scale.double()
    if s.dim() == 1:
        return c * s.view(1, -1, 1, 1)
    return c * s.repeat_interleave(codes.shape[-1] // s.shape[-1], dim=-1)


def attention_oracle(q, kc, ks, vc, vs, kv_len, mask, is_causal, scale):
    """float64 attention, one (batch, query row) at a time; a row with no visible key -> zeros."""
    B, Hq, Tq, D = q.shape
    Hkv, L = kc.shape[1], kc.shape[2]
    k = deq_oracle(kc, ks).repeat_interleave(Hq // Hkv, dim=1)
    v = deq_oracle(vc, vs).repeat_interleave(Hq // Hkv, dim=1)
    lens = [int(x) for x in kv_len.reshape(-1).expand(B)] if kv_len.numel() == 1 else kv_len.tolist()
    sm = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, Hq, Tq, D, dtype=torch.float64)
    if mask is not None:
        mask = mask.expand(B, Hq, Tq, L)
    for b in range(B):
        for i in range(Tq):
            s = torch.einsum("hd,hld->hl", q[b, :, i].double(), k[b]) * sm  # [Hq, L]
            visible = torch.zeros(Hq, L, dtype=torch.bool)
            last = lens[b] - Tq + i if is_causal else lens[b] - 1  # bottom-right causal
            visible[:, : max(0, min(last, lens[b] - 1) + 1)] = True
            if mask is not None and mask.dtype == torch.bool:
                visible &= mask[b, :, i]
            elif mask is not None:
                s = s + mask[b, :, i].double()
            s = s.masked_fill(~visible, -math.inf)
            for h in range(Hq):
                if torch.isneginf(s[h]).all():
                    continue  # stays zeros
                p = torch.softmax(s[h], dim=-1)
                out[b, h, i] = p @ v[b, h]
    return out


# ------------------------------------------------------------------------------------------------
# opcheck
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_offset", [False, True], ids=["", "offset"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_opcheck_store_and_dequantize(fmt, with_offset, fp8_safe_schema_check):
    kc, ks, vc, vs = make_cache(fmt)
    B, H, L, D = kc.shape
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(B, H, 5, D, generator=gen), torch.randn(B, H, 5, D, generator=gen)
    offset = torch.randn(H, D, generator=gen) * 0.1 if with_offset else None
    torch.library.opcheck(OPS.store_kv.default, (kc, ks, vc, vs, k, v, torch.tensor(3), offset), ids(fmt))
    OPS.store_kv(kc, ks, vc, vs, k, v, torch.tensor(3), offset, **ids(fmt))
    for kv_len in (torch.tensor(8), torch.tensor([8, 5])):
        for dtype in (torch.float32, torch.bfloat16):
            torch.library.opcheck(OPS.dequantize.default, (kc, ks, offset, kv_len, dtype), {"format": fmt.id})


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_opcheck_attention(fmt, mask_kind, fp8_safe_schema_check):
    kc, ks, vc, vs = make_cache(fmt)
    fill(fmt, kc, ks, vc, vs, 9)
    B, _, L, D = kc.shape
    q = torch.randn(B, 4, 3, D)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, 3, L) > 0.3
    elif mask_kind == "additive":
        mask = torch.randn(B, 1, 3, L)
    for kv_len, causal, scale in ((torch.tensor(9), True, None), (torch.tensor([9, 6]), False, 0.3)):
        torch.library.opcheck(OPS.attention.default, (q, kc, ks, vc, vs, kv_len, mask, causal, scale), ids(fmt))


def test_ops_run_with_grad_enabled_and_refuse_a_backward():
    """A model run without torch.no_grad() (eager logits) works: the output of attention / dequantize
    tracks the inputs that require grad, and a backward through it raises with the fix instead of
    returning wrong gradients. Under no_grad nothing is tracked."""
    fmt = as_format("int8", "token")
    kc, ks, vc, vs = make_cache(fmt)
    fill(fmt, kc, ks, vc, vs, 9)
    q = torch.randn(2, 4, 1, 64, requires_grad=True)
    out = OPS.attention(q, kc, ks, vc, vs, torch.tensor(9), None, False, None, **ids(fmt))
    with torch.no_grad():
        ref = OPS.attention(q, kc, ks, vc, vs, torch.tensor(9), None, False, None, **ids(fmt))
    assert out.requires_grad and not ref.requires_grad and torch.equal(out.detach(), ref)
    with pytest.raises(RuntimeError, match="no backward.*torch.no_grad"):
        out.sum().backward()
    offset = torch.randn(2, 64, requires_grad=True)
    deq = OPS.dequantize(kc, ks, offset, torch.tensor(9), torch.float32, format=fmt.id)
    with pytest.raises(RuntimeError, match="kvcompile::dequantize has no backward"):
        deq.sum().backward()


# ------------------------------------------------------------------------------------------------
# store_kv / dequantize semantics
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_offset", [False, True], ids=["", "offset"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_store_kv_writes_only_its_positions(fmt, with_offset):
    kc, ks, vc, vs = make_cache(fmt)
    B, H, L, D = kc.shape
    gen = torch.Generator().manual_seed(3)
    # poison: random bytes in the codes (NaN codes included), random scales
    for t in (kc, vc):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    if ks.dim() == 4:
        ks.copy_(torch.rand(ks.shape, generator=gen))
        vs.copy_(torch.rand(vs.shape, generator=gen))
    before = [t.clone() for t in (kc, ks, vc, vs)]
    start, T = 5, 3
    k, v = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
    offset = torch.randn(H, D, generator=gen) if with_offset else None
    OPS.store_kv(kc, ks, vc, vs, k, v, torch.tensor(start), offset, **ids(fmt))

    outside = torch.ones(L, dtype=torch.bool)
    outside[start:start + T] = False
    for name, new, old in zip(("k codes", "k scales", "v codes", "v scales"), (kc, ks, vc, vs), before):
        if new.dim() == 1:
            assert bits_equal(new, old), f"static {name} must be read, never written"
        else:
            assert bits_equal(new[:, :, outside], old[:, :, outside]), f"store_kv touched {name} outside [start, start+T)"
    # the written slots hold the reference quantization of k - offset and v
    k_in = k - offset.view(1, H, 1, D) if with_offset else k
    for x, codes, scale in ((k_in, kc, ks), (v, vc, vs)):
        if scale.dim() == 1:
            want_c, _ = formats.quantize(x, codes.dtype, scale=scale, kv_dtype=fmt.kv_dtype)
        else:
            want_c, want_s = formats.quantize(x, codes.dtype, groups=scale.shape[-1], kv_dtype=fmt.kv_dtype)
            assert bits_equal(scale[:, :, start:start + T], want_s.to(scale.dtype))
        assert bits_equal(codes[:, :, start:start + T], want_c)


def test_store_kv_past_the_end_raises():
    fmt = as_format("fp8_e4m3", "token")
    kc, ks, vc, vs = make_cache(fmt, L=8)
    k = torch.randn(2, 2, 3, 64)
    with pytest.raises(RuntimeError, match="max_cache_len"):
        OPS.store_kv(kc, ks, vc, vs, k, k, torch.tensor(6), None, **ids(fmt))
    OPS.store_kv(kc, ks, vc, vs, k, k, torch.tensor(5), None, **ids(fmt))  # exactly up to the end is fine


def test_store_kv_rejects_misshaped_inputs():
    fmt = as_format("q8_0", "block32")
    kc, ks, vc, vs = make_cache(fmt)
    with pytest.raises(ValueError, match="do not fit"):
        OPS.store_kv(kc, ks, vc, vs, torch.randn(2, 3, 1, 64), torch.randn(2, 3, 1, 64), torch.tensor(0), None, **ids(fmt))
    with pytest.raises(ValueError, match="scale"):
        OPS.store_kv(kc, torch.zeros(2, 2, 16, 3, dtype=ks.dtype), vc, vs, torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), torch.tensor(0), None, **ids(fmt))
    with pytest.raises(TypeError, match="codes in q8_0 must be torch.int8"):
        OPS.dequantize(kc.float(), ks, None, torch.tensor(1), torch.float32, format=fmt.id)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_dequantize_values_and_zeros_past_kv_len(fmt):
    kc, ks, vc, vs = make_cache(fmt)
    B, H, L, D = kc.shape
    offset = torch.randn(H, D) * 0.5
    k, _ = fill(fmt, kc, ks, vc, vs, 12, offset=offset)
    want = deq_oracle(kc, ks).float()
    # scalar kv_len: every batch row keeps 7 positions
    out = OPS.dequantize(kc, ks, None, torch.tensor(7), torch.float32, format=fmt.id)
    assert_close(out[:, :, :7], want[:, :, :7], atol=0, rtol=0)
    assert (out[:, :, 7:] == 0).all()
    # per-batch kv_len, offset added back (the value that was stored), bf16 out
    out = OPS.dequantize(kc, ks, offset, torch.tensor([12, 3]), torch.bfloat16, format=fmt.id)
    assert out.dtype == torch.bfloat16
    assert (out[0, :, 12:] == 0).all() and (out[1, :, 3:] == 0).all()
    with_off = want + offset.view(1, H, 1, D)
    assert_close(out[0, :, :12], with_off[0, :, :12].bfloat16(), atol=0, rtol=0)
    assert_close(out[1, :, :3], with_off[1, :, :3].bfloat16(), atol=0, rtol=0)
    if not fmt.is_static:  # and the stored values are close to what was written
        rel = (out[0, :, :12].float() - k[0]).norm() / k[0].norm()
        assert rel < 0.05, rel  # measured ~0.02 fp8 (+bf16 output rounding), ~0.006 q8_0


# ------------------------------------------------------------------------------------------------
# attention vs the float64 oracle
# ------------------------------------------------------------------------------------------------

# reference.attention computes in fp32 over fp32-dequantized K/V (exactly the oracle's values);
# the only difference is fp32 vs fp64 accumulation over <= 16 keys of O(1) values:
# measured max abs error 1.1e-6 over all CASES x FORMATS. atol 3e-6 is ~3x that and still
# ~2e4x below one e4m3 step (2^-4 relative), so any real masking/GQA/scale bug fails loudly.
ATTN_ATOL, ATTN_RTOL = 3e-6, 1e-5

CASES = [
    # (Hq, Hkv, Tq, kv_len, causal, mask_kind, scale)
    (4, 2, 1, [16], True, None, None),  # decode, full cache
    (4, 2, 1, [11, 4], True, None, None),  # decode, per-batch lengths
    (4, 2, 5, [9], True, None, None),  # prefill/extend, bottom-right causal
    (4, 2, 5, [13, 6], True, None, 0.2),  # extend, per-batch lengths, explicit scale
    (3, 1, 4, [10], False, "bool", None),  # MQA, bool mask, no causal
    (4, 2, 4, [12, 7], True, "bool", None),  # bool mask and causal
    (4, 4, 3, [16, 9], False, "additive", None),  # MHA, additive float mask
    (6, 2, 3, [14], True, "additive", 0.5),
]


@pytest.mark.parametrize("Hq,Hkv,Tq,kv_len,causal,mask_kind,scale", CASES)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_attention_matches_float64_oracle(fmt, Hq, Hkv, Tq, kv_len, causal, mask_kind, scale):
    B, L, D = 2, 16, 64
    kc, ks, vc, vs = make_cache(fmt, B=B, H=Hkv, L=L, D=D)
    fill(fmt, kc, ks, vc, vs, L, seed=Hq * 7 + Tq)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(B, Hq, Tq, D, generator=gen)
    kv_len = torch.tensor(kv_len[0]) if len(kv_len) == 1 else torch.tensor(kv_len)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, Tq, L, generator=gen) > 0.4
        mask[..., 0] = True  # keep one visible key per row (fully-masked rows are tested below)
    elif mask_kind == "additive":
        mask = torch.randn(B, 1, Tq, L, generator=gen) * 2
        mask[..., 1::3] = -math.inf
    out = OPS.attention(q, kc, ks, vc, vs, kv_len, mask, causal, scale, **ids(fmt))
    want = attention_oracle(q, kc, ks, vc, vs, kv_len, mask, causal, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, want, atol=ATTN_ATOL, rtol=ATTN_RTOL)


def test_attention_fully_masked_rows_are_zeros():
    fmt = as_format("fp8_e4m3", "token")
    kc, ks, vc, vs = make_cache(fmt)
    fill(fmt, kc, ks, vc, vs, 16)
    B, _, L, D = kc.shape
    q = torch.randn(B, 4, 3, D)
    bool_mask = torch.ones(B, 4, 3, L, dtype=torch.bool)
    bool_mask[0, 1, 2] = False  # one row sees nothing
    add_mask = torch.zeros(B, 1, 3, L)
    add_mask[1, 0, 0] = -math.inf
    for mask in (bool_mask, add_mask):
        out = OPS.attention(q, kc, ks, vc, vs, torch.tensor(16), mask, False, None, **ids(fmt))
        assert torch.isfinite(out).all()
        want = attention_oracle(q, kc, ks, vc, vs, torch.tensor(16), mask, False, None)
        assert_close(out, want, atol=ATTN_ATOL, rtol=ATTN_RTOL)
    assert (OPS.attention(q, kc, ks, vc, vs, torch.tensor(16), bool_mask, False, None, **ids(fmt))[0, 1, 2] == 0).all()
    assert (OPS.attention(q, kc, ks, vc, vs, torch.tensor(16), add_mask, False, None, **ids(fmt))[1, :, 0] == 0).all()
    # an empty sequence (kv_len 0) attends to nothing either
    out = OPS.attention(q, kc, ks, vc, vs, torch.tensor([0, 16]), None, False, None, **ids(fmt))
    assert (out[0] == 0).all() and (out[1] != 0).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_low_precision_queries(dtype):
    fmt = as_format("q8_0", "block32")
    kc, ks, vc, vs = make_cache(fmt)
    fill(fmt, kc, ks, vc, vs, 10)
    q = torch.randn(2, 4, 2, 64).to(dtype)
    out = OPS.attention(q, kc, ks, vc, vs, torch.tensor(10), None, True, None, **ids(fmt))
    assert out.dtype == dtype
    want = attention_oracle(q, kc, ks, vc, vs, torch.tensor(10), None, True, None)
    # the output is the fp32 result rounded once to `dtype`: at most half an ulp (2^-8 relative
    # for bf16, 2^-11 for fp16) plus the fp32 error (~1e-6). Measured: bf16 3.8e-3, fp16 4.8e-4 abs
    # on outputs up to ~1.6.
    half_ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert_close(out, want, atol=1e-5, rtol=half_ulp * 1.01)


def test_attention_rejects_bad_shapes():
    fmt = as_format("fp8_e4m3", "token")
    kc, ks, vc, vs = make_cache(fmt)
    with pytest.raises(ValueError, match="multiple"):
        OPS.attention(torch.randn(2, 3, 1, 64), kc, ks, vc, vs, torch.tensor(1), None, True, None, **ids(fmt))
    with pytest.raises(ValueError, match="does not fit"):
        OPS.attention(torch.randn(2, 4, 1, 32), kc, ks, vc, vs, torch.tensor(1), None, True, None, **ids(fmt))


def test_kernel_backend_env(monkeypatch):
    from kvcompile.ops import kernel_backend

    monkeypatch.setenv("KVCOMPILE_KERNELS", "auto")
    assert kernel_backend(torch.device("cpu")) == ("native" if kvcompile.native.available() else "reference")
    assert kernel_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv("KVCOMPILE_KERNELS", "reference")
    assert kernel_backend(torch.device("cuda")) == "reference"
    monkeypatch.setenv("KVCOMPILE_KERNELS", "cutlass")
    with pytest.raises(ValueError, match="auto"):
        kernel_backend(torch.device("cpu"))
    monkeypatch.setenv("KVCOMPILE_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernel_backend(torch.device("cpu"))


def test_ops_refuse_a_call_without_format_ids():
    """The format travels as an id; an op called without one names the fix instead of guessing
    (the ops' implementations, whatever a test elsewhere registered for the ops themselves)."""
    from kvcompile import ops

    kc, ks, vc, vs = make_cache(FORMATS[0])
    q = torch.randn(2, 2, 1, 64)
    with pytest.raises(ValueError, match="pass k_format=KVFormat.id"):
        ops._attention(q, kc, ks, vc, vs, torch.tensor(1), None, False, None)
    with pytest.raises(ValueError, match="pass v_format=KVFormat.id"):
        ops._store_kv(kc, ks, vc, vs, q, q, torch.tensor(0), None, k_format=FORMATS[0].id)
    with pytest.raises(ValueError, match="pass format=KVFormat.id"):
        ops._dequantize(kc, ks, None, torch.tensor(1), torch.float32)

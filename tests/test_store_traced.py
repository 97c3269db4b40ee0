"""The store a compiled CPU graph runs: ``reference.store_kv_traced``, compiled by Inductor, writes
the codes and scales the op writes, bit for bit, and nothing else; a model compiled on the CPU
traces it in place of the ``kvcompile::store_kv`` op (and keeps the op for a ring and in eager mode).

Bit-exact, not close: the compiled graph and eager mode must read one cache the same way, and the
GPU kernels are held to the op's codes. The data holds what the fused loop could get wrong:
ties of the rounding (half-way values: q8_0 rounds them away from zero, int8 and e4m3 to even),
saturation, all-zero and subnormal tokens, NaN and Inf.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvcompile
from kvcompile import get_format, reference, rotation
from utils import bits_equal

FORMATS = [("int8", "token"), ("fp8_e4m3", "token"), ("fp8_e4m3", "block32"), ("fp8_e4m3", "static"),
           ("q8_0", "block32")]
IDS = ["int8", "fp8", "fp8-block32", "fp8-static", "q8_0"]


def _cache(kv_dtype, granularity, B, H, L, D, gen):
    """A layer's codes and scales, poisoned with random bytes (NaN codes included) so a write
    outside the new positions shows."""
    fmt = get_format(kv_dtype, granularity)
    kc = torch.randint(0, 256, (B, H, L, D), dtype=torch.uint8, generator=gen).view(fmt.code_dtype)
    vc = torch.randint(0, 256, (B, H, L, D), dtype=torch.uint8, generator=gen).view(fmt.code_dtype)
    if fmt.is_static:
        ks, vs = torch.rand(H, generator=gen) * 0.01 + 0.005, torch.rand(H, generator=gen) * 0.01 + 0.005
    else:
        shape = fmt.scale_shape(B, H, L, D)
        ks = torch.rand(shape, generator=gen).to(fmt.scale_dtype)
        vs = torch.rand(shape, generator=gen).to(fmt.scale_dtype)
    return kc, ks, vc, vs


def _tokens(B, H, T, D, gen):
    """Random tokens, some of them made hard: ties, saturation, zeros, subnormals, NaN, Inf."""
    x = torch.randn(B, H, T, D, generator=gen) * 3
    x[0, 0, 0] = torch.arange(D) - D / 2 + 0.5  # half-way values once scaled (amax = D/2 - 0.5 ...)
    x[0, 0, 0, 0] = 127.0  # ... amax 127 under int8 / q8_0-like scales: x / s = x, ties at k + 0.5
    x[0, -1, 0] = 0.0  # an all-zero token: scale 0
    if T > 1:
        x[-1, 0, 1] = torch.randn(D, generator=gen) * 1e-41  # subnormal fp32: amax / 127 underflows
        x[-1, -1, 1, 3] = float("nan")
        x[-1, -1, 1, 5] = float("inf")
        x[0, 0, T - 1, 7] = float("-inf")
        x[0, 0, T - 1, 8] = 1e30
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that a NaN's sign and payload are free: which NaN ``x - offset`` gives
    for a NaN ``x`` is the CPU's choice, eager and fused alike (e4m3 codes 0x7F / 0xFF)."""
    if a.dtype == torch.int8:
        return bits_equal(a, b)
    fa, fb = a.float(), b.float()
    nan = torch.isnan(fa)
    return bool(torch.equal(nan, torch.isnan(fb))) and bits_equal(torch.where(nan, 0.0, fa), torch.where(nan, 0.0, fb))


@pytest.fixture(scope="module")
def compiled_store():
    torch._dynamo.reset()
    yield torch.compile(reference.store_kv_traced, fullgraph=True)
    torch._dynamo.reset()


@pytest.mark.parametrize("kv_dtype,granularity", FORMATS, ids=IDS)
def test_compiled_store_writes_the_ops_bits(kv_dtype, granularity, compiled_store):
    B, H, L, D, T, start = 2, 2, 16, 64, 3, 5
    gen = torch.Generator().manual_seed(11)
    ours = _cache(kv_dtype, granularity, B, H, L, D, gen)
    theirs = [t.clone() for t in ours]
    k, v = _tokens(B, H, T, D, gen), _tokens(B, H, T, D, gen)
    offset = torch.randn(H, D, generator=gen) * 0.1
    k_rot = rotation.hadamard(D) if kv_dtype == "int8" else None  # int8's default: K rotated
    compiled_store(*ours, k, v, torch.tensor(start), offset, k_rot, None)
    reference.store_kv(*theirs, k, v, torch.tensor(start), offset, k_rot, None)
    for name, a, b in zip(("k codes", "k scales", "v codes", "v scales"), ours, theirs):
        assert _same(a, b), f"{kv_dtype}/{granularity}: the compiled store's {name} differ from the op's"
    # the control: the NaN token reached its slot (int8 formats: a NaN scale; e4m3: a NaN code)
    nan_code = torch.isnan(ours[2][-1, -1, start + 1].float()).any()
    nan_scale = ours[3].dim() > 1 and torch.isnan(ours[3][-1, -1, start + 1].float()).any()
    assert nan_scale if ours[2].dtype == torch.int8 else nan_code


def test_compiled_store_stops_at_the_end(compiled_store):
    gen = torch.Generator().manual_seed(12)
    kc, ks, vc, vs = _cache("int8", "token", 1, 2, 8, 64, gen)
    k = torch.randn(1, 2, 3, 64, generator=gen)
    compiled_store(kc, ks, vc, vs, k, k, torch.tensor(5), None)  # exactly up to the end is fine
    with pytest.raises(RuntimeError, match="writing past max_cache_len; build the cache with a larger"):
        compiled_store(kc, ks, vc, vs, k, k, torch.tensor(6), None)


def _tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.usefixtures("dynamo_reset_around")
def test_compiled_cpu_model_traces_the_store(monkeypatch):
    """Compiled on the CPU, no call reaches the store op (Inductor runs the traced store) and the
    cache holds what eager mode writes; eager mode runs the op."""
    model = _tiny_llama()
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    calls = []
    real = reference.store_kv

    def counting(*args, **kwargs):
        calls.append(args[4].shape[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "store_kv", counting)
    caches = {}
    for mode in ("eager", "compiled"):
        cache = kvcompile.QuantizedCache(model.config, max_batch_size=1, max_cache_len=16, kv_dtype="int8")
        forward = model.forward if mode == "eager" else torch.compile(model.forward, backend=kvcompile.backend("int8"))
        calls.clear()
        with torch.no_grad():
            logits = forward(input_ids=ids, past_key_values=cache, use_cache=True).logits
            nxt = logits[:, -1:].argmax(-1)
            forward(input_ids=nxt, past_key_values=cache, use_cache=True)
        caches[mode] = cache
        if mode == "eager":
            assert calls == [6, 6, 1, 1], calls  # the op's reference path, per layer and call
        else:
            assert calls == [], f"the compiled CPU graph called the store op {len(calls)} times"
    # the K/V reaching the store differ by float32 rounding between Inductor's projections and eager's,
    # so the caches agree to that: scales to 1e-5 relative, codes within one step where a value sat at a
    # rounding boundary (and the token count exactly)
    for a, b in zip(caches["eager"].layers, caches["compiled"].layers):
        assert int(a.cumulative_length) == int(b.cumulative_length) == 7
        for x, y in ((a.k_scales, b.k_scales), (a.v_scales, b.v_scales)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=0)
        for x, y in ((a.k_codes, b.k_codes), (a.v_codes, b.v_codes)):
            assert (x.int() - y.int()).abs().max() <= 1

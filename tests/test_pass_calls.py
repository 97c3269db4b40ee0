"""Every call a user makes, through real HF graphs: no attention_mask, ``past_key_values=`` or
``cache=``, chunked prefill, left padding, a 4-D mask, q_len 1 and q_len > 1 over a filled cache
(speculative verification), generate().

The pass-only backend (tests/pass_models.PassOnly) runs the rewritten Dynamo graph eagerly;
each test compiles its model once and drives every call shape through that one compiled forward.
Tolerance as in tests/test_pass.py: the same cache codes on both sides, both attentions in
float32 (reference op vs dequantize + SDPA), so logits differ by float32 summation order only.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import kvcompile
from models import tiny_model
from pass_models import _COMMON, VOCAB, PassOnly, fresh_dynamo

ATOL = RTOL = 2e-5
MAX_LEN = 32

# family -> (config class, tiny kwargs, kv_dtype, the cache keyword its calls use). q8_0 needs
# head_dim 32 (2 heads of hidden 64); StableLM is MHA, Granite MQA, Llama / OLMo2 GQA.
NO_MASK_FAMILIES = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2), "fp8_e4m3", "past_key_values"),
    "granite": ("GraniteConfig", dict(num_attention_heads=2, num_key_value_heads=1), "q8_0", "cache"),
    "olmo2": ("Olmo2Config", dict(num_attention_heads=4, num_key_value_heads=2), "fp8_e4m3", "past_key_values"),
    "stablelm": ("StableLmConfig", dict(num_attention_heads=2, num_key_value_heads=2), "q8_0", "cache"),
}


def _model(family: str, attn: str = "sdpa"):
    cls, kw, kv_dtype, cache_kw = NO_MASK_FAMILIES[family]
    cfg = getattr(transformers, cls)(**_COMMON, **kw)
    cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = None
    return tiny_model(cfg, attn), kv_dtype, cache_kw


def _cache(model, kv_dtype, batch=2, lazy=True):
    """``device=None`` (allocated on the first update) is what a user writes; it is also the case
    where HF skips the mask of an unmasked prefill (the cache has no length tensor yet)."""
    return kvcompile.QuantizedCache(model.config, max_batch_size=batch, max_cache_len=MAX_LEN, kv_dtype=kv_dtype,
                                    device=None if lazy else "cpu")


def _ids(batch=2, length=13, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _drive(forward, cache, calls, cache_kw):
    """Run ``calls`` [(input_ids, attention_mask, rows)] over one cache; logits of each call at
    ``rows`` (a bool mask of real positions, or None for all)."""
    out = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values= is deprecated in 5.24
        for ids, mask, rows in calls:
            logits = forward(input_ids=ids, attention_mask=mask, **{cache_kw: cache}).logits
            out.append(logits if rows is None else logits[rows])
    return out


def _check(backend, layers, expected, got):
    for _, after, report in backend.graphs:
        assert (report.found, report.rewritten, report.skipped) == (layers, layers, []), report
        assert after["kv_attention"] == layers and after["sdpa"] == after["dequantize"] == 0, after
    assert len(expected) == len(got)
    for i, (e, g) in enumerate(zip(expected, got)):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"call {i}: {m}")


@pytest.mark.parametrize("family", list(NO_MASK_FAMILIES))
def test_no_mask_prefill_and_decode(family):
    """``model(ids, past_key_values=cache)`` with no attention_mask (issue: every site was left
    unrewritten). HF's unmasked prefill is ``is_causal=True`` SDPA over K/V sliced to the prompt:
    the prefill graph is rewritten through the ``slice`` spelling, decode through a mask."""
    fresh_dynamo()
    model, kv_dtype, cache_kw = _model(family)
    layers = model.config.num_hidden_layers
    ids = _ids()
    calls = [(ids[:, :6], None, None), (ids[:, 6:7], None, None), (ids[:, 7:8], None, None)]
    expected = _drive(model.forward, _cache(model, kv_dtype), calls, cache_kw)
    backend = PassOnly(kv_dtype)
    got = _drive(torch.compile(model.forward, backend=backend, fullgraph=True), _cache(model, kv_dtype), calls,
                 cache_kw)
    assert len(backend.graphs) == 2, "expected one prefill and one decode graph"
    _check(backend, layers, expected, got)
    prefill, decode = (r.patterns for _, _, r in backend.graphs)
    assert len(prefill) == 1 and next(iter(prefill)).startswith("sdpa[") and "slice" in next(iter(prefill)), prefill
    assert not any("slice" in k for k in decode), decode


def test_call_shapes_through_one_compile():
    """One compiled Llama forward serves, each against eager over an identical cache:
    (a) no mask: chunked prefill (4 + 4 tokens), decode, 3 tokens verified at once over the filled
    cache (speculative decoding), decode; (b) chunked prefill and decode of a left-padded batch
    with a 2-D mask; (c) a prefill with a user-built 4-D additive mask over the cache. Eight
    graphs (dynamic=False: one per shape)."""
    fresh_dynamo()
    model, kv_dtype, _ = _model("llama")
    layers = model.config.num_hidden_layers
    ids = _ids()
    backend = PassOnly(kv_dtype)
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)
    limit = torch._dynamo.config.patch(recompile_limit=16)
    spans = [(0, 4), (4, 8), (8, 9), (9, 12), (12, 13)]

    no_mask = [(ids[:, a:b], None, None) for a, b in spans]
    pad = torch.ones(2, 13, dtype=torch.long)
    pad[0, :3] = 0  # row 0 left-padded by 3
    padded = [(ids[:, a:b], pad[:, :b], pad[:, a:b].bool()) for a, b in spans[:3]]

    def mask_4d(a, b):
        keep = torch.arange(MAX_LEN).view(1, -1) < torch.arange(a + 1, b + 1).view(-1, 1)
        return torch.zeros(2, 1, b - a, MAX_LEN).masked_fill(~keep, torch.finfo(torch.float32).min)

    four_d = [(ids[:, :6], mask_4d(0, 6), None)]
    expected, got = [], []
    for calls, lazy in ((no_mask, True), (padded, False), (four_d, False)):
        expected += _drive(model.forward, _cache(model, kv_dtype, lazy=lazy), calls, "cache")
        with limit:
            got += _drive(compiled, _cache(model, kv_dtype, lazy=lazy), calls, "cache")
    _check(backend, layers, expected, got)
    labels = {k for _, _, r in backend.graphs for k in r.patterns}
    assert {"sdpa[slice]", "sdpa[repeat_kv]"} <= labels, labels


@pytest.mark.parametrize("through", ["pass", pytest.param("inductor", marks=pytest.mark.slow)])
def test_generate_without_mask(through):
    """The issue's call end to end: ``generate(ids, past_key_values=cache)``, no attention_mask, a
    lazily allocated cache; the pass alone, or kvcompile.backend (the pass + Inductor, slow on
    CPU): every graph rewritten (prefill through the slice), the same tokens and scores as eager
    generate (1e-4 through Inductor: its fused reductions, as in tests/test_backend.py)."""
    fresh_dynamo()
    model, kv_dtype, _ = _model("llama")
    ids = _ids(batch=1, length=6)
    gen = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref = model.generate(ids, past_key_values=_cache(model, kv_dtype, batch=1), **gen)
        backend = kvcompile.backend(kv_dtype) if through == "inductor" else PassOnly(kv_dtype)
        model.forward = torch.compile(model.forward, backend=backend, fullgraph=True)
        out = model.generate(ids, past_key_values=_cache(model, kv_dtype, batch=1), **gen)
    assert torch.equal(out.sequences, ref.sequences)
    tol = 1e-4 if through == "inductor" else ATOL
    for e, g in zip(ref.scores, out.scores):
        torch.testing.assert_close(g, e, atol=tol, rtol=tol)
    layers = model.config.num_hidden_layers
    reports = backend.report() if through == "inductor" else [r.as_dict() for _, _, r in backend.graphs]
    assert len(reports) >= 2 and all(
        r == {"found": layers, "rewritten": layers, "skipped": [], "kv_dtype": kv_dtype} for r in reports), reports
    if through == "pass":
        assert "slice" in next(iter(backend.graphs[0][2].patterns))


def test_flex_attention_is_left_alone_with_the_fix_named():
    """attn_implementation='flex_attention' is no form the pass rewrites: the graph runs as it was
    (logits equal the uncompiled model's over the same cache format) and the report's reason says
    which implementations kvcompile's kernels serve."""
    fresh_dynamo()
    model, kv_dtype, cache_kw = _model("llama", "flex_attention")
    ids = torch.randint(3, VOCAB, (1, 7))
    backend = PassOnly(kv_dtype)
    compiled = torch.compile(model.forward, backend=backend)
    outs = []
    with torch.no_grad():
        for fn in (model.forward, compiled):
            cache = kvcompile.QuantizedCache(model.config, max_batch_size=1, max_cache_len=MAX_LEN, kv_dtype=kv_dtype)
            outs.append(fn(input_ids=ids, **{cache_kw: cache}).logits)
    torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=RTOL)
    reports = [report for _, after, report in backend.graphs if report.found]
    assert sum(r.found for r in reports) == 2 and all(r.rewritten == 0 for r in reports)
    assert all("attn_implementation='sdpa'" in reason for r in reports for _, reason in r.skipped)

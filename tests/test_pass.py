"""KVAttentionPass on real HF graphs and on each spelling: op counts before/after, then numerics.

The pass-only backend (tests/pass_models.PassOnly) runs the rewritten Dynamo graph eagerly,
so these tests cost tracing only; tests/test_backend.py runs the same models through Inductor.

Tolerance: both sides use the same cache codes and the reference math in float32 (eager:
``reference.dequantize`` to fp32 then SDPA / matmul-softmax in fp32; rewritten: ``reference.attention``
in fp32 over the same codes), so they differ only by float32 summation order: ~1e-6.
"""

from __future__ import annotations

import os


import pytest
import torch
import torch.nn.functional as F

import kvcompile
from kvcompile import tiles
from kvcompile.passes import ATTENTION_FORMS, KV_SPELLINGS, KVAttentionPass
from models import tiny_model
from pass_models import (
    FAMILIES,
    PassOnly,
    fresh_dynamo,
    greedy,
    model_cache,
    make_model,
    prompt,
)
from utils import id_of

ATOL = RTOL = 2e-5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_attention_is_rewritten(family, attn):
    """Every layer's attention over the cache -> one kvcompile::attention, in prefill and decode
    graphs; left-padded batch on even families, unpadded on odd ones (both masks are 4-D:
    bool for sdpa, additive for eager). Logits match the eager model at real positions."""
    padded = list(FAMILIES).index(family) % 2 == 0
    fresh_dynamo()
    model, kv_dtype = make_model(family, attn)
    layers = model.config.num_hidden_layers
    ids, mask = prompt(padded)
    expected = greedy(model.forward, model, model_cache(model, kv_dtype, padded=padded), ids, mask, steps=3)

    backend = PassOnly(kv_dtype)
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
    got = greedy(compiled, model, model_cache(model, kv_dtype, padded=padded), ids, mask, steps=3)

    assert len(backend.graphs) >= 2, "expected a prefill and a decode graph"
    anchor = "sdpa" if attn == "sdpa" else "softmax"
    for before, after, report in backend.graphs:
        assert before[anchor] == layers and before["dequantize"] == 2 * layers, before
        assert after[anchor] == 0 and after["dequantize"] == 0 and after["kv_attention"] == layers, after
        assert (report.found, report.rewritten, report.skipped) == (layers, layers, [])
        assert report.kv_dtype == kv_dtype
        if attn == "eager":  # both attention matmuls of every layer are gone (RoPE may use one: 5.17)
            assert after["matmul"] == before["matmul"] - 2 * layers
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


def _pass_only_matches_eager(family: str, padded: bool) -> "PassOnly":
    """Prefill + 2 decode steps of a tiny sdpa model, eager and through the pass (no Inductor);
    asserts equal logits and returns the backend holding each graph before/after."""
    fresh_dynamo()
    model, kv_dtype = make_model(family, "sdpa")
    ids, mask = prompt(padded)
    expected = greedy(model.forward, model, model_cache(model, kv_dtype, padded=padded), ids, mask, steps=2)
    backend = PassOnly(kv_dtype)
    got = greedy(torch.compile(model.forward, backend=backend, fullgraph=True), model,
                 model_cache(model, kv_dtype, padded=padded), ids, mask, steps=2)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
    return backend


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_padded_and_unpadded_both_rewrite(family):
    """The other padding case for two families (GQA and MHA), sdpa + decode."""
    padded = list(FAMILIES).index(family) % 2 == 1
    backend = _pass_only_matches_eager(family, padded)
    for _, after, report in backend.graphs:
        assert report.rewritten == report.found == 2 and after["sdpa"] == 0


def test_sdpa_enable_gqa(monkeypatch):
    """HF passes enable_gqa=True (no repeat_kv) on CUDA when there is no mask; force that decision
    on CPU (transformers 5.24 also reads TRANSFORMERS_SDPA_FORCE_GQA=1; 5.17 does not)."""
    from transformers.integrations import sdpa_attention

    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", lambda *args, **kwargs: True)
    backend = _pass_only_matches_eager("llama", padded=True)
    for _, after, report in backend.graphs:
        assert report.patterns == {"sdpa[direct]": 2}
        assert after["kv_attention"] == 2 and after["sdpa"] == 0


# ---------------------------------------------------------------------------------------------
# spellings HF does not emit on CPU under torch.compile: a one-layer module over the cache
# ---------------------------------------------------------------------------------------------

B, HQ, D, L = 2, 4, 32, 16


class _Cfg:
    """Minimal config for a QuantizedCache with one layer."""

    def __init__(self, hkv):
        self.num_hidden_layers = 1
        self.num_attention_heads = HQ
        self.num_key_value_heads = hkv
        self.head_dim = D
        self.hidden_size = HQ * D
        self.max_position_embeddings = L


def _repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _eager(q, k, v, mask, scaling, dropout_first=False):
    s = torch.matmul(q, k.transpose(2, 3)) * scaling
    if mask is not None:
        s = s + mask
    p = F.softmax(s, dim=-1, dtype=torch.float32)
    if dropout_first:
        p = F.dropout(p, p=0.0, training=False).to(q.dtype)
    else:
        p = F.dropout(p.to(q.dtype), p=0.0, training=False)
    return torch.matmul(p, v)


def _eager_fp32_scores(q, k, v, mask, scaling, cast="to"):
    """GPT-J / CodeGen (transformers 5): scores in float32 from ``query.to(float32)`` and
    ``key.to(float32)``, P cast back to V's dtype (``.type`` in GPT-2's spelling)."""
    s = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(2, 3)) * scaling
    if mask is not None:
        s = s + mask
    p = F.softmax(s, dim=-1)
    p = p.type(v.dtype) if cast == "type" else p.to(v.dtype)
    return torch.matmul(p, v)


SPELLINGS = {
    # name: (kv heads, attention(q, k, v, mask_bool, mask_add) -> out, uses which mask, rewritten?)
    "sdpa_gqa_nomask": (2, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), None),
    "sdpa_mqa_bool_scale": (1, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mb, enable_gqa=True, scale=0.3), "bool"),
    "sdpa_repeat_kv_additive": (2, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(
        q, _repeat_kv(k, 2), _repeat_kv(v, 2), ma), "add"),
    "sdpa_repeat_interleave": (2, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=mb), "bool"),
    "sdpa_torch_repeat_interleave": (1, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(
        q, torch.repeat_interleave(k, 4, dim=1), torch.repeat_interleave(v, 4, dim=1), mb), "bool"),
    "sdpa_mha_positional_mask": (4, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(q, k, v, mb, 0.0), "bool"),
    "eager_mha_nomask": (4, lambda q, k, v, mb, ma: _eager(q, k, v, None, D ** -0.5), None),
    "eager_gqa_additive": (2, lambda q, k, v, mb, ma: _eager(q, _repeat_kv(k, 2), _repeat_kv(v, 2), ma, 0.2), "add"),
    "eager_dropout_first": (1, lambda q, k, v, mb, ma: _eager(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), ma, 0.2, dropout_first=True), "add"),
    "eager_gpt2_type": (4, lambda q, k, v, mb, ma: _eager_fp32_scores(q, k, v, ma, 0.2, cast="type"), "add"),
}


class OneLayer(torch.nn.Module):
    def __init__(self, attention, hkv, trim=False):
        super().__init__()
        self.attention = attention
        self.hkv = hkv
        self.trim = trim

    def forward(self, q, k, v, cache, mask_bool, mask_add):
        keys, values = cache.update(k, v, 0)
        if self.trim and not torch.compiler.is_compiling():
            # no mask: the eager oracle attends to the stored tokens only (the op's kv_len semantics;
            # over the untrimmed buffer it would also attend to the zero keys of empty slots)
            n = int(cache.layers[0].cumulative_length)
            keys, values = keys[:, :, :n], values[:, :, :n]
        return self.attention(q, keys, values, mask_bool, mask_add)


def _masks(tq, start):
    """HF-style masks for queries at positions start..start+tq-1 over L slots, row 0 left-padded by 2."""
    pos = torch.arange(tq).view(-1, 1) + start
    keep = (torch.arange(L).view(1, -1) <= pos).expand(B, 1, tq, L).clone()
    keep[0, :, :, :2] = False
    add = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    return keep, add


def _run_one_layer(attention, hkv, kv_dtype="fp8_e4m3", steps=((5, True), (1, True), (1, True)), trim=False,
                   cache_kwargs=None):
    """Run prefill/decode chunks (tq, with_masks) eagerly and through the pass; return both outputs."""
    fresh_dynamo()
    torch.manual_seed(0)
    chunks = [(torch.randn(B, HQ, t, D), torch.randn(B, hkv, t, D), torch.randn(B, hkv, t, D)) for t, _ in steps]
    mod = OneLayer(attention, hkv, trim)
    backend = PassOnly(kv_dtype)
    compiled = torch.compile(mod, backend=backend, fullgraph=True)
    outs = []
    for fn in (mod, compiled):
        cache = kvcompile.QuantizedCache(_Cfg(hkv), max_batch_size=B, max_cache_len=L, kv_dtype=kv_dtype, device="cpu",
                                         **(cache_kwargs or {}))
        start, res = 0, []
        for (q, k, v), (t, _) in zip(chunks, steps):
            mb, ma = _masks(t, start)
            res.append(fn(q, k, v, cache, mb, ma))
            start += t
        outs.append(res)
    # padded query rows (no visible key) are undefined under any attention: compare real rows only
    real = []
    start = 0
    for t, _ in steps:
        mb, _ = _masks(t, start)
        real.append(mb.any(-1, keepdim=True).expand(B, HQ, t, D))
        start += t
    outs = [[o[r] for o, r in zip(res, real)] for res in outs]
    return outs, backend


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_is_rewritten(name):
    hkv, attention, mask = SPELLINGS[name]
    (expected, got), backend = _run_one_layer(attention, hkv, trim=mask is None)
    for before, after, report in backend.graphs:
        assert (report.found, report.rewritten, report.skipped) == (1, 1, []), report
        assert after["kv_attention"] == 1 and after["sdpa"] == after["softmax"] == after["dequantize"] == 0
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


N_KEPT = 12  # keys a slicing attention keeps of the L = 16 cache slots


def _sliced_sdpa(q, k, v, mb, ma):
    return F.scaled_dot_product_attention(q, k[:, :, :N_KEPT], v[:, :, :N_KEPT], attn_mask=mb[..., :N_KEPT])


#: K/V spelling -> (kv heads, attention(q, k, v, mask_bool, mask_add), op_counts key of its node kind,
#: how many of those nodes the rewrite removes). Every entry of KV_SPELLINGS has one.
TABLE_CASES = {
    "dequantize": (4, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(q, k, v, attn_mask=mb), "dequantize", 2),
    "repeat_kv": (2, lambda q, k, v, mb, ma: _eager(q, _repeat_kv(k, 2), _repeat_kv(v, 2), ma, 0.2), "expand", 2),
    "repeat_interleave": (2, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=mb), "repeat_interleave", 2),
    "torch.repeat_interleave": (1, lambda q, k, v, mb, ma: _eager(
        q, torch.repeat_interleave(k, 4, dim=1), torch.repeat_interleave(v, 4, dim=1), ma, 0.2),
        "torch.repeat_interleave", 2),
    # JetMoE's tiling: query head h reads kv head h mod 2 (the op's grouping reads h // 2: the pass permutes q)
    "tile": (2, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(
        q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), attn_mask=mb), "repeat", 2),
    # the mask's own slice stays; the op's length becomes min(kv_len, 12) and the mask is padded to 16
    "slice": (4, _sliced_sdpa, "getitem", 2),
    # two K/V copies go, the pass adds one for q
    "contiguous": (2, lambda q, k, v, mb, ma: F.scaled_dot_product_attention(
        q, k.contiguous(), v.contiguous(), attn_mask=mb, enable_gqa=True), "contiguous", 1),
    # GPT-J's key.to(float32) goes with its P.to(V's dtype); q's own cast stays (an fp32 query)
    "cast": (2, lambda q, k, v, mb, ma: _eager_fp32_scores(q, _repeat_kv(k, 2), _repeat_kv(v, 2), ma, 0.2), "cast", 2),
}


def test_every_spelling_has_a_table_case():
    assert set(TABLE_CASES) == set(KV_SPELLINGS)


@pytest.mark.parametrize("entry", list(TABLE_CASES))
def test_spelling_table_entry_fires(entry):
    """Each K/V spelling fires on a Dynamo graph: its nodes are gone after the rewrite, the report
    names it, and the output equals the un-rewritten graph's (prefill of 5, two decode steps)."""
    hkv, attention, kind, removed = TABLE_CASES[entry]
    (expected, got), backend = _run_one_layer(attention, hkv)
    assert len(backend.graphs) == 2
    for before, after, report in backend.graphs:
        assert (report.found, report.rewritten, report.skipped) == (1, 1, []), report
        (label,) = report.patterns
        assert (label.endswith("[direct]") if entry == "dequantize" else entry in label[label.index("["):]), label
        assert before[kind] >= removed and after[kind] == before[kind] - removed, (before, after)
        assert after["kv_attention"] == 1 and after["dequantize"] == after["sdpa"] == after["softmax"] == 0
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


def _fp32_query_read_twice(q, k, v, mb, ma):
    """GPT-J's spelling, with the float32 query also read outside the scores: it cannot be unwrapped."""
    qf = q.to(torch.float32)
    s = torch.matmul(qf, k.to(torch.float32).transpose(2, 3)) * D ** -0.5 + ma
    out = torch.matmul(F.softmax(s, dim=-1).to(v.dtype), v)
    return out + (qf.sum() * 0).to(out.dtype)


@pytest.mark.parametrize("query_read_twice", [False, True], ids=["unwrapped", "fp32-query"])
def test_a_16_bit_query_upcast_for_its_scores_reaches_the_op_as_it_is(query_read_twice):
    """GPT-J / CodeGen in bf16: the op takes the bf16 query, not its float32 copy (the kernels' 16-bit
    dots accumulate in float32), and answers in V's dtype as the site did; the result equals the
    eager graph's within bf16 rounding of its output (2^-8 relative, P rounded to bf16 there too).
    A float32 query that something else reads too stays float32, and the op's float32 answer is
    cast to the site's bf16."""
    fresh_dynamo()
    torch.manual_seed(0)
    attention = (_fp32_query_read_twice if query_read_twice
                 else lambda q, k, v, mb, ma: _eager_fp32_scores(q, k, v, ma, D ** -0.5))  # noqa: E731
    mod, backend = OneLayer(attention, 4), PassOnly("fp8_e4m3")
    compiled = torch.compile(mod, backend=backend, fullgraph=True)
    q, k, v = (torch.randn(B, 4, 5, D, dtype=torch.bfloat16) for _ in range(3))
    mb, ma = _masks(5, 0)
    outs = []
    for fn in (mod, compiled):
        cache = kvcompile.QuantizedCache(_Cfg(4), max_batch_size=B, max_cache_len=L, kv_dtype="fp8_e4m3", device="cpu")
        outs.append(fn(q, k, v, cache, mb, ma.to(torch.bfloat16)))
    (_, after, report), = backend.graphs
    assert report.rewritten == 1 and after["kv_attention"] == 1
    (args,), = backend.calls
    q_op = args[0].args[0]  # the op's query, through the contiguous the pass adds
    if query_read_twice:
        assert q_op.meta["example_value"].dtype == torch.float32 and q_op.op == "call_method"
    else:
        assert q_op.meta["example_value"].dtype == torch.bfloat16 and q_op.op == "placeholder"
    real = mb.any(-1, keepdim=True).expand_as(outs[0])
    assert outs[1].dtype == outs[0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[1][real].float(), outs[0][real].float(), atol=2e-2, rtol=2e-2)


def test_slice_sets_the_length_bound():
    """A slice to 12 of 16 keys: the op's kv_len is min(kv_len, 12) and the 12-key mask is padded to 16."""
    _, backend = _run_one_layer(_sliced_sdpa, 4, steps=((5, True),))
    (args,), = backend.calls
    kv_len, mask = args[5], args[6]
    assert kv_len.target == "clamp" and kv_len.kwargs == {"max": N_KEPT}
    assert mask.target is F.pad and mask.args[1] == (0, L - N_KEPT)


def test_is_causal_when_queries_fill_the_cache():
    """is_causal with Tq == L: top-left == bottom-right; rewritten with the cache's own length."""
    (expected, got), backend = _run_one_layer(
        lambda q, k, v, mb, ma: F.scaled_dot_product_attention(q, k, v, is_causal=True), 4, steps=((L, False),))
    (_, after, report), = backend.graphs
    assert report.rewritten == 1 and after["kv_attention"] == 1
    torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=RTOL)


def test_is_causal_prefill_shorter_than_cache():
    """is_causal with Tq < L (empty cache, then a second chunk): SDPA's top-left causal is reproduced
    exactly through kv_len = min(kv_len, Tq), proven by the layer's cumulative_length.add_(Tq)."""
    (expected, got), backend = _run_one_layer(
        lambda q, k, v, mb, ma: F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True),
        2, steps=((5, False), (5, False)))
    for _, after, report in backend.graphs:
        assert report.rewritten == 1 and after["kv_attention"] == 1
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


class _NoLengthProof(torch.nn.Module):
    """Reads a kvcompile cache whose length comes from outside: nothing proves kv_len >= Tq."""

    def forward(self, q, k_codes, k_scale, v_codes, v_scale, kv_len):
        k = torch.ops.kvcompile.dequantize(k_codes, k_scale, None, kv_len, q.dtype, format=id_of(k_codes, k_scale))
        v = torch.ops.kvcompile.dequantize(v_codes, v_scale, None, kv_len, q.dtype, format=id_of(v_codes, v_scale))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_unprovable_is_causal_is_skipped_with_reason():
    fresh_dynamo()
    codes = torch.zeros(B, 4, L, D, dtype=torch.float8_e4m3fn)
    scale = torch.ones(B, 4, L, 1)
    backend = PassOnly("fp8_e4m3")
    q = torch.randn(B, 4, 3, D)
    args = (q, codes, scale, codes.clone(), scale.clone(), torch.tensor(8))
    out = torch.compile(_NoLengthProof(), backend=backend, fullgraph=True)(*args)
    torch.testing.assert_close(out, _NoLengthProof()(*args))
    (_, after, report), = backend.graphs
    assert report.found == 1 and report.rewritten == 0 and after["sdpa"] == 1
    (site, reason), = report.skipped
    assert "is_causal" in reason and "top-left" in reason


class _VFirst(torch.nn.Module):
    """Dequantizes V before K (the cache's update does K first): the site's roles come from the attention."""

    def forward(self, q, k_codes, k_scale, v_codes, v_scale, kv_len, mask):
        v = torch.ops.kvcompile.dequantize(v_codes, v_scale, None, kv_len, q.dtype, format=id_of(v_codes, v_scale))
        k = torch.ops.kvcompile.dequantize(k_codes, k_scale, None, kv_len, q.dtype, format=id_of(k_codes, k_scale))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_v_dequantized_before_k():
    fresh_dynamo()
    torch.manual_seed(0)
    k_codes, k_scale = kvcompile.formats.quantize(torch.randn(B, 4, L, D), torch.float8_e4m3fn)
    v_codes, v_scale = kvcompile.formats.quantize(torch.randn(B, 4, L, D), torch.float8_e4m3fn)
    mask = (torch.arange(L) < 8).view(1, 1, 1, L).expand(B, 1, 3, L)
    args = (torch.randn(B, 4, 3, D), k_codes, k_scale, v_codes, v_scale, torch.tensor(8), mask)
    backend = PassOnly("fp8_e4m3")
    out = torch.compile(_VFirst(), backend=backend, fullgraph=True)(*args)
    (_, after, report), = backend.graphs
    assert (report.found, report.rewritten) == (1, 1) and after["kv_attention"] == 1
    (call,) = backend.calls[0]
    assert "k_codes" in call[1].name and "v_codes" in call[3].name
    torch.testing.assert_close(out, _VFirst()(*args), atol=ATOL, rtol=RTOL)


def test_dropout_is_skipped_with_reason():
    _, backend = _run_one_layer(
        lambda q, k, v, mb, ma: F.scaled_dot_product_attention(q, k, v, attn_mask=mb, dropout_p=0.1), 4,
        steps=((3, True),))
    (_, after, report), = backend.graphs
    assert report.found == 1 and report.rewritten == 0 and after["sdpa"] == 1
    (site, reason), = report.skipped
    assert "dropout_p=0.1" in reason


def _scores(q, k):
    return torch.matmul(q, k.transpose(2, 3)) * 0.2


def _finish(q, s, v):
    return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _alibi(q, k, v, mb, ma):
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(1, HQ, 1, 1)
    return _finish(q, _scores(q, k) + slopes * torch.arange(L).view(1, 1, 1, L) + ma, v)


def _softcapped(q, k, v, mb, ma):
    return _finish(q, torch.tanh(_scores(q, k) / 2.0) * 2.0 + ma, v)


def _probs_read_twice(q, k, v, mb, ma):
    p = F.softmax(_scores(q, k) + ma, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v) + p.sum() * 0


#: name -> (attention, cache kwargs, words of the reason, whether eager and compiled outputs compare)
LEFT_ALONE = {
    "alibi_bias": (_alibi, None, "second additive term", True),
    "masked_fill": (lambda q, k, v, mb, ma: _finish(q, _scores(q, k).masked_fill(~mb, -1e9), v), None,
                    "masked_fill", True),
    # a where-mask (GPT-Neo's spelling) whose fill does not mask: the scores of dropped keys become -5
    "where_fill_not_masking": (lambda q, k, v, mb, ma: _finish(q, torch.where(mb, _scores(q, k), -5.0), v), None,
                               "not a masking value", True),
    "probabilities_read_elsewhere": (_probs_read_twice, None, "read by several nodes", True),
    "training_dropout": (lambda q, k, v, mb, ma: torch.matmul(F.dropout(
        F.softmax(_scores(q, k) + ma, dim=-1, dtype=torch.float32), p=0.1, training=True).to(q.dtype), v), None,
        "training mode", False),
    "softcap_with_k_offset": (_softcapped, {"calibration": {"k_offset": torch.randn(1, HQ, D)}}, "K centering", True),
    # tiled kv heads under a mask with a head dim: the query's heads would be regrouped, the mask's not
    "tiled_heads_head_mask": (lambda q, k, v, mb, ma: F.scaled_dot_product_attention(
        q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), attn_mask=mb.expand(-1, HQ, -1, -1)), None,
        "mask with a head dim", True),
}


@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_left_alone_with_reason(name):
    """What the op cannot compute stays as it is (Inductor compiles it), reported with its reason."""
    attention, cache_kwargs, words, compare = LEFT_ALONE[name]
    hkv = 2 if name.startswith("tiled_heads") else HQ
    (expected, got), backend = _run_one_layer(attention, hkv, steps=((5, True),), cache_kwargs=cache_kwargs)
    (before, after, report), = backend.graphs
    assert (report.found, report.rewritten) == (1, 0) and after["kv_attention"] == 0, report
    (site, reason), = report.skipped
    assert words in reason, reason
    if compare:
        torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_head_dim_without_a_kernel_is_left_alone_on_triton(kernels, monkeypatch):
    """Where the op would run the Triton kernels, a head dim they do not serve (Gemma 4's 512-dim
    global layers) leaves the site to the graph's own attention over the dequantized cache, with the
    reason; the reference serves every head dim, so there the same site is rewritten (the control)."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on these CPU tensors need TRITON_INTERPRET=1")
    monkeypatch.setenv("KVCOMPILE_KERNELS", kernels)
    monkeypatch.setattr(tiles, "SUPPORTED_HEAD_DIMS", tuple(d for d in tiles.SUPPORTED_HEAD_DIMS if d != D))
    hkv, attention, _ = SPELLINGS["sdpa_repeat_kv_additive"]
    (expected, got), backend = _run_one_layer(attention, hkv, steps=((5, True), (1, True)))
    for _, after, report in backend.graphs:
        if kernels == "reference":
            assert (report.found, report.rewritten, report.skipped) == (1, 1, []) and after["kv_attention"] == 1
            continue
        assert (report.found, report.rewritten) == (1, 0) and after["kv_attention"] == 0 and after["sdpa"] == 1
        (_, reason), = report.skipped
        assert f"head_dim {D}" in reason and "Triton attention kernels" in reason, reason
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


def test_k_and_v_formats():
    """kv_dtype sets both, k_dtype / v_dtype override; a cache of another format is a clear error
    naming the operand."""
    # nothing given: the documented default format on both sides
    assert (KVAttentionPass().k_dtype, KVAttentionPass().v_dtype) == (kvcompile.DEFAULT_KV_DTYPE,) * 2 == ("int8",) * 2
    mixed = KVAttentionPass("fp8_e4m3", v_dtype="q8_0")
    assert (mixed.k_dtype, mixed.v_dtype, mixed.kv_dtype) == ("fp8_e4m3", "q8_0", "fp8_e4m3/q8_0")
    other = KVAttentionPass(k_dtype="int8", v_dtype="fp8_e4m3")
    assert len({mixed.uuid(), KVAttentionPass("fp8_e4m3").uuid(), other.uuid()}) == 3
    with pytest.raises(ValueError, match="unknown v_dtype 'int4'"):
        KVAttentionPass(v_dtype="int4")
    fresh_dynamo()
    mod = OneLayer(lambda q, k, v, mb, ma: F.scaled_dot_product_attention(q, k, v, attn_mask=mb), 4)
    cache = kvcompile.QuantizedCache(_Cfg(4), max_batch_size=B, max_cache_len=L, kv_dtype="fp8_e4m3", device="cpu")
    q, kv = torch.randn(B, HQ, 3, D), torch.randn(B, 4, 3, D)
    mb, ma = _masks(3, 0)
    backend = PassOnly("fp8_e4m3")
    backend.graph_pass = mixed
    told = (r"backend\(k_dtype='fp8_e4m3', v_dtype='q8_0'\) compiled a model whose kvcompile cache holds K and V as "
            r"'fp8_e4m3' codes\. Build the backend with kv_dtype='fp8_e4m3'")
    with pytest.raises(Exception, match=told):
        torch.compile(mod, backend=backend, fullgraph=True)(q, kv, kv, cache, mb, ma)


def test_tables_are_explicit_and_uuid_is_stable():
    assert {"dequantize", "repeat_kv", "repeat_interleave", "torch.repeat_interleave", "slice"} <= set(KV_SPELLINGS)
    assert {"sdpa", "eager", "softcap", "sinks"} <= set(ATTENTION_FORMS)
    a, b, c = KVAttentionPass("fp8_e4m3"), KVAttentionPass("fp8_e4m3"), KVAttentionPass("q8_0")
    assert a.uuid() == b.uuid() != c.uuid()


def _eager_in_place(q, k, v, ma, into_mask):
    """Falcon's ``scores /= sqrt(d)``; with ``into_mask``, the scores added into the mask in place."""
    s = torch.matmul(q, k.transpose(2, 3))
    s /= D ** 0.5
    if into_mask:
        m = ma.expand(-1, HQ, -1, -1).clone()
        m += s
        s = m
    else:
        s += ma
    return torch.matmul(F.softmax(s, dim=-1), v)


@pytest.mark.parametrize("into_mask", [False, True], ids=["scores", "into-mask"])
def test_in_place_score_ops(into_mask):
    """In-place scaling and masking of the scores are the out-of-place ops on an intermediate with one
    reader: rewritten. Scores added into the mask in place (the mask is the one mutated) are left alone."""
    (expected, got), backend = _run_one_layer(lambda q, k, v, mb, ma: _eager_in_place(q, k, v, ma, into_mask), 4)
    for _, after, report in backend.graphs:
        if into_mask:
            assert report.rewritten == 0 and "in place" in report.skipped[0][1], report.skipped
        else:
            assert (report.found, report.rewritten) == (1, 1) and after["kv_attention"] == 1
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


def test_no_cache_graph_is_untouched():
    fresh_dynamo()
    backend = PassOnly("fp8_e4m3")

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    x = torch.randn(1, 2, 4, 8)
    torch.compile(f, backend=backend, fullgraph=True)(x, x, x)
    (before, after, report), = backend.graphs
    assert before == after and report.as_dict() == {"found": 0, "rewritten": 0, "skipped": [], "kv_dtype": "fp8_e4m3"}


@pytest.mark.parametrize("family", ["llama", "gemma3-ring"])
def test_dynamic_true(family):
    """dynamic=True: shapes are symbols and HF reads ``x.shape`` of the dequantized K/V (size() users);
    Python float scalings become graph inputs, so the site is skipped with a hint unless floats are
    specialised, and then rewritten. gemma3-ring: a sliding layer of window 4 (a ring, the 6-token
    prompt wraps it), whose dequantized K/V is longer than its codes: HF reads only dims 0, 1, 3."""
    if family == "gemma3-ring":
        model, kv_dtype = tiny_model("gemma3", "sdpa", sliding_window=4), "int8"
        assert model.config.layer_types[0] == "sliding_attention"
    else:
        model, kv_dtype = make_model(family, "sdpa")
    padded = True
    ids, mask = prompt(padded)
    expected = greedy(model.forward, model, model_cache(model, kv_dtype, padded=padded), ids, mask, steps=2)
    for specialize in (False, True):
        fresh_dynamo()
        backend = PassOnly(kv_dtype)
        with torch._dynamo.config.patch(specialize_float=specialize):
            got = greedy(torch.compile(model.forward, backend=backend, dynamic=True), model,
                         model_cache(model, kv_dtype, padded=padded), ids, mask, steps=2)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
        for _, after, report in backend.graphs:
            if specialize:
                assert report.rewritten == report.found == 2 and after["sdpa"] == 0
            else:
                assert report.rewritten == 0 and all("specialize_float" in r for _, r in report.skipped)


def test_a_cache_read_beside_the_attention_keeps_its_dequantize():
    """V read by the attention and by something else (Doge's dynamic mask reads the cached V): the attention
    becomes the op over the codes, the dequantize of V stays for the other reader (the report says so), and
    the output equals the un-rewritten graph's. The other reader is a real term: without it the output moves."""
    def attention(q, k, v, mb, ma):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mb) + v.sum(dim=2, keepdim=True)

    (expected, got), backend = _run_one_layer(attention, HQ)
    assert len(backend.graphs) == 2
    for before, after, report in backend.graphs:
        assert (report.found, report.rewritten, report.skipped) == (1, 1, []), report
        assert report.patterns == {"sdpa[direct] +1 other reader of the dequantized cache": 1}, report.patterns
        assert before["dequantize"] == 2 and after["dequantize"] == 1 and after["kv_attention"] == 1
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
    (plain, _), _ = _run_one_layer(lambda q, k, v, mb, ma: F.scaled_dot_product_attention(q, k, v, attn_mask=mb), HQ)
    assert max((p - e).abs().max().item() for p, e in zip(plain, expected)) > 100 * ATOL

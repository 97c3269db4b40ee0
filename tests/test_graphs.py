"""kvcompile.BatchPaddedForward: a live batch runs at the next captured batch size (CPU).

The CUDA-graph side (one capture per size, reused by a smaller live batch) is in
test_cudagraphs.py. Here: the size table, clear errors, and that padding changes nothing for the
live rows, eager and compiled, with no new compile when a second batch maps to a size already
seen. Tolerance: padded and unpadded runs hold bit-identical cache codes for the live rows and
differ only in how CPU matmuls group a batch of 3 vs 4 rows (float32 rounding, ~1e-6); 1e-4
as in test_backend.py.
"""

from __future__ import annotations

import pytest
import torch

import kvcompile
from models import cache_kwarg
from pass_models import greedy, model_cache, make_model, prompt

ATOL = RTOL = 1e-4


pytestmark = pytest.mark.usefixtures("dynamo_reset_around")


def test_default_capture_sizes():
    assert kvcompile.default_capture_sizes(1) == (1,)
    assert kvcompile.default_capture_sizes(8) == (1, 2, 4, 8)
    assert kvcompile.default_capture_sizes(6) == (1, 2, 4, 6)
    assert kvcompile.default_capture_sizes(33) == (1, 2, 4, 8, 16, 32, 33)


def test_padded_size_and_clear_errors():
    fwd = kvcompile.BatchPaddedForward(lambda **kw: kw, max_batch_size=8, capture_sizes=(8, 2, 4, 2))
    assert fwd.capture_sizes == (2, 4, 8)
    assert [fwd.padded_size(b) for b in (1, 2, 3, 4, 5, 8)] == [2, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="exceeds the largest capture size 8"):
        fwd.padded_size(9)
    with pytest.raises(ValueError, match=r"capture sizes \[16\] exceed max_batch_size=8"):
        kvcompile.BatchPaddedForward(lambda **kw: kw, max_batch_size=8, capture_sizes=(4, 16))
    with pytest.raises(ValueError, match="positive ints"):
        kvcompile.BatchPaddedForward(lambda **kw: kw, max_batch_size=8, capture_sizes=(0, 4))
    with pytest.raises(TypeError, match="callable"):
        kvcompile.BatchPaddedForward(None, max_batch_size=8)
    with pytest.raises(ValueError, match="attention_mask has batch 2, input has 3"):
        fwd(input_ids=torch.zeros(3, 1, dtype=torch.long), attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="input_ids or inputs_embeds"):
        fwd(attention_mask=torch.ones(2, 5))


def test_pads_by_repeating_the_last_row_and_slices_outputs():
    seen = {}

    def forward(**kw):
        seen.update(kw)
        ids = kw["input_ids"]
        return {"logits": ids.float() * 2, "hidden_states": (ids, ids + 1), "past_key_values": "cache", "n": 7}

    fwd = kvcompile.BatchPaddedForward(forward, max_batch_size=4)
    ids = torch.tensor([[5], [6], [7]])
    mask = torch.tensor([[0, 1], [1, 1], [1, 0]])
    out = fwd(ids, attention_mask=mask, cache_position=torch.tensor([3]))
    assert torch.equal(seen["input_ids"], torch.tensor([[5], [6], [7], [7]]))
    assert torch.equal(seen["attention_mask"], torch.tensor([[0, 1], [1, 1], [1, 0], [1, 0]]))
    assert torch.equal(seen["cache_position"], torch.tensor([3]))  # not batch-shaped: untouched
    assert torch.equal(out["logits"], ids.float() * 2)
    assert all(torch.equal(h, e) for h, e in zip(out["hidden_states"], (ids, ids + 1)))
    assert out["past_key_values"] == "cache" and out["n"] == 7


def _three_prompts():
    ids, mask = prompt(True, batch=3)  # left padding on row 0
    return ids, mask


def test_padded_batch_matches_unpadded_eager():
    """A batch of 3 through a 4-row cache at capture size 4: the 3 live rows' logits at every step
    equal those of an unpadded run over a 3-row cache."""
    model, kv_dtype = make_model("llama", "sdpa")
    ids, mask = _three_prompts()
    max_len = ids.shape[1] + 6
    expected = greedy(model.forward, model, model_cache(model, kv_dtype, max_len, batch=3, padded=True), ids, mask,
                      steps=5)
    calls = []

    def forward(**kw):
        calls.append(kw["input_ids"].shape[0])
        return model.forward(**kw)

    padded = kvcompile.BatchPaddedForward(forward, max_batch_size=4, capture_sizes=(1, 2, 4))
    got = greedy(padded, model, model_cache(model, kv_dtype, max_len, batch=4, padded=True), ids, mask, steps=5)
    assert calls == [4] * 6
    for i, (e, g) in enumerate(zip(expected, got)):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {i}: {m}")


def test_generate_through_padded_compiled_forward_no_recompile_for_a_second_batch():
    """model.generate() with a BatchPaddedForward around the compiled forward: a batch of 3 then a
    batch of 4 (same cache, reset between) run at capture size 4, the second without compiling
    anything new; tokens equal eager generate over right-sized caches."""
    model, kv_dtype = make_model("llama", "sdpa")
    kw = cache_kwarg(model)
    ids4, mask4 = prompt(True, batch=4, seed=3)
    ids3, mask3 = ids4[:3], mask4[:3]
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    max_len = ids4.shape[1] + gen["max_new_tokens"] + 1
    with torch.no_grad():
        ref3 = model.generate(ids3, attention_mask=mask3, **{kw: model_cache(model, kv_dtype, max_len, 3, True)}, **gen)
        ref4 = model.generate(ids4, attention_mask=mask4, **{kw: model_cache(model, kv_dtype, max_len, 4, True)}, **gen)
        backend = kvcompile.backend(kv_dtype)
        eager_forward = model.forward
        model.forward = kvcompile.BatchPaddedForward(
            torch.compile(eager_forward, backend=backend, fullgraph=True), max_batch_size=4, capture_sizes=(2, 4))
        try:
            assert cache_kwarg(model) == kw  # the wrapper shows generate() the wrapped signature
            cache = model_cache(model, kv_dtype, max_len, 4, True)
            out3 = model.generate(ids3, attention_mask=mask3, **{kw: cache}, **gen)
            graphs = len(backend.report())
            cache.reset()
            with torch._dynamo.config.patch(error_on_recompile=True):
                out4 = model.generate(ids4, attention_mask=mask4, **{kw: cache}, **gen)
        finally:
            model.forward = eager_forward
    assert torch.equal(out3, ref3) and torch.equal(out4, ref4)
    assert graphs >= 1 and len(backend.report()) == graphs
    layers = model.config.num_hidden_layers
    assert all(r["rewritten"] == r["found"] == layers for r in backend.report())


@pytest.mark.parametrize("family, runs_at", [("gemma3", [4, 1]), ("qwen3_5", [4, 4])])
def test_generate_over_padded_batches_matches_right_sized_caches(family, runs_at):
    """A batch of 3, then (the cache reset) a batch of 1, through BatchPaddedForward at sizes 1, 2, 4 give
    the tokens of generate() over 3-row and 1-row caches.
    gemma3: generate() on transformers 5.2x builds the masks once per attention type (a sliding and a full one)
    and passes them as a dict; each is padded with the inputs (unpadded, attention raised a batch mismatch).
    qwen3_5: transformers sizes a hybrid model's recurrent state by its first forward, so over such a cache
    every batch runs at the largest size (a batch of 1 at its own size raises, naming the state's batch)."""
    from models import tiny_model

    if family == "qwen3_5" and kvcompile.hf.STATE_LAYER_BASE is None:
        pytest.skip("transformers without LinearAttentionLayer")
    torch.manual_seed(0)
    model = tiny_model(family)
    kw = cache_kwarg(model)
    ids = torch.randint(3, 96, (3, 6))
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)

    def cache(batch):
        return kvcompile.QuantizedCache(model.config, max_batch_size=batch, max_cache_len=16, device="cpu")

    calls = []
    eager_forward = model.forward

    def forward(**kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return eager_forward(**kwargs)

    with torch.no_grad():
        ref3 = model.generate(ids, **{kw: cache(3)}, **gen)
        ref1 = model.generate(ids[:1], **{kw: cache(1)}, **gen)
        model.forward = kvcompile.BatchPaddedForward(forward, max_batch_size=4, capture_sizes=(1, 2, 4))
        try:
            shared = cache(4)
            out3 = model.generate(ids, **{kw: shared}, **gen)
            first = len(calls)
            shared.reset()
            out1 = model.generate(ids[:1], **{kw: shared}, **gen)
        finally:
            model.forward = eager_forward
    assert torch.equal(out3, ref3) and torch.equal(out1, ref1)
    assert set(calls[:first]) == {runs_at[0]} and set(calls[first:]) == {runs_at[1]}, calls

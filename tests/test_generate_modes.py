"""``generate()`` modes over a kvcompile cache: the README's "Generation modes" table.

A tiny random Llama (2 layers, 4 q / 2 kv heads of 32, fp32), eager attention over a q8_0 cache,
whose error is small enough that every mode picks the tokens it picks over a full-precision
cache (measured for these seeds; fp8 flips near-ties of this nearly uniform model). Where a mode
depends on a cache operation (beam search: reorder_cache; assisted and prompt-lookup decoding:
crop), a control with that operation disabled shows the test can tell.

Works: greedy, sampling, several return sequences, beam search (and beam sampling), assisted
decoding with an assistant model, prompt-lookup decoding. Refused: contrastive search (the cache
has a fixed batch; transformers 5 ships the mode as hub code). Not served: continuous batching
(transformers' generate_batch runs its own paged cache and never hands a kvcompile cache over).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import LlamaConfig

import kvcompile
from kvcompile.cache import QuantizedLayer
from models import tiny_model

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
NEW = 12  # new tokens per call
LEN = 40  # max_cache_len: 10 prompt tokens + 12 new, with room for assisted decoding's candidates


@pytest.fixture(scope="module")
def model():
    return tiny_model(LlamaConfig(**TINY), "sdpa")


@pytest.fixture(scope="module")
def assistant(model):
    """The model with 1% noise on every weight: it agrees with the model often, not always."""
    a = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return a


def prompt(batch=1, seed=0):
    return torch.randint(3, 128, (batch, 10), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, cache=None, **kw):
    """Seeded generate(); ``cache``: a kvcompile cache (None: transformers' default DynamicCache)."""
    torch.manual_seed(0)
    extra = {}
    if cache is not None:
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        extra[name] = cache
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0, **kw, **extra)


def q8(model, batch=1):
    return kvcompile.QuantizedCache(model.config, max_batch_size=batch, max_cache_len=LEN, kv_dtype="q8_0")


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(do_sample=True, top_k=20),
                                  dict(do_sample=True, num_return_sequences=3)],
                         ids=["greedy", "sampling", "num_return_sequences"])
def test_greedy_and_sampling(model, mode):
    ids = prompt()
    rows = mode.get("num_return_sequences", 1)
    cache = q8(model, rows)
    out = generate(model, ids, cache, **mode)
    assert out.shape == (rows, 10 + NEW)
    assert torch.equal(out, generate(model, ids, **mode))
    assert int(cache.get_seq_length()) == 10 + NEW - 1  # every token but the last went through the cache


@pytest.mark.parametrize("do_sample", [False, True], ids=["beam", "beam-sampling"])
def test_beam_search(model, do_sample, monkeypatch):
    ids = prompt(batch=2)
    mode = dict(num_beams=4, do_sample=do_sample)
    ref = generate(model, ids, **mode)
    assert torch.equal(generate(model, ids, q8(model, 8), **mode), ref)
    if do_sample:
        return
    # a cache with spare rows (16 for 2 x 4 beams) reorders the live rows only
    assert torch.equal(generate(model, ids, q8(model, 16), **mode), ref)
    # control: without reorder_cache the beams read each other's history
    monkeypatch.setattr(QuantizedLayer, "reorder_cache", lambda self, beam_idx: None)
    assert not torch.equal(generate(model, ids, q8(model, 8), **mode), ref)


def _count_crops(monkeypatch) -> list:
    calls, real = [], QuantizedLayer.crop

    def crop(self, n):
        calls.append(n)
        return real(self, n)

    monkeypatch.setattr(QuantizedLayer, "crop", crop)
    return calls


@pytest.mark.parametrize("mode", ["assisted", "prompt_lookup"])
def test_speculative_modes_equal_greedy(model, assistant, mode, monkeypatch):
    """Assisted decoding (an assistant model) and prompt lookup verify several tokens per step and crop
    the rejected ones from the cache; greedy verification gives exactly greedy's tokens."""
    kw = dict(assistant_model=assistant) if mode == "assisted" else dict(prompt_lookup_num_tokens=3)
    ids = prompt()
    greedy = generate(model, ids, q8(model), do_sample=False)
    assert torch.equal(greedy, generate(model, ids, do_sample=False))
    crops = _count_crops(monkeypatch)
    assert torch.equal(generate(model, ids, q8(model), do_sample=False, **kw), greedy)
    assert any(n < 0 for n in crops), "no candidate was ever rejected: the test would not see a broken crop"
    monkeypatch.setattr(QuantizedLayer, "crop", lambda self, n: None)  # control: rejected tokens stay
    assert not torch.equal(generate(model, ids, q8(model), do_sample=False, **kw), greedy)


@pytest.mark.parametrize("method,args", [("batch_repeat_interleave", (2,)),
                                         ("batch_select_indices", (torch.tensor([0]),))])
def test_contrastive_search_refused(model, method, args):
    """Contrastive search repeats the cache's rows per candidate, then selects them: a fixed-batch cache
    refuses, naming the mode and the ones that work."""
    cache = q8(model, 4)
    generate(model, prompt(), cache, do_sample=False)
    with pytest.raises(NotImplementedError, match="contrastive search.*is not supported.*greedy, sampling, "
                                                  "beam search, assisted or prompt-lookup"):
        getattr(cache, method)(*args)


def test_continuous_batching_does_not_use_the_cache(model):
    """cache_implementation='paged' switches generate() to transformers' continuous batching, which builds
    its own paged cache: a kvcompile cache passed along is never handed over (so it cannot object) and
    stays empty. (A small ContinuousBatchingConfig: by default it sizes its buffers from free memory.)"""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        pytest.skip("this transformers has no ContinuousBatchingConfig")
    cache = q8(model)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    small = ContinuousBatchingConfig(num_blocks=8, block_size=16, max_batch_tokens=32, max_memory_percent=0.01)
    with torch.no_grad():
        out = model.generate(prompt(), max_new_tokens=4, pad_token_id=0, eos_token_id=None,
                             cache_implementation="paged", continuous_batching_config=small, **{name: cache})
    assert out.shape[-1] == 10 + 4  # it generated, over its own cache
    assert int(cache.get_seq_length()) == 0 and cache.nbytes == 0

"""``generate(..., prefill_chunk_size=N)`` compiled with the backend: every chunk is rewritten and
attends over the prefix the cache holds, compiled = eager, with a bounded number of graphs.

transformers prefills a prompt in chunks of N tokens through the same forward (the attention mask
spanning every token so far), then decodes. With the backend: the first chunk (static shapes), the
next ones (the mask's length made symbolic once: no recompile per chunk), the remainder, and decode
each compile once. Gemma 3 (a sliding layer stored as a ring and a full-attention layer) and Qwen3.5
(a state layer and an attention layer) are the default cases; Llama (full attention) and Mistral
(every layer sliding) are marked ``slow``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

import kvcompile
from kvcompile import hf
from models import cache_kwarg, tiny_model

CHUNK, PROMPT, NEW, L = 8, 21, 4, 32  # chunks of 8, 8 and 5, then 4 new tokens

pytestmark = pytest.mark.skipif("prefill_chunk_size" not in inspect.signature(
    transformers.GenerationConfig.__init__).parameters and not hasattr(transformers.GenerationConfig(),
                                                                        "prefill_chunk_size"),
    reason="this transformers has no generate(prefill_chunk_size=...)")


def _generate(model, ids, backend=None):
    cache = kvcompile.QuantizedCache(model.config, max_batch_size=1, max_cache_len=L, kv_dtype="int8", device="cpu")
    forward = model.forward
    if backend is not None:
        model.forward = torch.compile(forward, backend=backend)
    try:
        return model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(model): cache},
                              max_new_tokens=NEW, do_sample=False, prefill_chunk_size=CHUNK, output_logits=True,
                              return_dict_in_generate=True)
    finally:
        model.forward = forward


# a sliding layer stored as a ring beside a full-attention one; a state layer (gated delta net, kept as
# transformers' own) beside an attention layer; full attention; every layer sliding
@pytest.mark.parametrize("family", ["gemma3", "qwen3_5", pytest.param("llama", marks=pytest.mark.slow),
                                    pytest.param("mistral", marks=pytest.mark.slow)])
def test_chunked_prefill_compiled_equals_eager(family):
    torch._dynamo.reset()
    model = tiny_model(family, num_hidden_layers=2, **({"sliding_window": 6} if family == "mistral" else {}))
    ids = torch.randint(3, 90, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    eager = _generate(model, ids)
    backend = kvcompile.backend(kv_dtype="int8")
    compiled = _generate(model, ids, backend)
    assert torch.equal(compiled.sequences, eager.sequences)
    for e, c in zip(eager.logits, compiled.logits):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)  # the same codes; float32 rounding apart
    report = backend.report()
    assert 2 <= len(report) <= 4, report  # first chunk, later chunks, remainder, decode: no graph per chunk
    sites = sum(t not in hf.STATE_LAYER_TYPES for t in hf.layer_types(model.config))  # the attention layers
    assert all(r["found"] == r["rewritten"] == sites > 0 and not r["skipped"] for r in report), report
    # the chunks read their prefix: the last chunk alone gives other first-token logits
    alone = _generate(model, ids[:, PROMPT - PROMPT % CHUNK:])
    assert (alone.logits[0] - eager.logits[0]).abs().max() > 1e-3

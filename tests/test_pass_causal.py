"""The model's causal mask taken apart (kvcompile/passes/causal.py): no [Tq, L] tensor reaches the op.

transformers builds ``kv_idx <= q_idx`` (and the padding of ``attention_mask``) as a [B, 1, Tq, L]
tensor for a fixed-size cache. The pass hands the op ``is_causal`` with ``kv_len`` bounded by the
last query's position, and the padding as a [B, 1, 1, L] key mask. A tiny Llama (1 layer, sdpa and
eager attention, whose masks differ: bool vs ``where(mask, 0, finfo.min)``) prefills a prompt and then
a chunk over it, unpadded and left-padded; the rewritten graph is run with the reference op.
"""

from __future__ import annotations

import pytest
import torch

import kvcompile
from pass_models import ATTENTION, PassOnly, fresh_dynamo
from models import cache_kwarg, tiny_model

RING = torch.ops.kvcompile.attention_ring.default
L = 24  # max_cache_len; the prompt is 6 tokens, the chunk 5: no shape equals another
PROMPT, CHUNK = 6, 5


def _mask_shaped(graph, tq: int) -> list:
    """Nodes whose value is a [.., tq, L] tensor that the graph's attention (the op, or SDPA / the scores
    before the pass) or its output reads, directly or through other nodes."""
    sinks = [n for n in graph.nodes if n.target in (ATTENTION, RING) or n.op == "output"]
    seen, stack = set(), list(sinks)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    out = []
    for n in seen:
        v = n.meta.get("example_value")
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[-2:]) == (tq, L) and n.target not in (ATTENTION,
                                                                                                        RING):
            out.append(n)
    return out


class Recording(PassOnly):
    """PassOnly that also keeps, per graph, the mask-shaped tensors the graph reads before and after."""

    def __init__(self, kv_dtype, attention=None):
        super().__init__(kv_dtype, attention)
        self.before, self.after = [], []

    def __call__(self, gm, example_inputs, **kw):
        tq = next(v.shape[1] for v in example_inputs if isinstance(v, torch.Tensor) and v.dtype == torch.long
                  and v.dim() == 2 and v.shape[1] in (PROMPT, CHUNK))
        self.before.append(len(_mask_shaped(gm.graph, tq)))
        fn = super().__call__(gm, example_inputs, **kw)
        self.after.append(len(_mask_shaped(gm.graph, tq)))
        return fn


def _run(model, forward, pad: int):
    """Logits of a prompt (its first ``pad`` tokens of row 1 padding) and of a chunk over it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (2, PROMPT + CHUNK), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    cache = kvcompile.QuantizedCache(model.config, max_batch_size=2, max_cache_len=L, kv_dtype="int8", device="cpu")
    kw = {cache_kwarg(model): cache, "use_cache": True}
    with torch.no_grad():
        a = forward(input_ids=ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], **kw).logits
        b = forward(input_ids=ids[:, PROMPT:], attention_mask=mask, **kw).logits
    return a, b


def _without(field: int, value):
    """The reference op with one argument replaced (a control that must change the logits)."""
    def op(*args):
        args = list(args)
        args[field] = value
        return torch.ops.kvcompile.attention(*args)
    return op


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_causal_mask_reaches_the_op_as_is_causal_and_key_terms(attn):
    model = tiny_model("llama", attn, num_hidden_layers=1)
    for pad in (0, 2):
        fresh_dynamo()
        expected = _run(model, model.forward, pad)
        backend = Recording("int8")
        got = _run(model, torch.compile(model.forward, backend=backend, fullgraph=True), pad)
        for e, g in zip(expected, got):
            # fp32 model, the same codes: rounding only. A padding query (row 1's first ``pad``) sees no key:
            # eager averages every slot under finfo.min, the op none; its logits are nobody's
            real = slice(pad, None) if e.shape[1] == PROMPT else slice(None)
            torch.testing.assert_close(g[0], e[0], atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(g[1, real], e[1, real], atol=2e-5, rtol=2e-5)
        assert min(backend.before) >= 1 and backend.after == [0, 0], (backend.before, backend.after)
        for calls in backend.calls:
            (args,) = calls
            assert args[7] is True  # is_causal
            keys = args[6].args[0] if args[6].target is torch.where else args[6]  # eager: where(keys, 0, min)
            assert tuple(keys.meta["example_value"].shape[-2:]) == (1, L)
        if pad:  # the key mask is read: dropping it changes the padded row's prompt logits
            fresh_dynamo()
            blind = _run(model, torch.compile(model.forward, backend=PassOnly("int8", _without(6, None))), pad)
            assert (blind[0][1, pad:] - expected[0][1, pad:]).abs().max() > 1e-3
    # is_causal is read: without it the prompt's first tokens see later ones
    fresh_dynamo()
    blind = _run(model, torch.compile(model.forward, backend=PassOnly("int8", _without(7, False))), 0)
    assert (blind[0][:, :-1] - expected[0][:, :-1]).abs().max() > 1e-3


def test_a_sliding_layers_window_term_is_the_rings_own():
    """Mistral with a window of 4 (a ring of 4 slots): its mask's ``kv > q - 4`` is the window the ring's
    op applies, so the mask is taken apart too; compiled = eager over the prompt and a chunk."""
    model = tiny_model("mistral", num_hidden_layers=1, sliding_window=4)
    fresh_dynamo()
    expected = _run(model, model.forward, 0)
    backend = Recording("int8")
    got = _run(model, torch.compile(model.forward, backend=backend, fullgraph=True), 0)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=2e-5)
    assert min(backend.before) >= 1 and backend.after == [0, 0], (backend.before, backend.after)

"""Layers that keep a recurrent or convolution state (hybrid models: Qwen3.5, Qwen3-Next, Jamba,
Nemotron-H, LFM3, Falcon-H1): what the cache builds for each layer type, what it refuses, and the
state side's bookkeeping. Whole models run through the family matrix (tests/test_families.py rows
qwen3_5, qwen3_next, jamba, nemotron_h, lfm3, falcon_h1: compiled = eager = transformers' own cache)."""

from __future__ import annotations

import pytest
import torch
import transformers

import kvcompile
from kvcompile import hf
from models import cache_kwarg, tiny_config, tiny_model

pytestmark = pytest.mark.skipif(hf.STATE_LAYER_BASE is None, reason="transformers without LinearAttentionLayer")


def _kinds(cache) -> list[str]:
    return [type(layer).__name__ for layer in cache.layers]


def test_each_layer_type_gets_its_cache_layer():
    """A state layer holds transformers' linear-attention layer, an attention layer 8-bit K/V, a layer
    with both a HybridLayer, a layer without attention a NoKVLayer; shapes and windows follow."""
    qwen = tiny_config("qwen3_5")  # gated delta net, attention
    assert hf.state_layers(qwen) == {0: 1}
    assert hf.per_layer_shapes(qwen) == [None, (2, 32)]
    assert _kinds(kvcompile.QuantizedCache(qwen, max_cache_len=16)) == ["StateLayer", "QuantizedLayer"]

    if hf.NO_KV_LAYER_BASE is not None:  # transformers with DummyLayer (before: the MoE / MLP layers are refused)
        nemotron = tiny_config("nemotron_h")  # Mamba2, MoE, attention, MLP
        assert hf.state_layers(nemotron) == {0: 1}
        assert _kinds(kvcompile.QuantizedCache(nemotron, max_cache_len=16)) == [
            "StateLayer", "NoKVLayer", "QuantizedLayer", "NoKVLayer"]

    falcon = tiny_config("falcon_h1")  # attention and Mamba2 in every layer
    assert hf.state_layers(falcon) == {0: 1, 1: 1}
    assert hf.per_layer_shapes(falcon) == [(2, 32), (2, 32)]
    assert _kinds(kvcompile.QuantizedCache(falcon, max_cache_len=16)) == ["HybridLayer", "HybridLayer"]

    # a hybrid layer with a window: the K/V side is a ring of the window, the state side as above
    cfg = tiny_config("qwen3_5", layer_types=["hybrid_sliding", "full_attention"], sliding_window=4)
    assert hf.layer_windows(cfg) == [4, 0] and hf.state_layers(cfg) == {0: 1}
    layer = kvcompile.QuantizedCache(cfg, max_cache_len=16).layers[0]
    assert isinstance(layer, kvcompile.HybridLayer) and layer.ring and layer.slots == 4


def test_repr_counts_the_layers_of_each_kind():
    assert "layers=2, 1 keeping a state instead of K/V," in repr(
        kvcompile.QuantizedCache(tiny_config("qwen3_5"), max_cache_len=16))
    assert "layers=2, 2 keeping a state beside K/V," in repr(
        kvcompile.QuantizedCache(tiny_config("falcon_h1"), max_cache_len=16))
    assert "layers=2, max_batch_size" in repr(kvcompile.QuantizedCache(tiny_config("llama", num_hidden_layers=2),
                                                                      max_cache_len=16))


def test_number_of_states_reaches_the_layer():
    cfg = tiny_config("qwen3_5", number_of_conv_states=2)
    assert hf.state_layers(cfg) == {0: 2}
    assert kvcompile.QuantizedCache(cfg, max_cache_len=16).layers[0].number_of_states == 2


@pytest.mark.parametrize("layer_types, match", [
    (["linear_attention", "linear_attention"], "no layer of .* stores K/V"),
    (["conv", "linear_attention"], "no layer of .* stores K/V"),
])
def test_a_model_with_no_kv_is_refused(layer_types, match):
    with pytest.raises(ValueError, match=match):
        kvcompile.QuantizedCache(tiny_config("qwen3_5", layer_types=layer_types), max_cache_len=16)


@pytest.mark.parametrize("layer_types", [["linear_attention", "full_attention"], ["hybrid", "full_attention"]])
def test_state_layers_are_refused_without_transformers_layer(monkeypatch, layer_types):
    """A transformers release without LinearAttentionLayer: the config is refused by name, not served
    with a missing state."""
    monkeypatch.setattr(hf, "STATE_LAYER_BASE", None)
    with pytest.raises(ValueError, match=f"type '{layer_types[0]}'.*no cache layer for"):
        hf.check_config(tiny_config("qwen3_5", layer_types=layer_types))


def test_relative_position_bias_is_refused():
    """Inkling adds a learned relative-position bias over the cache's key positions."""
    if not hasattr(transformers, "InklingTextConfig"):
        pytest.skip("transformers without Inkling")
    with pytest.raises(ValueError, match="relative-position bias"):
        hf.check_config(transformers.InklingTextConfig())


def test_writing_kv_into_a_state_layer_names_the_problem():
    cache = kvcompile.QuantizedCache(tiny_config("qwen3_5"), max_cache_len=16)
    k = torch.randn(1, 2, 3, 32)
    with pytest.raises(ValueError, match="layer 0 keeps a recurrent / convolution state"):
        cache.update(k, k, 0)


def test_states_are_counted_once_allocated_and_reset_with_the_cache():
    """A forward allocates the state (nbytes grows by exactly its bytes), decode reads it
    (has_previous_state), and reset() zeroes both the state and the K/V length."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_5")
    cache = kvcompile.QuantizedCache(model.config, max_batch_size=1, max_cache_len=16, device="cpu")
    kv_bytes = cache.nbytes
    state = cache.layers[0]
    assert kv_bytes > 0 and state.nbytes == 0
    with torch.no_grad():
        model(input_ids=torch.randint(3, 96, (1, 6)), **{cache_kwarg(model): cache})
    held = [t for t in (*state.conv_states.values(), *state.recurrent_states.values()) if t is not None]
    assert held and state.nbytes == sum(t.numel() * t.element_size() for t in held) > 0
    assert cache.nbytes == kv_bytes + state.nbytes
    assert cache.has_previous_state(0) and int(cache.layers[1].cumulative_length) == 6
    assert any(t.abs().sum() > 0 for t in held)
    cache.reset()
    assert not cache.has_previous_state(0) and int(cache.layers[1].cumulative_length) == 0
    assert all(t.abs().sum() == 0 for t in held)


def test_hybrid_layer_reset_and_reorder_reach_both_sides():
    """HybridLayer: the K/V side and the state side are one layer; beam reordering permutes the rows
    of both in place, reset clears both."""
    cache = kvcompile.QuantizedCache(tiny_config("falcon_h1"), max_batch_size=3, max_cache_len=16, device="cpu")
    layer = cache.layers[0]
    k, v = torch.randn(3, 2, 5, 32), torch.randn(3, 2, 5, 32)
    cache.update(k, v, 0)
    conv = torch.randn(3, 8, 4)
    cache.update_conv_state(conv, 0)
    rec = torch.randn(3, 2, 4, 4)
    cache.update_recurrent_state(rec, 0)
    assert layer.conv_states[0].device == layer.k_codes.device
    codes, state, rec = layer.k_codes.clone(), layer.conv_states[0].clone(), layer.recurrent_states[0].clone()
    addresses = [t.data_ptr() for t in (layer.k_codes, layer.conv_states[0], layer.recurrent_states[0])]
    beams = torch.tensor([2, 0, 1])
    cache.reorder_cache(beams)
    torch.testing.assert_close(layer.k_codes, codes[beams], rtol=0, atol=0)
    torch.testing.assert_close(layer.conv_states[0], state[beams], rtol=0, atol=0)
    torch.testing.assert_close(layer.recurrent_states[0], rec[beams], rtol=0, atol=0)
    # in place: the static addresses CUDA graphs replay stay
    assert [t.data_ptr() for t in (layer.k_codes, layer.conv_states[0], layer.recurrent_states[0])] == addresses
    assert layer.nbytes == cache.layers[0].nbytes > kvcompile.QuantizedLayer.nbytes.fget(layer)
    cache.reset()
    assert int(layer.cumulative_length) == 0 and not cache.has_previous_state(0)
    assert layer.conv_states[0].abs().sum() == 0 and layer.recurrent_states[0].abs().sum() == 0


def test_states_allocated_in_a_compiled_graph_become_static_inputs():
    """transformers marks a state's address static (for CUDA graphs) only when it is allocated outside
    a compiled graph. After a compiled prefill allocates it, the backend marks the decode graph's state
    inputs static, as it does the K/V buffers: the decode graph's placeholders for the states carry
    the mark Inductor's cudagraphs read, and the tensors themselves do. Control: without the backend's
    marking (patched out) they carry none."""
    from unittest import mock

    from kvcompile import compile_backend

    def run(mark):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = tiny_model("qwen3_5")
        cache = kvcompile.QuantizedCache(model.config, max_batch_size=1, max_cache_len=16, device="cpu")
        graphs = []

        def capture(gm, example_inputs, **kwargs):
            graphs.append(gm)
            return gm.forward

        with mock.patch("torch._inductor.compile_fx.compile_fx", capture), \
                mock.patch.object(compile_backend, "_mark_storage_static", mark):
            fn = torch.compile(model.forward, backend=kvcompile.backend("int8"), fullgraph=True)
            with torch.no_grad():
                out = fn(input_ids=torch.randint(3, 96, (1, 6)), **{cache_kwarg(model): cache}).logits
                fn(input_ids=out[:, -1:].argmax(-1), **{cache_kwarg(model): cache})
        torch._dynamo.reset()
        layer = cache.layers[0]
        states = [t for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
        marks = {n.name: n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
                 for n in graphs[-1].graph.find_nodes(op="placeholder") if "_states_" in n.name}
        return states, marks

    states, marks = run(compile_backend._mark_storage_static)
    assert len(marks) == len(states) == 2 and set(marks.values()) == {"unguarded"}, marks
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in states)
    states, marks = run(lambda gm, example_inputs: 0)
    assert len(marks) == 2 and set(marks.values()) == {None}, marks
    assert not any(hasattr(t, "_dynamo_static_input_type") for t in states)


def test_a_state_keeps_the_batch_of_the_first_forward():
    """transformers sizes a state by the first forward's batch; a later forward of another batch gets an
    error naming it (not a failed copy), while the K/V layers would serve the smaller batch."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_5")
    cache = kvcompile.QuantizedCache(model.config, max_batch_size=2, max_cache_len=16, device="cpu")
    kw = {cache_kwarg(model): cache}
    with torch.no_grad():
        model(input_ids=torch.randint(3, 96, (2, 5)), **kw)
        cache.reset()
        model(input_ids=torch.randint(3, 96, (2, 5)), **kw)  # the same batch after a reset: served
        cache.reset()
        with pytest.raises(ValueError, match="layer 0 keeps a recurrent state for a batch of 2 .* 1 rows"):
            model(input_ids=torch.randint(3, 96, (1, 5)), **kw)


def test_info_groups_the_layers_of_a_pattern():
    """`python -m kvcompile info`: a hybrid's recurring pattern is one line per kind of layer, with the
    layers named as runs (Qwen3.5: three state layers per attention layer), and the totals count the
    K/V layers only."""
    from kvcompile.__main__ import cache_size_lines

    cfg = tiny_config("qwen3_5", num_hidden_layers=8, layer_types=["linear_attention"] * 3 + ["full_attention"])
    out = "\n".join(cache_size_lines(cfg, max_cache_len=64))
    per_layer = kvcompile.QuantizedCache(cfg, max_cache_len=64, device="meta").planned_nbytes(per_layer=True)
    assert "layers 0-2, 4-6 (6):" in out and "a recurrent / conv state instead" in out, out
    assert "layers 3, 7 (2):" in out and f"{per_layer[3]:,d} bytes" in out, out
    assert f"total          {sum(per_layer):>14,d} bytes" in out and sum(per_layer) == 2 * per_layer[3], out


def test_beam_search_reorders_the_states():
    """Beam search over a hybrid model: the states' rows follow the beams (in place), so q8_0 picks the
    beams transformers' own cache picks. Control: with the states' reorder disabled the beams read each
    other's recurrent state and the result changes."""
    from kvcompile.state_layers import _StateRows

    torch.manual_seed(0)
    model = tiny_model("qwen3_5")
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, min_new_tokens=8, num_beams=4, do_sample=False, pad_token_id=0)

    def run(cache=None):
        extra = {} if cache is None else {cache_kwarg(model): cache}
        with torch.no_grad():
            return model.generate(ids, **kw, **extra)

    def q8():
        return kvcompile.QuantizedCache(model.config, max_batch_size=8, max_cache_len=24, kv_dtype="q8_0")

    ref = run()
    assert torch.equal(run(q8()), ref)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_StateRows, "reorder_cache", lambda self, beam_idx: None)
        assert not torch.equal(run(q8()), ref)

"""Features the pass reads off the graph and hands to ``kvcompile::attention``: Gemma 2's logit
softcap and gpt-oss's attention sinks (real tiny models, eager attention), and cache rotations
(a synthetic graph: the cache's dequantize un-rotates K / V; the op gets the cache's R_k / R_v
and rotates q and its output itself).

The op is checked by its emitted arguments; its numerics run through
``pass_models.attention_oracle`` (the op's contract in float64, softcap / sinks / window
included) in place of the op, against the model's own eager attention over the same cache. Each
feature test also switches the feature off in the oracle and shows the result moves far past
the tolerance: the test can tell the feature on from off.

Tolerance: both sides read the same cache codes; eager computes in float32, the oracle in
float64, so logits differ by float32 rounding (~1e-6); 2e-5 as in tests/test_pass.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
import transformers

import kvcompile
from kvcompile import formats
from kvcompile.passes import KVAttentionPass
from models import tiny_model
from pass_models import _COMMON, ATTENTION, DEQUANTIZE, PassOnly, attention_oracle, fresh_dynamo

ATOL = RTOL = 2e-5
MAX_LEN = 32


_OFF = {"feature": None}


def switchable_oracle(*args):
    """attention_oracle with one argument forced off when ``_OFF["feature"]`` names it ("softcap" / "sinks")."""
    args = list(args)
    if _OFF["feature"] == "softcap":
        args[10] = 0.0
    elif _OFF["feature"] == "sinks":
        args[11] = None
    return attention_oracle(*args)


def _run(model, kv_dtype, forward):
    """Prefill 6 tokens of a batch of 2 (no mask), then one decode step; logits of both calls."""
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    cache = kvcompile.QuantizedCache(model.config, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype=kv_dtype,
                                     device="cpu")
    with torch.no_grad():
        return [forward(input_ids=ids[:, :6], cache=cache).logits,
                forward(input_ids=ids[:, 6:], cache=cache).logits]


def _feature_run(model, kv_dtype, off):
    """Eager logits, the pass-rewritten logits with the oracle, the same with ``off`` switched off,
    and the pass-only backend."""
    fresh_dynamo()
    expected = _run(model, kv_dtype, model.forward)
    backend = PassOnly(kv_dtype, attention=switchable_oracle)
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
    got = _run(model, kv_dtype, compiled)
    _OFF["feature"] = off
    try:
        without = _run(model, kv_dtype, compiled)
    finally:
        _OFF["feature"] = None
    return expected, got, without, backend


def _assert_rewritten_and_close(backend, layers, form, expected, got, without):
    assert len(backend.graphs) == 2
    for _, after, report in backend.graphs:
        assert (report.found, report.rewritten, report.skipped) == (layers, layers, []), report
        assert report.patterns == {f"{form}[repeat_kv]": layers}, report.patterns
        assert after["kv_attention"] == layers and after["dequantize"] == 0
    for e, g, w in zip(expected, got, without):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
        assert (w - e).abs().max() > 100 * ATOL, "switching the feature off must change the logits"


def test_gemma2_softcap_is_passed_to_the_op():
    """Gemma 2 eager: ``scores / c -> tanh -> * c`` before the mask becomes ``softcap=c``; the
    scale is query_pre_attn_scalar ** -0.5. A small cap and wide init make the cap bite."""
    cfg = transformers.Gemma2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    sliding_window=64, attn_logit_softcapping=2.0, query_pre_attn_scalar=32,
                                    initializer_range=0.2)
    model = tiny_model(cfg, "eager")
    expected, got, without, backend = _feature_run(model, "fp8_e4m3", "softcap")
    _assert_rewritten_and_close(backend, 2, "eager+softcap", expected, got, without)
    for graph, calls in enumerate(backend.calls):  # the prefill graph, then decode's
        for args in calls:
            # the model's causal mask taken apart (passes/causal.py): is_causal for the prompt's queries (the
            # sliding layer's window of 64 spans the whole cache: its window term hides no key)
            assert args[0].target == "contiguous" and args[7] is (graph == 0), graph
            assert args[8] == pytest.approx(32 ** -0.5) and args[10] == 2.0 and args[11] is None
            assert isinstance(args[9], int) and args[9] in (0, cfg.sliding_window)


def _sinks_run(cfg, kv_dtype: str) -> None:
    """An eager model of ``cfg`` with its sinks drawn wide, through the pass: every layer's op gets
    ``sinks=<the layer's sinks parameter>`` (a [Hq] graph input), no softcap, the layer's scale."""
    model = tiny_model(cfg, "eager")
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    expected, got, without, backend = _feature_run(model, kv_dtype, "sinks")
    _assert_rewritten_and_close(backend, 2, "eager+sinks", expected, got, without)
    for calls in backend.calls:
        for i, args in enumerate(calls):
            sinks = args[11]
            assert sinks.op == "placeholder" and f"layers_modules_{i}_modules_self_attn_parameters_sinks" in sinks.name
            assert tuple(sinks.meta["example_value"].shape) == (cfg.num_attention_heads,)
            assert args[10] == 0.0 and args[8] == pytest.approx(model.model.layers[i].self_attn.scaling)


def test_gpt_oss_sinks_are_passed_to_the_op():
    """gpt-oss eager: the per-head sink column concatenated before softmax and dropped after it."""
    _sinks_run(transformers.GptOssConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         sliding_window=64, num_local_experts=4, num_experts_per_tok=2), "q8_0")


@pytest.mark.skipif(not hasattr(transformers, "GraniteSWAConfig"), reason="transformers has no GraniteSWA")
def test_granite_swa_sinks_after_attention_are_passed_to_the_op():
    """GraniteSWA eager: ``attn_output * sigmoid(logsumexp(scores) - sink)``, the sink in the softmax's
    denominator applied after P @ V, as gpt-oss's column gives it (its sinks start at zero). fp8: with
    int8 here a float32-rounding difference in layer 1's input flips one of its V codes (1e-4 in the logits),
    which the oracle comparison cannot tell from an error (tests/test_families.py replays for that)."""
    _sinks_run(transformers.GraniteSWAConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                             sliding_window=64, layer_types=["sliding_attention", "full_attention"]),
               "fp8_e4m3")


# ---------------------------------------------------------------------------------------------
# rotation: a hand-built graph (the rotated dequantize is the cache's, branch-independent)
# ---------------------------------------------------------------------------------------------

B, H, TQ, L, D = 2, 2, 3, 8, 32
STORED = 6


def _orthonormal(seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(seed)))[0].contiguous()


def _rotated_graph(r_k, r_v):
    """SDPA(q, dequantize(K codes, rotation=r_k), dequantize(V codes, rotation=r_v), mask) as an FX
    graph with value metadata; the inputs hold codes of ``x @ R`` (``x`` itself without R)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (TQ, L, L))
    inputs = {"q": q}
    truth = {}
    for name, x, r in (("k", k, r_k), ("v", v, r_v)):
        codes, scale = formats.quantize(x if r is None else x @ r, torch.float8_e4m3fn)
        inputs[f"{name}_codes"], inputs[f"{name}_scale"] = codes, scale
        stored = formats.dequantize(codes, scale, torch.float32)
        stored = stored if r is None else stored @ r.T  # what dequantize(rotation=R) returns
        truth[name] = torch.where(torch.arange(L).view(1, 1, L, 1) < STORED, stored, torch.zeros(()))
    inputs["kv_len"] = torch.tensor(STORED)
    inputs["mask"] = (torch.arange(L).view(1, L) <= torch.arange(STORED - TQ, STORED).view(TQ, 1)).expand(B, 1, TQ, L)
    inputs["r_k"], inputs["r_v"] = r_k, r_v
    graph = fx.Graph()
    nodes = {}
    for name, value in inputs.items():
        if value is not None:
            nodes[name] = graph.placeholder(name)
            nodes[name].meta["val"] = value
    dq = {}
    for name in ("k", "v"):
        rot = nodes.get(f"r_{name}")
        dq[name] = graph.call_function(DEQUANTIZE, (nodes[f"{name}_codes"], nodes[f"{name}_scale"], None,
                                                    nodes["kv_len"], torch.float32),
                                       {"rotation": rot, "sliding_window": 0, "format": formats.get_format("fp8_e4m3").id})
        dq[name].meta["val"] = truth[name]
    expected = F.scaled_dot_product_attention(q, truth["k"], truth["v"], attn_mask=inputs["mask"])
    out = graph.call_function(F.scaled_dot_product_attention, (nodes["q"], dq["k"], dq["v"]),
                              {"attn_mask": nodes["mask"]})
    out.meta["val"] = expected
    graph.output(out)
    args = [value for value in inputs.values() if value is not None]
    return graph, args, expected


@pytest.mark.parametrize("rotated", ["k", "v", "kv"])
def test_rotation_is_applied_around_the_op(rotated):
    r_k = _orthonormal(1) if "k" in rotated else None
    r_v = _orthonormal(2) if "v" in rotated else None
    graph, args, expected = _rotated_graph(r_k, r_v)
    report = KVAttentionPass("fp8_e4m3").apply(graph)
    assert (report.found, report.rewritten) == (1, 1), report
    graph.lint()
    (op,) = [n for n in graph.nodes if n.target is ATTENTION]
    q_in = op.args[0]
    assert q_in.target == "contiguous" and q_in.args[0].name == "q"  # the op rotates q itself
    k_rot, v_rot = op.args[12:14]  # the cache's own matrices, handed to the op
    assert (k_rot.name if r_k is not None else k_rot) == ("r_k" if r_k is not None else None)
    assert (v_rot.name if r_v is not None else v_rot) == ("r_v" if r_v is not None else None)
    (final,) = graph.find_nodes(op="output")[0].args[0:1]
    assert final is op  # no matmul around it: the output comes back un-rotated
    got = fx.GraphModule(torch.nn.Module(), graph)(*args)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)

    # off: the same codes read as if unrotated give another result
    plain, plain_args, _ = _rotated_graph(r_k, r_v)
    for n in plain.nodes:
        if n.target is DEQUANTIZE:
            n.kwargs = {**n.kwargs, "rotation": None}
    KVAttentionPass("fp8_e4m3").apply(plain)
    unrotated = fx.GraphModule(torch.nn.Module(), plain)(*plain_args)
    assert (unrotated - expected).abs().max() > 100 * ATOL


def test_a_layer_read_by_later_layers_gets_one_op_per_reader_unless_it_is_a_ring():
    """Gemma 4's num_kv_shared_layers: the last two layers attend over layer 1's and layer 2's K/V. Layer
    1 is a sliding layer; stored as a ring (the default) its store is folded into its first reader's op, over keys a
    later reader still needs, so its site is left to the model's attention with the reason, while full
    layer 2 and its reader get one op each; with ring=False every reader gets its own op. Both match eager over the same kind of cache."""
    from unittest import mock

    from models import cache_kwarg, tiny_config

    if not kvcompile.hf._has_no_kv_layers():
        pytest.skip("transformers without DummyLayer refuses K/V shared across layers")
    cfg = tiny_config("gemma4", num_hidden_layers=5, num_kv_shared_layers=2, sliding_window=4,
                      layer_types=["full_attention", "sliding_attention"] * 2 + ["full_attention"],
                      per_layer_config={i: dict(head_dim=64, num_key_value_heads=1) for i in (0, 2, 4)})
    model = tiny_model(cfg, "sdpa")
    kw = cache_kwarg(model)
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    for ring in (True, False):
        fresh_dynamo()
        backend = kvcompile.backend("int8")
        with mock.patch("torch._inductor.compile_fx.compile_fx", lambda gm, example_inputs, **k: gm.forward):
            compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
            outs = []
            for fn in (model.forward, compiled):
                cache = kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="int8", ring=ring)
                with torch.no_grad():
                    logits = [fn(input_ids=ids, **{kw: cache}).logits[:, -1]]
                    for _ in range(3):
                        logits.append(fn(input_ids=logits[-1].argmax(-1, keepdim=True), **{kw: cache}).logits[:, -1])
                outs.append(torch.stack(logits))
        fresh_dynamo()
        torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
        for r in backend.report():  # layers 0-2 store K/V; layer 3 (sliding) reads layer 1's, layer 4 (full) layer 2's
            if ring:
                (site, reason), = r["skipped"]
                assert (r["found"], r["rewritten"]) == (3, 2) and "layers.1." in site and "ring=False" in reason, r
            else:
                assert (r["found"], r["rewritten"], r["skipped"]) == (3, 3, []), r


def test_heads_folded_into_the_batch_become_one_op():
    """GPT-NeoX-Japanese folds the heads into the batch: ``baddbmm(zeros, q.view(B*H, Tq, D),
    K.view(B*H, T, D).transpose(1, 2), alpha=1/norm_factor).view(B, H, Tq, T)``, then the eager chain.
    Each layer becomes one op whose scale is baddbmm's alpha (not 1: head_dim 32) and whose query is the
    unfolded [B, H, Tq, D] one; the logits through the op's float64 contract equal the model's own eager
    attention over the same cache."""
    from models import cache_kwarg

    fresh_dynamo()
    model = tiny_model("gpt_neox_japanese", "eager")
    kw = cache_kwarg(model)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))

    def run(forward):
        cache = kvcompile.QuantizedCache(model.config, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype="int8",
                                         device="cpu")
        with torch.no_grad():
            return [forward(input_ids=ids[:, :6], **{kw: cache}).logits, forward(input_ids=ids[:, 6:], **{kw: cache}).logits]

    expected = run(model.forward)
    backend = PassOnly("int8", attention=attention_oracle)
    got = run(torch.compile(model.forward, backend=backend, fullgraph=True))
    layers = model.config.num_hidden_layers
    norm = model.gpt_neox_japanese.layers[0].attention.norm_factor
    assert len(backend.graphs) == 2
    for _, after, report in backend.graphs:
        assert (report.found, report.rewritten, report.skipped) == (layers, layers, []), report
        assert report.patterns == {"eager+folded[direct]": layers}, report.patterns
        assert after["kv_attention"] == layers and after["dequantize"] == 0
    for calls in backend.calls:
        for args in calls:
            q = args[0].args[0] if args[0].target == "contiguous" else args[0]
            assert q.meta["example_value"].dim() == 4  # the query before its fold
            assert args[8] == pytest.approx(1 / float(norm)) and args[8] != pytest.approx(1.0)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tiled_kv_heads_become_one_op_over_grouped_queries(attn, monkeypatch):
    """JetMoE tiles its kv heads for its attention experts' queries: ``K.repeat(1, top_k, 1, 1)``, so
    query head h reads kv head h mod Hkv, where the op's grouping reads h // top_k. Each layer becomes
    one op over the query's heads put into groups (and its output put back); the logits through the
    op's float64 contract equal the model's own attention over the same cache. Control: with the heads
    left in their tiled order (the permutations made identities), query heads meet the wrong kv heads and
    the logits move far past the tolerance."""
    from kvcompile.passes import rewrite

    model = tiny_model("jetmoe", attn)
    cfg = model.config
    assert cfg.num_key_value_heads == 2 and cfg.num_experts_per_tok == 2  # 4 query heads, 2 kv heads: h mod 2 != h // 2

    def rewritten():
        fresh_dynamo()
        backend = PassOnly("int8", attention=attention_oracle)
        return _run(model, "int8", torch.compile(model.forward, backend=backend, fullgraph=True)), backend

    expected = _run(model, "int8", model.forward)
    got, backend = rewritten()
    layers = cfg.num_hidden_layers
    form = "sdpa" if attn == "sdpa" else "eager"
    assert len(backend.graphs) == 2
    for _, after, report in backend.graphs:
        assert (report.found, report.rewritten, report.skipped) == (layers, layers, []), report
        assert report.patterns == {f"{form}[tile]": layers}, report.patterns
        assert after["kv_attention"] == layers and after["dequantize"] == 0
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)

    monkeypatch.setattr(rewrite, "_reorder_heads", lambda graph, x, split: x)
    wrong, _ = rewritten()
    assert max((w - e).abs().max().item() for w, e in zip(wrong, expected)) > 100 * ATOL


def test_alibi_as_baddbmm_input_joins_the_additive_mask(monkeypatch):
    """Bloom: ``alibi.baddbmm(q.view(B*H, Tq, D), K^T, beta=1, alpha=s)``, the scores viewed [B, H, Tq, T] plus
    the mask, then ``bmm(P.view(B*H, Tq, T), V.reshape(B*H, T, D))``. Each layer becomes one op whose additive
    mask is the mask plus the ALiBi term unfolded to [B, H, 1, T], whose scale is baddbmm's alpha, and whose
    output is folded back to [B*H, Tq, D]; the logits through the op's float64 contract equal Bloom's own
    attention over the same cache, with a left-padded mask spanning the cache (as generate() passes it).
    Control: without the ALiBi term in the mask the logits move far past the tolerance."""
    from kvcompile.passes import rewrite

    model = tiny_model("bloom", "eager", num_hidden_layers=2)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    span = torch.zeros(2, MAX_LEN, dtype=torch.long)
    span[:, :7] = 1
    span[1, :2] = 0  # left padding

    def run(forward):
        cache = kvcompile.QuantizedCache(model.config, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype="int8",
                                         device="cpu")
        with torch.no_grad():
            return [forward(input_ids=ids[:, :6], attention_mask=span, cache=cache).logits,
                    forward(input_ids=ids[:, 6:], attention_mask=span, cache=cache).logits]

    def rewritten():
        fresh_dynamo()
        backend = PassOnly("int8", attention=attention_oracle)
        return run(torch.compile(model.forward, backend=backend, fullgraph=True)), backend

    expected = run(model.forward)
    got, backend = rewritten()
    assert len(backend.graphs) == 2
    for _, after, report in backend.graphs:
        assert (report.found, report.rewritten, report.skipped) == (2, 2, []), report
        assert report.patterns == {"eager+folded[direct]": 2}, report.patterns
        assert after["kv_attention"] == 2 and after["dequantize"] == 0
    for calls in backend.calls:
        for args in calls:
            assert args[8] == pytest.approx(model.transformer.h[0].self_attention.inv_norm_factor)
            assert args[6] is not None and args[6].op == "call_function"  # the mask with the ALiBi term added
    real = span[:, :6].bool()  # the prefill's real positions (row 1's padding answers nothing)
    torch.testing.assert_close(got[0][real], expected[0][real], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got[1], expected[1], atol=ATOL, rtol=RTOL)

    monkeypatch.setattr(rewrite, "_with_bias", lambda graph, mask, call: mask)
    wrong, _ = rewritten()
    assert max((wrong[0][real] - expected[0][real]).abs().max().item(),
               (wrong[1] - expected[1]).abs().max().item()) > 100 * ATOL

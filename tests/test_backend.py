"""kvcompile.backend(): the pass + Inductor (CPU), numerics, recompiles, generate(), gating, report.

Tolerance: compiled and eager runs hold the same cache codes (quantization is deterministic and
bit-exact between the reference and Inductor-compiled graphs, as the fp32 K/V fed to store_kv are
equal up to float32 rounding) and both evaluate attention in float32 with the reference math, so
logits agree to float32 rounding (~1e-6); 1e-4 leaves room for Inductor's fused reductions.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers

import kvcompile
from models import cache_kwarg, tiny_model
from pass_models import fresh_dynamo, greedy, model_cache, make_model, prompt

ATOL = RTOL = 1e-4


pytestmark = pytest.mark.usefixtures("dynamo_reset_around")


@pytest.mark.parametrize(
    "family, attn, padded",
    [("llama", "sdpa", True), ("qwen3", "eager", False)],  # GQA+fp8+bool mask; q/k-norm+q8_0+additive mask
)
def test_compiled_matches_eager_no_recompiles(family, attn, padded):
    """Prefill + 3 warm-up decode steps, then 64 decode steps with recompiles turned into errors.
    Every step's logits match the eager model over an identical cache (>= 16 steps compared)."""
    model, kv_dtype = make_model(family, attn)
    ids, mask = prompt(padded)
    steps = 3 + 64
    max_len = ids.shape[1] + steps + 1
    expected = greedy(model.forward, model, model_cache(model, kv_dtype, max_len, padded=padded), ids, mask, steps=steps)

    backend = kvcompile.backend(kv_dtype)
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
    cache = model_cache(model, kv_dtype, max_len, padded=padded)
    warm = greedy(compiled, model, cache, ids, mask, steps=3)
    # the next 64 steps continue from the warm-up state
    kw = cache_kwarg(model)
    mask = torch.cat([mask, torch.ones(mask.shape[0], 3, dtype=mask.dtype)], 1)
    nxt = warm[-1].argmax(-1, keepdim=True)
    got = list(warm)
    compiles = len(backend.report())
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for _ in range(64):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits = compiled(input_ids=nxt, attention_mask=mask if padded else None, use_cache=True,
                              **{kw: cache}).logits[:, -1]
            got.append(logits)
            nxt = logits.argmax(-1, keepdim=True)
    assert len(backend.report()) == compiles  # no new graph after warm-up
    assert len(got) == len(expected) == 1 + steps
    for i, (e, g) in enumerate(zip(expected, got)):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {i}: {m}")
    layers = model.config.num_hidden_layers
    for r in backend.report():
        assert r == {"found": layers, "rewritten": layers, "skipped": [], "kv_dtype": kv_dtype}


def _greedy_generate_kwargs(mask) -> dict:
    """16 greedy tokens with their scores, for comparing compiled and eager generate()."""
    return dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_scores=True,
                attention_mask=mask, pad_token_id=0)


def test_generate_matches_eager(caplog):
    """model.generate() with the compiled forward: same tokens and scores as eager generate."""
    model, kv_dtype = make_model("gemma", "sdpa")
    padded = True
    ids, mask = prompt(padded)
    kw = cache_kwarg(model)
    gen = _greedy_generate_kwargs(mask)
    with torch.no_grad():
        ref = model.generate(ids, **{kw: model_cache(model, kv_dtype, padded=padded)}, **gen)
        backend = kvcompile.backend(kv_dtype)
        model.forward = torch.compile(model.forward, backend=backend, fullgraph=True)
        with caplog.at_level(logging.INFO, logger="kvcompile"):
            out = model.generate(ids, **{kw: model_cache(model, kv_dtype, padded=padded)}, **gen)
    assert torch.equal(out.sequences, ref.sequences)
    for e, g in zip(ref.scores, out.scores):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
    reports = backend.report()
    assert reports and all(r["rewritten"] == r["found"] == 2 for r in reports)
    infos = [r.getMessage() for r in caplog.records if r.name == "kvcompile" and r.levelno == logging.INFO]
    assert len(infos) == len(reports) and all("rewrote 2/2 attention sites, q8_0" in m for m in infos)
    assert not [r for r in caplog.records if r.name == "kvcompile" and r.levelno >= logging.WARNING]


def test_static_cache_is_plain_inductor(caplog):
    """No kvcompile cache in the graph: the backend is plain Inductor, report says 0 rewritten, and one
    WARNING (for all the graphs) names the cache to pass: attention over a full-precision cache is a trap."""
    model, _ = make_model("llama", "sdpa")
    ids, mask = prompt(True)
    kw = cache_kwarg(model)

    def run(backend):
        fresh_dynamo()
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        f = torch.compile(model.forward, backend=backend, fullgraph=True)
        return greedy(f, model, cache, ids, mask, steps=2)

    backend = kvcompile.backend("fp8_e4m3")
    with caplog.at_level(logging.INFO, logger="kvcompile"):
        got = run(backend)
    ref = run("inductor")
    for e, g in zip(ref, got):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert len(backend.report()) >= 2 and all(
        r == {"found": 0, "rewritten": 0, "skipped": [], "kv_dtype": "fp8_e4m3"} for r in backend.report()
    )
    warned = [r.getMessage() for r in caplog.records if r.name == "kvcompile" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "over no kvcompile cache" in warned[0] and "QuantizedCache(" in warned[0], warned
    del kw


def test_kv_dtype_mismatch_is_a_clear_compile_error():
    model, _ = make_model("gemma", "sdpa")  # head_dim 32: both formats fit
    ids, mask = prompt(False)
    compiled = torch.compile(model.forward, backend=kvcompile.backend("fp8_e4m3"), fullgraph=True)
    with pytest.raises(Exception, match=r"holds K and V as 'q8_0' codes\. Build the backend with kv_dtype='q8_0'"):
        greedy(compiled, model, model_cache(model, "q8_0"), ids, mask, steps=0)


def test_unknown_kv_dtype_rejected():
    with pytest.raises(ValueError, match="fp8_e4m3"):
        kvcompile.backend("int4")


def test_mode_and_options_are_forwarded(monkeypatch):
    """torch.compile passes mode=/options= to a callable backend; they become Inductor config patches."""
    seen = []
    import torch._inductor.compile_fx as cfx

    real = cfx.compile_fx

    def spy(gm, ex, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return real(gm, ex, config_patches=config_patches, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    backend = kvcompile.backend("fp8_e4m3")
    x = torch.randn(8)
    out = torch.compile(lambda t: t * 2 + 1, backend=backend, mode="reduce-overhead")(x)
    torch.testing.assert_close(out, x * 2 + 1)
    assert seen[0] == {"triton.cudagraphs": True}  # (compile_fx re-enters itself without patches)
    seen.clear()
    backend(torch.fx.symbolic_trace(lambda t: t + 1), [x], options={"max_autotune": False})
    assert seen[0] == {"max_autotune": False}


@pytest.mark.parametrize("family, device, prefill_graphs", [
    ("qwen3_5", "cpu", False),  # the gated-delta-net layer's state is allocated by the first forward
    ("llama", None, False),  # device=None: the first forward allocates the K/V
    ("llama", "cpu", True),  # control: storage allocated at construction, so the prefill keeps CUDA graphs
])
def test_a_graph_that_allocates_cache_storage_runs_without_cuda_graphs(monkeypatch, family, device, prefill_graphs):
    """Under mode="reduce-overhead" a tensor a graph allocates lives in the CUDA-graph pool, which the next
    replay reuses: a cache state allocated there would be overwritten (on the H100 it raised "accessing
    tensor output of CUDAGraphs that has been overwritten"). The backend compiles the graph that
    allocates a cache's storage without CUDA graphs; the decode graph after it keeps them, with that
    storage marked as static inputs (unmarked, the H100 skipped the decode graph for its mutated inputs)."""
    if family == "qwen3_5" and kvcompile.hf.STATE_LAYER_BASE is None:
        pytest.skip("transformers without LinearAttentionLayer")
    import torch._inductor.compile_fx as cfx

    patches = []

    def capture(gm, ex, config_patches=None, **kw):
        patches.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", capture)
    torch.manual_seed(0)
    model = tiny_model(family)
    cache = kvcompile.QuantizedCache(model.config, max_batch_size=1, max_cache_len=16, device=device)
    fn = torch.compile(model.forward, backend=kvcompile.backend("int8"), mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        out = fn(input_ids=torch.randint(3, 96, (1, 6)), **{cache_kwarg(model): cache}).logits
        fn(input_ids=out[:, -1:].argmax(-1), **{cache_kwarg(model): cache})
    assert [p["triton.cudagraphs"] for p in patches] == [prefill_graphs, True], patches
    # and the decode graph replays that storage in place: every tensor of it is a static input
    storage = [t for layer in cache.layers for t in (layer.buffers() if hasattr(layer, "k_codes") else [])
               + (layer.states() if hasattr(layer, "states") else [])]
    assert storage and all(hasattr(t, "_dynamo_static_input_type") for t in storage)


def test_unrewritten_site_warns(caplog):
    """Attention dropout in training mode (the op has none) stays as is, with one WARNING per site."""
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5,
                                   max_position_embeddings=64)
    model = tiny_model(cfg).train()
    ids, mask = prompt(False)
    backend = kvcompile.backend("fp8_e4m3")
    with caplog.at_level(logging.INFO, logger="kvcompile"):
        greedy(torch.compile(model.forward, backend=backend, fullgraph=True), model,
               model_cache(model, "fp8_e4m3"), ids, mask, steps=0)
    (r,) = backend.report()
    assert r["found"] == 2 and r["rewritten"] == 0 and len(r["skipped"]) == 2
    warnings = [x for x in caplog.records if x.name == "kvcompile" and x.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("left unrewritten" in w.getMessage() for w in warnings)
    assert all("dropout_p=0.5" in reason for _, reason in r["skipped"])


def test_dump_graphs(tmp_path):
    backend = kvcompile.backend("fp8_e4m3", dump_graphs=str(tmp_path))
    x = torch.randn(4)
    backend(torch.fx.symbolic_trace(lambda t: t + 1), [x])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph000_after.py", "graph000_before.py"]


def test_dynamic_true_compiles_without_dequantize():
    """Under dynamic=True the K/V view chain stays for its size() only; Inductor drops the dequantize."""
    from torch._inductor.utils import run_and_get_code

    model, kv_dtype = make_model("llama", "sdpa")
    padded = True
    ids, mask = prompt(padded)
    kw = cache_kwarg(model)
    expected = greedy(model.forward, model, model_cache(model, kv_dtype, padded=padded), ids, mask, steps=0)
    backend = kvcompile.backend(kv_dtype)
    with torch._dynamo.config.patch(specialize_float=True), torch.no_grad():
        f = torch.compile(model.forward, backend=backend, dynamic=True, fullgraph=True)
        out, codes = run_and_get_code(
            lambda: f(input_ids=ids, attention_mask=mask, use_cache=True, **{kw: model_cache(model, kv_dtype, padded=padded)}))
    torch.testing.assert_close(out.logits[mask.bool()], expected[0], atol=ATOL, rtol=RTOL)
    code = "\n".join(codes)
    assert "kvcompile.attention" in code and "kvcompile.dequantize" not in code
    assert backend.report()[0]["rewritten"] == 2


def test_generate_with_compile_config():
    """transformers' own auto-compile: CompileConfig(backend=kvcompile.backend(...)) (mode defaults to
    "reduce-overhead", which the backend forwards to Inductor; CUDA graphs do not apply on CPU)."""
    model, kv_dtype = make_model("mistral", "sdpa")
    padded = False
    ids, mask = prompt(padded)
    kw = cache_kwarg(model)
    gen = _greedy_generate_kwargs(mask)
    with torch.no_grad():
        ref = model.generate(ids, **{kw: model_cache(model, kv_dtype, padded=padded)}, **gen)
        backend = kvcompile.backend(kv_dtype)
        config = transformers.CompileConfig(backend=backend, fullgraph=True)
        config._compile_all_devices = True  # CPU CI: transformers auto-compiles on accelerators only
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(ids, **{kw: model_cache(model, kv_dtype, padded=padded)}, compile_config=config, **gen)
    # the prefill runs uncompiled before the backend's first graph: not the bypassed compiled module
    assert not [w for w in caught if "compiled nothing" in str(w.message)]
    assert torch.equal(out.sequences, ref.sequences)
    for e, g in zip(ref.scores, out.scores):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
    reports = backend.report()
    assert reports and all(r["rewritten"] == r["found"] == 2 for r in reports)


def test_smaller_live_batch_compiles_and_matches():
    """A cache built for 4 rows serving a batch of 2 (leading-row views of its buffers): every
    site is still rewritten, and the compiled logits match eager over a right-sized cache."""
    model, kv_dtype = make_model("llama", "sdpa")
    ids, mask = prompt(True)  # batch 2, left-padded
    max_len = ids.shape[1] + 6
    expected = greedy(model.forward, model, model_cache(model, kv_dtype, max_len, padded=True), ids, mask, steps=4)
    backend = kvcompile.backend(kv_dtype)
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True)
    roomy = model_cache(model, kv_dtype, max_len, batch=4, padded=True)
    got = greedy(compiled, model, roomy, ids, mask, steps=4)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)
    layers = model.config.num_hidden_layers
    assert backend.report() and all(r["rewritten"] == r["found"] == layers for r in backend.report())


def test_backend_function_is_not_shadowed():
    """``kvcompile.backend`` is the public function, whatever was imported before: the backend's
    module has another name, so importing it binds no package attribute ``backend``."""
    import pkgutil
    import sys

    import kvcompile.compile_backend as module

    assert "backend" not in {m.name for m in pkgutil.iter_modules(kvcompile.__path__)}  # no submodule of that name
    first = kvcompile.backend("q8_0")
    assert "kvcompile.backend" not in sys.modules
    assert callable(kvcompile.backend) and not isinstance(kvcompile.backend, type(module))
    assert isinstance(first, module.KVCompileBackend) and first.kv_dtype == "q8_0"
    assert isinstance(kvcompile.backend("fp8_e4m3"), module.KVCompileBackend)  # a second call still works


@pytest.mark.parametrize("device", [None, "cpu"], ids=["lazy", "eager"])
def test_a_new_cache_reuses_the_compiled_graphs(device, monkeypatch):
    """generate() twice, each over a fresh QuantizedCache (int8, K rotated: the layers read the
    shared rotation matrix): the second call compiles nothing. With ``device=None`` the buffers
    are allocated inside the first compiled graph; no rotation matrix is built when the compiled
    calls start (nor by an earlier test), as in a process whose first cache is compiled."""
    from kvcompile import rotation

    model, _ = make_model("llama", "sdpa")
    ids, _ = prompt(False)
    kw = cache_kwarg(model)
    gen = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)

    def cache():
        return kvcompile.QuantizedCache(model.config, max_batch_size=ids.shape[0], max_cache_len=ids.shape[1] + 4,
                                        kv_dtype="int8", device=device)

    with torch.no_grad():
        ref = model.generate(ids, **{kw: cache()}, **gen)
        monkeypatch.setattr(rotation, "_SHARED", {})  # as in a process whose first cache is compiled
        backend = kvcompile.backend("int8")
        model.forward = torch.compile(model.forward, backend=backend, fullgraph=True)
        first = model.generate(ids, **{kw: cache()}, **gen)
        graphs = len(backend.report())
        with torch._dynamo.config.patch(error_on_recompile=True):
            second = model.generate(ids, **{kw: cache()}, **gen)
    assert cache().layers[0].k_rotate  # the case this test is about
    assert torch.equal(first, ref) and torch.equal(second, ref)
    assert graphs == 2 and len(backend.report()) == graphs  # prefill + decode, nothing after

"""kvcompile.hf: layer shapes and windows as transformers' own caches read them, the refusals
(each naming the reason and the fix), the cache keyword, and an import graph without cycles."""

from __future__ import annotations

import ast
import inspect
import pathlib
import types

import pytest
import torch
import transformers

import kvcompile
from families import REFUSED, ROWS, WIDE, real_config, refusal_reason
from kvcompile import hf
from models import cache_kwarg, tiny_config, tiny_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the matrix's rows, skipped (with the reason) where the installed transformers runs none of a row's attentions
SERVED_ROWS = [pytest.param(row, id=row.name, marks=[pytest.mark.skip(reason=row.too_old(row.attn[0]))]
                            if all(row.too_old(a) for a in row.attn) else []) for row in ROWS]


def _windows_of_static_cache(config, max_cache_len: int = 1 << 20) -> list[int]:
    """transformers' StaticCache: a sliding layer holds min(window, max_cache_len) positions."""
    cache = transformers.StaticCache(config=config, max_cache_len=max_cache_len)
    return [layer.max_cache_len if getattr(layer, "is_sliding", False) else 0 for layer in cache.layers]


@pytest.mark.parametrize("row", SERVED_ROWS)
def test_windows_match_transformers_static_cache(row):
    """Per-layer windows equal the ones StaticCache builds its sliding layers with, for the tiny
    config, its window-removed control and the example model's config."""
    configs = [tiny_config(row.family, **row.tiny), real_config(row)]
    if row.windowed:
        configs.append(tiny_config(row.family, **{**row.tiny, **row.no_window}))
    for cfg in configs:
        assert hf.layer_windows(cfg) == _windows_of_static_cache(cfg)
        states = hf.state_layers(cfg)
        for i, (t, w, shape) in enumerate(zip(hf.layer_types(cfg), hf.layer_windows(cfg), hf.per_layer_shapes(cfg))):
            assert (i in states) == (t in hf.STATE_LAYER_TYPES), (i, t)
            if shape is None:  # no K/V: a layer reading another's K/V, or one keeping a state instead
                assert t == hf.NO_KV_LAYER_TYPE or (i in states and t not in hf.HYBRID_LAYER_TYPES), (i, t)
            else:  # a hybrid layer attends like its attention type
                assert hf.HYBRID_LAYER_TYPES.get(t, t) == ("sliding_attention" if w else "full_attention"), (i, t)
    tiny, control = hf.layer_windows(configs[0]), hf.layer_windows(configs[-1])
    if row.windowed:  # the test matrix's window rows slide somewhere, and their controls nowhere in its caches
        assert any(tiny) and all(w == 0 or w >= WIDE for w in control)
    else:
        assert not any(tiny)


@pytest.mark.parametrize("row", SERVED_ROWS)
def test_layer_shapes_are_what_the_model_writes(row):
    """Each layer's (kv heads, head_dim) equals the K the tiny model writes into that layer of a cache,
    and so does the QuantizedCache layer built for it."""
    cfg = tiny_config(row.family, **row.tiny)
    model = tiny_model(cfg, row.attn[0])
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True, **{cache_kwarg(model): cache})
    keys = [getattr(layer, "keys", None) for layer in cache.layers]  # a state layer has none
    written = [None if k is None else (k.shape[1], k.shape[3]) for k in keys]
    assert hf.per_layer_shapes(model.config) == written
    built = kvcompile.QuantizedCache(model.config, max_cache_len=8, kv_dtype="fp8_e4m3")
    assert [(layer.num_heads, layer.head_dim) if isinstance(layer, kvcompile.QuantizedLayer) else None
            for layer in built.layers] == written
    if len(set(written)) == 1:
        assert hf.layer_shapes(model.config) == (len(written), *written[0])
    else:
        with pytest.raises(ValueError, match=r"differ in \(kv heads, head dim\).*per_layer_shapes"):
            hf.layer_shapes(model.config)


_FALCON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)


# the new decoder's cached heads depend on the transformers version (5.17-5.24 broadcast the kv heads to
# every query head before the cache; 5.25 caches num_kv_heads): only "what the model writes" is checked
@pytest.mark.parametrize("variant, heads", [(dict(), 1), (dict(multi_query=False), 4),
                                            (dict(new_decoder_architecture=True, num_kv_heads=2), None)],
                         ids=["multi_query", "mha", "new_decoder"])
def test_falcon_kv_heads_are_what_the_model_writes(variant, heads):
    """Falcon names its kv heads num_kv_heads and caches one head with falcon-7b's multi_query: the
    cache allocates what the model writes, and the first update fits it (a mismatch would read as
    tensor parallelism)."""
    cfg = transformers.FalconConfig(**_FALCON, **variant)
    model = transformers.FalconForCausalLM(cfg).eval()
    ids = torch.tensor([[3, 4, 5]])
    ref = transformers.DynamicCache(config=cfg)
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(model): ref})
    _, kv_heads, head_dim = hf.layer_shapes(cfg)
    assert {(layer.keys.shape[1], layer.keys.shape[3]) for layer in ref.layers} == {(kv_heads, head_dim)}
    assert heads is None or kv_heads == heads
    cache = kvcompile.QuantizedCache(cfg, max_cache_len=8, kv_dtype="fp8_e4m3")
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(model): cache})
    assert cache.layers[0].k_codes.shape == (1, kv_heads, 8, head_dim)


def test_qwen2_window_follows_use_sliding_window_and_max_window_layers():
    cfg = lambda **kw: tiny_config("qwen2", num_hidden_layers=4, sliding_window=8, **kw)  # noqa: E731
    assert hf.layer_windows(cfg()) == [0, 0, 0, 0]  # the window Qwen2 carries by default is off
    assert hf.layer_windows(cfg(use_sliding_window=True, max_window_layers=2)) == [0, 0, 8, 8]
    assert hf.layer_windows(cfg(use_sliding_window=True, max_window_layers=0)) == [8, 8, 8, 8]


@pytest.mark.parametrize("entry", REFUSED, ids=[e.label for e in REFUSED])
def test_refused_families_name_the_reason_and_the_fix(entry):
    with pytest.raises(hf.UnsupportedModelError, match=entry.match) as e:
        kvcompile.QuantizedCache(entry.config(), max_batch_size=1, max_cache_len=16)
    assert isinstance(e.value, ValueError) and e.value.fix in str(e.value)
    assert entry.match.split()[0] in refusal_reason(entry)


@pytest.mark.parametrize(
    "config, match",
    [
        (lambda: transformers.GPT2Config(add_cross_attention=True), "cross-attention"),
        (lambda: tiny_config("gemma3", use_bidirectional_attention=True), "bidirectional"),
        (lambda: tiny_config("llama", v_head_dim=64, head_dim=32), "V head dim 64"),
        (lambda: tiny_config("llama", num_hidden_layers=2, layer_types=["sliding_attention"] * 2),
         "sliding_window"),
        (lambda: tiny_config("llama", num_hidden_layers=2, layer_types=["full_attention", "window_attention"]),
         "non-overlapping window"),
        (lambda: types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                       layer_types=["full_attention", "mystery_attention"]),
         "does not know.*mystery_attention"),
        (lambda: transformers.RwkvConfig(), "no attention heads"),
    ],
    ids=["cross-attention", "bidirectional", "v-head-dim", "window-missing", "window-attention",
         "unknown-type", "rwkv"],
)
def test_other_refusals(config, match):
    with pytest.raises(hf.UnsupportedModelError, match=match):
        hf.layer_shapes(config())


def test_bloom_refused_where_transformers_sizes_alibi_by_the_mask(monkeypatch):
    """transformers before 5.21 builds Bloom's ALiBi from the 2-D mask's length and widens generate()'s mask for its
    own StaticCache only, so Bloom over this cache raises inside the model: refused at construction, naming the
    version that works. Where Bloom pads the mask itself (its create_masks_for_generate) the same config is served."""
    config = tiny_config("bloom")
    if "create_masks_for_generate" in vars(transformers.BloomForCausalLM):  # 5.21 on (CI's transformers)
        hf.check_config(config)
    monkeypatch.delattr(transformers.BloomForCausalLM, "create_masks_for_generate", raising=False)
    with pytest.raises(hf.UnsupportedModelError, match=r"Bloom.*ALiBi.*5\.21 or later"):
        kvcompile.QuantizedCache(config, max_batch_size=1, max_cache_len=8)


def _gpt_neo(local: bool):
    types = [[["global", "local"], 1]] if local else [[["global"], 2]]
    return transformers.GPTNeoConfig(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, window_size=4,
                                     attention_types=types, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


def tiny_config_doge(keep: int):
    return transformers.DogeConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   keep_window_size=keep, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("family", ["gpt_neo", "doge"])
def test_key_length_selecting_models_refused_past_their_limit(family):
    """GPT-Neo's local layers (a band mask sliced by the key length) and Doge's dynamic mask (the
    keep_window_size largest keys over the key length) select keys by the key tensor's length,
    which a static cache pads: transformers' StaticCache shows it (its logits leave DynamicCache's),
    so kvcompile refuses lengths past the limit, naming it and the fix; up to the limit it builds,
    and the same family without the feature builds at any length."""
    cfg, plain, limit = {"gpt_neo": (_gpt_neo(True), _gpt_neo(False), 4),
                         "doge": (tiny_config_doge(4), tiny_config_doge(64), 4)}[family]
    model = tiny_model(cfg, "eager")
    for name, p in model.named_parameters():  # Doge's A at its zero init: every key's dynamic mask ties,
        if name.endswith(".A"):  # so the top-k selection runs by key index, which a static cache's padding moves
            torch.nn.init.zeros_(p)
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    kw = cache_kwarg(model)
    with torch.no_grad():
        dynamic = model(ids, **{kw: transformers.DynamicCache(config=cfg)}).logits
        static = model(ids, **{kw: transformers.StaticCache(config=cfg, max_cache_len=16)}).logits
    assert (dynamic - static).abs().max() > 1e-2  # what the refusal guards against
    with pytest.raises(hf.UnsupportedModelError, match=rf"={limit}\b.*max_cache_len <= {limit}, or .*DynamicCache"):
        kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3")
    assert kvcompile.QuantizedCache(cfg, max_cache_len=limit, kv_dtype="fp8_e4m3").max_cache_len == limit
    assert kvcompile.QuantizedCache(plain, max_cache_len=16, kv_dtype="fp8_e4m3").max_cache_len == 16


@pytest.mark.parametrize("cls, kw, match", [
    # a heterogeneous config (transformers' per-layer attributes): kv_lora_rank is per layer, and its
    # global read raises in transformers; the refusal must read it per layer
    ("Dots3NoteConfig", {}, "multi-head latent attention"),
    # K head dim 192, V head dim 128 (its published layout)
    ("MiMoV2FlashConfig", {}, "K head dim 192 and V head dim 128"),
    # its earlier loops read the cache layers' keys / values tensors (the per-loop mode runs, unrefused)
    ("DoryConfig", dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
                        n_recurrent_loops=2, recurrent_kv_cache_mode="last_loop"), "last_loop"),
])
def test_refusals_of_newer_families(cls, kw, match):
    if not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls}")
    with pytest.raises(hf.UnsupportedModelError, match=match):
        kvcompile.QuantizedCache(getattr(transformers, cls)(**kw), max_cache_len=16, kv_dtype="fp8_e4m3")


def test_mimo_v2_flash_sliding_layers_hold_twice_the_kv_heads():
    """MiMo-V2-Flash's modeling code gives its sliding layers twice the config's kv heads: the cache
    builds each layer of the shape the model writes, and eager logits over it stay within 8-bit
    error of the unquantized model's (a wrong shape raises at the first update)."""
    if not hasattr(transformers, "MiMoV2FlashConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no MiMoV2FlashConfig")
    from models import BASE

    cfg = transformers.MiMoV2FlashConfig(**{**BASE, "num_hidden_layers": 2, "head_dim": 32, "v_head_dim": 32,
                                            "layer_types": ["sliding_attention", "full_attention"],
                                            "sliding_window": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                            "moe_intermediate_size": 32})
    model = tiny_model(cfg, None)
    ids, kw = torch.tensor([[3, 4, 5, 6, 7, 8, 9]]), cache_kwarg(model)
    ref = transformers.DynamicCache(config=cfg)
    with torch.no_grad():
        want = model(input_ids=ids, **{kw: ref}).logits
        cache = kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="int8")
        got = model(input_ids=ids, **{kw: cache}).logits
    written = [(layer.keys.shape[1], layer.keys.shape[3]) for layer in ref.layers]
    assert written == [(4, 32), (2, 32)] == hf.per_layer_shapes(cfg)
    assert [(layer.num_heads, layer.head_dim) for layer in cache.layers] == written
    # int8 K/V (K rotated): measured 3.5e-3 of max|logits| ~0.9 on this model; 8-bit error, not a wrong layout
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


def test_bert_family_needs_is_decoder():
    """BERT-family causal-LM heads attend bidirectionally unless is_decoder=True (the witness: position
    0's logits move when a later token changes); kvcompile refuses that config and builds the other."""
    kw = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    ids = torch.randint(3, 96, (1, 6))
    later = ids.clone()
    later[0, -1] = (later[0, -1] + 1) % 96
    for is_decoder in (False, True):
        cfg = transformers.BertConfig(**kw, is_decoder=is_decoder)
        torch.manual_seed(0)
        model = transformers.BertLMHeadModel(cfg).eval()
        with torch.no_grad():
            moved = (model(ids).logits[0, 0] - model(later).logits[0, 0]).abs().max()
        assert (moved > 1e-4) == (not is_decoder)
        if is_decoder:
            assert kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3").max_cache_len == 16
        else:
            with pytest.raises(hf.UnsupportedModelError, match="is_decoder=False.*bidirectionally.*is_decoder=True"):
                kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3")


def test_cache_kwarg_sees_through_wrappers():
    model = tiny_model("llama")
    want = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"
    compiled = torch.compile(model.forward, backend="eager")
    padded = kvcompile.BatchPaddedForward(compiled, max_batch_size=2)
    for thing in (model, model.forward, compiled, padded):
        assert cache_kwarg(thing) == want
    model.forward = padded  # a model whose forward was replaced by a wrapper
    assert cache_kwarg(model) == want

    def old_forward(input_ids=None, past_key_values=None):
        pass

    def new_forward(input_ids=None, cache=None):
        pass

    assert cache_kwarg(old_forward) == "past_key_values" and cache_kwarg(new_forward) == "cache"
    assert cache_kwarg(print) == "past_key_values"  # no signature: the spelling every 5.x version takes


def _module_imports(path: pathlib.Path, package: str) -> set[str]:
    """kvcompile modules imported at module level (function-level imports are lazy, not cycles)."""
    tree = ast.parse(path.read_text())
    here = package.split(".")
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n.startswith("kvcompile"))
    return out


def test_kvcompile_has_no_import_cycle():
    pkg = ROOT / "kvcompile"
    modules = {}
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if rel.name == "__init__" else ".".join(rel.parts[:-1])
        modules[name] = (path, package)
    graph = {}
    for name, (path, package) in modules.items():
        deps = {d for d in _module_imports(path, package) if d in modules and d != name}
        graph[name] = {d for d in deps if not name.startswith(d + ".")}  # a submodule importing its package
    assert "kvcompile.cache" not in graph["kvcompile.calibration"]
    assert "kvcompile.hf" in graph["kvcompile.cache"] and "kvcompile.hf" in graph["kvcompile.calibration"]
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack + [node, dep])}")
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


@pytest.mark.skipif(not hf._has_no_kv_layers(), reason="this transformers has no placeholder for a layer without K/V")
def test_layers_that_store_no_kv_hold_a_placeholder():
    """Gemma 3n's shared layers store no K/V (the model hands them the K/V the last earlier layer of
    their type returned): the cache holds a NoKVLayer there, which transformers counts as a dummy
    layer, which holds no bytes, and which names the problem when written to; a calibration (one
    shape for every layer) is refused."""
    cfg = tiny_config("gemma3n", sliding_window=4)
    assert hf.per_layer_shapes(cfg) == [(2, 32), (2, 32), (2, 32), None]
    cache = kvcompile.QuantizedCache(cfg, max_batch_size=1, max_cache_len=16, kv_dtype="int8")
    assert [isinstance(layer, kvcompile.NoKVLayer) for layer in cache.layers] == [False, False, False, True]
    assert cache.is_dummy == [False, False, False, True]
    sizes = cache.planned_nbytes(per_layer=True, device="cpu")
    assert sizes[3] == 0 and all(sizes[:3])
    with pytest.raises(ValueError, match="layer 3 stores no K/V"):
        cache.update(torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32), 3)
    with pytest.raises(ValueError, match="layers that store no K/V.*without calibration"):
        kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3", calibration={"k_offset": torch.zeros(4, 2, 32)})


def test_cpmant_head_dim_is_its_dim_head():
    """CPM-Ant's config names the head dim dim_head (not hidden_size / heads): the K its model writes."""
    from models import BASE

    cfg = transformers.CpmAntConfig(**{**BASE, "num_key_value_heads": None, "dim_head": 16, "prompt_length": 2})
    model = tiny_model(cfg, None)
    ref = transformers.DynamicCache(config=cfg)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5]]), **{cache_kwarg(model): ref})
    written = [(layer.keys.shape[1], layer.keys.shape[3]) for layer in ref.layers]
    assert written == [(4, 16)] == hf.per_layer_shapes(cfg)

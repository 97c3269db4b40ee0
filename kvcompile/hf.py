"""What kvcompile reads from a Hugging Face model: layer shapes, attention types and windows, the
cache keyword, and the checks that refuse a model the cache cannot serve.

    num_layers, kv_heads, head_dim = layer_shapes(config)   # one shape for every layer (refuses others)
    shapes = per_layer_shapes(config)      # per layer: (kv heads, head_dim), which may differ (Gemma 4)
    windows = layer_windows(config)        # per layer: 0 = full attention, W = sliding window W
    states = state_layers(config)          # layer -> states, for a layer keeping a recurrent / conv state
    kwarg = cache_kwarg(model)             # "cache" (transformers >= 5.2x) or "past_key_values"

Layer types come from transformers' own rules (``get_layer_types_and_kwargs``, what
``StaticCache``/``DynamicCache`` build their layers from): ``config.layer_types`` when the config
has it (Qwen2 derives it from ``use_sliding_window`` / ``max_window_layers``, Gemma 2/3, gpt-oss
and Cohere2 from their local/global pattern), otherwise every layer is ``sliding_attention`` when
``config.sliding_window`` is set (Mistral, Phi-3, Starcoder2), ``chunked_attention`` when
``attention_chunk_size`` is, else ``full_attention``. A sliding layer's window is its config's
``sliding_window``; transformers' masks let query ``p`` see keys ``k > p - W``.

Every check raises :class:`UnsupportedModelError` (a ``ValueError``) naming what the model does
that the cache cannot store or the attention op cannot compute, and what to use instead. Nothing here imports the
rest of kvcompile but :mod:`kvcompile.checks` and :mod:`kvcompile.hf_config` (how a config is read:
layer types, the decoder's config, the error), which import none of it.
"""

from __future__ import annotations

import inspect
from .checks import not_a_causal_decoder
from .hf_config import (  # noqa: F401  (re-exported: kvcompile.hf is where they are read)
    HYBRID_LAYER_TYPES, NO_KV_LAYER_BASE, NO_KV_LAYER_TYPE, STATE_LAYER_BASE, STATE_LAYER_TYPES, SUPPORTED_LAYER_TYPES,
    UnsupportedModelError, _attention_type, _attr, _has_no_kv_layers, _layer_configs, _num_layers, _truthy_attr,
    _types_and_kwargs, _USE_HF_CACHE, layer_types, text_config)

__all__ = [
    "SUPPORTED_LAYER_TYPES",
    "UnsupportedModelError",
    "cache_kwarg",
    "check_config",
    "layer_shapes",
    "layer_types",
    "layer_windows",
    "NO_KV_LAYER_TYPE",
    "one_shape",
    "per_layer_shapes",
    "HYBRID_LAYER_TYPES",
    "STATE_LAYER_TYPES",
    "state_layers",
    "text_config",
]

# layer type -> why the cache cannot serve it
_REFUSED_LAYER_TYPES = {
    "chunked_attention": (
        "chunked attention (attention_chunk_size, Llama 4): each query sees only the keys of its own "
        "chunk, a mask kvcompile::attention does not apply"
    ),
    "linear_attention": ("a recurrent / linear-attention (Mamba, GDN, lightning) layer, whose state this release of "
                         "transformers has no cache layer for"),
    "conv": "a convolution layer, whose state this release of transformers has no cache layer for",
    "hybrid": ("an attention layer with a recurrent state beside its K/V (Zamba2, Falcon-H1), whose state this release "
               "of transformers has no cache layer for"),
    "hybrid_sliding": ("a sliding-window attention layer with a recurrent state beside its K/V, whose state this "
                       "release of transformers has no cache layer for"),
    "dummy": (
        "a layer without a K/V cache of its own (it reuses another layer's K/V, or has no attention); "
        "the cache needs one K/V store per layer"
    ),
    "indexed_attention": "sparse attention through a learned indexer (DeepSeek-V3.2 DSA): the cache keeps no indexer keys",
    "compressed_sparse_attention": "compressed sparse attention (DeepSeek-V4): not a K/V store per token",
    "heavily_compressed_attention": "compressed attention (DeepSeek-V4): not a K/V store per token",
    "minimax_m3_sparse": "lightning-index sparse attention (MiniMax-M3): the cache keeps no index keys",
    "reference_sliding_attention": "a full prefill plus a ring-buffered window over generated tokens (UnlimitedOCR)",
    "window_attention": "non-overlapping window attention (vision encoders): not causal decoding",
}


_ENCODER_UNLESS_DECODER = frozenset({
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod",
})


def _transformers_too_old_for_bloom() -> str | None:
    """The installed transformers' version where it sizes Bloom's ALiBi by the mask, else None (5.21 on:
    Bloom's own ``create_masks_for_generate`` pads generate()'s 2-D mask to the cache length for any cache)."""
    import transformers
    from transformers.models.bloom import modeling_bloom

    return None if "create_masks_for_generate" in vars(modeling_bloom.BloomForCausalLM) else transformers.__version__


def check_config(config) -> None:
    """Raise :class:`UnsupportedModelError` (a ``ValueError`` naming the reason and the fix) for a
    model the cache cannot serve."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(config).__name__} is an encoder-decoder model: its decoder cross-attends to the encoder "
            "(an EncoderDecoderCache), and the cache serves decoder-only self-attention"
        )
    not_decoder = not_a_causal_decoder(config)  # a ViT, DistilBERT, CLIP's text model, a ResNet
    if not_decoder:
        raise UnsupportedModelError(not_decoder, "build the cache from a language model's config (one that "
                                    "transformers.AutoModelForCausalLM loads)")
    text = text_config(config)
    _check_attention_inputs(text)
    _check_scores(text)
    _check_family_quirks(text)
    _check_layers(text)
    _per_layer_shapes(text)  # raises for K and V of different head dims


def _check_attention_inputs(text) -> None:
    """Refuse attention whose K/V are not the layer's own self-attention K/V of one shape."""
    name = type(text).__name__
    cross = _truthy_attr(text, "add_cross_attention", "cross_attention_layers")
    if cross:
        raise UnsupportedModelError(
            f"{name} has cross-attention ({cross[0]}={cross[1]}), and the cache serves self-attention K/V only"
        )
    if _attr(text, "kv_lora_rank") is not None:
        raise UnsupportedModelError(
            f"{name} uses multi-head latent attention (kv_lora_rank={_attr(text, 'kv_lora_rank')}: DeepSeek-V2/V3, "
            "Kimi K2, MiniCPM3): K and V come from a compressed latent with different head dims, which the cache's "
            "one-shape K/V store and kvcompile::attention do not serve"
        )


def _check_scores(text) -> None:
    """Refuse attention whose scores are not causal q.k (with the mask and biases the op applies)."""
    name = type(text).__name__
    model_type = getattr(text, "model_type", "") or ""
    # Bloom's ALiBi is a per-head, per-key score term sized by the cache (generate() runs over transformers'
    # StaticCache too), which the pass adds to the op's additive mask. MPT's and Falcon's (alibi=True): generate()
    # over transformers' own fixed-size StaticCache raises in their attention, and this cache is fixed-size too
    alibi = _attr(text, "alibi", False) or getattr(_attr(text, "attn_config"), "alibi", False)
    alibi = model_type != "bloom" and (alibi or _attr(text, "position_embedding_type") == "alibi")
    if alibi:
        raise UnsupportedModelError(
            f"{name} uses ALiBi (a per-head linear position bias added to the attention scores: MPT, Falcon with "
            "alibi=True) in an attention that transformers' generate() cannot run over a fixed-size cache (its own "
            "StaticCache raises the same), and this cache is fixed-size; Bloom's ALiBi is served"
        )
    if model_type == "bloom" and (old := _transformers_too_old_for_bloom()):
        raise UnsupportedModelError(
            f"{name} (Bloom): this transformers ({old}) builds its ALiBi term from the "
            "attention mask's length, not the cache's: over a fixed-size cache its forward raises, and generate() "
            "widens the mask for transformers' own StaticCache only",
            "upgrade transformers to 5.21 or later, where Bloom sizes ALiBi by the cache",
        )
    if _attr(text, "is_causal", True) is False or _attr(text, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{name} attends bidirectionally (is_causal=False / use_bidirectional_attention=True), and the "
            "cache serves causal decoding only",
            "run the model without a cache (it is an encoder)",
        )
    if model_type in _ENCODER_UNLESS_DECODER and not _attr(text, "is_decoder", False):
        raise UnsupportedModelError(
            f"{name} has is_decoder=False: this family (BERT, RoBERTa, ELECTRA, ...) attends bidirectionally unless "
            "its config says is_decoder=True, and the cache serves causal decoding only",
            "build the model from a config with is_decoder=True (transformers asks for it too when a causal-LM "
            "head runs on its own)",
        )
    if _attr(text, "d_rel") is not None:
        raise UnsupportedModelError(
            f"{name} adds a learned relative-position bias to its attention scores (d_rel={_attr(text, 'd_rel')}: "
            "Inkling), computed over key positions read from the cache's layout, which kvcompile::attention does "
            "not apply"
        )


def _check_family_quirks(text) -> None:
    """Refuse the families that read or evict cache entries in ways a fixed 8-bit cache cannot follow."""
    name = type(text).__name__
    model_type = getattr(text, "model_type", "") or ""
    last_loop = _attr(text, "recurrent_kv_cache_mode") == "last_loop"
    if model_type == "dory" and _attr(text, "n_recurrent_layers", 0) and last_loop:
        raise UnsupportedModelError(
            f"{name} runs recurrent_kv_cache_mode='last_loop': its earlier loops read the cache layers' keys and "
            "values tensors directly, which a kvcompile cache holds as 8-bit codes"
        )
    if model_type == "moshi" and _attr(text, "sliding_window") is not None:
        raise UnsupportedModelError(
            f"{name} gives its layers a sliding_window ({_attr(text, 'sliding_window')}) but masks them as full "
            "causal attention: the window exists only as transformers' caches evict old tokens, so a prefill sees "
            "every token and a decode step the last sliding_window; kvcompile's cache applies the window to every "
            "query"
        )
    shared = _attr(text, "num_kv_shared_layers", 0)
    if shared and not (_has_no_kv_layers() and getattr(text, "kv_sharing_modes", None) is not None):
        raise UnsupportedModelError(
            f"{name} shares K/V across layers (num_kv_shared_layers={shared}: Gemma 3n, Gemma 4): those layers "
            "read another layer's cache entries directly"
        )


def _check_layers(text) -> None:
    """Refuse a model without attention heads, a layer type the cache does not serve, a sliding layer
    without a window, and a model none of whose layers stores K/V."""
    name = type(text).__name__
    if _attr(text, "num_attention_heads") is None:
        raise UnsupportedModelError(
            f"{name} has no attention heads (a recurrent model such as Mamba or RWKV): it keeps no K/V to quantize",
            "run it without kvcompile",
        )
    types, kwargs = _types_and_kwargs(text)
    for i, (t, kw) in enumerate(zip(types, kwargs)):
        served = _has_no_kv_layers() if t == NO_KV_LAYER_TYPE else (
            STATE_LAYER_BASE is not None if t in STATE_LAYER_TYPES else True)
        attention = _attention_type(t)
        if served and attention is None:
            continue
        if served and attention in SUPPORTED_LAYER_TYPES:
            if attention == "sliding_attention":
                w = kw.get("sliding_window")
                if not isinstance(w, int) or isinstance(w, bool) or w < 1:
                    raise UnsupportedModelError(
                        f"layer {i} of {name} is a sliding-attention layer but its sliding_window is {w!r}",
                        "set config.sliding_window to the window (a positive int)",
                    )
            continue
        why = _REFUSED_LAYER_TYPES.get(t, f"an attention type kvcompile does not know ({t!r})")
        raise UnsupportedModelError(
            f"layer {i} of {name} has type {t!r}: {why}; the cache serves "
            f"{' and '.join(SUPPORTED_LAYER_TYPES)} layers only"
        )
    if not any(_attention_type(t) in SUPPORTED_LAYER_TYPES for t in types):
        raise UnsupportedModelError(
            f"no layer of {name} stores K/V (its layer types are {sorted(set(types))}): there is nothing to quantize",
            "run it without kvcompile (transformers' DynamicCache keeps its states)",
        )


def _kv_heads(cfg, heads: int) -> int:
    """The kv heads each layer of ``cfg`` hands its cache: ``num_key_value_heads`` where the config has
    it. Falcon's config has it from transformers 5.25 on; before, it names them ``num_kv_heads`` and the
    cache gets what the attention computes from it: every query head's K/V in the
    ``new_decoder_architecture`` (falcon-40b / 180b broadcast their kv heads before the cache), one
    head with ``multi_query`` (falcon-7b), else ``num_kv_heads``."""
    kv = getattr(cfg, "num_key_value_heads", None)
    if kv:
        return kv
    if getattr(cfg, "new_decoder_architecture", False):
        return heads
    if getattr(cfg, "multi_query", False):
        return 1
    return getattr(cfg, "num_kv_heads", None) or heads


def _per_layer_shapes(text) -> list[tuple[int, int] | None]:
    name = type(text).__name__
    shapes = []
    types, _ = _types_and_kwargs(text)
    for cfg, layer_type in zip(_layer_configs(text), types):
        if _attention_type(layer_type) is None:
            shapes.append(None)
            continue
        heads = cfg.num_attention_heads
        kv_heads = _kv_heads(cfg, heads)
        # CPM-Ant names it dim_head
        head_dim = getattr(cfg, "head_dim", None) or getattr(cfg, "dim_head", None) or cfg.hidden_size // heads
        if _attention_type(layer_type) == "sliding_attention":
            if getattr(text, "model_type", "") == "mimo_v2_flash":
                kv_heads *= 2  # MiMo-V2-Flash's sliding layers: twice the config's kv heads (its modeling code)
            # Inkling's sliding layers have their own kv heads and head dim
            kv_heads = getattr(cfg, "swa_num_key_value_heads", None) or kv_heads
            head_dim = getattr(cfg, "swa_head_dim", None) or head_dim
        v_head_dim = getattr(cfg, "v_head_dim", None)
        if v_head_dim is not None and v_head_dim != head_dim:
            raise UnsupportedModelError(
                f"{name} has K head dim {head_dim} and V head dim {v_head_dim}, and the cache stores K and V of one shape"
            )
        shapes.append((kv_heads, head_dim))
    return shapes


def per_layer_shapes(config) -> list[tuple[int, int] | None]:
    """``(kv_heads, head_dim)`` of each decoder layer, which may differ between layers (Gemma 4's
    global layers have twice the head dim of its sliding ones, MiMo-V2-Flash's sliding layers twice
    the kv heads); ``None`` for a layer that stores no K/V of its own (:data:`NO_KV_LAYER_TYPE`: it
    reuses an earlier layer's, or has no attention; a :data:`STATE_LAYER_TYPES` layer but a hybrid one:
    it keeps a recurrent or convolution state instead, :func:`state_layers`). Refuses (:class:`UnsupportedModelError`) what
    the cache cannot serve."""
    check_config(config)
    return _per_layer_shapes(text_config(config))


def state_layers(config) -> dict[int, int]:
    """Layer index -> number of states, for each layer of :data:`STATE_LAYER_TYPES` (a recurrent or
    convolution state instead of K/V, or beside it; transformers' ``number_of_conv_states``, 1 for
    most models).
    Refuses (:class:`UnsupportedModelError`) what the cache cannot serve."""
    check_config(config)
    types, kwargs = _types_and_kwargs(text_config(config))
    return {i: kw["number_of_states"] for i, (t, kw) in enumerate(zip(types, kwargs)) if t in STATE_LAYER_TYPES}


def layer_shapes(config) -> tuple[int, int, int]:
    """``(num_layers, kv_heads, head_dim)`` of a decoder whose layers share one shape; refuses
    (:class:`UnsupportedModelError`) what the cache cannot serve (see :func:`check_config`), and raises
    ``ValueError`` for layers of different shapes (:func:`per_layer_shapes` describes those)."""
    shapes = per_layer_shapes(config)
    return (len(shapes), *one_shape(config, shapes, "kvcompile",
                                    "layer_shapes describes one shape for every layer (kvcompile.hf.per_layer_shapes "
                                    "gives each layer's)"))


def one_shape(config, shapes: list, who: str, why: str) -> tuple[int, int]:
    """The ``(kv_heads, head_dim)`` every layer of :func:`per_layer_shapes` shares; ``ValueError`` from
    ``who`` naming the shapes (a layer without K/V among them) and ``why`` one shape is needed."""
    if len(set(shapes)) == 1 and shapes[0] is not None:
        return shapes[0]
    names = str(sorted({s for s in shapes if s is not None}))
    if None in shapes:
        names += " and layers that store no K/V"
    raise ValueError(f"{who}: the layers of {type(text_config(config)).__name__} differ in (kv heads, head dim): "
                     f"{names}; {why}")


def layer_windows(config) -> list[int]:
    """Per decoder layer: 0 for full attention, ``W`` for a sliding window of ``W`` keys (query ``p``
    sees keys ``k > p - W``). Refuses (:class:`UnsupportedModelError`) what the cache cannot serve (see
    :func:`check_config`)."""
    check_config(config)
    types, kwargs = _types_and_kwargs(text_config(config))
    return [int(kw["sliding_window"]) if _attention_type(t) == "sliding_attention" else 0
            for t, kw in zip(types, kwargs)]


def check_cache_length(config, max_cache_len: int) -> None:
    """Raise :class:`UnsupportedModelError` for a model whose attention cannot run over a static cache
    of ``max_cache_len`` positions.

    Two models select keys by the key tensor's length, which a static cache pads to
    ``max_cache_len`` (transformers' own ``StaticCache`` gives the same wrong answers there):

    * GPT-Neo's local layers cut their window out of a band mask by rows ``key_length -
      query_length ...``: past ``window_size`` positions the band lands on the empty slots past the
      tokens stored (up to ``window_size`` the band holds every key);
    * Doge's dynamic mask keeps the ``keep_window_size`` keys of largest weight over the whole key
      length: past it, empty slots compete with the stored tokens.
    """
    text = text_config(config)
    model_type = getattr(text, "model_type", "")
    limit, why = None, ""
    if model_type == "gpt_neo" and "local" in (getattr(text, "attention_layers", None) or []):
        limit = getattr(text, "window_size", None)
        why = (f"GPT-Neo's local attention layers (window_size={limit}) cut their window out of a mask by the key "
               "tensor's length")
    elif model_type == "doge":
        limit = getattr(text, "keep_window_size", None)
        why = (f"Doge's dynamic mask keeps the keep_window_size={limit} keys of largest weight over the key "
               "tensor's whole length")
    if limit and max_cache_len > limit:
        raise UnsupportedModelError(
            f"{why}, which a static cache pads to max_cache_len={max_cache_len}: past {limit} positions it would "
            "select empty slots (transformers' StaticCache gives the same wrong answer)",
            f"use max_cache_len <= {limit}, or transformers' DynamicCache for longer sequences",
        )


def cache_kwarg(model) -> str:
    """The keyword under which ``model`` (a transformers model, its ``forward``, or a wrapper of it such
    as ``torch.compile``'s or :class:`kvcompile.BatchPaddedForward`) takes a cache: ``"cache"``
    (transformers >= 5.24, where ``past_key_values`` is deprecated) or ``"past_key_values"`` (older 5.x)."""
    fwd = model.forward if hasattr(model, "forward") and not inspect.isfunction(model) else model
    fwd = getattr(fwd, "_torchdynamo_orig_callable", fwd)
    try:
        params = inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"

"""How kvcompile reads a Hugging Face config: the layer types it serves (and transformers' cache-layer
bases for them), the decoder's config, each layer's type and cache kwargs by transformers' own rules,
and a per-layer attribute; :class:`UnsupportedModelError`, which every refusal raises. The base of
:mod:`kvcompile.hf` (which re-exports these names, adds the shapes, windows and checks); imports
nothing of kvcompile."""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_LAYER_TYPES", "NO_KV_LAYER_TYPE", "NO_KV_LAYER_BASE", "STATE_LAYER_TYPES", "HYBRID_LAYER_TYPES", "STATE_LAYER_BASE", "UnsupportedModelError", "text_config", "layer_types"]


#: Layer types the cache serves: a full layer stores every position, a sliding layer its window (a
#: ring, :mod:`kvcompile.ring`); the window is applied by the model's mask in eager mode and by the
#: kvcompile attention ops in compiled code.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")

#: transformers' cache-layer type of a layer with no K/V store of its own (a layer that reuses an earlier
#: layer's K/V, or has no attention): the cache holds a placeholder there (:class:`kvcompile.NoKVLayer`).
NO_KV_LAYER_TYPE = "dummy"


try:  # transformers' placeholder cache layer (with kv_sharing_modes: a sharing layer takes the K/V the earlier
    # layer's update returned, not the cache's storage); older releases have neither, and are refused such layers
    from transformers.cache_utils import DummyLayer as NO_KV_LAYER_BASE
except ImportError:
    NO_KV_LAYER_BASE = None


def _has_no_kv_layers() -> bool:
    return NO_KV_LAYER_BASE is not None


#: transformers' cache-layer types that keep a recurrent or convolution state: instead of K/V (Mamba and
#: gated-delta-net layers of hybrid models such as Qwen3-Next, Qwen3.5, Jamba, Bamba, Nemotron-H; short
#: convolutions of LFM-style models), or beside it (:data:`HYBRID_LAYER_TYPES`). The state is kept by
#: transformers' own linear-attention layer (:class:`kvcompile.StateLayer`, or the state half of a
#: :class:`kvcompile.HybridLayer`), at its fixed size and in the model's dtype.
STATE_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")

#: state layer types that store K/V too (an attention and a Mamba mixer in one layer: Falcon-H1, Zamba2's
#: shared blocks), and the attention each applies over its K/V.
HYBRID_LAYER_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}

try:  # transformers' linear-attention cache layer (conv / recurrent states); releases without it refuse such layers
    from transformers.cache_utils import LinearAttentionLayer as STATE_LAYER_BASE
except ImportError:
    STATE_LAYER_BASE = None

_USE_HF_CACHE = "use transformers' own cache (DynamicCache / StaticCache) for this model"


class UnsupportedModelError(ValueError):
    """A model the cache cannot serve: ``reason`` says what the model does, ``fix`` what to use instead."""

    def __init__(self, reason: str, fix: str = _USE_HF_CACHE):
        self.reason, self.fix = reason, fix
        super().__init__(f"kvcompile.QuantizedCache: {reason}; {fix}")


def text_config(config) -> Any:
    """The decoder's config (``config.get_text_config(decoder=True)`` for multimodal wrappers)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _layer_configs(text) -> list:
    """One config per layer: transformers' per-layer view where it has one (heterogeneous configs)."""
    if hasattr(text, "per_layer_config"):
        return list(text.per_layer_config)
    return [text] * _num_layers(text)


def _num_layers(text) -> int:
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise UnsupportedModelError(
            f"the config ({type(text).__name__}) has no num_hidden_layers",
            "pass the model's decoder config (model.config of a transformers causal LM)",
        )
    return n


_NO_ATTENTION = {"moe": NO_KV_LAYER_TYPE, "mlp": NO_KV_LAYER_TYPE}  # layer types without attention, as transformers maps them


def _types_and_kwargs(text) -> tuple[list[str], list[dict]]:
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # transformers before per-layer cache construction: the same rules, one config
        get_layer_types_and_kwargs = None
    try:
        if get_layer_types_and_kwargs is not None and hasattr(text, "per_layer_config"):
            types, kwargs = get_layer_types_and_kwargs(text)
            if isinstance(kwargs, dict):  # transformers <= 5.17: one kwargs dict shared by every layer
                kwargs = [_layer_kwargs(t, kwargs.get("sliding_window"), kwargs.get("number_of_states", 1))
                          for t in types]
            # layers without attention ("moe" / "mlp"): transformers >= 5.2x names them "dummy" itself
            return [_NO_ATTENTION.get(t, t) for t in types], list(kwargs)
        return _types_and_kwargs_fallback(text)
    except AttributeError as e:  # e.g. sliding_attention layers in a config without sliding_window
        raise UnsupportedModelError(
            f"the layer types of {type(text).__name__} cannot be read ({e})",
            "give the config the attribute its layer types need (sliding_window for sliding_attention layers)",
        ) from e


def _types_and_kwargs_fallback(text) -> tuple[list[str], list[dict]]:
    n = _num_layers(text)
    types = getattr(text, "layer_types", None)
    if types is None:
        if getattr(text, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n
        elif getattr(text, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    remap = {"mamba": "linear_attention", "attention": "full_attention", **_NO_ATTENTION}
    types = [remap.get(t, t) for t in types]
    window, states = getattr(text, "sliding_window", None), getattr(text, "number_of_conv_states", 1)
    return types, [_layer_kwargs(t, window, states) for t in types]


def _layer_kwargs(layer_type: str, sliding_window, number_of_states) -> dict:
    """What a layer of ``layer_type`` is built from: a sliding layer's window, a state layer's count of states."""
    kwargs = {"sliding_window": sliding_window} if _attention_type(layer_type) == "sliding_attention" else {}
    if layer_type in STATE_LAYER_TYPES:
        kwargs["number_of_states"] = number_of_states or 1
    return kwargs


def _attention_type(layer_type: str) -> str | None:
    """The attention a layer of ``layer_type`` applies over its K/V (a hybrid layer's, see
    :data:`HYBRID_LAYER_TYPES`); None for a layer that stores no K/V (a state or a dummy layer)."""
    if layer_type == NO_KV_LAYER_TYPE or (layer_type in STATE_LAYER_TYPES and layer_type not in HYBRID_LAYER_TYPES):
        return None
    return HYBRID_LAYER_TYPES.get(layer_type, layer_type)


def layer_types(config) -> list[str]:
    """Attention type per decoder layer, as transformers' own caches read it."""
    types, _ = _types_and_kwargs(text_config(config))
    return list(types)


def _attr(text, name: str, default: Any = None) -> Any:
    """``text.<name>``; for an attribute a heterogeneous config holds per layer (transformers raises
    on its global read), the first layer's value other than ``default`` (any layer that departs from
    it decides a refusal), else ``default``."""
    try:
        return getattr(text, name, default)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: it varies across layers
        if not hasattr(text, "per_layer_config"):
            raise
        values = (getattr(c, name, default) for c in text.per_layer_config)
        return next((v for v in values if v != default), default)


def _truthy_attr(cfg, *names) -> Any:
    for name in names:
        value = _attr(cfg, name)
        if value:
            return name, value
    return None

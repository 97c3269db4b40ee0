"""The one tiny-model factory of the tests (no tests here): ``tiny_config`` / ``tiny_model``.

Every family is its real transformers architecture shrunk to a few layers and a hidden size of
128 (4 query heads, 2 kv heads, head_dim 32: 32 so that q8_0's block-32 scales apply), so that
Dynamo tracing stays within CI's 2 cores. Real sizes are in the comments. A test module that needs
other sizes passes them as overrides (``tiny_config("llama", hidden_size=64, head_dim=32)``); the
families here fix only what the architecture needs to build small (expert counts, layer
patterns). Windows, softcapping and the like are the caller's overrides too.

``cache_kwarg`` is :func:`kvcompile.hf.cache_kwarg` (the keyword a model takes its cache under).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import transformers

from kvcompile.hf import cache_kwarg

__all__ = ["BASE", "FAMILIES", "cache_kwarg", "tiny_config", "tiny_model"]

BASE = dict(
    vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

_TWO = ["sliding_attention", "full_attention"]  # a local/global pair: the smallest hybrid
_STATE = ["linear_attention", "full_attention"]  # a state layer (Mamba / gated delta net) and an attention layer

# family -> (transformers config class, what the architecture needs beyond BASE)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama-3.1-8B: hidden 4096, 32 layers, 32 q / 8 kv heads, head_dim 128
    "llama": ("LlamaConfig", {}),
    # Qwen2.5-7B: hidden 3584, 28 layers, 28 q / 4 kv heads, head_dim 128, qkv bias;
    # use_sliding_window=True makes layers >= max_window_layers slide
    "qwen2": ("Qwen2Config", {}),
    # Qwen3-8B: hidden 4096, 36 layers, 32 q / 8 kv heads, head_dim 128, q/k RMSNorm
    "qwen3": ("Qwen3Config", {}),
    # Mistral-7B-v0.1: hidden 4096, 32 layers, 32 q / 8 kv heads, head_dim 128, sliding window 4096
    "mistral": ("MistralConfig", {}),
    # Phi-3-mini-4k: hidden 3072, 32 layers, 32 q / 32 kv heads (MHA), head_dim 96, fused qkv, window 2047
    "phi3": ("Phi3Config", {}),
    # Gemma-7B: hidden 3072, 28 layers, 16 q / 16 kv heads, head_dim 256, embeddings * sqrt(hidden)
    "gemma": ("GemmaConfig", {}),
    # Gemma-2-9B: hidden 3584, 42 layers alternating window-4096 / global, 16 q / 8 kv heads,
    # head_dim 256, attention logit softcap 50 (eager only: transformers has no SDPA path for it)
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=2, layer_types=_TWO)),
    # Gemma-3-4B (text): hidden 2560, 34 layers, 5 window-1024 layers per global one, 8 q / 4 kv heads,
    # head_dim 256, q/k RMSNorm
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=2, layer_types=_TWO)),
    # Gemma 4 (text; transformers' default Gemma4TextConfig): hidden 2304, 30 layers, 5 window-512 layers
    # per global one, 8 q / 4 kv heads, head_dim 256 on the sliding layers and 512 (global_head_dim) on the
    # global ones, q/k/v RMSNorm, per-layer input embeddings. Tiny: the global layer has twice the head
    # dim and half the kv heads of the sliding one (a cache shape per layer)
    "gemma4": ("Gemma4TextConfig", dict(num_hidden_layers=2, layer_types=_TWO, vocab_size_per_layer_input=96,
                                        hidden_size_per_layer_input=16,
                                        per_layer_config={1: dict(head_dim=64, num_key_value_heads=1)})),
    # Gemma 3n (text; gemma-3n-E4B): hidden 2048, 35 layers, 4 window-512 layers per global one, 8 q / 2 kv
    # heads, head_dim 256, AltUp and Laurel blocks, per-layer input embeddings; its last 15 layers store no
    # K/V and read the K/V of the last earlier layer of their type. Tiny: 4 layers, the last (full) reading
    # layer 1's
    "gemma3n": ("Gemma3nTextConfig", dict(num_hidden_layers=4, layer_types=_TWO, num_kv_shared_layers=1,
                                          vocab_size_per_layer_input=96, hidden_size_per_layer_input=16,
                                          altup_num_inputs=2, laurel_rank=8, activation_sparsity_pattern=[0.0] * 4,
                                          intermediate_size=[128] * 4)),
    # gpt-oss-20b: hidden 2880, 24 layers alternating window-128 / global, 64 q / 8 kv heads,
    # head_dim 64, a learned sink logit per head, 32 experts top-4 (eager only in transformers)
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, layer_types=_TWO, num_local_experts=4,
                                     num_experts_per_tok=2)),
    # granite-swash-2b (GraniteSWA): hidden 2560, 24 layers alternating window-128 / global, 20 q / 4 kv
    # heads, a learned sink per head applied after attention (eager only in transformers)
    "granite_swa": ("GraniteSWAConfig", dict(num_hidden_layers=2, layer_types=_TWO)),
    # Granite-3.0-8B: hidden 4096, 40 layers, 32 q / 8 kv heads, embedding/residual/attention multipliers
    "granite": ("GraniteConfig", {}),
    # OLMo-2-7B: hidden 4096, 32 layers, 32 heads (MHA), q/k RMSNorm after the projections
    "olmo2": ("Olmo2Config", {}),
    # StableLM-2-1.6B: hidden 2048, 24 layers, 32 heads (MHA), partial rotary (25%)
    "stablelm": ("StableLmConfig", {}),
    # Command-R (35B): hidden 8192, 40 layers, 64 heads (MHA), parallel attention/MLP block
    "cohere": ("CohereConfig", {}),
    # Command-R7B: hidden 4096, 32 layers, 3 window-4096 layers per global one (global layers: no RoPE)
    "cohere2": ("Cohere2Config", dict(num_hidden_layers=2, layer_types=_TWO)),
    # StarCoder2-7B: hidden 4608, 32 layers, 36 q / 4 kv heads, sliding window 4096, LayerNorm, biases
    "starcoder2": ("Starcoder2Config", {}),
    # Mixtral-8x7B: hidden 4096, 32 layers, 32 q / 8 kv heads, 8 experts top-2
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Qwen3-30B-A3B: hidden 2048, 48 layers, 32 q / 4 kv heads, head_dim 128, 128 experts top-8
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)),
    # GPT-2 (124M): hidden 768, 12 layers, 12 heads (MHA), learned positions, Conv1D projections;
    # eager attention casts P with .type(). No num_key_value_heads in its config: BASE's is dropped
    "gpt2": ("GPT2Config", dict(num_key_value_heads=None)),
    # GPT-J-6B: hidden 4096, 28 layers, 16 heads (MHA), rotary on 64 of 256 dims; eager scores in float32
    # from query.to(float32) / key.to(float32)
    "gptj": ("GPTJConfig", dict(num_key_value_heads=None, rotary_dim=16)),
    # GPT-Neo-1.3B: hidden 2048, 24 layers alternating global / local (window_size 256), 16 heads (MHA),
    # learned positions, unscaled float32 scores masked by torch.where(band, scores, finfo.min); its
    # local layers are served up to window_size positions (kvcompile.hf.check_cache_length)
    "gpt_neo": ("GPTNeoConfig", dict(num_key_value_heads=None, num_hidden_layers=2,
                                     attention_types=[[["global", "local"], 1]], window_size=256)),
    # GPT-NeoX-Japanese-2.7B: hidden 2560, 32 layers, 32 heads (MHA), rotary; eager attention with the heads
    # folded into the batch: baddbmm(zeros, q.view(B*H, Tq, D), K.view(B*H, T, D).transpose(1, 2), alpha=s)
    "gpt_neox_japanese": ("GPTNeoXJapaneseConfig", dict(num_key_value_heads=None)),
    # Bloom-7b1: hidden 4096, 30 layers, 32 heads (MHA), ALiBi, no rotary; eager attention with its heads folded
    # into the batch, the ALiBi term baddbmm's input: alibi.baddbmm(q.view(B*H, Tq, D), K^T, beta=1, alpha=s)
    "bloom": ("BloomConfig", dict(num_key_value_heads=None)),
    # DogeConfig's defaults: hidden 1024, 32 layers, 8 heads; a dynamic mask computed from the cached V (dt_proj
    # reads the dequantized V beside the attention), per query head
    "doge": ("DogeConfig", {}),
    # JetMoE-8B: hidden 2048, 24 layers, 16 kv heads of 128 (kv_channels) tiled for top_k = 2 experts' queries
    # (query head h reads kv head h mod 16): 4 query heads over BASE's 2 kv heads of 32 here
    "jetmoe": ("JetMoeConfig", dict(kv_channels=32, num_local_experts=2, num_experts_per_tok=2)),
    # Qwen3.5 (text; transformers' default Qwen3_5TextConfig): 32 layers, 3 gated-delta-net layers (a
    # recurrent state, no K/V) per attention layer; attention: 16 q / 4 kv heads, head_dim 256, q/k RMSNorm,
    # an output gate. Tiny: one of each
    "qwen3_5": ("Qwen3_5TextConfig", dict(num_hidden_layers=2, layer_types=_STATE)),
    # Qwen3-Next-80B-A3B: 48 layers, 3 gated-delta-net layers per attention layer, 512 experts top-10
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=2, layer_types=_STATE, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=64)),
    # Jamba-v0.1: 32 layers, one attention layer per 8 (offset 4), the rest Mamba; no positional encoding
    # in attention; 16 experts top-2 on every other layer. Tiny: Mamba then attention
    "jamba": ("JambaConfig", dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                  expert_layer_period=2, expert_layer_offset=1, num_experts=4)),
    # Nemotron-H (transformers' default NemotronHConfig): Mamba2, MoE, attention and MLP layers, one of each;
    # the MoE and MLP layers have no attention (no K/V: kvcompile.NoKVLayer)
    "nemotron_h": ("NemotronHConfig", dict(num_hidden_layers=4)),
    # LFM3 (transformers' default Lfm3Config): 24 layers, short convolutions (a conv state) between
    # attention layers that alternate full and window-256; 16 q / 4 kv heads. Tiny: one of each
    "lfm3": ("Lfm3Config", dict(num_hidden_layers=3, layer_types=["conv", "sliding_attention", "full_attention"])),
    # Falcon-H1 (transformers' default FalconH1Config, Falcon-H1-7B's layout): 32 layers, each an attention
    # and a Mamba2 mixer side by side (a hybrid cache layer: K/V and a recurrent state)
    "falcon_h1": ("FalconH1Config", dict(num_hidden_layers=2)),
    # falcon-7b: hidden 4544, 32 layers, 71 q heads over one kv head (multi_query, broadcast without
    # enable_gqa); its config names kv heads num_kv_heads; eager divides the scores in place
    "falcon": ("FalconConfig", dict(num_key_value_heads=None)),
    # Pythia-1.4b (GPT-NeoX): hidden 2048, 24 layers, 16 heads (MHA), fused qkv, rotary on a quarter of
    # each head, attention and MLP in parallel
    "gpt_neox": ("GPTNeoXConfig", dict(num_key_value_heads=None)),
    # Phi-2: hidden 2560, 32 layers, 32 heads (MHA), rotary on 40% of each head, attention and MLP in parallel
    "phi": ("PhiConfig", dict(num_key_value_heads=None)),
    # SmolLM3-3B: hidden 2048, 36 layers, 16 q / 4 kv heads, every 4th layer without rotary (NoPE). Tiny:
    # one rotary layer, one NoPE
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=2, no_rope_layers=[1, 0])),
}


def tiny_config(family: str, **overrides):
    """The tiny config of ``family`` (a key of :data:`FAMILIES`): BASE, the family's needs, then ``overrides``."""
    cls_name, needs = FAMILIES[family]
    cls = getattr(transformers, cls_name)
    kw = {**BASE, **needs, **overrides}
    if "head_dim" not in kw and _has_field(cls, "head_dim"):  # else Gemma's default 256, gpt-oss's 64, ...
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    layer_types = kw.get("layer_types")
    if layer_types is not None and len(layer_types) != kw["num_hidden_layers"]:
        kw["layer_types"] = [layer_types[i % len(layer_types)] for i in range(kw["num_hidden_layers"])]
    return cls(**kw)


def _has_field(cls, name: str) -> bool:
    if dataclasses.is_dataclass(cls):
        return any(f.name == name for f in dataclasses.fields(cls))
    return name in inspect.signature(cls.__init__).parameters


# parameters transformers initializes to zero where zero hides a feature from the checks: Doge's A (its dynamic
# mask is exp(A * softplus(dt_proj(V))), all ones at A = 0, so a wrong V read beside the attention would not show).
# Drawn after the weights, from the same seed
DRAWN = {"DogeAttention": ("A",)}


def tiny_model(family_or_config, attn: str | None = "sdpa", *, seed: int = 0, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None, **overrides):
    """A random causal LM (eval mode) from :func:`tiny_config` (or from a config given as is), its
    weights drawn after ``torch.manual_seed(seed)``; ``attn`` is the attention implementation (None:
    transformers' default for the model). The tests' one factory of tiny models."""
    if isinstance(family_or_config, str):
        cfg = tiny_config(family_or_config, **overrides)
    else:
        if overrides:
            raise TypeError("tiny_model: overrides apply to a family name, not to a ready config")
        cfg = family_or_config
    torch.manual_seed(seed)
    kw = {} if attn is None else {"attn_implementation": attn}
    model = transformers.AutoModelForCausalLM.from_config(cfg, **kw)
    with torch.no_grad():
        for module in model.modules():
            for name in DRAWN.get(type(module).__name__, ()):
                getattr(module, name).normal_(std=0.5)
    if dtype is not None or device is not None:
        model = model.to(device=device, dtype=dtype)
    return model.eval()

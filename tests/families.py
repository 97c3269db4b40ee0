"""The family matrix: the Hugging Face families kvcompile serves (``tests/test_families.py`` runs
every row) and the ones it refuses (with :mod:`kvcompile.hf`'s reason).

    PYTHONPATH=. python tests/families.py     # prints the table of families (the README's "Model families" sums it up)

The table is generated from these two lists: a supported row's attention column comes from
:func:`kvcompile.hf.layer_windows` on its example model's config (transformers' default config of
the class with the example's published layer count and window), a refused row's reason from the
:class:`kvcompile.hf.UnsupportedModelError` its config raises.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import packaging.version
import transformers

W = 4  # the tiny window: the test prompt (8 tokens) and decode run past it
WIDE = 64  # a window wider than every cache of the matrix tests (16 positions): slides nowhere there

_FULL2 = ["full_attention", "full_attention"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One supported family of the matrix."""

    name: str  # test id
    family: str  # key of models.FAMILIES
    label: str  # the family in the table
    example: str  # a published model of this layout
    tiny: dict  # overrides on models.tiny_config (window, softcap, ...)
    # overrides that remove the window (the control), or widen it to WIDE where a family's layer types must
    # stay (Gemma 4: its rotary embedding wants each layer type's layers alike); None: no window
    no_window: dict | None = None
    real: dict = dataclasses.field(default_factory=dict)  # overrides on transformers' default config: the example's layout
    attn: tuple = ("sdpa", "eager")  # the attention implementations transformers has for it
    note: str = ""  # what else the attention does
    # False: a forward with a 2-D attention_mask over the tokens seen (shorter than the cache) is not a call the
    # family takes over a fixed-size cache (Bloom builds its ALiBi from that mask; transformers' StaticCache
    # fails the same way), so the matrix leaves that run out; generate(), which passes a mask spanning the cache,
    # still checks a left-padded batch
    forward_mask: bool = True
    # (version, attention implementations, why): transformers before `version` runs these wrong over any cache,
    # so the matrix skips them there with the reason; empty: every transformers the project supports
    since: tuple = ()

    def too_old(self, attn: str) -> str | None:
        """Why the installed transformers cannot run this row with ``attn``, or None."""
        if self.since and attn in self.since[1]:
            if packaging.version.parse(transformers.__version__) < packaging.version.parse(self.since[0]):
                return f"transformers {transformers.__version__} < {self.since[0]}: {self.since[2]}"
        return None

    @property
    def windowed(self) -> bool:
        return self.no_window is not None


ROWS: list[Row] = [
    Row("llama", "llama", "Llama", "Llama-3.1-8B", {}, real=dict(num_hidden_layers=32)),
    Row("qwen2", "qwen2", "Qwen2 / Qwen2.5", "Qwen2.5-7B", {}, real=dict(num_hidden_layers=28)),
    Row("qwen2_window", "qwen2", "Qwen2 (use_sliding_window=True)", "Qwen2-7B config with use_sliding_window",
        dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=W, max_window_layers=1),
        no_window=dict(use_sliding_window=False),
        real=dict(num_hidden_layers=28, use_sliding_window=True, sliding_window=4096, max_window_layers=21)),
    Row("qwen3", "qwen3", "Qwen3", "Qwen3-8B", {}, real=dict(num_hidden_layers=36)),
    Row("mistral", "mistral", "Mistral", "Mistral-7B-v0.1", dict(sliding_window=W), no_window=dict(sliding_window=None),
        real=dict(num_hidden_layers=32, sliding_window=4096)),
    Row("phi3", "phi3", "Phi-3", "Phi-3-mini-4k-instruct", dict(sliding_window=W), no_window=dict(sliding_window=None),
        real=dict(num_hidden_layers=32, sliding_window=2047)),
    Row("gemma", "gemma", "Gemma", "gemma-7b", {}, real=dict(num_hidden_layers=28)),
    Row("gemma2", "gemma2", "Gemma 2", "gemma-2-9b", dict(sliding_window=W, attn_logit_softcapping=50.0),
        no_window=dict(layer_types=_FULL2), real=dict(num_hidden_layers=42, sliding_window=4096),
        attn=("eager",), note="attention logit softcap 50"),
    Row("gemma3", "gemma3", "Gemma 3 (text)", "gemma-3-4b", dict(sliding_window=W), no_window=dict(layer_types=_FULL2),
        real=dict(num_hidden_layers=34, sliding_window=1024)),
    Row("gemma4", "gemma4", "Gemma 4 (text)", "Gemma4TextConfig's defaults", dict(sliding_window=W),
        no_window=dict(sliding_window=WIDE),
        note="head_dim 256 on the sliding layers, 512 on the full ones: each layer's cache has its own shape"),
    Row("gemma4_shared", "gemma4", "Gemma 4 (text), num_kv_shared_layers", "Gemma4TextConfig(num_kv_shared_layers=10)",
        dict(sliding_window=W, num_hidden_layers=4, num_kv_shared_layers=1,
             per_layer_config={i: dict(head_dim=64, num_key_value_heads=1) for i in (1, 3)}),
        no_window=dict(sliding_window=WIDE), real=dict(num_kv_shared_layers=10),
        note="the reading layers store no K/V"),
    Row("gemma3n", "gemma3n", "Gemma 3n (text)", "gemma-3n-E4B", dict(sliding_window=W),
        no_window=dict(sliding_window=WIDE),
        note="the reading layers store no K/V"),
    Row("gpt_oss", "gpt_oss", "gpt-oss", "gpt-oss-20b", dict(sliding_window=W), no_window=dict(layer_types=_FULL2),
        real=dict(num_hidden_layers=24, sliding_window=128), attn=("eager",), note="a learned sink logit per head"),
    Row("granite", "granite", "Granite", "granite-3.0-8b", {}, real=dict(num_hidden_layers=40)),
    Row("granite_swa", "granite_swa", "Granite SWA", "granite-swash-2b", dict(sliding_window=W),
        no_window=dict(layer_types=_FULL2), attn=("eager",),
        note="a learned sink per head, applied after attention as sigmoid(logsumexp - sink)"),
    Row("olmo2", "olmo2", "OLMo 2", "OLMo-2-1124-7B", {}, real=dict(num_hidden_layers=32)),
    Row("stablelm", "stablelm", "StableLM", "stablelm-2-1_6b", {}, real=dict(num_hidden_layers=24)),
    Row("cohere", "cohere", "Cohere (Command-R)", "c4ai-command-r-v01", {}, real=dict(num_hidden_layers=40)),
    Row("cohere2", "cohere2", "Cohere2 (Command-R7B)", "c4ai-command-r7b-12-2024", dict(sliding_window=W),
        no_window=dict(layer_types=_FULL2), real=dict(num_hidden_layers=32, sliding_window=4096)),
    Row("starcoder2", "starcoder2", "Starcoder2", "starcoder2-7b", dict(sliding_window=W),
        no_window=dict(sliding_window=None), real=dict(num_hidden_layers=32, sliding_window=4096)),
    Row("mixtral", "mixtral", "Mixtral", "Mixtral-8x7B-v0.1", {}, real=dict(num_hidden_layers=32, sliding_window=None)),
    Row("qwen3_moe", "qwen3_moe", "Qwen3-MoE", "Qwen3-30B-A3B", {}, real=dict(num_hidden_layers=48)),
    Row("gpt2", "gpt2", "GPT-2", "gpt2", {}, real=dict(n_layer=12)),
    Row("gptj", "gptj", "GPT-J", "gpt-j-6b", {}, real=dict(n_layer=28), note="scores in float32"),
    Row("gpt_neo", "gpt_neo", "GPT-Neo", "gpt-neo-1.3B", {}, real=dict(num_layers=24), attn=("eager",),
        note="12 of them local (window 256), served up to max_cache_len 256"),
    Row("qwen3_5", "qwen3_5", "Qwen3.5 (text)", "Qwen3_5TextConfig's defaults", {},
        note="gated delta nets in the state layers; transformers' own cache layer keeps their state (not quantized)"),
    Row("qwen3_next", "qwen3_next", "Qwen3-Next", "Qwen3-Next-80B-A3B", {}, attn=("sdpa",),
        note="gated delta nets in the state layers; transformers' own cache layer keeps their state (not quantized)"),
    Row("jamba", "jamba", "Jamba", "Jamba-v0.1", {}, attn=("sdpa",),
        note="Mamba in the state layers; transformers' own cache layer keeps their state (not quantized)"),
    Row("nemotron_h", "nemotron_h", "Nemotron-H", "NemotronHConfig's defaults", {}, attn=("sdpa",),
        note="Mamba2 in the state layers; transformers' own cache layer keeps their state (not quantized)"),
    Row("lfm3", "lfm3", "LFM3", "Lfm3Config's defaults", dict(sliding_window=W), no_window=dict(sliding_window=WIDE),
        attn=("sdpa",), note="short convolutions in the state layers; transformers' own cache layer keeps their state (not quantized)"),
    Row("falcon_h1", "falcon_h1", "Falcon-H1", "Falcon-H1-7B", {}, attn=("sdpa",),
        note="Mamba2 beside attention in each layer; transformers' own cache layer keeps its state (not quantized)"),
    Row("falcon", "falcon", "Falcon", "falcon-7b", {}, real=dict(num_hidden_layers=32, num_attention_heads=71,
                                                                 hidden_size=4544), note="one kv head (multi-query)"),
    # appended: a row's index picks the (attention, format) CI runs for it and for every later row
    Row("gpt_neox_japanese", "gpt_neox_japanese", "GPT-NeoX-Japanese", "gpt-neox-japanese-2.7b", {},
        real=dict(num_hidden_layers=32), attn=("eager",), note="heads folded into the batch for baddbmm"),
    Row("jetmoe", "jetmoe", "JetMoE", "jetmoe-8b", {}, real=dict(num_hidden_layers=24),
        note="kv heads tiled for its attention experts' queries (`repeat(1, top_k, 1, 1)`)"),
    Row("bloom", "bloom", "Bloom", "bloom-7b1", {}, real=dict(n_layer=30), attn=("eager",), forward_mask=False,
        since=("5.21", ("eager",), "Bloom sizes ALiBi by the mask, so over a fixed-size cache it raises "
                                   "(kvcompile.hf refuses it there)"),
        note="ALiBi as baddbmm's input, heads folded into the batch; a 2-D attention_mask must span the cache "
             "(or be left out), as generate() passes it and as for transformers' StaticCache"),
    Row("doge", "doge", "Doge", "DogeConfig's defaults", {},
        since=("5.21", ("sdpa",), "an unpadded SDPA prefill skips the causal mask, which Doge's dynamic mask then "
                                  "replaces: every key is visible, with or without a cache"),
        note="a dynamic mask from the cached V: the dequantized V is kept for it beside the op"),
    Row("gpt_neox", "gpt_neox", "GPT-NeoX (Pythia)", "pythia-1.4b", {},
        real=dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=16), note="rotary on a quarter of each head"),
    Row("phi", "phi", "Phi (1, 1.5, 2)", "phi-2", {}, real=dict(num_hidden_layers=32, hidden_size=2560,
                                                                  num_attention_heads=32), note="partial rotary"),
    Row("smollm3", "smollm3", "SmolLM3", "SmolLM3-3B", {}, real=dict(num_hidden_layers=36),
        note="every 4th layer without rotary (NoPE)"),
]



def _in_this_transformers(row: Row) -> bool:
    """The row's config class exists here, and transformers has the cache layers its layer types need
    (layers without K/V of their own, or sharing another's: its DummyLayer; state layers: its
    linear-attention cache layer); kvcompile.hf refuses the model before."""
    from kvcompile import hf
    from models import FAMILIES, tiny_config

    if not hasattr(transformers, FAMILIES[row.family][0]):
        return False
    cfg = tiny_config(row.family, **row.tiny)
    no_kv = getattr(cfg, "num_kv_shared_layers", 0) or hf.NO_KV_LAYER_TYPE in hf.layer_types(cfg)
    if no_kv and not hf._has_no_kv_layers():
        return False
    return hf.STATE_LAYER_BASE is not None or not set(hf.layer_types(cfg)) & set(hf.STATE_LAYER_TYPES)


ROWS = [row for row in ROWS if _in_this_transformers(row)]  # an older release lacks the newest families


@dataclasses.dataclass(frozen=True)
class Refused:
    """A family the cache refuses at construction; ``match``: a regex its error must contain."""

    label: str
    example: str
    config: Callable[[], Any]
    match: str


def _cfg(name: str, **kw) -> Callable[[], Any]:
    return lambda: getattr(transformers, name)(**kw)


REFUSED: list[Refused] = [
    Refused("T5", "t5-base", _cfg("T5Config"), "encoder-decoder"),
    Refused("BART", "bart-large", _cfg("BartConfig"), "encoder-decoder"),
    Refused("Whisper", "whisper-large-v3", _cfg("WhisperConfig"), "encoder-decoder"),
    Refused("Llama 3.2 Vision (Mllama)", "Llama-3.2-11B-Vision", _cfg("MllamaConfig"), "cross-attention"),
    Refused("DeepSeek-V2 / V3, Kimi K2", "DeepSeek-V3", _cfg("DeepseekV3Config"), "multi-head latent attention"),
    Refused("MiniCPM3", "MiniCPM3-4B", _cfg("MiniCPM3Config"), "multi-head latent attention"),
    Refused("Llama 4", "Llama-4-Scout-17B-16E", _cfg("Llama4TextConfig"), "chunked attention"),
    Refused("MPT", "mpt-7b", _cfg("MptConfig"), "ALiBi"),
    Refused("Falcon (alibi=True)", "falcon-rw-1b", _cfg("FalconConfig", alibi=True), "ALiBi"),
    Refused("Moshi", "moshiko-pytorch-bf16", _cfg("MoshiConfig"), "masks them as full causal"),
    Refused("BERT / RoBERTa as a causal LM, is_decoder=False", "bert-base-uncased", _cfg("BertConfig"),
            "attends bidirectionally unless"),
    Refused("Mamba", "mamba-2.8b", _cfg("MambaConfig"), "no attention heads"),
]


def real_config(row: Row):
    """transformers' default config of the row's class with the example's layout overrides."""
    from models import FAMILIES

    return getattr(transformers, FAMILIES[row.family][0])(**row.real)


def attention_summary(row: Row) -> str:
    from kvcompile import hf

    cfg = real_config(row)
    windows, shapes, with_state = hf.layer_windows(cfg), hf.per_layer_shapes(cfg), hf.state_layers(cfg)
    states = sum(shapes[i] is None for i in with_state)  # a state instead of K/V (the rest: beside it)
    hybrid = len(with_state) - states
    no_kv = sum(shape is None for shape in shapes) - states
    n, sliding = len(windows), [w for w in windows if w]
    full = n - len(sliding) - no_kv - states
    if sliding:
        text = f"window {'/'.join(str(w) for w in sorted(set(sliding)))} on {len(sliding)} of {n} layers"
        if full:
            text += f", full on {full}"
    else:
        text = f"full attention, {n} layers" if full == n else f"full attention on {full} of {n} layers"
    if states:
        text += f", {states} keeping a state instead of K/V"
    if hybrid:
        text += f", {'all' if hybrid == n else hybrid} keeping a state beside their K/V"
    if no_kv:
        shared = getattr(hf.text_config(cfg), "num_kv_shared_layers", 0)
        text += f", {no_kv} reading an earlier layer's K/V" if shared else f", {no_kv} without attention"
    return text + (f"; {row.note}" if row.note else "")


def refusal_reason(entry: Refused) -> str:
    from kvcompile import hf

    try:
        hf.check_config(entry.config())
    except hf.UnsupportedModelError as e:
        return e.reason
    raise AssertionError(f"{entry.label}: kvcompile.hf accepts {entry.example}'s config; it is listed as refused")


def table() -> str:
    lines = [
        "| Family | Example | Attention (example's config) | Tested with | kvcompile |",
        "|---|---|---|---|---|",
    ]
    for row in ROWS:
        status = "supported"
        if row.windowed:
            status += " (each sliding layer stores its window only, as a ring)"
        lines.append(f"| {row.label} | {row.example} | {attention_summary(row)} | {', '.join(row.attn)} | {status} |")
    for entry in REFUSED:
        lines.append(f"| {entry.label} | {entry.example} | | | refused: {refusal_reason(entry)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(table())

"""kvcompile.QuantizedCache inside real transformers models (tiny, random, built from configs).

Every family runs 2 layers, hidden 64, 4 query heads / 2 kv heads of head_dim 32 (32 so that
q8_0's block-32 scales apply), vocab 128. Real sizes for orientation:
  Llama-3.1-8B   hidden 4096, 32 layers, 32 q / 8 kv heads, head_dim 128
  Mistral-7B     hidden 4096, 32 layers, 32 q / 8 kv heads, head_dim 128 (sliding window 4096 in v0.1)
  Qwen2.5-7B     hidden 3584, 28 layers, 28 q / 4 kv heads, head_dim 128
  Qwen3-8B       hidden 4096, 36 layers, 32 q / 8 kv heads, head_dim 128 (q/k RMSNorm)
  Phi-3-mini     hidden 3072, 32 layers, 32 q / 32 kv heads, head_dim 96 (fused qkv)
  Gemma-7B       hidden 3072, 28 layers, 16 q / 16 kv heads, head_dim 256 (embeddings * sqrt(hidden))
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import BartConfig, DynamicCache, T5Config

import kvcompile
from kvcompile import KV_DTYPES, QuantizedCache, get_format, save_calibration
from models import cache_kwarg
from models import tiny_config as family_config
from models import tiny_model as family_model
from utils import max_rel_err

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)
MAX_LEN = 16


def tiny_config(family: str, **overrides):
    kw = dict(TINY)
    if family == "mistral":
        kw["sliding_window"] = MAX_LEN  # == max_cache_len: the window never bites, exactly full attention
    kw.update(overrides)
    return family_config(family, **kw)


_MODELS: dict = {}


def tiny_model(family: str, attn: str = "sdpa"):
    key = (family, attn)
    if key not in _MODELS:
        _MODELS[key] = family_model(tiny_config(family), attn)
    return _MODELS[key]


def left_padded_batch(B=2, T=8, pads=(0, 3), seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (B, T), generator=gen)
    am = torch.ones(B, T, dtype=torch.long)
    for b, p in enumerate(pads):
        ids[b, :p] = 0
        am[b, :p] = 0
    return ids, am


@torch.no_grad()
def run_steps(model, cache, ids, am, decode_tokens):
    """Prefill ``ids`` then feed ``decode_tokens`` (list of [B, 1]) one at a time; logits per step."""
    kw = cache_kwarg(model)
    logits, x, a = [], ids, am
    for step in range(len(decode_tokens) + 1):
        pos = (a.cumsum(-1) - 1).clamp(min=0)[:, -x.shape[1]:]
        out = model(input_ids=x, attention_mask=a, position_ids=pos, use_cache=True, **{kw: cache})
        logits.append(out.logits.float())
        if step < len(decode_tokens):
            x = decode_tokens[step]
            a = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
    return logits


@torch.no_grad()
def greedy_tokens(model, ids, am, n):
    """n greedy tokens under a full-precision DynamicCache (the tokens every cache is fed)."""
    cache = DynamicCache(config=model.config)
    logits = run_steps(model, cache, ids, am, [])
    toks = [logits[0][:, -1].argmax(-1, keepdim=True)]
    for _ in range(n - 1):
        lg = run_steps_continue(model, cache, am, toks)
        toks.append(lg[:, -1].argmax(-1, keepdim=True))
    return toks


@torch.no_grad()
def run_steps_continue(model, cache, am, toks):
    a = torch.cat([am, torch.ones(am.shape[0], len(toks), dtype=am.dtype)], dim=1)
    pos = (a.cumsum(-1) - 1)[:, -1:]
    return model(input_ids=toks[-1], attention_mask=a, position_ids=pos, use_cache=True,
                 **{cache_kwarg(model): cache}).logits.float()


def logits_error(ref, got, am) -> float:
    """max over steps of max|Δlogits| / max|logits|, non-pad positions only (pads see nothing real)."""
    err = 0.0
    for step, (r, g) in enumerate(zip(ref, got)):
        keep = am.bool() if step == 0 else torch.ones(r.shape[:2], dtype=torch.bool)
        err = max(err, max_rel_err(g[keep], r[keep]))
    return err


# ------------------------------------------------------------------------------------------------
# logits vs a full-precision DynamicCache
# ------------------------------------------------------------------------------------------------

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma"]

# Bounds on max|Δlogits| / max|logits| over a left-padded prefill (8 tokens, 3 pads in row 1)
# plus 4 decode steps, fp32 model, initializer_range 0.02 (HF default). The error is the 8-bit
# K/V quantization noise pushed through a random 2-layer model; it is the same for sdpa and
# eager. Measured (fp8, q8_0):
#   llama/mistral 2.8e-2, 7.7e-3 · qwen2 1.8e-2, 5.5e-3 · qwen3 3.4e-2, 7.6e-3
#   phi3 3.1e-2, 5.5e-3 · gemma 3.0e-3, 6.1e-4 (larger logits: embeddings scaled by sqrt(hidden))
# Each bound is 2x the measurement. For scale, a cache that silently drops the newest token
# (kv_len - 1) measures 0.21-0.41 (gemma 2.1e-2): 7-13x the fp8 error, checked below.
BOUNDS = {
    "llama": {"fp8_e4m3": 0.056, "q8_0": 0.016},
    "mistral": {"fp8_e4m3": 0.056, "q8_0": 0.016},
    "qwen2": {"fp8_e4m3": 0.036, "q8_0": 0.011},
    "qwen3": {"fp8_e4m3": 0.068, "q8_0": 0.016},
    "phi3": {"fp8_e4m3": 0.062, "q8_0": 0.011},
    "gemma": {"fp8_e4m3": 0.006, "q8_0": 0.0012},
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_close_to_dynamic_cache(family, attn, monkeypatch):
    model = tiny_model(family, attn)
    ids, am = left_padded_batch()
    toks = greedy_tokens(model, ids, am, 4)
    ref = run_steps(model, DynamicCache(config=model.config), ids, am, toks)
    errs = {}
    for kv_dtype in ("fp8_e4m3", "q8_0"):
        cache = QuantizedCache(model.config, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype=kv_dtype)
        got = run_steps(model, cache, ids, am, toks)
        assert int(cache.get_seq_length()) == ids.shape[1] + len(toks)
        errs[kv_dtype] = logits_error(ref, got, am)
        assert errs[kv_dtype] <= BOUNDS[family][kv_dtype], (kv_dtype, errs)
    # stable facts, not tolerances: q8_0 is 3.3-5.7x closer than fp8 (measured), and a real bug is
    # far outside the fp8 bound. Broken path: every read of the cache loses its newest token.
    assert errs["q8_0"] < errs["fp8_e4m3"] / 2, errs
    import kvcompile.cache_layer as layer_mod

    real = layer_mod.ops.dequantize
    monkeypatch.setattr(layer_mod.ops, "dequantize", lambda c, s, o, n, d, *rest: real(c, s, o, n - 1, d, *rest))
    cache = QuantizedCache(model.config, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype="fp8_e4m3")
    broken = logits_error(ref, run_steps(model, cache, ids, am, toks), am)
    assert broken > 5 * errs["fp8_e4m3"] and broken > 2 * BOUNDS[family]["fp8_e4m3"], (broken, errs)


def test_bf16_model():
    # the GPU path runs bf16 models: the cache takes bf16 K/V and returns bf16 K/V
    cfg = tiny_config("llama")
    model = family_model(cfg, "sdpa", dtype=torch.bfloat16)
    ids, am = left_padded_batch()
    toks = greedy_tokens(model, ids, am, 4)
    ref = run_steps(model, DynamicCache(config=cfg), ids, am, toks)
    # Measured vs the bf16 DynamicCache run: fp8 3.2e-2, q8_0 1.1e-2 (bf16 itself is 7.6e-3 from
    # the fp32 model). Bounds 2x.
    for kv_dtype, bound in (("fp8_e4m3", 0.064), ("q8_0", 0.022)):
        cache = QuantizedCache(cfg, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype=kv_dtype)
        err = logits_error(ref, run_steps(model, cache, ids, am, toks), am)
        assert err <= bound, (kv_dtype, err)
        k, v = cache.update(_kv(B=2, T=1, dtype=torch.bfloat16), _kv(B=2, T=1, dtype=torch.bfloat16), 0)
        assert k.dtype == v.dtype == torch.bfloat16 and k.shape == (2, 2, MAX_LEN, 32)


@pytest.mark.parametrize("granularity", ["block32", "static"])
def test_other_fp8_granularities_and_k_offset(granularity, tmp_path):
    model = tiny_model("llama")
    ids, am = left_padded_batch()
    toks = greedy_tokens(model, ids, am, 3)
    ref = run_steps(model, DynamicCache(config=model.config), ids, am, toks)
    # calibration by hand from the reference run's K/V (kvcompile.calibrate is tested elsewhere):
    # static scale = amax / 448 per layer and kv head, with a 1.5x margin; K offset = channel mean
    dyn = DynamicCache(config=model.config)
    run_steps(model, dyn, ids, am, toks)
    ks = torch.stack([l.keys.abs().amax(dim=(0, 2, 3)) for l in dyn.layers]) * 1.5 / 448
    vs = torch.stack([l.values.abs().amax(dim=(0, 2, 3)) for l in dyn.layers]) * 1.5 / 448
    mu = torch.stack([l.keys.mean(dim=(0, 2)) for l in dyn.layers])
    path = tmp_path / "calib.safetensors"
    save_calibration({"k_scale": ks, "v_scale": vs, "k_offset": mu}, path)
    cache = QuantizedCache(model.config, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype="fp8_e4m3",
                           granularity=granularity, calibration=path if granularity == "static" else {"k_offset": mu})
    err = logits_error(ref, run_steps(model, cache, ids, am, toks), am)
    # measured: block32 + offset 2.7e-2, static + offset 2.8e-2, per-token 2.8e-2. e4m3's error is
    # relative to each element, so the scale granularity barely moves it; same bound as per-token
    assert err <= BOUNDS["llama"]["fp8_e4m3"], err


# ------------------------------------------------------------------------------------------------
# generate()
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_greedy_generate(kv_dtype):
    model = tiny_model("qwen3")
    ids, am = left_padded_batch()
    n = 6
    outs = {}
    spellings = ["past_key_values"] + (["cache"] if cache_kwarg(model) == "cache" else [])
    for kw in spellings:
        cache = QuantizedCache(model.config, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype=kv_dtype)
        with torch.no_grad():
            outs[kw] = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=n, do_sample=False,
                                      min_new_tokens=n, **{kw: cache})
        assert outs[kw].shape == (2, ids.shape[1] + n)
        assert torch.equal(outs[kw][:, : ids.shape[1]], ids)
        # every token but the last one generated went through the cache
        assert int(cache.get_seq_length()) == ids.shape[1] + n - 1
    for kw in spellings[1:]:
        assert torch.equal(outs[kw], outs["past_key_values"]), "cache= and past_key_values= must agree"
    # the first generated token is the argmax of the prefill logits through the same kind of cache
    cache = QuantizedCache(model.config, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype=kv_dtype)
    first = run_steps(model, cache, ids, am, [])[0][:, -1].argmax(-1)
    assert torch.equal(outs["past_key_values"][:, ids.shape[1]], first)


@pytest.mark.parametrize("broken", [False, True], ids=["reordered", "control-no-reorder"])
def test_beam_search_scores_what_it_returns(broken, monkeypatch):
    # beam search reorders the cache in place (reorder_cache) every step. Per-token scales make a
    # sequence's codes the same whether stored a token at a time or in one prefill, so the score beam
    # search reports for each returned sequence must equal that sequence scored afresh in one forward
    # over a new cache (float32: equal to 1e-4, the order of the sums apart). The control leaves the
    # cache unreordered: the beams then read other beams' keys and the scores part.
    model = tiny_model("llama")
    ids, am = left_padded_batch()
    B, T, N = ids.shape[0], ids.shape[1], 6
    if broken:
        monkeypatch.setattr(QuantizedCache, "reorder_cache", lambda self, beam_idx: None)
    cache = QuantizedCache(model.config, max_batch_size=2 * B, max_cache_len=MAX_LEN, kv_dtype="q8_0")
    with torch.no_grad():
        g = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=N, min_new_tokens=N, num_beams=2,
                           do_sample=False, output_scores=True, return_dict_in_generate=True, length_penalty=0.0,
                           pad_token_id=0, **{cache_kwarg(model): cache})
        seq = g.sequences
        assert seq.shape == (B, T + N) and torch.equal(seq[:, :T], ids)
        am_full = torch.cat([am, torch.ones(B, N, dtype=am.dtype)], 1)
        fresh = QuantizedCache(model.config, max_batch_size=B, max_cache_len=MAX_LEN, kv_dtype="q8_0")
        logits = model(seq, attention_mask=am_full, position_ids=(am_full.cumsum(-1) - 1).clamp(min=0),
                       use_cache=True, **{cache_kwarg(model): fresh}).logits
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, seq[:, 1:, None])[..., 0]
    rescored = logp[:, T - 1:].sum(-1)
    agree = torch.allclose(g.sequences_scores, rescored, atol=1e-4, rtol=0)
    assert agree != broken, (g.sequences_scores, rescored)


# ------------------------------------------------------------------------------------------------
# bad input raises, naming the fix
# ------------------------------------------------------------------------------------------------


def test_unknown_kv_dtype_lists_accepted_names():
    with pytest.raises(ValueError) as e:
        QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, kv_dtype="fp8")
    assert all(name in str(e.value) for name in KV_DTYPES)


def test_misspelled_option_is_refused_not_ignored():
    # kv_dtpye= must not silently build the default fp8 cache
    with pytest.raises(TypeError, match="kv_dtpye"):
        QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, kv_dtpye="q8_0")


def test_head_dim_not_multiple_of_32_refused_for_block_formats():
    cfg = tiny_config("llama", head_dim=16)
    for kw in ({"kv_dtype": "q8_0"}, {"kv_dtype": "fp8_e4m3", "granularity": "block32"}):
        with pytest.raises(ValueError, match="multiple of 32"):
            QuantizedCache(cfg, max_batch_size=1, max_cache_len=8, **kw)
    QuantizedCache(cfg, max_batch_size=1, max_cache_len=8, kv_dtype="fp8_e4m3")  # per-token: fine


@pytest.mark.parametrize(
    "family, overrides, windows",
    [
        ("mistral", dict(sliding_window=8), [8, 8]),
        ("gemma2", dict(sliding_window=8), [8, 0]),  # alternating sliding / full layers
        ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), [0, 8]),
        ("qwen2", dict(sliding_window=8), [0, 0]),  # a window Qwen2 carries but does not use
    ],
    ids=["mistral", "gemma2", "qwen2-window", "qwen2-window-unused"],
)
def test_sliding_window_layers_record_their_window(family, overrides, windows, monkeypatch):
    """A sliding layer records its window and hands it to its dequantize (metadata for the pass);
    it stores only the window (a ring, dequantize_ring) and returns max_cache_len positions, so
    HF's mask sizes stay max_cache_len."""
    cfg = tiny_config(family, **overrides)
    cache = QuantizedCache(cfg, max_batch_size=1, max_cache_len=16, device="cpu")
    assert cache.sliding_windows == windows
    assert [layer.is_sliding for layer in cache.layers] == [w > 0 for w in windows]
    assert ("sliding window 8" in repr(cache)) == any(windows)
    import kvcompile.cache_layer as layer_mod

    seen = []
    # the window dequantize was given, positional (after rotation) or keyword
    window_of = lambda a, kw: kw.get("sliding_window", a[6] if len(a) > 6 else 0)  # noqa: E731
    for name in ("dequantize", "dequantize_ring"):
        real = getattr(layer_mod.ops, name)
        monkeypatch.setattr(layer_mod.ops, name,
                            lambda *a, _real=real, _name=name, **kw: seen.append((_name, window_of(a, kw))) or
                            _real(*a, **kw))
    full = QuantizedCache(cfg, max_batch_size=1, max_cache_len=16, device="cpu", ring=False).layers[0].nbytes
    for i, layer in enumerate(cache.layers):
        k, v = cache.update(_kv(T=12), _kv(T=12), i)
        assert k.shape == v.shape == (1, 2, 16, 32) and layer.get_mask_sizes(1) == (16, 0)
        op = "dequantize_ring" if windows[i] else "dequantize"
        assert seen[-2:] == [(op, windows[i])] * 2
        assert (layer.nbytes < full) == (windows[i] > 0)  # a ring of 8 positions, or all 16
    assert QuantizedCache(cfg, max_batch_size=1, max_cache_len=8).sliding_windows == [0, 0]


@pytest.mark.parametrize(
    "cfg",
    [T5Config(vocab_size=128, d_model=64, num_layers=2, num_heads=2, d_kv=32), BartConfig(vocab_size=128, d_model=64)],
    ids=["t5", "bart"],
)
def test_encoder_decoder_refused(cfg):
    with pytest.raises(ValueError, match="encoder-decoder"):
        QuantizedCache(cfg, max_batch_size=1, max_cache_len=16)


def _kv(B=1, T=1, H=2, D=32, dtype=torch.float32, device="cpu"):
    return torch.randn(B, H, T, D, dtype=dtype, device=device)


def test_writing_past_max_cache_len_raises():
    cache = QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8)
    cache.update(_kv(T=6), _kv(T=6), 0)
    with pytest.raises(ValueError, match="max_cache_len"):
        cache.update(_kv(T=3), _kv(T=3), 0)
    cache.update(_kv(T=2), _kv(T=2), 0)  # exactly full is fine
    with pytest.raises(ValueError, match="max_cache_len"):
        cache.update(_kv(T=1), _kv(T=1), 0)


@pytest.mark.parametrize("layer_idx", [-1, 2, 1.0, True], ids=["negative", "past-the-end", "float", "bool"])
def test_layer_idx_out_of_range_names_the_range(layer_idx):
    """update(..., layer_idx=-1) would write the last layer as Python indexing does: refused, like any index
    that is not an int in 0..layers-1, with the range; a valid index writes that layer and no other."""
    cache = QuantizedCache(tiny_config("llama", num_hidden_layers=2), max_batch_size=1, max_cache_len=8, device="cpu")
    match = "wrote attention layer 2, but the cache was built for 2 layers" if layer_idx == 2 else (
        rf"update: layer_idx={layer_idx!r} is not a layer of the cache: it takes an int in 0\.\.1 \(2 layers")
    with pytest.raises(ValueError, match=match):
        cache.update(_kv(), _kv(), layer_idx)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [0, 0]
    cache.update(_kv(), _kv(), 1)
    assert [int(layer.cumulative_length) for layer in cache.layers] == [0, 1]


def test_reorder_cache_indices_out_of_range_name_the_rows():
    """beam_idx must address the cache's rows (0..max_batch_size-1): out of range (IndexError inside torch, a
    device assert on a GPU), too long, or not integers, it is refused by name; a permutation reorders."""
    cache = QuantizedCache(tiny_config("llama"), max_batch_size=2, max_cache_len=8, kv_dtype="q8_0", device="cpu")
    k = _kv(B=2, T=3)
    cache.update(k, k, 0)
    before = cache.layers[0].k_codes.clone()
    for idx, err, match in [
        (torch.tensor([0, 2]), ValueError, r"beam_idx holds 2, outside the cache's rows 0\.\.1 \(max_batch_size=2\)"),
        (torch.tensor([-1, 0]), ValueError, r"beam_idx holds -1, outside the cache's rows 0\.\.1"),
        (torch.tensor([0, 1, 0]), ValueError, "beam_idx has 3 entries, but the cache holds max_batch_size=2 rows"),
        (torch.tensor([1.0, 0.0]), TypeError, "beam_idx must be a 1-D integer tensor of row indices, got a torch.float32"),
        ([1, 0], TypeError, "beam_idx must be a 1-D integer tensor of row indices, got a list"),
    ]:
        with pytest.raises(err, match=r"kvcompile.QuantizedCache.reorder_cache: " + match):
            cache.reorder_cache(idx)
        assert torch.equal(cache.layers[0].k_codes, before)  # refused before any row moved
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[0].k_codes, before.flip(0))


def test_batch_larger_than_max_batch_size_raises():
    cache = QuantizedCache(tiny_config("llama"), max_batch_size=2, max_cache_len=8)
    with pytest.raises(ValueError, match="max_batch_size"):
        cache.update(_kv(B=3), _kv(B=3), 0)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "q8_0"])
def test_smaller_batch_uses_leading_rows(kv_dtype):
    """A batch below max_batch_size returns exactly what a cache of that batch returns, and the
    rows past it stay untouched (poisoned before, equal after)."""
    exact = QuantizedCache(tiny_config("llama"), max_batch_size=2, max_cache_len=8, kv_dtype=kv_dtype, device="cpu")
    roomy = QuantizedCache(tiny_config("llama"), max_batch_size=5, max_cache_len=8, kv_dtype=kv_dtype, device="cpu")
    layer = roomy.layers[0]
    for t in (layer.k_codes, layer.v_codes):
        t.view(torch.uint8).copy_(torch.randint(0, 127, t.shape, dtype=torch.uint8))
    spare = [t[2:].clone() for t in (layer.k_codes, layer.v_codes, layer.k_scales, layer.v_scales)]
    for T in (3, 1):
        k, v = _kv(B=2, T=T), _kv(B=2, T=T)
        want = exact.update(k, v, 0)
        got = roomy.update(k, v, 0)
        assert got[0].shape[0] == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    for before, t in zip(spare, (layer.k_codes, layer.v_codes, layer.k_scales, layer.v_scales)):
        assert torch.equal(t[2:].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t[2:],
                           before.view(torch.uint8) if before.dtype == torch.float8_e4m3fn else before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_kv_dtype_outside_fp16_bf16_fp32_raises(dtype):
    cache = QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, device="cpu")
    bad = _kv().to(dtype)
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        cache.update(bad, bad, 0)
    for ok in (torch.float16, torch.bfloat16, torch.float32):
        cache.update(_kv(dtype=ok), _kv(dtype=ok), 0)


def test_device_mismatch_raises():
    # a 'meta' tensor stands in for "K/V on another device than the cache" on a CPU-only machine
    cache = QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, device="cpu")
    k = torch.empty(1, 2, 1, 32, device="meta")
    with pytest.raises(ValueError, match="device="):
        cache.update(k, k, 0)
    lazy = QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8)
    lazy.update(_kv(), _kv(), 0)  # allocates on cpu
    with pytest.raises(ValueError, match="lives on cpu"):
        lazy.update(k, k, 0)


def test_static_granularity_needs_calibration():
    with pytest.raises(ValueError, match="calibrat"):
        QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, kv_dtype="fp8_e4m3", granularity="static")


def _good_calib():
    return {"k_scale": torch.full((2, 2), 0.01), "v_scale": torch.full((2, 2), 0.01), "k_offset": torch.zeros(2, 2, 32)}


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda c: c.update(k_scale=torch.full((1, 2), 0.01)), "shape"),  # a layer missing
        (lambda c: c.update(k_offset=torch.zeros(2, 2, 16)), "shape"),
        (lambda c: c["v_scale"].__setitem__((1, 0), math.nan), "non-finite"),
        (lambda c: c["k_scale"].__setitem__((0, 1), 0.0), "<= 0"),
        (lambda c: c["k_scale"].__setitem__((0, 1), -1.0), "<= 0"),
        (lambda c: c.pop("v_scale"), "only one of"),
        (lambda c: c.update(k_bias=torch.zeros(2)), "unknown"),
    ],
    ids=["missing-layer", "offset-shape", "nan", "zero", "negative", "half", "unknown-key"],
)
def test_corrupted_calibration_raises(corrupt, match, tmp_path):
    calib = _good_calib()
    corrupt(calib)
    with pytest.raises(ValueError, match=match):
        QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, kv_dtype="fp8_e4m3", granularity="static", calibration=calib)
    path = tmp_path / "c.safetensors"
    with pytest.raises(ValueError, match=match):  # refused at save for this model, as at load
        save_calibration(calib, path, config=tiny_config("llama"))
    assert not path.exists()
    from safetensors.torch import save_file

    save_file(calib, str(path))  # the same through a file written by other means
    with pytest.raises(ValueError, match=match):
        QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, kv_dtype="fp8_e4m3", granularity="static",
                       calibration=path)


def test_unreadable_calibration_file_raises(tmp_path):
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(b"\x00\x01 this is not safetensors" * 10)
    with pytest.raises(ValueError, match="safetensors"):
        QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, kv_dtype="fp8_e4m3", granularity="static",
                       calibration=path)
    with pytest.raises(ValueError, match="safetensors"):
        QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, kv_dtype="fp8_e4m3", granularity="static",
                       calibration=tmp_path / "missing.safetensors")


# ------------------------------------------------------------------------------------------------
# memory, lifecycle, static addresses
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype,granularity,v_layout", [
    ("fp8_e4m3", "token", "auto"), ("fp8_e4m3", "token", "keys"), ("fp8_e4m3", "block32", "auto"),
    ("q8_0", None, "auto")])
def test_nbytes_matches_bytes_per_element(kv_dtype, granularity, v_layout):
    B, L, layers, H, D = 3, 24, 2, 2, 32
    cache = QuantizedCache(tiny_config("llama"), max_batch_size=B, max_cache_len=L, kv_dtype=kv_dtype,
                           granularity=granularity, v_layout=v_layout)
    assert cache.nbytes == 0  # lazy: nothing allocated yet
    cache.update(_kv(B=B), _kv(B=B), 0)
    cache.update(_kv(B=B), _kv(B=B), 1)
    fmt = get_format(kv_dtype, granularity)
    per_elem = fmt.bytes_per_element(D)
    elements = 2 * layers * B * H * L * D  # K and V
    lengths = layers * 8  # one int64 cumulative_length per layer
    # key-contiguous V rows are padded to a multiple of 16 keys (24 -> 32); "auto" on the CPU is head_dim-contiguous
    v_pad = layers * B * H * D * (32 - L) if v_layout == "keys" else 0
    assert cache.layers[0].v_keys == (v_layout == "keys")
    assert cache.nbytes == round(per_elem * elements) + lengths + v_pad
    assert cache.nbytes - v_pad < 0.6 * cache.bf16_nbytes()


@pytest.mark.parametrize("kv_dtype,v_layout", [("q8_0", "auto"), ("fp8_e4m3", "keys")],
                         ids=["q8_0-v-head_dim", "fp8-v-keys"])
def test_reset_crop_reorder(kv_dtype, v_layout):
    model = tiny_model("llama")
    ids, am = left_padded_batch(pads=(0, 0))
    toks = greedy_tokens(model, ids, am, 3)
    cache = QuantizedCache(model.config, max_batch_size=2, max_cache_len=MAX_LEN, kv_dtype=kv_dtype,
                           v_layout=v_layout)
    first = run_steps(model, cache, ids, am, toks)
    # reset: an empty cache gives the same logits again, bit for bit
    cache.reset()
    assert int(cache.get_seq_length()) == 0
    assert all((l.k_codes == 0).all() and (l.v_scales == 0).all() for l in cache.layers)
    again = run_steps(model, cache, ids, am, toks)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # crop: drop the last two decode tokens, feed them again -> the same logits
    cache.crop(-2)
    assert int(cache.get_seq_length()) == ids.shape[1] + len(toks) - 2
    lg = run_steps_continue(model, cache, am, toks[:2])  # feeds toks[1] after prefill + toks[0]
    assert torch.equal(lg, first[2])
    with pytest.raises(RuntimeError, match="negative"):
        cache.crop(3)
    # reorder_cache (beam search): swapping the batch rows swaps every later result, in place
    ptrs = [t.data_ptr() for l in cache.layers for t in l.buffers()]
    cache.reorder_cache(torch.tensor([1, 0]))
    assert ptrs == [t.data_ptr() for l in cache.layers for t in l.buffers()]
    swapped = run_steps_continue(model, cache, am, toks[:2] + [toks[2].flip(0)])
    torch.testing.assert_close(swapped, first[3].flip(0), atol=1e-6, rtol=1e-6)  # rows are independent


@pytest.mark.parametrize("kv_dtype,granularity", [("fp8_e4m3", "token"), ("q8_0", None)])
def test_v_layouts_store_the_same_values(kv_dtype, granularity):
    """v_layout only changes where V codes live: update() returns the same K/V bit for bit, and
    "auto" picks head_dim-contiguous on the CPU and, elsewhere, the format's layout (key-contiguous
    for token scales: kvcompile.formats.KVFormat.v_keys_contiguous)."""
    B, L = 2, 21
    k, v = _kv(B=B, T=9), _kv(B=B, T=9)
    got = {}
    for layout in ("auto", "keys", "head_dim"):
        cache = QuantizedCache(tiny_config("llama"), max_batch_size=B, max_cache_len=L, kv_dtype=kv_dtype,
                               granularity=granularity, device="cpu", v_layout=layout)
        layer = cache.layers[0]
        assert layer.v_codes.shape == layer.k_codes.shape
        assert (layer.v_codes.stride(2) == 1) == layer.v_keys
        got[layout] = (cache.update(k, v, 0), layer.v_keys)
    assert not got["auto"][1]  # the CPU
    meta = QuantizedCache(tiny_config("llama"), max_batch_size=B, max_cache_len=L, kv_dtype=kv_dtype,
                          granularity=granularity, device="meta")
    assert meta.layers[0].v_keys == get_format(kv_dtype, granularity).v_keys_contiguous
    assert got["keys"][1] and not got["head_dim"][1]
    for layout in ("auto", "keys"):
        for a, b in zip(got[layout][0], got["head_dim"][0]):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="v_layout='rows' is not one of"):
        QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, v_layout="rows")


def test_buffers_have_static_addresses_and_dynamo_accepts_them():
    cache = QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, kv_dtype="fp8_e4m3", device="cpu")
    for layer in cache.layers:
        for t in layer.buffers():
            assert getattr(t, "_dynamo_static_input_type", None) is not None, "buffer not mark_static_address-ed"
            torch._dynamo.mark_static_address(t)  # marking again is harmless
    # lazy allocation also marks them; early_initialization (HF export path) allocates up front
    lazy = QuantizedCache(tiny_config("llama"), max_batch_size=1, max_cache_len=8, kv_dtype="q8_0")
    lazy.early_initialization(1, 2, 32, torch.float32, torch.device("cpu"))
    assert all(getattr(t, "_dynamo_static_input_type", None) for l in lazy.layers for t in l.buffers())
    assert lazy.is_compileable and lazy.get_max_length() == 8

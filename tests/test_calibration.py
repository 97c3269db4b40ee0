"""kvcompile.calibrate and the calibration file: statistics against an independent computation,
safetensors round trip, and every kind of bad file rejected (fail closed)."""

from __future__ import annotations

import copy
import os
import re
import sys

import pytest
import torch

import kvcompile
from kvcompile.formats import FP8_E4M3_MAX

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import _common  # noqa: E402

LAYERS, HKV, D = 2, 2, 64  # the tiny model (real SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64)


@pytest.fixture(scope="module")
def tiny():
    model, tok = _common.tiny_model(seed=0)
    return model, tok


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (96,), generator=g)


@pytest.fixture(scope="module")
def calib(tiny, ids):
    return kvcompile.calibrate(tiny[0], [ids], max_length=96, chunk_size=32)


def _reference_kv(model, ids):
    """K and V as a plain DynamicCache stores them (post-RoPE K), one forward."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[None], use_cache=True, **{_common.cache_kwarg(model): cache})
    return [(layer.keys[0].double(), layer.values[0].double()) for layer in cache.layers]  # [H, T, D]


def test_calibrate_matches_independent_statistics(tiny, ids, calib):
    assert set(calib) == {"k_scale", "v_scale", "k_offset"}
    assert calib["k_scale"].shape == (LAYERS, HKV) and calib["v_scale"].shape == (LAYERS, HKV)
    assert calib["k_offset"].shape == (LAYERS, HKV, D)
    assert all(t.dtype == torch.float32 for t in calib.values())
    for i, (k, v) in enumerate(_reference_kv(tiny[0], ids)):
        mu = k.mean(1)  # [H, D]
        torch.testing.assert_close(calib["k_offset"][i].double(), mu, rtol=1e-5, atol=1e-6)
        k_amax = (k - mu[:, None]).abs().amax((1, 2))
        torch.testing.assert_close(calib["k_scale"][i].double(), k_amax / FP8_E4M3_MAX, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(calib["v_scale"][i].double(), v.abs().amax((1, 2)) / FP8_E4M3_MAX,
                                   rtol=1e-5, atol=1e-9)


def test_calibrate_inputs_agree(tiny, ids, calib):
    model, tok = tiny
    # chunking inside a window must not change anything; padding must be dropped
    padded = {"input_ids": torch.cat([ids, torch.zeros(7, dtype=ids.dtype)])[None],
              "attention_mask": torch.cat([torch.ones(96), torch.zeros(7)])[None].long()}
    for other in (kvcompile.calibrate(model, [ids], max_length=96, chunk_size=96),
                  kvcompile.calibrate(model, [padded], max_length=96, chunk_size=32)):
        for k in calib:
            torch.testing.assert_close(other[k], calib[k], rtol=1e-5, atol=1e-6)
    text = bytes(int(i) for i in ids).decode("latin-1")
    with pytest.raises(ValueError, match="tokenizer"):
        kvcompile.calibrate(model, [text])
    out = kvcompile.calibrate(model, "a short string", tokenizer=tok)
    assert out["k_scale"].shape == (LAYERS, HKV)
    with pytest.raises(ValueError, match="margin"):
        kvcompile.calibrate(model, [ids], margin=0.5)
    with pytest.raises(ValueError, match="no tokens"):
        kvcompile.calibrate(model, [])


def test_margin_scales_only_the_scales(tiny, ids, calib):
    m2 = kvcompile.calibrate(tiny[0], [ids], max_length=96, margin=2.0)
    torch.testing.assert_close(m2["k_scale"], 2 * calib["k_scale"])
    torch.testing.assert_close(m2["v_scale"], 2 * calib["v_scale"])
    torch.testing.assert_close(m2["k_offset"], calib["k_offset"])


def test_round_trip_and_use(tmp_path, tiny, ids, calib):
    path = tmp_path / "calib.safetensors"
    kvcompile.save_calibration(calib, path)
    loaded = kvcompile.load_calibration(path, num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)
    assert set(loaded) == set(calib)
    for k in calib:
        assert torch.equal(loaded[k], calib[k])
    model = tiny[0]
    kw = _common.cache_kwarg(model)
    x = ids[None, :40]
    with torch.no_grad():
        ref = model(input_ids=x).logits
        for gran in ("static", "token"):
            cache = kvcompile.QuantizedCache(model.config, max_batch_size=1, max_cache_len=64, kv_dtype="fp8_e4m3",
                                             granularity=gran, calibration=str(path), device="cpu")
            assert cache.layers[0].k_offset is not None
            out = model(input_ids=x, use_cache=True, **{kw: cache}).logits
            # a calibrated 8-bit cache stays close to full precision
            assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def _bad_files():
    good = lambda: {"k_scale": torch.full((LAYERS, HKV), 0.01), "v_scale": torch.full((LAYERS, HKV), 0.01),  # noqa: E731
                    "k_offset": torch.zeros(LAYERS, HKV, D)}
    cases = {}
    c = good(); c["k_scale"] = c["k_scale"][:1]; c["v_scale"] = c["v_scale"][:1]; c["k_offset"] = c["k_offset"][:1]
    cases["missing layer"] = (c, "shape")
    c = good(); c["k_scale"][1, 0] = float("nan"); cases["nan scale"] = (c, "non-finite")
    c = good(); c["k_offset"][0, 1, 3] = float("inf"); cases["inf offset"] = (c, "non-finite")
    c = good(); c["v_scale"][0, 1] = 0.0; cases["zero scale"] = (c, "<= 0")
    c = good(); c["k_scale"][1, 1] = -1.0; cases["negative scale"] = (c, "<= 0")
    c = good(); c["k_offset"] = c["k_offset"][..., :32]; cases["wrong head_dim"] = (c, "shape")
    c = good(); c["v_scale"] = torch.full((LAYERS, HKV + 1), 0.01); cases["wrong kv heads"] = (c, "shape")
    c = good(); del c["v_scale"]; cases["only k_scale"] = (c, "only one")
    c = good(); c["extra"] = torch.zeros(1); cases["unknown tensor"] = (c, "unknown")
    return cases


@pytest.mark.parametrize("case", list(_bad_files()))
def test_bad_calibration_files_are_rejected(tmp_path, tiny, case):
    tensors, match = _bad_files()[case]
    path = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    with pytest.raises(ValueError, match=match):
        kvcompile.load_calibration(path, num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)
    with pytest.raises(ValueError, match=match):  # the cache fails closed too
        kvcompile.QuantizedCache(tiny[0].config, max_batch_size=1, max_cache_len=16, kv_dtype="fp8_e4m3", granularity="static",
                                 calibration=str(path))
    with pytest.raises(ValueError, match=match):  # and a dict is validated like a file
        kvcompile.load_calibration(tensors, num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", b"\xff" * 64, "truncated"])
def test_unreadable_files_are_rejected(tmp_path, calib, content):
    path = tmp_path / "bad.safetensors"
    if content == "truncated":
        kvcompile.save_calibration(calib, path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match="cannot be read as safetensors"):
        kvcompile.load_calibration(path, num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)
    with pytest.raises(ValueError):
        kvcompile.load_calibration(tmp_path / "missing.safetensors", num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)


def _scales(k_scale: float, **extra) -> dict:
    return {"k_scale": torch.full((LAYERS, HKV), k_scale), "v_scale": torch.full((LAYERS, HKV), 0.01), **extra}


@pytest.mark.parametrize("scale,dtype,stores", [(1e-30, None, "saturated"), (1e30, None, "below e4m3's smallest"),
                                                (200.0, "float16", "below e4m3's smallest")],
                         ids=["1e-30", "1e30", "fp16-200"])
def test_implausible_scales_are_refused(tmp_path, tiny, scale, dtype, stores):
    """Finite, positive scales that would store every K/V of a working model as ~0 (1e-30: all saturated;
    1e30: all under e4m3's smallest code; 200 in an fp16 model: an amax past 65504) are refused at load,
    at save and by the cache, naming the range; the range's ends are accepted (kvcompile.calibrate's floor
    for an all-zero head, fp16's largest amax)."""
    from kvcompile.calibration_checks import MIN_AMAX, amax_range

    cfg = copy.deepcopy(tiny[0].config)
    cfg.dtype = dtype
    with pytest.raises(ValueError, match=rf"k_scale holds the scale {re.escape(f'{scale:.3g}')}, outside the plausible "
                                         rf".*{stores}"):
        kvcompile.load_calibration(_scales(scale), num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, config=cfg)
    with pytest.raises(ValueError, match="outside the plausible"):
        kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3", granularity="static",
                                 calibration=_scales(scale))
    with pytest.raises(ValueError, match="outside the plausible"):
        kvcompile.save_calibration(_scales(scale), tmp_path / "c.safetensors", config=cfg)
    assert not os.listdir(tmp_path)
    top = amax_range(getattr(torch, dtype) if dtype else None)[1]
    assert top == (65504.0 if dtype else torch.finfo(torch.float32).max ** 0.5)
    for ok in (MIN_AMAX / FP8_E4M3_MAX, 0.99 * top / FP8_E4M3_MAX):
        kvcompile.QuantizedCache(cfg, max_cache_len=16, kv_dtype="fp8_e4m3", granularity="static",
                                 calibration=_scales(float(torch.tensor(ok, dtype=torch.float32))))
    with pytest.raises(ValueError, match="k_offset holds 1e\\+30, beyond any K"):
        kvcompile.load_calibration(_scales(0.01, k_offset=torch.full((LAYERS, HKV, D), 1e30)), num_layers=LAYERS,
                                   num_kv_heads=HKV, head_dim=D)


def test_a_calibration_records_its_model_and_serves_its_fine_tunes(tmp_path, tiny, calib):
    """calibrate() records the model; the file keeps the record; another architecture of the very same
    shapes (Mistral's config for Llama's) is refused by name, a fine-tune (same architecture and sizes, new
    vocabulary and RoPE base, another name) is served. A plain dict records nothing and is checked by shape."""
    from safetensors import safe_open
    from transformers import MistralConfig

    path = tmp_path / "calib.safetensors"
    kvcompile.save_calibration(calib, path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert (meta["model.model_type"], meta["model.num_layers"], meta["model.num_kv_heads"]) == ("llama", "2", "2")
    other = MistralConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=None)
    fine_tune = copy.deepcopy(tiny[0].config)
    fine_tune.vocab_size, fine_tune._name_or_path = 300, "someone/tuned"
    fine_tune.rope_parameters = dict(fine_tune.rope_parameters or {}, rope_theta=5e5)
    for source in (path, calib):  # the file, and the dict calibrate() returns
        with pytest.raises(ValueError, match=r"was taken from .*LlamaConfig.*\(model_type llama vs mistral, "
                                             r"config_class LlamaConfig vs MistralConfig\); calibrate this model"):
            kvcompile.QuantizedCache(other, max_cache_len=16, kv_dtype="fp8_e4m3", granularity="static",
                                     calibration=source)
        cache = kvcompile.QuantizedCache(fine_tune, max_cache_len=16, kv_dtype="fp8_e4m3", granularity="static",
                                         calibration=source, device="cpu")
        assert torch.equal(cache.layers[1].k_scales, calib["k_scale"][1])
    kvcompile.QuantizedCache(other, max_cache_len=16, kv_dtype="fp8_e4m3", granularity="static",
                             calibration=dict(calib))  # no record: shapes only


def test_calibration_paths_name_the_path_and_the_fix(tmp_path, calib):
    """A directory given to load, a missing folder or a directory given to save: named with the fix, not
    as the OS's error on a temporary file; NaN scales are refused at save, not written for the loader
    to refuse later."""
    from kvcompile.calibration import Calibration

    kvcompile.save_calibration(calib, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match=r"calibration '.*' is a directory \(it holds c.safetensors\); pass the "
                                         "path of the safetensors file itself"):
        kvcompile.load_calibration(tmp_path, num_layers=LAYERS, num_kv_heads=HKV, head_dim=D)
    missing = tmp_path / "no" / "such" / "c.safetensors"
    with pytest.raises(FileNotFoundError, match=rf"cannot write '{missing}': its folder '{missing.parent}' does "
                                                "not exist; create it first"):
        kvcompile.save_calibration(calib, missing)
    with pytest.raises(IsADirectoryError, match=f"'{tmp_path}' is a directory; pass a file path inside it"):
        kvcompile.save_calibration(calib, tmp_path)
    nan = Calibration(calib, calib.model)
    nan["v_scale"] = nan["v_scale"].clone()
    nan["v_scale"][1, 0] = float("nan")
    with pytest.raises(ValueError, match="v_scale holds non-finite values"):
        kvcompile.save_calibration(nan, tmp_path / "nan.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors"]


def test_static_cache_needs_both_scales(tiny):
    with pytest.raises(ValueError, match="static"):
        kvcompile.QuantizedCache(tiny[0].config, max_batch_size=1, max_cache_len=16, kv_dtype="fp8_e4m3", granularity="static",
                                 calibration={"k_offset": torch.zeros(LAYERS, HKV, D)})


def test_layers_of_different_shapes_are_served_without_calibration():
    """A calibration holds one [layers, kv heads(, head_dim)] shape: a model whose layers differ
    (tests/models.py's tiny Gemma 4) is refused it by name, in calibrate() and at cache construction,
    while the same cache without calibration builds."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from models import tiny_model

    model = tiny_model("gemma4", sliding_window=4)
    differ = r"kvcompile.calibrate: the layers of Gemma4TextConfig differ .*\(1, 64\), \(2, 32\).*without calibration"
    with pytest.raises(ValueError, match=differ):
        kvcompile.calibrate(model, [torch.arange(3, 19)])
    with pytest.raises(ValueError, match=r"differ in \(kv heads, head dim\).*without calibration"):
        kvcompile.QuantizedCache(model.config, max_cache_len=16, kv_dtype="fp8_e4m3",
                                 calibration={"k_offset": torch.zeros(2, 2, 32)})
    assert len(kvcompile.QuantizedCache(model.config, max_cache_len=16, kv_dtype="fp8_e4m3").layers) == 2

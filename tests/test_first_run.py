"""The first ten minutes: every mistake a new user makes is named by kvcompile, the cache's size is
known before it is allocated, and what the examples need ships inside the package.

Each bad-input test asserts that the message names the problem and the fix, and that the error is
kvcompile's (raised before torch or Dynamo reach the input).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

import kvcompile
from kvcompile import QuantizedCache
from kvcompile.cache import CacheSizeWarning
from kvcompile.calibration import shipped_calibrations
from models import tiny_model as factory_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
# SmolLM2-135M's attention shapes (30 layers, 3 kv heads of 64): the shipped calibration's model
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)


def config(**overrides):
    return LlamaConfig(**dict(TINY, **overrides))


_MODEL = {}


def tiny_model():
    if not _MODEL:
        _MODEL["m"] = factory_model(config(), "sdpa")
    return _MODEL["m"]


IDS = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))


def kv(cache) -> dict:
    """The cache as the keyword this transformers' forward/generate takes (``cache``, or 5.17's name)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(tiny_model().forward).parameters else "past_key_values"
    return {name: cache}


# ------------------------------------------------------------------------------------------------
# arguments of QuantizedCache
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", [("max_cache_len", dict(max_cache_len=64.0)),
                                     ("max_batch_size", dict(max_batch_size=2.0)),
                                     ("max_cache_len", dict(max_cache_len=True))])
def test_non_int_sizes_refused(name, kw):
    args = dict(max_batch_size=1, max_cache_len=16, device="cpu")
    args.update(kw)
    with pytest.raises(TypeError, match=f"kvcompile.QuantizedCache: {name} must be an int"):
        QuantizedCache(config(), **args)


def test_float_size_names_the_int_to_use():
    with pytest.raises(TypeError, match=r"got float 64.0 \(use 64\)"):
        QuantizedCache(config(), max_batch_size=1, max_cache_len=64.0)


@pytest.mark.parametrize("kw", [dict(max_cache_len=0), dict(max_batch_size=-1)])
def test_non_positive_sizes_refused(kw):
    args = dict(max_batch_size=1, max_cache_len=16)
    args.update(kw)
    with pytest.raises(ValueError, match="must be a positive int"):
        QuantizedCache(config(), **args)


def test_integer_like_sizes_accepted():
    cache = QuantizedCache(config(), max_batch_size=np.int64(2), max_cache_len=torch.tensor(16), device="cpu")
    assert (cache.max_batch_size, cache.max_cache_len) == (2, 16)
    assert type(cache.max_cache_len) is int and cache.layers[0].k_codes.shape[:3] == (2, 2, 16)


def test_model_instead_of_config_refused():
    with pytest.raises(TypeError, match="pass model.config"):
        QuantizedCache(tiny_model(), max_batch_size=1, max_cache_len=16)


@pytest.mark.parametrize("cfg", ["HuggingFaceTB/SmolLM2-135M-Instruct", TINY], ids=["name", "dict"])
def test_name_or_dict_instead_of_config_refused(cfg):
    with pytest.raises(TypeError, match="config must be a transformers config object.*AutoConfig"):
        QuantizedCache(cfg, max_batch_size=1, max_cache_len=16)


def test_unknown_device_refused():
    with pytest.raises(ValueError, match="device='gpu' is not a torch device; use e.g. 'cuda'"):
        QuantizedCache(config(), max_batch_size=1, max_cache_len=16, device="gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_refused():
    with pytest.raises(ValueError, match="device='cuda' but CUDA is not available.*device='cpu'"):
        QuantizedCache(config(), max_batch_size=1, max_cache_len=16, device="cuda")


@pytest.mark.parametrize("cls,task", [("ViTConfig", "image classification"), ("DistilBertConfig", "masked LM"),
                                      ("CLIPTextConfig", "text encoding"), ("ResNetConfig", "image classification")])
def test_configs_of_models_that_are_not_causal_decoders_refused(cls, task):
    """A vision model, an encoder, a text encoder: refused by name when the cache is built, with what
    transformers serves the model for (a ResNet is no "recurrent model such as Mamba"); a decoder builds."""
    import transformers

    with pytest.raises(ValueError, match=rf"{cls} \(model_type '\w+'\) is not a causal decoder: transformers serves "
                                         rf"it for [^;]*{task}.*AutoModelForCausalLM") as e:
        QuantizedCache(getattr(transformers, cls)(), max_batch_size=1, max_cache_len=16)
    assert "Mamba" not in str(e.value)
    assert len(QuantizedCache(config(), max_batch_size=1, max_cache_len=16).layers) == 2


def test_cache_larger_than_the_device_refused_before_allocating(monkeypatch):
    """The bytes a cache needs, against what its device holds (the CPU: total memory, here patched to
    1 MiB), refused before anything is allocated, with the bytes and the length that would fit; built with
    device=None, at the first update. A cache that fits is built."""
    from kvcompile import checks

    fits = QuantizedCache(config(), max_batch_size=1, max_cache_len=16, kv_dtype="fp8_e4m3", device="cpu")
    per_position = fits.nbytes // 16  # 2 layers x 2 kv heads x (2 x 32 code bytes + 2 x 4 scale bytes) + ...
    monkeypatch.setattr(checks, "_system_memory", lambda: 2**20)
    QuantizedCache(config(), max_batch_size=1, max_cache_len=16, kv_dtype="fp8_e4m3", device="cpu")
    too_long = 2 * 2**20 // per_position
    need = QuantizedCache(config(), max_cache_len=too_long, kv_dtype="fp8_e4m3").planned_nbytes(device="cpu")
    match = (rf"max_batch_size=1 x max_cache_len={too_long:,} needs {need:,} bytes \([\d.]+ MiB\) of K/V storage in "
             r"2 layers, but this machine has 1.00 MiB of memory in all; pass max_cache_len=.*at most about ([\d,]+) fit")
    with pytest.raises(ValueError, match=match) as e:
        QuantizedCache(config(), max_batch_size=1, max_cache_len=too_long, kv_dtype="fp8_e4m3", device="cpu")
    advised = int(re.search(match, str(e.value)).group(1).replace(",", ""))
    # the advice is the longest that fits: it builds, 1% more does not
    QuantizedCache(config(), max_batch_size=1, max_cache_len=advised, kv_dtype="fp8_e4m3", device="cpu")
    with pytest.raises(ValueError, match="this machine has 1.00 MiB"):
        QuantizedCache(config(), max_batch_size=1, max_cache_len=advised * 101 // 100, kv_dtype="fp8_e4m3", device="cpu")
    lazy = QuantizedCache(config(), max_batch_size=1, max_cache_len=too_long, kv_dtype="fp8_e4m3")
    k = torch.randn(1, 2, 1, 32)
    with pytest.raises(ValueError, match=match):
        lazy.update(k, k, 0)
    assert lazy.nbytes == 0 and lazy.unallocated_layers() == [0, 1]
    # on a GPU: its free memory, and what this process's allocator holds unused
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    assert checks.room_on(torch.device("cuda", 0)) == (4 * 2**30, "cuda:0 has 4.00 GiB free of 80.00 GiB")


def test_cache_beyond_any_memory_refused():
    with pytest.raises(ValueError, match=r"max_cache_len=10,000,000,000,000 needs [\d,]+ bytes \([\d,.]+ TiB\)"):
        QuantizedCache(config(), max_batch_size=1, max_cache_len=10**13, device="cpu")


# ------------------------------------------------------------------------------------------------
# gradients: refused, naming torch.no_grad()
# ------------------------------------------------------------------------------------------------

NO_GRAD = r"run the model under torch.no_grad\(\) or torch.inference_mode\(\)"


def test_forward_with_gradients_refused_at_the_first_update():
    """The codes are integers: no gradient reaches k_proj / v_proj through the cache, so a forward whose K/V
    require grad is refused at the first update (before anything is stored), in one line naming the fix.
    Under torch.no_grad() or torch.inference_mode() the same forward runs."""
    model = tiny_model()
    cache = QuantizedCache(model.config, max_batch_size=1, max_cache_len=16, device="cpu")
    with pytest.raises(RuntimeError, match=rf"^kvcompile.QuantizedCache: {NO_GRAD} \(generate\(\) does\): layer 0's "
                                           r"key_states requires grad.*DynamicCache, or use_cache=False$") as e:
        model(input_ids=IDS, use_cache=True, **kv(cache))
    assert "\n" not in str(e.value) and int(cache.get_seq_length()) == 0
    for mode in (torch.no_grad, torch.inference_mode):
        cache.reset()
        with mode():
            model(input_ids=IDS, use_cache=True, **kv(cache))
        assert int(cache.get_seq_length()) == IDS.shape[1]


@pytest.mark.usefixtures("dynamo_reset_around")
def test_compiled_forward_with_gradients_names_the_fix_first():
    """Compiled, the graph that stores K/V requiring grad raises kvcompile's line as the first line (not
    torch's BackendCompilerFailed), before Inductor; a graph traced under no_grad is let through."""
    from kvcompile import compile_backend

    cache = QuantizedCache(config(num_hidden_layers=1), max_batch_size=1, max_cache_len=8, kv_dtype="fp8_e4m3",
                           device="cpu")
    k = torch.randn(1, 2, 1, 32, requires_grad=True)
    backend = kvcompile.backend(kv_dtype="fp8_e4m3")
    with pytest.raises(RuntimeError) as e:
        torch.compile(lambda k, v: cache.update(k, v, 0), backend=backend, fullgraph=True)(k, k * 2)
    first = str(e.value).splitlines()[0]
    assert first.startswith("kvcompile.backend: run the model under torch.no_grad() or torch.inference_mode()"), first
    assert "kvcompile::store_kv" in first and backend.report() == []
    refusals = []  # what kvcompile.backend's check says where the backend is called, here under no_grad

    def check_only(gm, _):
        refusals.append(compile_backend._grad_refusal(gm.graph, 0))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(lambda k, v: cache.update(k, v, 0), backend=check_only, fullgraph=True)(k, k * 2)
    assert refusals == [None]


# ------------------------------------------------------------------------------------------------
# calibration: shipped by name, wrong types named
# ------------------------------------------------------------------------------------------------


def test_calibration_of_the_wrong_type_refused():
    with pytest.raises(TypeError, match="calibration: got a list; pass the dict kvcompile.calibrate"):
        QuantizedCache(config(), max_batch_size=1, max_cache_len=16, calibration=[1, 2, 3])


def test_shipped_calibration_by_name():
    assert "smollm2-135m-instruct" in shipped_calibrations()
    cfg = LlamaConfig(**SMOLLM2)
    cache = QuantizedCache(cfg, max_batch_size=1, max_cache_len=16, device="cpu", calibration="smollm2-135m-instruct")
    by_path = kvcompile.load_calibration(
        os.path.join(os.path.dirname(kvcompile.__file__), "data", "calibration", "smollm2-135m-instruct.safetensors"),
        num_layers=30, num_kv_heads=3, head_dim=64)
    assert cache.layers[29].k_offset.shape == (3, 64)
    # the default format (int8) stores K rotated: its offset is the file's, rotated into K's space
    rotated = (by_path["k_offset"][29].double() @ kvcompile.rotation.hadamard(64, torch.float64)).float()
    assert cache.k_rotate and torch.equal(cache.layers[29].k_offset, rotated)
    plain = QuantizedCache(cfg, max_batch_size=1, max_cache_len=16, device="cpu", kv_dtype="fp8_e4m3",
                           calibration="smollm2-135m-instruct")
    assert torch.equal(plain.layers[29].k_offset, by_path["k_offset"][29])
    # static scales from the shipped file (fp8 only)
    static = QuantizedCache(cfg, max_batch_size=1, max_cache_len=16, device="cpu", kv_dtype="fp8_e4m3",
                            granularity="static", calibration="smollm2-135m-instruct")
    assert torch.equal(static.layers[3].k_scales, by_path["k_scale"][3])


def test_unknown_calibration_name_lists_the_shipped_ones():
    with pytest.raises(ValueError, match=r"'smollm2-135m'.*no such file.*shipped: \['smollm2-135m-instruct'"):
        QuantizedCache(LlamaConfig(**SMOLLM2), max_batch_size=1, max_cache_len=16, calibration="smollm2-135m")


def test_shipped_calibration_for_another_model_refused():
    # the tiny model has 2 layers of 2 kv heads: the SmolLM2 file, which records its model, does not fit it
    with pytest.raises(ValueError, match=r"was taken from HuggingFaceTB/SmolLM2-135M-Instruct .*\(num_layers 30 vs 2, "
                                         r"num_kv_heads 3 vs 2, .*calibrate this model"):
        QuantizedCache(config(), max_batch_size=1, max_cache_len=16, calibration="smollm2-135m-instruct")


# ------------------------------------------------------------------------------------------------
# under generate()
# ------------------------------------------------------------------------------------------------


def test_meta_cache_sizes_but_refuses_to_run():
    meta = QuantizedCache(config(), max_batch_size=2, max_cache_len=16, kv_dtype="q8_0", device="meta")
    real = QuantizedCache(config(), max_batch_size=2, max_cache_len=16, kv_dtype="q8_0", device="cpu")
    assert meta.nbytes == real.nbytes > 0
    with pytest.raises(ValueError, match="device='meta': it holds no storage.*device='cuda' or 'cpu'"):
        tiny_model().generate(IDS, max_new_tokens=2, do_sample=False, **kv(meta))


def test_beam_search_names_num_beams():
    cache = QuantizedCache(config(), max_batch_size=1, max_cache_len=16)
    with pytest.raises(ValueError, match="batch of 2 exceeds max_batch_size=1.*batch x num_beams"):
        tiny_model().generate(IDS, max_new_tokens=2, num_beams=2, do_sample=False, **kv(cache))


def test_generating_past_max_cache_len_names_max_new_tokens():
    cache = QuantizedCache(config(), max_batch_size=1, max_cache_len=10)
    with pytest.raises(ValueError, match="max_cache_len>=11 .*prompt tokens \\+ max_new_tokens") as e:
        tiny_model().generate(IDS, max_new_tokens=6, min_new_tokens=6, do_sample=False, **kv(cache))
    assert "use_cache" not in str(e.value)


def test_generate_without_use_cache_is_told_to_pass_no_cache():
    # generate(use_cache=False) feeds the whole sequence every step: the cache fills whatever its size
    # (here 4x the prompt for 6 new tokens), so the advice is to pass none, not a larger max_cache_len
    cache = QuantizedCache(config(), max_batch_size=1, max_cache_len=4 * IDS.shape[1])
    with pytest.raises(ValueError, match="generate\\(use_cache=False\\).*pass no cache"):
        tiny_model().generate(IDS, max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=False,
                              **kv(cache))


@pytest.mark.usefixtures("dynamo_reset_around")
def test_format_mismatch_is_the_first_line():
    """A q8_0 cache under an fp8_e4m3 backend: the first call fails with kvcompile's message as the first
    line, not Dynamo's BackendCompilerFailed wrapper, and before Inductor compiles anything."""
    from kvcompile.passes import KVDtypeMismatch

    model = tiny_model()
    cache = QuantizedCache(model.config, max_batch_size=1, max_cache_len=16, kv_dtype="q8_0")
    backend = kvcompile.backend(kv_dtype="fp8_e4m3")
    compiled = torch.compile(model.forward, backend=backend)
    with pytest.raises(KVDtypeMismatch) as e, torch.no_grad():
        compiled(input_ids=IDS, use_cache=True, **kv(cache))
    first = str(e.value).splitlines()[0]
    assert "kv_dtype='q8_0'" in first and "Build the backend with kv_dtype='q8_0'" in first, first
    assert backend.report() == []  # the graph never reached the pass's report, nor Inductor


@pytest.mark.usefixtures("dynamo_reset_around")
@pytest.mark.parametrize("backend_kw", [dict(kv_dtype="int8"), dict(kv_dtype="fp8_e4m3"),
                                        dict(k_dtype="fp8_e4m3", v_dtype="int8")])
def test_format_mismatch_of_a_k_v_pair_names_both_sides(backend_kw):
    """A cache with K int8 and V fp8_e4m3 under a backend of either format alone (or the pair swapped): the
    error names the pair to build the backend with, and that backend then compiles and rewrites the model."""
    from kvcompile.passes import KVDtypeMismatch

    model = tiny_model()
    pair = dict(k_dtype="int8", v_dtype="fp8_e4m3")
    cache = lambda: QuantizedCache(model.config, max_batch_size=1, max_cache_len=16, **pair)  # noqa: E731
    with pytest.raises(KVDtypeMismatch) as e, torch.no_grad():
        torch.compile(model.forward, backend=kvcompile.backend(**backend_kw))(input_ids=IDS, **kv(cache()))
    first = str(e.value).splitlines()[0]
    assert "holds K as 'int8' and V as 'fp8_e4m3' codes" in first, first
    assert "Build the backend with k_dtype='int8', v_dtype='fp8_e4m3'" in first, first
    torch._dynamo.reset()
    backend = kvcompile.backend(**pair)
    with torch.no_grad():
        torch.compile(model.forward, backend=backend)(input_ids=IDS, **kv(cache()))
    assert [(r["found"], r["rewritten"]) for r in backend.report()] == [(model.config.num_hidden_layers,) * 2]


# ------------------------------------------------------------------------------------------------
# max_cache_len omitted: a warning that names the bytes
# ------------------------------------------------------------------------------------------------


def test_omitted_max_cache_len_warns_with_the_bytes():
    cfg = LlamaConfig(**SMOLLM2)
    with pytest.warns(CacheSizeWarning) as rec:
        cache = QuantizedCache(cfg, max_batch_size=1)
    assert cache.max_cache_len == 8192 and cache.nbytes == 0  # nothing allocated (device=None)
    msg = str(rec[0].message)
    mib = cache.planned_nbytes() / 2**20
    assert f"max_position_embeddings=8192 positions x max_batch_size=1: {mib:,.1f} MiB" in msg, msg
    assert "Pass max_cache_len=<prompt tokens + max_new_tokens>" in msg and "python -m kvcompile info" in msg
    assert rec[0].filename == __file__  # points at the caller's line
    # what the warning announced is what the cache then allocates
    cache.early_initialization(1, 3, 64, torch.float32, "cpu")
    assert cache.nbytes == cache.planned_nbytes()


def test_given_max_cache_len_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheSizeWarning)
        QuantizedCache(config(), max_batch_size=1, max_cache_len=16)


@pytest.mark.parametrize("kw", [dict(kv_dtype="fp8_e4m3"), dict(kv_dtype="q8_0"),
                                dict(kv_dtype="fp8_e4m3", granularity="block32"),
                                dict(kv_dtype="fp8_e4m3", v_layout="head_dim")],
                         ids=["fp8", "q8_0", "block32", "fp8-head_dim"])
def test_planned_nbytes_is_what_allocation_holds(kw):
    cache = QuantizedCache(config(), max_batch_size=3, max_cache_len=37, **kw)
    planned = cache.planned_nbytes(per_layer=True, device="cpu")
    assert cache.nbytes == 0 and len(planned) == 2
    # on a GPU, "auto" stores token-scale V key-contiguous, padded to 48 positions; on the CPU head_dim-contiguous
    pad = 2 * 3 * 2 * 32 * (48 - 37) if kw == dict(kv_dtype="fp8_e4m3") else 0
    assert cache.planned_nbytes(device="cuda") == sum(planned) + pad
    cache.early_initialization(3, 2, 32, torch.float32, "cpu")
    assert [layer.nbytes for layer in cache.layers] == planned


# ------------------------------------------------------------------------------------------------
# python -m kvcompile info --config
# ------------------------------------------------------------------------------------------------


def _info(*args) -> str:
    from kvcompile.__main__ import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["info", *args]) == 0
    return buf.getvalue()


def test_info_config_prints_the_cache_bytes(tmp_path):
    LlamaConfig(**SMOLLM2).save_pretrained(tmp_path)
    out = _info("--config", str(tmp_path / "config.json"), "--max-cache-len", "128", "--kv-dtype", "q8_0")
    cache = QuantizedCache(LlamaConfig(**SMOLLM2), max_batch_size=1, max_cache_len=128, kv_dtype="q8_0", device="cpu")
    per_layer = cache.layers[0].nbytes
    assert "layers 0-29" in out and f"{per_layer:,d} bytes" in out, out
    total_line = next(line for line in out.splitlines() if line.strip().startswith("total"))
    assert f"{cache.nbytes:,d} bytes" in total_line, out
    assert f"({cache.nbytes / cache.bf16_nbytes():.3f}x)" in out
    assert "max_cache_len 128 (given)" in out


def test_info_config_counts_a_sliding_layer_by_its_window(tmp_path):
    """A Gemma-3-style config (5 sliding layers of window 64, 1 full): the sliding layers hold a ring of
    64 positions, whatever max_cache_len; ring=False would hold 4096."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=64,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"])
    cfg.save_pretrained(tmp_path)
    out = _info("--config", str(tmp_path), "--max-cache-len", "4096")
    ring = QuantizedCache(cfg, max_cache_len=4096, device="meta").planned_nbytes(per_layer=True)
    full = QuantizedCache(cfg, max_cache_len=4096, device="meta", ring=False).planned_nbytes(per_layer=True)
    assert "layers 0-4" in out and f"{ring[0]:,d} bytes" in out and f"{full[5]:,d} bytes" in out, out
    assert "x 64 positions (a ring: sliding window 64)" in out and "x 4096 positions" in out, out
    assert ring[0] < full[0] / 32 and ring[5] == full[5]
    # the cost of context is the full layer's alone; the rings are a fixed part of it
    assert f"{ring[5] / 4096:,.0f} bytes per position of context, plus " in out, out
    cfg.layer_types = ["sliding_attention"] * 6  # no full layer: the cache does not grow with the context
    cfg.save_pretrained(tmp_path)
    out = _info("--config", str(tmp_path), "--max-cache-len", "4096")
    assert "fixed: every K/V layer is a sliding window's ring" in out and "per position" not in out, out


def test_info_config_allocates_nothing(tmp_path):
    # a Llama-3.1-8B-shaped config at its full 131072 positions, batch 64: 528 GiB if it were allocated
    LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=131072).save_pretrained(tmp_path)
    out = _info("--config", str(tmp_path), "--batch", "64")
    assert "max_cache_len 131072 (from max_position_embeddings: pass --max-cache-len to choose)" in out
    assert "(528.00 GiB)" in out and "8.25 GiB" in out, out  # total; per batch row


@pytest.mark.parametrize("args,match", [
    (["--kv-dtype", "int4"], "argument --kv-dtype: unknown kv_dtype 'int4'"),
    (["--max-cache-len", "0"], "argument --max-cache-len: must be a positive int, got 0"),
    (["--batch", "two"], "argument --batch: expected a positive int, got 'two'"),
    (["--granularity", "tokens"], "argument --granularity: invalid choice: 'tokens'"),
    (["--calibration", "."], "argument --calibration: kvcompile calibration '.' is a directory"),
], ids=["kv-dtype", "max-cache-len", "batch", "granularity", "calibration"])
def test_info_arguments_are_checked_before_the_config_is_read(args, match, capsys):
    """One line from argparse, before the config (here a path that does not exist) is read."""
    from kvcompile.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["info", "--config", "no/such/config", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and match in err and "Traceback" not in err and "info works offline" not in err, err


def test_info_config_cli_offline(tmp_path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "kvcompile", "info", "--config", str(tmp_path), "--max-cache-len", "64"],
                       capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "layers 0-1" in r.stdout and "bf16 cache of the same capacity" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "kvcompile", "info", "--config", "nobody/no-such-model"],
                         capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=300)
    assert bad.returncode != 0 and "info works offline: pass a local model directory or its config.json" in bad.stderr


# ------------------------------------------------------------------------------------------------
# the examples: what they need comes from inside the install
# ------------------------------------------------------------------------------------------------


def _examples_common():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import _common
    finally:
        sys.path.pop(0)
    return _common


def test_default_text_is_python_prose():
    common = _examples_common()
    text = common.read_text(None)
    from pydoc_data.topics import topics

    assert len(text) > 100_000 and topics["assert"] in text
    assert "pydoc_data.topics" in common.DEFAULT_TEXT  # what --help says the default is


def test_examples_refer_to_nothing_outside_the_repository():
    for d in ("examples", "kvcompile", "benchmarks"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if f.endswith((".py", ".sh", ".md")):
                    src = open(os.path.join(dirpath, f), encoding="utf-8").read()
                    outside = (os.path.join("..", "shared"), os.path.join("shared", "data"))  # beside the checkout
                    assert not any(o in src for o in outside), os.path.join(dirpath, f)


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_missing_examples_extra_is_named(monkeypatch, missing):
    common = _examples_common()
    import importlib.util

    real = importlib.util.find_spec
    present = object()  # the other one is found whether or not this machine has it: only `missing` is named

    def find_spec(name, *a):
        if name in ("gguf", "accelerate"):
            return None if name == missing else present
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SystemExit, match=rf"needs {missing}, which come with kvcompile's `examples` extra: "
                                         rf"pip install \"\.\[examples\]\" in the kvcompile checkout, or "
                                         rf"pip install {missing}$"):
        common.load_model(None, device="cpu")
    with pytest.raises(SystemExit, match=rf"the GGUF file x.gguf needs {missing}"):
        common.load_model("some/dir", gguf_file="x.gguf", device="cpu")


def test_generate_runs_from_any_directory_and_splits_prefill_from_decode(tmp_path):
    """examples/generate.py from a directory outside the checkout, against the kvcompile on the path."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "generate.py"), "--tiny", "--no-compile",
                        "--max-new-tokens", "5", "--device", "cpu", "--max-cache-len", "100"],
                       capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("prefill:"))
    assert " tokens in " in line and "| decode: 4 tokens in " in line and line.endswith("tokens/s"), line
    assert "max_cache_len=100" in r.stdout


def test_generate_result_times_prefill_and_decode_apart():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import generate
    finally:
        sys.path.pop(0)
    common = _examples_common()
    model, tok = common.tiny_model()
    res = generate.run(model, tok, max_new_tokens=4, compile=False, device="cpu", out=lambda *a: None)
    assert res["new_tokens"] == 4 and res["decode_tokens"] == 3  # the first new token comes from the prefill
    assert res["prefill_s"] > 0 and res["decode_s"] > 0
    assert res["decode_tokens_per_s"] == pytest.approx(3 / res["decode_s"])
    assert res["prefill_s"] + res["decode_s"] <= res["seconds"]


# ------------------------------------------------------------------------------------------------
# more mistakes found by trying the API as a new user
# ------------------------------------------------------------------------------------------------


def test_cache_of_another_model_names_the_layers():
    fewer = QuantizedCache(config(num_hidden_layers=1), max_batch_size=1, max_cache_len=16)
    with pytest.raises(ValueError, match="wrote attention layer 1, but the cache was built for 1 layers.*"
                                         r"QuantizedCache\(model.config"):
        tiny_model().generate(IDS, max_new_tokens=2, do_sample=False, **kv(fewer))


@pytest.mark.parametrize("option", ["mode", "fullgraph", "dynamic"])
def test_torch_compile_options_given_to_the_backend(option):
    with pytest.raises(TypeError, match=rf"kvcompile.backend\(\) takes no {option}=; it is torch.compile's"):
        kvcompile.backend(kv_dtype="q8_0", **{option: True})


@pytest.mark.usefixtures("dynamo_reset_around")
def test_generate_through_a_compiled_module_names_the_forward(monkeypatch):
    """``torch.compile(model, backend=kvcompile.backend())`` then ``.generate()`` runs the original
    module uncompiled (PyTorch's OptimizedModule hands ``generate`` to it): the cache says so once,
    with the fix. Control: the forward compiled as the README does it reaches the backend, no warning."""
    from kvcompile import cache_layer

    model = tiny_model()
    backend = kvcompile.backend()
    compiled = torch.compile(model, backend=backend)
    monkeypatch.setattr(cache_layer, "_warned_uncompiled", False)
    gen = dict(max_new_tokens=2, do_sample=False)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"model\.forward = torch\.compile\(model\.forward"):
        compiled.generate(IDS, **gen, **kv(QuantizedCache(model.config, max_batch_size=1, max_cache_len=16)))
    assert backend.report() == []  # nothing was compiled: what the warning says

    monkeypatch.setattr(cache_layer, "_warned_uncompiled", False)
    backend = kvcompile.backend()
    monkeypatch.setattr(model, "forward", torch.compile(model.forward, backend=backend))  # the shared model: undone after
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(IDS, **gen, **kv(QuantizedCache(model.config, max_batch_size=1, max_cache_len=16)))
    assert backend.report(), "the compiled forward never reached the backend"
    assert not [w for w in caught if "compiled nothing" in str(w.message)]

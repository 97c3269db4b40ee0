"""Argument checks at kvcompile's entry points: each refuses a value with kvcompile's own message,
naming the argument, what is wrong with it and the fix, before torch or transformers reach it.

* :func:`positive_int`, :func:`checked_config`, :func:`checked_device`: ``QuantizedCache``'s arguments;
* :func:`not_a_causal_decoder`: a config whose model writes no K/V while generating (a ViT, DistilBERT);
* :func:`room_on`: the bytes a device can hold, for refusing a cache before it is allocated;
* :func:`check_rows`: row indices (``reorder_cache``'s ``beam_idx``);
* :func:`grad_refusal`: the error for a forward with gradients enabled;
* :func:`file_to_read` / :func:`file_to_write`: paths that are directories or in missing folders.

Imports nothing of kvcompile (:mod:`kvcompile.hf` uses it too).
"""

from __future__ import annotations

import functools
import operator
import os
from typing import Mapping

import torch

from . import formats, rotation

__all__ = ["cache_head_dims", "cache_options", "checked_config", "checked_device", "check_rows", "file_to_read",
           "file_to_write", "gib", "grad_refusal", "max_cache_len", "not_a_causal_decoder", "positive_int", "room_on"]


def positive_int(name: str, value, who: str = "kvcompile.QuantizedCache") -> int:
    """``value`` as an int >= 1 (ints and integer-like numpy/torch scalars); floats and bools are refused."""
    if isinstance(value, bool) or isinstance(value, float):
        hint = f" (use {int(value)})" if isinstance(value, float) and value.is_integer() and value >= 1 else ""
        raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__} {value!r}{hint}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__} {value!r}") from None
    if n < 1:
        raise ValueError(f"{who}: {name} must be a positive int, got {n}")
    return n


def positive_int_arg(text: str) -> int:
    """An argparse ``type``: an int >= 1 (a mistake is one line from argparse, not a traceback)."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {n}")
    return n


def checked_config(config):
    """The model config the cache is built from; a model, a name or a dict is refused with the fix."""
    if isinstance(config, torch.nn.Module):
        raise TypeError(
            f"kvcompile.QuantizedCache: got the model ({type(config).__name__}) where the config goes; "
            "pass model.config"
        )
    if isinstance(config, (str, os.PathLike, Mapping)):
        raise TypeError(
            f"kvcompile.QuantizedCache: config must be a transformers config object, got a {type(config).__name__}; "
            "pass model.config or transformers.AutoConfig.from_pretrained(...)"
        )
    if not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
        raise TypeError(
            f"kvcompile.QuantizedCache: config must be a transformers config object (model.config), "
            f"got {type(config).__name__}"
        )
    return config


def checked_device(device):
    """``device`` as a torch.device (None stays None: allocate lazily); a device torch cannot use is refused."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"kvcompile.QuantizedCache: device={device!r} is not a torch device; use e.g. 'cuda', 'cuda:1' "
            "or 'cpu', or device=None to allocate on the first update's device"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"kvcompile.QuantizedCache: device={device!r} but CUDA is not available here (torch "
            f"{torch.__version__}); use device='cpu' (or device=None: the first update's device)"
        )
    return dev


# -- configs of models that are not causal decoders -----------------------------------------------

# transformers' auto mappings (model type -> class) of the heads that generate: a model type in one of
# them writes K/V to a cache while generating (its decoder, for a multimodal or encoder-decoder model)
_GENERATING = ("CAUSAL_LM", "IMAGE_TEXT_TO_TEXT", "MULTIMODAL_LM", "SEQ_TO_SEQ_CAUSAL_LM", "SPEECH_SEQ_2_SEQ",
               "VISION_2_SEQ", "CAUSAL_IMAGE_MODELING", "TEXT_TO_WAVEFORM", "TEXT_TO_SPECTROGRAM")
_TASK_NAMES = {"IMAGE": "image features", "MASKED_LM": "masked LM", "CTC": "CTC speech recognition"}
# every model type has a base class and many a pre-training one: no evidence either way
_ANY_MODEL = ("MODEL_MAPPING_NAMES", "MODEL_FOR_PRETRAINING_MAPPING_NAMES")


@functools.lru_cache(maxsize=1)
def _task_mappings() -> dict[str, dict]:
    """transformers' ``MODEL_FOR_<TASK>_MAPPING_NAMES`` by task name ("image classification")."""
    from transformers.models.auto import modeling_auto

    out = {}
    for name in dir(modeling_auto):
        if name.startswith("MODEL_FOR_") and name.endswith("_MAPPING_NAMES") and name not in _ANY_MODEL:
            out[name[len("MODEL_FOR_"):-len("_MAPPING_NAMES")]] = getattr(modeling_auto, name)
    return out


def not_a_causal_decoder(config) -> str | None:
    """Why ``config`` describes no model that generates with a cache, or None.

    Decided by transformers' own auto classes: a model type (the config's or its decoder's) with a
    causal-LM or other generating head is served on; one that transformers knows only for other tasks
    (image classification: ViT, ResNet; masked LM: DistilBERT; text encoding: CLIP's text model) is
    not. A model type transformers has no class for (remote code, a config made by hand) gets the
    benefit of the doubt, as does one whose ``auto_map`` names an ``AutoModelForCausalLM``."""
    auto_map = getattr(config, "auto_map", None) or {}
    if isinstance(auto_map, Mapping) and "AutoModelForCausalLM" in auto_map:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = {t for t in (getattr(config, "model_type", ""), getattr(text, "model_type", "")) if t}
    tasks = _task_mappings()
    if not types or any(t in tasks.get(g, {}) for t in types for g in _GENERATING):
        return None
    served = [_TASK_NAMES.get(task, task.lower().replace("_", " ")) for task, names in tasks.items()
              if any(t in names for t in types)]
    if not served:  # transformers has no head for it at all: cannot tell
        return None
    served = served[:4]
    tasks_text = ", ".join(served[:-1]) + " and " + served[-1] if len(served) > 1 else served[0]
    return (f"{type(config).__name__} (model_type {sorted(types)[0]!r}) is not a causal decoder: transformers "
            f"serves it for {tasks_text}, with no causal-LM head, so no forward of it writes K/V to a cache")


# -- memory ---------------------------------------------------------------------------------------


def gib(n: float) -> str:
    """Bytes in the binary unit that reads best (TiB / GiB / MiB / KiB)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n / 2**10:,.2f} KiB"


def _system_memory() -> int | None:
    """Total physical memory (os.sysconf: Linux, macOS), None where the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def room_on(device: torch.device) -> tuple[int, str] | None:
    """``(bytes, description)``: what an allocation on ``device`` can take now, or None where kvcompile
    cannot tell (meta and other devices). CUDA: the device's free memory plus what this process's
    caching allocator holds unused; the CPU: the machine's total memory (zeroed pages are mapped
    lazily, so a larger cache would be accepted by the allocator and fail later, as pages are touched)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free, f"{device} has {gib(free)} free of {gib(total)}"
    if device.type == "cpu":
        total = _system_memory()
        return None if not total else (total, f"this machine has {gib(total)} of memory in all")
    return None


# -- indices, gradients, paths --------------------------------------------------------------------


def check_rows(who: str, name: str, idx, rows: int) -> None:
    """Refuse ``idx`` unless it is a 1-D integer tensor of at most ``rows`` row indices in ``0..rows-1``
    (one host read of its min and max, outside torch.compile)."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.is_floating_point() or idx.dtype == torch.bool:
        got = f"{idx.dtype} tensor of shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise TypeError(f"{who}: {name} must be a 1-D integer tensor of row indices, got a {got}")
    if idx.numel() > rows:
        raise ValueError(f"{who}: {name} has {idx.numel()} entries, but the cache holds max_batch_size={rows} rows; "
                         "build it with max_batch_size >= the batch (x num_beams)")
    if idx.numel() == 0 or torch.compiler.is_compiling():
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= rows:
        raise ValueError(f"{who}: {name} holds {lo if lo < 0 else hi}, outside the cache's rows 0..{rows - 1} "
                         f"(max_batch_size={rows}); pass row indices of the current batch")


def grad_refusal(who: str, what: str, why: str = "k_proj and v_proj would get none") -> RuntimeError:
    """The one-line error for a forward with gradients enabled over the cache: the fix comes first."""
    return RuntimeError(
        f"{who}: run the model under torch.no_grad() or torch.inference_mode() (generate() does): {what} requires "
        f"grad, and the cache stores K/V as 8-bit integer codes, which no gradient flows through ({why}). To take "
        "gradients, use transformers' DynamicCache, or use_cache=False"
    )


def file_to_read(path, who: str) -> str:
    """``path`` as a string, refused when it is a directory (naming the safetensors files inside)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        inside = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[:5]
        hint = f" (it holds {', '.join(inside)})" if inside else ""
        raise ValueError(f"{who} {path!r} is a directory{hint}; pass the path of the safetensors file itself")
    return path


def file_to_write(path, who: str, example: str = "calibration.safetensors") -> str:
    """``path`` as a string, refused when it is a directory or its folder does not exist."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{who}: {path!r} is a directory; pass a file path inside it, e.g. "
                                f"{os.path.join(path, example)!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{who}: cannot write {path!r}: its folder {folder!r} does not exist; create it "
                                "first (os.makedirs) or pass a path in an existing folder")
    return path


def cache_options(kwargs: dict, rotate, ring) -> None:
    """QuantizedCache's keyword arguments: no unknown one, ``rotate`` and ``ring`` of their types."""
    if kwargs:  # a misspelled option must not silently fall back to a default format
        raise TypeError(
            f"kvcompile.QuantizedCache got unexpected arguments {sorted(kwargs)}; it takes config, "
            "max_batch_size, max_cache_len, kv_dtype, device, k_dtype, v_dtype, rotate, granularity, "
            "calibration, v_layout, tp_size and ring"
        )
    if not any(rotate is r or (isinstance(r, str) and rotate == r) for r in (None, True, False, "k", "v")):
        raise TypeError(f"kvcompile.QuantizedCache: rotate must be None, True, False, 'k' or 'v', got {rotate!r}")
    if not isinstance(ring, bool):
        raise TypeError(f"kvcompile.QuantizedCache: ring must be True or False, got {ring!r}")


def max_cache_len(text_config, max_cache_len) -> int:
    """``max_cache_len``, or the config's ``max_position_embeddings`` when it is None."""
    if max_cache_len is None:
        max_cache_len = getattr(text_config, "max_position_embeddings", None)
        if max_cache_len is None:
            raise ValueError(
                "kvcompile.QuantizedCache: pass max_cache_len (prompt + generated tokens per sequence); the "
                "config has no max_position_embeddings to fall back on"
            )
    return positive_int("max_cache_len", max_cache_len)


def cache_head_dims(head_dims, k_fmt, v_fmt, rotated: bool, rotate) -> None:
    """Every layer's head dim suits both formats and, where a side is rotated, the rotation."""
    for head_dim in head_dims:
        k_fmt.check_head_dim(head_dim)
        v_fmt.check_head_dim(head_dim)
    if rotated and k_fmt.is_static:
        raise ValueError(
            f"kvcompile.QuantizedCache: rotate={rotate!r} with granularity='static': static scales are calibrated on "
            "unrotated K/V; use rotate=False (or a per-token format)"
        )
    if rotated:
        try:
            for head_dim in head_dims:
                rotation.check_head_dim(head_dim)
        except ValueError as e:
            how = f"rotate={rotate!r}" if rotate else f"{k_fmt.kv_dtype} rotates K by default"
            plain = next(s.name for s in formats.specs() if not s.rotate_k)
            raise ValueError(
                f"kvcompile.QuantizedCache: {how}, but {e}"
                + ("" if rotate else f" (or a format that is not rotated by default, e.g. kv_dtype={plain!r})")
            ) from None

"""What a calibration must be for a cache to use it: the model's shapes, finite values, static scales in a
plausible range for the model's dtype, and (where the calibration records it) the model it was taken from.

:class:`Calibration` is the dict of tensors :func:`kvcompile.calibrate` returns and
:func:`kvcompile.load_calibration` reads, with ``.model``: what identifies the model the statistics were
measured on (:func:`model_identity`). :func:`kvcompile.save_calibration` writes it into the file's
metadata (``model.<key>``), and loading a file (or a dict that carries it) into another model's cache is
refused, naming what differs (:func:`check_identity`). A plain dict, and a file saved before kvcompile
recorded the model, have no identity: only their shapes and values are checked.

Where the line is between another model and a fine-tune of this one: the architecture (model type and
config class) and every size the K/V statistics are laid out by or follow from (layers, kv heads, head
dim, query heads, hidden and intermediate sizes) must agree; the weights, the name, the vocabulary and the
RoPE settings are not compared. So a fine-tune (same architecture and shapes, new weights, maybe added
tokens or a longer RoPE base) takes its base model's calibration, and two models that differ only in their
weights cannot be told apart: the cache never sees the weights.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from .formats import FP8_E4M3_MAX
from .hf import per_layer_shapes, text_config

__all__ = ["CALIBRATION_KEYS", "Calibration", "MIN_AMAX", "amax_range", "check_identity", "model_identity",
           "validate"]

CALIBRATION_KEYS = ("k_scale", "v_scale", "k_offset")

# Smallest amax a calibrated scale is built from: an all-zero head (possible in toy models)
# still gets a positive, finite scale, and quantizes its zeros to exact zeros.
MIN_AMAX = 1e-6

# identity keys compared at load (a difference refuses the calibration); the others are recorded for messages
_COMPARED = ("model_type", "config_class", "num_layers", "num_kv_heads", "head_dim", "num_attention_heads",
             "hidden_size", "intermediate_size")


class Calibration(dict):
    """``{"k_scale", "v_scale", "k_offset"}`` tensors, and ``model``: the identity of the model they were
    measured on (``{}``: unknown)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] = (), model: Mapping[str, str] | None = None):
        super().__init__(tensors)
        self.model = dict(model or {})


def model_identity(config) -> dict[str, str]:
    """What identifies the model of ``config`` to a calibration (strings, as safetensors metadata holds them)."""
    text = text_config(config)
    shapes = {s for s in per_layer_shapes(config) if s is not None}
    kv_heads, head_dim = next(iter(shapes)) if len(shapes) == 1 else ("", "")
    architectures = getattr(config, "architectures", None) or []
    out = {
        "model_type": getattr(text, "model_type", "") or "", "config_class": type(text).__name__,
        "num_layers": len(per_layer_shapes(config)), "num_kv_heads": kv_heads, "head_dim": head_dim,
        "num_attention_heads": getattr(text, "num_attention_heads", ""), "hidden_size": getattr(text, "hidden_size", ""),
        "intermediate_size": getattr(text, "intermediate_size", ""),
        "name_or_path": getattr(config, "_name_or_path", "") or "", "architecture": ",".join(architectures),
    }
    return {k: str(v) for k, v in out.items()}


def _describe(identity: Mapping[str, str]) -> str:
    name = identity.get("name_or_path") or identity.get("architecture") or "a model"
    return (f"{name} ({identity.get('config_class', '?')}: {identity.get('num_layers', '?')} layers, "
            f"{identity.get('num_kv_heads', '?')} kv heads of head_dim {identity.get('head_dim', '?')}, hidden_size "
            f"{identity.get('hidden_size', '?')})")


def check_identity(recorded: Mapping[str, str], config, source: str) -> None:
    """Refuse a calibration whose recorded model (``recorded``, maybe empty) is not ``config``'s model or a
    fine-tune of it (module docstring), naming the keys that differ."""
    if not recorded:
        return
    here = model_identity(config)
    differ = [k for k in _COMPARED if recorded.get(k, "") and here[k] and recorded[k] != here[k]]
    if differ:
        what = ", ".join(f"{k} {recorded[k]} vs {here[k]}" for k in differ)
        raise ValueError(
            f"kvcompile calibration {source}: was taken from {_describe(recorded)}, and this model is "
            f"{_describe(here)} ({what}); calibrate this model (kvcompile.calibrate). A calibration serves the "
            "model it was measured on and its fine-tunes (same architecture and sizes)"
        )


def model_dtype(config) -> torch.dtype | None:
    """The floating dtype ``config`` says its model runs in (``config.dtype``), or None."""
    text = text_config(config)
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def amax_range(dtype: torch.dtype | None) -> tuple[float, float]:
    """The plausible range of ``amax = FP8_E4M3_MAX * scale`` for a model running in ``dtype`` (None: the
    widest, bf16's / fp32's), and the bound on ``|k_offset|`` (a mean of K: at most its amax).

    A static fp8 scale ``s`` stores ``|x|`` up to ``448 * s`` (e4m3's largest code) and rounds ``x / s`` to
    e4m3. Outside the range the cache would turn a working model's K/V into zeros without any sign (no value
    is non-finite):

    * low: :data:`MIN_AMAX` (1e-6), where :func:`kvcompile.calibrate` floors amax (a head whose K or V is all
      zero). Below it every value of a working model saturates to ``+-amax``: a scale of 1e-30 stores ~0.
    * high: the dtype's largest finite value (fp16: 65504; no fp16 model computes a larger K or V), and at
      most ``sqrt(float32 max)`` (1.8e19) for bf16 and fp32: attention multiplies K by queries of like
      magnitude and accumulates in float32, so a K element past it makes ``q . k`` overflow. Above it every
      value of a working model is under e4m3's smallest code, ``2**-9 * s``: a scale of 1e30 stores 0.
    """
    top = math.sqrt(torch.finfo(torch.float32).max)
    if dtype is not None:
        top = min(top, torch.finfo(dtype).max)
    return MIN_AMAX, top


def _check_values(name: str, t: torch.Tensor, dtype: torch.dtype | None, source: str) -> None:
    if not torch.isfinite(t).all():
        raise ValueError(f"kvcompile calibration {source}: {name} holds non-finite values; calibrate again")
    low, high = amax_range(dtype)
    of = f" for a {str(dtype).replace('torch.', '')} model" if dtype is not None else ""
    if name == "k_offset":
        worst = t.abs().max().item() if t.numel() else 0.0
        if worst > high:
            raise ValueError(f"kvcompile calibration {source}: k_offset holds {worst:.3g}, beyond any K{of} "
                             f"(|k_offset| <= {high:.3g}); calibrate again")
        return
    if not (t > 0).all():
        raise ValueError(f"kvcompile calibration {source}: {name} holds scales <= 0; calibrate again")
    # float32 rounds the calibrated floor MIN_AMAX / 448 by up to 2**-24: a margin of 2**-20 accepts it
    lo, hi = t.min().item(), t.max().item()
    too_small = lo * FP8_E4M3_MAX < low * (1 - 2**-20)
    if too_small or hi * FP8_E4M3_MAX > high:
        raise ValueError(
            f"kvcompile calibration {source}: {name} holds the scale {lo if too_small else hi:.3g}, outside the "
            f"plausible {low / FP8_E4M3_MAX:.3g}..{high / FP8_E4M3_MAX:.3g}{of} (fp8 scale = amax / "
            f"{FP8_E4M3_MAX:g}, amax from {low:g} to {high:.3g}): it would store this model's K/V as "
            + ("+-amax, every value saturated" if too_small else "zeros, every value below e4m3's smallest code")
            + "; calibrate again (kvcompile.calibrate)"
        )


def validate(calib: Mapping[str, torch.Tensor], num_layers: int, num_kv_heads: int, head_dim: int | None,
             source: str, dtype: torch.dtype | None = None) -> Calibration:
    """The calibration's tensors as float32 CPU tensors (and its identity), or ``ValueError`` naming the tensor
    and the fix: unknown or missing tensors, shapes other than the model's, non-finite values, scales outside
    :func:`amax_range` for ``dtype``. ``head_dim=None``: ``k_offset``'s own."""
    unknown = set(calib) - set(CALIBRATION_KEYS)
    if unknown:
        raise ValueError(f"kvcompile calibration {source}: unknown tensors {sorted(unknown)}; expected {CALIBRATION_KEYS}")
    if not calib:
        raise ValueError(f"kvcompile calibration {source}: holds none of {CALIBRATION_KEYS}")
    if ("k_scale" in calib) != ("v_scale" in calib):
        raise ValueError(f"kvcompile calibration {source}: has only one of k_scale / v_scale; re-run kvcompile.calibrate")
    out = Calibration(model=getattr(calib, "model", None))
    for name, t in calib.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"kvcompile calibration {source}: {name} is a {type(t).__name__}, not a tensor")
        if name == "k_offset" and head_dim is None and t.dim() == 3:
            head_dim = t.shape[2]
        want = (num_layers, num_kv_heads) if name != "k_offset" else (num_layers, num_kv_heads, head_dim)
        if tuple(t.shape) != want:
            raise ValueError(
                f"kvcompile calibration {source}: {name} has shape {tuple(t.shape)}, the model needs {want} "
                f"(layers, kv heads{', head_dim' if name == 'k_offset' else ''}): it was measured on a model of other "
                "shapes; calibrate this model again (kvcompile.calibrate)"
            )
        t = t.detach().to(torch.float32)
        _check_values(name, t, dtype, source)
        out[name] = t.cpu().contiguous()
    return out

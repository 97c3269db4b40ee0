"""Calibrated per-layer K/V statistics: static fp8 scales and K centering offsets.

The on-disk format is one safetensors file with up to three tensors (float32):

* ``k_scale``  ``[num_layers, Hkv]``      static fp8 scale of K (after centering), per layer and kv head
* ``v_scale``  ``[num_layers, Hkv]``      static fp8 scale of V
* ``k_offset`` ``[num_layers, Hkv, D]``   per-channel mean of K, subtracted before quantizing

Loading validates everything and fails closed: a missing layer, a wrong shape, a
non-finite value or a non-positive scale raises ``ValueError`` naming the tensor and the fix.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

__all__ = ["load_calibration", "save_calibration", "CALIBRATION_KEYS"]

CALIBRATION_KEYS = ("k_scale", "v_scale", "k_offset")


def _validate(calib: Mapping[str, torch.Tensor], num_layers: int, num_kv_heads: int, head_dim: int, source: str):
    unknown = set(calib) - set(CALIBRATION_KEYS)
    if unknown:
        raise ValueError(f"kvcompile calibration {source}: unknown tensors {sorted(unknown)}; expected {CALIBRATION_KEYS}")
    if not calib:
        raise ValueError(f"kvcompile calibration {source}: holds none of {CALIBRATION_KEYS}")
    if ("k_scale" in calib) != ("v_scale" in calib):
        raise ValueError(f"kvcompile calibration {source}: has only one of k_scale / v_scale; re-run kvcompile.calibrate")
    out = {}
    for name, t in calib.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"kvcompile calibration {source}: {name} is a {type(t).__name__}, not a tensor")
        want = (num_layers, num_kv_heads) if name != "k_offset" else (num_layers, num_kv_heads, head_dim)
        if tuple(t.shape) != want:
            raise ValueError(
                f"kvcompile calibration {source}: {name} has shape {tuple(t.shape)}, the model needs {want} "
                f"(layers, kv heads{', head_dim' if name == 'k_offset' else ''}); calibrate this model again"
            )
        t = t.detach().to(torch.float32)
        if not torch.isfinite(t).all():
            raise ValueError(f"kvcompile calibration {source}: {name} holds non-finite values; calibrate again")
        if name != "k_offset" and not (t > 0).all():
            raise ValueError(f"kvcompile calibration {source}: {name} holds scales <= 0; calibrate again")
        out[name] = t.cpu().contiguous()
    return out


def load_calibration(
    calibration: Mapping[str, torch.Tensor] | str | os.PathLike,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, torch.Tensor]:
    """Load (from a safetensors path or a dict) and validate calibrated scales/offsets."""
    if isinstance(calibration, (str, os.PathLike)):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        source = os.fspath(calibration)
        try:
            tensors = load_file(source)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"kvcompile calibration {source}: cannot be read as safetensors ({e})") from e
    else:
        source, tensors = "(dict)", dict(calibration)
    return _validate(tensors, num_layers, num_kv_heads, head_dim, source)


def save_calibration(calibration: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to(torch.float32).cpu().contiguous() for k, v in calibration.items()}, os.fspath(path))

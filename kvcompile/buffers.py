"""The V codes buffer of a cache layer and of a ring's scratch: ``[B, Hkv, L, D]``, plain or
key-contiguous (:func:`v_codes_buffer`). Imported by :mod:`kvcompile.cache_layer` and
:mod:`kvcompile.ring`; imports nothing of kvcompile."""

from __future__ import annotations

import torch

__all__ = ["v_codes_buffer"]


def v_codes_buffer(shape, dtype: torch.dtype, device, keys: bool) -> torch.Tensor:
    """Zeroed V codes ``[B, Hkv, L, D]``; ``keys=True``: key-contiguous, a view of a ``[B, Hkv, D, L16]``
    buffer (``L16`` = ``L`` rounded up to 16: the attention kernel reads whole 16-key chunks)."""
    B, H, L, D = shape
    if not keys:
        return torch.zeros((B, H, L, D), dtype=dtype, device=device)
    return torch.zeros((B, H, D, -(-L // 16) * 16), dtype=dtype, device=device).transpose(2, 3)[:, :, :L]

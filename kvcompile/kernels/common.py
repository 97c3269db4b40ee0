"""Small launcher helpers: device capability, interpreter detection, length arguments."""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _cuda_cc(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_cc(device: torch.device) -> tuple[int, int]:
    """Compute capability of ``device``; the interpreter (CPU tensors) counts as sm_90."""
    if device.type != "cuda":
        return (9, 0)
    return _cuda_cc(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def kv_len_arg(kv_len: Tensor, batch: int, device: torch.device) -> tuple[Tensor, int]:
    """``kv_len`` ([] or [B], any int dtype) -> (a device tensor to index by b, its stride). No host sync."""
    kvl = kv_len.to(device=device).reshape(-1)
    if kvl.numel() == 1:
        return kvl, 0
    if kvl.numel() != batch:
        raise ValueError(f"kvcompile: kv_len must be [] or [B={batch}], got shape {tuple(kv_len.shape)}")
    return kvl, kvl.stride(0)


@functools.lru_cache(maxsize=None)
def rot_scale(D: int) -> float:
    """1 / sqrt(D) rounded to float32 (the entries of kvcompile.rotation's matrix for a power-of-two D)."""
    return torch.tensor(D**-0.5, dtype=torch.float64).float().item()

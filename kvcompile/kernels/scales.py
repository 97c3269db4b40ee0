"""The scale layout of a call, read off its K and V scale tensors' shapes (:func:`scale_layout`,
:func:`scale_bytes`), and the kernel's ``SCALE_*`` mode constants. Part of the launch plan
(:mod:`kvcompile.kernels.plan` re-exports these names); imports nothing of kvcompile."""

from __future__ import annotations

from torch import Tensor

__all__ = ["SCALE_TOKEN", "SCALE_BLOCK", "SCALE_STATIC", "scale_layout", "scale_bytes"]

# the kernel's scale modes (tl.constexpr in _attention_kernel.py; equal by test_plan)
SCALE_TOKEN, SCALE_BLOCK, SCALE_STATIC = 0, 1, 2


def scale_layout(k_scale: Tensor, v_scale: Tensor, head_dim: int) -> tuple[int, int]:
    """(SCALE_* kind, values per scale) of a cache's K and V scale tensors (their shapes only: meta
    tensors do); K and V must share one granularity, and block scales must cover 16+ values."""

    def kind(s: Tensor) -> tuple[int, int]:
        if s.dim() == 1:
            return SCALE_STATIC, head_dim
        if s.shape[-1] == 1:
            return SCALE_TOKEN, head_dim
        return SCALE_BLOCK, head_dim // s.shape[-1]

    kk, vk = kind(k_scale), kind(v_scale)
    if kk[0] == SCALE_BLOCK and (kk[1] & (kk[1] - 1) or kk[1] < 16):
        raise ValueError(
            f"kvcompile.attention (triton): scale groups of {kk[1]} values (head_dim={head_dim}, "
            f"{k_scale.shape[-1]} groups) are not supported; use granularity 'token' or 'block32'"
        )
    if kk != vk:
        raise ValueError(
            "kvcompile.attention (triton): K and V scales must have one granularity, got "
            f"{tuple(k_scale.shape)} and {tuple(v_scale.shape)}"
        )
    return kk


def scale_bytes(scale: Tensor) -> int:
    """Bytes of scales the kernel loads per key (for K or for V): 0 for static scales."""
    return 0 if scale.dim() == 1 else scale.element_size() * scale.shape[-1]

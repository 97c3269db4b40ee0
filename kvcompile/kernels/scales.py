"""The scale layout of a call, from its K and V formats (:func:`scale_layout`, :func:`scale_bytes`),
and the kernel's ``SCALE_*`` mode constants: the formats' granularity ids
(:data:`kvcompile.formats.spec.GRANULARITY_IDS`). Part of the launch plan (:mod:`kvcompile.kernels.plan`
re-exports these names)."""

from __future__ import annotations

from ..formats import KVFormat
from ..formats.spec import GRANULARITY_IDS

__all__ = ["SCALE_TOKEN", "SCALE_BLOCK", "SCALE_STATIC", "scale_layout", "scale_bytes"]

# the kernel's scale modes (tl.constexpr in _attention_kernel.py; equal by test_plan)
SCALE_TOKEN, SCALE_BLOCK, SCALE_STATIC = (GRANULARITY_IDS[g] for g in ("token", "block32", "static"))


def scale_layout(k_fmt: KVFormat, v_fmt: KVFormat, head_dim: int) -> tuple[int, int]:
    """(SCALE_* kind, values per scale) of a cache's K and V formats; K and V must share one
    granularity, and block scales must cover 16+ values."""
    kk = (k_fmt.scale_mode, k_fmt.group_size(head_dim))
    vk = (v_fmt.scale_mode, v_fmt.group_size(head_dim))
    if kk[0] == SCALE_BLOCK and (kk[1] & (kk[1] - 1) or kk[1] < 16 or head_dim % kk[1]):
        raise ValueError(
            f"kvcompile.attention (triton): scale groups of {kk[1]} values (head_dim={head_dim}) are not "
            "supported; use granularity 'token' or 'block32'"
        )
    if kk != vk:
        raise ValueError(
            f"kvcompile.attention (triton): K and V scales must have one granularity, got {k_fmt.name} and {v_fmt.name}"
        )
    return kk


def scale_bytes(fmt: KVFormat, head_dim: int) -> int:
    """Bytes of scales the kernel loads per key (for K or for V): 0 for static scales."""
    return fmt.scale_bytes(head_dim)

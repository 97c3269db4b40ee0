"""Launcher: rows of a tensor times a rotation (``x @ R`` or ``x @ R^T``), one launch.

The attention launcher rotates q by K's rotation once per call with it (every split-K program of a
decode step would otherwise repeat the product and re-read R), and the dense path's output by V's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._rotation import _rotate_rows_kernel
from .common import interpreting, next_pow2

ROT_CHUNK = 32  # columns of R per dot: an fp32 R of D = 128 is 64 KiB, never held whole in registers


def rotate_rows(x: Tensor, rotation: Tensor, transpose: bool = False, dtype: torch.dtype = torch.float32) -> Tensor:
    """``x @ R`` (``x @ R^T`` with ``transpose``) over the last dim of ``x``, float32 accuracy, in ``dtype``."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    y = torch.empty(x2.shape, dtype=dtype, device=x.device)
    M = x2.shape[0]
    if M:
        block_m = 16 if M <= 256 else 64
        _rotate_rows_kernel[(-(-M // block_m),)](
            x2, *x2.stride(), rotation.contiguous(), y, *y.stride(), M, D,
            TRANSPOSE=transpose, X_PARTS=1 if x.dtype == torch.bfloat16 else 3, EXACT_FMA=interpreting(),
            BLOCK_M=block_m, BLOCK_D=next_pow2(D), RC=ROT_CHUNK, num_warps=4,
        )
    return y.view(x.shape)

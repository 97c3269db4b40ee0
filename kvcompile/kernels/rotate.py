"""Launcher: rows of one or two tensors times a rotation (``x @ R`` or ``x @ R^T``), one launch.

The attention launcher rotates q by K's rotation once per call (every split-K program of a decode
step would otherwise repeat the product and re-read R), and the dense path's output by V's; the
store rotates K and V together before quantizing them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._rotation import _rotate_rows_kernel
from .common import interpreting, next_pow2
from .plan import ROT_CHUNK  # output columns per program


def rotate_rows(x: Tensor, rotation: Tensor, transpose: bool = False, dtype: torch.dtype = torch.float32,
                x2: Optional[Tensor] = None, rotation2: Optional[Tensor] = None):
    """``x @ R`` (``x @ R^T`` with ``transpose``) over the last dim of ``x``, float32 accuracy, in
    ``dtype``. With ``x2`` (same shape and dtype as ``x``) and ``rotation2``: both in the same launch,
    returned as a pair."""
    D = x.shape[-1]
    ins = [x.reshape(-1, D)] + ([x2.reshape(-1, D)] if x2 is not None else [])
    rs = [rotation.contiguous()] + ([rotation2.contiguous()] if x2 is not None else [])
    outs = [torch.empty(t.shape, dtype=dtype, device=x.device) for t in ins]
    M = ins[0].shape[0]
    if M:
        a, b = ins[0], ins[-1]
        ya, yb = outs[0], outs[-1]
        block_m = 16 if M <= 1024 else 64
        grid = (-(-M // block_m), -(-D // ROT_CHUNK), len(ins))
        _rotate_rows_kernel[grid](
            a, *a.stride(), rs[0], ya, *ya.stride(), b, *b.stride(), rs[-1], yb, *yb.stride(), M, D,
            TRANSPOSE=transpose, X_PARTS=1 if x.dtype == torch.bfloat16 else 3, EXACT_FMA=interpreting(),
            BLOCK_M=block_m, BLOCK_D=next_pow2(D), RC=ROT_CHUNK, num_warps=4,
        )
    if x2 is not None:
        return outs[0].view(x.shape), outs[1].view(x2.shape)
    return outs[0].view(x.shape)

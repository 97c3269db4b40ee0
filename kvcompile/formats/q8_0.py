"""``q8_0``: GGUF's format, int8 codes with one float16 scale per 32 values along head_dim.

GGUF's ``quantize_row_q8_0_ref``: ``d = amax / 127`` (fp32), ``id = 1 / d`` (0 when d == 0),
``q = roundf(x * id)`` (half away from zero), and ``d`` stored as fp16. Dequantize is
``q * fp16(d)``, exactly what llama.cpp reads back. A block holding a NaN or an Inf gets a NaN scale
(its Inf codes +-127, its NaN codes 0). Kernels: ``CODE_Q8_0`` in ``kernels/_store_kernel.py``,
``CODE_Q8_0`` in ``native/attend.c``; its codes widen as int8's.
"""

from __future__ import annotations

import torch

from ._math import nan_marked, roundf
from .spec import FormatSpec, register

Q8_0_MAX = 127.0  # GGUF q8_0: d = amax / 127


def encode(y: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(roundf(y.clamp(-Q8_0_MAX, Q8_0_MAX)), nan=0.0).to(torch.int8)


def quantize_groups(xg: torch.Tensor, amax: torch.Tensor, special: bool, cpu: bool):
    # a tensor divisor on every device (formats._math.divide)
    d = amax / torch.full_like(amax, Q8_0_MAX)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    y = xg * inv  # x * (1/d), as GGUF computes it (not x / d: the two round differently)
    s = d
    if special:  # a block holding a NaN or an Inf: a NaN scale (its Inf codes +-127, its NaN codes 0)
        y = torch.where(torch.isinf(xg), torch.sign(xg) * Q8_0_MAX, y)
        s = nan_marked(xg, d)
    return encode(y.flatten(-2)), s.to(torch.float16)


SPEC = register(FormatSpec(
    name="q8_0", id=1, code_dtype=torch.int8, scale_dtype=torch.float16, qmax=Q8_0_MAX,
    granularities=("block32",), rotate_k=False, quantize_groups=quantize_groups, aliases=("q8",),
    defined_as="one fp16 scale per 32 values (granularity='block32')",
    hint="use kv_dtype='fp8_e4m3' for other granularities",
))

"""``fp8_e4m3``: float8_e4m3fn codes with float32 scales, per token, per 32 values or static.

``s = amax / 448``; ``code = e4m3_rne(clamp(x / s, -448, 448))``. An all-zero group stores
``s = 0`` and codes 0, so it dequantizes to exact zeros. A NaN or +-Inf is stored as e4m3's NaN code
(also in a group whose scale is 0) and its group's scale is NaN; with static scales the code is the
only marker. Kernels: e4m3 encode / widen in ``kernels/_codes.py`` (``CODE_FP8`` in the store kernel),
``codes_to_f32`` / ``quantize_group`` in ``native/attend.c``.
"""

from __future__ import annotations

import torch

from ._math import divide, e4m3_nan, nan_marked
from .spec import FormatSpec, register

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def encode(y: torch.Tensor) -> torch.Tensor:
    # clamp keeps NaN (e4m3fn has a NaN code) and saturates ±Inf; the cast rounds to nearest even.
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_groups(xg: torch.Tensor, amax: torch.Tensor, special: bool, cpu: bool):
    s = divide(amax, FP8_E4M3_MAX, cpu)  # true division (as int8)
    y = torch.where(s > 0, xg / s, torch.zeros_like(xg))  # +0 where s == 0 (e4m3 has a -0 code)
    if special:  # a NaN or an Inf: e4m3's NaN code, and the group's scale is NaN (the policy)
        y = e4m3_nan(xg, y)
        s = nan_marked(xg, s)
    return encode(y.flatten(-2)), s


def quantize_static(xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.float().view(1, -1, 1, 1)
    with torch.no_grad():
        y = torch.where(s > 0, xf / s, torch.zeros_like(xf))
        # a NaN stays NaN even where s == 0, and an Inf becomes NaN (e4m3 has no Inf): only finite values saturate
        y = e4m3_nan(xf, y)
    return encode(y)


SPEC = register(FormatSpec(
    name="fp8_e4m3", id=0, code_dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, qmax=FP8_E4M3_MAX,
    granularities=("token", "block32", "static"), rotate_k=False,
    quantize_groups=quantize_groups, quantize_static=quantize_static,
    aliases=("fp8", "e4m3", "float8", "float8_e4m3fn", "fp8_e4m3fn"),
))

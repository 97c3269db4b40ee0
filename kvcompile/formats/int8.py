"""``int8``: int8 codes with one float32 scale per token and kv head (the default format).

``s = amax / 127`` (fp32, true division); ``code = round_half_even(x / s)`` (true division, as fp8)
saturated to ``[-127, 127]`` (-128 is never written, so the codes are symmetric). An all-zero token
stores ``s = 0`` and codes 0. Same bytes as fp8 per token, but uniform steps of ``amax / 127``
instead of e4m3's 3-bit mantissa. A few outlier channels set a token's amax and leave the others few
steps, so the cache rotates int8's K by default (:mod:`kvcompile.rotation`), which spreads them: on
SmolLM2-135M that takes the KL of the next-token distribution from 0.87e-3 (unrotated) to 0.24e-3
(0.23e-3 with V rotated too), below q8_0's 0.40e-3 (QUALITY.md). int8 has no NaN code: a NaN is
stored as 0 and ±Inf as ±127, and the token's scale is NaN. Kernels: ``CODE_INT8`` in
``kernels/_store_kernel.py``, ``CODE_INT8`` in ``native/attend.c``; its codes widen in
``kernels/_codes.py`` (``codes_to``).
"""

from __future__ import annotations

import torch

from ._math import divide, nan_marked
from .spec import FormatSpec, register

INT8_MAX = 127.0  # int8: s = amax / 127, codes in [-127, 127]


def quantize_groups(xg: torch.Tensor, amax: torch.Tensor, special: bool, cpu: bool):
    s = divide(amax, INT8_MAX, cpu)
    # x / s, true division, as fp8; s == 0 (a group of zeros, or of values so small that amax / 127
    # underflows): x / 1, which rounds to 0 (int8 has no -0)
    y = xg / torch.where(s > 0, s, 1.0)
    if special:
        y = torch.where(torch.isinf(xg), torch.sign(xg) * INT8_MAX, y)  # also where s == 0
        y = torch.nan_to_num(y, nan=0.0)  # int8 has no NaN code: 0 there, and the token's scale is NaN
        s = nan_marked(xg, s)
    # round half to even, saturate (in place: y is this function's own)
    return y.clamp_(-INT8_MAX, INT8_MAX).round_().flatten(-2).to(torch.int8), s


SPEC = register(FormatSpec(
    name="int8", id=2, code_dtype=torch.int8, scale_dtype=torch.float32, qmax=INT8_MAX,
    granularities=("token",), rotate_k=True, quantize_groups=quantize_groups, aliases=("int8_t",),
    defined_as="one fp32 scale per token and kv head (granularity='token')",
    hint=("static and block32 int8 scales are not implemented; use kv_dtype='fp8_e4m3' for static scales or "
          "kv_dtype='q8_0' for block32"),
))

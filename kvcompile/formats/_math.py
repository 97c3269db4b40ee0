"""Reference math the format specs share (pure torch): grouping, the finite group maxima, the NaN
markers of the non-finite policy, rounding, and the one dequantize every format reads back by."""

from __future__ import annotations

import math

import torch

_E4M3_TABLE: dict = {}


def group_view(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., D] -> [..., G, D/G]."""
    return x.unflatten(-1, (groups, x.shape[-1] // groups))


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: round half away from zero (torch.round is half to even).

    Not ``floor(|x| + 0.5)``: that addition rounds in fp32, so 0.49999997 + 0.5 becomes 1.0 and
    rounds up. ``|x| - floor(|x|)`` is exact, so this matches roundf (and gguf's np_roundf) exactly.
    """
    a = x.abs()
    f = torch.floor(a)
    return torch.sign(x) * (f + torch.floor(2.0 * (a - f)))


def finite_amax(xg: torch.Tensor, cpu: bool) -> tuple[torch.Tensor, bool]:
    """(the group maxima of |x| over finite values [..., G, 1], whether any value may be NaN / Inf).

    With no NaN / Inf anywhere the special-value steps change nothing and are skipped (a host read,
    so on the CPU only, where it is free; the values are the same either way). amax propagates NaN
    and Inf, so the group maxima show whether there is any."""
    special = True
    if cpu:
        amax = xg.abs().amax(dim=-1, keepdim=True)
        special = not math.isfinite(float(amax.max()))
    if special:
        amax = torch.where(torch.isfinite(xg), xg.abs(), torch.zeros_like(xg)).amax(dim=-1, keepdim=True)
    return amax, special


def divide(amax: torch.Tensor, qmax: float, cpu: bool) -> torch.Tensor:
    """``amax / qmax``, true division on every device: CUDA torch turns ``t / python_scalar`` into
    ``t * (1/scalar)``, which rounds differently from the true division the kernels do; the CPU
    divides by a Python scalar truly."""
    return amax / qmax if cpu else amax / torch.full_like(amax, qmax)


def nan_marked(xg: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The group scales with a NaN where the group holds a NaN or an Inf (no format holds either)."""
    return torch.where(torch.isfinite(xg).all(dim=-1, keepdim=True), s, torch.full_like(s, float("nan")))


def e4m3_nan(xf: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` with e4m3's NaN where ``xf`` is NaN or +-Inf (e4m3 has no Inf): only finite values saturate."""
    return torch.where(torch.isnan(xf), xf, torch.where(torch.isinf(xf), torch.full_like(xf, float("nan")), y))


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as float32, the values ``codes.float()`` gives. On the CPU, where that conversion
    runs one code at a time (~55 us for SmolLM2's 19k decode codes against ~25 for a gather), the
    values are looked up in the 256-entry table of that same conversion."""
    if codes.device.type != "cpu":
        return codes.float()
    table = _E4M3_TABLE.get("cpu")
    if table is None:
        table = _E4M3_TABLE["cpu"] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(
            torch.float8_e4m3fn).float()
    index = codes.view(torch.uint8).to(torch.int64)
    return torch.gather(table.expand(*codes.shape[:-1], 256), -1, index)  # the codes' shape, no flat copy


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [B, H, L, D] with scales [B, H, L, G] or static [H] -> values [B, H, L, D] in ``dtype``:
    code times scale for every format (the tensors' layout only decides how the scales broadcast)."""
    # int8 codes times fp32 scales promote to fp32 in one kernel, the same products (the codes are
    # exact in fp32); fp8 codes do not promote, so they are converted first
    c = codes if codes.dtype == torch.int8 else e4m3_to_float(codes)
    s = scale if scale.dtype == torch.float32 else scale.float()
    if scale.dim() == 1:
        out = c * s.view(1, -1, 1, 1)
    elif scale.shape[-1] == 1:  # one scale per token broadcasts as it is (4-D: half the grouped path's cost)
        out = c * s
    else:
        out = (group_view(c, scale.shape[-1]) * s.unsqueeze(-1)).flatten(-2)
    return out if out.dtype == dtype else out.to(dtype)

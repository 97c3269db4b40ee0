"""KV-cache formats: what an 8-bit cache stores, as data, and the pure-torch reference math.

Each format is one file of this package holding its :class:`FormatSpec` (:mod:`.fp8_e4m3`,
:mod:`.q8_0`, :mod:`.int8`: name, integer id, code and scale dtypes, qmax, the granularities it
admits and its default, whether K is rotated by default, its reference quantization). The cache
builds a :class:`KVFormat` (a spec at one granularity) from the user's spellings (:func:`resolve`);
below the cache the format travels as :attr:`KVFormat.id` (the ops' ``k_format`` / ``v_format``,
the kernels' ``CODE`` / ``SCALE_*`` constexprs, the C path's ``CODE_*``: :mod:`.spec`), never
inferred from a tensor's dtype or shape.

Scale granularities: ``"token"`` ``[B, Hkv, L, 1]`` (one scale per token and kv head), ``"block32"``
``[B, Hkv, L, D // 32]`` (one per 32 values along head_dim), ``"static"`` ``[Hkv]`` (one calibrated
scale per kv head). Rounding is bit-exact between this reference and every kernel (each spec's
docstring says how it rounds).

Non-finite inputs (a policy, tested; README "Non-finite values"): no format holds an infinity,
and none turns a non-finite value into a finite one. The scale is computed from the finite values
of the group only; a group (a token, or a block of 32 values) that holds a ``NaN`` or ``±Inf`` gets
a NaN scale and dequantizes to NaN as a whole (each spec says what its codes hold there; fp8 marks
the scale too because attention's masked key tiles cannot tell a stored NaN code from the bytes
past a row's length at no cost: ``kernels/_attention_kernel.py``). Attention over a marker gives
NaN where attention over a bf16 cache gives NaN or ±Inf. Finite values never become NaN: ones past
the range (a static scale) saturate to the largest code.

Optional K centering: a per-(kv head, channel) offset ``mu`` of shape ``[Hkv, D]`` is
subtracted from K before quantizing and added back by ``dequantize``. Attention never
needs it back: every key of one query shifts its score by the same ``q . mu``, which
softmax ignores, so the fused kernels read the centered codes as they are.

Optional rotation (:mod:`kvcompile.rotation`): a cache may store ``quantize(x @ R - mu)`` with
``R`` an orthonormal ``[D, D]`` matrix; the offset ``mu`` then lives in rotated space, and the
ops undo the rotation on dequantize. The formats themselves never see ``R``.
"""

from __future__ import annotations

import typing

import torch

from . import fp8_e4m3, q8_0, int8  # noqa: F401  (registration order: ids 0, 1, 2)
from ._math import _E4M3_TABLE, dequantize, e4m3_to_float as _e4m3_to_float, finite_amax, group_view, roundf as _roundf
from .fp8_e4m3 import FP8_E4M3_MAX
from .int8 import INT8_MAX
from .q8_0 import Q8_0_MAX
from .spec import BLOCK, GRANULARITIES, FormatSpec, KVFormat, check_name, from_id, spec, specs

__all__ = [
    "KV_DTYPES", "DEFAULT_KV_DTYPE", "SCALE_GRANULARITIES", "FormatSpec", "KVFormat", "Resolved", "spec", "specs",
    "from_id", "get_format", "format_of", "resolve", "resolve_kv_dtypes", "check_pair", "quantize", "dequantize",
    "FP8_E4M3_MAX", "Q8_0_MAX", "INT8_MAX", "BLOCK",
]

KV_DTYPES: tuple[str, ...] = tuple(s.name for s in specs())
# The format QuantizedCache, kvcompile.backend and the examples use when none is given: int8,
# K Hadamard-rotated (QuantizedCache's rotate=None rotates int8's K). On SmolLM2-135M (fp32, 2048
# tokens of pydoc_data.topics, no calibration; examples/perplexity.py) it is the one 8-bit format that
# meets kvcompile's quality targets: KL 0.24e-3 (target <= 0.3e-3; q8_0 0.40e-3, fp8_e4m3 9.5e-3),
# top-1 agreement 99.22% (>= 98.5%), median free-running greedy agreement over 24 prompts 128 of
# 128 tokens (q8_0: 123; bf16 K/V: 128), with fp8's storage (one byte per value plus one fp32
# scale per token and kv head) and its scale outside the dot product.
DEFAULT_KV_DTYPE = int8.SPEC.name
SCALE_GRANULARITIES = GRANULARITIES


def get_format(kv_dtype: str, granularity: str | None = None) -> KVFormat:
    """The format for a user-facing ``kv_dtype`` at ``granularity`` (default: the spec's own)."""
    return KVFormat(kv_dtype, spec(kv_dtype).default_granularity if granularity is None else granularity)


def resolve_kv_dtypes(
    kv_dtype: str | None = None, k_dtype: str | None = None, v_dtype: str | None = None
) -> tuple[str, str]:
    """``(k_dtype, v_dtype)`` from the user's keywords: ``kv_dtype`` sets both, ``k_dtype`` /
    ``v_dtype`` override one side, :data:`DEFAULT_KV_DTYPE` fills what is left.

    Refuses unknown names (listing the accepted ones) and the pairs no granularity serves (the
    attention kernel reads K and V with one scale granularity; see also :func:`check_pair`).
    """
    for what, name in (("kv_dtype", kv_dtype), ("k_dtype", k_dtype), ("v_dtype", v_dtype)):
        if name is not None:
            check_name(name, what)
    base = kv_dtype if kv_dtype is not None else DEFAULT_KV_DTYPE
    k = k_dtype if k_dtype is not None else base
    v = v_dtype if v_dtype is not None else base
    ks, vs = spec(k), spec(v)
    if not set(ks.granularities) & set(vs.granularities):
        shared = [s.name for s in specs() if set(s.granularities) & set(ks.granularities)
                  and set(s.granularities) & set(vs.granularities)]
        raise ValueError(
            f"k_dtype={k!r} with v_dtype={v!r}: {k} keeps scales at granularity {'/'.join(ks.granularities)}, {v} at "
            f"{'/'.join(vs.granularities)}, and the attention kernel reads K and V with one scale granularity"
            + (f"; pair either with {' or '.join(map(repr, shared))} at a granularity both admit" if shared else "")
        )
    return k, v


def check_pair(k_fmt: KVFormat, v_fmt: KVFormat) -> None:
    """Refuse a K/V format pair the attention kernel cannot read: K and V need one scale granularity."""
    if k_fmt.granularity != v_fmt.granularity:
        raise ValueError(
            f"K as {k_fmt.kv_dtype}/{k_fmt.granularity} with V as {v_fmt.kv_dtype}/{v_fmt.granularity}: the "
            "attention kernel reads K and V with one scale granularity; pick formats that share one ("
            + "; ".join(f"{g}: {', '.join(s.name for s in specs() if g in s.granularities)}" for g in GRANULARITIES)
            + ")"
        )


class Resolved(typing.NamedTuple):
    k_fmt: KVFormat
    v_fmt: KVFormat
    k_rotate: bool
    v_rotate: bool


def resolve(kv_dtype: str | None = None, k_dtype: str | None = None, v_dtype: str | None = None,
            granularity: str | None = None, rotate=None) -> Resolved:
    """The K and V formats and rotations of the user's spellings, the pair checked: ``kv_dtype`` /
    ``k_dtype`` / ``v_dtype`` as :func:`resolve_kv_dtypes`, ``granularity`` (default: each spec's),
    ``rotate`` None (each spec's default for K, V unrotated), True, False, ``"k"`` or ``"v"``."""
    k_name, v_name = resolve_kv_dtypes(kv_dtype, k_dtype, v_dtype)
    k_fmt, v_fmt = get_format(k_name, granularity), get_format(v_name, granularity)
    check_pair(k_fmt, v_fmt)
    if rotate is None:
        return Resolved(k_fmt, v_fmt, k_fmt.spec.rotate_k, False)
    return Resolved(k_fmt, v_fmt, rotate in (True, "k"), rotate in (True, "v"))


def format_of(codes: torch.Tensor, scale: torch.Tensor) -> str:
    """The ``kv_dtype`` a stored ``(codes, scale)`` pair can be read as, for a user inspecting tensors:
    the registered spec whose code and scale dtypes they have (per-token scales for a float32
    ``[B, Hkv, L, 1]``). kvcompile itself never asks: the cache's :class:`KVFormat` travels as its id.
    Anything else raises ``ValueError`` naming what was found."""
    # the granularities a scale of this shape may hold (one group of 32 values is a token's scale too)
    fits = {"static"} if scale.dim() == 1 else {"token", "block32"} if scale.shape[-1] == 1 else {"block32"}
    for s in specs():
        if codes.dtype == s.code_dtype and scale.dtype == s.scale_dtype and fits & set(s.granularities):
            return s.name
    raise ValueError(
        f"{codes.dtype} codes with {scale.dtype} scales of shape {tuple(scale.shape)} are no kvcompile format ("
        + "; ".join(f"{s.name}: {s.code_dtype} codes, {s.scale_dtype} scales" for s in specs()) + ")")


def of_tensors(codes: torch.Tensor, scale: torch.Tensor) -> KVFormat:
    """The :class:`KVFormat` a stored ``(codes, scale)`` pair can be read as (:func:`format_of` plus the
    granularity of the scale's shape), for a user, benchmark or test inspecting tensors it built by
    hand. kvcompile itself never asks: its ops take the format's id and refuse a call without one."""
    if all(codes.dtype != s.code_dtype for s in specs()):
        raise TypeError(f"kvcompile: codes must be {' or '.join(sorted({str(s.code_dtype)[6:] for s in specs()}))}, "
                        f"got {codes.dtype}")
    name = format_of(codes, scale)
    if scale.dim() == 1:
        return get_format(name, "static")
    return get_format(name, "token" if scale.shape[-1] == 1 and "token" in spec(name).granularities else "block32")


def quantize(
    x: torch.Tensor,
    code_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    groups: int = 1,
    *,
    kv_dtype: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [B, H, T, D] -> (codes [B, H, T, D], scales [B, H, T, G]).

    With ``scale`` given ([H], static), ``x / scale`` is rounded and saturated; the returned scale
    is that same tensor. Otherwise the scale is computed per group of ``D // groups`` values.

    ``kv_dtype`` names the format (default: the first registered spec with ``code_dtype`` codes,
    i.e. fp8_e4m3 for e4m3 codes and q8_0 for int8 ones); ``groups`` must suit its granularities.
    """
    if kv_dtype is None:
        kv_dtype = next(s.name for s in specs() if s.code_dtype == code_dtype)
    s = spec(kv_dtype)
    if s.code_dtype != code_dtype:
        raise ValueError(f"kvcompile.formats.quantize: {kv_dtype} codes are not {code_dtype}")
    xf = x.float()
    if scale is not None:  # static per-kv-head scale
        if s.quantize_static is None:
            static = [o.name for o in specs() if o.quantize_static is not None]
            raise ValueError(f"kvcompile.formats.quantize: {kv_dtype} has no static scales ({', '.join(static)} only)")
        return s.quantize_static(xf, scale), scale
    if "block32" not in s.granularities and groups != 1:
        raise ValueError(f"kvcompile.formats.quantize: {kv_dtype} keeps one scale per token (groups=1), "
                         f"got groups={groups}")
    cpu = xf.device.type == "cpu"
    xg = group_view(xf, groups)  # [B, H, T, G, D/G]
    amax, special = finite_amax(xg, cpu)
    codes, sc = s.quantize_groups(xg, amax, special, cpu)
    return codes, sc.squeeze(-1)

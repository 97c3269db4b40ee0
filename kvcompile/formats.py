"""KV-cache formats: what an 8-bit cache stores, and the pure-torch reference math.

A format is described by three facts, all of which can be read back off the tensors
it produces (so ops and kernels need no format string):

* the code type of the data tensor: ``torch.float8_e4m3fn`` or ``torch.int8``;
* the scale granularity, read off the scale tensor's shape:
    - ``[B, Hkv, L, 1]``        one scale per (token, kv head)            ("token")
    - ``[B, Hkv, L, D // 32]``  one scale per 32 values along head_dim    ("block32")
    - ``[Hkv]``                 one static, calibrated scale per kv head  ("static")
* the scale dtype: float32 for fp8 and int8 (the scale must not add error of its own),
  float16 for q8_0 (GGUF stores ``d`` as fp16). int8 codes with fp16 scales are q8_0, int8
  codes with float32 per-token scales are ``int8`` (:func:`format_of`).

Rounding (bit-exact between this reference and every kernel):

* ``fp8_e4m3``: ``s = amax / 448``; ``code = e4m3_rne(clamp(x / s, -448, 448))``.
  An all-zero group stores ``s = 0`` and codes 0, so it dequantizes to exact zeros.
* ``q8_0``: GGUF's ``quantize_row_q8_0_ref``: ``d = amax / 127`` (fp32),
  ``id = 1 / d`` (0 when d == 0), ``q = roundf(x * id)`` (half away from zero), and ``d``
  stored as fp16. Dequantize is ``q * fp16(d)``, exactly what llama.cpp reads back.
* ``int8``: one float32 scale per token and kv head, ``s = amax / 127`` (fp32, true division);
  ``code = round_half_even(x / s)`` (true division, as fp8) saturated to ``[-127, 127]`` (-128 is
  never written, so the codes are symmetric). An all-zero token stores ``s = 0`` and codes 0.
  Same bytes as fp8 per token (one byte per value + 4 bytes per token and head), but uniform
  steps of ``amax / 127`` instead of e4m3's 3-bit mantissa. A few outlier channels set a token's
  amax and leave the others few steps, so the cache rotates int8's K by default
  (:mod:`kvcompile.rotation`), which spreads them: on SmolLM2-135M that takes the KL of the
  next-token distribution from 0.87e-3 (unrotated) to 0.24e-3 (0.23e-3 with V rotated too),
  below q8_0's 0.40e-3 (QUALITY.md).

Non-finite inputs (a policy, tested; README "Non-finite values"): no format holds an infinity,
and none turns a non-finite value into a finite one. The scale is computed from the finite values
of the group only; a ``NaN`` or ``±Inf`` is stored as a NaN marker: the group (a token, or a block
of 32 values) that holds one gets a NaN scale, and dequantizes to NaN as a whole. Its codes: fp8
stores e4m3's NaN code for that element (the other elements keep their codes; with static scales
the code is the only marker); int8 codes have no NaN: 0 for a NaN, ±127 for ±Inf, the usual codes
elsewhere. (fp8 marks the scale too because attention's masked key tiles cannot tell a stored NaN
code from the bytes past a row's length at no cost: ``kernels/_attention_kernel.py``.) Attention
over a marker gives NaN where attention over a bf16 cache gives NaN or ±Inf. Finite values never
become NaN: ones past the range (a static scale) saturate to the largest code.

Optional K centering: a per-(kv head, channel) offset ``mu`` of shape ``[Hkv, D]`` is
subtracted from K before quantizing and added back by ``dequantize``. Attention never
needs it back: every key of one query shifts its score by the same ``q . mu``, which
softmax ignores, so the fused kernels read the centered codes as they are.

Optional rotation (:mod:`kvcompile.rotation`): a cache may store ``quantize(x @ R - mu)`` with
``R`` an orthonormal ``[D, D]`` matrix; the offset ``mu`` then lives in rotated space, and the
ops undo the rotation on dequantize. The formats themselves never see ``R``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = [
    "KV_DTYPES",
    "DEFAULT_KV_DTYPE",
    "SCALE_GRANULARITIES",
    "KVFormat",
    "get_format",
    "format_of",
    "resolve_kv_dtypes",
    "check_pair",
    "quantize",
    "dequantize",
    "FP8_E4M3_MAX",
    "Q8_0_MAX",
    "INT8_MAX",
    "BLOCK",
]

KV_DTYPES: tuple[str, ...] = ("fp8_e4m3", "q8_0", "int8")
# The format QuantizedCache, kvcompile.backend and the examples use when none is given: int8,
# K Hadamard-rotated (QuantizedCache's rotate=None rotates int8's K). On SmolLM2-135M (fp32, 2048
# tokens of pydoc_data.topics, no calibration; examples/perplexity.py) it is the one 8-bit format that
# meets kvcompile's quality targets: KL 0.24e-3 (target <= 0.3e-3; q8_0 0.40e-3, fp8_e4m3 9.5e-3),
# top-1 agreement 99.22% (>= 98.5%), median free-running greedy agreement over 24 prompts 128 of
# 128 tokens (q8_0: 123; bf16 K/V: 128), with fp8's storage (one byte per value plus one fp32
# scale per token and kv head) and its scale outside the dot product.
DEFAULT_KV_DTYPE = "int8"
SCALE_GRANULARITIES: tuple[str, ...] = ("token", "block32", "static")

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
Q8_0_MAX = 127.0  # GGUF q8_0: d = amax / 127
INT8_MAX = 127.0  # int8: s = amax / 127, codes in [-127, 127]
BLOCK = 32  # GGUF / "block32" group size along head_dim


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """One cache format: code type plus scale granularity.

    ``kv_dtype`` is the user-facing name (``"fp8_e4m3"``, ``"q8_0"`` or ``"int8"``), ``granularity``
    one of ``"token"``, ``"block32"``, ``"static"`` (fp8 takes all three; q8_0 is block32 only,
    int8 token only).
    """

    kv_dtype: str
    granularity: str

    def __post_init__(self):
        _check_name(self.kv_dtype)
        if self.granularity not in SCALE_GRANULARITIES:
            raise ValueError(
                f"unknown scale granularity {self.granularity!r}; use one of {list(SCALE_GRANULARITIES)}"
            )
        if self.kv_dtype == "q8_0" and self.granularity != "block32":
            raise ValueError(
                f"q8_0 is defined with one fp16 scale per 32 values (granularity='block32'), "
                f"got granularity={self.granularity!r}; use kv_dtype='fp8_e4m3' for other granularities"
            )
        if self.kv_dtype == "int8" and self.granularity != "token":
            raise ValueError(
                f"int8 is defined with one fp32 scale per token and kv head (granularity='token'), got "
                f"granularity={self.granularity!r}: static and block32 int8 scales are not implemented; use "
                f"kv_dtype='fp8_e4m3' for static scales or kv_dtype='q8_0' for block32"
            )

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_dtype == "fp8_e4m3" else torch.int8

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float16 if self.kv_dtype == "q8_0" else torch.float32

    @property
    def qmax(self) -> float:
        return FP8_E4M3_MAX if self.kv_dtype == "fp8_e4m3" else INT8_MAX

    @property
    def is_static(self) -> bool:
        return self.granularity == "static"

    @property
    def name(self) -> str:
        if self.kv_dtype != "fp8_e4m3" or self.granularity == "token":
            return self.kv_dtype
        return f"{self.kv_dtype}/{self.granularity}"

    @property
    def v_keys_contiguous(self) -> bool:
        """Whether a cache of this format on a GPU stores V key-contiguous by default (``[B, Hkv, D, L]``
        in memory, seen as ``[B, Hkv, L, D]``). A cache on the CPU stores V head_dim-contiguous
        (``cache_layer.QuantizedLayer``'s ``v_layout``).

        The attention kernels reduce V over keys (``P @ V``): stored key-contiguous, an 8-bit V tile
        feeds the dot like K does, with no transpose, and the decode tile fits three programs per
        SM instead of two (nothing staged for a transpose). Measured on the H200 (bench_kv.py, docs/perf-log.md):
        token scales decode 1.09-1.10x faster that way (7d3664b), static scales 1.09-1.11x (2da443f); q8_0
        and fp8/block32 (scales along head_dim, applied to the tile) run slower, so those keep V
        head_dim-contiguous.
        """
        return self.granularity in ("token", "static")

    def check_head_dim(self, head_dim: int) -> None:
        if self.granularity == "block32" and head_dim % BLOCK != 0:
            raise ValueError(
                f"{self.name} keeps one scale per {BLOCK} values along head_dim, but head_dim={head_dim} "
                f"is not a multiple of {BLOCK}; use kv_dtype='fp8_e4m3' with granularity='token'"
            )

    def groups(self, head_dim: int) -> int:
        """Scales per (token, kv head): 1 for "token", head_dim/32 for "block32", 0 for "static"."""
        self.check_head_dim(head_dim)
        if self.granularity == "token":
            return 1
        if self.granularity == "block32":
            return head_dim // BLOCK
        return 0

    def scale_shape(self, batch: int, kv_heads: int, max_len: int, head_dim: int) -> tuple[int, ...]:
        if self.is_static:
            return (kv_heads,)
        return (batch, kv_heads, max_len, self.groups(head_dim))

    def bytes_per_element(self, head_dim: int) -> float:
        """Bytes per cached K or V element, scales included (static scales: amortized to 0)."""
        g = self.groups(head_dim)
        scale_bytes = torch.empty((), dtype=self.scale_dtype).element_size()
        return 1.0 + g * scale_bytes / head_dim


# names people write for a format (torch's, llama.cpp's, another case): the error suggests the format
_ALIASES = {"fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "float8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
            "fp8_e4m3fn": "fp8_e4m3", "q8": "q8_0", "int8_t": "int8"}


def _check_name(kv_dtype, what: str = "kv_dtype") -> None:
    if kv_dtype not in KV_DTYPES:
        key = str(kv_dtype).lower().replace("torch.", "")
        close = key if key in KV_DTYPES else _ALIASES.get(key)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ValueError(f"unknown {what} {kv_dtype!r}{hint}; kvcompile accepts one of {list(KV_DTYPES)}")


def get_format(kv_dtype: str, granularity: str | None = None) -> KVFormat:
    """The format for a user-facing ``kv_dtype`` (default granularity: token for fp8 and int8,
    block32 for q8_0)."""
    _check_name(kv_dtype)
    if granularity is None:
        granularity = "block32" if kv_dtype == "q8_0" else "token"
    return KVFormat(kv_dtype, granularity)


def resolve_kv_dtypes(
    kv_dtype: str | None = None, k_dtype: str | None = None, v_dtype: str | None = None
) -> tuple[str, str]:
    """``(k_dtype, v_dtype)`` from the user's keywords: ``kv_dtype`` sets both, ``k_dtype`` /
    ``v_dtype`` override one side, :data:`DEFAULT_KV_DTYPE` fills what is left.

    Refuses unknown names (listing the accepted ones) and the pairs no granularity serves: q8_0
    keeps block32 scales and int8 per-token ones, and the attention kernel reads K and V with one
    scale granularity. (q8_0 with fp8 depends on fp8's granularity: see :func:`check_pair`.)
    """
    for what, name in (("kv_dtype", kv_dtype), ("k_dtype", k_dtype), ("v_dtype", v_dtype)):
        if name is not None:
            _check_name(name, what)
    base = kv_dtype if kv_dtype is not None else DEFAULT_KV_DTYPE
    k = k_dtype if k_dtype is not None else base
    v = v_dtype if v_dtype is not None else base
    if {k, v} == {"q8_0", "int8"}:
        raise ValueError(
            f"k_dtype={k!r} with v_dtype={v!r}: q8_0 keeps one scale per 32 values (block32), int8 one per "
            "token, and the attention kernel reads K and V with one scale granularity; pair int8 with "
            "fp8_e4m3 (both per token), or q8_0 with fp8_e4m3 at granularity='block32'"
        )
    return k, v


def check_pair(k_fmt: KVFormat, v_fmt: KVFormat) -> None:
    """Refuse a K/V format pair the attention kernel cannot read: K and V need one scale granularity
    (fp8_e4m3 and int8 mix at "token"; fp8_e4m3/block32 and q8_0 at "block32")."""
    if k_fmt.granularity != v_fmt.granularity:
        raise ValueError(
            f"K as {k_fmt.kv_dtype}/{k_fmt.granularity} with V as {v_fmt.kv_dtype}/{v_fmt.granularity}: the "
            "attention kernel reads K and V with one scale granularity; pick formats that share one "
            "(fp8_e4m3 and int8 per token; fp8_e4m3 granularity='block32' with q8_0)"
        )


def format_of(codes: torch.Tensor, scale: torch.Tensor) -> str:
    """The ``kv_dtype`` of a stored ``(codes, scale)`` pair, read off the tensors alone.

    ``float8_e4m3fn`` codes: ``"fp8_e4m3"`` (any granularity); ``int8`` codes with float16 scales
    ``[B, Hkv, L, D/32]``: ``"q8_0"``; ``int8`` codes with float32 scales ``[B, Hkv, L, 1]``:
    ``"int8"``. Anything else raises ``ValueError`` naming what was found.
    """
    if codes.dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if codes.dtype == torch.int8:
        if scale.dtype == torch.float16:
            return "q8_0"
        if scale.dtype == torch.float32 and scale.dim() == 4 and scale.shape[-1] == 1:
            return "int8"
        raise ValueError(
            f"int8 codes with {scale.dtype} scales of shape {tuple(scale.shape)} are no kvcompile format "
            "(q8_0: float16 scales [B, Hkv, L, D/32]; int8: float32 scales [B, Hkv, L, 1])"
        )
    raise ValueError(f"{codes.dtype} codes are no kvcompile format (float8_e4m3fn or int8)")


# --------------------------------------------------------------------------------------------
# Reference math (pure torch). Kernels must match quantize() bit for bit.
# --------------------------------------------------------------------------------------------


def _group_view(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., D] -> [..., G, D/G]."""
    return x.unflatten(-1, (groups, x.shape[-1] // groups))


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: round half away from zero (torch.round is half to even).

    Not ``floor(|x| + 0.5)``: that addition rounds in fp32, so 0.49999997 + 0.5 becomes 1.0 and
    rounds up. ``|x| - floor(|x|)`` is exact, so this matches roundf (and gguf's np_roundf) exactly.
    """
    a = x.abs()
    f = torch.floor(a)
    return torch.sign(x) * (f + torch.floor(2.0 * (a - f)))


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

    ``kv_dtype`` names the format when the code dtype alone does not: int8 codes are q8_0 unless
    ``kv_dtype="int8"`` (then ``groups`` must be 1: one fp32 scale per token).
    """
    if kv_dtype is None:
        kv_dtype = "fp8_e4m3" if code_dtype == torch.float8_e4m3fn else "q8_0"
    if get_format(kv_dtype).code_dtype != code_dtype:
        raise ValueError(f"kvcompile.formats.quantize: {kv_dtype} codes are not {code_dtype}")
    xf = x.float()
    if scale is not None:  # static per-kv-head scale
        if kv_dtype != "fp8_e4m3":
            raise ValueError(f"kvcompile.formats.quantize: {kv_dtype} has no static scales (fp8_e4m3 only)")
        s = scale.float().view(1, -1, 1, 1)
        with torch.no_grad():
            y = torch.where(s > 0, xf / s, torch.zeros_like(xf))
            # a NaN stays NaN even where s == 0, and an Inf becomes NaN (e4m3 has no Inf): only
            # finite values saturate
            y = torch.where(torch.isnan(xf), xf, torch.where(torch.isinf(xf), torch.full_like(xf, float("nan")), y))
        return _encode(y, code_dtype), scale
    if kv_dtype == "int8" and groups != 1:
        raise ValueError(f"kvcompile.formats.quantize: int8 keeps one scale per token (groups=1), got groups={groups}")

    xg = _group_view(xf, groups)  # [B, H, T, G, D/G]
    # no NaN / Inf anywhere: the special-value steps below change nothing and are skipped (a host
    # read, so on the CPU only, where it is free; the values are the same either way). amax
    # propagates NaN and Inf, so the group maxima show whether there is any.
    cpu = xf.device.type == "cpu"
    special = True
    if cpu:
        amax = xg.abs().amax(dim=-1, keepdim=True)
        special = not math.isfinite(float(amax.max()))
    if special:
        amax = torch.where(torch.isfinite(xg), xg.abs(), torch.zeros_like(xg)).amax(dim=-1, keepdim=True)
    if kv_dtype == "q8_0":
        # a tensor divisor: CUDA torch turns `t / python_scalar` into t * (1/scalar), which rounds
        # differently from the true division the kernels (and CPU torch) do
        d = amax / torch.full_like(amax, Q8_0_MAX)
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        # x * (1/d), as GGUF computes it (not x / d: the two round differently).
        y = xg * inv
        s = d
        if special:  # a block holding a NaN or an Inf: a NaN scale (its Inf codes +-127, its NaN codes 0)
            y = torch.where(torch.isinf(xg), torch.sign(xg) * Q8_0_MAX, y)
            s = torch.where(torch.isfinite(xg).all(dim=-1, keepdim=True), d, torch.full_like(d, float("nan")))
        s = s.to(torch.float16)
        codes = _encode(y.flatten(-2), code_dtype)
    elif kv_dtype == "int8":
        # true division on every device (see q8_0); the CPU divides by a Python scalar truly too
        s = amax / INT8_MAX if cpu else amax / torch.full_like(amax, INT8_MAX)
        # x / s, true division, as fp8; s == 0 (a group of zeros, or of values so small that amax / 127
        # underflows): x / 1, which rounds to 0 (int8 has no -0)
        y = xg / torch.where(s > 0, s, 1.0)
        if special:
            y = torch.where(torch.isinf(xg), torch.sign(xg) * INT8_MAX, y)  # also where s == 0
            y = torch.nan_to_num(y, nan=0.0)  # int8 has no NaN code: 0 there, and the token's scale is NaN
            # a NaN or an Inf (int8 holds neither): the token's scale is NaN, so it reads back as NaN
            s = torch.where(torch.isfinite(xg).all(dim=-1, keepdim=True), s, torch.full_like(s, float("nan")))
        # round half to even, saturate (in place: y is this function's own)
        codes = y.clamp_(-INT8_MAX, INT8_MAX).round_().flatten(-2).to(torch.int8)
    else:
        s = amax / FP8_E4M3_MAX if cpu else amax / torch.full_like(amax, FP8_E4M3_MAX)  # true division (int8)
        y = torch.where(s > 0, xg / s, torch.zeros_like(xg))  # +0 where s == 0 (e4m3 has a -0 code)
        if special:
            # a NaN or an Inf is stored as e4m3's NaN code, also in a group whose scale is 0, and the group's
            # scale is NaN (the policy above)
            y = torch.where(torch.isnan(xg), xg, torch.where(torch.isinf(xg), torch.full_like(xg, float("nan")), y))
            s = torch.where(torch.isfinite(xg).all(dim=-1, keepdim=True), s, torch.full_like(s, float("nan")))
        codes = _encode(y.flatten(-2), code_dtype)
    return codes, s.squeeze(-1)


def _encode(y: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    if code_dtype == torch.int8:
        y = torch.nan_to_num(_roundf(y.clamp(-Q8_0_MAX, Q8_0_MAX)), nan=0.0)
        return y.to(torch.int8)
    # clamp keeps NaN (e4m3fn has a NaN code) and saturates ±Inf; the cast rounds to nearest even.
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


_E4M3_TABLE: dict = {}


def _e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
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
    """codes [B, H, L, D] with scales [B, H, L, G] or static [H] -> values [B, H, L, D] in ``dtype``."""
    # int8 codes times fp32 scales promote to fp32 in one kernel, the same products (the codes are
    # exact in fp32); fp8 codes do not promote, so they are converted first
    c = codes if codes.dtype == torch.int8 else _e4m3_to_float(codes)
    s = scale if scale.dtype == torch.float32 else scale.float()
    if scale.dim() == 1:
        out = c * s.view(1, -1, 1, 1)
    elif scale.shape[-1] == 1:  # one scale per token broadcasts as it is (4-D: half the grouped path's cost)
        out = c * s
    else:
        out = (_group_view(c, scale.shape[-1]) * s.unsqueeze(-1)).flatten(-2)
    return out if out.dtype == dtype else out.to(dtype)

"""A format as data: :class:`FormatSpec` (one per file of this package), the registry of specs, the
scale granularities, :class:`KVFormat` (a spec at one granularity) and its integer id.

Ids (one numbering, shared by Python, the Triton kernels and the C path):

* ``FormatSpec.id``: the code kind, 0, 1, 2, ... in registration order (the store kernel's ``CODE``
  constexpr, ``attend.c``'s ``CODE_*`` values, passed to the compiler by :mod:`kvcompile.native`);
* granularity ids: ``token`` 0, ``block32`` 1, ``static`` 2 (the kernels' ``SCALE_*`` modes);
* ``KVFormat.id = spec.id | granularity_id << 8``: what the ops carry (``k_format`` / ``v_format``)
  and what :func:`from_id` turns back into the format.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

__all__ = ["FormatSpec", "KVFormat", "GRANULARITIES", "GRANULARITY_IDS", "BLOCK", "register", "spec", "specs",
           "from_id", "check_name"]

BLOCK = 32  # GGUF / "block32" group size along head_dim
GRANULARITIES: tuple[str, ...] = ("token", "block32", "static")
GRANULARITY_IDS = {g: i for i, g in enumerate(GRANULARITIES)}  # the kernels' SCALE_TOKEN / _BLOCK / _STATIC
_ID_SHIFT = 8  # KVFormat.id: the spec's id in the low 8 bits, the granularity's above


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """What a format is: its name and id, code and scale dtypes, the largest code (``qmax``), the
    granularities it admits (the first is its default), whether the cache rotates its K by default,
    and its reference quantization.

    ``quantize_groups(xg, amax, special, cpu) -> (codes [..., D], scales [..., G, 1])`` quantizes
    float32 values grouped as ``[..., G, D/G]`` with ``amax`` their finite group maxima (``special``:
    some value may be NaN / Inf; ``cpu``: on the CPU). ``quantize_static(x, scale)`` quantizes
    float32 ``[B, H, T, D]`` by a static ``[H]`` scale (None where the format has no static scales).
    ``widen`` names the kernels' widening of its codes (int8 codes: ``"int"``, e4m3: ``"e4m3"``).
    """

    name: str
    id: int
    code_dtype: torch.dtype
    scale_dtype: torch.dtype
    qmax: float
    granularities: tuple[str, ...]
    rotate_k: bool
    quantize_groups: Callable
    quantize_static: Optional[Callable] = None
    aliases: tuple[str, ...] = ()
    defined_as: str = ""  # how the format's granularity is defined, for the error that refuses another one
    hint: str = ""  # the format to use instead, for that error

    @property
    def default_granularity(self) -> str:
        return self.granularities[0]

    def check_granularity(self, granularity: str) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"unknown scale granularity {granularity!r}; use one of {list(GRANULARITIES)}")
        if granularity not in self.granularities:
            raise ValueError(f"{self.name} is defined with {self.defined_as}, got granularity={granularity!r}"
                             + (f"; {self.hint}" if self.hint else ""))


_SPECS: dict[str, FormatSpec] = {}


def register(s: FormatSpec) -> FormatSpec:
    if s.name in _SPECS or any(o.id == s.id for o in _SPECS.values()) or not 0 <= s.id < 1 << _ID_SHIFT:
        raise ValueError(f"kvcompile.formats: {s.name} (id {s.id}) is registered already or its id is out of range")
    _SPECS[s.name] = s
    return s


def specs() -> tuple[FormatSpec, ...]:
    """Every registered spec, in id order."""
    return tuple(sorted(_SPECS.values(), key=lambda s: s.id))


def check_name(kv_dtype, what: str = "kv_dtype") -> None:
    if kv_dtype not in _SPECS:
        key = str(kv_dtype).lower().replace("torch.", "")
        close = key if key in _SPECS else next((s.name for s in _SPECS.values() if key in s.aliases), None)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ValueError(f"unknown {what} {kv_dtype!r}{hint}; kvcompile accepts one of {[s.name for s in specs()]}")


def spec(name: str) -> FormatSpec:
    check_name(name)
    return _SPECS[name]


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """One cache format: a registered spec (``kv_dtype``, its name) at one scale ``granularity``
    (``"token"``, ``"block32"`` or ``"static"``, among those the spec admits)."""

    kv_dtype: str
    granularity: str

    def __post_init__(self):
        spec(self.kv_dtype).check_granularity(self.granularity)

    @property
    def spec(self) -> FormatSpec:
        return _SPECS[self.kv_dtype]

    @property
    def id(self) -> int:
        """The integer the ops, the kernels and the C path know this format by (module docstring)."""
        return self.spec.id | GRANULARITY_IDS[self.granularity] << _ID_SHIFT

    @property
    def scale_mode(self) -> int:
        """The kernels' SCALE_* mode: the granularity's id."""
        return GRANULARITY_IDS[self.granularity]

    @property
    def code_dtype(self) -> torch.dtype:
        return self.spec.code_dtype

    @property
    def scale_dtype(self) -> torch.dtype:
        return self.spec.scale_dtype

    @property
    def qmax(self) -> float:
        return self.spec.qmax

    @property
    def is_static(self) -> bool:
        return self.granularity == "static"

    @property
    def name(self) -> str:
        if len(self.spec.granularities) == 1 or self.granularity == "token":
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
            fallback = next(s.name for s in specs() if "token" in s.granularities and len(s.granularities) > 1)
            raise ValueError(
                f"{self.name} keeps one scale per {BLOCK} values along head_dim, but head_dim={head_dim} "
                f"is not a multiple of {BLOCK}; use kv_dtype={fallback!r} with granularity='token'"
            )

    def group_size(self, head_dim: int) -> int:
        """Values per scale along head_dim: 32 for "block32", head_dim otherwise."""
        return BLOCK if self.granularity == "block32" else head_dim

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

    def scale_bytes(self, head_dim: int) -> int:
        """Scale bytes per (token, kv head) the kernels load: 0 for static scales."""
        return self.groups(head_dim) * self.scale_dtype.itemsize

    def bytes_per_element(self, head_dim: int) -> float:
        """Bytes per cached K or V element, scales included (static scales: amortized to 0)."""
        return 1.0 + self.scale_bytes(head_dim) / head_dim


_BY_ID: dict[int, KVFormat] = {}


def from_id(format_id: int) -> KVFormat:
    """The :class:`KVFormat` of an id (:attr:`KVFormat.id`); ValueError for an id no format has."""
    fmt = _BY_ID.get(format_id)
    if fmt is None:
        kind, gran = format_id & ((1 << _ID_SHIFT) - 1), format_id >> _ID_SHIFT
        named = [s for s in _SPECS.values() if s.id == kind]
        if format_id < 0 or not named or gran >= len(GRANULARITIES):
            raise ValueError(
                f"kvcompile: format id {format_id} names no format; pass the cache's KVFormat.id "
                "(kvcompile.get_format(kv_dtype, granularity).id)")
        fmt = _BY_ID[format_id] = KVFormat(named[0].name, GRANULARITIES[gran])
    return fmt

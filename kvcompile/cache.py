"""``kvcompile.QuantizedCache``: an 8-bit KV cache that is a transformers ``Cache``.

Modelled on transformers' ``StaticCache``/``StaticLayer`` (5.x): fixed ``[B, Hkv, L, D]``
storage, a ``cumulative_length`` device tensor, every buffer ``mark_static_address``-ed so
CUDA graphs can replay it, and an ``update()`` that writes in place. The difference: the
storage is 8-bit codes plus scales, written by ``kvcompile::store_kv``, and ``update()``
returns ``kvcompile::dequantize(...)`` so that eager attention of any implementation is
correct. Under ``torch.compile(backend=kvcompile.backend(...))`` the pass replaces attention
over that dequantized K/V by ``kvcompile::attention``, which reads the codes directly.

Sliding-window layers (the layer types and windows of :func:`kvcompile.hf.layer_windows`) keep all
``max_cache_len`` positions like full layers (a rolling buffer is not implemented): the model's
mask applies the window in eager mode, and the layer's ``sliding_window`` travels with
``dequantize`` to the compiler pass so that the kernels skip the keys below it.
"""

from __future__ import annotations

import copy
import operator
import os
import warnings
from typing import Any, Mapping

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import formats, hf, ops, rotation, tp

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
    ``k_offset`` (or None; in K's rotated space when K is rotated), ``cumulative_length``,
    ``k_rotation`` / ``v_rotation`` (None, or the ``[D, D]`` float32 matrix R that side is stored
    rotated by: stored = quantize(x @ R - offset)), ``sliding_window`` (0 = full attention).

    ``fmt`` is K's format (``k_fmt``); ``v_fmt`` is V's, which may differ when the two share one
    scale granularity (:func:`formats.check_pair`). ``fmt`` stays for code that predates K and V
    formats chosen apart; ``k_fmt`` / ``v_fmt`` say which side is meant.

    ``sliding_window``: the window attention applies over this layer (query ``p`` sees keys
    ``k > p - W``), 0 for full attention. A window no shorter than ``max_cache_len`` never excludes
    a stored key and is recorded as 0. Every layer stores all ``max_cache_len`` positions: in eager
    mode the model's mask applies the window; :meth:`update` hands it to ``kvcompile::dequantize``
    for the compiler pass, and ``kvcompile::attention`` skips the keys below it. ``is_sliding`` is
    True for a layer the config makes sliding (what transformers' masks read).

    ``v_layout``: ``"keys"`` stores V codes key-contiguous (a ``[B, Hkv, D, L16]`` buffer, ``L16``
    = ``L`` rounded up to 16, seen through a ``[B, Hkv, L, D]`` view), the layout the attention
    kernel reads without a transpose; ``"head_dim"`` stores them like K; ``"auto"`` takes
    :attr:`formats.KVFormat.v_keys_contiguous` of V's format.

    ``k_rotate`` / ``v_rotate``: store that side rotated by :func:`kvcompile.rotation.hadamard`.
    ``k_offset`` is given in the model's K space (what :func:`kvcompile.calibrate` measures) and
    rotated here once when K is rotated: ``(x - mu) @ R == x @ R - mu @ R``.
    """

    is_compileable = True
    is_croppable = True
    is_sliding = False
    supports_early_init = True
    tp_shard = tp.TPShard()  # the kv heads this tensor-parallel rank stores (kvcompile.tp); size 1: all

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
        *,
        v_fmt: formats.KVFormat | None = None,
        k_rotate: bool = False,
        v_rotate: bool = False,
        sliding_window: int = 0,
    ):
        super().__init__()
        v_fmt = fmt if v_fmt is None else v_fmt
        formats.check_pair(fmt, v_fmt)
        fmt.check_head_dim(head_dim)
        v_fmt.check_head_dim(head_dim)
        if v_layout not in V_LAYOUTS:
            raise ValueError(f"kvcompile.QuantizedCache: v_layout={v_layout!r} is not one of {list(V_LAYOUTS)}")
        for side, f, rot in (("K", fmt, k_rotate), ("V", v_fmt, v_rotate)):
            if rot and f.is_static:
                raise ValueError(
                    f"kvcompile.QuantizedCache: {side} in {f.name} cannot be rotated: static scales are calibrated on "
                    "unrotated K/V; use rotate=False with granularity='static'"
                )
        if k_rotate or v_rotate:
            rotation.check_head_dim(head_dim)
        self.v_keys = v_fmt.v_keys_contiguous if v_layout == "auto" else v_layout == "keys"
        self.fmt = self.k_fmt = fmt
        self.v_fmt = v_fmt
        self.k_rotate, self.v_rotate = bool(k_rotate), bool(v_rotate)
        if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 0:
            raise ValueError(
                f"kvcompile.QuantizedCache: layer {layer_idx} got sliding_window={sliding_window!r}; it must be an "
                "int >= 0 (0 = full attention)"
            )
        self.is_sliding = sliding_window > 0
        # a window no shorter than the cache never excludes a stored key: recorded as full attention
        self.sliding_window = sliding_window if sliding_window < max_cache_len else 0
        self.max_batch_size = max_batch_size
        self.max_cache_len = max_cache_len
        self.num_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self._k_static = k_static_scale
        self._v_static = v_static_scale
        if k_offset is not None and k_rotate:  # into K's rotated space, in float64
            k_offset = (k_offset.detach().cpu().double() @ rotation.hadamard(head_dim, torch.float64)).float()
        self._k_offset = k_offset
        self.cumulative_length = torch.tensor(0, dtype=torch.long)
        self.k_codes = self.v_codes = self.k_scales = self.v_scales = None
        self.k_offset = self.k_rotation = self.v_rotation = None
        self.device = None

    # -- allocation -----------------------------------------------------------------------------

    def allocate(self, device: torch.device) -> None:
        B, H, L, D = self.max_batch_size, self.num_heads, self.max_cache_len, self.head_dim
        kf, vf = self.k_fmt, self.v_fmt
        self.device = torch.device(device)
        self.k_codes = torch.zeros((B, H, L, D), dtype=kf.code_dtype, device=device)
        self.v_codes = v_codes_buffer((B, H, L, D), vf.code_dtype, device, self.v_keys)
        self.device = self.k_codes.device  # normalized: "cuda" -> cuda:0, so input checks compare equal
        if kf.is_static:  # check_pair: static on both sides or neither
            self.k_scales = self._k_static.to(device=device, dtype=torch.float32).contiguous()
            self.v_scales = self._v_static.to(device=device, dtype=torch.float32).contiguous()
        else:
            self.k_scales = torch.zeros(kf.scale_shape(B, H, L, D), dtype=kf.scale_dtype, device=device)
            self.v_scales = torch.zeros(vf.scale_shape(B, H, L, D), dtype=vf.scale_dtype, device=device)
        if self._k_offset is not None:
            self.k_offset = self._k_offset.to(device=device, dtype=torch.float32).contiguous()
        if self.k_rotate or self.v_rotate:
            R = rotation.hadamard(D, torch.float32, self.device)  # one matrix per layer, shared by K and V
            self.k_rotation = R if self.k_rotate else None
            self.v_rotation = R if self.v_rotate else None
        self.cumulative_length = self.cumulative_length.to(device)
        # HF's StaticLayer semantics (keys/values are the storage); they are 8-bit codes here.
        self.keys, self.values = self.k_codes, self.v_codes
        if not _is_compiling():
            for t in self.buffers():
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def buffers(self) -> list[torch.Tensor]:
        bufs = [self.k_codes, self.v_codes, self.k_scales, self.v_scales, self.cumulative_length]
        for t in (self.k_offset, self.k_rotation, self.v_rotation):
            if t is not None and not any(t is b for b in bufs):  # K and V share one rotation matrix
                bufs.append(t)
        return bufs

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() == 4:  # fewer heads than the config: a tensor-parallel rank's (kvcompile.tp)
            tp.shard_to_local_heads(self, key_states.shape[1])
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
                + ("; under tensor parallelism build it with tp_size=model.tp_size" if H < self.num_heads else "")
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
            key_states, value_states, self.cumulative_length, self.k_offset, self.k_rotation, self.v_rotation,
        )
        self.cumulative_length.add_(key_states.shape[2])
        dtype = key_states.dtype
        n, w = self.cumulative_length, self.sliding_window
        k = ops.dequantize(k_codes, k_scales, self.k_offset, n, dtype, self.k_rotation, w)
        v = ops.dequantize(v_codes, v_scales, None, n, dtype, self.v_rotation, w)
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
            if not self.k_fmt.is_static:
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
        per_batch = [self.k_codes, self.v_codes] + ([] if self.k_fmt.is_static else [self.k_scales, self.v_scales])
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

    @property
    def format_name(self) -> str:
        """``"int8+rot"``-style: the format, ``+rot`` when rotated; ``"K/V"`` when K and V differ."""
        k = self.k_fmt.name + ("+rot" if self.k_rotate else "")
        v = self.v_fmt.name + ("+rot" if self.v_rotate else "")
        return k if k == v else f"K {k}/V {v}"

    def __repr__(self):
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return (
            f"QuantizedLayer({self.format_name}, B={self.max_batch_size}, Hkv={self.num_heads}, L={self.max_cache_len}, "
            f"D={self.head_dim}{window})"
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
        config: the model config (``model.config``). Its layer shapes, attention types and sliding
            windows are read as transformers' own caches read them (:mod:`kvcompile.hf`); a model the
            cache cannot serve (encoder-decoder, cross-attention, multi-head latent attention, ALiBi,
            chunked or linear attention, K/V shared across layers) raises ``ValueError`` naming why.
            Sliding-window layers (Mistral, Qwen2 with ``use_sliding_window``, Phi-3, Gemma 2/3,
            gpt-oss, Cohere2) are served: attention skips keys below the window, but every layer
            still stores ``max_cache_len`` positions, so memory grows with ``max_cache_len``, not
            with the window.
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
        kv_dtype: one of :data:`kvcompile.KV_DTYPES` (``"fp8_e4m3"``, ``"q8_0"``, ``"int8"``) for K and
            V; ``None``: :data:`kvcompile.formats.DEFAULT_KV_DTYPE`.
        device: where to allocate now; ``None`` allocates lazily on the first update's device;
            ``"meta"`` allocates nothing and serves only to measure :attr:`nbytes`.
        k_dtype, v_dtype: K's / V's format, overriding ``kv_dtype`` for that side. K and V must share
            one scale granularity (the attention kernel reads both with one): fp8_e4m3 and int8 mix
            (per token), fp8_e4m3 with ``granularity="block32"`` and q8_0 mix; q8_0 with int8, or
            with per-token fp8, is refused here with the reason.
        rotate: store K and V rotated by an orthonormal Hadamard matrix of the head dimension
            (:mod:`kvcompile.rotation`; head_dim must be a multiple of 8). ``None`` (default): rotate
            the sides stored as int8 (its per-token scale needs the outlier channels spread), not the
            others; ``True`` / ``False``: both sides / neither. Rotation is exact for attention (the
            compiler pass rotates q, and the output for V) and ``update()`` returns un-rotated K/V.
            fp8 and q8_0 may be rotated too (q8_0 codes are then GGUF's q8_0 of the rotated values);
            static scales may not (they are calibrated on unrotated K/V).
        granularity: fp8 scale granularity: ``"token"`` (default: one fp32 scale per token and kv
            head; the fastest format without calibration), ``"block32"`` (one per 32 values: about
            half the perplexity cost on SmolLM2-135M, see QUALITY.md, but its decode kernel is
            15-22% slower, see BENCHMARKS.md) or ``"static"`` (calibrated, per layer and kv head; needs
            ``calibration``). q8_0 is always block32, int8 always token.
        calibration: output of :func:`kvcompile.calibrate`, a safetensors path holding it, or the
            name of a calibration shipped with kvcompile (``"smollm2-135m-instruct"``; see
            :func:`kvcompile.calibration.shipped_calibrations`):
            ``k_scale``/``v_scale`` ``[layers, Hkv]`` (static fp8 scales, read only with
            ``granularity="static"``) and/or ``k_offset`` ``[layers, Hkv, D]`` (K centering, usable
            with every format; measured on unrotated K, and rotated by the cache when K is rotated,
            so a layer's ``k_offset`` lives in K's rotated space).
        v_layout: how V codes are laid out in memory: ``"auto"`` (default: key-contiguous for
            token and static scales, head_dim-contiguous otherwise, the faster layout of each on the H200, see
            BENCHMARKS.md), ``"keys"`` or ``"head_dim"``. ``v_codes`` is ``[B, Hkv, L, D]`` either way.
        tp_size: under tensor parallelism (``from_pretrained(..., tp_plan="auto")``), ``model.tp_size``:
            each rank stores its ``Hkv / tp_size`` kv heads and its slice of ``calibration``, and heads
            that do not divide are refused here. ``None``: the first update's head count decides, as in
            transformers' ``StaticCache`` (:mod:`kvcompile.tp`).

    Like transformers' ``StaticCache``, a cache passed to ``generate()`` keeps what it holds: a second
    call continues from it (its prompt must then start with the cached tokens). Call ``cache.reset()``
    before reusing it for an unrelated prompt.
    """

    def __init__(
        self,
        config,
        max_batch_size: int = 1,
        max_cache_len: int | None = None,
        kv_dtype: str | None = None,
        device: torch.device | str | None = None,
        *,
        k_dtype: str | None = None,
        v_dtype: str | None = None,
        rotate: bool | None = None,
        granularity: str | None = None,
        calibration: Mapping[str, torch.Tensor] | str | os.PathLike | None = None,
        v_layout: str = "auto",
        tp_size: int | None = None,
        **kwargs: Any,
    ):
        if kwargs:  # a misspelled option must not silently fall back to a default format
            raise TypeError(
                f"kvcompile.QuantizedCache got unexpected arguments {sorted(kwargs)}; it takes config, "
                "max_batch_size, max_cache_len, kv_dtype, device, k_dtype, v_dtype, rotate, granularity, "
                "calibration, v_layout and tp_size"
            )
        if rotate not in (None, True, False):
            raise TypeError(f"kvcompile.QuantizedCache: rotate must be None, True or False, got {rotate!r}")
        config = _checked_config(config)
        text_config = hf.text_config(config)
        k_name, v_name = formats.resolve_kv_dtypes(kv_dtype, k_dtype, v_dtype)
        k_fmt, v_fmt = formats.get_format(k_name, granularity), formats.get_format(v_name, granularity)
        formats.check_pair(k_fmt, v_fmt)
        fmt = k_fmt
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
        num_layers, kv_heads, head_dim = hf.layer_shapes(config)  # refuses what the cache cannot serve
        windows = hf.layer_windows(config)
        k_fmt.check_head_dim(head_dim)
        v_fmt.check_head_dim(head_dim)
        k_rotate = k_fmt.kv_dtype == "int8" if rotate is None else rotate
        v_rotate = v_fmt.kv_dtype == "int8" if rotate is None else rotate
        if (k_rotate or v_rotate) and fmt.is_static:
            raise ValueError(
                "kvcompile.QuantizedCache: rotate=True with granularity='static': static scales are calibrated on "
                "unrotated K/V; use rotate=False (or a per-token format)"
            )
        if k_rotate or v_rotate:
            try:
                rotation.check_head_dim(head_dim)
            except ValueError as e:
                how = "rotate=True" if rotate else "int8 rotates by default"
                raise ValueError(
                    f"kvcompile.QuantizedCache: {how}, but {e}"
                    + ("" if rotate else " (or a format that is not rotated by default, e.g. kv_dtype='fp8_e4m3')")
                ) from None

        calib = {}
        if calibration is not None:
            calib = tp.load_calibration(
                calibration, num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim, tp_size=tp_size
            )
        if fmt.is_static and ("k_scale" not in calib or "v_scale" not in calib):
            raise ValueError(
                "kvcompile.QuantizedCache: granularity='static' needs calibrated scales: pass "
                "calibration=kvcompile.calibrate(model, texts) (or the safetensors file it saved)"
            )
        layers = [
            QuantizedLayer(
                k_fmt, max_batch_size, max_cache_len, kv_heads, head_dim, i,
                k_static_scale=calib["k_scale"][i] if fmt.is_static else None,
                v_static_scale=calib["v_scale"][i] if fmt.is_static else None,
                k_offset=calib["k_offset"][i] if "k_offset" in calib else None,
                v_layout=v_layout,
                v_fmt=v_fmt, k_rotate=k_rotate, v_rotate=v_rotate,
                sliding_window=windows[i],
            )
            for i in range(num_layers)
        ]
        shard = tp.shard(kv_heads, tp_size)  # this rank's kv heads under tensor parallelism
        for layer in layers:
            tp.shard_layer(layer, shard)
        super().__init__(layers=layers)
        self.fmt = self.k_fmt = k_fmt  # ``fmt``: K's format, as before K and V could differ
        self.v_fmt = v_fmt
        self.k_dtype, self.v_dtype = k_fmt.kv_dtype, v_fmt.kv_dtype
        # one name when K and V agree, "k_dtype/v_dtype" otherwise (as kvcompile.backend reports it)
        self.kv_dtype = self.k_dtype if self.k_dtype == self.v_dtype else f"{self.k_dtype}/{self.v_dtype}"
        self.k_rotate, self.v_rotate = k_rotate, v_rotate
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

    def bytes_per_element(self) -> float:
        """Bytes per cached K or V element (mean of K and V), scales included (see KVFormat)."""
        D = self.layers[0].head_dim
        return (self.k_fmt.bytes_per_element(D) + self.v_fmt.bytes_per_element(D)) / 2

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
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized:  # transformers passes each tensor-parallel rank's head count
                tp.shard_to_local_heads(layer, num_heads[i] if isinstance(num_heads, (list, tuple)) else num_heads)
                layer.allocate(torch.device(device))

    @property
    def sliding_windows(self) -> list[int]:
        """Per layer: the attention window inside this cache (0 = full attention; see QuantizedLayer)."""
        return [layer.sliding_window for layer in self.layers]

    def __repr__(self):
        windows = sorted({w for w in self.sliding_windows if w})
        sliding = sum(1 for w in self.sliding_windows if w)
        extra = ""
        if sliding:
            extra = (
                f", sliding window {'/'.join(map(str, windows))} on {sliding} of {len(self.layers)} layers "
                f"(each still stores max_cache_len positions)"
            )
        return (
            f"kvcompile.QuantizedCache({self.layers[0].format_name}, layers={len(self.layers)}, "
            f"max_batch_size={self.max_batch_size}, max_cache_len={self.max_cache_len}{extra})"
        )

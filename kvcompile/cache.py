"""``kvcompile.QuantizedCache``: an 8-bit KV cache that is a transformers ``Cache``.

Modelled on transformers' ``StaticCache`` (5.x): one :class:`~kvcompile.cache_layer.QuantizedLayer`
per attention layer (its storage, ``update()`` and sliding-window bookkeeping live there). This
module builds them from a model config: argument checks, the K/V formats, rotation and
calibration each side gets, and the sizing (``max_cache_len``, :class:`CacheSizeWarning`,
``planned_nbytes``). Under ``torch.compile(backend=kvcompile.backend(...))`` the pass replaces
attention over the layers' dequantized K/V by ``kvcompile::attention``, which reads the codes
directly.
"""

from __future__ import annotations

import copy
import os
import warnings
import weakref
from typing import Any, Mapping

import torch
from transformers.cache_utils import Cache

from . import checks, formats, hf, tp
# re-exported: kvcompile.cache names them too
from .cache_layer import NoKVLayer, QuantizedLayer, v_codes_buffer
from .state_layers import HybridLayer, StateLayer

__all__ = ["CacheSizeWarning", "QuantizedCache", "QuantizedLayer", "v_codes_buffer"]

# every QuantizedCache alive: the compile backend looks through them for a graph's cache storage
_LIVE_CACHES: "weakref.WeakSet" = weakref.WeakSet()


def live_caches() -> list["QuantizedCache"]:
    return list(_LIVE_CACHES)


class CacheSizeWarning(UserWarning):
    """``QuantizedCache`` was sized from the config's ``max_position_embeddings`` (no ``max_cache_len``)."""


def _layer_nbytes(layer: "QuantizedLayer", device=None) -> int:
    """Bytes ``layer`` holds once allocated on ``device``, measured by allocating a copy on the meta
    device (no memory); a layer without K/V, what it holds now."""
    if not isinstance(layer, QuantizedLayer) or layer.is_initialized:
        return layer.nbytes
    ghost = copy.copy(layer)
    ghost.allocate(torch.device("meta"), layout_device=device)
    return ghost.nbytes


def _load_calibration(calibration, config, shapes, tp_size) -> dict:
    kv_heads, head_dim = hf.one_shape(
        config, shapes, "kvcompile.QuantizedCache", "a calibration holds one [layers, kv heads(, head_dim)] "
        "shape: build this model's cache without calibration (per-token scales need none)")
    return tp.load_calibration(calibration, num_layers=len(shapes), num_kv_heads=kv_heads, head_dim=head_dim,
                               tp_size=tp_size, config=config)


class QuantizedCache(Cache):
    """An 8-bit KV cache for Hugging Face causal LMs.

    Args:
        config: the model config (``model.config``). Its layer shapes, attention types and sliding
            windows are read as transformers' own caches read them (:mod:`kvcompile.hf`); a model the
            cache cannot serve (encoder-decoder, cross-attention, multi-head latent attention, MPT's ALiBi,
            chunked attention, a model with no K/V at all, a model that is no causal decoder: a ViT,
            DistilBERT) raises ``ValueError`` naming why. Layers may differ in shape
            (Gemma 4), and a layer that stores no K/V of its own (Gemma 3n / 4's shared layers, which
            attend over the K/V an earlier layer returned) holds a :class:`NoKVLayer`, and a layer that
            keeps a recurrent or convolution state instead of K/V (the Mamba / gated-delta-net layers
            of Qwen3-Next, Qwen3.5, Jamba, Bamba, Nemotron-H) holds transformers' own
            linear-attention layer (:class:`StateLayer`, not quantized); a layer with both (Falcon-H1,
            Zamba2's shared blocks) holds a :class:`HybridLayer`.
            Sliding-window layers (Mistral, Qwen2 with ``use_sliding_window``, Phi-3, Gemma 2/3,
            gpt-oss, Cohere2) are served and store only their window (see ``ring``).
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
            over as is), hence the warning rather than a guess. A cache larger than its device holds (a
            GPU's free memory, the CPU's total memory) is refused before anything is allocated (with
            ``device=None``: at the first update, outside ``torch.compile``), naming its bytes.
        kv_dtype: one of :data:`kvcompile.KV_DTYPES` (``fp8_e4m3``, ``q8_0``, ``int8``) for K and
            V; ``None``: :data:`kvcompile.formats.DEFAULT_KV_DTYPE`.
        device: where to allocate now; ``None`` allocates lazily on the first update's device (under
            ``torch.compile`` the graph that allocates is its own, so the cache's next prefill, after
            :meth:`reset`, compiles once more; give the device to compile one prefill graph);
            ``"meta"`` allocates nothing and serves only to measure :attr:`nbytes`.
        k_dtype, v_dtype: K's / V's format, overriding ``kv_dtype`` for that side. K and V must share
            one scale granularity (the attention kernel reads both with one): fp8_e4m3 and int8 mix
            (per token), fp8_e4m3 with ``granularity="block32"`` and q8_0 mix; q8_0 with int8, or
            with per-token fp8, is refused here with the reason.
        rotate: store K and/or V rotated by an orthonormal Hadamard matrix of the head dimension
            (:mod:`kvcompile.rotation`; head_dim must be a multiple of 8). ``None`` (default): rotate
            K when it is stored as int8 (its per-token scale needs K's outlier channels spread), V
            not (its quantization error averages over the keys a query attends to: QUALITY.md);
            ``True`` / ``False``: both sides / neither; ``"k"`` / ``"v"``: that side only. Rotation is
            exact for attention (the op rotates q for K, and the output for V) and ``update()``
            returns un-rotated K/V.
            fp8 and q8_0 may be rotated too (q8_0 codes are then GGUF's q8_0 of the rotated values);
            static scales may not (they are calibrated on unrotated K/V).
        granularity: fp8 scale granularity: ``"token"`` (default: one fp32 scale per token and kv
            head; the fastest format without calibration), ``"block32"`` (one per 32 values: about
            half the perplexity cost on SmolLM2-135M, see QUALITY.md, but its decode kernel is
            15-22% slower, see docs/perf-log.md) or ``"static"`` (calibrated, per layer and kv head; needs
            ``calibration``). q8_0 is always block32, int8 always token.
        calibration: output of :func:`kvcompile.calibrate`, a safetensors path holding it, or the
            name of a calibration shipped with kvcompile (``"smollm2-135m-instruct"``; see
            :func:`kvcompile.calibration.shipped_calibrations`):
            ``k_scale``/``v_scale`` ``[layers, Hkv]`` (static fp8 scales, read only with
            ``granularity="static"``) and/or ``k_offset`` ``[layers, Hkv, D]`` (K centering, usable
            with every format; measured on unrotated K, and rotated by the cache when K is rotated,
            so a layer's ``k_offset`` lives in K's rotated space).
        v_layout: how V codes are laid out in memory: ``"auto"`` (default: on a GPU key-contiguous for
            token and static scales, head_dim-contiguous otherwise, the faster layout of each on the H200, see
            docs/perf-log.md; on the CPU head_dim-contiguous, whose stored prefix is one run of memory
            at any ``max_cache_len``), ``"keys"`` or ``"head_dim"``. ``v_codes`` is
            ``[B, Hkv, L, D]`` either way.
        tp_size: under tensor parallelism (``from_pretrained(...,
            distributed_config=DistributedConfig(tp_plan="auto"))``), ``model.tp_size``:
            each rank stores its ``Hkv / tp_size`` kv heads and its slice of ``calibration``, and heads
            that do not divide are refused here. ``None``: the first update's head count decides, as in
            transformers' ``StaticCache`` (:mod:`kvcompile.tp`).
        ring: ``True`` (default): a sliding-window layer stores only its window of ``W`` positions, as a
            ring (:mod:`kvcompile.ring`), so its memory follows the window, not ``max_cache_len``
            (transformers' sliding layers keep the window too). ``False``: it stores all
            ``max_cache_len`` positions like a full layer, and attention skips the keys below the
            window; that is what cropping the cache past the window needs (assisted or
            prompt-lookup decoding of a sliding-window model beyond its window).

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
        ring: bool = True,
        **kwargs: Any,
    ):
        checks.cache_options(kwargs, rotate, ring)
        config = checks.checked_config(config)
        text_config = hf.text_config(config)
        k_fmt, v_fmt, k_rotate, v_rotate = formats.resolve(kv_dtype, k_dtype, v_dtype, granularity, rotate)
        fmt = k_fmt
        max_batch_size = checks.positive_int("max_batch_size", max_batch_size)
        size_from_config = max_cache_len is None
        max_cache_len = checks.max_cache_len(text_config, max_cache_len)
        device = checks.checked_device(device)
        # (kv heads, head_dim) per layer, None for a layer without K/V of its own; refuses what the cache cannot serve
        shapes = hf.per_layer_shapes(config)
        states = hf.state_layers(config)  # layer -> number of states, for layers that keep a state instead of K/V
        head_dims = sorted({s[1] for s in shapes if s is not None})
        windows = hf.layer_windows(config)
        hf.check_cache_length(config, max_cache_len)
        checks.cache_head_dims(head_dims, k_fmt, v_fmt, k_rotate or v_rotate, rotate)
        calib = {} if calibration is None else _load_calibration(calibration, config, shapes, tp_size)
        if fmt.is_static and ("k_scale" not in calib or "v_scale" not in calib):
            raise ValueError(
                "kvcompile.QuantizedCache: granularity='static' needs calibrated scales: pass "
                "calibration=kvcompile.calibrate(model, texts) (or the safetensors file it saved)"
            )
        def kv_layer(i: int, shape: tuple[int, int]) -> QuantizedLayer:
            cls, extra = (HybridLayer, {"number_of_states": states[i]}) if i in states else (QuantizedLayer, {})
            return cls(
                k_fmt, max_batch_size, max_cache_len, shape[0], shape[1], i,
                k_static_scale=calib["k_scale"][i] if fmt.is_static else None,
                v_static_scale=calib["v_scale"][i] if fmt.is_static else None,
                k_offset=calib["k_offset"][i] if "k_offset" in calib else None,
                v_layout=v_layout,
                v_fmt=v_fmt, k_rotate=k_rotate, v_rotate=v_rotate,
                sliding_window=windows[i], ring=ring, **extra,
            )

        layers = [
            kv_layer(i, shape) if shape is not None
            else StateLayer(i, max_batch_size, max_cache_len, states[i]) if i in states
            else NoKVLayer(i, max_batch_size, max_cache_len)
            for i, shape in enumerate(shapes)
        ]
        for layer in self._kv_layers(layers):  # this rank's kv heads under tensor parallelism
            tp.shard_layer(layer, tp.shard(layer.num_heads, tp_size))
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
        self._size_checked = device is not None  # lazily allocated (device=None): checked at the first update
        if device is not None:
            self._refuse_if_too_large(device, size_from_config)
        if size_from_config:
            self._warn_size_from_config(stacklevel=3)
        if device is not None:
            for layer in self._kv_layers(self.layers):
                layer.allocate(device)
        self.keeps_states = any(isinstance(layer, (StateLayer, HybridLayer)) for layer in self.layers)
        _LIVE_CACHES.add(self)

    def storage(self) -> list[torch.Tensor]:
        """The tensors the cache holds at fixed addresses, allocated so far: each K/V layer's buffers and the
        recurrent / conv states (transformers updates a state in place unless it records the past for
        cropping). A compiled graph that allocates some (a hybrid model's first forward, or the first forward
        of a ``device=None`` cache) cannot mark them static for CUDA graphs; the compile backend does, where a
        later graph takes them as inputs."""
        out = []
        for layer in self.layers:
            if isinstance(layer, QuantizedLayer) and layer.is_initialized:
                out += layer.buffers()
            if isinstance(layer, (StateLayer, HybridLayer)) and not layer.record_past:
                out += layer.states()
        return out

    def unallocated_layers(self) -> list[int]:
        """The layers whose storage the next forward allocates: K/V not allocated yet (``device=None``), or a
        state layer before its first forward."""
        return [i for i, layer in enumerate(self.layers)
                if (isinstance(layer, QuantizedLayer) and not layer.is_initialized)
                or (isinstance(layer, (StateLayer, HybridLayer)) and not layer.states())]

    def length_counters(self) -> list[torch.Tensor]:
        """Each layer's count of stored tokens, a host tensor until the layer is allocated (transformers
        >= 5.25 keeps one on a state layer too): a graph over this cache reads at least one."""
        return [t for layer in self.layers for t in (getattr(layer, "cumulative_length", None),
                                                     getattr(layer, "cumulative_length_linear", None))
                if isinstance(t, torch.Tensor)]

    @staticmethod
    def _kv_layers(layers) -> list[QuantizedLayer]:
        """The layers that store K/V (every one but :class:`NoKVLayer` and :class:`StateLayer`)."""
        return [layer for layer in layers if isinstance(layer, QuantizedLayer)]

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
        """Bytes held by the cache: codes, scales, offsets and lengths of every layer, and the recurrent /
        conv states of :class:`StateLayer` and :class:`HybridLayer` layers once a forward has allocated them."""
        return sum(layer.nbytes for layer in self.layers)

    def bytes_per_element(self) -> float:
        """Bytes per cached K or V element (mean of K and V; where the layers' shapes differ, weighted by
        each layer's elements per position), scales included (see KVFormat)."""
        per_pos = [(l.num_heads * l.head_dim, l.head_dim) for l in self._kv_layers(self.layers)]  # per position
        total = sum(n for n, _ in per_pos)
        return sum(n * (self.k_fmt.bytes_per_element(D) + self.v_fmt.bytes_per_element(D)) / 2
                   for n, D in per_pos) / total

    def planned_nbytes(self, per_layer: bool = False, device: torch.device | str | None = None) -> int | list[int]:
        """Bytes the cache holds once allocated (``nbytes`` of every layer), without allocating:
        each layer not yet allocated is measured on the meta device. ``per_layer=True``: a list.
        ``device``: where the layers will be allocated, which decides V's layout under
        ``v_layout="auto"`` (key-contiguous V pads each head's positions to a multiple of 16);
        default: a GPU's layout."""
        sizes = [_layer_nbytes(layer, device) for layer in self.layers]
        return sizes if per_layer else sum(sizes)

    def bf16_nbytes(self) -> int:
        """Bytes a bf16 cache of the same capacity would hold (for comparisons): per layer the positions it
        stores, a sliding layer's window included, as transformers' ``StaticCache`` holds them."""
        return sum(2 * 2 * l.max_batch_size * l.num_heads * l.slots * l.head_dim for l in self.layers)

    def _refuse_if_too_large(self, device: torch.device, size_from_config: bool = False) -> None:
        """Refuse, before anything is allocated on ``device``, a cache larger than the device can hold
        (:func:`kvcompile.checks.room_on`), stating its bytes and the ``max_cache_len`` that would fit."""
        room = checks.room_on(device)
        sizes = [_layer_nbytes(layer, device) if isinstance(layer, QuantizedLayer) and not layer.is_initialized else 0
                 for layer in self.layers]  # what allocating the rest takes (all of it before the first write)
        total = sum(sizes)
        if room is None or total <= room[0]:
            return
        # a sliding layer's ring holds its window whatever max_cache_len; the other layers grow with it
        fixed = sum(size for layer, size in zip(self.layers, sizes) if layer.ring)
        per_position = (total - fixed) / self.max_cache_len
        fits = int((room[0] - fixed) // per_position) if per_position else 0
        given = " (the config's max_position_embeddings)" if size_from_config else ""
        raise ValueError(
            f"kvcompile.QuantizedCache: max_batch_size={self.max_batch_size} x max_cache_len={self.max_cache_len:,}"
            f"{given} needs {total:,} bytes ({checks.gib(total)}) of K/V storage in {len(self.layers)} layers, but "
            f"{room[1]}; pass max_cache_len=<prompt tokens + max_new_tokens>"
            + (f" (at most about {fits:,} fit at this batch)" if fits >= 1 else ", and a smaller max_batch_size")
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        n = len(self.layers)
        if type(layer_idx) is not int or not 0 <= layer_idx < n:
            if isinstance(layer_idx, int) and not isinstance(layer_idx, bool) and layer_idx >= n:
                raise ValueError(
                    f"kvcompile.QuantizedCache: the model wrote attention layer {layer_idx}, but the cache was built "
                    f"for {n} layers; build it from this model's config (QuantizedCache(model.config, ...))"
                )
            raise ValueError(
                f"kvcompile.QuantizedCache.update: layer_idx={layer_idx!r} is not a layer of the cache: it takes an "
                f"int in 0..{n - 1} ({n} layers; a negative index does not count from the end)"
            )
        if isinstance(key_states, torch.Tensor) and not torch.compiler.is_compiling():  # compiled: the backend's
            self._check_first_writes(key_states, value_states, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_first_writes(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Eager checks of an update: gradients (refused: kvcompile.backend refuses a compiled graph with the
        same message), and before the first write of a lazily allocated cache, the bytes its device can hold."""
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            side = "key_states" if key_states.requires_grad else "value_states"
            raise checks.grad_refusal("kvcompile.QuantizedCache", f"layer {layer_idx}'s {side}")
        if not self._size_checked:
            self._size_checked = True
            # fewer heads than the layer's: a tensor-parallel rank's, sized once sharded (kvcompile.tp)
            if key_states.dim() == 4 and key_states.shape[1] == getattr(self.layers[layer_idx], "num_heads", -1):
                self._refuse_if_too_large(key_states.device)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        checks.check_rows("kvcompile.QuantizedCache.reorder_cache", "beam_idx", beam_idx, self.max_batch_size)
        super().reorder_cache(beam_idx)

    def early_initialization(self, batch_size, num_heads, head_dim, dtype, device):
        fresh = [(i, layer) for i, layer in enumerate(self.layers)
                 if isinstance(layer, QuantizedLayer) and not layer.is_initialized]
        for i, layer in fresh:  # each tensor-parallel rank's heads
            tp.shard_to_local_heads(layer, num_heads[i] if isinstance(num_heads, (list, tuple)) else num_heads)
        if fresh and not torch.compiler.is_compiling():
            self._size_checked = True
            self._refuse_if_too_large(torch.device(device))
        for _, layer in fresh:
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
                + ("(each a ring of its window's positions)" if any(layer.ring for layer in self.layers)
                   else "(each stores max_cache_len positions: ring=False)")
            )
        kinds = [(sum(isinstance(layer, cls) for layer in self.layers), what) for cls, what in (
            (StateLayer, "keeping a state instead of K/V"), (HybridLayer, "keeping a state beside K/V"),
            (NoKVLayer, "without K/V of their own"))]
        kinds = "".join(f", {n} {what}" for n, what in kinds if n)
        return (
            f"kvcompile.QuantizedCache({self._kv_layers(self.layers)[0].format_name}, layers={len(self.layers)}"
            f"{kinds}, max_batch_size={self.max_batch_size}, max_cache_len={self.max_cache_len}{extra})"
        )

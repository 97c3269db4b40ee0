"""``QuantizedLayer``: one attention layer's 8-bit K/V storage inside :class:`kvcompile.QuantizedCache`.

Modelled on transformers' ``StaticLayer`` (5.x): fixed ``[B, Hkv, L, D]`` storage, a
``cumulative_length`` device tensor, every buffer ``mark_static_address``-ed so CUDA graphs can
replay it, and an ``update()`` that writes in place. The difference: the storage is 8-bit codes
plus scales, written by ``kvcompile::store_kv``, and ``update()`` returns
``kvcompile::dequantize(...)`` so that eager attention of any implementation is correct.

Sliding-window layers (the layer types and windows of :func:`kvcompile.hf.layer_windows`) keep only
their window: ``W`` slots used as a ring (:mod:`kvcompile.ring`), so their memory follows the window,
not the context. Positions stay absolute outside the ring: ``update()`` returns ``max_cache_len``
positions (zeros outside the window) and transformers' masks apply unchanged.
"""

from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import CacheLayerMixin

from . import backend_registry, formats, hf, ops, rotation, tp
from .buffers import v_codes_buffer

__all__ = ["NoKVLayer", "QuantizedLayer", "V_LAYOUTS", "v_codes_buffer"]



_KV_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


_warned_uncompiled = False


def _warn_if_compiled_module_bypassed(tokens: int) -> None:
    """Once per process: a decode step (one token) written eagerly while a ``kvcompile.backend()``
    exists that no graph ever reached is what ``torch.compile(model, backend=...)`` followed by
    ``model.generate()`` does (generate calls the module it wraps, uncompiled): say so, and what
    compiles instead. Not for a longer write: transformers' ``CompileConfig`` runs the prefill
    uncompiled and compiles from the first decode step on."""
    global _warned_uncompiled
    if _warned_uncompiled or tokens != 1:
        return
    if not backend_registry.unused_backend_exists():
        return
    _warned_uncompiled = True
    warnings.warn(
        "kvcompile: a decode step ran uncompiled over the QuantizedCache (attention reads dequantized K/V, "
        "slowly) while a kvcompile.backend() exists that has compiled nothing. If you wrote "
        "`model = torch.compile(model, backend=...)`: model.generate() calls the original, uncompiled module; "
        "compile its forward instead: `model.forward = torch.compile(model.forward, backend=backend)`",
        UserWarning, stacklevel=4)


V_LAYOUTS = ("auto", "keys", "head_dim")


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
    a stored key and is recorded as 0. ``is_sliding`` is True for a layer the config makes sliding
    (what transformers' masks read).

    ``ring`` (default True): a layer with a window stores ``slots = W`` positions, position ``p`` in
    slot ``p % W`` (:mod:`kvcompile.ring`): :meth:`update` reads the ring (and the new tokens) into
    ``kvcompile::dequantize_ring`` *before* ``store_kv(ring=True)`` writes them, since a chunk's tail
    may overwrite keys its first queries still see; the compiler pass turns the three into one
    ``kvcompile::attention_ring``. ``ring=False`` stores all ``max_cache_len`` positions
    (``slots = max_cache_len``), the layout :meth:`crop` past the window needs; the window then
    travels with ``dequantize`` to the pass and ``kvcompile::attention`` skips the keys below it.

    ``v_layout``: ``"keys"`` stores V codes key-contiguous (a ``[B, Hkv, D, L16]`` buffer, ``L16``
    = ``L`` rounded up to 16, seen through a ``[B, Hkv, L, D]`` view), the layout the attention
    kernel reads without a transpose; ``"head_dim"`` stores them like K; ``"auto"`` takes
    :attr:`formats.KVFormat.v_keys_contiguous` of V's format on a GPU and ``"head_dim"`` on the CPU,
    decided when the layer is allocated. On the CPU, the C attention (:mod:`kvcompile.native`) reads
    the stored prefix of a head_dim-contiguous V as one run of memory for any ``max_cache_len``.
    A key-contiguous V puts each channel's row ``L`` bytes after the last, so past 4 KiB every row
    starts on its own page: at ``max_cache_len=8192``, a decode call cost 30-34 us more than at 128
    on a 2-core CPU (an explicit ``"keys"`` on the CPU still does).

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
        ring: bool = True,
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
            rotation.prebuild(head_dim)  # now, so that a lazy allocation inside a compiled graph only reads it
        self.v_layout = v_layout
        self.v_keys = None  # V key-contiguous: allocate() decides (under "auto", by the device)
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
        self.ring = bool(ring) and self.sliding_window > 0
        self.slots = self.sliding_window if self.ring else max_cache_len  # positions stored per row
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

    def allocate(self, device: torch.device, layout_device: torch.device | str | None = None) -> None:
        """Allocate every buffer on ``device``; ``layout_device`` (default ``device``) decides V's
        layout under ``v_layout="auto"`` (a size measured on the meta device for another device)."""
        B, H, L, D = self.max_batch_size, self.num_heads, self.slots, self.head_dim
        kf, vf = self.k_fmt, self.v_fmt
        self.device = torch.device(device)
        self.v_keys = (vf.v_keys_contiguous and torch.device(layout_device or device).type != "cpu"
                       if self.v_layout == "auto" else self.v_layout == "keys")
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
            R = rotation.shared(D, self.device)  # one matrix for every layer of this head_dim, K and V alike
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
            _warn_if_compiled_module_bypassed(T)
            # One host read per layer in eager mode; compiled code relies on the op's device assert.
            end = int(self.cumulative_length) + T
            if end > self.max_cache_len:
                raise ValueError(
                    f"kvcompile.QuantizedCache: writing {T} tokens at position {end - T} would pass "
                    f"max_cache_len={self.max_cache_len}; " + ops.sizing_advice(end - T, T)
                )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states, value_states)
        k_codes, k_scales, v_codes, v_scales = self.live_buffers(key_states.shape[0])
        if self.ring:
            return self._update_ring(key_states, value_states, k_codes, k_scales, v_codes, v_scales)
        kf, vf = self.k_fmt.id, self.v_fmt.id
        ops.store_kv(
            k_codes, k_scales, v_codes, v_scales,
            key_states, value_states, self.cumulative_length, self.k_offset, self.k_rotation, self.v_rotation,
            False, kf, vf,
        )
        self.cumulative_length.add_(key_states.shape[2])
        dtype = key_states.dtype
        n, w = self.cumulative_length, self.sliding_window
        k = ops.dequantize(k_codes, k_scales, self.k_offset, n, dtype, self.k_rotation, w, kf)
        v = ops.dequantize(v_codes, v_scales, None, n, dtype, self.v_rotation, w, vf)
        return k, v

    def _update_ring(self, key_states, value_states, k_codes, k_scales, v_codes, v_scales):
        """Read before write (class docstring): the window and the new tokens, then the store."""
        n, w, L, dtype = self.cumulative_length, self.sliding_window, self.max_cache_len, key_states.dtype
        kf, vf = self.k_fmt.id, self.v_fmt.id
        k = ops.dequantize_ring(k_codes, k_scales, self.k_offset, n, dtype, self.k_rotation, w, key_states, L, kf)
        v = ops.dequantize_ring(v_codes, v_scales, None, n, dtype, self.v_rotation, w, value_states, L, vf)
        ops.store_kv(
            k_codes, k_scales, v_codes, v_scales,
            key_states, value_states, n, self.k_offset, self.k_rotation, self.v_rotation, True, kf, vf,
        )
        self.cumulative_length.add_(key_states.shape[2])
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
        n = abs(tokens_to_remove)
        if self.ring and n > 1 and self.is_initialized:
            stored = int(self.cumulative_length)
            if stored - self.slots > 0:  # the positions the shorter cache's window needs were overwritten
                raise RuntimeError(
                    f"kvcompile.QuantizedCache: layer {self.layer_idx} keeps only its sliding window of "
                    f"{self.slots} positions (a ring) and holds {stored} tokens; dropping {n} of them needs "
                    f"positions it has overwritten. Build the cache with ring=False (every layer stores "
                    "max_cache_len positions) for assisted or prompt-lookup decoding past the window"
                )
        self.cumulative_length.sub_(n)

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
        # V codes own their buffer, padding included (a key-contiguous view shows L of its L16 keys);
        # the rotation matrix is kvcompile.rotation.shared's, one per head_dim for every cache: not counted
        own = [t for t in self.buffers() if not any(t is x for x in (self.v_codes, self.k_rotation, self.v_rotation))]
        rest = sum(t.numel() * t.element_size() for t in own)
        return rest + self.v_codes.untyped_storage().nbytes()

    @property
    def format_name(self) -> str:
        """``"int8+rot"``-style: the format, ``+rot`` when rotated; ``"K/V"`` when K and V differ."""
        k = self.k_fmt.name + ("+rot" if self.k_rotate else "")
        v = self.v_fmt.name + ("+rot" if self.v_rotate else "")
        return k if k == v else f"K {k}/V {v}"

    def __repr__(self):
        window = f", sliding_window={self.sliding_window}{' (ring)' if self.ring else ''}" if self.sliding_window else ""
        return (
            f"QuantizedLayer({self.format_name}, B={self.max_batch_size}, Hkv={self.num_heads}, L={self.max_cache_len}, "
            f"D={self.head_dim}{window})"
        )


class HoldsNoKV:
    """The cache's bookkeeping of a layer that stores no K/V: zero heads, positions and window."""

    num_heads = head_dim = slots = sliding_window = 0
    ring = False

    def buffers(self) -> list:
        return []


class NoKVLayer(HoldsNoKV, hf.NO_KV_LAYER_BASE or object):  # no base before transformers has one: refused there
    """A decoder layer that stores no K/V in the cache (transformers' ``DummyLayer``, which masks and
    offloading skip and whose reset / crop / reorder do nothing): a layer that reuses an earlier layer's
    K/V (Gemma 3n's and Gemma 4's ``num_kv_shared_layers``: the model hands it the K/V the earlier
    layer's ``update`` returned) or has no attention. Its sizes are zero, so the cache's totals count
    it as nothing, and a write into it names the problem."""

    nbytes = 0

    def __init__(self, layer_idx: int, max_batch_size: int, max_cache_len: int):
        super().__init__()
        self.layer_idx, self.max_batch_size, self.max_cache_len = layer_idx, max_batch_size, max_cache_len

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states is None and value_states is None:  # transformers' DummyLayer contract
            return None, None
        raise ValueError(
            f"kvcompile.QuantizedCache: layer {self.layer_idx} stores no K/V (its config makes it reuse an earlier "
            "layer's K/V, or gives it no attention), but the model wrote K/V into it; build the cache from this "
            "model's own config (QuantizedCache(model.config, ...))"
        )

    def get_seq_length(self) -> int:
        return 0

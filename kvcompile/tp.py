"""Tensor parallelism: which kv heads one rank's :class:`kvcompile.QuantizedCache` stores.

transformers shards attention by heads (``from_pretrained(...,
distributed_config=DistributedConfig(tp_plan="auto"))`` under torchrun: ``q_proj``/``k_proj``/``v_proj``
colwise, ``o_proj`` rowwise). Rank ``r`` of ``tp_size`` computes
kv heads ``[r * h, (r + 1) * h)`` with ``h = Hkv / tp_size``, as plain local tensors: with grad
off (``generate``, ``torch.no_grad``) a colwise Linear returns its local shard, so attention and
``cache.update`` see ``[B, h, T, D]`` tensors, not DTensors. transformers' ``StaticCache`` learns
``h`` from the first ``key_states`` it stores; so does the cache (``tp_size=None``), or it is told
up front (``tp_size=model.tp_size``), which also checks that the heads divide before anything runs.

Per kv head state is sliced to the rank's heads: static scales ``[Hkv]`` and K offsets ``[Hkv, D]``
of each layer. The Hadamard rotation acts on head_dim within one head, so it is the same matrix on
every rank; per-token scales are per (token, local head) and are allocated local.

The rank inside the TP group is ``torch.distributed.get_rank() % tp_size``: transformers' device
mesh puts ``tp`` innermost (stride 1) under ``pp``/``dp``/``fsdp``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

__all__ = [
    "TPShard", "load_calibration", "shard", "shard_for_local_heads", "shard_layer", "shard_to_local_heads",
    "slice_heads",
]


@dataclasses.dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size`` stores kv heads ``[rank * local_heads, (rank + 1) * local_heads)``."""

    size: int = 1
    rank: int = 0
    local_heads: int = 0

    @property
    def heads(self) -> slice:
        return slice(self.rank * self.local_heads, (self.rank + 1) * self.local_heads)


def _distributed() -> bool:
    """Whether this process runs under an initialized torch.distributed (a tensor-parallel rank can)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _tp_rank(tp_size: int) -> int:
    dist = torch.distributed
    if not _distributed():
        raise ValueError(
            f"kvcompile.QuantizedCache: tp_size={tp_size}, but torch.distributed is not initialized in this "
            "process; run under torchrun and load the model with from_pretrained(..., "
            "distributed_config=DistributedConfig(tp_plan='auto')) first "
            "(it initializes torch.distributed), or leave tp_size unset for a single-process model"
        )
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(
            f"kvcompile.QuantizedCache: tp_size={tp_size} does not divide the world size {world}; "
            "pass tp_size=model.tp_size"
        )
    return dist.get_rank() % tp_size


def shard(kv_heads: int, tp_size: int | None) -> TPShard:
    """The shard of this process for a model of ``kv_heads`` kv heads split over ``tp_size`` ranks
    (``None`` or 1: one process holds every head). Heads that do not divide raise ``ValueError``."""
    if tp_size is None or tp_size == 1:
        return TPShard(1, 0, kv_heads)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise TypeError(f"kvcompile.QuantizedCache: tp_size must be a positive int (model.tp_size), got {tp_size!r}")
    if kv_heads % tp_size:
        divisors = [n for n in range(1, kv_heads + 1) if kv_heads % n == 0]
        raise ValueError(
            f"kvcompile.QuantizedCache: the model has {kv_heads} kv heads, which do not divide among "
            f"tp_size={tp_size} ranks (tensor parallelism gives each rank whole kv heads: heads / tp_size); "
            f"run with a number of processes that divides {kv_heads} (torchrun --nproc-per-node one of {divisors})"
        )
    return TPShard(tp_size, _tp_rank(tp_size), kv_heads // tp_size)


def shard_for_local_heads(kv_heads: int, local_heads: int, layer_idx: int) -> TPShard:
    """The shard implied by a first update with ``local_heads`` of the model's ``kv_heads`` heads
    (what transformers' ``StaticLayer`` learns from its first ``key_states``)."""
    if local_heads < 1 or kv_heads % local_heads:
        raise ValueError(
            f"kvcompile.QuantizedCache: layer {layer_idx} got {local_heads} kv heads, the config says {kv_heads}; "
            "build the cache from this model's config (under tensor parallelism: QuantizedCache(model.config, ..., "
            "tp_size=model.tp_size))"
        )
    return shard(kv_heads, kv_heads // local_heads)


def slice_heads(t: torch.Tensor | None, shard_: TPShard, dim: int = 0) -> torch.Tensor | None:
    """``t``'s rows of this rank's kv heads along ``dim`` (a per-head calibration tensor)."""
    if t is None or shard_.size == 1:
        return t
    return t.narrow(dim, shard_.heads.start, shard_.local_heads).contiguous()


def load_calibration(calibration, *, num_layers: int, num_kv_heads: int, head_dim: int, tp_size: int | None,
                     config=None):
    """:func:`kvcompile.load_calibration` for the whole model (every kv head); under tensor parallelism, a
    file made for one rank's heads is refused with the reason and the fix."""
    from .calibration import load_calibration as load

    try:
        return load(calibration, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, config=config)
    except ValueError:
        if not ((tp_size is not None and tp_size > 1) or _distributed()):
            raise  # no tensor parallelism here: fewer kv heads are another model's shapes, as the error says
        per_rank = _per_rank_heads(calibration)
        if per_rank is None or per_rank >= num_kv_heads or num_kv_heads % per_rank:
            raise
        where = f" (this run has tp_size={tp_size})" if tp_size and tp_size > 1 else ""
        raise ValueError(
            f"kvcompile.QuantizedCache: the calibration holds {per_rank} kv heads per layer, the model has "
            f"{num_kv_heads}: it was made for one rank of a tensor-parallel layout{where}. The cache takes the "
            "whole model's calibration and slices each rank's heads itself: calibrate the unsharded model in one "
            "process (kvcompile.calibrate) and pass that file"
        ) from None


def _per_rank_heads(calibration) -> int | None:
    """The kv head count a calibration's ``k_scale``/``k_offset`` holds (dim 1), or None if unreadable."""
    if isinstance(calibration, Mapping):
        tensors = calibration
    else:
        try:
            from safetensors.torch import load_file

            from .calibration import _resolve_path

            tensors = load_file(_resolve_path(calibration))
        except Exception:  # noqa: BLE001 - the original error is the one to show
            return None
    for name in ("k_offset", "k_scale", "v_scale"):
        t = tensors.get(name)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[1])
    return None


def shard_layer(layer, shard_: TPShard) -> None:
    """Make an unallocated :class:`kvcompile.QuantizedLayer` of every kv head hold only ``shard_``'s:
    its head count and its per-head static scales and K offsets (the rotation is per head: unchanged)."""
    if shard_.size == 1:
        return
    if layer.is_initialized or getattr(layer, "tp_shard", TPShard()).size != 1:
        raise RuntimeError(
            f"kvcompile.QuantizedCache: layer {layer.layer_idx} is already allocated or sharded; build a new cache "
            "for a tensor-parallel model (QuantizedCache(model.config, ..., tp_size=model.tp_size))"
        )
    layer.num_heads = shard_.local_heads
    layer._k_static = slice_heads(layer._k_static, shard_)
    layer._v_static = slice_heads(layer._v_static, shard_)
    layer._k_offset = slice_heads(layer._k_offset, shard_)
    layer.tp_shard = shard_


def shard_to_local_heads(layer, local_heads: int) -> None:
    """Lazy sharding: the first K/V (or transformers' ``early_initialization``) carries ``local_heads``
    of the layer's ``num_heads``; fewer means tensor parallelism (``kv_heads / local_heads`` ranks)."""
    if layer.is_initialized or local_heads == layer.num_heads:
        return
    if local_heads < layer.num_heads and not _distributed():
        raise ValueError(
            f"kvcompile.QuantizedCache: layer {layer.layer_idx} got K/V of {local_heads} kv heads, but the cache was "
            f"built for {layer.num_heads}, and this process is not tensor-parallel (torch.distributed is not "
            "initialized): the config the cache was built from does not describe this model's attention; build it "
            "from the model's own config (QuantizedCache(model.config, ...))"
        )
    shard_layer(layer, shard_for_local_heads(layer.num_heads, local_heads, layer.layer_idx))

"""Cache layers that keep transformers' recurrent / convolution states: a hybrid model's Mamba,
gated-delta-net or short-convolution layers (:class:`StateLayer`: the state instead of K/V) and layers
with an attention and a Mamba mixer side by side (:class:`HybridLayer`: 8-bit K/V and the state).

The states are transformers' own ``LinearAttentionLayer`` storage, kept at their fixed size in the
model's dtype (not quantized); what this module adds is the cache's bookkeeping around them: their
bytes, one batch size (transformers sizes a state by its first forward), beam reordering in place,
and the list of a layer's states (the compile backend marks them as static CUDA-graph inputs).
"""

from __future__ import annotations

import torch

from . import hf
from .cache_layer import QuantizedLayer, HoldsNoKV

__all__ = ["HybridLayer", "StateLayer"]


class _StateRows:
    """The batch rows of a layer's states. transformers allocates them for the batch of the first update
    and copies every later update into them: a later batch of another size names the problem here
    rather than failing in a copy. Beam search reorders them in place, so they keep the static
    addresses CUDA graphs replay (transformers' own reorder allocates new tensors)."""

    def _check_state_batch(self, states, held: dict, state_idx: int) -> None:
        new = states if isinstance(states, torch.Tensor) else states[-1]
        old = held.get(state_idx)
        if isinstance(old, torch.Tensor) and new.shape[0] != old.shape[0]:
            raise ValueError(
                f"kvcompile.QuantizedCache: layer {self.layer_idx} keeps a recurrent state for a batch of "
                f"{old.shape[0]} (the batch of the cache's first forward; transformers sizes a state then), but "
                f"this forward has {new.shape[0]} rows; build a new QuantizedCache for another batch size"
            )

    def states(self) -> list[torch.Tensor]:
        """The conv and recurrent states allocated so far."""
        return [t for t in (*self.conv_states.values(), *self.recurrent_states.values()) if isinstance(t, torch.Tensor)]

    def _states_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.states())

    def update_conv_state(self, conv_states, state_idx: int = 0, *args, **kwargs):
        self._check_state_batch(conv_states, self.conv_states, state_idx)
        return super().update_conv_state(conv_states, state_idx, *args, **kwargs)

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, *args, **kwargs):
        self._check_state_batch(recurrent_states, self.recurrent_states, state_idx)
        return super().update_recurrent_state(recurrent_states, state_idx, *args, **kwargs)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for t in self.states():
            t.copy_(t.index_select(0, beam_idx.to(t.device)))


class StateLayer(_StateRows, HoldsNoKV, hf.STATE_LAYER_BASE or object):  # no base before transformers has one: refused there
    """A decoder layer that keeps a recurrent or convolution state instead of K/V (the Mamba and
    gated-delta-net layers of hybrid models, short convolutions): transformers' own
    ``LinearAttentionLayer``, which the model updates through the cache's ``update_conv_state`` /
    ``update_recurrent_state``. Its state has a fixed size per sequence, is allocated on the first
    forward in the model's dtype (its shape comes from the model, not the config) and is not quantized:
    :attr:`nbytes` counts it once it exists. A write of K/V into it names the problem."""

    def __init__(self, layer_idx: int, max_batch_size: int, max_cache_len: int, number_of_states: int = 1):
        super().__init__(number_of_states=number_of_states)
        self.layer_idx, self.max_batch_size, self.max_cache_len = layer_idx, max_batch_size, max_cache_len

    @property
    def nbytes(self) -> int:
        return self._states_nbytes()

    def buffers(self) -> list[torch.Tensor]:
        return self.states()

    def update(self, key_states, value_states, *args, **kwargs):
        raise ValueError(
            f"kvcompile.QuantizedCache: layer {self.layer_idx} keeps a recurrent / convolution state (its config "
            "makes it a linear-attention or conv layer), but the model wrote K/V into it; build the cache from this "
            "model's own config (QuantizedCache(model.config, ...))"
        )


class HybridLayer(_StateRows, QuantizedLayer, hf.STATE_LAYER_BASE or object):  # no base before transformers has one: refused
    """A decoder layer that stores K/V *and* keeps a recurrent state (an attention and a Mamba mixer in
    one layer: Falcon-H1, Zamba2's shared blocks; transformers' ``hybrid`` / ``hybrid_sliding`` layer
    types): a :class:`QuantizedLayer` for the K/V and transformers' ``LinearAttentionLayer`` for the
    state (:class:`StateLayer`'s), as transformers' own ``LinearAttentionAndStaticFullAttentionLayer``
    pairs them. The K/V side answers the cache contract (length, masks, batch, offload); reset and
    beam reordering reach both sides."""

    def __init__(self, *args, number_of_states: int = 1, **kwargs):
        hf.STATE_LAYER_BASE.__init__(self, number_of_states=number_of_states)
        QuantizedLayer.__init__(self, *args, **kwargs)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if args:  # update(key_states, value_states): the K/V side
            QuantizedLayer.lazy_initialization(self, *args, **kwargs)
        else:  # update_conv_state / update_recurrent_state: the state side, by keyword. It moves its own
            # counters to the states' device only while `device` is unset, which the K/V side may have set
            device, self.device = self.device, None
            hf.STATE_LAYER_BASE.lazy_initialization(self, **kwargs)
            self.device = device if device is not None else self.device

    def reset(self) -> None:
        hf.STATE_LAYER_BASE.reset(self)
        QuantizedLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        _StateRows.reorder_cache(self, beam_idx)
        QuantizedLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        hf.STATE_LAYER_BASE.crop(self, tokens_to_remove)  # raises unless transformers records the states' past
        QuantizedLayer.crop(self, tokens_to_remove)

    @property
    def nbytes(self) -> int:
        return QuantizedLayer.nbytes.fget(self) + self._states_nbytes()

    def __repr__(self):
        return "Hybrid" + QuantizedLayer.__repr__(self)

"""Run a compiled ``model.forward`` at a fixed set of batch sizes: one CUDA graph per size.

Inductor's cudagraph trees (``mode="reduce-overhead"``) record one graph per input shape. A decode
step of a batch of 3, then of 5, then of 6 would compile and capture three times. Serving engines
capture a short list of batch sizes instead (1, 2, 4, 8, ...) and run a live batch on the next
captured size; :class:`BatchPaddedForward` does that for an HF causal LM:

    cache = kvcompile.QuantizedCache(model.config, max_batch_size=8, max_cache_len=4096, device="cuda")
    fwd = torch.compile(model.forward, backend=kvcompile.backend(), mode="reduce-overhead")
    model.forward = kvcompile.BatchPaddedForward(fwd, max_batch_size=cache.max_batch_size)
    model.generate(ids, cache=cache, ...)   # a batch of 3 runs (and is captured) at 4

The padding rows repeat the last real row (its tokens, mask and positions), so they compute
finite, valid values in the cache rows after the live ones and never touch a live row: every
op of a decoder is independent across batch rows. Their outputs are sliced off before they are
returned. A QuantizedCache already runs a smaller batch on its leading rows (static addresses),
so the padded batch reads and writes the same buffers at every size. A cache that keeps recurrent
states (a hybrid model: :class:`kvcompile.StateLayer`) runs every batch at the largest capture size:
transformers sizes a state by the batch of its first forward, and every later forward must match it.
"""

from __future__ import annotations

import bisect
import inspect
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["BatchPaddedForward", "default_capture_sizes"]

# forward() arguments whose dim 0 is the batch (HF causal LMs); other tensors pass through
BATCH_ARGS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "token_type_ids")


def default_capture_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch_size``, then ``max_batch_size`` itself (1, 2, 4, ..., max)."""
    if max_batch_size < 1:
        raise ValueError(f"kvcompile: max_batch_size must be >= 1, got {max_batch_size}")
    sizes, s = [], 1
    while s < max_batch_size:
        sizes.append(s)
        s *= 2
    return tuple(sizes) + (max_batch_size,)


class BatchPaddedForward:
    """Wraps ``forward`` so that every call runs at the smallest captured batch size >= the batch.

    Args:
        forward: the (compiled) ``model.forward``; called with keyword arguments.
        max_batch_size: the cache's ``max_batch_size``; no captured size may exceed it.
        capture_sizes: batch sizes to run at (default :func:`default_capture_sizes`). The largest
            must be ``max_batch_size`` or below; a batch larger than the largest raises. Over a cache
            that keeps recurrent states, every batch runs at the largest.
    """

    def __init__(self, forward: Callable[..., Any], *, max_batch_size: int,
                 capture_sizes: Optional[Iterable[int]] = None):
        if not callable(forward):
            raise TypeError(f"kvcompile.BatchPaddedForward: forward must be callable, got {type(forward).__name__}")
        sizes = default_capture_sizes(max_batch_size) if capture_sizes is None else tuple(capture_sizes)
        if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"kvcompile.BatchPaddedForward: capture_sizes must be positive ints, got {sizes!r}")
        too_big = [s for s in sizes if s > max_batch_size]
        if too_big:
            raise ValueError(
                f"kvcompile.BatchPaddedForward: capture sizes {too_big} exceed max_batch_size={max_batch_size} "
                "(the cache has no rows for them); drop them or build the cache with a larger max_batch_size"
            )
        self.forward = forward
        self.max_batch_size = max_batch_size
        self.capture_sizes = tuple(sorted(set(sizes)))
        try:  # generate() reads model.forward's signature (cache kwarg name, logits_to_keep, ...)
            self.__signature__ = inspect.signature(forward)
        except (TypeError, ValueError):
            pass

    def padded_size(self, batch: int) -> int:
        """The captured size a batch of ``batch`` runs at."""
        i = bisect.bisect_left(self.capture_sizes, batch)
        if i == len(self.capture_sizes):
            raise ValueError(
                f"kvcompile.BatchPaddedForward: a batch of {batch} exceeds the largest capture size "
                f"{self.capture_sizes[-1]} (max_batch_size={self.max_batch_size}); build the cache with "
                f"max_batch_size>={batch} and add a capture size for it"
            )
        return self.capture_sizes[i]

    def __call__(self, input_ids: Optional[torch.Tensor] = None, **kwargs: Any) -> Any:
        if input_ids is not None:
            kwargs["input_ids"] = input_ids
        lead = kwargs.get("input_ids")
        if lead is None:
            lead = kwargs.get("inputs_embeds")
        if lead is None:
            raise ValueError("kvcompile.BatchPaddedForward: needs input_ids or inputs_embeds to know the batch")
        batch = lead.shape[0]
        padded = self.padded_size(batch)
        if _keeps_states(kwargs):  # transformers sized the states by the first forward: every one runs at that batch
            padded = self.capture_sizes[-1]
        if padded == batch:
            return self.forward(**kwargs)
        for name in BATCH_ARGS:
            t = kwargs.get(name)
            if isinstance(t, torch.Tensor):
                kwargs[name] = _pad_rows(t, batch, padded, name)
            elif isinstance(t, dict):  # the masks generate() builds per attention type (transformers >= 5.2x)
                kwargs[name] = {k: _pad_rows(m, batch, padded, f"{name}[{k!r}]", broadcast=True)
                                if isinstance(m, torch.Tensor) else m for k, m in t.items()}
        return _slice_batch(self.forward(**kwargs), padded, batch)

    def __repr__(self) -> str:
        return f"BatchPaddedForward(capture_sizes={self.capture_sizes}, forward={self.forward!r})"


def _pad_rows(t: torch.Tensor, batch: int, padded: int, name: str, broadcast: bool = False) -> torch.Tensor:
    """``t`` with its last row repeated up to ``padded`` rows; a mask of one row (``broadcast``) stays as it is."""
    if broadcast and t.shape[0] == 1:
        return t
    if t.shape[0] != batch:
        raise ValueError(f"kvcompile.BatchPaddedForward: {name} has batch {t.shape[0]}, input has {batch}")
    return torch.cat([t, t[-1:].expand(padded - batch, *t.shape[1:])])


def _keeps_states(kwargs: dict) -> bool:
    """Whether the forward's cache has layers that keep a recurrent / conv state (a hybrid model)."""
    return getattr(kwargs.get("past_key_values", kwargs.get("cache")), "keeps_states", False)


def _slice_batch(out: Any, padded: int, batch: int) -> Any:
    """The first ``batch`` rows of every batch-shaped tensor in a forward's output."""
    if isinstance(out, torch.Tensor):
        return out[:batch] if out.dim() > 0 and out.shape[0] == padded else out
    if type(out) is tuple:
        return tuple(_slice_batch(o, padded, batch) for o in out)
    if hasattr(out, "keys") and hasattr(out, "__setitem__"):  # transformers ModelOutput / dict
        for k in list(out.keys()):
            v = out[k]
            if isinstance(v, (torch.Tensor, tuple)):  # the cache object itself is passed through
                out[k] = _slice_batch(v, padded, batch)
        return out
    return out

"""Causal masks the model built as tensors, taken apart so that no [Tq, L] mask reaches the op.

transformers builds its mask for a fixed-size cache as a tensor over every cache position
(``masking_utils.sdpa_mask``: ``kv_idx <= q_idx`` and the padding of ``attention_mask``, expanded to
``[B, 1, Tq, L]``; the eager form turns it into ``where(mask, 0, finfo.min)``). Passed to the op as
it is, a 32k-token prompt materializes a 1 GiB mask and the dense path's SDPA runs its masked
kernels (4.3x slower than ``is_causal`` on an H100). :func:`factor` reads the mask's graph instead:
an ``&`` of terms, where

* the causal term is ``kv <= q`` (or ``q >= kv``) over ``kv = arange(n)`` (the attention's keys, from
  position 0) and ``q = arange(Tq) + offset`` (consecutive query positions from a scalar offset),
  each unsqueezed to ``[..., Tq, 1]`` / ``[..., 1, n]``;
* every other term has size 1 along the query dim (a key mask such as padding, ``[B, 1, 1, n]``);
* a constant ``new_ones((), dtype=bool)`` is dropped, and so is a sliding window's ``kv > q - w`` over the
  same query positions where the op applies that window itself (``w`` the site's window, or a ring's
  size) or where ``w >= n`` hides no key.

Key ``j`` is then visible to query ``i`` iff ``j <= offset + i`` and every key term keeps it: the op's
``is_causal`` (query ``i`` at ``kv_len - Tq + i``) with ``kv_len = min(kv_len, offset + Tq)`` and the key
terms as its mask. That equals the graph's attention whenever the layer holds the queries'
positions (``offset + Tq <= kv_len``: transformers takes ``offset`` from the cache's length before this
forward's write); keys at or past ``kv_len`` the op never reads, as for any mask. A mask with any
other term (another window, chunked or bidirectional attention, a per-query term)
is not taken apart, and reaches the op as before. One query (decode) is left as it is too: its mask is
``[B, 1, 1, L]`` already.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from .graph import ADD, SUB, arg, is_call, known_eq, shape, val

__all__ = ["CausalMask", "factor"]

_AND = (operator.and_, torch.logical_and, torch.bitwise_and, "__and__", "logical_and", "bitwise_and")
_LE, _GE = (operator.le, torch.le, "le", "__le__"), (operator.ge, torch.ge, "ge", "__ge__")
_GT, _LT = (operator.gt, torch.gt, "gt", "__gt__"), (operator.lt, torch.lt, "lt", "__lt__")
_MIN_FILL = -1e30  # an additive mask's "hidden" value: finfo.min of any float dtype is below it


@dataclasses.dataclass(frozen=True)
class CausalMask:
    """A mask taken apart: ``keys`` (bool nodes of size 1 along the query dim; none: every key is
    kept), the 1-D node of the consecutive query positions, and, for an additive mask, the value of
    a hidden key (None: a bool mask)."""

    keys: tuple[fx.Node, ...]
    q_positions: fx.Node
    fill: Optional[float] = None
    zero: Any = 0.0  # an additive mask's value of a kept key (the graph's own node or constant)


def factor(mask: Any, tq: Any, n: Any, window: int = 0) -> Optional[CausalMask]:
    """``mask`` (the site's mask over ``n`` keys for ``tq`` queries) taken apart as the module
    docstring says, or None when it is not of that form (the caller then passes it on whole).
    ``window``: the window the op applies at this site (0: none); a sliding-window term
    ``kv > q - w`` with ``w == window``, or with ``w >= n`` (it hides no key), is dropped."""
    if not isinstance(mask, fx.Node):
        return None
    fill, zero = None, 0.0
    if is_call(mask, torch.where) and len(mask.args) == 3 and not mask.kwargs:
        keep, zero, fill = mask.args
        if not (_is_zero(zero) and isinstance(fill, (int, float)) and fill <= _MIN_FILL):
            return None
        mask = keep
    if getattr(val(mask), "dtype", None) != torch.bool:
        return None
    keys, causal, windows = [], [], []
    for term in _terms(mask):
        if _is_true(term):
            continue
        q = _causal_positions(term, tq, n)
        if q is not None:
            causal.append(q)
            continue
        qw = _window_positions(term, tq, n, window)
        if qw is not None:
            windows.append(qw)
            continue
        s = shape(term)
        if s is None or len(s) > 4 or (len(s) >= 2 and not known_eq(s[-2], 1)) or not s or not known_eq(s[-1], n):
            return None  # a term that depends on the query (or is no tensor over the keys)
        keys.append(term)
    if len(causal) != 1 or any(w is not causal[0] for w in windows):
        return None
    return CausalMask(tuple(keys), causal[0], None if fill is None else float(fill), zero)


def _strip(node: Any) -> Any:
    """Through ``expand`` and device-only ``to`` (the mask code's ``.to(device)``)."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.args:
        if node.target == "expand":
            node = node.args[0]
        elif node.target == "to" and len(node.args) <= 2 and not node.kwargs and (
                len(node.args) == 1 or isinstance(node.args[1], (torch.device, str))):
            node = node.args[0]
        else:
            break
    return node


def _terms(node: Any) -> list:
    """The leaves of an ``&`` tree (expands and device moves stripped)."""
    node = _strip(node)
    if is_call(node, *_AND) and len(node.args) == 2 and not node.kwargs:
        return _terms(node.args[0]) + _terms(node.args[1])
    return [node]


def _is_true(node: Any) -> bool:
    """``x.new_ones((), dtype=torch.bool)`` or the constant True."""
    if node is True:
        return True
    return (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "new_ones"
            and len(node.args) == 2 and tuple(node.args[1]) == () and node.kwargs.get("dtype") == torch.bool
            and set(node.kwargs) <= {"dtype", "device"})


def _is_zero(x: Any) -> bool:
    if isinstance(x, (int, float)):
        return x == 0
    return (is_call(x, torch.zeros) and len(x.args) == 1 and tuple(x.args[0]) == ()
            and x.kwargs.get("dtype", torch.float32).is_floating_point)


def _causal_positions(term: Any, tq: Any, n: Any) -> Optional[fx.Node]:
    """For ``kv <= q`` / ``q >= kv`` (module docstring): the 1-D node of the query positions."""
    if is_call(term, *_LE) and len(term.args) == 2:
        kv, q = term.args
    elif is_call(term, *_GE) and len(term.args) == 2:
        q, kv = term.args
    else:
        return None
    if _unsqueezed_arange(kv, n, -1) is None:
        return None
    q1 = _unsqueezed(q, -2)
    if q1 is None or not _consecutive(q1, tq):
        return None
    return q1


def _window_positions(term: Any, tq: Any, n: Any, window: int) -> Optional[fx.Node]:
    """For ``kv > q - w`` / ``q - w < kv`` with ``w`` the op's ``window`` or ``w >= n``: the 1-D node of
    the query positions (transformers' ``sliding_window_overlay``)."""
    if is_call(term, *_GT) and len(term.args) == 2:
        kv, lo = term.args
    elif is_call(term, *_LT) and len(term.args) == 2:
        lo, kv = term.args
    else:
        return None
    if _unsqueezed_arange(kv, n, -1) is None or not (is_call(lo, *SUB) and len(lo.args) == 2):
        return None
    q, w = lo.args
    if not isinstance(w, int) or isinstance(w, bool) or not (w == window > 0 or isinstance(n, int) and w >= n):
        return None
    q1 = _unsqueezed(q, -2)
    return q1 if q1 is not None and _consecutive(q1, tq) else None


def _unsqueezed(node: Any, axis: int) -> Optional[fx.Node]:
    """``x`` for ``x[None, ..., :, None...]`` (a 1-D ``x`` placed at dim ``axis`` of a 4-D index), else None."""
    node = _strip(node)
    if not (is_call(node, operator.getitem) and isinstance(node.args[1], tuple)):
        return None
    index = node.args[1]
    full = [i for i, x in enumerate(index) if isinstance(x, slice)]
    if len(index) != 4 or len(full) != 1 or full[0] != 4 + axis or any(
            x is not None for i, x in enumerate(index) if i != full[0]) or index[full[0]] != slice(None, None, None):
        return None
    x = node.args[0]
    s = shape(x)
    return x if s is not None and len(s) == 1 else None


def _unsqueezed_arange(node: Any, n: Any, axis: int) -> Optional[fx.Node]:
    """``arange(n) [+ 0]`` unsqueezed to dim ``axis``: the key positions 0..n-1."""
    x = _unsqueezed(node, axis)
    if x is None:
        return None
    if is_call(x, *ADD) and len(x.args) == 2 and x.args[1] == 0:
        x = x.args[0]
    return x if _is_arange(x, n) else None


def _is_arange(x: Any, length: Any) -> bool:
    """``torch.arange(length)`` or ``torch.arange(0, length)`` (step 1)."""
    if not is_call(x, torch.arange):
        return False
    ends = x.args if len(x.args) <= 2 else ()
    if len(x.args) == 2 and x.args[0] != 0:
        return False
    if not ends or arg(x, 2, "step", 1) != 1:
        return False
    return known_eq(ends[-1], length)


def _consecutive(q: fx.Node, tq: Any) -> bool:
    """``q`` is ``arange(tq) + offset`` with ``offset`` one integer (a scalar, or a tensor of one element)."""
    if not (is_call(q, *ADD) and len(q.args) == 2):
        return False
    a, b = q.args
    if not _is_arange(a, tq):
        a, b = b, a
    if not _is_arange(a, tq):
        return False
    if isinstance(b, int):
        return True
    v = val(b)
    return isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point() and v.dtype != torch.bool

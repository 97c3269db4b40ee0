"""Attention sinks, two spellings (stages of the eager chain in :mod:`.forms`): gpt-oss's sink
column in the softmax (:func:`sinks`) and GraniteSWA's ``sigmoid(lse - sinks)`` factor on the
output (:func:`lse_sinks`); both become the op's ``sinks`` (one logit per query head)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .call import LOGSUMEXP, SOFTMAX, AttentionCall, check_softmax
from .graph import SUB, Skip, arg, cast_dtype, describe, is_call, known_eq, only_user, shape, val, value_users
from .spellings import index_entries, is_full

__all__ = ["sinks", "lse_sinks"]


def sinks(x: fx.Node, cat: fx.Node, call: AttentionCall) -> fx.Node:
    """gpt-oss attention sinks: a per-head logit column joins the softmax and is dropped after it ->
    op ``sinks=<the [Hq] tensor>``. Returns the node holding the probabilities over the keys."""
    pieces, dim = arg(cat, 0, "tensors"), arg(cat, 1, "dim", 0)
    if not (isinstance(pieces, (list, tuple)) and len(pieces) == 2 and pieces[0] is x and dim in (-1, 3)):
        raise Skip(f"the attention scores are concatenated as {pieces!r} on dim {dim!r}, not [scores, sinks] on "
                   "the key dim")
    call.sinks = _sink_source(pieces[1], call)
    call.form += "+sinks"
    call.nodes.append(cat)
    users = value_users(cat)
    if len(users) == 1:
        sm = users[0]
    else:
        sm = _max_subtracted(cat, users, call)
    if not (is_call(sm, *SOFTMAX) and len(sm.args) >= 1):
        raise Skip(f"the scores with sinks feed {describe(sm)} ({sm.name}), not softmax")
    check_softmax(sm, call)
    call.nodes.append(sm)
    drop = only_user(sm, "the probabilities with sinks")
    entries = index_entries(drop.args[1], 4) if is_call(drop, operator.getitem) and drop.args[0] is sm else None
    a, b = shape(sm), shape(drop)
    last = entries[3] if entries and None not in entries else None
    if not (last is not None and all(is_full(e) for e in entries[:3]) and last.start in (None, 0)
            and last.step in (None, 1) and a is not None and b is not None and known_eq(b[3], a[3] - 1)):
        raise Skip(f"the sink column is not dropped after softmax ({describe(drop)} {drop.args[1:]!r})")
    call.nodes.append(drop)
    return drop


def lse_sinks(x: fx.Node, readers: list, call: AttentionCall) -> tuple[fx.Node, fx.Node]:
    """Sinks applied after attention (GraniteSWA): ``lse = logsumexp(scores, -1)``, the output of the
    plain softmax times ``sigmoid(lse - sink)`` per row, with the sink a ``[Hq]`` tensor viewed as
    ``[1, Hq, 1]``. That factor is ``sum / (sum + exp(sink))``: the sink logit joins the softmax's
    denominator, which is the op's ``sinks``. Returns (the factor as the output reads it, the softmax)."""
    lse = next(u for u in readers if is_call(u, *LOGSUMEXP))
    sm = next(u for u in readers if u is not lse)
    if not (is_call(sm, *SOFTMAX) and sm.args[0] is x):
        raise Skip(f"the attention scores with a logsumexp feed {describe(sm)} ({sm.name}), not softmax")
    dim, keepdim = arg(lse, 1, "dim"), arg(lse, 2, "keepdim", False)
    if lse.args[0] is not x or dim not in (-1, 3, [-1], [3], (-1,), (3,)) or keepdim:
        raise Skip(f"logsumexp over the attention scores is not over the key dim ({lse.args[1:]!r}, {lse.kwargs})")
    sub = only_user(lse, "the scores' logsumexp")
    if not (is_call(sub, *SUB) and len(sub.args) == 2 and sub.args[0] is lse):
        raise Skip(f"the scores' logsumexp feeds {describe(sub)} ({sub.name}), not lse - sinks")
    call.sinks = _head_vector(sub.args[1], 3, "the logit subtracted from the logsumexp", call)
    call.form += "+sinks"
    call.nodes.extend([lse, sub])
    node, seen = sub, []
    while True:  # casts, then sigmoid, then casts and the unsqueeze that makes it a column, in any order
        nxt = only_user(node, "the sink scale")
        if nxt.op == "call_method" and nxt.target in ("to", "type") or cast_dtype(nxt, node) is not None:
            if cast_dtype(nxt, node) not in (torch.float32, getattr(val(call.q), "dtype", None)):
                raise Skip(f"the sink scale is converted with {describe(nxt)}{nxt.args[1:]}")
        elif is_call(nxt, torch.sigmoid, "sigmoid", F.sigmoid) and "sigmoid" not in seen:
            seen.append("sigmoid")
        elif is_call(nxt, "unsqueeze", torch.unsqueeze) and "sigmoid" in seen and "unsqueeze" not in seen:
            if arg(nxt, 1, "dim") not in (-1, 3):
                raise Skip(f"the sink scale is unsqueezed at dim {arg(nxt, 1, 'dim')!r}, not as a column")
            seen.append("unsqueeze")
        else:
            break
        call.nodes.append(nxt)
        node = nxt
    if seen != ["sigmoid", "unsqueeze"]:
        raise Skip(f"the scores' logsumexp minus the sinks feeds {describe(nxt)} ({nxt.name}), "
                   "not sigmoid(...).unsqueeze(-1)")
    return node, sm


def _max_subtracted(cat: fx.Node, users: list, call: AttentionCall) -> fx.Node:
    """``c - c.max(dim=-1, keepdim=True).values`` (softmax is invariant to it): returns its reader."""
    sub = next((u for u in users if is_call(u, *SUB) and len(u.args) == 2 and u.args[0] is cat), None)
    mx = next((u for u in users if is_call(u, "max", torch.max, "amax", torch.amax)), None)
    if sub is None or mx is None or len(users) != 2:
        raise Skip("the scores with sinks are read by " + ", ".join(f"{describe(u)} ({u.name})" for u in users))
    if arg(mx, 1, "dim") not in (-1, 3) or not arg(mx, 2, "keepdim", False):
        raise Skip("the scores with sinks are shifted by a max that is not over the key dim")
    m = mx
    if mx.target in ("max", torch.max):
        m = only_user(mx, "the row max")
        if not (is_call(m, operator.getitem) and m.args[1] == 0 or is_call(m, getattr) and m.args[1] == "values"):
            raise Skip(f"the row max is read as {describe(m)}")
    if sub.args[1] is not m:
        raise Skip("the scores with sinks are shifted by something other than their row max")
    call.nodes.extend([mx, m, sub] if m is not mx else [mx, sub])
    return only_user(sub, "the shifted scores with sinks")


def _sink_source(col: Any, call: AttentionCall) -> fx.Node:
    """The ``[Hq]`` tensor a sink column [B, Hq, Tq, 1] is broadcast from (:func:`_head_vector`)."""
    q = val(call.q)
    hq = q.shape[1]
    c = shape(col)
    if not (isinstance(col, fx.Node) and c is not None and len(c) == 4 and known_eq(c[1], hq) and c[3] == 1):
        raise Skip(f"the column concatenated to the scores has shape {c}, not [B, Hq={hq}, Tq, 1]")
    return _head_vector(col, 4, "the sink column", call)


def _head_vector(col: Any, rank: int, what: str, call: AttentionCall) -> fx.Node:
    """The ``[Hq]`` tensor ``col`` (of ``rank`` dims, heads at dim 1, every other dim 1 or broadcast)
    is made from, through reshape / view / unsqueeze (keeping one non-unit dim, Hq) and expand
    (broadcasting unit dims only)."""
    hq = val(call.q).shape[1]
    c = shape(col)
    if not (isinstance(col, fx.Node) and c is not None and len(c) == rank and known_eq(c[1], hq)
            and (rank != 3 or c[0] == c[2] == 1)):
        raise Skip(f"{what} has shape {c}, not per query head")
    node = col
    while True:
        s = shape(node)
        if s is not None and len(s) == 1 and known_eq(s[0], hq):
            return node
        if not (node.op == "call_method" and node.target in ("expand", "reshape", "view", "unsqueeze")):
            raise Skip(f"{what} comes from {describe(node)} ({node.name}), not a [Hq] tensor")
        src = shape(node.args[0])
        if src is None:
            raise Skip(f"{what}'s {node.target} input has no shape")
        if node.target == "expand":
            if len(src) != len(s) or not all(known_eq(a, b) or a == 1 for a, b in zip(src, s)):
                raise Skip(f"{what} is expanded from {src} to {s}")
        elif [d for d in s if d != 1] != [hq] or len(s) == 4 and not known_eq(s[1], hq):
            raise Skip(f"{what} is reshaped to {s}")
        call.nodes.append(node)
        node = node.args[0]


#: name -> handler; ``sdpa`` and ``eager`` take (K chain, V chain), ``softcap`` and ``sinks`` are eager stages.

"""How the dequantized cache reaches attention: the K/V spelling table.

A K or V operand of attention starts at one ``kvcompile::dequantize`` node (the cache layer's
``update()`` returns it) and passes through zero or more *spellings* before the attention
reads it. Each spelling is one entry of :data:`KV_SPELLINGS` with what it implies for the op:

==========================  ==================================================  =================
entry                       graph                                               implies
==========================  ==================================================  =================
``dequantize``              ``kvcompile::dequantize(codes, scale, offset,       the source: codes,
                            kv_len, dtype[, rotation, sliding_window])``,       scales, length,
                            or ``dequantize_ring(..., new, length)``            rotation, window
``repeat_kv``               ``x[:, :, None]`` (or ``x.unsqueeze(2)``)           kv heads repeated
                            ``.expand(B, H, n, L, D).reshape(B, H*n, L, D)``    n times
``repeat_interleave``       ``x.repeat_interleave(n, dim=1)``                   kv heads repeated
``torch.repeat_interleave`` ``torch.repeat_interleave(x, n, dim=1)``            kv heads repeated
``tile``                    ``x.repeat(1, n, 1, 1)`` (JetMoE)                   kv heads tiled n
                                                                                times: query head
                                                                                h reads kv head
                                                                                h mod H
``slice``                   ``x[:, :, :n]`` / ``x[..., :n, :]`` (start 0, step  only the first n
                            1, every other dim whole)                           keys exist
``contiguous``              ``x.contiguous()``                                  nothing
``cast``                    ``x.to(dtype)``, ``x.type(dtype)``, ``x.float()``   the dtype attention
                            (fp32, fp16, bf16; nothing moved or copied)         reads (the op works
                                                                                from the codes)
==========================  ==================================================  =================

Every step is proven from the node's arguments *and* its input/output shapes (fake tensors in
the node metadata); a node that looks like a spelling but does something else (a repeat over
another dim, a slice that starts past 0) raises :class:`Skip` with the reason. A node that is no
spelling ends the chain: it is the *consumer* the attention forms (:mod:`.forms`) look at.
Besides the chain, only shape queries (``x.size()`` under ``dynamic=True``) may read a node.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .graph import Skip, arg, cast_dtype, describe, is_shape_query, known_eq, known_le, shape, val, value_users

DEQUANTIZE = torch.ops.kvcompile.dequantize.default
# a sliding layer's ring (kvcompile.ring): the same first seven arguments, then the new tokens and
# the length of the (absolute-position) result
DEQUANTIZE_RING = (torch.ops.kvcompile.dequantize_ring.default, torch.ops.kvcompile.dequantize_ring)
# Dynamo may record a call of the op (``ops.dequantize(...)``, ``torch.ops.kvcompile.dequantize(...)``)
# as its packet or as the overload: accept both.
DEQUANTIZE_TARGETS = (DEQUANTIZE, torch.ops.kvcompile.dequantize, *DEQUANTIZE_RING)


@dataclasses.dataclass(frozen=True)
class Source:
    """The arguments of one ``kvcompile::dequantize`` node. ``rotation`` and ``sliding_window`` are
    read with their defaults (None, 0) when the op's schema or the call does not have them."""

    node: fx.Node
    codes: fx.Node
    scale: fx.Node
    offset: Any
    kv_len: fx.Node
    dtype: torch.dtype
    rotation: Any
    sliding_window: Any
    ring: bool = False  # ``dequantize_ring``: kv_len is the length before ``new``; the result spans ``length``
    format: int = -1  # the codes' KVFormat.id (kvcompile.formats), as the cache passed it


def read_dequantize(node: fx.Node) -> Source:
    return Source(
        node=node,
        codes=arg(node, 0, "codes"),
        scale=arg(node, 1, "scale"),
        offset=arg(node, 2, "offset"),
        kv_len=arg(node, 3, "kv_len"),
        dtype=arg(node, 4, "dtype"),
        rotation=arg(node, 5, "rotation"),
        sliding_window=arg(node, 6, "sliding_window", 0),
        ring=node.target in DEQUANTIZE_RING,
        format=arg(node, 9 if node.target in DEQUANTIZE_RING else 7, "format", -1),
    )


@dataclasses.dataclass(frozen=True)
class Step:
    """One matched spelling: the nodes it covers (the last is the new K/V value) and what it implies."""

    nodes: tuple
    repeat: int = 1  # kv heads repeated (interleaved) this many times
    tile: int = 1  # kv heads tiled (the whole set repeated) this many times
    length: Any = None  # the keys that remain: an int or a graph node holding it (slices only)


@dataclasses.dataclass(frozen=True)
class Spelling:
    name: str
    implies: str
    match: Optional[Callable[[fx.Node, fx.Node], Optional[Step]]]  # (user, K/V value) -> Step | None


FULL = slice(None, None, None)


def is_full(s: Any) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def index_entries(index: Any, ndim: int) -> Optional[list]:
    """``x[index]`` for an ``ndim``-D x as one entry per output position: slices for kept dims,
    None for new axes; None when the index holds anything else (ints, tensors, bools)."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if any(e is not Ellipsis and e is not None and not isinstance(e, slice) for e in entries):
        return None
    consumed = sum(1 for e in entries if isinstance(e, slice))
    if entries.count(Ellipsis) > 1 or consumed > ndim:
        return None
    fill = [FULL] * (ndim - consumed)
    if Ellipsis in entries:
        i = entries.index(Ellipsis)
        return entries[:i] + fill + entries[i + 1:]
    return entries + fill


def _dims_equal(a: tuple, b: tuple, dims) -> bool:
    return all(known_eq(a[d], b[d]) for d in dims)


def _kv_shape(node: fx.Node, what: str) -> tuple:
    s = shape(node)
    if s is None or len(s) != 4:
        raise Skip(f"{what} ({node.name}) is not a 4-D [B, H, L, D] tensor (shape {s})")
    return s


def _repeated(x: fx.Node, out: fx.Node, n: Any, nodes: tuple, name: str) -> Step:
    """Check ``out`` is ``x`` with kv heads repeated ``n`` times: [B, H, L, D] -> [B, H * n, L, D]."""
    a, b = _kv_shape(x, "the K/V value"), shape(out)
    n = val(n)
    if not (isinstance(n, int) and b is not None and len(b) == 4 and known_eq(b[1], a[1] * n)
            and _dims_equal(a, b, (0, 2, 3))):
        raise Skip(f"{name} turns {a} into {b}, not a repeat of the kv heads [B, H*n, L, D]")
    return Step(nodes, repeat=n)


def match_repeat_kv(user: fx.Node, x: fx.Node) -> Optional[Step]:
    if user.op == "call_function" and user.target is operator.getitem and user.args[0] is x:
        entries = index_entries(user.args[1], 4)
        if entries is None or None not in entries:
            return None  # not an unsqueeze (a slice, or another index)
        if not (len(entries) == 5 and entries[2] is None and all(is_full(e) for i, e in enumerate(entries) if i != 2)):
            raise Skip(f"the cache is indexed with {user.args[1]!r}, not repeat_kv's x[:, :, None]")
    elif not (user.op == "call_method" and user.target == "unsqueeze" and user.args[0] is x
              and arg(user, 1, "dim") in (2, -3)):
        return None
    expand = _single(user, "repeat_kv's unsqueeze")
    if not (expand.op == "call_method" and expand.target == "expand"):
        raise Skip(f"repeat_kv's unsqueeze feeds {describe(expand)}, not expand")
    reshape = _single(expand, "repeat_kv's expand")
    if not (reshape.op == "call_method" and reshape.target == "reshape"):
        raise Skip(f"repeat_kv's expand feeds {describe(reshape)}, not reshape")
    a, e = _kv_shape(x, "the K/V value"), shape(expand)
    if not (e is not None and len(e) == 5 and known_eq(e[0], a[0]) and known_eq(e[1], a[1])
            and known_eq(e[3], a[2]) and known_eq(e[4], a[3])):
        raise Skip(f"repeat_kv expands {a} to {e}, not [B, H, n, L, D]")
    return _repeated(x, reshape, e[2], (user, expand, reshape), "repeat_kv")


def match_repeat_interleave_method(user: fx.Node, x: fx.Node) -> Optional[Step]:
    if not (user.op == "call_method" and user.target == "repeat_interleave" and user.args[0] is x):
        return None
    return _repeat_interleave(user)


def match_repeat_interleave_function(user: fx.Node, x: fx.Node) -> Optional[Step]:
    if not (user.op == "call_function" and user.target is torch.repeat_interleave and user.args and user.args[0] is x):
        return None
    return _repeat_interleave(user)


def _repeat_interleave(node: fx.Node) -> Step:
    repeats = arg(node, 1, "repeats")
    dim = arg(node, 2, "dim")
    if dim not in (1, -3) or not isinstance(repeats, int) or isinstance(repeats, bool):
        raise Skip(f"repeat_interleave(repeats={repeats!r}, dim={dim!r}) is not a repeat of the kv heads (dim=1)")
    return _repeated(node.args[0], node, repeats, (node,), "repeat_interleave")


def match_tile(user: fx.Node, x: fx.Node) -> Optional[Step]:
    """JetMoE's ``x.repeat(1, n, 1, 1)``: the kv heads tiled, so query head h reads kv head h mod H
    (the op's grouping reads h // n: the rewrite permutes the query heads into groups and back)."""
    if not (user.op == "call_method" and user.target == "repeat" and user.args and user.args[0] is x):
        return None
    # x.repeat(1, n, 1, 1) or x.repeat((1, n, 1, 1))
    sizes = user.args[1] if len(user.args) == 2 else user.args[1:] if len(user.args) > 2 else user.kwargs.get("sizes")
    sizes = [val(n) for n in sizes] if isinstance(sizes, (list, tuple)) else None
    if not (sizes is not None and len(sizes) == 4 and all(isinstance(n, int) for n in sizes)
            and sizes[0] == sizes[2] == sizes[3] == 1 and sizes[1] >= 1):
        raise Skip(f"the cache is repeated with {sizes}: only x.repeat(1, n, 1, 1) (its kv heads tiled) is understood")
    a, b = _kv_shape(x, "the K/V value"), shape(user)
    n = sizes[1]
    if not (b is not None and len(b) == 4 and known_eq(b[1], a[1] * n) and _dims_equal(a, b, (0, 2, 3))):
        raise Skip(f"repeat turns {a} into {b}, not its kv heads tiled [B, n*H, L, D]")
    return Step((user,), tile=n)


def match_slice(user: fx.Node, x: fx.Node) -> Optional[Step]:
    if not (user.op == "call_function" and user.target is operator.getitem and user.args[0] is x):
        return None
    entries = index_entries(user.args[1], 4)
    if entries is None or None in entries:
        return None
    a, b = _kv_shape(x, "the K/V value"), _kv_shape(user, "the sliced K/V")
    keys = entries[2]
    if not (all(is_full(entries[d]) for d in (0, 1, 3)) and keys.start in (None, 0) and keys.step in (None, 1)):
        raise Skip(f"the cache is sliced with {user.args[1]!r}: only x[:, :, :n] (the first n keys) is understood")
    n = b[2]
    if not known_le(n, a[2]) or not _dims_equal(a, b, (0, 1, 3)):
        raise Skip(f"slice {user.args[1]!r} turns {a} into {b}")
    if isinstance(n, int):
        return Step((user,), length=n)
    stop = keys.stop
    if isinstance(stop, fx.Node) and known_eq(val(stop), n):
        return Step((user,), length=stop)
    raise Skip(f"the slice keeps {n} keys, and no graph value holds that count")


def match_contiguous(user: fx.Node, x: fx.Node) -> Optional[Step]:
    if user.op == "call_method" and user.target == "contiguous" and user.args[0] is x and len(user.args) == 1:
        return Step((user,))
    return None


def match_cast(user: fx.Node, x: fx.Node) -> Optional[Step]:
    """GPT-J / CodeGen read K as ``key.to(torch.float32)``: a cast changes only the dtype the attention
    reads, which the forms check against the query's."""
    return Step((user,)) if cast_dtype(user, x) is not None else None


def _single(node: fx.Node, what: str) -> fx.Node:
    users = value_users(node)
    if len(users) != 1:
        raise Skip(f"{what} ({node.name}) is read by {len(users)} nodes")
    return users[0]


#: name -> spelling; ``dequantize`` is the source every chain starts at (no matcher).
KV_SPELLINGS: dict[str, Spelling] = {
    s.name: s
    for s in (
        Spelling("dequantize", "the source: codes, scales, length, dtype, rotation, sliding window", None),
        Spelling("repeat_kv", "kv heads repeated n times (unsqueeze, expand, reshape)", match_repeat_kv),
        Spelling("repeat_interleave", "kv heads repeated n times (method)", match_repeat_interleave_method),
        Spelling("torch.repeat_interleave", "kv heads repeated n times (function)", match_repeat_interleave_function),
        Spelling("tile", "kv heads tiled n times (repeat(1, n, 1, 1)): query head h reads kv head h mod H",
                 match_tile),
        Spelling("slice", "only the first n keys: the op's length is min(kv_len, n)", match_slice),
        Spelling("contiguous", "nothing (a copy)", match_contiguous),
        Spelling("cast", "the dtype attention reads (to / type / float / half / bfloat16)", match_cast),
    )
}


@dataclasses.dataclass
class KVChain:
    """One K or V operand: its dequantize source, the spelling nodes after it, and its reader."""

    source: Source
    nodes: list  # spelling nodes after the dequantize, in order
    end: fx.Node  # the value attention reads (the dequantize itself when there is no spelling)
    consumer: fx.Node  # the node that reads ``end``
    repeat: int = 1
    tile: int = 1  # kv heads tiled: query head h reads kv head h mod H
    length: Any = None  # None: every key of the cache; else the slice bound (int or node)
    spellings: list = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return "+".join(self.spellings) or "direct"

    def shape_users(self) -> list:
        """(user, node) for every shape query on the chain's nodes."""
        return [(u, n) for n in [self.source.node, *self.nodes] for u in n.users if is_shape_query(u, n)]


def trace_readers(dequantize: fx.Node) -> list[KVChain]:
    """Follow a dequantize node through the spelling table to each node that consumes it: one chain per
    reader of the dequantized cache (several where later layers attend over this layer's K/V too: Gemma
    3n / 4's ``num_kv_shared_layers``); a fork after a spelling is a :class:`Skip`."""
    users = value_users(dequantize)
    if not users:
        raise Skip(f"the dequantized cache ({dequantize.name}) is not read")
    return [_follow(KVChain(read_dequantize(dequantize), [], dequantize, dequantize), user) for user in users]


def _follow(chain: KVChain, user: fx.Node) -> KVChain:
    x = chain.end
    while True:
        for spelling in KV_SPELLINGS.values():
            step = spelling.match(user, x) if spelling.match else None
            if step is not None:
                break
        else:
            chain.end, chain.consumer = x, user
            return chain
        chain.nodes.extend(step.nodes)
        chain.spellings.append(spelling.name)
        if step.tile > 1 and chain.repeat > 1 or step.repeat > 1 and chain.tile > 1:
            raise Skip("the cache's kv heads are both interleaved and tiled: not a grouping the op has")
        chain.repeat *= step.repeat
        chain.tile *= step.tile
        if step.length is not None:
            chain.length = step.length
        x = step.nodes[-1]
        users = value_users(x)
        if len(users) != 1:
            if not users:
                raise Skip(f"the dequantized cache ({x.name}) is not read")
            others = ", ".join(f"{describe(u)} ({u.name})" for u in users)
            raise Skip(f"the dequantized cache ({x.name}) is read by several nodes: {others}")
        user = users[0]

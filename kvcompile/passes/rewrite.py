"""From a matched site to one ``kvcompile::attention`` call: the checks every form shares, and the emission.

The op (contract in :func:`kvcompile.ops._attention`)::

    attention(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale,
              sliding_window, softcap, sinks, k_rotation, v_rotation)

excludes keys at positions ``>= kv_len``; its ``is_causal`` puts query ``i`` at ``kv_len - Tq + i``
(bottom-right). What the pass proves before emitting it:

* shapes: q is ``[B, Hq, Tq, D]``, K and V codes one shape ``[B, Hkv, L, D]``, K and V repeated
  by the same factor r, and ``Hq == Hkv * r`` (or a multiple of it under ``enable_gqa``);
  K/V dequantized to q's dtype; V dequantized without an offset;
* length: the op's key range must be the graph's. A slice ``[:, :, :n]`` bounds it: the op gets
  ``min(kv_len, n)`` and a mask spanning n keys is padded to L (the padding lies past the
  bound). SDPA's ``is_causal`` is top-left (query i sees keys ``<= i``); the pass proves
  ``kv_len >= Tq`` from the graph (this layer's ``cumulative_length.add_(Tq)`` comes before the
  attention) and passes ``min(kv_len, Tq)``, which is top-left exactly; the queries must not
  outnumber the keys the graph keeps (``Tq <= n``). Without the proof the site is skipped;
* K centering (the dequantize ``offset`` of K) is dropped: every key of one query shifts by the
  same ``q . mu``, which softmax ignores. Not with softcap (tanh is not shift-invariant) or sinks
  (the sink logit does not shift): those sites are skipped;
* ``sliding_window`` is the K dequantize's (V's must agree); ``softcap`` and ``sinks`` come from
  the form;
* a score term of the form (Bloom's ALiBi, baddbmm's input [B*H, 1, T]) is unfolded to [B, H, 1, T] and
  added to the op's additive mask (over every key the op reads, no slice);
* tiled kv heads (JetMoE: query head h reads kv head h mod Hkv, the op reads h // group): the query's
  heads are put into groups before the op and its output's back after it;
* rotation: a side stored rotated by R (its dequantize un-rotates it) hands R to the op, which
  attends in the rotated space (``q @ R_k`` before the scores, the output times ``R_v^T``) inside
  its own launch.

A sliding layer's ring (``dequantize_ring``, :mod:`kvcompile.ring`) becomes ``kvcompile::attention_ring``,
which stores the new tokens and attends in one call: the layer's ``store_kv(ring=True)`` node, which
follows the two reads in the graph, is folded into it (the op takes its k, v and offset) and erased.
Everything above holds in absolute positions (the ring's result spans ``max_cache_len``, as the
mask does); the op's ``kv_len`` is None when the key bound is the cache length itself.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import ops, tiles
from . import causal
from .forms import AttentionCall, WhereMask
from .graph import Skip, arg, before, cast_dtype, constant, copy_meta, known_eq, known_le, shape, val
from .spellings import KVChain

ATTENTION = torch.ops.kvcompile.attention.default
ATTENTION_RING = torch.ops.kvcompile.attention_ring.default
STORE_KV = (torch.ops.kvcompile.store_kv.default, torch.ops.kvcompile.store_kv)


def plan(call: AttentionCall, k: KVChain, v: KVChain) -> dict:
    """The checks shared by every form; returns what :func:`emit` needs, or raises :class:`Skip`."""
    q = val(call.q)
    kc, vc = shape(k.source.codes), shape(v.source.codes)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or kc is None or len(kc) != 4:
        raise Skip("query is not a 4-D tensor" if kc is not None else "the cache codes have no shape")
    kv_dtypes = [getattr(val(c.end), "dtype", None) for c in (k, v)]
    out = val(call.anchor)
    if kv_dtypes[0] != q.dtype or call.form.startswith("sdpa") and kv_dtypes[1] != q.dtype:
        raise Skip(f"attention reads K/V as {kv_dtypes[0]}/{kv_dtypes[1]} but the query is {q.dtype}")
    if not (isinstance(out, torch.Tensor) and out.dtype.is_floating_point):
        raise Skip(f"the attention output is {getattr(out, 'dtype', out)}")
    if vc is None or len(vc) != 4 or not all(known_eq(a, b) for a, b in zip(kc, vc)):
        raise Skip(f"K and V caches differ in shape ({kc} vs {vc})")
    if not known_eq(q.shape[3], kc[3]):
        raise Skip(f"query head_dim {q.shape[3]} != cache head_dim {kc[3]}")
    if not known_eq(q.shape[0], kc[0]):
        raise Skip(f"query batch {q.shape[0]} != cache batch {kc[0]}")
    _check_kernel_head_dim(q)
    if v.source.offset is not None:
        raise Skip("V is dequantized with an offset, which the op does not add back")
    if k.source.offset is not None and (call.softcap or call.sinks is not None):
        feature = "softcap" if call.softcap else "sinks"
        raise Skip(f"K centering (k_offset) with {feature}: the offset shifts every key logit by q.mu, which "
                   f"{feature} does not ignore; build the cache without k_offset for this model")
    if k.repeat != v.repeat:
        raise Skip(f"K repeated {k.repeat}x but V {v.repeat}x")
    if k.tile != v.tile:
        raise Skip(f"K tiled {k.tile}x but V {v.tile}x")
    heads, hq = kc[1] * k.repeat * k.tile, q.shape[1]
    # one kv head broadcasts over every query head, in SDPA and in matmul alike (Falcon's multi-query)
    if not (known_eq(hq % heads, 0) if call.enable_gqa or known_eq(heads, 1) else known_eq(hq, heads)):
        raise Skip(f"{hq} query heads over {heads} key heads (enable_gqa={call.enable_gqa})")
    # tiled kv heads (query head h reads kv head h mod Hkv): the op reads h // group, so the query heads
    # go into groups before it and back after (one kv head: tiled and interleaved are the same)
    tile = k.tile if k.tile > 1 and not known_eq(kc[1], 1) else 1
    if tile > 1:
        _check_tiled(call, hq)

    if k.source.ring != v.source.ring:
        raise Skip("one of K and V is read from a ring and the other is not")
    # the keys the dequantized K spans: the codes' positions, or a ring's absolute ``length``
    L = shape(k.source.node)[2] if k.source.ring else kc[2]
    if (k.length is None) != (v.length is None) or k.length is not None and not known_eq(val(k.length), val(v.length)):
        raise Skip(f"K and V keep different key counts ({k.length} vs {v.length})")
    n = L if k.length is None else val(k.length)
    sliced = not known_eq(n, L)
    windows = [_window(c.source.sliding_window) for c in (k, v)]
    if windows[0] is not windows[1] and windows[0] != windows[1]:
        raise Skip(f"K and V dequantized with different sliding windows {windows}")
    if call.bias is not None:
        _check_bias(call, q, n, sliced)
    found = {
        "mask": _mask(call.mask, n, L, sliced),
        "kv_len": _length(call, k, q.shape[2], n, L, sliced),
        "window": windows[0],
        "q": _query(call.q),
        "tile": tile,
        "is_causal": call.is_causal,
    }
    # a causal mask built as a tensor: the op's is_causal and the key terms instead (passes/causal.py)
    # (one query: its mask is [B, 1, 1, L] already; a ring's op applies the window of the ring's size)
    window = kc[2] if k.source.ring else windows[0]
    parts = None if call.is_causal or known_eq(q.shape[2], 1) else causal.factor(
        call.mask, q.shape[2], n, window if isinstance(window, int) else 0)
    if parts is not None:
        found["mask"] = ("causal", [_mask(t, n, L, sliced) for t in parts.keys], parts)
        found["q_positions"] = parts.q_positions
        found["is_causal"] = True
    if k.source.ring:
        found["store"] = _ring_store(k, v, call.anchor)
    return found


def _check_tiled(call: AttentionCall, hq: Any) -> None:
    """A site over tiled kv heads: its query heads exactly the tiled heads (no GQA on top), its output
    [B, Hq, Tq, D] (the heads to put back in order), its mask the same for every head and no per-head
    sinks (no model tiles its heads beside either)."""
    if call.enable_gqa:
        raise Skip("tiled kv heads read with enable_gqa: two groupings of the query heads")
    if call.sinks is not None or call.bias is not None:
        raise Skip("attention sinks or a score term over tiled kv heads: per-head terms in the tiled order")
    out = val(call.anchor)
    if not (isinstance(out, torch.Tensor) and out.dim() == 4 and known_eq(out.shape[1], hq)):
        raise Skip(f"the attention over tiled kv heads answers {getattr(out, 'shape', out)}, not [B, Hq, Tq, D]")
    masks = [call.mask.keep, call.mask.add] if isinstance(call.mask, WhereMask) else [call.mask]
    for m in (val(m) for m in masks if m is not None):
        if isinstance(m, torch.Tensor) and m.dim() >= 3 and not known_eq(m.shape[-3], 1):
            raise Skip(f"a mask with a head dim ({tuple(m.shape)}) over tiled kv heads")


def _check_bias(call: AttentionCall, q: torch.Tensor, n: Any, sliced: bool) -> None:
    """A score term added before the mask (``call.bias``, folded [B*H or 1, 1 or Tq, T]): over every key the
    op reads (no slice) and the query's heads a known count, so that it unfolds to [B, Hq, 1 or Tq, T]."""
    b = shape(call.bias)
    if sliced or not known_eq(b[2], n):
        raise Skip(f"a score term over {b[2]} keys, the attention over {n} of the cache's")
    if not isinstance(q.shape[1], int):
        raise Skip(f"a folded score term with a symbolic head count ({q.shape[1]})")
    if not isinstance(call.mask, WhereMask) and getattr(val(call.mask), "dtype", None) == torch.bool:
        raise Skip("a score term beside a bool mask (the op takes one additive mask)")


def _with_bias(graph: fx.Graph, mask: Any, call: AttentionCall) -> fx.Node:
    """The op's additive mask (``mask``: an additive one, or None) with ``call.bias`` (scaled by
    ``call.bias_scale``) added, unfolded to [B, Hq, 1 or Tq, T] (or [1, 1, 1 or Tq, T])."""
    b = call.bias
    b = (graph.call_method("unsqueeze", (b, 0)) if known_eq(shape(b)[0], 1)
         else graph.call_method("unflatten", (b, 0, (-1, val(call.q).shape[1]))))
    if call.bias_scale != 1.0:
        b = graph.call_function(operator.mul, (b, call.bias_scale))
    return b if mask is None else graph.call_function(operator.add, (mask, b))


def _reorder_heads(graph: fx.Graph, x: fx.Node, split: tuple) -> fx.Node:
    """``x`` [B, Hq, ...] with its heads split as ``split`` and the two factors swapped: ``(tile, -1)`` takes
    tiled heads (``j * H + g``) to grouped ones (``g * tile + j``), ``(-1, tile)`` back."""
    x = graph.call_method("unflatten", (x, 1, split))
    x = graph.call_method("transpose", (x, 1, 2))
    return graph.call_method("flatten", (x, 1, 2))


def _check_kernel_head_dim(q: torch.Tensor) -> None:
    """Where the op would run the Triton kernels (a GPU), its head dim must be one they serve; another
    (Gemma 4's 512-dim global layers) stays with the graph's own attention over the dequantized cache."""
    D = q.shape[3]
    if isinstance(D, int) and ops.kernel_backend(q.device) == "triton":
        try:
            tiles.check_head_dim(D)
        except ValueError as e:
            raise Skip(f"head_dim {D}: {e}") from None


def _query(q: fx.Node) -> fx.Node:
    """The query the op takes: ``q``, or a 16-bit query that ``q`` only upcasts to float32 (GPT-J's and
    CodeGen's ``query.to(torch.float32)``, which keeps their scores from overflowing in 16 bits). The op
    accumulates its scores in float32 from 16-bit operands exactly (the kernels scale a query beyond
    fp16's range), so the 16-bit query gives the float32 scores without the float32 dots' cost."""
    src = q.args[0] if cast_dtype(q) == torch.float32 and len(q.users) == 1 else None
    if isinstance(src, fx.Node) and getattr(val(src), "dtype", None) in (torch.float16, torch.bfloat16):
        return src
    return q


def _ring_store(k: KVChain, v: KVChain, anchor: fx.Node) -> fx.Node:
    """The ``store_kv(ring=True)`` node writing this ring between the reads and ``anchor``, with the
    layer's ``cumulative_length.add_(T)`` before ``anchor`` (the op reads the length after it)."""
    for chain in (k, v):
        for user, node in chain.shape_users():
            if node is chain.source.node and _reads_length(user):
                raise Skip("the ring's dequantized K/V has its length read (dynamic=True): the ring's codes, "
                           "which stand in for it, are shorter")
    codes = k.source.codes
    stores = [u for u in codes.users if u.op == "call_function" and u.target in STORE_KV and u.args
              and u.args[0] is codes and u.args[2] is v.source.codes]
    stores = [u for u in stores if all(before(d, u) for d in (k.source.node, v.source.node)) and before(u, anchor)]
    if len(stores) != 1:
        raise Skip(f"{len(stores)} ring stores between the ring's reads and the attention (expected one)")
    store = stores[0]
    start, new = arg(store, 6, "start"), arg(store, 4, "k")
    if start is not k.source.kv_len or not arg(store, 10, "ring", False):
        raise Skip("the ring's store does not write at the ring's length")
    if _stored_at_least(start, shape(new)[2], anchor) is None:
        raise Skip("the ring's length is not advanced by the new tokens before the attention")
    return store


def _window(w: Any) -> Any:
    """The layer's window: a constant int, or (``dynamic=True`` makes the layer's int attribute a
    symbol) the SymInt node itself, which the op takes as it is (its schema says SymInt)."""
    if isinstance(w, fx.Node) and isinstance(val(w), (int, torch.SymInt)):
        return w
    return constant(w, "sliding_window", (int,))


def _mask(mask: Any, n: Any, L: Any, sliced: bool) -> Any:
    """A mask over the graph's keys: bool (keep) or float (additive), at most 4-D, its last dim the
    key count. Returns ``mask`` or, over a slice of n < L keys, ``("pad", mask, L - n)``; a
    :class:`WhereMask` gives ``("where", keep, add)`` of those."""
    if mask is None:
        return None
    if isinstance(mask, WhereMask):
        keep, add = _mask(mask.keep, n, L, sliced), _mask(mask.add, n, L, sliced)
        if val(mask.add).dtype == torch.bool:
            raise Skip("a bool mask added to the attention scores")
        return ("where", keep, add)
    m = val(mask)
    if not isinstance(m, torch.Tensor):
        raise Skip(f"mask {mask!r} is not a tensor")
    if m.dtype != torch.bool and not m.is_floating_point():
        raise Skip(f"mask of dtype {m.dtype}")
    if m.dim() > 4:
        raise Skip(f"mask of rank {m.dim()}")
    if not known_eq(m.shape[-1], n):
        raise Skip(f"mask spans {m.shape[-1]} keys, the attention {n}")
    if not sliced:
        return mask
    if not (isinstance(n, int) and isinstance(L, int)):
        raise Skip(f"a mask over {n} of the cache's {L} keys, with symbolic sizes: nothing to pad it to the cache")
    return ("pad", mask, L - n)


def _length(call: AttentionCall, k: KVChain, tq: Any, n: Any, L: Any, sliced: bool) -> Any:
    """The op's kv_len: ``kv_len``, ``("min", kv_len, bound)`` or :class:`Skip` (module docstring)."""
    kv_len = k.source.kv_len
    if not call.is_causal:
        return ("min", kv_len, k.length) if sliced else kv_len
    if not known_le(tq, n):
        raise Skip(f"is_causal with {tq} queries over {n} keys: SDPA aligns top-left and the keys run out "
                   "before the queries do")
    stored = _stored_at_least(kv_len, tq, call.anchor)
    if stored is None:
        raise Skip(f"is_causal with {tq} queries over {n} keys: SDPA aligns top-left, the op bottom-right, and "
                   "the graph does not prove kv_len >= Tq")
    if known_eq(tq, L):
        return kv_len  # Tq <= kv_len <= L = Tq: both alignments coincide
    return ("min", kv_len, stored)


def _stored_at_least(kv_len: fx.Node, tq: Any, anchor: fx.Node) -> Any:
    """The ``T`` of this layer's ``cumulative_length.add_(T)`` with ``T == Tq`` before ``anchor``, or None."""
    if not isinstance(kv_len, fx.Node):
        return None
    for user in kv_len.users:
        if (user.op == "call_method" and user.target == "add_" and user.args[0] is kv_len and len(user.args) == 2
                and known_eq(val(user.args[1]), tq) and before(user, anchor)):
            return user.args[1]
    return None


def _reads_length(user: fx.Node) -> bool:
    """Whether a shape query on a ring's dequantized K/V may read dim 2, the one its codes differ in
    (the pass points shape queries at the codes): ``x.size()`` read only at dims 0, 1 and 3 and
    ``x.size(d)`` / ``sym_size(x, d)`` at another dim do not."""
    other = {0, 1, 3, -1, -3, -4}
    if user.op == "call_method" and user.target == "size" and len(user.args) == 1 and not user.kwargs:
        return not all(u.op == "call_function" and u.target is operator.getitem and u.args[1] in other
                       for u in user.users)
    if user.op == "call_method" and user.target == "dim":
        return False
    dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
    return dim not in other


def _emit_mask(graph: fx.Graph, mask: Any) -> Any:
    """The op's mask from :func:`_mask`'s answer (at the graph's insertion point)."""
    if not isinstance(mask, tuple):
        return mask
    if mask[0] == "pad":  # bool: padded keys are dropped (False); additive: 0 (kv_len bounds them anyway)
        return graph.call_function(F.pad, (mask[1], (0, mask[2])))
    if mask[0] == "causal":  # the key terms of a causal mask, as the mask it was (bool, or additive)
        _, terms, parts = mask
        keep = None
        for t in (_emit_mask(graph, t) for t in terms):
            keep = t if keep is None else graph.call_function(operator.and_, (keep, t))
        if keep is None or parts.fill is None:
            return keep
        return graph.call_function(torch.where, (keep, parts.zero, parts.fill))
    keep, add = _emit_mask(graph, mask[1]), _emit_mask(graph, mask[2])
    return graph.call_function(torch.where, (keep, add, float("-inf")))


def emit(call: AttentionCall, k: KVChain, v: KVChain, p: dict) -> fx.Node:
    """Insert the op before the anchor; returns the node replacing it."""
    graph = call.anchor.graph
    with graph.inserting_before(call.anchor):
        q, tile = p["q"], p["tile"]
        if tile > 1:
            q = _reorder_heads(graph, q, (tile, -1))
        # contiguous q: the op's fake returns empty_like(q) (q's strides) while kernels write a dense
        # [B, Hq, Tq, D] output; HF's q is a transposed view. Free when already dense.
        q = graph.call_method("contiguous", (q,))
        copy_meta(q, p["q"], ("nn_module_stack", "stack_trace"))
        kv_len = p["kv_len"]
        if isinstance(kv_len, tuple):
            _, length, bound = kv_len
            kv_len = graph.call_method("clamp", (length,), {"max": bound})
            copy_meta(kv_len, length, ("example_value", "val"))
        if "q_positions" in p:  # a causal mask taken apart: the keys up to the last query's position
            last = graph.call_function(operator.getitem, (p["q_positions"], -1))
            end = graph.call_function(operator.add, (last, 1))
            kv_len = graph.call_function(torch.minimum, (kv_len, end))
        mask = _emit_mask(graph, p["mask"])
        if call.bias is not None:
            mask = _with_bias(graph, mask, call)
        if "store" in p:  # a ring: the store folded in (module docstring)
            store = p["store"]
            cache_len = arg(store, 6, "start")
            out = graph.call_function(ATTENTION_RING, (
                q, k.source.codes, k.source.scale, v.source.codes, v.source.scale, cache_len,
                arg(store, 4, "k"), arg(store, 5, "v"), arg(store, 7, "k_offset"),
                None if kv_len is cache_len else kv_len, mask, p["is_causal"], call.scale, float(call.softcap),
                call.sinks, k.source.rotation, v.source.rotation, k.source.format, v.source.format,
            ))
        else:
            out = graph.call_function(ATTENTION, (
                q, k.source.codes, k.source.scale, v.source.codes, v.source.scale, kv_len, mask, p["is_causal"],
                call.scale, p["window"], float(call.softcap), call.sinks, k.source.rotation, v.source.rotation,
                k.source.format, v.source.format,
            ))
        if tile > 1:
            out = _reorder_heads(graph, out, (-1, tile))
        if call.out_folded:  # the site's [B*H, Tq, D]
            out = graph.call_method("flatten", (out, 0, 1))
        site_dtype = val(call.anchor).dtype  # a floating tensor (plan checked)
        if getattr(val(p["q"]), "dtype", None) != site_dtype:
            # the op answers in its query's dtype; the site answered in V's (GPT-J: float32 scores, P cast
            # to V's dtype before P @ V)
            copy_meta(out, p["q"], ("nn_module_stack", "stack_trace"))
            out = graph.call_method("to", (out, site_dtype))
        copy_meta(out, call.anchor)
    call.anchor.replace_all_uses_with(out)
    if "store" in p:
        graph.erase_node(p["store"])
    return out

"""Attention forms: what reads the K/V chains, and what it computes.

Each form is one handler in :data:`ATTENTION_FORMS`. ``sdpa``, ``eager`` and ``folded`` start from the K
and V chains (:mod:`.spellings`) and return an :class:`AttentionCall` (``None`` when the K
chain's consumer is not theirs; :class:`Skip` with the reason when it is, but the site does
something the op does not). ``softcap`` and ``sinks`` are stages of the eager chain:

* ``sdpa``: ``F.scaled_dot_product_attention(q, K, V, attn_mask, dropout_p, is_causal, scale,
  enable_gqa)``, positional or keyword;
* ``eager``: ``matmul(q, K.transpose(2, 3))`` [``* s`` or ``/ s``] [softcap] [``torch.where(bool mask,
  scores, fill <= -1e30)``, GPT-Neo] [``+ mask``] ->
  ``softmax(dim=-1[, dtype])`` [a cast to V's dtype (``.to`` / ``.type``) / ``dropout`` in either
  order] -> ``matmul(P, V)`` (Llama's ``eager_attention_forward`` and its copies; GPT-2's ``.type``,
  GPT-J's and CodeGen's scores in float32 from ``query.to(torch.float32)``);
* ``folded`` (GPT-NeoX-Japanese, Bloom): the heads folded into the batch, ``baddbmm(zeros, q.view(B*H, Tq, D),
  K.view(B*H, T, D).transpose(1, 2), alpha=s)`` (or ``bmm`` [``* s``]) ``.view(B, H, Tq, T)``, then the eager
  chain from the scores on. Bloom: baddbmm's input is its ALiBi term, ``alibi.baddbmm(batch1=q, batch2=K^T,
  beta, alpha)`` with ``alibi`` [B*H, 1, T] (``AttentionCall.bias``: the rewrite adds it to the op's additive
  mask), and ``P @ V`` folded too, ``bmm(P.view(B*H, Tq, T), V.reshape(B*H, T, D))`` (the op's output is
  folded back to [B*H, Tq, D]);
* ``softcap`` (Gemma 2): ``scores / c -> tanh -> * c`` right after the scaling, before the mask;
* ``sinks`` (gpt-oss): in place of the softmax, ``cat([scores, sink column], dim=-1)``
  [``- max(dim=-1, keepdim=True)``] ``-> softmax -> [..., :-1]``, the column a ``[Hq]`` tensor
  reshaped to ``[1, Hq, 1, 1]`` and expanded; or (GraniteSWA) after attention: the masked scores
  read by ``logsumexp(dim=-1)`` and the softmax, and ``P @ V`` multiplied by
  ``sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1)`` (:func:`lse_sinks`; the same sink logit).

Every intermediate of a form (but the scores that GraniteSWA's sinks read) must have one reader:
an attention whose probabilities are returned (``output_attentions=True``) or read by anything
else is left alone, with the reason.
Anything else on the scores (a second additive term such as an ALiBi or position bias added after the
scores, a ``masked_fill``, a different normalisation) does not match and is reported.

The sinks stage is :mod:`.sinks`; what a form returns (:class:`AttentionCall`) is :mod:`.call`.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .call import (  # noqa: F401  (AttentionCall, WhereMask: re-exported for .rewrite)
    DROPOUT, LOGSUMEXP, SDPA, SOFTMAX, AttentionCall, WhereMask, check_softmax)
from .graph import (
    ADD, DIV, MATMUL, MUL, SUB, Skip, arg, cast_dtype, constant, describe, is_call, known_eq, only_user,
    scalar_operand, shape, val, value_users,
)
from .spellings import KVChain
from .sinks import lse_sinks, sinks

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


# ---------------------------------------------------------------------------------------------
# SDPA
# ---------------------------------------------------------------------------------------------


def sdpa(k: KVChain, v: KVChain) -> Optional[AttentionCall]:
    node = k.consumer
    if not (node.op == "call_function" and node.target is SDPA):
        return None
    unknown = set(node.kwargs) - set(_SDPA_ARGS)
    if unknown:
        raise Skip(f"unsupported SDPA arguments {sorted(unknown)}")
    a = dict(zip(_SDPA_ARGS, node.args))
    a.update(node.kwargs)
    if a.get("key") is not k.end:
        return None  # k is not SDPA's key: the other order of the site's chains, or no attention over the cache
    if a.get("value") is not v.end or v.consumer is not node:
        raise Skip("the cache's V is not SDPA's value")
    dropout = constant(a.get("dropout_p", 0.0), "dropout_p", (int, float))
    if dropout != 0:
        raise Skip(f"dropout_p={dropout} (the op has no dropout)")
    is_causal = constant(a.get("is_causal", False), "is_causal", (bool,))
    scale = a.get("scale")
    if scale is not None:
        scale = float(constant(scale, "scale", (int, float)))
    mask = a.get("attn_mask")
    if mask is not None and is_causal:
        raise Skip("both attn_mask and is_causal")
    return AttentionCall(
        form="sdpa", anchor=node, q=a["query"], key=k.end, value=v.end, mask=mask, is_causal=is_causal,
        scale=scale, enable_gqa=bool(constant(a.get("enable_gqa", False), "enable_gqa", (bool,))), nodes=[node],
    )


# ---------------------------------------------------------------------------------------------
# the eager chain and its stages
# ---------------------------------------------------------------------------------------------


def _transposes_keys(node: fx.Node, x: fx.Node) -> bool:
    """``x.transpose(2, 3)`` / ``x.transpose(-1, -2)`` / ``torch.transpose(x, 2, 3)``."""
    if not (is_call(node, "transpose", torch.transpose) and node.args and node.args[0] is x):
        return False
    dims = [arg(node, 1, "dim0"), arg(node, 2, "dim1")]
    return all(isinstance(d, int) for d in dims) and {d % 4 for d in dims} == {2, 3}


def eager(k: KVChain, v: KVChain) -> Optional[AttentionCall]:
    t = k.consumer
    if not _transposes_keys(t, k.end):
        return None
    m1 = only_user(t, "K^T")
    if not (is_call(m1, *MATMUL) and len(m1.args) == 2 and m1.args[1] is t):
        raise Skip(f"K^T feeds {describe(m1)}, not matmul(q, K^T)")
    call = AttentionCall(form="eager", anchor=m1, q=m1.args[0], key=k.end, value=v.end, nodes=[t, m1])
    return _scores_to_output(_scaling(m1, call), call, v)


_VIEW = ("view", "reshape", torch.reshape)


def _folded(node: Any, x: fx.Node) -> bool:
    """``node`` is ``x.view(B * H, T, D)`` (or a reshape) of a ``[B, H, T, D]`` value: its heads folded into
    the batch."""
    if not (is_call(node, *_VIEW) and node.args and node.args[0] is x):
        return False
    s4, s3 = shape(x), shape(node)
    return (s4 is not None and s3 is not None and len(s4) == 4 and len(s3) == 3
            and known_eq(s3[0], s4[0] * s4[1]) and known_eq(s3[1], s4[2]) and known_eq(s3[2], s4[3]))


def folded(k: KVChain, v: KVChain) -> Optional[AttentionCall]:
    """The heads folded into the batch for a batched product (GPT-NeoX-Japanese):
    ``baddbmm(zeros, q.view(B*H, Tq, D), K.view(B*H, T, D).transpose(1, 2), beta=1, alpha=s)`` (or
    ``bmm(q, K^T)`` [``* s``]) ``.view(B, H, Tq, T)``, then the eager chain from the scores on."""
    kv = k.consumer
    if not _folded(kv, k.end):
        return None
    t = only_user(kv, "the folded K")
    if not (is_call(t, "transpose", torch.transpose) and t.args[0] is kv
            and {d % 3 for d in (arg(t, 1, "dim0"), arg(t, 2, "dim1")) if isinstance(d, int)} == {1, 2}):
        raise Skip(f"the folded K feeds {describe(t)}, not its transpose(1, 2)")
    m = only_user(t, "the folded K^T")
    call = AttentionCall(form="eager+folded", anchor=m, q=None, key=k.end, value=v.end, nodes=[kv, t, m])
    if is_call(m, torch.bmm, *MATMUL) and len(m.args) == 2 and m.args[1] is t and not m.kwargs:
        q3, scale = m.args[0], None
    elif (is_call(m, torch.baddbmm, "baddbmm") and arg(m, 2, "batch2") is t
          and set(m.kwargs) <= {"batch1", "batch2", "beta", "alpha"}):
        # torch.baddbmm(input, batch1, batch2) or Bloom's input.baddbmm(batch1=..., batch2=...)
        base, q3 = m.args[0], arg(m, 1, "batch1")
        beta = float(constant(m.kwargs.get("beta", 1), "baddbmm beta", (int, float)))
        if is_call(base, torch.zeros) or beta == 0:
            if isinstance(base, fx.Node):
                call.nodes.append(base)  # erased once dead
        else:
            call.bias, call.bias_scale = _folded_bias(base, m), beta
        scale = float(constant(m.kwargs.get("alpha", 1.0), "baddbmm alpha", (int, float)))
    else:
        raise Skip(f"the folded K^T feeds {describe(m)}, not bmm / baddbmm(q, K^T)")
    if not (isinstance(q3, fx.Node) and is_call(q3, *_VIEW) and q3.args and _folded(q3, q3.args[0])
            and known_eq(shape(q3.args[0])[1], shape(k.end)[1])):
        raise Skip(f"the folded query {q3} is not a [B, H, Tq, D] query viewed as [B*H, Tq, D]")
    call.q = q3.args[0]
    call.nodes.append(q3)
    back = only_user(m, "the folded attention scores")
    sq, sk, sb = shape(call.q), shape(k.end), shape(back)
    if not (is_call(back, *_VIEW) and back.args[0] is m and sb is not None and len(sb) == 4
            and all(known_eq(a, b) for a, b in zip(sb, (sq[0], sq[1], sq[2], sk[2])))):
        raise Skip(f"the folded attention scores feed {describe(back)}, not their view as [B, H, Tq, T]")
    call.nodes.append(back)
    if scale is None:
        x = _scaling(back, call)
    else:
        call.scale, x = scale, back
    return _scores_to_output(x, call, v)


def _folded_bias(base: Any, scores: fx.Node) -> fx.Node:
    """baddbmm's ``input`` as a score term: a folded [B*H or 1, 1 or Tq, T] tensor (Bloom's ALiBi,
    [B*H, 1, T]) that broadcasts over the folded scores [B*H, Tq, T] along its size-1 dims."""
    b, sc = shape(base) if isinstance(base, fx.Node) else None, shape(scores)
    if not (b is not None and len(b) == 3 and sc is not None and known_eq(b[2], sc[2])
            and (known_eq(b[0], sc[0]) or known_eq(b[0], 1)) and (known_eq(b[1], sc[1]) or known_eq(b[1], 1))):
        raise Skip(f"baddbmm adds {describe(base) if isinstance(base, fx.Node) else repr(base)} of shape {b} to the "
                   f"scores {sc}: not a [B*H or 1, 1 or Tq, T] term the op can take as an additive mask")
    return base


def _scores_to_output(x: fx.Node, call: AttentionCall, v: KVChain) -> AttentionCall:
    """The eager chain from the scaled scores ``x`` to ``P @ V``: softcap, masks, softmax or sinks, cast and
    dropout."""
    x = softcap(x, call)
    x = _where_mask(x, call)
    x = _mask(x, call)
    readers = value_users(x)
    sink_scale = None
    if len(readers) == 2 and any(is_call(u, *LOGSUMEXP) for u in readers):
        sink_scale, nxt = lse_sinks(x, readers, call)
    else:
        nxt = only_user(x, "the attention scores")
    if is_call(nxt, torch.cat):
        p = sinks(x, nxt, call)
    elif is_call(nxt, *SOFTMAX) and nxt.args[0] is x:
        check_softmax(nxt, call)
        call.nodes.append(nxt)
        p = nxt
    else:
        raise Skip(f"the attention scores feed {describe(nxt)} ({nxt.name}), not softmax: a score term the op does "
                   "not have (a position bias such as ALiBi, masked_fill, another normalisation)")
    p = _cast_and_dropout(p, call)
    m2 = only_user(p, "the attention probabilities")
    if _folded(m2, p) and _folded(v.consumer, v.end):
        # Bloom: P and V folded for bmm(P.view(B*H, Tq, T), V.reshape(B*H, T, D)) -> [B*H, Tq, D]
        m3 = only_user(m2, "the folded attention probabilities")
        if not (is_call(m3, torch.bmm, *MATMUL) and len(m3.args) == 2 and not m3.kwargs and m3.args[0] is m2
                and m3.args[1] is v.consumer and only_user(v.consumer, "the folded V") is m3):
            raise Skip(f"the folded attention probabilities feed {describe(m3)} ({m3.name}), not bmm(P, V) over the "
                       "cache's folded V")
        call.nodes += [m2, v.consumer]
        call.out_folded, m2 = True, m3
    elif not (is_call(m2, *MATMUL) and len(m2.args) == 2 and m2.args[0] is p and m2.args[1] is v.end
              and v.consumer is m2):
        raise Skip(f"the attention probabilities feed {describe(m2)} ({m2.name}), not matmul(P, V) over the cache's V")
    call.nodes.append(m2)
    call.anchor = m2
    if sink_scale is not None:
        out = only_user(m2, "the attention output")
        if not (is_call(out, *MUL) and len(out.args) == 2 and not out.kwargs and set(out.args) == {m2, sink_scale}):
            raise Skip(f"the attention output feeds {describe(out)} ({out.name}), not its product with the sink scale")
        call.nodes.append(out)
        call.anchor = out
    return call


def _scaling(x: fx.Node, call: AttentionCall) -> fx.Node:
    """``scores * s`` or ``scores / s`` (a constant); none means scale 1 (the query came pre-scaled)."""
    nxt = only_user(x, "the attention scores")
    mul, div = scalar_operand(nxt, MUL), scalar_operand(nxt, DIV)
    if mul is not None and mul[0] is x:
        call.scale = float(constant(mul[1], "score scaling", (int, float)))
    elif div is not None and div[0] is x and not is_call(only_user(nxt, "the scaled scores"), torch.tanh):
        call.scale = 1.0 / float(constant(div[1], "score scaling", (int, float)))
    else:
        call.scale = 1.0
        return x
    call.nodes.append(nxt)
    return nxt


def softcap(x: fx.Node, call: AttentionCall) -> fx.Node:
    """Gemma 2's logit softcapping: ``scores / c -> tanh -> * c`` (the same constant c) -> op ``softcap=c``."""
    div = only_user(x, "the scaled attention scores")
    d = scalar_operand(div, DIV)
    if d is None or d[0] is not x:
        return x
    tanh = only_user(div, "the softcap division")
    if not (is_call(tanh, torch.tanh, "tanh") and tanh.args[0] is div):
        return x  # not a softcap; the next stage reports what this division is
    mul = only_user(tanh, "the softcap tanh")
    m = scalar_operand(mul, MUL)
    c = float(constant(d[1], "softcap", (int, float)))
    if m is None or m[0] is not tanh or float(constant(m[1], "softcap", (int, float))) != c:
        raise Skip(f"tanh(scores / {c}) is not multiplied back by {c} (not a logit softcap)")
    if not c > 0:
        raise Skip(f"softcap {c} is not positive")
    call.softcap = c
    call.form += "+softcap"
    call.nodes.extend([div, tanh, mul])
    return mul


# a fill at or below this masks a key: exp(fill - max) is 0 in float32 for any score the op sees
_MASKING_FILL = -1e30


def _fill_value(fill: Any) -> Optional[float]:
    """The number a ``torch.where`` fill stands for: a Python number, or ``torch.tensor(number, ...)``
    built in the graph (GPT-Neo's ``torch.finfo(dtype).min``); None otherwise."""
    if isinstance(fill, (int, float)) and not isinstance(fill, bool):
        return float(fill)
    if is_call(fill, torch.tensor) and fill.args and isinstance(fill.args[0], (int, float)):
        return float(fill.args[0])
    return None


def _where_mask(x: fx.Node, call: AttentionCall) -> fx.Node:
    """A bool mask applied by ``torch.where(mask, scores, fill)`` with a masking fill (GPT-Neo's band /
    causal mask, ``torch.finfo(dtype).min``) -> the op's bool mask (keep where True). An additive mask
    after it joins it in :func:`_mask`."""
    nxt = only_user(x, "the attention scores")
    if not (is_call(nxt, torch.where, "where") and len(nxt.args) == 3 and not nxt.kwargs and nxt.args[1] is x):
        return x
    cond, fill = nxt.args[0], nxt.args[2]
    c = val(cond)
    if not (isinstance(c, torch.Tensor) and c.dtype == torch.bool):
        what = describe(cond) if isinstance(cond, fx.Node) else repr(cond)
        raise Skip(f"torch.where over the attention scores selects by {what}, not by a bool mask")
    f = _fill_value(fill)
    if f is None or not f <= _MASKING_FILL:
        raise Skip(f"torch.where(mask, scores, fill) fills with {fill!r}, not a masking value (<= {_MASKING_FILL:g})")
    call.mask = cond
    call.nodes.append(nxt)
    if isinstance(fill, fx.Node):
        call.nodes.append(fill)  # erased with the form's nodes once dead
    return nxt


def _mask(x: fx.Node, call: AttentionCall) -> fx.Node:
    nxt = only_user(x, "the attention scores")
    if not (is_call(nxt, *ADD) and len(nxt.args) == 2 and not nxt.kwargs and x in nxt.args):
        return x
    if nxt.target is operator.iadd and nxt.args[0] is not x:
        raise Skip("the attention scores are added into the mask in place (mask += scores), which the op would not do")
    other = nxt.args[1] if nxt.args[0] is x else nxt.args[0]
    if not isinstance(val(other), torch.Tensor):
        raise Skip(f"the attention scores are shifted by {other!r}, not by a mask tensor")
    # after a where-mask both apply: the op gets one additive mask, built by the rewrite
    call.mask = other if call.mask is None else WhereMask(call.mask, other)
    call.nodes.append(nxt)
    after = value_users(nxt)  # several readers: reported by the stage that reads them
    if len(after) == 1 and is_call(after[0], *ADD, *SUB):
        raise Skip("a second additive term on the attention scores (a position bias such as ALiBi?)")
    return nxt


def _cast_and_dropout(p: fx.Node, call: AttentionCall) -> fx.Node:
    """A cast (``.to(dtype)``, ``.type(dtype)``) and inference dropout, each at most once, in either order.
    The op keeps its probabilities in float32 whatever the cast; the site's output dtype is kept
    (:func:`kvcompile.passes.rewrite.emit`)."""
    seen = set()
    while True:
        nxt = only_user(p, "the attention probabilities")
        if nxt.op == "call_method" and nxt.target in ("to", "type") and "to" not in seen:
            if cast_dtype(nxt, p) is None:
                raise Skip(f"the attention probabilities are converted with {describe(nxt)}{nxt.args[1:]}")
            seen.add("to")
        elif is_call(nxt, *DROPOUT) and "dropout" not in seen:
            if nxt.target is torch.dropout:
                p_drop, training = arg(nxt, 1, "p"), arg(nxt, 2, "train")
            else:
                p_drop, training = arg(nxt, 1, "p", 0.5), arg(nxt, 2, "training", True)
            p_drop = constant(p_drop, "dropout p", (int, float))
            training = constant(training, "dropout training", (bool,))
            if p_drop != 0 and training:
                raise Skip(f"dropout p={p_drop} in training mode (the op has no dropout)")
            seen.add("dropout")
        else:
            break
        call.nodes.append(nxt)
        p = nxt
    return p


ATTENTION_FORMS: dict[str, Callable] = {"sdpa": sdpa, "eager": eager, "folded": folded, "softcap": softcap,
                                        "sinks": sinks}

#: the forms tried on a site, in order.
SITE_FORMS = (sdpa, eager, folded)

__all__ = ["ATTENTION_FORMS", "AttentionCall", "SITE_FORMS"]

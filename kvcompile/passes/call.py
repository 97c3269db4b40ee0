"""What an attention form hands the rewrite (:class:`AttentionCall`, :class:`WhereMask`), the call
targets the forms match (SDPA, softmax, logsumexp, dropout) and the softmax check they share.
The base of :mod:`.forms` and :mod:`.sinks` (which import it; it imports neither)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph import Skip, arg, val

__all__ = ["AttentionCall", "WhereMask", "SDPA", "SOFTMAX", "LOGSUMEXP", "DROPOUT", "check_softmax"]

SDPA = F.scaled_dot_product_attention
SOFTMAX = (F.softmax, torch.softmax, "softmax")
LOGSUMEXP = (torch.logsumexp, "logsumexp")
DROPOUT = (F.dropout, torch.dropout)


@dataclasses.dataclass(frozen=True)
class WhereMask:
    """A bool mask and an additive one on the same scores (GPT-Neo: ``torch.where(keep, s, min) +
    add``): the rewrite passes the op ``torch.where(keep, add, -inf)``."""

    keep: fx.Node
    add: fx.Node


@dataclasses.dataclass
class AttentionCall:
    """What one attention site computes, in the op's terms (before the common checks of :mod:`.rewrite`)."""

    form: str
    anchor: fx.Node  # the node whose value the op replaces
    q: fx.Node
    key: fx.Node  # the K value attention reads (the K chain's end)
    value: fx.Node
    mask: Any = None  # a bool / additive mask node, or a WhereMask
    is_causal: bool = False
    scale: Optional[float] = None
    enable_gqa: bool = False
    softcap: float = 0.0
    sinks: Optional[fx.Node] = None
    # a score term the form adds before the mask, folded [B*H or 1, 1 or Tq, T] (Bloom's ALiBi as baddbmm's
    # input), and its factor (baddbmm's beta): the rewrite adds it, unfolded, to the op's additive mask
    bias: Optional[fx.Node] = None
    bias_scale: float = 1.0
    out_folded: bool = False  # the site answers [B*H, Tq, D] (P @ V as a folded bmm): the op's output folded
    nodes: list = dataclasses.field(default_factory=list)  # the form's nodes (erased once dead)


def check_softmax(node: fx.Node, call: AttentionCall) -> None:
    """A softmax the op computes: over the key dim, in float32 or q's dtype (else :class:`Skip`)."""
    dim = arg(node, 1, "dim")
    if dim not in (-1, 3):
        raise Skip(f"softmax over dim {dim!r}, not the key dim")
    dtype = node.kwargs.get("dtype")
    if node.target is F.softmax and len(node.args) > 3:
        dtype = node.args[3]
    elif node.target is torch.softmax and len(node.args) > 2:
        dtype = node.args[2]
    q = val(call.q)
    if dtype not in (None, torch.float32, getattr(q, "dtype", None)):
        raise Skip(f"softmax in {dtype}")

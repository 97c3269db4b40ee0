"""Tiny Hugging Face models and drivers shared by the pass/backend tests (a helper module: no tests here).

Every config is the real architecture shrunk to 2 layers and hidden 64 so that Dynamo tracing
and Inductor's CPU compile stay within CI's 2 cores; the real sizes are in the comments.
"""

from __future__ import annotations

import inspect
import operator

import pytest
import torch
import torch.nn.functional as F

import kvcompile
from kvcompile.passes import KVAttentionPass
from models import cache_kwarg, tiny_model
from utils import fmt_of  # noqa: E402

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)

# family -> (tiny kwargs on top of _COMMON, kv_dtype the cache uses in tests); real sizes in models.py
FAMILIES = {
    "llama": (dict(num_attention_heads=4, num_key_value_heads=2), "fp8_e4m3"),  # GQA
    "mistral": (dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=4096), "fp8_e4m3"),  # MQA
    "qwen2": (dict(num_attention_heads=4, num_key_value_heads=2), "fp8_e4m3"),
    "qwen3": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32), "q8_0"),
    "phi3": (dict(num_attention_heads=4, num_key_value_heads=4, sliding_window=None,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2), "fp8_e4m3"),  # MHA
    "gemma": (dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32), "q8_0"),  # MQA
}

MAX_LEN = 32
BATCH = 2
PROMPT = 6


def make_model(family: str, attn: str, seed: int = 0):
    kw, kv_dtype = FAMILIES[family]
    return tiny_model(family, attn, seed=seed, **_COMMON, **kw), kv_dtype


def model_cache(model, kv_dtype: str, max_len: int = MAX_LEN, batch: int = BATCH, padded: bool = False):
    """A QuantizedCache on CPU. ``padded=True`` turns prompt-mean K centering off where the cache has
    it: that mean includes the padded positions, whose hidden states are implementation-defined
    (a query row with no visible key), so centering would let them leak into real tokens' codes."""
    kw = {}
    if padded and "center_keys" in inspect.signature(kvcompile.QuantizedCache).parameters:
        kw["center_keys"] = False
    return kvcompile.QuantizedCache(model.config, max_batch_size=batch, max_cache_len=max_len, kv_dtype=kv_dtype,
                                    device="cpu", **kw)


def prompt(padded: bool, batch: int = BATCH, length: int = PROMPT, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        mask[0, :3] = 0  # left padding on the first row
        ids[0, :3] = 0
    return ids, mask


def greedy(forward, model, cache, ids, mask, steps: int):
    """Prefill + ``steps`` greedy decode steps through ``forward``; returns the logits of each call
    (at real positions only: padded query rows are undefined under any attention). An unpadded
    prompt is run with ``attention_mask=None`` (HF still builds a causal mask while tracing)."""
    kw = cache_kwarg(model)
    real = mask.bool()
    unpadded = bool(real.all())  # then the model gets attention_mask=None: the "no mask" case
    outs = []
    with torch.no_grad():
        logits = forward(input_ids=ids, attention_mask=None if unpadded else mask, use_cache=True, **{kw: cache}).logits
        outs.append(logits[real])
        for _ in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits = forward(input_ids=nxt, attention_mask=None if unpadded else mask, use_cache=True,
                             **{kw: cache}).logits
            outs.append(logits[:, -1])
    return outs


# ---------------------------------------------------------------------------------------------
# a backend that runs the pass only (no Inductor) and keeps each graph before/after
# ---------------------------------------------------------------------------------------------

SDPA = F.scaled_dot_product_attention
DEQUANTIZE = torch.ops.kvcompile.dequantize.default
ATTENTION = torch.ops.kvcompile.attention.default


def op_counts(graph: torch.fx.Graph) -> dict:
    """Attention ops, and the K/V spellings of :data:`kvcompile.passes.KV_SPELLINGS` by their node kinds."""
    c = {"sdpa": 0, "softmax": 0, "dequantize": 0, "kv_attention": 0, "matmul": 0,
         "expand": 0, "repeat_interleave": 0, "torch.repeat_interleave": 0, "repeat": 0, "getitem": 0, "contiguous": 0,
         "cast": 0}
    for n in graph.nodes:
        if n.op == "call_method" and n.target in ("expand", "repeat_interleave", "repeat", "contiguous"):
            c[n.target] += 1
        if n.op == "call_method" and n.target in ("to", "type", "float", "half", "bfloat16"):
            c["cast"] += 1
        if n.op != "call_function":
            continue
        if n.target is torch.repeat_interleave:
            c["torch.repeat_interleave"] += 1
        elif n.target is operator.getitem:
            c["getitem"] += 1
        if n.target is SDPA:
            c["sdpa"] += 1
        elif n.target in (F.softmax, torch.softmax):
            c["softmax"] += 1
        elif n.target in (DEQUANTIZE, torch.ops.kvcompile.dequantize):
            c["dequantize"] += 1
        elif n.target is ATTENTION:
            c["kv_attention"] += 1
        elif n.target in (torch.matmul, operator.matmul):
            c["matmul"] += 1
    return c


class PassOnly:
    """torch.compile backend: KVAttentionPass then run the rewritten graph eagerly.

    ``attention``: a function run in place of every emitted ``kvcompile::attention`` (same
    arguments), e.g. :func:`attention_oracle` for features this build's kernels do not implement.
    ``calls`` keeps the emitted nodes' arguments, one list per graph."""

    def __init__(self, kv_dtype: str, attention=None):
        self.graph_pass = KVAttentionPass(kv_dtype)
        self.graphs = []  # (counts before, counts after, report)
        self.calls = []  # per graph: [args of each emitted kvcompile::attention]
        self.attention = attention

    def __call__(self, gm, example_inputs, **_):
        before = op_counts(gm.graph)
        report = self.graph_pass.apply(gm.graph)
        gm.graph.lint()
        emitted = [n for n in gm.graph.nodes if n.target is ATTENTION]
        self.calls.append([n.args for n in emitted])
        self.graphs.append((before, op_counts(gm.graph), report))
        if self.attention is not None:
            for n in emitted:
                n.target = self.attention
        gm.recompile()
        return gm.forward


def attention_oracle(q, k_q, k_scale, v_q, v_scale, kv_len, attn_mask, is_causal, scale, sliding_window=0,
                     softcap=0.0, sinks=None, k_rotation=None, v_rotation=None, k_format=-1, v_format=-1):
    """``kvcompile::attention`` as its contract states it (window, softcap, sinks and the codes of a
    rotated side un-rotated: ``x @ R^T``), in float64."""
    B, Hq, Tq, D = q.shape
    Hkv, L = k_q.shape[1], k_q.shape[2]
    k = kvcompile.formats.dequantize(k_q, k_scale, torch.float64)
    v = kvcompile.formats.dequantize(v_q, v_scale, torch.float64)
    if k_rotation is not None:
        k = k @ k_rotation.double().t()
    if v_rotation is not None:
        v = v @ v_rotation.double().t()
    k = k.repeat_interleave(Hq // Hkv, dim=1)
    v = v.repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(q.double(), k.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    kvl = kv_len.reshape(-1).expand(B).view(B, 1, 1, 1).long()
    pos = torch.arange(L).view(1, 1, 1, L)
    q_pos = kvl - Tq + torch.arange(Tq).view(1, 1, Tq, 1)
    valid = pos < kvl
    if is_causal:
        valid = valid & (pos <= q_pos)
    if sliding_window:
        valid = valid & (pos > q_pos - sliding_window)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            valid = valid & attn_mask
        else:
            s = s + attn_mask.double()
    s = s.masked_fill(~valid, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, Hq, 1, 1).expand(B, Hq, Tq, 1)], dim=-1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    if sinks is not None:
        p = p[..., :-1]
    return torch.matmul(p, v).to(q.dtype)


def fresh_dynamo():
    torch._dynamo.reset()


requires_family = pytest.mark.parametrize("family", list(FAMILIES))

"""The attention rewrite: ``attention(q, dequantize(K), dequantize(V))`` -> ``kvcompile::attention``.

Graph stage: the Dynamo graph, before AOTAutograd (pre-AOT)
-----------------------------------------------------------
The pass runs on the torch-level FX graph Dynamo hands to the backend, before ``compile_fx``:

* attention is one ``F.scaled_dot_product_attention`` node on every device. Post-grad it has
  become a device-specific aten op (``_scaled_dot_product_flash_attention_for_cpu`` on CPU,
  ``_scaled_dot_product_cudnn_attention`` / ``_efficient_`` / ``_flash_`` on CUDA, chosen by
  dtype, mask and head_dim), so a post-grad pass would need one pattern per backend op and
  would silently miss the ones it did not list;
* the eager spelling (matmul, ``F.softmax``, ``F.dropout``) is still whole; post-grad it is
  decomposed into bmm/amax/exp/sum/div with views between them;
* ``kvcompile::dequantize`` reads the cache tensors themselves (graph inputs). Post-grad it reads
  outputs of ``auto_functionalized_v2(store_kv)`` and the pattern matcher refuses matches that
  cross that mutation; pre-AOT the mutation (``store_kv``, ``cumulative_length.add_``) comes
  *before* dequantize and attention, so the matched nodes share one mutation region;
* node metadata (``example_value`` fake tensors, ``nn_module_stack``) gives shapes for the
  checks below and layer names for the report;
* the rewritten graph is what AOTAutograd traces and what the FX graph cache keys on, so the
  cache stays valid without hooking Inductor's config (the pass still has a ``uuid()``).

Pattern matching
----------------
Torch's pattern matcher (``torch._inductor.pattern_matcher``) with one explicit pattern per HF
spelling (``PATTERNS`` below). A pattern fixes the *structure* (which ops feed which); the
handler reads the *semantics* off the matched nodes (mask, scale, dropout, causal flag, GQA
factor, shapes) and rewrites only what it can prove equal, recording a reason otherwise.

What the rewrite relies on
--------------------------
``kvcompile::attention`` excludes keys at positions ``>= kv_len``. ``kvcompile::dequantize``
returns zeros there and the attention above it would see those zero keys unless masked.
Hugging Face masks for this cache (``get_mask_sizes`` returns ``max_cache_len``) always mask
positions past the current length for every real query, so the rewrite is exact for HF models.
An attention with *no* mask and ``is_causal=False`` over the whole cache is rewritten too: the
op then attends to the stored tokens only, which is what the model means (HF never builds that
graph for a cache longer than its contents under torch.compile: masks are always materialised
while tracing).

SDPA's ``is_causal`` is top-left aligned (query ``i`` sees keys ``<= i``); the op's is
bottom-right (query ``i`` sits at ``kv_len - Tq + i``). They agree when ``Tq == L`` (then
``kv_len == L``). Otherwise the pass proves ``kv_len >= Tq`` from the graph (the same layer's
``cumulative_length.add_(Tq)`` precedes the attention) and passes ``min(kv_len, Tq)`` as the
length, which reproduces top-left exactly: query ``i`` sees keys ``0..i``. Without that proof
the site is skipped.

Two more differences, both outside what a model can observe: the K centering offset that
``dequantize`` adds back is dropped (every key of a query shifts by the same ``q . mu``, which
softmax ignores; float32 rounding differs at the 1e-7 level), and a query row with no visible key
(a left-padding position) gets zeros (bool mask) or an average over the stored keys (additive
``finfo.min`` mask) from the op, where SDPA/eager average over all ``L`` slots; real tokens never
attend to those rows.

Spellings (``PATTERNS``): K/V arrive ``direct`` (MHA, or SDPA ``enable_gqa=True``), through HF
``repeat_kv`` (unsqueeze-expand-reshape), or ``repeat_interleave`` (method or function), into
``F.scaled_dot_product_attention`` (any mask / is_causal / scale, positional or keyword) or the
eager chain ``matmul(q, K^T) * s (+ mask) -> softmax(fp32) -> .to / dropout (either order, or no
dropout) -> matmul(P, V)``. Anything else over the cache (softcapping, sinks, ALiBi bias, returned
attention weights) is left unchanged and reported with a reason. ``dynamic=True`` works when
Python floats are specialised (``torch._dynamo.config.specialize_float``, the default for
``dynamic=None``); otherwise the scaling is a graph input and the site is skipped with that hint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import operator
import re
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import (
    CallFunction,
    CallMethod,
    Ignored,
    MULTIPLE,
    KeywordArg,
    Match,
    PatternExpr,
    PatternMatcherPass,
    register_graph_pattern,
)
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .. import formats

log = logging.getLogger("kvcompile")

__all__ = ["KVAttentionPass", "PassReport", "PATTERNS", "KVDtypeMismatch"]

DEQUANTIZE = torch.ops.kvcompile.dequantize.default
# Dynamo records ``ops.dequantize(...)`` (the custom_op wrapper) as the overload, and a direct
# ``torch.ops.kvcompile.dequantize(...)`` call as the packet: accept both.
DEQUANTIZE_TARGETS = (DEQUANTIZE, torch.ops.kvcompile.dequantize)
ATTENTION = torch.ops.kvcompile.attention.default
SDPA = F.scaled_dot_product_attention
MATMUL = [torch.matmul, operator.matmul]

# keyword order of F.scaled_dot_product_attention after (query, key, value)
_SDPA_KWARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class KVDtypeMismatch(ValueError):
    """The graph reads a kvcompile cache whose kv_dtype is not the backend's."""


# ---------------------------------------------------------------------------------------------
# K/V provenance: how the dequantized cache reaches attention (one sub-pattern per spelling)
# ---------------------------------------------------------------------------------------------


def _dequantized(kv: str) -> PatternExpr:
    """``kvcompile::dequantize(codes, scale, offset, kv_len, dtype)``; kv_len shared by K and V."""
    return CallFunction(
        list(DEQUANTIZE_TARGETS),
        KeywordArg(f"{kv}_codes"),
        KeywordArg(f"{kv}_scale"),
        Ignored(),  # K centering offset: softmax-invariant, never read by the op
        KeywordArg("kv_len"),
        KeywordArg(f"{kv}_dtype"),
        # K/V nodes: besides attention only shape queries (``x.size()`` under dynamic=True) may read
        # them; the handler checks that (see _shape_query_users)
        _users=MULTIPLE,
    )


def kv_direct(kv: str) -> PatternExpr:
    """The dequantized cache used as is (MHA, or SDPA with ``enable_gqa=True``)."""
    return _dequantized(kv)


def kv_repeat_expand(kv: str) -> PatternExpr:
    """HF ``repeat_kv``: ``x[:, :, None, :, :].expand(B, H, n, L, D).reshape(B, H * n, L, D)``."""
    unsqueezed = CallFunction(operator.getitem, _dequantized(kv), Ignored(), _users=MULTIPLE)
    expanded = CallMethod("expand", unsqueezed, Ignored(), Ignored(), Ignored(), Ignored(), Ignored(), _users=MULTIPLE)
    return CallMethod("reshape", expanded, Ignored(), Ignored(), Ignored(), Ignored(), _users=MULTIPLE)


def kv_repeat_interleave_method(kv: str) -> PatternExpr:
    """``x.repeat_interleave(n, dim=1)``."""
    return CallMethod("repeat_interleave", _dequantized(kv), Ignored(), _users=MULTIPLE)


def kv_repeat_interleave_function(kv: str) -> PatternExpr:
    """``torch.repeat_interleave(x, n, dim=1)``."""
    return CallFunction(torch.repeat_interleave, _dequantized(kv), Ignored(), _users=MULTIPLE)


KV_SPELLINGS: dict[str, Callable[[str], PatternExpr]] = {
    "direct": kv_direct,
    "repeat_kv": kv_repeat_expand,
    "repeat_interleave": kv_repeat_interleave_method,
    "torch.repeat_interleave": kv_repeat_interleave_function,
}


# ---------------------------------------------------------------------------------------------
# attention spellings
# ---------------------------------------------------------------------------------------------


def sdpa(kv: Callable[[str], PatternExpr]) -> PatternExpr:
    """``F.scaled_dot_product_attention(q, K, V, **kw)``: fires for any mask / is_causal / scale /
    enable_gqa; the handler checks them (keyword arguments are canonicalised first)."""
    return CallFunction(SDPA, KeywordArg("q"), kv("k"), kv("v"))


def _eager_scores(kv: Callable[[str], PatternExpr], masked: bool) -> PatternExpr:
    """``matmul(q, K.transpose(2, 3)) * scaling (+ mask)``."""
    scores = CallFunction(MATMUL, KeywordArg("q"), CallMethod("transpose", kv("k"), Ignored(), Ignored()))
    scores = CallFunction(operator.mul, scores, KeywordArg("scaling"))
    if masked:
        scores = CallFunction(operator.add, scores, KeywordArg("mask"))
    return scores


def eager_cast_then_dropout(kv: Callable[[str], PatternExpr], masked: bool) -> PatternExpr:
    """HF ``eager_attention_forward`` (Llama, Mistral, Qwen2/3, Phi3, Gemma):
    ``softmax(s, dim=-1, dtype=float32).to(q.dtype)`` -> ``dropout(p, training)`` -> ``matmul(P, V)``."""
    p = CallFunction(F.softmax, _eager_scores(kv, masked))
    p = CallMethod("to", p, Ignored())
    p = CallFunction(F.dropout, p)
    return CallFunction(MATMUL, p, kv("v"))


def eager_dropout_then_cast(kv: Callable[[str], PatternExpr], masked: bool) -> PatternExpr:
    """``softmax(s, dim=-1, dtype=float32)`` -> ``dropout`` -> ``.to(q.dtype)`` -> ``matmul(P, V)``."""
    p = CallFunction(F.softmax, _eager_scores(kv, masked))
    p = CallFunction(F.dropout, p)
    p = CallMethod("to", p, Ignored())
    return CallFunction(MATMUL, p, kv("v"))


def eager_no_dropout(kv: Callable[[str], PatternExpr], masked: bool) -> PatternExpr:
    """``softmax(s, dim=-1, dtype=float32).to(q.dtype)`` -> ``matmul(P, V)`` (dropout omitted)."""
    p = CallFunction(F.softmax, _eager_scores(kv, masked))
    p = CallMethod("to", p, Ignored())
    return CallFunction(MATMUL, p, kv("v"))


def _build_patterns() -> dict[str, PatternExpr]:
    patterns: dict[str, PatternExpr] = {}
    for kv_name, kv in KV_SPELLINGS.items():
        patterns[f"sdpa[{kv_name}]"] = sdpa(kv)
        for eager_name, eager in (
            ("eager", eager_cast_then_dropout),
            ("eager_dropout_first", eager_dropout_then_cast),
            ("eager_no_dropout", eager_no_dropout),
        ):
            patterns[f"{eager_name}[{kv_name}, mask]"] = eager(kv, True)
            patterns[f"{eager_name}[{kv_name}]"] = eager(kv, False)
    return patterns


#: name -> pattern; every spelling the pass rewrites.
PATTERNS: dict[str, PatternExpr] = _build_patterns()


# ---------------------------------------------------------------------------------------------
# helpers over node metadata
# ---------------------------------------------------------------------------------------------


def _val(x: Any) -> Any:
    """The example value (fake tensor / SymInt / constant) of a node or constant."""
    if isinstance(x, fx.Node):
        return x.meta.get("example_value", x.meta.get("val"))
    return x


def _known_eq(a: Any, b: Any) -> bool:
    """``a == b`` for ints or SymInts. A backed symbolic comparison is decided by its hint and guarded
    (as Inductor does; under ``dynamic=True`` the cache length is a symbol equal to the mask's
    ``max_cache_len``, and the guard pins it); an unbacked one counts as unequal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(guard_or_false(a == b))
    except Exception:  # noqa: BLE001  (an unresolvable symbolic comparison is "not known")
        return False


def _shape(node: Any) -> Optional[tuple]:
    v = _val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def site_name(node: fx.Node) -> str:
    """A readable name for the attention site: the innermost module path, e.g.
    ``model.layers.3.self_attn``, else the node name."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        path = re.sub(r"^L(\[[^\]]*\])+\.?", "", path)  # L['self'] / L['args'][0]: the compiled root
        path = re.sub(r"_modules\['([^']*)'\]", r"\1", path)
        path = re.sub(r"\[(\d+)\]", r".\1", path).replace("..", ".")
        return f"{path or 'model'}:{node.name}"
    return node.name


class _Skip(Exception):
    """A matched site that cannot be rewritten exactly; the message is the reason."""


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PassReport:
    kv_dtype: str
    found: int = 0
    rewritten: int = 0
    skipped: list = dataclasses.field(default_factory=list)  # [(site, reason)]
    patterns: dict = dataclasses.field(default_factory=dict)  # pattern name -> rewrites

    def as_dict(self) -> dict:
        return {"found": self.found, "rewritten": self.rewritten, "skipped": list(self.skipped), "kv_dtype": self.kv_dtype}


# ---------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------


class KVAttentionPass(CustomGraphPass):
    """Rewrites attention over a kvcompile cache into ``kvcompile::attention``.

    ``apply(graph)`` (or calling the pass) works in place on a Dynamo (pre-AOT) graph and returns a :class:`PassReport`.
    Raises :class:`KVDtypeMismatch` when the graph's cache codes are not ``kv_dtype``'s.
    """

    def __init__(self, kv_dtype: Optional[str] = None, *, k_dtype: Optional[str] = None, v_dtype: Optional[str] = None):
        k_dtype, v_dtype = formats.resolve_kv_dtypes(kv_dtype, k_dtype, v_dtype)
        self.kv_dtype = k_dtype if k_dtype == v_dtype else f"{k_dtype}/{v_dtype}"
        self.code_dtype = formats.get_format(k_dtype).code_dtype
        self._matcher = PatternMatcherPass(pass_name="kvcompile_attention")
        self._state: Optional[dict] = None
        for name, pattern in PATTERNS.items():
            register_graph_pattern(pattern, pass_dict=self._matcher)(self._handler(name))

    # CustomGraphPass ---------------------------------------------------------------------------

    def uuid(self) -> bytes:
        h = hashlib.sha256()
        h.update(inspect.getsource(inspect.getmodule(KVAttentionPass)).encode())
        h.update(self.kv_dtype.encode())
        return h.digest()

    def __call__(self, graph: fx.Graph) -> PassReport:
        return self.apply(graph)

    # ------------------------------------------------------------------------------------------

    def apply(self, graph: fx.Graph) -> PassReport:
        report = PassReport(self.kv_dtype)
        dequants = [n for t in DEQUANTIZE_TARGETS for n in graph.find_nodes(op="call_function", target=t)]
        if not dequants:
            return report
        self._check_kv_dtype(dequants)
        _canonicalize_sdpa(graph)

        # one site per cache layer: K and V of a layer share its kv_len (cumulative_length)
        sites: dict[fx.Node, list[fx.Node]] = {}
        for d in dequants:
            sites.setdefault(d.args[3], []).append(d)
        self._state = {"reasons": {}, "rewritten": set(), "report": report}
        try:
            self._matcher.apply(graph)
        finally:
            state, self._state = self._state, None

        for kv_len, nodes in sites.items():
            report.found += 1
            if kv_len in state["rewritten"]:
                report.rewritten += 1
                continue
            reason = state["reasons"].get(kv_len)
            if reason is None:
                users = sorted({_describe(u) for n in nodes if not n._erased for u in n.users})
                reason = "attention spelling not recognised (dequantized K/V feeds " + ", ".join(users) + ")"
            live = [n for n in nodes if not n._erased] or nodes
            report.skipped.append((site_name(live[0]), reason))
        for d in dequants:  # a dequantize left without users by a rewrite
            if not d._erased and not d.users:
                graph.erase_node(d)
        return report

    def _check_kv_dtype(self, dequants: list[fx.Node]) -> None:
        for d in dequants:
            codes = _val(d.args[0])
            if isinstance(codes, torch.Tensor) and codes.dtype != self.code_dtype:
                found = {torch.float8_e4m3fn: "fp8_e4m3", torch.int8: "q8_0"}.get(codes.dtype, str(codes.dtype))
                raise KVDtypeMismatch(
                    f"kvcompile.backend(kv_dtype={self.kv_dtype!r}) compiled a model whose kvcompile cache holds "
                    f"{codes.dtype} codes (kv_dtype={found!r}). Build the backend with kv_dtype={found!r}, or the "
                    f"cache with kv_dtype={self.kv_dtype!r}."
                )

    # handlers ---------------------------------------------------------------------------------

    def _handler(self, pattern_name: str):
        def handler(match: Match, *args, **kwargs) -> None:
            state = self._state
            anchor = match.output_node()
            kv_len = kwargs["kv_len"]
            try:
                if pattern_name.startswith("sdpa"):
                    call = _sdpa_call(anchor, kwargs)
                else:
                    call = _eager_call(anchor, kwargs, match)
                shape_users = _shape_query_users(match, kwargs)
                _check_heads_and_dtypes(anchor, kwargs, call)
                call["kv_len"] = _causal_length(anchor.graph, anchor, kwargs, call)
            except _Skip as e:
                state["reasons"][kv_len] = f"{pattern_name}: {e}"
                return
            graph = anchor.graph
            with graph.inserting_before(anchor):
                # contiguous q: the op's fake returns empty_like(q) (q's strides) while kernels write a
                # dense [B, Hq, Tq, D] output; HF's q is a transposed view. Free when already dense.
                q = graph.call_method("contiguous", (kwargs["q"],))
                q.meta.update({k: v for k, v in kwargs["q"].meta.items() if k in ("nn_module_stack", "stack_trace")})
                new = graph.call_function(
                    ATTENTION,
                    (
                        q, kwargs["k_codes"], kwargs["k_scale"], kwargs["v_codes"], kwargs["v_scale"],
                        call["kv_len"], call["mask"], call["is_causal"], call["scale"],
                    ),
                )
            new.meta.update({k: v for k, v in anchor.meta.items() if k in ("example_value", "val", "nn_module_stack", "stack_trace", "source_fn_stack")})
            anchor.replace_all_uses_with(new)
            for user, dq, codes in shape_users:
                user.replace_input_with(dq, codes)
            match.erase_nodes()
            state["rewritten"].add(kv_len)
            patterns = state["report"].patterns
            patterns[pattern_name] = patterns.get(pattern_name, 0) + 1

        handler.__name__ = f"rewrite_{pattern_name}"
        return handler


# ---------------------------------------------------------------------------------------------
# semantics of a matched site (raise _Skip with a reason when not provably equal)
# ---------------------------------------------------------------------------------------------


def _canonicalize_sdpa(graph: fx.Graph) -> None:
    """Move SDPA's positional arguments after (q, k, v) into keywords so one pattern fits all."""
    for node in graph.find_nodes(op="call_function", target=SDPA):
        if len(node.args) > 3:
            kwargs = dict(node.kwargs)
            for name, value in zip(_SDPA_KWARGS, node.args[3:]):
                kwargs[name] = value
            node.args, node.kwargs = node.args[:3], kwargs


_SHAPE_QUERIES = ("size", "dim")


def _shape_query_users(match: Match, kw: dict) -> list:
    """Shape queries (``x.size()``, ``x.dim()``) on the matched K/V nodes, as (user, node, codes).

    Any other reader outside the match means the dequantized K/V is needed beyond attention: skip.
    Queries on a dequantize node are pointed at its codes (same shape). Queries on a repeat
    (``value.shape[-1]`` in HF's SDPA glue under dynamic=True) keep that view chain alive for its
    metadata only; AOTAutograd's dead-code elimination drops the unused dequantize.
    """
    out = []
    for node in match.nodes:
        if node is match.output_node():
            continue
        for user in node.users:
            if user in match.nodes:
                continue
            if not (user.op == "call_method" and user.target in _SHAPE_QUERIES and user.args[0] is node):
                raise _Skip(f"the dequantized cache is also read by {_describe(user)} ({user.name})")
            if node.target in DEQUANTIZE_TARGETS:
                out.append((user, node, node.args[0]))
    return out


def _constant(value: Any, what: str, types: tuple) -> Any:
    if isinstance(value, fx.Node) or not isinstance(value, types):
        hint = (" (dynamic=True lifts Python floats to graph inputs: compile with dynamic=None, or set "
                "torch._dynamo.config.specialize_float=True)") if isinstance(value, fx.Node) else ""
        raise _Skip(f"{what} is not a compile-time constant ({value!r}){hint}")
    return value


def _sdpa_call(node: fx.Node, kw: dict) -> dict:
    unknown = set(node.kwargs) - set(_SDPA_KWARGS)
    if unknown:
        raise _Skip(f"unsupported SDPA arguments {sorted(unknown)}")
    dropout = _constant(node.kwargs.get("dropout_p", 0.0), "dropout_p", (int, float))
    if dropout != 0:
        raise _Skip(f"dropout_p={dropout} (the op has no dropout)")
    is_causal = _constant(node.kwargs.get("is_causal", False), "is_causal", (bool,))
    scale = node.kwargs.get("scale")
    if scale is not None:
        scale = float(_constant(scale, "scale", (int, float)))
    mask = node.kwargs.get("attn_mask")
    if mask is not None and is_causal:
        raise _Skip("both attn_mask and is_causal")
    return {
        "mask": _check_mask(mask, node, kw),
        "is_causal": is_causal,
        "scale": scale,
        "enable_gqa": bool(_constant(node.kwargs.get("enable_gqa", False), "enable_gqa", (bool,))),
        "key": node.args[1],
        "value": node.args[2],
    }


def _eager_call(node: fx.Node, kw: dict, match: Match) -> dict:
    by_target: dict[Any, fx.Node] = {}
    for n in match.nodes:
        by_target.setdefault(n.target, n)
    softmax = by_target[F.softmax]
    if _arg(softmax, 1, "dim") not in (-1, 3):
        raise _Skip(f"softmax over dim {_arg(softmax, 1, 'dim')!r}, not the key dim")
    if _arg(softmax, 2, "dtype") not in (None, torch.float32) or len(softmax.args) > 3:
        raise _Skip("softmax with an unexpected dtype/stacklevel")
    dropout = by_target.get(F.dropout)
    if dropout is not None:
        p = _constant(_arg(dropout, 1, "p", 0.5), "dropout p", (int, float))
        training = _constant(_arg(dropout, 2, "training", True), "dropout training", (bool,))
        if p != 0 and training:
            raise _Skip(f"dropout p={p} in training mode")
    cast = by_target["to"]
    q = _val(kw["q"])
    if len(cast.args) != 2 or cast.kwargs or (isinstance(q, torch.Tensor) and cast.args[1] != q.dtype):
        raise _Skip("probabilities are not cast back to the query dtype")
    transpose = by_target["transpose"]
    dims = {d % 4 for d in transpose.args[1:] if isinstance(d, int)}
    if dims != {2, 3}:
        raise _Skip(f"K is transposed over dims {transpose.args[1:]}, not (2, 3)")
    scaling = _constant(kw["scaling"], "score scaling", (int, float))
    return {
        "mask": _check_mask(kw.get("mask"), node, kw),
        "is_causal": False,
        "scale": float(scaling),
        "enable_gqa": False,
        "key": transpose.args[0],
        "value": node.args[1],
    }


def _check_mask(mask: Any, node: fx.Node, kw: dict) -> Any:
    """A mask must be a tensor whose last dim spans the cache (bool = keep, float = additive)."""
    if mask is None:
        return None
    m = _val(mask)
    if not isinstance(m, torch.Tensor):
        raise _Skip(f"mask {mask!r} is not a tensor")
    if m.dtype != torch.bool and not m.is_floating_point():
        raise _Skip(f"mask of dtype {m.dtype}")
    if m.dim() > 4:
        raise _Skip(f"mask of rank {m.dim()}")
    L = _shape(kw["k_codes"])[2]
    if not _known_eq(m.shape[-1], L):
        raise _Skip(f"mask spans {m.shape[-1]} keys, the cache {L}")
    return mask


def _repeat_factor(x: fx.Node, dq_shape: tuple) -> int:
    """How many times the K/V chain ending at ``x`` repeats each kv head (interleaved), proven
    from shapes; raises _Skip when the chain is anything else."""
    if x.target in DEQUANTIZE_TARGETS:
        return 1
    out = _shape(x)
    B, H, L, D = dq_shape
    if x.op == "call_method" and x.target == "reshape":
        expand = x.args[0]
        unsq = expand.args[0]
        index = unsq.args[1]
        full = slice(None, None, None)
        if not (isinstance(index, tuple) and len(index) == 5 and index[2] is None
                and all(s == full for i, s in enumerate(index) if i != 2)):
            raise _Skip(f"repeat_kv indexes the cache with {index!r}")
        e = _shape(expand)
        if not (len(e) == 5 and all(_known_eq(a, b) for a, b in zip((e[0], e[1], e[3], e[4]), (B, H, L, D)))):
            raise _Skip(f"repeat_kv expands {dq_shape} to {e}")
        n = e[2]
    else:  # repeat_interleave (method or function)
        repeats = _arg(x, 1, "repeats")
        dim = x.kwargs.get("dim", x.args[2] if len(x.args) > 2 else None)
        if dim not in (1, -3) or isinstance(repeats, fx.Node) or not isinstance(repeats, int):
            raise _Skip(f"repeat_interleave(repeats={repeats!r}, dim={dim!r}) is not a kv-head repeat")
        n = repeats
    if not (out is not None and len(out) == 4 and _known_eq(out[1], H * n)
            and all(_known_eq(a, b) for a, b in zip((out[0], out[2], out[3]), (B, L, D)))):
        raise _Skip(f"K/V repeat gives shape {out}, expected [B, {H}*{n}, L, D]")
    return int(n)


def _check_heads_and_dtypes(anchor: fx.Node, kw: dict, call: dict) -> None:
    q = _val(kw["q"])
    k_codes = _shape(kw["k_codes"])
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or k_codes is None:
        raise _Skip("query is not a 4-D tensor")
    if kw["k_dtype"] != q.dtype or kw["v_dtype"] != q.dtype:
        raise _Skip(f"K/V dequantized to {kw['k_dtype']}/{kw['v_dtype']} but the query is {q.dtype}")
    if _shape(kw["v_codes"]) != k_codes:
        raise _Skip("K and V caches differ in shape")
    if not _known_eq(q.shape[3], k_codes[3]):
        raise _Skip(f"query head_dim {q.shape[3]} != cache head_dim {k_codes[3]}")
    nk = _repeat_factor(call["key"], k_codes)
    nv = _repeat_factor(call["value"], k_codes)
    if nk != nv:
        raise _Skip(f"K repeated {nk}x but V {nv}x")
    heads = k_codes[1] * nk
    Hq = q.shape[1]
    ok = _known_eq(Hq % heads, 0) if call["enable_gqa"] else _known_eq(Hq, heads)
    if not ok:
        raise _Skip(f"{Hq} query heads over {heads} key heads (enable_gqa={call['enable_gqa']})")


def _causal_length(graph: fx.Graph, anchor: fx.Node, kw: dict, call: dict) -> Any:
    """The kv_len argument for the op; for SDPA's top-left ``is_causal`` see the module docstring."""
    kv_len = kw["kv_len"]
    if not call["is_causal"]:
        return kv_len
    Tq = _val(kw["q"]).shape[2]
    L = _shape(kw["k_codes"])[2]
    if _known_eq(Tq, L):
        return kv_len  # kv_len >= Tq = L = max length: both alignments coincide
    # prove kv_len >= Tq: this layer's cumulative_length.add_(T) with T == Tq precedes attention
    for user in kv_len.users:
        if (user.op == "call_method" and user.target == "add_" and user.args[0] is kv_len
                and len(user.args) == 2 and _known_eq(_val(user.args[1]), Tq) and _before(user, anchor)):
            with graph.inserting_before(anchor):
                clamped = graph.call_method("clamp", (kv_len,), {"max": user.args[1]})
            clamped.meta.update({k: v for k, v in kv_len.meta.items() if k in ("example_value", "val")})
            return clamped
    raise _Skip(
        f"is_causal with {Tq} queries over {L} keys: SDPA aligns top-left, the op bottom-right, and the graph "
        "does not prove kv_len >= Tq"
    )


def _before(a: fx.Node, b: fx.Node) -> bool:
    n = a
    while n is not None and n.op != "root":
        if n is b:
            return True
        n = n.next
    return False


def _describe(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))

"""The attention rewrite: attention over ``kvcompile::dequantize(cache)`` -> ``kvcompile::attention``.

Graph stage: the Dynamo graph, before AOTAutograd (pre-AOT)
-----------------------------------------------------------
The pass runs on the torch-level FX graph Dynamo hands to the backend, before ``compile_fx``:

* attention is one ``F.scaled_dot_product_attention`` node on every device (post-grad it is a
  device-specific aten op per backend), and the eager spelling (matmul, softmax, dropout) is
  still whole (post-grad it is decomposed into bmm/amax/exp/sum/div with views between);
* ``kvcompile::dequantize`` reads the cache tensors themselves; the cache mutation
  (``store_kv``, ``cumulative_length.add_``) comes before it in graph order;
* node metadata (``example_value`` fake tensors, ``nn_module_stack``) gives the shapes every
  proof below uses and the layer names of the report;
* the rewritten graph is what AOTAutograd traces and what the FX graph cache keys on.

How a site is found
-------------------
The pass starts from the cache, not from one spelling of attention. Every dequantize node is
followed forward through the K/V spelling table (:mod:`.spellings`: repeat_kv, repeat_interleave,
slicing, ...) to the node that consumes it; the two dequantize nodes of one cache layer (they
share its ``kv_len``) form one *site*. A site read by several layers (Gemma 3n / 4's
``num_kv_shared_layers``: later layers attend over this layer's K/V) gets one op per reader, all or
none; not over a ring, whose store is folded into one reader's op. The attention form handlers (:mod:`.forms`: SDPA, the
eager chain with optional softcap or sinks) read what the site computes from the nodes
themselves; :mod:`.rewrite` checks what every form shares (heads, dtypes, the key range, the
causal alignment) and emits the op. A site that is anything else, or that cannot be proven
equal, stays as it is (Inductor compiles the dequantized attention) and the report says why.
Nothing is kept on the pass object between calls: each :meth:`KVAttentionPass.apply` works on
its own graph and returns its own :class:`PassReport`.

What the rewrite relies on
--------------------------
``kvcompile::attention`` excludes keys at positions ``>= kv_len``; ``dequantize`` returns zeros
there. Hugging Face masks for this cache (``get_mask_sizes`` returns ``max_cache_len``) mask
every position past the current length for every real query, and HF's unmasked prefill
(``is_causal=True`` over K/V sliced to the prompt) sees only stored keys, so the rewrite is exact
for HF models. An attention with *no* mask and ``is_causal=False`` over the whole cache is
rewritten too: the op then attends to the stored tokens only, which is what such a graph means
(HF does not build it for this cache). A query row with no visible key (a left-padding
position) gets zeros (bool mask) or an average over the stored keys (additive ``finfo.min``
mask) from the op, where SDPA/eager average over all slots; real tokens never attend to
those rows.

Left out, with the reason in the report: dropout in training, attention probabilities read
by anything but ``P @ V`` (returned attention weights), a score term other than one mask and
Bloom's ALiBi as baddbmm's input (a position bias added after the scores, ``masked_fill``), softmax
over another dim, heads or shapes that do not line
up, K centering with softcap or sinks, and ``is_causal`` that the graph does not prove
top-left-equal. Cross-attention (encoder-decoder configs) and MLA (K and V of different widths)
never reach the pass: the cache refuses them. ``dynamic=True`` works when Python floats are specialised
(``torch._dynamo.config.specialize_float``, the default for ``dynamic=None``); otherwise the
scaling is a graph input and the site is skipped with that hint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from typing import Optional

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import formats
from . import forms, graph as graph_utils, rewrite, spellings
from .forms import ATTENTION_FORMS, SITE_FORMS
from .graph import Skip, describe, erase_dead, site_name
from .spellings import DEQUANTIZE_TARGETS, KV_SPELLINGS, KVChain

__all__ = ["KVAttentionPass", "PassReport", "KVDtypeMismatch", "KV_SPELLINGS", "ATTENTION_FORMS"]


class KVDtypeMismatch(ValueError):
    """The graph reads a kvcompile cache whose kv_dtype is not the backend's."""


@dataclasses.dataclass
class PassReport:
    """What one :meth:`KVAttentionPass.apply` did. ``kv_dtype`` names the backend's format
    (``"<k>/<v>"`` when K and V differ); ``patterns`` counts rewrites per ``form[K spellings]``."""

    kv_dtype: str
    found: int = 0
    rewritten: int = 0
    skipped: list = dataclasses.field(default_factory=list)  # [(site, reason)]
    patterns: dict = dataclasses.field(default_factory=dict)  # e.g. {"sdpa[slice]": 2}

    def as_dict(self) -> dict:
        return {"found": self.found, "rewritten": self.rewritten, "skipped": list(self.skipped), "kv_dtype": self.kv_dtype}


def _node_format(node: fx.Node) -> Optional[str]:
    """The kv_dtype of the codes a dequantize node reads: its ``format`` argument (the cache's
    ``KVFormat.id``); None where the graph does not say (a constant int)."""
    fid = spellings.read_dequantize(node).format
    if not isinstance(fid, int) or isinstance(fid, bool) or fid == -1:
        return None
    return formats.from_id(fid).kv_dtype


def _format_args(k_dtype: str, v_dtype: str) -> str:
    """The keywords that build a backend or cache of these formats: ``kv_dtype=`` for one, the pair otherwise."""
    return f"kv_dtype={k_dtype!r}" if k_dtype == v_dtype else f"k_dtype={k_dtype!r}, v_dtype={v_dtype!r}"


resolve_kv_dtypes = formats.resolve_kv_dtypes  # as the cache resolves them


class KVAttentionPass(CustomGraphPass):
    """Rewrites attention over a kvcompile cache into ``kvcompile::attention``.

    ``KVAttentionPass(kv_dtype=None, *, k_dtype=None, v_dtype=None)``: the formats the compiled
    model's cache holds (``kv_dtype`` sets both, ``k_dtype`` / ``v_dtype`` override, the default is
    ``formats.DEFAULT_KV_DTYPE``). ``apply(graph)`` (or calling the pass) works in place on a Dynamo
    (pre-AOT) graph and returns a :class:`PassReport`; it raises :class:`KVDtypeMismatch` when the
    graph's cache holds another format.
    """

    def __init__(self, kv_dtype: Optional[str] = None, *, k_dtype: Optional[str] = None,
                 v_dtype: Optional[str] = None):
        self.k_dtype, self.v_dtype = resolve_kv_dtypes(kv_dtype, k_dtype, v_dtype)
        self.kv_dtype = self.k_dtype if self.k_dtype == self.v_dtype else f"{self.k_dtype}/{self.v_dtype}"

    # CustomGraphPass ---------------------------------------------------------------------------

    def uuid(self) -> bytes:
        h = hashlib.sha256()
        for module in (graph_utils, spellings, forms, rewrite, inspect.getmodule(KVAttentionPass)):
            h.update(inspect.getsource(module).encode())
        h.update(f"{self.k_dtype}/{self.v_dtype}".encode())
        return h.digest()

    def __call__(self, graph: fx.Graph) -> PassReport:
        return self.apply(graph)

    # ------------------------------------------------------------------------------------------

    def apply(self, graph: fx.Graph) -> PassReport:
        report = PassReport(self.kv_dtype)
        dequants = [n for t in DEQUANTIZE_TARGETS for n in graph.find_nodes(op="call_function", target=t)]
        if not dequants:
            return report
        mixed = self._check_formats(dequants)
        # one site per cache layer: K and V of a layer share its kv_len (cumulative_length)
        sites: dict[fx.Node, list[fx.Node]] = {}
        order = {n: i for i, n in enumerate(graph.nodes)}
        for d in sorted(dequants, key=order.__getitem__):
            sites.setdefault(spellings.read_dequantize(d).kv_len, []).append(d)
        for nodes in sites.values():
            report.found += 1
            name = site_name(nodes[0])
            try:
                label = self._rewrite_site(nodes)
            except Skip as e:
                report.skipped.append((name, str(e)))
                continue
            report.rewritten += 1
            report.patterns[label] = report.patterns.get(label, 0) + 1
        if mixed:  # no site paired a K and V of the wrong formats (each was skipped first): name them all
            raise KVDtypeMismatch(
                f"kvcompile.backend({_format_args(self.k_dtype, self.v_dtype)}) compiled a model whose kvcompile "
                f"cache holds codes of {', '.join(map(repr, sorted(mixed)))}. Build the backend with the k_dtype "
                "and v_dtype the cache was built with."
            )
        return report

    def _rewrite_site(self, nodes: list[fx.Node]) -> str:
        if len(nodes) != 2:
            raise Skip(f"{len(nodes)} dequantize nodes share one cache length (expected K and V)")
        readers = [spellings.trace_readers(n) for n in nodes]
        if max(len(r) for r in readers) > 1 and readers[0][0].source.ring:
            many = max(readers, key=len)
            others = ", ".join(f"{describe(c.consumer)} ({c.consumer.name})" for c in many)
            raise Skip(f"the dequantized cache ({many[0].source.node.name}) is read by several nodes: {others}; a "
                       "sliding layer's ring stores a chunk's tokens inside its first reader's attention, over keys "
                       "the other readers still need (build the cache with ring=False to rewrite every reader)")
        # each reader of the side read by fewer nodes paired with one of the other side's: the pair a form
        # accepts. The other side's readers left over read its dequantized cache for something else (Doge's
        # dynamic mask reads V): that dequantize stays for them, and the attention still becomes the op.
        few, many = sorted(readers, key=len)
        matched, pool = [], list(many)
        for chain in few:
            found, why = None, None
            for other in pool:
                try:
                    found = self._match(chain, other)
                    break
                except Skip as e:
                    why = why or e
            if found is None:
                raise why
            pool.remove(other)
            matched.append(found)
        for _, k, v in matched:
            self._check_pair(k.source.node, v.source.node)
        plans = [rewrite.plan(call, k, v) for call, k, v in matched]  # every reader, or none
        for (call, k, v), plan in zip(matched, plans):
            rewrite.emit(call, k, v, plan)
        dead = []
        for call, k, v in matched:
            for chain in (k, v):
                for user, node in chain.shape_users():
                    if node is chain.source.node:  # the dequantize node's shape is its codes' shape
                        user.replace_input_with(node, chain.source.codes)
            dead += [*call.nodes, *k.nodes, *v.nodes, k.source.node, v.source.node]
        erase_dead(nodes[0].graph, dead)
        call, k, _ = matched[0]
        kept = f" +{len(pool)} other reader{'s' if len(pool) > 1 else ''} of the dequantized cache" if pool else ""
        return (f"{call.form}[{k.label}]" + ("@ring" if k.source.ring else "")
                + (f" x{len(matched)} readers" if len(matched) > 1 else "") + kept)

    def _match(self, first: KVChain, second: KVChain) -> tuple:
        """The attention form the two chains (K and V of one reader, in either order) feed: ``(call, k, v)``,
        or :class:`Skip` naming what they feed."""
        for a, b in ((first, second), (second, first)):
            for form in SITE_FORMS:
                call = form(a, b)
                if call is not None:
                    return call, a, b
        consumers = ", ".join(f"{describe(c.consumer)} ({c.consumer.name})" for c in (first, second))
        hint = ""
        if any("flex_attention" in describe(c.consumer) for c in (first, second)):
            hint = ("; kvcompile rewrites SDPA and eager attention: load the model with attn_implementation='sdpa' "
                    "(or 'eager') to run its kernels")
        raise Skip(f"attention form not recognised (the dequantized K/V feed {consumers}){hint}")

    def _check_formats(self, dequants: list[fx.Node]) -> Optional[set]:
        """Every dequantized cache holds one of the backend's formats, checked before any site is rewritten
        (a site skipped for another reason still reports a wrong backend). A cache whose K and V formats
        differ from each other is named side by side where a site pairs them (:meth:`_check_pair`); if no
        site got that far, after every site (returned: the formats found)."""
        found = {f for f in map(_node_format, dequants) if f is not None}
        if found <= {self.k_dtype, self.v_dtype}:
            return None
        if len(found) == 1:  # K and V alike
            (f,) = found
            raise self._mismatch(f, f)
        return found

    def _check_pair(self, k: fx.Node, v: fx.Node) -> None:
        kf, vf = _node_format(k), _node_format(v)
        if None not in (kf, vf) and (kf, vf) != (self.k_dtype, self.v_dtype):
            raise self._mismatch(kf, vf)

    def _mismatch(self, k_found: str, v_found: str) -> "KVDtypeMismatch":
        held = f"K and V as {k_found!r} codes" if k_found == v_found else f"K as {k_found!r} and V as {v_found!r} codes"
        backend = _format_args(self.k_dtype, self.v_dtype)
        return KVDtypeMismatch(
            f"kvcompile.backend({backend}) compiled a model whose kvcompile cache holds {held}. Build the backend "
            f"with {_format_args(k_found, v_found)} (the cache's formats), or the cache with {backend}."
        )

"""``kvcompile.backend(kv_dtype=...)``: a torch.compile backend = the attention pass + Inductor.

    backend = kvcompile.backend(kv_dtype=name)   # or k_dtype=..., v_dtype=... (names: kvcompile.KV_DTYPES)
    model.forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    ...
    backend.report()  # [{"found": 30, "rewritten": 30, "skipped": [], "kv_dtype": name}, ...]

``kv_dtype`` in the report is the format's name when K and V agree, ``"k_dtype/v_dtype"``
(e.g. ``"int8/fp8_e4m3"``) when they differ.

Per graph Dynamo hands over, the backend runs :class:`kvcompile.passes.KVAttentionPass` on the
Dynamo (pre-AOT) graph, then calls Inductor's ``compile_fx`` with the config patches torch.compile
would use for ``mode=``/``options=`` (``"reduce-overhead"`` -> ``triton.cudagraphs=True``). A graph
without a kvcompile cache goes to ``compile_fx`` untouched: exactly plain Inductor. The pass adds no
guards, so it causes no recompiles; the FX graph cache keys on the rewritten graph.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional, Sequence

import torch

from . import backend_registry, checks, formats
from .backend_registry import unused_backend_exists
from .passes import KVAttentionPass, KVDtypeMismatch

log = logging.getLogger("kvcompile")

__all__ = ["KVCompileBackend", "unused_backend_exists"]

class KVCompileBackend:
    """A callable torch.compile backend; see the module docstring.

    Args:
        kv_dtype: the cache format the compiled model uses (one of ``kvcompile.KV_DTYPES``; ``None``:
            :data:`kvcompile.formats.DEFAULT_KV_DTYPE`); a graph over a cache of another format fails
            to compile with a clear error.
        k_dtype, v_dtype: K's / V's format when they differ (override ``kv_dtype`` for that side), as
            ``QuantizedCache(k_dtype=..., v_dtype=...)``.
        config_patches: Inductor config applied to every graph (merged under ``options=``).
        dump_graphs: a directory; each graph is written there before and after the pass
            (also enabled by ``KVCOMPILE_DUMP_GRAPHS=<dir>``).
    """

    def __init__(
        self,
        kv_dtype: Optional[str] = None,
        *,
        k_dtype: Optional[str] = None,
        v_dtype: Optional[str] = None,
        config_patches: Optional[dict] = None,
        dump_graphs: Optional[str] = None,
    ):
        self.k_dtype, self.v_dtype = formats.resolve_kv_dtypes(kv_dtype, k_dtype, v_dtype)
        # one name when K and V agree (the report's "kv_dtype"), "k_dtype/v_dtype" otherwise
        self.kv_dtype = self.k_dtype if self.k_dtype == self.v_dtype else f"{self.k_dtype}/{self.v_dtype}"
        self.config_patches = dict(config_patches or {})
        self.dump_graphs = dump_graphs or os.environ.get("KVCOMPILE_DUMP_GRAPHS") or None
        self.graph_pass = KVAttentionPass(k_dtype=self.k_dtype, v_dtype=self.v_dtype)
        self._reports: list[dict] = []
        self.pass_seconds: list[float] = []  # wall time of the pass per graph (benchmarks)
        self.used = False  # Dynamo has handed this backend a graph
        self._warned_no_cache = False
        backend_registry.register(self)

    def report(self) -> list[dict]:
        """One dict per compiled graph: ``{"found", "rewritten", "skipped": [(site, reason)], "kv_dtype"}``."""
        return [dict(r, skipped=list(r["skipped"])) for r in self._reports]

    def reset_report(self) -> None:
        self._reports.clear()
        self.pass_seconds.clear()

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        mode: Optional[str] = None,
        options: Optional[dict] = None,
    ):
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        self.used = True
        index = len(self._reports)
        self._dump(gm, index, "before")
        t0 = time.perf_counter()
        try:
            result = self.graph_pass.apply(gm.graph)
        except KVDtypeMismatch as e:
            # Raised here, Dynamo would wrap it in BackendCompilerFailed under a first line that names only
            # the backend. Hand Dynamo a graph that raises it instead: the first call fails with this
            # message as its first line, before Inductor spends any time on the graph.
            return _raise_when_run(e)
        grad = _grad_refusal(gm.graph, index)
        if grad is not None:  # as above: the first call raises it, its fix on the first line, before Inductor
            return _raise_when_run(grad)
        if result.found:
            gm.graph.lint()
            gm.recompile()
        self.pass_seconds.append(time.perf_counter() - t0)
        self._dump(gm, index, "after")
        report = result.as_dict()
        report["kv_dtype"] = self.kv_dtype
        self._reports.append(report)
        if result.found:
            log.info(
                "kvcompile: graph %d: rewrote %d/%d attention sites, %s%s",
                index, result.rewritten, result.found, self.kv_dtype,
                f" ({', '.join(f'{k} x{v}' for k, v in result.patterns.items())})" if result.patterns else "",
            )
            for site, reason in result.skipped:
                log.warning("kvcompile: attention over the %s cache left unrewritten at %s: %s", self.kv_dtype, site, reason)
        else:
            log.info("kvcompile: graph %d: no kvcompile cache, compiled as plain Inductor", index)
            if not self._warned_no_cache and _attends(gm.graph):
                self._warned_no_cache = True
                log.warning(
                    "kvcompile: graph %d attends, but over no kvcompile cache: its K/V are not a "
                    "kvcompile.QuantizedCache's (transformers makes a full-precision DynamicCache when none is "
                    "passed), or a graph break parts them from the attention. Pass cache="
                    "kvcompile.QuantizedCache(model.config, max_batch_size=B, max_cache_len=L) to the model or to "
                    "generate() (past_key_values= before transformers 5.24); this graph is compiled as plain "
                    "Inductor (warned once per backend)", index)

        _mark_storage_static(gm, example_inputs)
        patches = dict(list_mode_options(mode)) if mode not in (None, "default") else {}
        patches.update(self.config_patches)
        patches.update(options or {})
        _no_cudagraphs_where_storage_is_allocated(patches, example_inputs, index)
        return compile_fx(gm, example_inputs, config_patches=patches)

    def _dump(self, gm: torch.fx.GraphModule, index: int, stage: str) -> None:
        if not self.dump_graphs:
            return
        os.makedirs(self.dump_graphs, exist_ok=True)
        with open(os.path.join(self.dump_graphs, f"graph{index:03d}_{stage}.py"), "w") as f:
            f.write(gm.print_readable(print_output=False))

    def __deepcopy__(self, memo):
        # transformers deep-copies GenerationConfig (and its CompileConfig(backend=...)); the copy
        # must be this backend, or report() would miss the graphs compiled through it
        return self

    def __copy__(self):
        return self

    def __repr__(self) -> str:
        if self.k_dtype == self.v_dtype:
            return f"kvcompile.backend(kv_dtype={self.kv_dtype!r})"
        return f"kvcompile.backend(k_dtype={self.k_dtype!r}, v_dtype={self.v_dtype!r})"


def _attends(graph: torch.fx.Graph) -> bool:
    """Whether the graph computes attention: SDPA, or eager attention's softmax over [B, H, Tq, T] scores
    (a router's softmax over [tokens, experts] is none)."""
    from .passes.forms import SDPA, SOFTMAX
    from .passes.graph import is_call, val

    return any(is_call(n, SDPA) or is_call(n, *SOFTMAX) and getattr(val(n), "ndim", 0) == 4 for n in graph.nodes)


def _grad_refusal(graph: torch.fx.Graph, index: int) -> Optional[RuntimeError]:
    """The error for a graph in which a kvcompile op reads a tensor that requires grad (a forward with
    gradients enabled: kvcompile's ops have no backward, and AOTAutograd's trace of one would fail
    under a ``BackendCompilerFailed`` whose first line names only the backend); None for any other."""
    from .passes.graph import val

    if not torch.is_grad_enabled():  # as AOTAutograd decides: no backward is traced (a leaf input may require grad)
        return None

    def tracked(x, depth: int = 0) -> bool:  # a node the pass added has no example value: ask its inputs
        v = val(x)
        if isinstance(v, torch.Tensor):
            return v.requires_grad
        return isinstance(x, torch.fx.Node) and depth < 4 and any(tracked(a, depth + 1) for a in x.all_input_nodes)

    for node in graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("kvcompile."):
            if any(tracked(a) for a in (*node.args, *node.kwargs.values())):
                op = str(node.target).split(".")[1]
                return checks.grad_refusal("kvcompile.backend", f"an input of kvcompile::{op} in compiled graph "
                                           f"{index}", "kvcompile's ops have no backward")
    return None


def _mark_storage_static(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Mark the graph inputs that are a kvcompile cache's storage as static addresses, so CUDA graphs
    replay them in place rather than skipping the graph for its mutated inputs. Storage allocated outside
    a compiled graph already carries the mark; this reaches what a compiled prefill allocated
    (:meth:`kvcompile.QuantizedCache.storage`). Returns how many inputs it marked."""
    from .cache import live_caches

    storage = {id(t): t for cache in live_caches() for t in cache.storage()}
    marked = 0
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, torch.Tensor) and storage.get(id(value)) is value:
            torch._dynamo.mark_static_address(value, guard=False)
            node.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = "unguarded"
            marked += 1
    return marked


def _no_cudagraphs_where_storage_is_allocated(patches: dict, example_inputs: Sequence[Any], index: int) -> None:
    """Turn CUDA graphs off (in ``patches``) for a graph that allocates a cache's storage: a hybrid
    model's recurrent state on its first forward, or the K/V of a cache built with ``device=None``.
    Under CUDA graphs that tensor would live in the graph pool, and the next replay would reuse its memory
    while the cache still holds it. Only a fresh cache's first forward runs that graph, a compute-bound
    prefill; later graphs read the storage as static inputs and replay as usual."""
    from torch._inductor import config as inductor_config

    from .cache import live_caches

    if not patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs):
        return
    inputs = {id(t) for t in example_inputs if isinstance(t, torch.Tensor)}
    # a graph over a cache takes some tensor of it as an input: its storage or its length counters
    layers = [i for cache in live_caches() if any(id(t) in inputs for t in cache.storage() + cache.length_counters())
              for i in cache.unallocated_layers()]
    if layers:
        patches["triton.cudagraphs"] = False
        log.info("kvcompile: graph %d allocates the cache storage of layers %s (their first forward): compiled "
                 "without CUDA graphs, whose memory pool the next replay reuses", index, layers)


def _raise_when_run(error: Exception):
    """A compiled graph that raises ``error`` (a fresh copy per call) whenever it runs."""
    cls, args = type(error), error.args

    def compiled_graph(*inputs):
        raise cls(*args)

    return compiled_graph


"""Helpers over Dynamo FX nodes shared by the attention pass modules: metadata, constants,
single-user walks and readable names. Nothing here knows about attention."""

from __future__ import annotations

import operator
import re
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_or_false

MATMUL = (torch.matmul, operator.matmul)
SHAPE_METHODS = ("size", "dim", "stride")


class Skip(Exception):
    """A site that cannot be rewritten exactly; the message is the reason (it goes into the report)."""


def val(x: Any) -> Any:
    """The example value (fake tensor / SymInt / constant) of a node, or the constant itself."""
    if isinstance(x, fx.Node):
        return x.meta.get("example_value", x.meta.get("val"))
    return x


def shape(x: Any) -> Optional[tuple]:
    v = val(x)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def known_eq(a: Any, b: Any) -> bool:
    """``a == b`` for ints or SymInts. A backed symbolic comparison is decided by its hint and guarded
    (as Inductor does: under ``dynamic=True`` the cache length is a symbol equal to the mask's
    ``max_cache_len``, and the guard pins it); an unbacked one counts as unequal."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        a, b = val(a), val(b)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(guard_or_false(a == b))
    except Exception:  # noqa: BLE001  (an unresolvable symbolic comparison is "not known")
        return False


def known_le(a: Any, b: Any) -> bool:
    """``a <= b`` for ints or SymInts, decided as :func:`known_eq` decides equality."""
    if isinstance(a, int) and isinstance(b, int):
        return a <= b
    try:
        return bool(guard_or_false(a <= b))
    except Exception:  # noqa: BLE001
        return False


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` / keyword ``name`` of a call."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def constant(value: Any, what: str, types: tuple) -> Any:
    """``value`` if it is a compile-time constant of ``types``, else :class:`Skip` with the reason."""
    if isinstance(value, fx.Node) or not isinstance(value, types):
        hint = (" (dynamic=True lifts Python floats to graph inputs: compile with dynamic=None, or set "
                "torch._dynamo.config.specialize_float=True)") if isinstance(value, fx.Node) else ""
        raise Skip(f"{what} is not a compile-time constant ({value!r}){hint}")
    return value


def is_call(node: Any, *targets: Any) -> bool:
    """``node`` is a call_function of one of ``targets`` or a call_method named one of them."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    if node.op == "call_method":
        return node.target in targets
    return False


_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
_CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the query dtypes the op serves


def cast_dtype(node: Any, x: Any = None) -> Optional[torch.dtype]:
    """The dtype ``node`` converts its input to when it is a plain cast (``x.to(dtype)``, ``x.type(dtype)``,
    ``x.float()`` / ``.half()`` / ``.bfloat16()``) of ``x`` (any input when None) to float32, float16 or
    bfloat16; None for any other node, or a cast that also moves, copies or reads another tensor."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.args and (x is None or node.args[0] is x)):
        return None
    if node.target in _CAST_METHODS:
        return _CAST_METHODS[node.target] if len(node.args) == 1 and not node.kwargs else None
    if node.target not in ("to", "type"):
        return None
    dtype = node.args[1] if len(node.args) == 2 and not node.kwargs else None
    if len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        dtype = node.kwargs["dtype"]
    return dtype if dtype in _CAST_DTYPES else None


def is_shape_query(user: fx.Node, of: fx.Node) -> bool:
    """``x.size()``, ``x.dim()``, ``x.stride()`` or ``aten.sym_size(x, d)``: reads metadata of ``of`` only."""
    if user.op == "call_method" and user.target in SHAPE_METHODS and user.args and user.args[0] is of:
        return True
    return user.op == "call_function" and user.target in _SYM_SIZE and user.args and user.args[0] is of


_SYM_SIZE = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default, torch.ops.aten.sym_stride.int)


def value_users(node: fx.Node) -> list[fx.Node]:
    """Users of ``node`` that read its values (every user but shape queries)."""
    return [u for u in node.users if not is_shape_query(u, node)]


def only_user(node: fx.Node, what: str) -> fx.Node:
    """The one user that reads ``node``'s values; :class:`Skip` when there are several (``what`` names
    the intermediate, e.g. "the attention probabilities", for the reason)."""
    users = value_users(node)
    if len(users) != 1:
        if not users:
            raise Skip(f"{what} ({node.name}) is not used")
        others = ", ".join(f"{describe(u)} ({u.name})" for u in users)
        returned = (" (an output of the graph: attention weights returned with output_attentions=True, or kept "
                    "alive by a graph break after the attention; compile with fullgraph=True to find the break)"
                    if any(u.op == "output" for u in users) else "")
        raise Skip(f"{what} ({node.name}) is read by several nodes: {others}{returned}")
    return users[0]


def scalar_operand(node: fx.Node, target) -> Optional[tuple[fx.Node, Any]]:
    """For ``x * c`` / ``c * x`` (``target`` mul) or ``x / c`` (div) with one tensor operand: (x, c).
    ``c`` may be a graph node (a SymFloat input under dynamic=True); the caller checks it is constant."""
    if node.op != "call_function" or node.target not in target or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if isinstance(a, fx.Node) and isinstance(val(a), torch.Tensor) and not _is_tensor(b):
        return a, b
    if target is MUL and isinstance(b, fx.Node) and isinstance(val(b), torch.Tensor) and not _is_tensor(a):
        return b, a
    return None


def _is_tensor(x: Any) -> bool:
    return isinstance(val(x), torch.Tensor)


# in-place spellings too (Falcon's ``scores /= sqrt(d)``): the forms accept them only on an intermediate
# with one reader, where they compute what the out-of-place op does
MUL = (operator.mul, torch.mul, operator.imul)
DIV = (operator.truediv, torch.div, operator.itruediv)
ADD = (operator.add, torch.add, operator.iadd)
SUB = (operator.sub, torch.sub, operator.isub)


def before(a: fx.Node, b: fx.Node) -> bool:
    """``a`` comes before ``b`` in graph order."""
    n = a
    while n is not None and n.op != "root":
        if n is b:
            return True
        n = n.next
    return False


def describe(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def site_name(node: fx.Node) -> str:
    """A readable name for an attention site: the innermost module path, e.g.
    ``model.layers.3.self_attn``, and the node name."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        path = re.sub(r"^L(\[[^\]]*\])+\.?", "", path)  # L['self'] / L['args'][0]: the compiled root
        path = re.sub(r"_modules\['([^']*)'\]", r"\1", path)
        path = re.sub(r"\[(\d+)\]", r".\1", path).replace("..", ".")
        return f"{path or 'model'}:{node.name}"
    return node.name


def copy_meta(dst: fx.Node, src: fx.Node, keys=("example_value", "val", "nn_module_stack", "stack_trace",
                                                "source_fn_stack")) -> None:
    dst.meta.update({k: v for k, v in src.meta.items() if k in keys})


def erase_dead(graph: fx.Graph, nodes) -> None:
    """Erase, latest first, each of ``nodes`` left without users (never inputs or attributes)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted({n for n in nodes if n in order}, key=order.__getitem__, reverse=True):
        if not n.users and n.op in ("call_function", "call_method"):
            graph.erase_node(n)

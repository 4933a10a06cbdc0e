"""Graph-op helpers for plugins: see through exir's edge dialect to the aten op beneath.

An edge-dialect node's ``target`` wraps the aten ``OpOverload`` it stands for;
a pass or partitioner that matches ops should match through these helpers, so
that one rule holds on the aten program and on the edge program alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = [
    "MATMULS",
    "SAME_VALUES",
    "VIEWS_AND_EXPANDS",
    "aten_op",
    "decomposed_from",
    "node_value",
    "normalize_dim",
    "normalize_index",
    "op_name",
    "overload_name",
    "packet_name",
    "schema_of",
    "source_of",
    "write_back_copies",
    "written_placeholders",
]


# Op families, as packet names (:func:`packet_name`), each named once for every pass and backend.
# Matrix products of two operands (no batch broadcasting).
MATMULS = frozenset({"bmm", "mm"})
# Copies exir's later passes turn into views (``view_copy``) or that only broadcast (``expand_copy``).
VIEWS_AND_EXPANDS = frozenset({"view_copy", "expand_copy"})
# Ops whose output holds only their input's values, each unchanged (reshaped, moved, broadcast),
# in ATen and edge spelling.
SAME_VALUES = frozenset(
    {
        "_unsafe_view",
        "alias",
        "alias_copy",
        "clone",
        "expand",
        "expand_copy",
        "flatten",
        "permute",
        "permute_copy",
        "reshape",
        "squeeze",
        "squeeze_copy",
        "unsqueeze",
        "unsqueeze_copy",
        "view",
        "view_copy",
    }
)


def normalize_dim(dim: object, rank: int, *, what: str = "dim") -> int:
    """``dim`` as an axis in ``[0, rank)``, with eager PyTorch's rule for negative dims.

    The one place a dim is wrapped and checked. Like ATen, a dim in ``[-rank, rank)``
    is accepted (a negative one counts from the end) and a rank-0 tensor takes ``0`` or
    ``-1``. Anything else -- a dim out of range, a bool, a non-integer read from a file
    -- raises :class:`IndexError` (``TypeError`` for a non-integer) that names ``what``,
    the accepted range and the value, so a caller never indexes an axis that is not there.
    """
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{what}: a dim must be an int, got {type(dim).__name__} {dim!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise TypeError(f"{what}: a rank must be a non-negative int, got {rank!r}")
    span = max(rank, 1)
    if not -span <= dim < span:
        raise IndexError(
            f"{what}: dimension out of range (expected to be in range of [{-span}, {span - 1}]"
            f" for a tensor of rank {rank}, but got {dim})"
        )
    return dim + span if dim < 0 else dim


def normalize_index(index: object, size: int, *, what: str = "index") -> int:
    """``index`` as a position in ``[0, size)``, with eager PyTorch's rule for negatives.

    An index in ``[-size, size)`` is accepted (a negative one counts from the end, as
    ``t[-1]`` does); anything else raises :class:`IndexError` naming ``what``, the index
    and the size -- eager's "index 7 is out of bounds for dimension 0 with size 4".
    """
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"{what}: an index must be an int, got {type(index).__name__} {index!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TypeError(f"{what}: a size must be a non-negative int, got {size!r}")
    if not -size <= index < size:
        raise IndexError(f"{what}: index {index} is out of bounds for a dimension of size {size}")
    return index + size if index < 0 else index


def node_value(value: object) -> Any:
    """The value traced for a graph node (its ``meta["val"]``: a fake tensor, a list of them,
    a number), or ``None`` for a literal argument or a node that has none.

    The one place an argument's traced value is read, so a check over ``node.args`` never
    mistakes a literal for a node or fails on a node the tracer left bare.
    """
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else None


def aten_op(target: Any) -> Any:
    """The ``torch._ops.OpOverload`` behind ``target`` (edge ops wrap one), else ``target``."""
    inner = getattr(target, "_op", None)
    if isinstance(inner, torch._ops.OpOverload):
        return inner
    return target


def overload_name(target: Any) -> str | None:
    """``"aten.mm.default"`` for an op overload or its edge wrapper; ``None`` for anything
    else (``operator.getitem``, a Python function): the key backends' op tables use."""
    op = aten_op(target)
    return str(op) if isinstance(op, torch._ops.OpOverload) else None


def op_name(target: Any) -> str:
    """A stable printable name such as ``aten.index_put.default``, for any target (a
    function's ``__name__`` when it is not an op overload)."""
    name = overload_name(target)
    return name if name is not None else getattr(target, "__name__", repr(target))


def schema_of(target: Any) -> torch.FunctionSchema | None:
    """The function schema of an op target, or ``None`` when it has none."""
    op = aten_op(target)
    schema = getattr(op, "_schema", None)
    if isinstance(schema, torch.FunctionSchema):
        return schema
    schema = getattr(target, "_schema", None)
    return schema if isinstance(schema, torch.FunctionSchema) else None


def packet_name(target: Any) -> str | None:
    """``"index_put"`` for ``aten.index_put.default`` and its edge wrapper; ``None`` otherwise."""
    op = aten_op(target)
    if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten":
        return str(op._opname)
    return None


def decomposed_from(node: torch.fx.Node, packet: str) -> bool:
    """Whether ``node`` was decomposed from op ``packet`` (``"index_copy"``: the ``index_put``
    that ``index_copy_`` becomes).

    The graph says so in ``original_aten`` after one decomposition and in ``torch_fn`` (the
    torch function the model called) after several. Rules that differ between the two ops
    (eager's ``index_copy`` rejects a negative index that ``index_put`` wraps) ask here.
    """
    if packet_name(node.meta.get("original_aten")) == packet:
        return True
    source = node.meta.get("torch_fn")
    function = source[1] if isinstance(source, tuple) and len(source) == 2 else None
    return isinstance(function, str) and function.rsplit(".", 1)[-1] in (packet, f"{packet}_")


def write_back_copies(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Every write-back: a ``copy_(placeholder, value)`` node (aten or edge), in graph order.

    exir writes a mutated buffer or input back this way; the one helper every pass,
    report and check uses to find them.
    """
    return [
        node
        for node in graph.nodes
        if node.op == "call_function"
        and packet_name(node.target) == "copy_"
        and node.args
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "placeholder"
    ]


def _aliased_source(value: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory ``value`` is, through ops whose schema says their result aliases their
    first argument (views, ``alias``, ``to`` that changes nothing: ``Tensor(a) self -> Tensor(a)``)."""
    seen = 0
    while value.op == "call_function" and seen < 64:
        schema = schema_of(value.target)
        if schema is None or not schema.returns or not schema.arguments or not value.args:
            break
        returned, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
        source = value.args[0]
        if returned is None or first is None or returned.is_write or not isinstance(source, torch.fx.Node):
            break
        if not set(returned.before_set) & set(first.before_set):
            break
        value, seen = source, seen + 1
    return value


def written_placeholders(graph: torch.fx.Graph) -> dict[str, str]:
    """Placeholders an in-place op writes (an argument its schema marks written), directly or
    through a view or alias of them (``torch.export`` keeps a ``to`` that changes nothing as an
    alias: an ``add_`` on it writes the buffer): name -> op."""
    written: dict[str, str] = {}
    for node in graph.nodes:
        schema = schema_of(node.target) if node.op == "call_function" else None
        if schema is None:
            continue
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, torch.fx.Node):
                value = _aliased_source(value)
                if value.op == "placeholder":
                    written.setdefault(value.name, op_name(node.target))
    return written


def source_of(node: torch.fx.Node, with_class: bool = False) -> str:
    """Where the model wrote ``node``, in its own terms: the innermost module's path (with its
    class when ``with_class``) and the model's source line (``layers.0.conv at short_conv.py:77``,
    ``layers.0.conv (ShortConv) at short_conv.py:77``), from the node's ``nn_module_stack`` and
    ``stack_trace``; the node's name where the export kept neither."""
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if isinstance(stack, dict) and stack:
        entry = list(stack.values())[-1]
        path = str(entry[0]) if isinstance(entry, tuple) and entry else ""
        kind = entry[1] if isinstance(entry, tuple) and len(entry) > 1 else None
        name = kind if isinstance(kind, str) else getattr(kind, "__name__", "")
        if with_class and path and name:
            path = f"{path} ({name.rsplit('.', 1)[-1]})"
    line = _model_line(node.meta.get("stack_trace"))
    if path and line:
        return f"{path} at {line}"
    return path or line or f"node {node.name!r}"


def _model_line(trace: object) -> str:
    """``file.py:N`` of the last frame of ``trace`` (a Python traceback text), ``""`` for none."""
    if not isinstance(trace, str):
        return ""
    found = ""
    for text in trace.splitlines():
        text = text.strip()
        if text.startswith('File "') and '", line ' in text:
            name, _, rest = text[len('File "') :].partition('", line ')
            found = f"{name.replace(chr(92), '/').rsplit('/', 1)[-1]}:{rest.split(',', 1)[0]}"
    return found

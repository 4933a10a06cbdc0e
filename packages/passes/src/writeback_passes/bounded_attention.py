"""Attention over what is written: keys no mask row can see are not read.

A decoder with a static cache attends over every cache position at every call; the
mask it passes sets each position after the current one to ``-inf`` (or ``False``), so
those keys weigh exactly zero, yet the stock runtime computes them: at 64 tokens into
a 1,024-position cache, 94% of the attention's work. ExecuTorch's Llama example
exported with a dynamic token dimension (``enable_dynamic_shape``) builds its mask as
rows ``[start, start + n)`` of a causal table it keeps as a constant::

    mask = causal.narrow(0, start, n)
    out = scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)

This pass, on the exported ATen program (stage ``"exported"``), proves from the table
itself that no row ``i`` opens a column past ``i``; then every column from ``start + n``
on is closed in every row of the mask, and the attention reads keys, values and mask
columns ``[0, start + n)`` only (``narrow`` along the key axis, a size the runtime knows
at each call)::

    end = start + n
    out = scaled_dot_product_attention(q, k_cache.narrow(-2, 0, end),
                                       v_cache.narrow(-2, 0, end), mask.narrow(-1, 0, end))

The result is eager's up to the order of floating-point sums over the kept keys: a
closed column adds ``exp(-inf) = 0`` to the softmax's sum and ``0 * v`` to its output.

Refused (the attention is left whole; :attr:`BoundReport.refused` says why):

- the mask is not a ``narrow`` along rows of a 2-D constant (a parameter, an unwritten
  buffer, a lifted constant): a mask computed at run time, or rows picked by an index
  tensor (the one-token export's ``mask[input_pos]``), is not proved here;
- a table row opens a column past its own index (``-inf`` or ``False`` is required;
  ``finfo.min`` still weighs ``exp(min - max)``);
- the table has more rows than the key axis has positions, or its columns are not
  the key axis;
- ``dropout_p`` other than 0 or ``is_causal``: the kernel then changes what the mask
  says;
- keys or values not read from a buffer the program owns (a cache the caller passes
  may hold ``inf`` or ``nan`` in a closed row, and ``0 * nan`` is ``nan`` in eager) or
  reached through an op that may move the key axis; a buffer whose initial value is
  not finite.

What the proof assumes: the closed rows of a cache the program owns hold finite
values. They hold the buffer's initial value (checked here) or keys and values the
model computed at earlier calls; a model whose keys overflow to ``inf`` answers ``nan``
at that call already.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from writeback_core import ProgramPass
from writeback_core.ops import schema_of

from writeback_passes.graph import arg_value

__all__ = [
    "AttentionRefused",
    "BoundReport",
    "bound_attention",
    "bound_attention_pass",
    "input_of",
    "read_bound",
    "shape_of",
]

_aten = torch.ops.aten
_SDPA = _aten.scaled_dot_product_attention.default
_NARROW = _aten.narrow.default
# Ops a key or value passes through from the cache to the attention without moving the
# key axis (dim -2): a grouped-query repeat or expand along the heads, a copy, a cast.
_ALONG = {
    _aten.repeat_interleave.self_int,
    _aten.expand.default,
    _aten.clone.default,
    _aten.contiguous.default,
    _aten.to.dtype,
    _aten._to_copy.default,
    _aten.alias.default,
    _aten.detach.default,
}
# In-place or functional writes whose result is the cache they write (argument 0).
_WRITES = {
    _aten.index_copy_.default,
    _aten.index_copy.default,
    _aten.index_put_.default,
    _aten.index_put.default,
    _aten.copy_.default,
}


@dataclass
class BoundReport:
    """Which attention calls read keys ``[0, start + n)`` only (``bounded``), and why the
    others read the whole key axis (``refused``: node name -> reason)."""

    bounded: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


class AttentionRefused(Exception):
    """Why an attention is left as it is (raised by the checks, caught by the passes)."""


def _written_in_place(node: torch.fx.Node) -> bool:
    """Whether an op of the graph writes ``node`` in place (an argument its schema marks written)."""
    for user in node.users:
        schema = schema_of(user.target)
        if schema is None:
            continue
        for index, argument in enumerate(schema.arguments):
            value = user.args[index] if index < len(user.args) else user.kwargs.get(argument.name)
            if value is node and argument.alias_info is not None and argument.alias_info.is_write:
                return True
    return False


def input_of(program: ExportedProgram, node: torch.fx.Node) -> tuple[InputKind, bool, torch.Tensor | None] | None:
    """``(kind, written, value)`` of the program input ``node``: ``written`` when the program
    writes it (an in-place op, or a functional program's mutation output); ``value`` for a
    weight, buffer or constant. ``None``: not an input."""
    written = set(program.graph_signature.buffers_to_mutate.values())
    for spec in program.graph_signature.input_specs:
        if spec.arg is not None and getattr(spec.arg, "name", None) == node.name:
            value = None
            if spec.target is not None:
                value = program.state_dict.get(spec.target, program.constants.get(spec.target))
            is_written = spec.target in written or _written_in_place(node)
            return spec.kind, is_written, value if isinstance(value, torch.Tensor) else None
    return None


_NOT_ROWS = "the mask is not rows [start, start + n) of a constant table (narrow along rows)"


def _mask_table(program: ExportedProgram, mask: Any) -> tuple[str, torch.Tensor, Any, Any]:
    """``(name, table, start, n)`` of a mask that is ``table.narrow(0, start, n)``."""
    if not isinstance(mask, torch.fx.Node) or mask.target is not _NARROW:
        raise AttentionRefused(_NOT_ROWS)
    table, dim, start, length = mask.args
    if dim not in (0, -2) or not isinstance(table, torch.fx.Node) or table.op != "placeholder":
        raise AttentionRefused(_NOT_ROWS)
    found = input_of(program, table)
    if found is None or found[0] == InputKind.USER_INPUT or found[2] is None:
        raise AttentionRefused(f"the mask table {table.name!r} is not a constant of the program")
    _, written, value = found
    if written:
        raise AttentionRefused(f"the mask table {table.name!r} is written by the program")
    assert value is not None
    if value.dim() != 2:
        raise AttentionRefused(f"the mask table {table.name!r} has {value.dim()} dims, not 2")
    return table.name, value, start, length


def _check_causal(name: str, table: torch.Tensor) -> None:
    """Every row ``i`` of ``table`` closes every column past ``i``."""
    rows, cols = table.shape
    above = torch.arange(cols)[None, :] > torch.arange(rows)[:, None]
    opened = above & (table if table.dtype == torch.bool else table != float("-inf"))
    if bool(opened.any()):
        i, j = (int(x) for x in opened.nonzero()[0])
        closed = "False" if table.dtype == torch.bool else "-inf"
        raise AttentionRefused(
            f"mask table {name!r} row {i} opens column {j} past its own position "
            f"(value {table[i, j].item()!r}; only {closed} closes a column exactly)"
        )


def _moves_key_axis(node: torch.fx.Node) -> bool:
    """Whether ``node`` (one of ``_ALONG``) may change the key axis (dim -2) of its input."""
    if node.target is _aten.repeat_interleave.self_int:
        dim = arg_value(node, 2, "dim", None)
        rank = len(shape_of(node))
        return dim is None or not isinstance(dim, int) or dim % max(rank, 1) == rank - 2
    if node.target is _aten.expand.default:
        source = node.args[0]
        return not isinstance(source, torch.fx.Node) or shape_of(source)[-2:-1] != shape_of(node)[-2:-1]
    return False


def _cache_of(program: ExportedProgram, node: Any, what: str) -> torch.fx.Node:
    """The buffer placeholder ``node`` (a key or value) is read from along its key axis."""
    seen = node
    while isinstance(seen, torch.fx.Node) and seen.op == "call_function":
        if seen.target not in _WRITES and seen.target not in _ALONG:
            raise AttentionRefused(
                f"the {what} is computed by {seen.name} ({seen.target}), not read from a cache buffer"
            )
        if _moves_key_axis(seen):
            raise AttentionRefused(f"the {what} is reshaped along its key axis ({seen.name})")
        seen = seen.args[0]
    if not isinstance(seen, torch.fx.Node) or seen.op != "placeholder":
        raise AttentionRefused(f"the {what} is not read from a cache buffer")
    found = input_of(program, seen)
    if found is None or found[0] != InputKind.BUFFER:
        raise AttentionRefused(
            f"the {what} is read from input {seen.name!r}, not a buffer the program owns (a caller's cache may "
            "hold non-finite values in the rows the mask closes)"
        )
    value = found[2]
    if value is not None and value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise AttentionRefused(f"the {what}'s buffer {seen.name!r} starts with non-finite values")
    return seen


def shape_of(node: torch.fx.Node) -> tuple[Any, ...]:
    """The traced shape of ``node``; ``()`` when it has no traced tensor."""
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def read_bound(program: ExportedProgram, node: torch.fx.Node) -> tuple[Any, Any]:
    """``(start, n)`` when the attention ``node`` may read keys ``[0, start + n)`` only."""
    key, value = node.args[1:3]
    if arg_value(node, 4, "dropout_p", 0.0) != 0.0:
        raise AttentionRefused("dropout_p is not 0")
    if arg_value(node, 5, "is_causal", False):
        raise AttentionRefused("is_causal is set (the kernel adds its own mask)")
    name, table, start, length = _mask_table(program, arg_value(node, 3, "attn_mask", None))
    for what, operand in (("key", key), ("value", value)):
        _cache_of(program, operand, what)
    key_shape = shape_of(key) if isinstance(key, torch.fx.Node) else ()
    value_shape = shape_of(value) if isinstance(value, torch.fx.Node) else ()
    if len(key_shape) < 2 or len(value_shape) < 2 or not isinstance(key_shape[-2], int):
        raise AttentionRefused("the key axis has no static size")
    positions = key_shape[-2]
    if value_shape[-2] != positions:
        raise AttentionRefused(f"keys have {positions} positions and values {value_shape[-2]}")
    if table.shape[1] != positions or table.shape[0] > positions:
        raise AttentionRefused(
            f"the mask table is {list(table.shape)}; its columns must be the {positions} key positions "
            "and its rows at most as many"
        )
    _check_causal(name, table)
    return start, length


def _insert(graph: torch.fx.Graph, target: Any, args: tuple[Any, ...], val: Any) -> torch.fx.Node:
    new = graph.call_function(target, args)
    new.meta["val"] = val
    return new


def _narrowed(graph: torch.fx.Graph, source: torch.fx.Node, dim: int, end: torch.fx.Node) -> torch.fx.Node:
    val = source.meta["val"]
    with val.fake_mode:
        narrowed = _NARROW(val, dim, 0, end.meta["val"])
    return _insert(graph, _NARROW, (source, dim, 0, end), narrowed)


def _meta_value(value: Any) -> Any:
    return value.meta["val"] if isinstance(value, torch.fx.Node) else value


def bound_attention(program: ExportedProgram) -> BoundReport:
    """Make every attention of ``program`` whose mask closes every column past its rows
    read keys ``[0, start + n)`` only (see the module's rules). Edits ``program``'s graph
    in place."""
    report = BoundReport()
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        try:
            start, length = read_bound(program, node)
        except AttentionRefused as why:
            report.refused[node.name] = str(why)
            continue
        query, key, value = node.args[:3]
        mask = arg_value(node, 3, "attn_mask", None)
        with graph.inserting_before(node):
            end = _insert(graph, operator.add, (start, length), _meta_value(start) + _meta_value(length))
            key_part = _narrowed(graph, key, len(shape_of(key)) - 2, end)
            value_part = _narrowed(graph, value, len(shape_of(value)) - 2, end)
            mask_part = _narrowed(graph, mask, 1, end)
        rest = dict(node.kwargs)
        rest.pop("attn_mask", None)
        node.args = (query, key_part, value_part, mask_part, *node.args[4:])
        node.kwargs = rest
        report.bounded.append(node.name)
    if report.bounded:
        graph.lint()
        program.graph_module.recompile()
    return report


def bound_attention_pass() -> ProgramPass:
    """This pass as an ``"exported"`` :class:`~writeback_core.ProgramPass`, for the stock
    runtime's lowerings: MLX's delegate bounds each attention itself, to the window its masks
    leave at each call (``writeback_mlx_backend.window``), whatever form the mask takes."""
    from writeback_passes.backend_names import STOCK_RUNTIME

    return ProgramPass(
        name="bound_attention",
        stage="exported",
        run=bound_attention,
        backends=STOCK_RUNTIME,
        reason="attention reads only the keys its mask opens",
    )

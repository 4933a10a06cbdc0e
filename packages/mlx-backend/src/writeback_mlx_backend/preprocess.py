"""``WritebackMLXBackend.preprocess``: serialize a delegated edge subgraph into a blob.

Before serializing, the subgraph's attention gets the one graph rewrite the delegate builds
on: each scalar multiply of a matmul operand moves to the smaller operand
(:func:`writeback_core.matmul_scaling.scale_smaller_operand`). PyTorch's decomposed SDPA
scales both ``q`` and ``K^T``; with the scale on ``q`` alone the delegate runs the attention
as one ``mx.fast.scaled_dot_product_attention`` (``writeback_mlx_backend.fast``) and no step
scales the whole key cache. The delegate owns this: no program pass of another package is
needed for it (the stock runtime's lowerings run the same rewrite as writeback-passes'
``scale_smaller_operand`` pass).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, cast, final

import torch
import torch.fx
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from writeback_core.blob import dtype_name
from writeback_core.matmul_scaling import scale_smaller_operand
from writeback_core.ops import node_value

from writeback_mlx_backend.delegate_program import DelegateProgram, InPlaceCandidate
from writeback_mlx_backend.op_table import OPS, SPLIT, op_key, split_parts, unsupported_reason

__all__ = ["WRITE_OPS", "WritebackMLXBackend", "build_program"]

# Ops whose result is their first argument with part of it overwritten.
WRITE_OPS = frozenset(k for k, h in OPS.items() if h.region is not None)


def _encode(value: Any) -> Any:
    """A JSON form of a node argument (see ``writeback_mlx_backend.delegate_program``)."""
    if isinstance(value, torch.fx.Node):
        return {"$v": value.name}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isinf(value):
            return {"$float": "inf" if value > 0 else "-inf"}
        if math.isnan(value):
            return {"$float": "nan"}
        return value
    if isinstance(value, (torch.device, torch.layout, torch.memory_format)):
        return None
    raise ValueError(
        f"argument {value!r} of type {type(value).__name__} cannot be serialized into an MLX "
        "delegate blob; the partitioner should have left this node out"
    )


def _tensor_of(program: ExportedProgram, target: str) -> torch.Tensor:
    if target in program.state_dict:
        tensor: torch.Tensor = program.state_dict[target]
        return tensor
    if target in program.constants:
        value = program.constants[target]
        if isinstance(value, torch.Tensor):
            return value
    raise ValueError(f"the lowered program has no tensor for {target!r}")


def build_program(program: ExportedProgram) -> DelegateProgram:
    """Describe the edge subgraph ``program`` as a :class:`DelegateProgram`.

    1. User inputs become the delegate's arguments in order; parameters, constant
       tensors and buffers it only reads become constants; mutated buffers (the
       partitioner tagged them, so the delegate owns them) become state with
       their initial value. A tensor of zero bytes only (a fresh KV cache) is
       recorded as zeros of its shape and dtype, so the blob carries no bytes
       for it.
    2. ``call_function`` nodes are recorded in graph order with JSON arguments.
    3. User outputs become the delegate's results; buffer mutations become state
       updates. An output that is a write op into a user input is an in-place
       candidate.
    """
    sig = program.graph_signature
    graph = program.graph_module.graph
    mutated = {spec.target for spec in sig.output_specs if spec.kind is OutputKind.BUFFER_MUTATION}
    specs = {spec.arg.name: spec for spec in sig.input_specs if hasattr(spec.arg, "name")}
    result = DelegateProgram(inputs=[], input_meta=[], outputs=[], nodes=[])
    for node in graph.nodes:
        if node.op == "placeholder":
            _add_placeholder(program, result, node, specs.get(node.name), mutated)
        elif node.op == "call_function":
            _add_node(result, node)
        elif node.op == "output":
            _add_outputs(program, result, node)
    return result


def _add_placeholder(
    program: ExportedProgram,
    result: DelegateProgram,
    node: torch.fx.Node,
    spec: Any,
    mutated: set[str | None],
) -> None:
    kind = spec.kind if spec is not None else InputKind.USER_INPUT
    if kind is InputKind.USER_INPUT:
        val = node.meta.get("val")
        result.inputs.append(node.name)
        result.input_meta.append(
            {"shape": list(val.shape), "dtype": dtype_name(val.dtype)}
            if isinstance(val, torch.Tensor)
            else {"scalar": True}
        )
        return
    tensor = _tensor_of(program, str(spec.target))
    if kind is InputKind.BUFFER and spec.target in mutated:
        result.state[node.name] = result.add_tensor(tensor)
    else:
        result.constants[node.name] = result.add_tensor(tensor)


def _add_node(result: DelegateProgram, node: torch.fx.Node) -> None:
    key = op_key(node.target)
    if key == SPLIT:
        return  # each part the graph reads becomes a slice step (below)
    split = node.args[0] if node.target is operator.getitem and node.args else None
    if isinstance(split, torch.fx.Node) and op_key(split.target) == SPLIT:
        found, index = split_parts(split), node.args[1]
        if found is None or not isinstance(index, int) or unsupported_reason(split) is not None:
            raise ValueError(f"split {split.name!r} reached the MLX delegate; the partitioner must leave it outside")
        dim, parts = found
        start, end = parts[index]
        _append(result, node, "aten.slice_copy.Tensor", [split.args[0], dim, start, end, 1], {})
        return
    if key not in OPS:
        raise ValueError(
            f"node {node.name!r} ({key or node.target}) reached the MLX delegate but has no "
            "handler; the partitioner must leave it outside"
        )
    args = list(node.args)
    if key == "aten.copy.default" and _same_meta(args[0], args[1]):
        # exir's functional copy of a new value into a mutated input: only the
        # destination's shape is read, so it is the new value itself. Dropping the
        # read of the old input matters: that read would otherwise keep the old
        # contents alive past an in-place write (and force a snapshot of them).
        key, args = "aten.alias.default", [args[1]]
    _append(result, node, key, args, node.kwargs)


def _append(result: DelegateProgram, node: torch.fx.Node, key: str, args: list[Any], kwargs: Any) -> None:
    """Record ``node`` as one step running op ``key`` on ``args`` and ``kwargs``."""
    val = node.meta.get("val")
    result.nodes.append(
        {
            "name": node.name,
            "op": key,
            "args": _encode(args),
            "kwargs": {k: _encode(v) for k, v in kwargs.items()},
            "dtype": dtype_name(val.dtype) if isinstance(val, torch.Tensor) else None,
        }
    )


def _same_meta(a: Any, b: Any) -> bool:
    va, vb = node_value(a), node_value(b)
    return (
        isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape and va.dtype == vb.dtype
    )


def _add_outputs(program: ExportedProgram, result: DelegateProgram, node: torch.fx.Node) -> None:
    sig = program.graph_signature
    inputs_to_buffers = sig.inputs_to_buffers
    buffer_placeholder = {target: name for name, target in inputs_to_buffers.items()}
    values = list(cast(Sequence[Any], node.args[0]))
    for spec, value in zip(sig.output_specs, values, strict=True):
        if spec.kind is OutputKind.BUFFER_MUTATION:
            result.state_updates[buffer_placeholder[str(spec.target)]] = value.name
            continue
        write = _write_into_input(value, result.inputs)
        if write is not None:
            dest = write.args[0]
            assert isinstance(dest, torch.fx.Node)
            result.in_place.append(InPlaceCandidate(len(result.outputs), result.inputs.index(dest.name), write.name))
        result.outputs.append(_encode(value))


def _write_into_input(value: Any, inputs: list[str]) -> torch.fx.Node | None:
    """The write op behind ``value`` whose destination is a user input, if any.

    Functional ``aten.copy(P, x)`` nodes that exir adds for a mutated input
    ``P`` are looked through: their value is ``x`` in ``P``'s shape.
    """
    node = value
    while isinstance(node, torch.fx.Node) and op_key(node.target) == "aten.copy.default":
        node = node.args[1]
    if not isinstance(node, torch.fx.Node) or op_key(node.target) not in WRITE_OPS:
        return None
    dest = node.args[0]
    if not isinstance(dest, torch.fx.Node) or dest.name not in inputs:
        return None
    return node if _copies_into(value, node, dest) else None


def _copies_into(value: Any, write: torch.fx.Node, dest: torch.fx.Node) -> bool:
    """Whether every copy from ``value`` down to ``write`` copies into ``dest``."""
    through = value
    while through is not write:
        if through.args[0] is not dest:
            return False
        through = through.args[1]
    return True


@final
class WritebackMLXBackend(BackendDetails):  # type: ignore[misc]  # executorch is untyped
    """ExecuTorch ``BackendDetails`` of the MLX delegate (the class name is the backend id)."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        """Move each attention's scale to its smaller operand (the module docstring), then
        serialize the delegated subgraph, weights and initial state into one blob.

        ``edge_program`` is exir's copy of the partition, the delegate's to change."""
        scale_smaller_operand(edge_program)
        return PreprocessResult(processed_bytes=build_program(edge_program).to_bytes())

"""Lowering of the kv-alias engine: its exir ``Partitioner`` and ``BackendDetails.preprocess``."""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping
from typing import Any, final

import torch
import torch.fx
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from torch.export import ExportedProgram
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from writeback_core import meta
from writeback_core.ops import decomposed_from, packet_name

from writeback_trt_copyback._blob import Blob, encode_arg, encode_tensor, engine_op_key, ops
from writeback_trt_copyback.clones import peel_input_clones
from writeback_trt_copyback.derive import Bounds, engine_write, resolve_bounds
from writeback_trt_copyback.kv_alias_options import BACKEND_ID, KVAliasOptions, op_excluded

__all__ = ["KVAliasPartitioner", "WritebackKVAliasBackend"]

# Write ops the engine can perform in place, keyed by aten packet.
_IN_PLACE_WRITES = {"index_put", "slice_scatter", "index_copy"}

# exir's edge dialect spells views as copies (``permute_copy``); the engine runs the view
# instead, so reading a cache through a transpose costs no cache-sized copy. Safe because
# the engine writes only into inputs that nothing else reads (``derive.engine_write``).
_VIEW_OF_COPY = {
    "aten.view_copy.default": "aten.reshape.default",
    "aten.permute_copy.default": "aten.permute.default",
    "aten.expand_copy.default": "aten.expand.default",
    "aten.transpose_copy.int": "aten.transpose.int",
    "aten.t_copy.default": "aten.t.default",
    "aten.slice_copy.Tensor": "aten.slice.Tensor",
    "aten.select_copy.int": "aten.select.int",
    "aten.unsqueeze_copy.default": "aten.unsqueeze.default",
    "aten.squeeze_copy.dims": "aten.squeeze.dims",
    "aten.squeeze_copy.dim": "aten.squeeze.dim",
    "aten.alias_copy.default": "aten.alias.default",
    "aten.split_copy.Tensor": "aten.split.Tensor",
    "aten.unbind_copy.int": "aten.unbind.int",
}


class _Support(OperatorSupportBase):
    def __init__(self, engine: KVAliasOptions) -> None:
        self.engine = engine

    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            source = node.args[0]
            return isinstance(source, torch.fx.Node) and self.is_node_supported(submodules, source)
        try:
            key = engine_op_key(node.target)
        except TypeError:
            return False
        # The runtime delegate runs only the ops of its allow-list (views under their own names).
        return _VIEW_OF_COPY.get(key, key) in ops() and not op_excluded(key, self.engine.excluded_ops)


class KVAliasPartitioner(Partitioner):  # type: ignore[misc]  # exir's base is untyped
    """Tags every connected group of ops the engine takes; placeholders are never tagged.

    Buffers, parameters and constants stay outside the delegate and reach it as
    inputs, so a cache the engine writes in place is the program's own
    (caller-visible) buffer. A group of fewer than ``engine.min_block_size``
    ops is left to ExecuTorch's kernels.
    """

    def __init__(self, engine: KVAliasOptions) -> None:
        super().__init__()
        self.engine = engine
        self.delegation_spec = DelegationSpec(BACKEND_ID, engine.compile_specs())

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        proposer = CapabilityBasedPartitioner(
            exported_program.graph_module, _Support(self.engine), allows_single_node_partition=True
        )
        tags: dict[str, DelegationSpec] = {}
        for index, part in enumerate(proposer.propose_partitions()):
            ops = [n for n in part.nodes if n.target is not operator.getitem]
            if len(ops) < self.engine.min_block_size:
                continue
            tag = f"kv_alias_{index}"
            for node in part.nodes:
                node.meta["delegation_tag"] = tag
            tags[tag] = self.delegation_spec
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)


def _as_index_copy(node: torch.fx.Node) -> tuple[int, torch.fx.Node] | None:
    """``(dim, index)`` of the ``index_copy`` an ``index_put`` node was decomposed from (its
    indices are ``None`` for every dim before one 1-d index tensor); ``None`` for any other node."""
    indices = node.args[1] if len(node.args) > 1 else None
    if not decomposed_from(node, "index_copy") or not isinstance(indices, (list, tuple)) or not indices:
        return None
    *leading, index = indices
    val = index.meta.get("val") if isinstance(index, torch.fx.Node) else None
    if any(i is not None for i in leading) or not isinstance(val, torch.Tensor) or val.dim() != 1:
        return None
    assert isinstance(index, torch.fx.Node)
    return len(leading), index


def _owned_tensor(program: ExportedProgram, name: str) -> torch.Tensor:
    sig = program.graph_signature
    fqn = (
        sig.inputs_to_parameters.get(name)
        or sig.inputs_to_buffers.get(name)
        or sig.inputs_to_lifted_tensor_constants.get(name)
    )
    if fqn is None:
        raise ValueError(
            f"kv-alias engine: partition input {name!r} is neither a user input nor "
            "a parameter, buffer or constant of the partition"
        )
    value = program.state_dict.get(fqn, program.constants.get(fqn))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"kv-alias engine: no tensor for {fqn!r} in the partition")
    return value


def _check_slice_source(node: torch.fx.Node, cache_shape: tuple[object, ...], bounds: Bounds) -> None:
    """Refuse a slice write whose value does not have the shape of the clamped slots it lands in.

    The engine writes ``src`` into exactly ``bounds.length`` slots from
    ``bounds.start``; a value of another shape would be broadcast into them
    (or fail half-way), never what eager PyTorch computes.
    """
    src = node.args[1]
    val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or bounds.dim is None:
        return
    expected = tuple(bounds.length if d == bounds.dim else s for d, s in enumerate(cache_shape))
    if tuple(val.shape) != expected:
        raise ValueError(
            f"kv-alias engine: slice write {node.name} lands {bounds.length} slot(s) of dim {bounds.dim} "
            f"from {bounds.start} (its bounds clamped to the cache), expected a value of shape "
            f"{list(expected)}, got {list(val.shape)}; the graph is inconsistent: re-export the model "
            "(torch.export checks this shape) or exclude the write from the engine"
        )


def _in_place_step(node: torch.fx.Node, position: int, engine: KVAliasOptions) -> dict[str, Any] | None:
    """The in-place update for write ``node`` into input ``position``, or ``None`` if refused."""
    if not isinstance(meta.get_custom(node, meta.COPY_BACK_CLASS), dict):
        # Not a buffer's new value (a functional ``buf.index_copy(...)`` whose result is
        # only read): writing it in place would change a buffer the program leaves alone.
        return None
    cache = node.args[0]
    assert isinstance(cache, torch.fx.Node)
    write = engine_write(node, cache)
    if engine.alias_refusal(write) is not None:
        return None
    bounds = resolve_bounds(write)
    step: dict[str, Any] = {"name": node.name, "input": position}
    packet = packet_name(node.target)
    if packet == "slice_scatter":
        _check_slice_source(node, write.shape, bounds)
        step.update(
            update="slice",
            dim=bounds.dim,
            start=bounds.start,
            length=bounds.length,
            src=encode_arg(node.args[1]),
        )
    elif packet == "index_put" and (as_copy := _as_index_copy(node)) is not None:
        # A decomposed index_copy_ runs as one: eager's index_copy rejects a negative index
        # that index_put would wrap.
        step.update(update="index_copy", dim=as_copy[0], index=encode_arg(as_copy[1]), src=encode_arg(node.args[2]))
    elif packet == "index_put":
        step.update(update="index_put", indices=encode_arg(node.args[1]), src=encode_arg(node.args[2]))
    else:
        step.update(
            update="index_copy",
            dim=bounds.dim,
            index=encode_arg(node.args[2]),
            src=encode_arg(node.args[3]),
        )
    return step


@final
class WritebackKVAliasBackend(BackendDetails):  # type: ignore[misc]  # exir's base is untyped
    """``preprocess``: the partition as a list of aten calls, cache writes made in place.

    Algorithm:
      1. Copy the partition and peel input clones (``clones.peel_input_clones``).
      2. Walk the nodes in order. A write op (``index_put``, ``slice_scatter``,
         ``index_copy``) whose destination is a partition input becomes an
         in-place update of that input when it is a buffer's new value (lift
         recorded ``meta.COPY_BACK_CLASS`` on it) and the engine's rule accepts
         the write, derived by ``derive.engine_write`` exactly as the classifier
         derives it; every other node becomes a call of its aten op. Refused:
         ``t = buf.index_copy(2, pos, x)`` with ``buf`` never written, which is
         a functional write whose result only is read.
      3. Record each in-place write in ``aliased_io``: ``output<k>`` when the
         write is the delegate's output ``k`` (the runtime leaves that output
         untouched: the input holds the value), ``update:<node>`` otherwise.
    """

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        engine = KVAliasOptions.from_compile_specs(compile_specs)
        module = copy.deepcopy(edge_program.graph_module)
        graph = module.graph
        peel_input_clones(graph)
        user_inputs = list(edge_program.graph_signature.user_inputs)
        position = {name: i for i, name in enumerate(user_inputs)}
        blob = Blob(inputs=user_inputs, steps=[], outputs=[])
        in_place: dict[str, int] = {}
        for node in graph.nodes:
            if meta.get_custom(node, meta.NO_ALIAS) is not None:
                blob.marked.append(node.name)
            if node.op == "placeholder":
                if node.name not in position:
                    blob.constants[node.name] = encode_tensor(_owned_tensor(edge_program, node.name))
                continue
            if node.op != "call_function":
                continue
            dest = node.args[0] if node.args else None
            step = None
            if (
                packet_name(node.target) in _IN_PLACE_WRITES
                and isinstance(dest, torch.fx.Node)
                and dest.name in position
            ):
                step = _in_place_step(node, position[dest.name], engine)
            if step is not None:
                in_place[node.name] = step["input"]
            elif (as_copy := _as_index_copy(node)) is not None:
                # The index_put an index_copy_ decomposed into runs as the index_copy eager
                # ran: it rejects a negative index index_put would wrap.
                step = {
                    "name": node.name,
                    "op": "aten.index_copy.default",
                    "args": encode_arg([node.args[0], as_copy[0], as_copy[1], node.args[2]]),
                    "kwargs": encode_arg({}),
                }
            else:
                key = engine_op_key(node.target)
                step = {
                    "name": node.name,
                    "op": _VIEW_OF_COPY.get(key, key),
                    "args": encode_arg(list(node.args)),
                    "kwargs": encode_arg(dict(node.kwargs)),
                }
            blob.steps.append(step)
        outputs = graph.output_node().args[0]
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        blob.outputs = [encode_arg(o) for o in outputs]
        for name, input_index in in_place.items():
            indices = [k for k, o in enumerate(outputs) if isinstance(o, torch.fx.Node) and o.name == name]
            binding = f"output{indices[0]}" if indices else f"update:{name}"
            blob.aliased_io[binding] = input_index
        return PreprocessResult(processed_bytes=blob.to_bytes())

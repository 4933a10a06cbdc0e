"""The example backend's partitioner, preprocess and Python runtime delegate."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, final

import torch
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from torch.export import ExportedProgram
from writeback_core import in_place_outputs, meta
from writeback_core.blob import BlobReader, load_json
from writeback_core.ops import normalize_dim, packet_name

from writeback_example_backend import BACKEND_ID, BACKEND_NAME

__all__ = [
    "IN_PLACE_OUTPUTS_SPEC",
    "ExamplePartitioner",
    "ExampleRuntimeDelegate",
    "WritebackExampleBackend",
    "single_index_dim",
]


def single_index_dim(node: torch.fx.Node) -> int | None:
    """The dim of ``index_put(dest, [None, .., idx], src)`` with one 1-D index, else None: the
    nodes this backend delegates (the partitioner) and the ones its plugin knows are not a plain
    read of the state (``writeback_accepts_in_place``)."""
    if packet_name(node.target) != "index_put" or len(node.args) < 3:
        return None
    if len(node.args) > 3 and node.args[3]:
        return None
    indices = node.args[1]
    if not isinstance(indices, (list, tuple)):
        return None
    present = [i for i, idx in enumerate(indices) if idx is not None]
    index = indices[-1] if present == [len(indices) - 1] else None
    if not isinstance(index, torch.fx.Node):
        return None
    val = index.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1:
        return None
    return present[0]


class ExamplePartitioner(Partitioner):  # type: ignore[misc]  # executorch is untyped: its bases are Any
    """Delegates each one-index ``index_put`` node (the exported form of ``index_copy_``).

    It only tags nodes, as every exir partitioner does: core's lowering path
    wraps it with :func:`writeback_core.annotating`, which asks
    ``writeback_accepts_in_place`` about each mutation a partition touches and
    records the decision.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        tags: dict[str, DelegationSpec] = {}
        for node in exported_program.graph_module.graph.nodes:
            if node.op != "call_function" or single_index_dim(node) is None:
                continue
            tag = f"{BACKEND_NAME}_{len(tags)}"
            node.meta["delegation_tag"] = tag
            tags[tag] = DelegationSpec(BACKEND_ID, [])
        return PartitionResult(tagged_exported_program=exported_program, partition_tags=tags)


@final
class WritebackExampleBackend(BackendDetails):  # type: ignore[misc]  # executorch is untyped: its bases are Any
    """Serializes which delegate argument is the destination, index and source."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        graph = edge_program.graph_module.graph
        inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
        (node,) = [n for n in graph.nodes if n.op == "call_function" and single_index_dim(n) is not None]
        dest, indices, source = node.args[0], node.args[1], node.args[2]
        plan = {
            "dim": single_index_dim(node),
            "dest": inputs.index(dest.name),
            "index": inputs.index(indices[-1].name),
            "source": inputs.index(source.name),
            "inputs": len(inputs),
        }
        return PreprocessResult(processed_bytes=json.dumps(plan).encode())


# The compile-spec key under which a pass that drops a write-back tells the
# delegate to write an input in place (defined and documented in core).
IN_PLACE_OUTPUTS_SPEC = meta.IN_PLACE_OUTPUTS_SPEC


def _broadcasts(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` (trailing dims equal or 1)."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False))


class ExampleRuntimeDelegate:
    """Performs ``index_copy(dest, dim, index, source)``, in place only when told to.

    Arguments are the delegate's inputs then its one output. The destination
    is written in place only when the lowered module's compile spec
    :data:`IN_PLACE_OUTPUTS_SPEC` names it (a pass dropped its write-back, so
    nothing reads the old value afterwards); otherwise the destination is left
    untouched and the result goes to the output: writing it in place anyway
    would change state that the program still reads, or that is not state at
    all (a functional ``index_copy`` of a read-only buffer).
    """

    backend_id = BACKEND_ID

    def init(self, processed: bytes, compile_specs: Mapping[str, bytes]) -> dict[str, Any]:
        """Read the plan with :mod:`writeback_core.blob`: every field an int in range.

        :raises writeback_core.blob.BlobError: naming the field, before anything runs.
        """
        read = BlobReader(BACKEND_NAME)
        plan = read.record(
            load_json(processed, BACKEND_NAME), "plan", keys=("dim", "dest", "index", "source", "inputs")
        )
        count = read.integer(plan["inputs"], "inputs", 3)
        handle: dict[str, Any] = {key: read.integer(plan[key], key, 0, count) for key in ("dest", "index", "source")}
        handle["inputs"] = count
        handle["dim"] = read.integer(plan["dim"], "dim", 0)
        entries = in_place_outputs(compile_specs, BACKEND_NAME, count, 1)
        for entry in entries:
            if entry.input != handle["dest"]:
                # Only the destination can take the result: ignoring the entry would
                # leave the output unwritten and the input unchanged.
                raise read.fail(
                    f"compile_specs[{IN_PLACE_OUTPUTS_SPEC!r}]",
                    entry._asdict(),
                    f"the delegate writes its output in place only into its destination (input {handle['dest']})",
                )
        handle["in_place"] = bool(entries)
        return handle

    def execute(self, handle: dict[str, Any], args: Sequence[Any]) -> None:
        if len(args) != handle["inputs"] + 1:
            raise ValueError(
                f"example delegate expects {handle['inputs']} inputs and 1 output, got {len(args)} arguments"
            )
        dest, index, source = args[handle["dest"]], args[handle["index"]], args[handle["source"]]
        out = args[handle["inputs"]]
        # The plan's dim and argument positions are checked against this call's tensors
        # (init cannot know their ranks): as eager's index_copy refuses them, by name.
        dim = normalize_dim(
            handle["dim"], dest.dim(), what=f"example delegate: dim {handle['dim']} indexes the destination"
        )
        if index.dtype not in (torch.int64, torch.int32) or index.dim() > 1:
            raise IndexError(
                f"example delegate: the index (input {handle['index']}) must be a 0-D or 1-D int64 or int32 "
                f"tensor, got shape {[*index.shape]} of {index.dtype}; the plan names the wrong input"
            )
        if bool((index < 0).any()) or bool((index >= dest.shape[dim]).any()):
            raise IndexError(f"index_copy: index {index.tolist()} out of range for dim {dim} of size {dest.shape[dim]}")
        # index_put broadcasts its values to the indexed region (ExecuTorch's Llama writes
        # [batch, 1, heads, dim] values at one position); index_copy wants them whole.
        region = [*dest.shape]
        region[dim] = index.numel()
        if not _broadcasts(source.shape, region):
            raise ValueError(
                f"index_put: values of shape {[*source.shape]} do not broadcast to the indexed region {region}"
            )
        source = source.expand(region)
        if handle["in_place"]:
            dest.index_copy_(dim, index, source)
            return
        # Computed whole before the output is touched: a refused call leaves it as it was.
        out.copy_(dest.index_copy(dim, index, source))

    def destroy(self, handle: dict[str, Any]) -> None:
        return None

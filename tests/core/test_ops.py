"""``writeback_core.ops`` sees through the edge dialect: an edge op is the aten op it wraps,
with its name and schema, and the write-back copies exir inserts are found in the graph."""

from __future__ import annotations

import torch
from executorch.exir import to_edge
from writeback_core.exporting import export_model
from writeback_core.ops import aten_op, packet_name, schema_of, write_back_copies


class SlotWrite(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cache: torch.Tensor
        self.register_buffer("cache", torch.zeros(4, 2))

    def forward(self, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        self.cache.index_put_((pos,), row)
        return self.cache.sum()


_ARGS = (torch.tensor([1]), torch.ones(1, 2))


def _edge_calls() -> list[torch.fx.Node]:
    edge = to_edge(export_model(SlotWrite(), _ARGS))
    return [n for n in edge.exported_program().graph.nodes if n.op == "call_function"]


def test_an_edge_op_is_the_aten_op_it_wraps_with_its_name_and_schema() -> None:
    (write,) = [n for n in _edge_calls() if "index_put" in str(n.target)]
    assert write.target is not torch.ops.aten.index_put.default  # the edge dialect's wrapper
    assert aten_op(write.target) is torch.ops.aten.index_put.default
    assert packet_name(write.target) == "index_put"
    schema = schema_of(write.target)
    assert schema is not None and schema.name == "aten::index_put"
    assert [a.name for a in schema.arguments] == ["self", "indices", "values", "accumulate"]


def test_a_target_that_is_no_aten_op_is_itself_and_has_no_packet() -> None:
    assert aten_op(len) is len
    assert packet_name(len) is None and packet_name(torch.ops.aten.add.Tensor) == "add"


def test_the_write_back_copy_to_executorch_inserts_is_found_into_the_cache() -> None:
    program = to_edge(export_model(SlotWrite(), _ARGS)).to_executorch()
    graph = program.exported_program().graph
    (copy,) = write_back_copies(graph)
    destination = copy.args[0]
    assert isinstance(destination, torch.fx.Node) and destination.op == "placeholder"
    (cache_input,) = program.exported_program().graph_signature.inputs_to_buffers
    assert destination.name == cache_input

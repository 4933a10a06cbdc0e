"""Alias analysis: each rule checked on a real exported or edge graph, expectations by hand."""

from __future__ import annotations

import operator

import torch
from writeback_core import AliasAnalysis


def _nodes(program):  # type: ignore[no-untyped-def]
    return {n.name: n for n in program.graph_module.graph.nodes}


class ViewChain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        view = self.buf.view(6, 4).transpose(0, 1)[1:3]
        fresh = view * 2
        return fresh + x


def test_view_chain_aliases_the_buffer_and_a_computed_value_does_not(export) -> None:  # type: ignore[no-untyped-def]
    program = export(ViewChain(), (torch.ones(2, 6),))
    nodes = _nodes(program)
    analysis = AliasAnalysis(program.graph_module.graph)
    buf = nodes["b_buf"]
    views = [n for n in nodes.values() if n.op == "call_function" and n.name.startswith(("view", "transpose", "slice"))]
    assert len(views) == 3
    for view in views:
        assert analysis.may_alias(view, buf), view.name
    mul = nodes["mul"]
    assert not analysis.may_alias(mul, buf)
    assert analysis.aliases(buf) == frozenset({buf, *views})
    assert analysis.writers_of(buf) == ()


class Split(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.buf.split(2)
        return a + b + x


def test_getitem_counts_as_aliasing_its_source(export) -> None:  # type: ignore[no-untyped-def]
    program = export(Split(), (torch.ones(2, 6),))
    analysis = AliasAnalysis(program.graph_module.graph)
    nodes = _nodes(program)
    items = [n for n in nodes.values() if n.target is operator.getitem]
    assert len(items) == 2
    for item in items:
        assert analysis.may_alias(item, nodes["b_buf"])
        assert analysis.writes(item) == ()


@torch.library.custom_op("writeback_test::scale", mutates_args=())
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_scale.register_fake
def _scale_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class CustomOp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.writeback_test.scale(self.buf) + x


def test_custom_op_with_schema_but_no_alias_annotation_counts_as_writing(export) -> None:  # type: ignore[no-untyped-def]
    program = export(CustomOp(), (torch.ones(3),))
    nodes = _nodes(program)
    (call,) = [n for n in nodes.values() if "writeback_test" in str(n.target)]
    schema = call.target._schema
    assert all(a.alias_info is None for a in schema.arguments)  # no (a!) anywhere
    analysis = AliasAnalysis(program.graph_module.graph)
    assert analysis.writes(call) == (nodes["b_buf"],)
    assert analysis.writes_alias_of(call, nodes["b_buf"])
    assert analysis.may_alias(call, nodes["b_buf"])
    assert analysis.writers_of(nodes["b_buf"]) == (call,)


class Cache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 2, 8, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(2, pos, x)
        return self.cache.sum()


def test_in_place_ops_after_exir_reinplace_write_and_alias_the_cache(edge) -> None:  # type: ignore[no-untyped-def]
    from executorch.exir.passes.reinplace import reinplace_pass

    program = edge(Cache(), (torch.ones(1, 2, 1, 4), torch.tensor([3]))).exported_program()
    program = reinplace_pass(program)
    nodes = _nodes(program)
    (inplace,) = [n for n in nodes.values() if "index_put_" in str(n.target)]
    analysis = AliasAnalysis(program.graph_module.graph)
    cache = nodes["b_cache"]
    assert analysis.writes(inplace) == (cache,)
    assert analysis.may_alias(inplace, cache)
    (total,) = [n for n in nodes.values() if "sum" in str(n.target)]
    assert not analysis.may_alias(total, cache)


def test_exir_share_allocation_annotation_is_an_alias_edge(export) -> None:  # type: ignore[no-untyped-def]
    program = export(ViewChain(), (torch.ones(2, 6),))
    nodes = _nodes(program)
    assert not AliasAnalysis(program.graph_module.graph).may_alias(nodes["mul"], nodes["b_buf"])
    # mul's first argument is the slice view of buf; exir's reinplace pass marks
    # an op that reuses that argument's allocation this way.
    nodes["mul"].meta["_share_alloc_with_arg_idx"] = 0
    analysis = AliasAnalysis(program.graph_module.graph)
    assert analysis.may_alias(nodes["mul"], nodes["b_buf"])
    assert analysis.writes_alias_of(nodes["mul"], nodes["b_buf"])


def test_out_variants_after_to_executorch_alias_their_out_argument(edge) -> None:  # type: ignore[no-untyped-def]
    program = edge(ViewChain(), (torch.ones(2, 6),)).to_executorch().exported_program()
    graph = program.graph_module.graph
    analysis = AliasAnalysis(graph)
    outs = [n for n in graph.nodes if n.op == "call_function" and "out" in n.kwargs]
    assert outs
    for node in outs:
        assert analysis.may_alias(node, node.kwargs["out"])
        assert node.kwargs["out"] in analysis.writes(node)


def test_delegate_call_is_conservative(export) -> None:  # type: ignore[no-untyped-def]
    from executorch.exir import to_edge_transform_and_lower
    from writeback_example_backend.backend import ExamplePartitioner

    ep = export(Cache(), (torch.ones(1, 2, 1, 4), torch.tensor([3])))
    lowered = to_edge_transform_and_lower(ep, partitioner=[ExamplePartitioner()]).exported_program()
    graph = lowered.graph_module.graph
    nodes = {n.name: n for n in graph.nodes}
    (call,) = [n for n in graph.nodes if "call_delegate" in str(n.target)]
    analysis = AliasAnalysis(graph)
    assert nodes["b_cache"] in analysis.writes(call)
    assert nodes["x"] in analysis.writes(call)
    assert analysis.may_alias(call, nodes["b_cache"])


def test_node_added_after_build_is_rejected(export) -> None:  # type: ignore[no-untyped-def]
    import pytest

    program = export(ViewChain(), (torch.ones(2, 6),))
    graph = program.graph_module.graph
    analysis = AliasAnalysis(graph)
    nodes = _nodes(program)
    with graph.inserting_after(nodes["mul"]):
        extra = graph.call_function(torch.ops.aten.neg.default, (nodes["mul"],))
    with pytest.raises(KeyError, match="added after"):
        analysis.may_alias(extra, nodes["b_buf"])

"""The per-mutation decision survives to_edge, partitioning, lowering and to_executorch."""

from __future__ import annotations

import json

import pytest
import torch
from executorch.exir import to_edge, to_edge_transform_and_lower
from writeback.model_build import export_case
from writeback.zoo import builtin_models
from writeback_core import PartitionView, annotating, find_mutations, in_place_decisions, load_registry


def test_decision_recorded_before_to_edge_survives_to_edge_and_to_executorch() -> None:
    program = export_case(builtin_models()["decoder"])
    registry = load_registry(entry_points=False)
    graph = program.graph_module.graph
    mutations = find_mutations(program.run_decompositions())
    view = PartitionView("toy", frozenset(), graph)
    registry.annotate_in_place(graph, "toy", view, mutations)
    edge = to_edge(program)
    found = in_place_decisions(edge.exported_program())
    assert set(found) == {"blocks.0.k_cache", "blocks.0.v_cache"}
    assert all(d.backend == "toy" and d.accepted is False for d in found.values())
    final = edge.to_executorch().exported_program()
    assert set(in_place_decisions(final)) == set(found)


@pytest.mark.parametrize("name", ["decoder", "decoder-caller-cache"])
def test_partitioner_answer_reaches_the_annotation_through_lowering(name: str) -> None:
    from writeback_example_backend.backend import ExamplePartitioner

    registry = load_registry()  # the example backend comes through its entry point
    program = export_case(builtin_models()[name])
    lowered = to_edge_transform_and_lower(program, partitioner=[annotating(ExamplePartitioner(), "example", registry)])
    found = in_place_decisions(lowered.exported_program())
    targets = {m.target for m in find_mutations(program.run_decompositions())}
    assert set(found) == targets
    for decision in found.values():
        assert decision.backend == "example"
        assert decision.accepted is True
        assert decision.accepted_by == ("example-backend",)
        assert decision.write == "index_copy"
    graph = lowered.exported_program().graph_module.graph
    assert any("call_delegate" in str(n.target) for n in graph.nodes)
    final = lowered.to_executorch().exported_program()
    assert set(in_place_decisions(final)) == targets


def test_decision_on_a_placeholder_the_graph_lacks_is_a_clear_error() -> None:
    program = export_case(builtin_models()["ema"])
    other = export_case(builtin_models()["decoder"]).run_decompositions()
    registry = load_registry(entry_points=False)
    graph = program.graph_module.graph
    with pytest.raises(KeyError, match="b_blocks_0_k_cache"):
        registry.annotate_in_place(graph, "toy", PartitionView("toy", frozenset(), graph), find_mutations(other))
    assert in_place_decisions(program) == {}


def test_example_backend_runs_from_pte_and_writes_the_cache() -> None:
    """The example delegate is real: lowered, serialized, loaded by stock executorch.runtime
    once its Python delegate is registered by a runtime; here we execute its delegate
    directly on the processed blob against eager index_copy_."""
    from writeback_example_backend.backend import IN_PLACE_OUTPUTS_SPEC, ExampleRuntimeDelegate

    registry = load_registry()
    case = builtin_models()["decoder-caller-cache"]
    from writeback_example_backend.backend import ExamplePartitioner

    lowered = to_edge_transform_and_lower(
        export_case(case), partitioner=[annotating(ExamplePartitioner(), "example", registry)]
    )
    graph_module = lowered.exported_program().graph_module
    blobs = [m for _, m in graph_module.named_children() if hasattr(m, "processed_bytes")]
    assert blobs
    # The delegate writes the cache in place only when a pass dropped its write-back
    # (compile spec IN_PLACE_OUTPUTS_SPEC names the input); otherwise the result goes
    # to the output and the cache, still read by the program, is left alone.
    plan = json.loads(blobs[0].processed_bytes.decode())
    in_place = json.dumps([{"output": 0, "input": plan["dest"]}]).encode()
    source = torch.randn(1, 2, 1, 16)
    index = torch.tensor([5])
    expected = torch.zeros(1, 2, 16, 16).index_copy_(2, index, source)
    delegate = ExampleRuntimeDelegate()
    for specs in ({IN_PLACE_OUTPUTS_SPEC: in_place}, {}):
        handle = delegate.init(blobs[0].processed_bytes, specs)
        cache = torch.zeros(1, 2, 16, 16)
        out = torch.full_like(cache, -7.0)
        args = [None] * handle["inputs"] + [out]
        args[handle["dest"]], args[handle["index"]], args[handle["source"]] = cache, index, source
        delegate.execute(handle, args)
        if specs:
            torch.testing.assert_close(cache, expected)
        else:
            torch.testing.assert_close(cache, torch.zeros(1, 2, 16, 16))
            torch.testing.assert_close(out, expected)

"""The MLX backend's plugin: its hooks through a real registry, and a thin entry point."""

from __future__ import annotations

import subprocess
import sys

import torch
import writeback_mlx_backend.plugin as mlx_plugin
from writeback_core import PartitionView, find_mutations, load_registry
from writeback_mlx_backend import MLXDelegate, MLXPartitioner

from tests.mlx_backend.lowering import export_module, registry


def test_importing_the_plugin_does_not_import_mlx() -> None:
    code = (
        "import sys, writeback_mlx_backend, writeback_mlx_backend.plugin; "
        "sys.exit(1 if 'mlx.core' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_writeback_backends_offers_mlx_with_a_partitioner_core_annotates() -> None:
    reg = registry()
    spec = reg.backends()["mlx"]
    assert spec.backend_id == "WritebackMLXBackend"
    # The backend's own partitioner only tags: core's lowering path wraps it and records the decisions.
    partitioner = spec.partitioner(reg)
    assert isinstance(partitioner, MLXPartitioner) and not hasattr(partitioner, "registry")


def test_writeback_runtime_delegates_offers_the_mlx_delegate() -> None:
    delegates = load_registry(entry_points=False, plugins=[mlx_plugin]).runtime_delegates()
    assert isinstance(delegates["WritebackMLXBackend"], MLXDelegate)


class Writes(torch.nn.Module):
    def forward(self, idx: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        a.index_copy_(0, idx, torch.ones(1, 2))
        b[:, 1:2] = 5.0
        c.copy_(c * 2.0)
        return a.sum()


def test_writeback_accepts_in_place_answers_per_mutation() -> None:
    from executorch.exir import to_edge

    args = (torch.tensor([0]), torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3, 2))
    program = to_edge(export_module(Writes(), args)).exported_program()
    mutations = {m.target: m for m in find_mutations(program)}
    graph = program.graph_module.graph
    everything = PartitionView("mlx", frozenset(n.name for n in graph.nodes), graph)
    nothing = PartitionView("mlx", frozenset(), graph)
    answers = {t: mlx_plugin.writeback_accepts_in_place("mlx", everything, m) for t, m in mutations.items()}
    assert answers == {"a": True, "b": True, "c": True}  # c's full write lands after the call's outputs
    assert mlx_plugin.writeback_accepts_in_place("mlx", nothing, mutations["a"]) is False
    assert mlx_plugin.writeback_accepts_in_place("tensorrt", everything, mutations["a"]) is None


def test_writeback_explain_columns_says_what_each_mutation_costs() -> None:
    from writeback.zoo import decoder_case

    case = decoder_case(caller_cache=True)
    program = export_module(case.build(), case.example_args(0)).run_decompositions()
    mutation = find_mutations(program)[0]
    column = mlx_plugin.writeback_explain_columns(program, mutation)
    assert column is not None
    assert column["mlx"] == "in place; 2.0 KiB/call copy-in unless from empty()"

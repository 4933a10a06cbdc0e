"""Core annotates, backends answer: the example backend's partitioner only tags, and
core's wrapper records one decision per mutation a partition touches."""

from __future__ import annotations

import warnings

import pytest
import torch
from executorch.exir import to_edge_transform_and_lower
from writeback_core import AnnotatingPartitioner, annotating, in_place_decisions, load_registry
from writeback_example_backend.backend import ExamplePartitioner


class CacheAndCounter(torch.nn.Module):
    """``cache.index_copy_(0, pos, x)`` (a partition of the example backend) and
    ``total[0:1] += x.sum()`` (a slice write no partition takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 2))
        self.register_buffer("total", torch.zeros(3))

    def forward(self, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, x)
        self.total[0:1] += x.sum()
        return self.cache.sum() + self.total.sum()


def _export() -> torch.export.ExportedProgram:
    module = CacheAndCounter().eval().requires_grad_(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(module, (torch.tensor([2]), torch.ones(1, 2)), strict=False)


def test_backend_spec_partitioner_only_tags_and_core_records_the_decisions() -> None:
    registry = load_registry()  # the example backend through its real entry point
    spec = registry.backends()["example"]
    plain = spec.partitioner(registry)
    assert isinstance(plain, ExamplePartitioner) and not hasattr(plain, "registry")
    # What the one lowering path (writeback_core.lowering.partition) does with it.
    partitioner = annotating(plain, spec.name, registry)
    assert isinstance(partitioner, AnnotatingPartitioner)
    edge = to_edge_transform_and_lower(_export(), partitioner=[partitioner])
    # Worked out by hand: the index_copy is the example's one partition and it accepts;
    # the slice write is in no partition, so no plugin is asked and nothing is recorded.
    assert [(d.target, d.accepted, d.accepted_by) for d in partitioner.decisions] == [
        ("cache", True, ("example-backend",))
    ]
    recorded = in_place_decisions(edge.exported_program())
    assert {t: d.accepted for t, d in recorded.items()} == {"cache": True}


def test_wrapping_twice_is_one_wrapper_and_another_backend_is_refused() -> None:
    registry = load_registry(entry_points=False)
    wrapped = annotating(ExamplePartitioner(), "example", registry)
    assert annotating(wrapped, "example", registry) is wrapped
    with pytest.raises(ValueError, match="already records decisions for backend 'example'"):
        annotating(wrapped, "other", registry)
    with pytest.raises(TypeError, match="make the backend's partitioner subclass it"):
        annotating(object(), "example", registry)

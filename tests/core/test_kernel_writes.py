"""A backend with ``BackendSpec.kernel_writes`` is asked about the writes outside its partitions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from torch.export import ExportedProgram
from writeback.model_build import export_case
from writeback.zoo import builtin_models
from writeback_core import BackendSpec, Mutation, PartitionView, hookimpl, load_registry
from writeback_core.lowering import partition


class _TagsNothing(Partitioner):  # type: ignore[misc]  # executorch is untyped
    def __init__(self) -> None:
        super().__init__(DelegationSpec("NoSuchBackend", []))

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        return PartitionResult(tagged_exported_program=exported_program, partition_tags={})


class _Toy:
    def __init__(self, name: str, kernel_writes: bool) -> None:
        self.writeback_name = f"toy-{name}"
        self.name = name
        self.kernel_writes = kernel_writes
        self.asked: list[tuple[str, bool, bool]] = []

    @hookimpl
    def writeback_backends(self) -> Sequence[BackendSpec]:
        return [BackendSpec(self.name, "", lambda registry, **_: _TagsNothing(), kernel_writes=self.kernel_writes)]

    @hookimpl
    def writeback_accepts_in_place(self, backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
        if backend != self.name:
            return None
        write = mutation.write.node
        self.asked.append((mutation.target, partition.kernels, write is not None and partition.contains(write)))
        return True


def _lower(toy: _Toy) -> dict[str, Any]:
    registry = load_registry(entry_points=False, plugins=[toy])
    program = export_case(builtin_models()["decoder"])
    return partition(program, registry, registry.backends()[toy.name]).decisions


def test_kernel_writes_backend_is_asked_about_writes_outside_every_partition() -> None:
    toy = _Toy("kernels", kernel_writes=True)
    decisions = _lower(toy)
    # Two caches, each written by an index_put that no partition takes: asked once each,
    # with the view of the operators outside every partition, which holds the write.
    assert sorted(toy.asked) == [("blocks.0.k_cache", True, True), ("blocks.0.v_cache", True, True)]
    assert {t: d.accepted for t, d in decisions.items()} == {"blocks.0.k_cache": True, "blocks.0.v_cache": True}


def test_backend_without_kernel_writes_is_not_asked_when_no_partition_touches_a_write() -> None:
    toy = _Toy("plain", kernel_writes=False)
    assert _lower(toy) == {}
    assert toy.asked == []

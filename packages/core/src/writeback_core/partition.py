"""Core's side of partitioning: a backend tags nodes, core records the in-place decisions.

A backend's exir ``Partitioner`` only tags the nodes its delegate takes (as
every ExecuTorch partitioner does). :func:`annotating` wraps it; after the
backend's ``partition`` has run, the wrapper:

1. groups the tagged operator nodes by delegation tag, one
   :class:`~writeback_core.types.PartitionView` per tag the backend returned;
2. finds the program's mutations (:func:`~writeback_core.mutations.find_mutations`)
   and, per partition, those it touches: the partition performs the write, or
   computes the value written back;
3. asks every plugin's ``writeback_accepts_in_place`` about each of them
   (:meth:`Registry.decide_in_place <writeback_core.registry.Registry.decide_in_place>`)
   and records the decision on the mutated placeholder under
   ``writeback_core.meta.IN_PLACE``;
4. for a backend whose ``BackendSpec.kernel_writes`` is set, asks the same
   about every mutation no partition touches, with one view (``kernels=True``)
   of the operators outside every partition: the stock runtime's kernels run
   those writes, and a pass may make them in place.

So a backend answers the per-mutation hook and never calls back into core to
record its answer. Placeholders a partitioner tags to hand state or constants
to its delegate are not part of a view: a view holds the operators the
partition runs. A mutation no partition touches gets no decision (it is
copied back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from executorch.exir.backend.partitioner import Partitioner, PartitionResult
from torch.export import ExportedProgram

from writeback_core.mutations import Mutation, find_mutations
from writeback_core.types import PartitionView

if TYPE_CHECKING:
    from writeback_core.registry import InPlaceDecision, Registry

__all__ = [
    "DELEGATION_TAG",
    "AnnotatingPartitioner",
    "LoweringPartitioner",
    "annotating",
    "partition_views",
    "record_in_place_decisions",
    "to_edge_arguments",
    "wrapped",
]

# True while a wrapper runs the backend's own ``partition``: a backend partitioner used bare
# (nothing records its decisions) can tell so and say what it needs.
_WRAPPED: ContextVar[bool] = ContextVar("writeback_wrapped", default=False)


def wrapped() -> bool:
    """Whether the partitioner now running is wrapped by :func:`annotating` (core records its
    in-place decisions). A backend's partitioner calls it to warn when it is used bare."""
    return _WRAPPED.get()


# The ``node.meta`` key exir partitioners tag delegated nodes with (exir's own name).
DELEGATION_TAG = "delegation_tag"


def partition_views(program: ExportedProgram, backend: str, tags: Iterable[str]) -> list[PartitionView]:
    """One view per tag in ``tags`` (in that order): the operator nodes tagged with it."""
    graph = program.graph_module.graph
    members: dict[str, set[str]] = {tag: set() for tag in tags}
    for node in graph.nodes:
        tag = node.meta.get(DELEGATION_TAG)
        if node.op == "call_function" and tag in members:
            members[tag].add(node.name)
    return [PartitionView(backend, frozenset(names), graph) for names in members.values()]


def record_in_place_decisions(
    program: ExportedProgram,
    backend: str,
    registry: Registry,
    tags: Iterable[str],
    kernels: bool = False,
    mutations: list[Mutation] | None = None,
) -> list[InPlaceDecision]:
    """Decide and record, per partition tagged with one of ``tags``, every mutation it touches.

    This is what :class:`AnnotatingPartitioner` runs after the backend's
    ``partition``; call it directly only for a partitioner that is not wrapped.

    :param program: the edge program, already tagged by ``backend``'s partitioner.
    :param backend: the backend's name (``BackendSpec.name``), passed to the hook.
    :param registry: whose plugins answer ``writeback_accepts_in_place``.
    :param tags: the delegation tags the partitioner returned (``PartitionResult.partition_tags``).
    :param kernels: also decide the mutations no partition touches, with a view of the
        operators outside every partition (``PartitionView.kernels``), last.
    :param mutations: ``find_mutations(program)`` when the caller has it already.
    :return: the decisions, partition by partition, each in ``find_mutations`` order.
    :raises writeback_core.registry.InPlaceConflictError: two plugins disagree on a mutation.
    """
    tags = list(tags)
    views = partition_views(program, backend, tags)
    if not views and not kernels:
        return []
    if mutations is None:
        mutations = find_mutations(program)
    graph = program.graph_module.graph
    decisions: list[InPlaceDecision] = []
    untouched = list(mutations)
    for view in views:
        touched = [m for m in mutations if view.contains(m.write.node or m.value)]
        untouched = [m for m in untouched if m not in touched]
        if touched:
            decisions += registry.annotate_in_place(graph, backend, view, touched)
    if kernels and untouched:
        outside = frozenset(
            n.name for n in graph.nodes if n.op == "call_function" and n.meta.get(DELEGATION_TAG) not in tags
        )
        view = PartitionView(backend, outside, graph, kernels=True)
        decisions += registry.annotate_in_place(graph, backend, view, untouched)
    return decisions


class AnnotatingPartitioner(Partitioner):  # type: ignore[misc]  # executorch is untyped: its bases are Any
    """A backend's partitioner whose in-place decisions core records (see the module docstring).

    ``partitioner`` is the backend's own; every other ``Partitioner`` method is
    its. ``decisions`` holds the decisions of the last ``partition`` call and ``mutations``
    the mutations of the edge program it partitioned (:func:`find_mutations`, before any
    delegate took a write): the lowering reports them without decomposing the program again.
    """

    def __init__(self, partitioner: Partitioner, backend: str, registry: Registry) -> None:
        super().__init__(partitioner.spec)
        self.partitioner = partitioner
        self.backend = backend
        self.registry = registry
        self.decisions: list[InPlaceDecision] = []
        self.mutations: list[Mutation] = []

    def transform_for_pre_decomposition(self, exported_program: ExportedProgram) -> ExportedProgram:
        """The backend's own transform, unchanged."""
        result: ExportedProgram = self.partitioner.transform_for_pre_decomposition(exported_program)
        return result

    def ops_to_not_decompose(
        self, ep: ExportedProgram
    ) -> tuple[list[torch._ops.OpOverload], Callable[[torch.fx.Node], bool] | None]:
        """The backend's own answer, unchanged."""
        result: tuple[list[torch._ops.OpOverload], Callable[[torch.fx.Node], bool] | None]
        result = self.partitioner.ops_to_not_decompose(ep)
        return result

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        """Run the backend's ``partition``, then record a decision per mutation a partition touches."""
        token = _WRAPPED.set(True)
        try:
            result = self.partitioner.partition(exported_program)
        finally:
            _WRAPPED.reset(token)
        if not isinstance(result, PartitionResult):
            raise TypeError(
                f"the partitioner of backend {self.backend!r} ({type(self.partitioner).__name__}) returned "
                f"{type(result).__name__} from partition(); it must return an exir PartitionResult"
            )
        program = result.tagged_exported_program
        spec = self.registry.backends().get(self.backend)
        kernels = spec is not None and spec.kernel_writes
        self.mutations = find_mutations(program)
        self.decisions = record_in_place_decisions(
            program, self.backend, self.registry, result.partition_tags, kernels, self.mutations
        )
        return result


def annotating(partitioner: Any, backend: str, registry: Registry) -> AnnotatingPartitioner:
    """``partitioner`` wrapped so that core records its per-mutation in-place decisions.

    Wrapping twice for the same backend and registry returns the first wrapper,
    so a ``BackendSpec.partitioner`` factory and the pipeline may both wrap.

    :param partitioner: the backend's exir ``Partitioner``; it only tags nodes.
    :param backend: the backend's name (``BackendSpec.name``), what the hook is asked about.
    :param registry: whose plugins answer ``writeback_accepts_in_place``.
    :raises TypeError: ``partitioner`` is not an exir ``Partitioner``.
    :raises ValueError: ``partitioner`` is already wrapped for another backend or registry.
    """
    if isinstance(partitioner, AnnotatingPartitioner):
        if partitioner.backend == backend and partitioner.registry is registry:
            return partitioner
        raise ValueError(
            f"partitioner already records decisions for backend {partitioner.backend!r}; "
            f"wrap the backend's own partitioner (its .partitioner) for backend {backend!r}"
        )
    if not isinstance(partitioner, Partitioner):
        raise TypeError(
            f"annotating() wraps an executorch.exir.backend.partitioner.Partitioner, got "
            f"{type(partitioner).__name__}; make the backend's partitioner subclass it"
        )
    return AnnotatingPartitioner(partitioner, backend, registry)


class LoweringPartitioner(AnnotatingPartitioner):
    """An :class:`AnnotatingPartitioner` whose ``transform_for_pre_decomposition`` also runs
    the registry's ``"exported"`` passes for its backend, on a copy of the program that owns
    its tables (the caller's program is not changed), before the backend's own transform.
    exir calls it first in ``to_edge_transform_and_lower``, on the ATen program."""

    def transform_for_pre_decomposition(self, exported_program: ExportedProgram) -> ExportedProgram:
        """A copy of ``exported_program`` with the ``"exported"`` passes run, then the backend's transform."""
        from writeback_core.program_passes import run_exported_passes

        own = run_exported_passes(exported_program, self.registry, self.backend)
        return super().transform_for_pre_decomposition(own)


def to_edge_arguments(backend: str, partitioner: Any = None, registry: Registry | None = None) -> dict[str, Any]:
    """The ``partitioner`` and ``transform_passes`` arguments that make ExecuTorch's own
    ``to_edge_transform_and_lower`` writeback's partition step.

    ``to_edge_transform_and_lower(ep, **to_edge_arguments("xnnpack"))`` then
    :func:`writeback_passes.to_executorch` writes the ``.pte`` that
    :func:`writeback_core.lowering.lower` writes for the same program and backend, byte
    for byte (``lower`` partitions through this very function).

    :param backend: an installed backend's name (``BackendSpec.name``: ``xnnpack``, ``mlx``, ...).
    :param partitioner: the backend's exir ``Partitioner`` to use (for ``xnnpack``, ExecuTorch's
        own ``XnnpackPartitioner()``); default: the one the backend's plugin makes.
    :param registry: whose plugins decide and whose passes (those for ``backend``) run
        (default: :func:`load_registry`).
    :raises ValueError: ``backend`` is not installed; the message lists those that are.
    :raises TypeError: ``partitioner`` is not an exir ``Partitioner``.
    """
    from writeback_core.registry import load_registry

    registry = registry if registry is not None else load_registry()
    specs = registry.backends()
    spec = specs.get(backend)
    if spec is None:
        raise ValueError(
            f"no backend named {backend!r} is installed (installed: {', '.join(sorted(specs)) or 'none'}); "
            "install the plugin that provides it or pick one of those"
        )
    return edge_arguments(backend, partitioner if partitioner is not None else spec.partitioner(registry), registry)


def edge_arguments(backend: str, inner: Any, registry: Registry) -> dict[str, Any]:
    """:func:`to_edge_arguments` for ``inner``, backend ``backend``'s partitioner, already made
    (the ``"before_partition"`` passes are those for ``backend``)."""
    from writeback_core.program_passes import as_exir_pass

    if isinstance(inner, AnnotatingPartitioner):
        inner = inner.partitioner
    if not isinstance(inner, Partitioner):
        raise TypeError(
            f"to_edge_arguments() wraps an executorch.exir.backend.partitioner.Partitioner, got {type(inner).__name__}"
        )
    transforms = [as_exir_pass(p) for p in registry.program_passes("before_partition", backend)]
    return {"partitioner": [LoweringPartitioner(inner, backend, registry)], "transform_passes": transforms or None}

"""The types that cross package lines through hooks. Packages never pass their own classes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch.fx

__all__ = [
    "BackendSpec",
    "PartitionView",
    "ProgramPass",
    "RuntimeDelegate",
    "Stage",
]

# Where a program pass runs inside ``to_executorch``:
#   "edge": on the edge ``ExportedProgram`` before ``to_executorch`` starts
#           (a function ``ExportedProgram -> ExportedProgram | None``);
#   "before_memory_planning": on the ``GraphModule`` after exir inserted its
#           write-backs and before memory planning (``ExecutorchBackendConfig.passes``;
#           a function ``GraphModule -> PassResult | None``).
Stage = Literal["edge", "before_memory_planning"]


@dataclass(frozen=True)
class BackendSpec:
    """A backend a plugin offers.

    ``name`` is what users pick (``--backend mlx``); ``backend_id`` is the
    ExecuTorch backend id its delegate blobs carry (the ``BackendDetails``
    subclass name); ``partitioner`` builds a fresh exir ``Partitioner`` given
    the registry (so it can ask the per-mutation hook) and keyword options.
    """

    name: str
    backend_id: str
    partitioner: Callable[..., Any]
    description: str = ""


@dataclass(frozen=True)
class PartitionView:
    """What the per-mutation hook sees of one partition.

    ``nodes`` are the names of the nodes the partition takes; ``graph`` the
    whole graph being partitioned (read only: hookimpls must not edit it).
    """

    backend: str
    nodes: frozenset[str]
    graph: torch.fx.Graph = field(compare=False, repr=False)

    def contains(self, node: torch.fx.Node | str) -> bool:
        """Whether the partition takes ``node``."""
        name = node if isinstance(node, str) else node.name
        return name in self.nodes


@dataclass(frozen=True)
class ProgramPass:
    """A pass a plugin contributes to the pipeline at one :data:`Stage`.

    Passes of one stage run in ascending ``order``, ties broken by ``name``, so
    registration order never changes the result.
    """

    name: str
    stage: Stage
    run: Callable[[Any], Any]
    order: int = 0


@runtime_checkable
class RuntimeDelegate(Protocol):
    """A delegate written in Python that a runtime registers as an ExecuTorch backend.

    ``execute`` receives the delegate's arguments as torch tensors (zero-copy
    views of the runtime's memory) or Python scalars: first the inputs, then
    the outputs, already allocated; it writes its results into the outputs and
    may write mutated inputs in place.
    """

    backend_id: str

    def init(self, processed: bytes, compile_specs: Mapping[str, bytes]) -> Any:
        """Build a handle from the delegate's processed blob."""

    def execute(self, handle: Any, args: Sequence[Any]) -> None:
        """Run once; raise to fail the call."""

    def destroy(self, handle: Any) -> None:
        """Free what ``init`` built."""

"""The oracle's targets (see :mod:`writeback_testing.oracle`): the :class:`Target` protocol
(one way to lower and run a program, observing each call), stock ``executorch.runtime``
(:class:`StockTarget`), a runtime that writes mutated inputs into the caller's tensors in each
memory plan (:class:`RuntimeTarget`, :func:`runtime_targets`), and the runtime a plugin offers
through ``writeback_runtimes``, loading with the registry's delegates (:func:`registry_runtime`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from writeback_core.registry import Registry
from writeback_core.types import MemoryPlan

from writeback_testing.lowered_plans import Lowerings
from writeback_testing.observations import Observation, error_text, snapshot

__all__ = [
    "RegistryRuntime",
    "RuntimeTarget",
    "StockTarget",
    "Target",
    "registry_runtime",
    "runtime_targets",
]


class Target(Protocol):
    """One way to lower and run a program; ``run`` returns what each call produced.

    EXTENSION POINT: a backend-lowered target (MLX through
    ``to_edge_transform_and_lower`` with the backend's partitioner) or a
    copy-back engine target (``writeback_testing.engines``) implements
    this protocol and is passed to :func:`~writeback_testing.oracle.check_program`
    in ``targets``. A target that cannot take a program raises
    :class:`~writeback_testing.oracle.TargetSkipped`; a target may set ``verdicts``
    (see :class:`~writeback_testing.oracle.ProgramMismatch`) when its path without
    writeback's passes is not upstream's alone.
    """

    @property
    def name(self) -> str:
        """How reports name this target."""

    def run(self, lowered: Lowerings, calls: int) -> list[Observation]:
        """Run ``calls`` calls of ``lowered``; observations hold only what this target can see."""


@dataclass(frozen=True)
class StockTarget:
    """Stock ``executorch.runtime``: buffers by name; mutated inputs through returned values."""

    name: str = "stock"

    def run(self, lowered: Lowerings, calls: int) -> list[Observation]:
        from executorch.runtime import Runtime

        pte = lowered.pte("planned")
        layout = lowered.layout("planned")
        # Keep the Program alive while its Method runs: stock executorch.runtime frees the
        # program's memory with it, and a Method left behind reads freed memory.
        program = Runtime.get().load_program(pte)
        method = program.load_method("forward")
        spec = lowered.built.spec
        state = dict(zip((s.name for s in spec.inputs), lowered.built.make_state(), strict=True))
        observations = []
        for call in range(calls):
            args = [*lowered.built.step_inputs(call), *(state[s.name] for s in spec.inputs)]
            try:
                got = list(method.execute(args))
            except Exception as error:  # refused: what state is left is compared with eager's
                seen = {name: snapshot(t) for name, t in state.items()}
                seen.update({fqn: snapshot(method._method.get_attribute(fqn)) for fqn in layout.mutated_buffers})
                observations.append(Observation((), seen, error_text(error)))
                break
            n_mut = len(layout.mutated_inputs)
            for name, value in zip(layout.mutated_inputs, got[:n_mut], strict=True):
                state[name] = value.clone()
            seen = {name: snapshot(t) for name, t in state.items()}
            for fqn in layout.mutated_buffers:
                # executorch.runtime.Method exposes only execute/metadata; the
                # ExecuTorchMethod under it reads a named mutable buffer.
                seen[fqn] = snapshot(method._method.get_attribute(fqn))
            observations.append(Observation(tuple(snapshot(o) for o in got[n_mut:]), seen))
        del method, program  # the Method first, then the Program it reads
        return observations


@dataclass(frozen=True)
class RuntimeTarget:
    """A runtime that writes mutated inputs into the caller's tensors (the pybind-runtime).

    ``runtime`` has ``load_program(bytes).load_method(name)``; its methods
    ``execute(inputs)``, ``metadata`` and (when ``bind_outputs``)
    ``set_output(tensor, index)``. ``plan`` picks the memory plan of graph
    inputs and outputs (:data:`~writeback_core.types.MemoryPlan`); ``bind_outputs``
    binds every output that is unplanned, not an input and returned once to a caller
    tensor before the first call.
    """

    name: str
    runtime: Any
    plan: MemoryPlan
    bind_outputs: bool = False

    def run(self, lowered: Lowerings, calls: int) -> list[Observation]:
        pte = lowered.pte(self.plan)
        layout = lowered.layout(self.plan)
        method = self.runtime.load_program(pte).load_method("forward")
        if self.bind_outputs:
            self._bind(method)
        spec = lowered.built.spec
        state = lowered.built.make_state()
        observations = []
        n_mut = len(layout.mutated_inputs)
        for call in range(calls):
            try:
                got = list(method.execute([*lowered.built.step_inputs(call), *state]))
            except Exception as error:  # refused: the caller's state must be as it was
                seen = {s.name: snapshot(t) for s, t in zip(spec.inputs, state, strict=True)}
                observations.append(Observation((), seen, error_text(error)))
                break
            seen = {s.name: snapshot(t) for s, t in zip(spec.inputs, state, strict=True)}
            by_name = dict(zip(layout.mutated_inputs, got[:n_mut], strict=True))
            for name, value in by_name.items():
                # The returned mutated input must be the new state too.
                seen[f"{name} (returned)"] = snapshot(value)
            observations.append(Observation(tuple(snapshot(o) for o in got[n_mut:]), seen))
        return observations

    @staticmethod
    def _bind(method: Any) -> None:
        for index, out in enumerate(method.metadata.outputs):
            if out.tag != "Tensor" or out.memory_planned or out.is_input is not None or out.repeats:
                continue
            dtype = getattr(torch, str(out.dtype).split(".")[-1])
            method.set_output(torch.full(tuple(out.sizes), -7, dtype=dtype), index)


@dataclass(frozen=True)
class RegistryRuntime:
    """A runtime a plugin offers (``writeback_runtimes``), loading with the registry's delegates."""

    spec: Any  # writeback_core.types.RuntimeSpec
    registry: Registry

    def load_program(self, data: bytes) -> Any:
        return self.spec.load_program(data, self.registry.runtime_delegates())


def registry_runtime(registry: Registry, name: str | None = None) -> RegistryRuntime | None:
    """The runtime ``name`` offered through ``writeback_runtimes`` (default: the only or the
    first by name), or ``None`` when no plugin offers one."""
    runtimes = registry.runtimes()
    if name is None:
        if not runtimes:
            return None
        name = sorted(runtimes)[0]
    if name not in runtimes:
        raise KeyError(f"no runtime named {name!r}; offered: {sorted(runtimes)}")
    return RegistryRuntime(runtimes[name], registry)


def runtime_targets(runtime: Any, prefix: str = "pybind") -> list[RuntimeTarget]:
    """The three configurations of a caller-writing runtime: every input and output planned;
    caller-owned state unplanned (``"state"``, what ``writeback run`` ships); nothing planned,
    every bindable output bound by ``set_output``."""
    return [
        RuntimeTarget(f"{prefix}-planned", runtime, "planned"),
        RuntimeTarget(f"{prefix}-state", runtime, "state"),
        RuntimeTarget(f"{prefix}-unplanned-bound", runtime, "unplanned", bind_outputs=True),
    ]

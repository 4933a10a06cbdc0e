"""Engine targets: each program through the copy-back path of every engine the registry offers.

An aliasing engine (``writeback_engines``; TensorRT-like) writes some buffer
updates in place and recomputes the rest, which the program copies back. Core
reaches one only through hooks, so a third party's engine is fuzzed the same way:

1. ``writeback_lower_for_engine`` lowers the exported program by the owning
   plugin's copy-back path (classify, lift, declare, lower, cross-check); a
   ``str`` answer is the engine refusing the program: :class:`TargetSkipped`.
2. The one lowering path's ``to_executorch`` (:func:`writeback_core.lowering.to_executorch`)
   runs the registered passes on it, memory planned, buffers initialised and named.
3. The ``.pte`` runs in two runtimes, each compared with eager PyTorch after
   every call: a caller-writing runtime a plugin offers (``writeback_runtimes``;
   outputs, and caller-owned state written into the caller's tensors), which
   registers the engine's Python delegate (``writeback_runtime_delegates``);
   and stock ``executorch.runtime`` (outputs, and every buffer read back by
   name), which finds that delegate in the process-wide backend registry.

Both targets of one engine share one lowering per program (``Lowerings.derived``).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

from writeback_core.quiet import known_warnings_ignored
from writeback_core.registry import Registry

from writeback_testing.lowered_plans import Lowerings, export_built
from writeback_testing.observations import Observation
from writeback_testing.oracle import LoweringError, TargetSkipped
from writeback_testing.targets import RuntimeTarget, StockTarget

__all__ = [
    "ENGINE_VERDICTS",
    "EngineTarget",
    "engine_targets",
]

# An engine target's triage: without writeback's passes the program still takes the
# engine's copy-back path, which is writeback's own (trt-copyback), not upstream's.
ENGINE_VERDICTS: dict[bool | None, str] = {
    None: "not checked without writeback's passes",
    True: "ALSO wrong without writeback's passes: the engine's copy-back path (or exir)",
    False: "right without writeback's passes: a writeback pass bug on the engine's program",
}


@dataclass(frozen=True)
class _Refused:
    reason: str


@dataclass(frozen=True)
class EngineTarget:
    """One engine's copy-back path, run in ``runtime`` (``stock`` False) or stock ``executorch.runtime``.

    ``registry`` supplies the engine, its lowering and its delegate (it must
    hold the plugin owning the engine, whatever registry the oracle lowers
    with); ``runtime`` loads programs with that registry's delegates
    (:class:`~writeback_testing.targets.RegistryRuntime`). The stock
    variant loads each program through ``runtime`` once first, which registers
    the delegate, then runs it in stock ``executorch.runtime``.
    """

    name: str
    engine: str
    registry: Registry
    runtime: Any
    stock: bool = False
    verdicts: dict[bool | None, str] | None = None

    def run(self, lowered: Lowerings, calls: int) -> list[Observation]:
        """Lower ``lowered``'s program for the engine (once per program) and run ``calls`` calls.

        :raises TargetSkipped: the engine's plugin refused the program (its reason).
        :raises LoweringError: the program could not be exported.
        """
        derived = self._derived(lowered)
        before = derived.seconds
        try:
            if self.stock:
                # Registers the engine's delegate in the process-wide backend registry, which
                # stock executorch.runtime shares with the caller-writing runtime.
                self.runtime.load_program(derived.pte("planned"))
                return StockTarget(self.name).run(derived, calls)
            return RuntimeTarget(self.name, self.runtime, "planned").run(derived, calls)
        finally:
            lowered.seconds += derived.seconds - before

    def _derived(self, lowered: Lowerings) -> Lowerings:
        key = f"engine:{self.engine}:{lowered.with_passes}"
        if key not in lowered.derived:
            start = time.perf_counter()
            lowered.derived[key] = self._lower(lowered)
            lowered.seconds += time.perf_counter() - start
        derived = lowered.derived[key]
        if isinstance(derived, _Refused):
            raise TargetSkipped(self.name, derived.reason)
        assert isinstance(derived, Lowerings)
        return derived

    def _lower(self, lowered: Lowerings) -> Lowerings | _Refused:
        engines = self.registry.engines()
        if self.engine not in engines:
            raise LookupError(f"no plugin offers engine {self.engine!r}; offered: {sorted(engines)}")
        try:
            program = export_built(lowered.built)
        except Exception as error:
            raise LoweringError(
                f"export failed: {type(error).__name__}: {error}\n--- program ---\n{lowered.built.source}",
                upstream=True,
            ) from error
        with known_warnings_ignored(), warnings.catch_warnings():
            # The engine's warning that copy-back buffers read before written carry no value
            # in the .pte: the lowering path keeps every non-zero initial value, and the
            # runtimes zero-fill the rest.
            warnings.filterwarnings("ignore", "copy-back buffers .* are read before they are written", UserWarning)
            result = self.registry.hook.writeback_lower_for_engine(engine=engines[self.engine], program=program)
        if result is None:
            raise LookupError(
                f"engine {self.engine!r} is offered, but no plugin lowers for it "
                "(writeback_lower_for_engine answered None)"
            )
        if isinstance(result, str):
            return _Refused(result)
        derived = Lowerings(lowered.built, lowered.registry, lowered.with_passes)
        derived._edge = result
        return derived


def engine_targets(registry: Registry, runtime: Any, engines: tuple[str, ...] | None = None) -> list[EngineTarget]:
    """Two targets per engine (``<engine>-<runtime>`` and ``<engine>-stock``).

    :param registry: offers the engines, their lowering and delegates.
    :param runtime: a caller-writing runtime loading with ``registry``'s delegates.
    :param engines: engine names to run (default: every engine offered).
    """
    offered = registry.engines()
    names = sorted(offered) if engines is None else list(engines)
    unknown = [n for n in names if n not in offered]
    if unknown:
        raise KeyError(f"no plugin offers engine(s) {unknown}; offered: {sorted(offered)}")
    label = getattr(getattr(runtime, "spec", None), "name", "runtime")
    targets = []
    for name in names:
        targets.append(EngineTarget(f"{name}-{label}", name, registry, runtime, verdicts=ENGINE_VERDICTS))
        targets.append(EngineTarget(f"{name}-stock", name, registry, runtime, stock=True, verdicts=ENGINE_VERDICTS))
    return targets

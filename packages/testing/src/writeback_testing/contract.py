"""The backend contract suite: what a backend says per mutation is what it does at run time.

For every backend the registry knows, on the zoo and on generated programs,
:func:`check_backend_contract`:

1. exports the program and partitions it with the backend's partitioner
   (``to_edge_transform_and_lower``), which asks ``writeback_accepts_in_place``
   per mutation and records core's decision on each state placeholder;
2. lowers it with the registry's passes through the one lowering path, with
   the memory plan ``writeback run`` ships (caller-owned state unplanned, so a
   delegate works on the caller's memory);
3. checks the structure: every **accepted** mutation has no write-back
   ``copy_`` left (written in place, copy dropped); every **declined** one
   still has its write-back (copied back);
4. checks the behaviour against eager PyTorch, every output and every state
   after each of ``calls`` calls, in the caller-writing runtime (the
   mutation must land in the caller's tensor, in place or by the copy) and in
   stock ``executorch.runtime`` (buffers read back by name).

A third-party backend runs the suite against itself from its own tests::

    from writeback_testing.contract import backend_names, check_backend_contract, zoo_cases

    @pytest.mark.parametrize("case", zoo_cases(), ids=lambda c: c.name)
    @pytest.mark.parametrize("backend", backend_names(registry))
    def test_contract(backend, case):
        check_backend_contract(registry, backend, case.built)

and on generated programs with ``@given(strategies.programs(...))``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.export.graph_signature import OutputKind
from writeback_core import meta
from writeback_core.program_passes import write_back_positions
from writeback_core.registry import InPlaceDecision, Registry

from writeback_testing.lowered_plans import Lowerings
from writeback_testing.observations import DEFAULT_CALLS, compare_observations, eager_reference
from writeback_testing.oracle import ProgramMismatch, built_from_case
from writeback_testing.program_spec import Built, ProgramSpec, build
from writeback_testing.targets import RuntimeTarget, StockTarget, Target, registry_runtime

__all__ = [
    "ContractCase",
    "ContractReport",
    "ContractViolation",
    "DelegateWrites",
    "backend_names",
    "check_backend_contract",
    "check_declared_writes",
    "write_backs",
    "zoo_cases",
]


class ContractViolation(AssertionError):
    """The backend's answer and what the lowered program does disagree."""


@dataclass(frozen=True)
class ContractCase:
    """A program the contract runs on: a name and the built program."""

    name: str
    built: Built


@dataclass
class ContractReport:
    """What one contract check saw: decisions made, write-backs left, targets compared."""

    backend: str
    decisions: dict[str, InPlaceDecision] = field(default_factory=dict)
    write_backs: frozenset[str] = frozenset()
    delegated: int = 0
    targets: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> list[str]:
        return sorted(t for t, d in self.decisions.items() if d.accepted)

    @property
    def declined(self) -> list[str]:
        return sorted(t for t, d in self.decisions.items() if not d.accepted)


def backend_names(registry: Registry) -> list[str]:
    """Every backend the registry offers, sorted (the contract's parametrization)."""
    return sorted(registry.backends())


def zoo_cases() -> list[ContractCase]:
    """The built-in models (``writeback.zoo``) as contract cases."""
    from writeback.zoo import builtin_models

    return [ContractCase(name, built_from_case(case)) for name, case in sorted(builtin_models().items())]


def write_backs(program: Any) -> frozenset[str]:
    """Names of the placeholders that a final ``ExecutorchProgramManager`` still copies into."""
    return frozenset(write_back_positions(program.exported_program().graph_module.graph))


def explained_copies(program: Any) -> frozenset[str]:
    """Placeholders whose write-back copy a pass kept with its reason recorded
    (``meta.COPY_LEFT_REASON``): a whole-state write accepted at partitioning that the final
    kernels did not allow, said in the model's terms by the pass that tried."""
    graph = program.exported_program().graph_module.graph
    return frozenset(
        str(node.args[0].name)
        for node in graph.nodes
        if node.op == "call_function"
        and node.args
        and getattr(node.args[0], "op", None) == "placeholder"
        and meta.get_custom(node, meta.COPY_LEFT_REASON)
    )


def _delegate_count(program: Any) -> int:
    graph = program.exported_program().graph_module.graph
    return sum(1 for n in graph.nodes if n.op == "get_attr" and "lowered_module" in str(n.target))


def check_backend_contract(
    registry: Registry,
    backend: str,
    program: Built | ProgramSpec,
    runtime: Any = None,
    calls: int = DEFAULT_CALLS,
) -> ContractReport:
    """Check ``backend``'s per-mutation answers against the lowered program and its runs.

    :param registry: the plugins (backend, passes, runtime delegates) to use.
    :param backend: a name from ``registry.backends()``.
    :param program: a built program or a spec (built here).
    :param runtime: a caller-writing runtime (``load_program(bytes).load_method``);
        default: the first one the registry offers (``writeback_runtimes``),
        loading programs with the registry's runtime delegates.
    :raises ContractViolation: an accepted mutation is still copied back, or a
        declined one is not.
    :raises ProgramMismatch: a run differs from eager PyTorch.
    :raises InvalidProgram: eager PyTorch itself fails on the program (nothing is lowered).
    """
    built = program if isinstance(program, Built) else build(program)
    expected = eager_reference(built, calls)
    if runtime is None:
        runtime = registry_runtime(registry)
        if runtime is None:
            raise LookupError(
                "no plugin offers a runtime (writeback_runtimes); install writeback-pybind-runtime or pass runtime="
            )
    spec = registry.backends()[backend]
    lowered = Lowerings(built, registry, backend=spec)
    report = ContractReport(backend)
    # The program `writeback run --backend <backend>` ships: caller-owned state unplanned.
    final = lowered.program("state")
    report.decisions = dict(lowered.lowered("state").decisions)
    report.write_backs = write_backs(final)
    report.delegated = _delegate_count(final)
    explained = explained_copies(final)
    for target, decision in sorted(report.decisions.items()):
        copied = decision.placeholder in report.write_backs
        if decision.accepted and copied and decision.placeholder not in explained:
            raise ContractViolation(
                f"backend {backend!r} accepted to write {target!r} ({decision.write}) in place "
                f"(accepted by {', '.join(decision.accepted_by)}), but the lowered program still "
                f"copies it back (copy_ into {decision.placeholder!r}): no registered pass "
                f"dropped the write-back, so the backend must not accept this mutation, or a "
                f"pass that drops it must be installed\n--- program ---\n{built.source}"
            )
        if not decision.accepted and not copied and _state_written(lowered, decision):
            raise ContractViolation(
                f"backend {backend!r} declined {target!r} ({decision.write}), but the lowered "
                f"program has no write-back copy_ into {decision.placeholder!r}: a declined "
                f"mutation must be copied back\n--- program ---\n{built.source}"
            )
    targets: list[Target] = [
        RuntimeTarget(f"{backend}-state", runtime, "state"),
        RuntimeTarget(f"{backend}-planned", runtime, "planned"),
        StockTarget(f"{backend}-stock"),
    ]
    for runner in targets:
        observed = runner.run(lowered, calls)
        # A refused call is the last each side runs; one side refusing alone is a difference.
        for call, (want, got) in enumerate(zip(expected, observed, strict=False)):
            diff = compare_observations(want, got)
            if diff is not None:
                raise ProgramMismatch(
                    built.source,
                    runner.name,
                    call,
                    diff[0],
                    f"{diff[1]}\ndecisions: accepted {report.accepted}, declined {report.declined}",
                )
        report.targets.append(runner.name)
    return report


def _state_written(lowered: Lowerings, decision: InPlaceDecision) -> bool:
    """Whether the program still writes ``decision``'s state at all (it may be dead code now)."""
    program = lowered.program("state")

    kinds = (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION)
    return any(
        str(spec.target) == decision.target and spec.kind in kinds
        for spec in program.exported_program().graph_signature.output_specs
    )


@dataclass(frozen=True)
class DelegateWrites:
    """What one lowered delegate did to its inputs in one call on fresh inputs.

    ``declared``: the inputs its lowering says it writes (in-place compile spec entries,
    and its engine's ``aliased_io`` for an aliasing engine's delegate); ``written``:
    the inputs whose values the call changed. ``refused``: the error the call raised on
    those inputs (integers are zero: a division by one may fail as eager's does), after
    which no input may have changed.
    """

    delegate: int
    backend_id: str
    declared: frozenset[int]
    written: frozenset[int]
    refused: str | None = None  # the error a call on fresh inputs raised (then nothing may be written)

    @property
    def undeclared(self) -> frozenset[int]:
        """Inputs written without a declaration: what the rule forbids."""
        return self.written - self.declared


def _fresh(value: Any, generator: Any) -> Any:
    """A real tensor for a fake one: floats random, integers and bools zero (index 0 is valid)."""
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype.is_floating_point:
        return torch.randn(tuple(value.shape), generator=generator).to(value.dtype)
    return torch.zeros(tuple(value.shape), dtype=value.dtype)


def check_declared_writes(program: Any, registry: Registry) -> list[DelegateWrites]:
    """Run every delegate of ``program`` (an ``ExecutorchProgramManager``) once on fresh inputs
    and record which inputs it wrote against which its lowering declared
    (``writeback_core.types.RuntimeDelegate``: a delegate writes an input only where declared).

    Each delegate is called through the runtime delegate the registry offers for its
    backend id (``init`` with its blob and compile specs, ``execute``, ``destroy``), with
    its arguments made from the program's own shapes and dtypes.

    :raises ContractViolation: a delegate wrote an input it did not declare; the message
        names the delegate, its backend and the inputs.
    :raises LookupError: no runtime delegate is offered for a delegate's backend id.
    """
    import torch
    from executorch.exir.lowered_backend_module import get_lowered_submodules
    from writeback_core.blob import in_place_outputs

    offered = registry.runtime_delegates()
    engines = {e.backend_id: e for e in registry.engines().values()}
    graph_module = program.exported_program().graph_module
    generator = torch.Generator().manual_seed(0)
    found = []
    for number, (_, module, call) in enumerate(get_lowered_submodules(graph_module)):
        backend_id = module.backend_id
        if backend_id not in offered:
            raise LookupError(f"no runtime delegate for backend {backend_id!r}; offered: {sorted(offered)}")
        inputs = [_fresh(a.meta.get("val") if isinstance(a, torch.fx.Node) else a, generator) for a in call.args[1:]]
        values = call.meta.get("val")
        outputs = [_fresh(v, generator) for v in (values if isinstance(values, (list, tuple)) else [values])]
        specs = {spec.key: bytes(spec.value) for spec in module.compile_specs}
        declared = {e.input for e in in_place_outputs(specs, backend_id, len(inputs), len(outputs))}
        if backend_id in engines:
            declared |= set(engines[backend_id].aliased_io(module.processed_bytes).values())
        before = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        delegate = offered[backend_id]
        handle = delegate.init(module.processed_bytes, specs)
        refused: str | None = None
        try:
            delegate.execute(handle, [*inputs, *outputs])
        except Exception as error:  # e.g. an integer division by the zero a fresh input holds
            refused = f"{type(error).__name__}: {error}"
        finally:
            delegate.destroy(handle)
        written = {
            i
            for i, (old, new) in enumerate(zip(before, inputs, strict=True))
            if isinstance(old, torch.Tensor) and not torch.equal(old, new)
        }
        record = DelegateWrites(number, backend_id, frozenset(declared), frozenset(written), refused)
        if refused is not None and written:
            raise ContractViolation(
                f"delegate {number} ({backend_id}) refused the call ({refused}) but changed input(s) "
                f"{sorted(written)}: a refused call must change nothing"
            )
        if record.undeclared:
            raise ContractViolation(
                f"delegate {number} ({backend_id}) wrote input(s) {sorted(record.undeclared)} that its lowering "
                f"did not declare (declared: {sorted(declared) or 'none'}); a delegate writes an input only where "
                "its in-place compile spec (or its engine's aliased_io) says so"
            )
        found.append(record)
    return found

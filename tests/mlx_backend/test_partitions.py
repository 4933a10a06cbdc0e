"""Graphs that split into several MLX partitions: who owns each mutated buffer, and every
step equal to eager through core's pipeline (export, the MLX partitioner wrapped by core,
the registered passes, ``to_executorch``, the pybind-runtime, real MLX).

The rule worked out by hand per buffer: a mutated buffer lives inside a delegate only when
one partition reads it everywhere it is read and produces its new value; otherwise it
stays a program buffer. An op the MLX delegate lacks (``cumsum`` here) is never taken.
"""

from __future__ import annotations

import pytest
import torch
import writeback_mlx_backend.plugin as mlx_plugin
import writeback_passes.plugin as passes_plugin
import writeback_pybind_runtime.plugin as runtime_plugin
from executorch.exir.lowered_backend_module import LoweredBackendModule
from writeback.session import Eager, Session, assemble, compare, lower_case
from writeback_core import exporting
from writeback_core.lowered import Lowered
from writeback_core.registry import load_registry
from writeback_core.types import ModelCase

STEPS = 5


class CumsumState(torch.nn.Module):
    """The issue's state update: ``cumsum`` is not an MLX op, so ``s`` must stay a program buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.s.copy_(torch.cumsum(self.s + x, 0))
        return self.s * 2.0


class SplitState(torch.nn.Module):
    """Two MLX partitions around a ``cumsum``; five buffers, each a case of the rule.

    - ``a``: read in partition 1, its new value made in partition 2: program buffer (the
      partition replacing it is not passed it, so its new value is copied back).
    - ``c``: read in both partitions, written by ``index_copy`` in partition 2: program
      buffer that partition 2 writes in place (its write-back is dropped).
    - ``d``: read and written in partition 1 only; its new value also feeds the cumsum:
      owned by partition 1.
    - ``b``: read and written in partition 2 only: owned by partition 2.
    - ``e``: never read, written in partition 2: owned by partition 2.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(4))
        self.register_buffer("b", torch.zeros(8, 4))
        self.register_buffer("c", torch.zeros(8, 4))
        self.register_buffer("d", torch.ones(4))
        self.register_buffer("e", torch.zeros(4))

    def forward(self, pos: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = (self.a + x) * 2.0 + self.c.sum(0)
        self.d.mul_(0.5)
        self.d.add_(h)
        self.e.copy_(x * 3.0)
        m = torch.cumsum(h + self.d, 0)
        self.a.copy_(m * 0.5 + 1.0)
        self.b.index_copy_(0, pos, m.unsqueeze(0))
        self.c.index_copy_(0, pos, (m * 2.0).unsqueeze(0))
        return self.b.sum(0) + self.c.sum(0) + self.e, m


def _vector(step: int) -> torch.Tensor:
    return torch.randn(4, generator=torch.Generator().manual_seed(step))


def _cumsum_case() -> ModelCase:
    return ModelCase("cumsum-state", "s = cumsum(s + x)", CumsumState, lambda step: (_vector(step),))


def _split_case() -> ModelCase:
    return ModelCase(
        "split-state",
        "two MLX partitions around a cumsum",
        SplitState,
        lambda step: (torch.tensor([step]), _vector(step)),
    )


def _lower_and_run(case: ModelCase) -> Lowered:
    """Lower ``case`` for MLX and run :data:`STEPS` steps, each compared with eager."""
    registry = load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin, runtime_plugin])
    pipeline = assemble(registry, "mlx")
    lowered = lower_case(case, pipeline)
    session, eager = Session.open(pipeline, lowered), Eager(case)
    for step in range(STEPS):
        check = compare(session.step(step), eager.step(step), session.state, eager.state)
        assert check.ok, (step, check.problems)
    return lowered


def _owners(lowered: Lowered) -> dict[str, str]:
    """Which lowered module owns each delegate-owned buffer (read from exir's own records)."""
    found = {}
    for name, module in lowered.program.exported_program().graph_module.named_children():
        if isinstance(module, LoweredBackendModule):
            for target in module.original_module.graph_signature.buffers_to_mutate.values():
                found[target] = name
    return found


def test_cumsum_state_update_stays_a_program_buffer_and_matches_eager() -> None:
    lowered = _lower_and_run(_cumsum_case())
    program = lowered.program.exported_program()
    assert set(program.graph_signature.inputs_to_buffers.values()) == {"s"}
    assert _owners(lowered) == {}
    assert lowered.write_back_bytes == {"b_s": 16}  # the whole 4-float state, copied back per call


@pytest.fixture(scope="module")
def split_lowered() -> Lowered:
    """``SplitState`` lowered once for this module's tests, its steps already checked."""
    return _lower_and_run(_split_case())


def test_buffer_read_in_one_partition_and_written_in_another_stays_a_program_buffer(split_lowered: Lowered) -> None:
    lowered = split_lowered
    program = lowered.program.exported_program()
    assert set(program.graph_signature.inputs_to_buffers.values()) == {"a", "c"}
    assert _owners(lowered) == {"d": "lowered_module_0", "b": "lowered_module_1", "e": "lowered_module_1"}
    # c's index_copy runs in place inside partition 2; a's new value is copied back whole.
    assert lowered.write_back_bytes == {"b_a": 16}
    decisions = {t: d.accepted for t, d in lowered.decisions.items()}
    assert decisions["c"] is True and decisions["a"] is False


def test_in_place_spec_of_one_partition_stays_out_of_the_others(split_lowered: Lowered) -> None:
    """Each partition has a compile-spec list of its own: the in-place entry of partition 2
    (output 1 into input 3) once leaked into partition 1, whose init then refused it."""
    specs = {
        name: [s.key for s in module.compile_specs]
        for name, module in split_lowered.program.exported_program().graph_module.named_children()
        if isinstance(module, LoweredBackendModule)
    }
    assert specs == {"lowered_module_0": [], "lowered_module_1": ["writeback.in_place_outputs"]}


class UnsupportedOps(torch.nn.Module):
    """Four kinds of node the MLX delegate lacks, between ops it runs, around a state update:

    ``cumsum`` (no handler), ``max(dim)`` (a two-output op read through ``getitem``), an
    int64 matrix product (MLX multiplies only floating point) and float64 arithmetic (no
    MLX dtype here).
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.zeros(4, 4))
        self.register_buffer("w", torch.arange(16, dtype=torch.int64).reshape(4, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.cumsum(x * 2.0, 1)
        best, where = torch.max(h + 1.0, 1)
        counts = (where.unsqueeze(0) @ self.w).squeeze(0)
        wide = (h.double() * 3.0).sum(0).float()
        self.s.index_copy_(0, pos, (best.unsqueeze(0) + wide.unsqueeze(0)) * 0.5)
        return self.s.sum(0), counts, where


def test_ops_mlx_lacks_stay_outside_the_delegate_and_the_program_matches_eager() -> None:
    case = ModelCase(
        "unsupported-ops",
        "four kinds of op MLX lacks",
        UnsupportedOps,
        lambda step: (torch.randn(4, 4, generator=torch.Generator().manual_seed(step)), torch.tensor([step % 4])),
    )
    lowered = _lower_and_run(case)
    inside = set()
    for module in lowered.program.exported_program().graph_module.children():
        if isinstance(module, LoweredBackendModule):
            inside |= {str(n.target) for n in module.original_module.graph.nodes if n.op == "call_function"}
    assert inside, "the ops MLX runs are still delegated"
    lacking = ("cumsum", "max.dim", "getitem", "mm.default", "float64")
    assert not [op for op in inside if any(word in op for word in lacking)], inside


def test_explain_column_names_the_owner_of_each_buffer_as_the_split_lowering_does(split_lowered: Lowered) -> None:
    """explain's "mlx" column works on the real partitions: ``a`` and ``c`` are read in
    partition 1 and written in partition 2, so neither is delegate-owned (it once said so for
    every buffer whose write MLX can run)."""
    from writeback.model_build import export_case
    from writeback_core import find_mutations

    registry = load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin, runtime_plugin])
    program = export_case(_split_case())
    columns = {}
    for mutation in find_mutations(program.run_decompositions()):
        found = registry.hook.writeback_explain_columns(program=program, mutation=mutation)
        columns[mutation.target] = next(c["mlx"] for c in found if c and "mlx" in c)
    owned = {t for t, text in columns.items() if text == "delegate-owned, in place"}
    assert owned == set(_owners(split_lowered)) == {"b", "d", "e"}
    assert columns["c"] == "program buffer (read outside its writing partition), written in place"
    assert columns["a"].startswith("copied back, 16 B/call") or columns["a"].startswith("copied back, 0.0 KiB/call")


class ReturnsAReadBuffer(torch.nn.Module):
    """Found by the fuzzer: a buffer read inside a partition and also returned as it is.
    exir tagged it into the partition and then refused the lowering (its other user, the
    graph output, is outside); it must stay outside and reach the delegate as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4, dtype=torch.float32).reshape(2, 2) * 0.5)
        self.register_buffer("s", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.s.copy_(self.table.reshape(-1)[1:4] * -1.0 + x)
        return self.table, self.s * 2.0, x + 1.0


def test_buffer_read_in_a_partition_and_returned_lowers_and_matches_eager() -> None:
    registry = load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin, runtime_plugin])
    case = ModelCase(
        name="returns-a-read-buffer",
        description="",
        build=ReturnsAReadBuffer,
        step_inputs=lambda step: (torch.full((3,), float(step)),),
        make_state=lambda: (),
    )
    pipeline = assemble(registry, "mlx")
    session = Session.open(pipeline, lower_case(case, pipeline), case)
    eager = Eager(case)
    for step in range(3):
        result = session.step(step)
        check = compare(result, eager.step(step), session.state, eager.state)
        assert check.ok, check.problems


class MaskRows(torch.nn.Module):
    """A non-persistent buffer (a lifted constant, as ExecuTorch's Llama keeps its mask)
    that a delegate takes with it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.mask[pos] * 3.0


def test_lowering_leaves_the_callers_program_whole_so_it_lowers_again() -> None:
    from executorch.exir import to_edge
    from executorch.runtime import Runtime
    from writeback_core import lowering

    registry = load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin, runtime_plugin])
    exported = exporting.export_model(MaskRows(), (torch.tensor([1]),))
    constants = dict(exported.constants)
    lowering.lower(exported, registry, registry.backends()["mlx"])
    assert set(exported.constants) == set(constants)
    # A second, stock lowering of the same program still finds the mask, and runs.
    data = bytes(to_edge(exported).to_executorch().buffer)
    program = Runtime.get().load_program(data)
    (out,) = program.load_method("forward").execute([torch.tensor([2])])
    torch.testing.assert_close(out, MaskRows()(torch.tensor([2])))

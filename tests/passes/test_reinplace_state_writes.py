"""State written in place with the stock runtime's ``index_put_`` kernel (``--backend portable`` and
``--backend xnnpack``), run in stock ``executorch.runtime`` against eager PyTorch, step by step.

The programs are checked in what the runtime executes: the operator table of the emitted
program (``aten::copy_`` is the whole-state write-back; ``aten::index_put_`` the in-place write).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from writeback_core import find_mutations, load_registry
from writeback_core.exporting import export_model
from writeback_core.lowered import Lowered
from writeback_core.lowering import lower
from writeback_core.types import MemoryPlan
from writeback_passes import plugin as passes_plugin
from writeback_passes.explain_columns import stock_kernel_columns
from writeback_passes.state_write_refusals import in_place_kernel_refusal

SHAPE = (1, 2, 16, 8)

# Each write form, as a model writes its cache ``k`` ([1, 2, 16, 8]) with ``v`` ([1, 2, 1, 8]) at ``pos``.
FORMS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {
    "index_copy": lambda k, v, pos: k.index_copy_(2, pos, v),
    # The ExecuTorch Llama example's form, values one rank short (broadcast by index_put).
    "index_put_llama": lambda k, v, pos: k.__setitem__((slice(None), slice(None), pos), v.view(2, 1, 8)),
    "slice_assignment": lambda k, v, pos: k.__setitem__((..., slice(-8, -4, 2), slice(None)), v.expand(1, 2, 2, 8)),
    "copy_into_narrow": lambda k, v, pos: k.narrow(2, 3, 1).copy_(v),
    "select_assignment": lambda k, v, pos: k.__setitem__((slice(None), slice(None), 5), v[:, :, 0]),
}


class CacheWriter(torch.nn.Module):
    """Writes its cache buffer with one form, then reads the new cache."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.register_buffer("k", torch.zeros(SHAPE))

    def forward(self, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        FORMS[self.form](self.k, v, pos)
        return (self.k * 2).sum(-1)


class ReadsOldValue(torch.nn.Module):
    """Computes the new cache, reads the old one, then writes the new one back."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(SHAPE))

    def forward(self, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        new = self.k.index_copy(2, pos, v)
        old = self.k.sum(-1)
        self.k.copy_(new)
        return old + new.sum(-1)


class LinearOverCache(torch.nn.Module):
    """XNNPACK reads the cache inside its delegates (Linears over it): the old cache in one
    whose result the written value needs, the new cache in one after the write."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(SHAPE))
        self.before = torch.nn.Linear(8, 8)
        self.after = torch.nn.Linear(8, 8)
        self.value = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        old = self.before(self.k).mean(2, keepdim=True)
        self.k.index_copy_(2, pos, self.value(x) + old)
        return self.after(self.k).sum(-1)


class LinearOverOldCacheAfterWrite(torch.nn.Module):
    """XNNPACK reads the old cache in a partition that also needs the new one: after the write."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(SHAPE))
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        new = self.k.index_copy(2, pos, v)
        out = self.proj(self.k) + self.proj(new)
        self.k.copy_(new)
        return out.sum(-1)


def _registry() -> Any:
    return load_registry(entry_points=False, plugins=[passes_plugin])


def _steps(count: int, width: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(1, 2, 1, width, generator=generator), torch.tensor([(3 * s + 1) % 16])) for s in range(count)]


def _lower(module: torch.nn.Module, backend: str, plan: MemoryPlan = "planned") -> Lowered:
    registry = _registry()
    exported = export_model(copy.deepcopy(module), _steps(1)[0])
    return lower(exported, registry, registry.backends()[backend], plan)


def _operators(lowered: Lowered) -> list[str]:
    plan = lowered.program.executorch_program.execution_plan[0]
    return [op.name for op in plan.operators]


def _instructions(lowered: Lowered, name: str) -> int:
    """How many instructions of the emitted program call operator ``name``."""
    plan = lowered.program.executorch_program.execution_plan[0]
    ids = {i for i, op in enumerate(plan.operators) if op.name == name}
    chains = plan.chains
    return sum(1 for chain in chains for ins in chain.instructions if getattr(ins.instr_args, "op_index", None) in ids)


def _run_stock_against_eager(lowered: Lowered, module: torch.nn.Module, steps: int = 5) -> None:
    """Every step's output and the buffer ``k`` in stock executorch.runtime equal eager's."""
    from executorch.runtime import Runtime

    eager = copy.deepcopy(module).eval()
    program = Runtime.get().load_program(lowered.pte)  # kept alive: its methods read its memory
    method = program.load_method("forward")
    for step, (v, pos) in enumerate(_steps(steps)):
        got = method.execute([v, pos])[0]
        with torch.no_grad():
            want = eager(v, pos)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"output of step {step}")
        state = method._method.get_attribute("k")
        torch.testing.assert_close(state, eager.k, rtol=1e-5, atol=1e-5, msg=f"cache after step {step}")


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_write_form_runs_in_stock_runtime_in_place_with_no_write_back(form: str) -> None:
    module = CacheWriter(form)
    lowered = _lower(module, "portable")
    assert lowered.decisions["k"].accepted, lowered.decisions["k"]
    assert _instructions(lowered, "aten::copy_") == 0
    assert _instructions(lowered, "aten::index_put_") == 1
    assert lowered.write_back_bytes == {}
    _run_stock_against_eager(lowered, module)


def test_old_value_read_after_the_write_keeps_the_copy_and_matches_eager() -> None:
    module = ReadsOldValue()
    exported = export_model(copy.deepcopy(module), _steps(1)[0]).run_decompositions()
    (mutation,) = find_mutations(exported)
    reason = in_place_kernel_refusal(exported.graph_module.graph, mutation.placeholder, mutation.value)
    assert reason is not None and "reads the old value of 'b_k'" in reason
    lowered = _lower(module, "portable")
    assert not lowered.decisions["k"].accepted
    assert _instructions(lowered, "aten::copy_") == 1
    assert _instructions(lowered, "aten::index_put_") == 0
    _run_stock_against_eager(lowered, module)


@pytest.mark.slow  # XNNPACK lowering: about 30 s
def test_state_xnnpack_reads_inside_its_delegate_is_written_in_place_outside_it() -> None:
    module = LinearOverCache()
    lowered = _lower(module, "xnnpack")
    plan = lowered.program.executorch_program.execution_plan[0]
    assert [d.id for d in plan.delegates] and all(d.id == "XnnpackBackend" for d in plan.delegates)
    assert lowered.decisions["k"].accepted
    assert _instructions(lowered, "aten::copy_") == 0
    assert _instructions(lowered, "aten::index_put_") == 1
    _run_stock_against_eager(lowered, module)


@pytest.mark.slow  # XNNPACK lowering
def test_xnnpack_partition_reading_the_old_state_after_the_write_keeps_the_copy() -> None:
    module = LinearOverOldCacheAfterWrite()
    lowered = _lower(module, "xnnpack")
    assert any(d.id == "XnnpackBackend" for d in lowered.program.executorch_program.execution_plan[0].delegates)
    assert not lowered.decisions["k"].accepted
    assert _instructions(lowered, "aten::copy_") == 1
    _run_stock_against_eager(lowered, module)


class CallerCache(torch.nn.Module):
    """The cache is the caller's: ``forward(v, pos, cache)`` writes it with ``index_copy_``."""

    def forward(self, v: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(2, pos, v)
        return (cache * 2).sum(-1)


def _lower_caller_cache() -> Lowered:
    registry = _registry()
    v, pos = _steps(1)[0]
    exported = export_model(CallerCache(), (v, pos, torch.zeros(SHAPE)))
    return lower(exported, registry, registry.backends()["portable"], "state")


def test_caller_owned_cache_is_written_in_place_in_writebacks_runtime() -> None:
    from writeback_pybind_runtime import plugin as pybind_plugin

    lowered = _lower_caller_cache()
    assert lowered.decisions["cache"].accepted
    assert _instructions(lowered, "aten::copy_") == 0
    assert _instructions(lowered, "aten::index_put_") == 1
    registry = load_registry(entry_points=False, plugins=[pybind_plugin])
    method = registry.runtimes()["pybind"].load_program(lowered.pte, {}).load_method("forward")
    cache, expected = torch.zeros(SHAPE), torch.zeros(SHAPE)
    for step, (v, pos) in enumerate(_steps(5)):
        got = method.execute([v, pos, cache])
        want = CallerCache()(v, pos, expected)
        torch.testing.assert_close(got[-1], want, rtol=1e-5, atol=1e-5, msg=f"output of step {step}")
        torch.testing.assert_close(cache, expected, rtol=0, atol=0, msg=f"caller's cache after step {step}")


def test_stock_python_runtime_does_not_write_a_caller_owned_cache() -> None:
    """What explain warns about: stock executorch.runtime returns the new cache and leaves the
    caller's tensor as it was."""
    from executorch.runtime import Runtime

    lowered = _lower_caller_cache()
    program = Runtime.get().load_program(lowered.pte)
    method = program.load_method("forward")
    cache = torch.zeros(SHAPE)
    v, pos = _steps(1)[0]
    got = method.execute([v, pos, cache])
    expected = torch.zeros(SHAPE).index_copy_(2, pos, v)
    torch.testing.assert_close(got[0], expected, rtol=0, atol=0)
    assert torch.count_nonzero(cache) == 0


def _kernel_cells(program: Any) -> dict[str, str]:
    """The "stock kernels" cell of each state (the column alone; through `writeback explain`
    and every plugin's columns: the README's explain block, tests/test_readme_output.py)."""
    return {
        mutation.target: stock_kernel_columns(program, mutation)["stock kernels"]
        for mutation in find_mutations(program.run_decompositions())
    }


def test_explain_column_says_in_place_or_why_the_copy_stays() -> None:
    from writeback.model_build import export_case
    from writeback.zoo import builtin_models

    buffers = _kernel_cells(export_case(builtin_models()["decoder"]))
    in_place = "in place (aten::index_put_), any runtime"
    assert buffers == dict.fromkeys(["blocks.0.k_cache", "blocks.0.v_cache"], in_place)
    for cell in _kernel_cells(export_case(builtin_models()["decoder-caller-cache"])).values():
        assert cell.startswith("in place (aten::index_put_) in writeback's runtime")
        assert "stock executorch.runtime leaves the caller's tensor unwritten" in cell
    (kept,) = _kernel_cells(export_model(ReadsOldValue(), _steps(1)[0])).values()
    assert kept.startswith("copied back, 1.0 KiB/call: ") and "reads the old value of 'b_k'" in kept
    # Whole-state updates (a running mean, a step counter) have no in-place kernel.
    for cell in _kernel_cells(export_case(builtin_models()["ema"])).values():
        assert cell.startswith("copied back") and "the stock runtime's only in-place state kernel" in cell

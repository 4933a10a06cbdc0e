"""A call the runtime refuses for an index changes no state, although writeback writes state in place.

Stock ExecuTorch writes state back at the end of the graph, so a kernel refusing an index
(error 0x12) leaves every state as it was. writeback writes a state where its value is made
(an early ``copy_``, an ``index_put_``): without :func:`check_indices_first` a refusal later in
the graph would leave those writes done. Each program here is lowered through writeback for
``portable`` (and ``xnnpack``, slow), run in stock ``executorch.runtime`` with an index in
range (compared with eager) and then one eager rejects; the refused call must leave every
state exactly as the previous call left it (eager's state before the call).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from writeback_core import load_registry
from writeback_core.exporting import export_model
from writeback_core.lowered import Lowered
from writeback_core.lowering import lower
from writeback_passes import plugin as passes_plugin
from writeback_passes.index_checks import UncheckedIndexWarning

BACKENDS = ["portable", pytest.param("xnnpack", marks=pytest.mark.slow)]


class WritesThenIndexes(torch.nn.Module):
    """Three states written before an ``index_copy_`` at ``pos`` (which eager rejects past 3):
    a whole copy (``copy_``), a slice and a row at a constant index."""

    whole: torch.Tensor
    tail: torch.Tensor
    cache: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("whole", torch.zeros(1, 3))
        self.register_buffer("tail", torch.zeros(4, 2))
        self.register_buffer("cache", torch.zeros(4, 3))
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.whole.copy_(self.proj(x))
        self.tail[2:] = self.tail[2:] + 1.0
        self.cache.index_copy_(0, pos % 7, x[:, :3] * 2.0)
        return self.whole.sum() + self.cache.sum()


class Layers(torch.nn.Module):
    """Four caches written at the same run-time position, one after the other (a decoder's
    layers): one check serves them all."""

    def __init__(self) -> None:
        super().__init__()
        for n in range(4):
            self.register_buffer(f"k{n}", torch.zeros(1, 2, 8, 4))

    def forward(self, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = v
        for n in range(4):
            cache = getattr(self, f"k{n}")
            cache[:, :, pos] = out
            out = out + cache.sum(2, keepdim=True)
        return out


class IndexFromWrittenState(torch.nn.Module):
    """The second write's index reads a state after the first write: its check cannot move
    before that write (the pass reports it)."""

    a: torch.Tensor
    b: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(4))
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.a[pos] = x
        self.b[self.a.long()[:1]] = x
        return self.a + self.b


def _lower(module: torch.nn.Module, backend: str, example: tuple[torch.Tensor, ...]) -> Lowered:
    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    exported = export_model(copy.deepcopy(module), example)
    return lower(exported, registry, registry.backends()[backend], "planned")


def _buffers(method: Any, names: list[str]) -> dict[str, torch.Tensor]:
    return {n: method._method.get_attribute(n).clone() for n in names}


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_refused_index_after_in_place_writes_changes_no_state_no_partial_write(backend: str) -> None:
    from executorch.runtime import Runtime

    module = WritesThenIndexes()
    x = torch.randn(1, 6, generator=torch.Generator().manual_seed(0))
    lowered = _lower(module, backend, (x[:, :3], torch.tensor([1])))
    names = ["whole", "tail", "cache"]
    program = Runtime.get().load_program(lowered.pte)
    method = program.load_method("forward")
    eager = copy.deepcopy(module)
    for step, pos in enumerate([1, 3, 0]):
        inp = torch.randn(1, 3, generator=torch.Generator().manual_seed(step + 1))
        got = method.execute([inp, torch.tensor([pos])])[0]
        torch.testing.assert_close(got, eager(inp, torch.tensor([pos])))
    state = _buffers(method, names)
    torch.testing.assert_close(state["tail"][2:], torch.full((2, 2), 3.0))  # three calls, worked out by hand
    before = {n: getattr(eager, n).clone() for n in names}
    inp = torch.randn(1, 3)
    with pytest.raises(IndexError, match=r"out of range|out of bounds"):
        copy.deepcopy(eager)(inp, torch.tensor([4]))  # eager rejects position 4 of 4 (4 % 7)
    with pytest.raises(RuntimeError):
        method.execute([inp, torch.tensor([4])])
    after = _buffers(method, names)
    for name in names:
        torch.testing.assert_close(after[name], before[name], msg=f"{name} changed by the refused call")
    del method, program


def test_negative_position_still_wraps_after_the_check_no_silent_wrong_answer() -> None:
    from executorch.runtime import Runtime

    module = Layers()
    v = torch.randn(1, 2, 1, 4, generator=torch.Generator().manual_seed(0))
    lowered = _lower(module, "portable", (v, torch.tensor([0])))
    program = Runtime.get().load_program(lowered.pte)
    method = program.load_method("forward")
    eager = copy.deepcopy(module)
    for step, pos in enumerate([0, -1, 3, -8, 7]):
        v = torch.randn(1, 2, 1, 4, generator=torch.Generator().manual_seed(step))
        torch.testing.assert_close(method.execute([v, torch.tensor([pos])])[0], eager(v, torch.tensor([pos])))
    for n in range(4):
        torch.testing.assert_close(method._method.get_attribute(f"k{n}"), getattr(eager, f"k{n}"))
    before = {n: getattr(eager, f"k{n}").clone() for n in range(4)}
    with pytest.raises(RuntimeError):
        method.execute([v, torch.tensor([8])])
    for n in range(4):
        torch.testing.assert_close(method._method.get_attribute(f"k{n}"), before[n], msg=f"k{n} changed")
    del method, program


def test_one_check_serves_every_write_at_the_same_position() -> None:
    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    v = torch.randn(1, 2, 1, 4)
    exported = export_model(Layers(), (v, torch.tensor([0])))
    lowered = lower(exported, registry, registry.backends()["portable"], "planned")
    plan = lowered.program.executorch_program.execution_plan[0]
    kernels = [
        plan.operators[i.instr_args.op_index].name
        for i in plan.chains[0].instructions
        if hasattr(i.instr_args, "op_index")
    ]
    assert kernels.count("aten::index_put_") == 4  # every cache written in place
    assert kernels.count("aten::index") == 1  # and its position checked once, before the first
    assert kernels.index("aten::index") < kernels.index("aten::index_put_")


def test_index_read_from_a_state_after_its_write_warns_it_is_unchecked() -> None:
    """The pass's one refusal: an index computed from a value that exists only after a write."""
    module = IndexFromWrittenState()
    expected = r"index_put_ into state 'b_b' \(its index depends on index_put_ into state 'b_a', which runs after"
    with pytest.warns(UncheckedIndexWarning, match=expected):
        _lower(module, "portable", (torch.tensor([1.0]), torch.tensor([0])))


class RoutesFromWrittenState(torch.nn.Module):
    """A state written, then a router reading it: the top 2 of ``scores`` positions pick the
    experts' weights (a mixture-of-experts layer after a recurrent one)."""

    h: torch.Tensor

    def __init__(self, scores: int, experts: int) -> None:
        super().__init__()
        self.register_buffer("h", torch.zeros(1, scores))
        self.score = torch.nn.Linear(3, scores)
        self.experts = torch.nn.Parameter(torch.randn(experts, 3, 3, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.h[:, pos] = self.score(x)[:, pos]  # written in place: the router reads it after the write
        ids = self.h.topk(2, dim=-1).indices.reshape(-1)
        return (self.experts[ids] @ x[0]).sum(0)


def test_router_indices_from_topk_need_no_check_and_route_as_eager() -> None:
    """topk's indices over 4 scores index 4 experts: in range by construction, no warning."""
    from executorch.runtime import Runtime

    torch.manual_seed(0)
    module = RoutesFromWrittenState(scores=4, experts=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedIndexWarning)
        lowered = _lower(module, "portable", (torch.randn(1, 3), torch.tensor([0])))
    method = Runtime.get().load_program(lowered.pte).load_method("forward")
    eager = copy.deepcopy(module)
    for step in range(4):
        x = torch.randn(1, 3, generator=torch.Generator().manual_seed(step))
        pos = torch.tensor([step])
        torch.testing.assert_close(method.execute([x, pos])[0], eager(x, pos))
    torch.testing.assert_close(method._method.get_attribute("h"), eager.h)


def test_router_indices_over_more_scores_than_experts_still_warn_unchecked() -> None:
    """topk over 5 scores may pick position 4 of 4 experts: not in range by construction."""
    torch.manual_seed(0)
    unchecked = r"index \(aten_index_tensor_1\) \(its index depends on index_put_ into state 'b_h'"
    with pytest.warns(UncheckedIndexWarning, match=unchecked):
        _lower(RoutesFromWrittenState(scores=5, experts=4), "portable", (torch.randn(1, 3), torch.tensor([0])))

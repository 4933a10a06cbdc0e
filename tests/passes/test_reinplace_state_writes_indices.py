"""In-place state writes take every index eager takes and reject every index eager rejects.

Each program is lowered through writeback for ``portable`` and ``xnnpack`` and run in stock
``executorch.runtime``; every step's output and the cache buffer are compared with eager
PyTorch. An index eager rejects must fail the call with the cache unchanged (the stock
``index_put_`` kernel checks every index before it writes: measured below, not assumed).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from writeback_core import load_registry
from writeback_core.exporting import export_model
from writeback_core.lowered import Lowered
from writeback_core.lowering import lower
from writeback_passes import plugin as passes_plugin

SHAPE = (1, 2, 16, 8)
BACKENDS = ["portable", pytest.param("xnnpack", marks=pytest.mark.slow)]


class Cache(torch.nn.Module):
    """A cache ``k`` written by ``write(k, v, pos)``, then read whole."""

    def __init__(self, write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
        super().__init__()
        self.write = write
        self.register_buffer("k", torch.zeros(SHAPE))
        self.proj = torch.nn.Linear(8, 8)  # something for XNNPACK to take

    def forward(self, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.write(self.k, self.proj(v), pos)
        return (self.k * 2).sum(-1)


def _index_put(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    k[:, :, pos] = v  # aten.index_put_: eager wraps a negative position


def _index_copy(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
    k.index_copy_(2, pos, v)  # eager rejects a negative position


class TailWriter(torch.nn.Module):
    """``k[:, :, 16 - n : end] = v`` for values ``v`` of a run-time length ``n``: the slice's
    start is known only at run time and ``end`` (open, or 20) lies past the size, which eager
    clamps to 16."""

    def __init__(self, end: int | None) -> None:
        super().__init__()
        self.end = end
        self.register_buffer("k", torch.zeros(SHAPE))

    def forward(self, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k[:, :, 16 - v.shape[2] : self.end] = v * pos
        return (self.k * 2).sum(-1)


def _lower(module: torch.nn.Module, backend: str, example: tuple[torch.Tensor, ...]) -> Lowered:
    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    exported = export_model(copy.deepcopy(module), example)
    return lower(exported, registry, registry.backends()[backend], "planned")


def _in_place(lowered: Lowered) -> bool:
    plan = lowered.program.executorch_program.execution_plan[0]
    names = [op.name for op in plan.operators]
    return "aten::index_put_" in names and "aten::copy_" not in names


def _values(step: int, length: int = 1) -> torch.Tensor:
    return torch.randn(1, 2, length, 8, generator=torch.Generator().manual_seed(step))


def _run(lowered: Lowered, module: torch.nn.Module, steps: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every step's output and ``k`` in stock executorch.runtime equal eager's."""
    from executorch.runtime import Runtime

    eager = copy.deepcopy(module).eval()
    program = Runtime.get().load_program(lowered.pte)  # kept alive: its methods read its memory
    method = program.load_method("forward")
    for step, (v, pos) in enumerate(steps):
        with torch.no_grad():
            want = eager(v, pos)
        got = method.execute([v, pos])[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"output of step {step} (pos {pos.tolist()})")
        state = method._method.get_attribute("k")
        torch.testing.assert_close(state, eager.k, rtol=1e-5, atol=1e-5, msg=f"cache after step {step}")


def _rejects_like_eager(lowered: Lowered, module: torch.nn.Module, good: Any, bad: Any) -> None:
    """After a good step, ``bad`` fails in eager and in the runtime, and leaves the runtime's
    cache as it was; a good step after it still matches eager."""
    from executorch.runtime import Runtime

    eager = copy.deepcopy(module).eval()
    program = Runtime.get().load_program(lowered.pte)
    method = program.load_method("forward")
    method.execute(list(good))
    with torch.no_grad():
        eager(*good)
    before, eager_before = method._method.get_attribute("k").clone(), eager.k.clone()
    torch.testing.assert_close(before, eager_before, rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError), torch.no_grad():
        eager(*bad)
    with pytest.raises(RuntimeError, match="0x12"):
        method.execute(list(bad))
    assert torch.equal(method._method.get_attribute("k"), before), "a rejected index wrote into the cache"
    # Eager's CPU index_put_ may write the good positions before it reaches the bad one
    # ([2, 40] writes position 2); the runtime writes nothing. Go on from the unchanged cache.
    eager.k.copy_(eager_before)
    _continue = (_values(99, good[1].numel()), good[1])
    method.execute(list(_continue))
    with torch.no_grad():
        eager(*_continue)
    torch.testing.assert_close(method._method.get_attribute("k"), eager.k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_positions_of_index_put_match_eager_at_every_step(backend: str) -> None:
    module = Cache(_index_put)
    lowered = _lower(module, backend, (_values(0), torch.tensor([0])))
    assert _in_place(lowered)
    positions = [[-1], [3], [-16], [-5], [15], [-1]]
    _run(lowered, module, [(_values(s), torch.tensor(p)) for s, p in enumerate(positions)])


def test_negative_int32_positions_of_index_put_match_eager_at_every_step() -> None:
    module = Cache(_index_put)
    lowered = _lower(module, "portable", (_values(0), torch.tensor([0], dtype=torch.int32)))
    assert _in_place(lowered)
    positions = [[-1], [3], [-16], [-7]]
    _run(lowered, module, [(_values(s), torch.tensor(p, dtype=torch.int32)) for s, p in enumerate(positions)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_negative_positions_in_one_index_put_match_eager(backend: str) -> None:
    module = Cache(_index_put)
    lowered = _lower(module, backend, (_values(0, 3), torch.tensor([0, 1, 2])))
    assert _in_place(lowered)
    positions = [[-1, 0, -16], [4, -3, 7], [-2, -9, 9]]
    _run(lowered, module, [(_values(s, 3), torch.tensor(p)) for s, p in enumerate(positions)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", [[16], [-17], [2, 40]])
def test_index_put_out_of_range_fails_and_leaves_the_cache_unchanged(backend: str, position: list[int]) -> None:
    module = Cache(_index_put)
    count = len(position)
    lowered = _lower(module, backend, (_values(0, count), torch.arange(count)))
    assert _in_place(lowered)
    good = (_values(1, count), torch.arange(count) + 3)
    _rejects_like_eager(lowered, module, good, (_values(2, count), torch.tensor(position)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", [-1, 16])
def test_index_copy_rejects_what_eager_rejects_and_leaves_the_cache_unchanged(backend: str, position: int) -> None:
    """``index_copy_`` reaches the program as ``index_put`` (torch's decomposition), but eager's
    ``index_copy_`` rejects a negative position: the in-place write must not wrap it."""
    module = Cache(_index_copy)
    lowered = _lower(module, backend, (_values(0), torch.tensor([0])))
    assert _in_place(lowered)
    _rejects_like_eager(lowered, module, (_values(1), torch.tensor([4])), (_values(2), torch.tensor([position])))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("end", [None, 20])
def test_slice_assignment_with_a_run_time_start_and_an_end_past_the_size_matches_eager(
    backend: str, end: int | None
) -> None:
    module = TailWriter(end)
    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    length = torch.export.Dim("length", min=1, max=15)
    example = (_values(0, 3), torch.tensor(2.0))
    exported = export_model(copy.deepcopy(module), example, dynamic_shapes=({2: length}, None))
    lowered = lower(exported, registry, registry.backends()[backend], "planned")
    assert _in_place(lowered)
    lengths = [3, 15, 1, 7, 15]
    _run(lowered, module, [(_values(s, n), torch.tensor(float(s + 1))) for s, n in enumerate(lengths)])


class ReadsOldCache(torch.nn.Module):
    """``index_copy`` whose copy stays (the old cache is read after the write), and an
    ``index_copy`` of an activation: both run on the functional ``index_put.out`` kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(SHAPE))

    def forward(self, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        new = self.k.index_copy(2, pos, v)
        old = self.k.sum(-1)
        self.k.copy_(new)
        scratch = torch.zeros(1, 2, 16, 8).index_copy(2, pos, v * 3.0)
        return old + new.sum(-1) + scratch.sum(-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_index_copy_whose_copy_stays_rejects_a_negative_position_as_eager_does(backend: str) -> None:
    """torch's decomposition makes ``index_copy`` an ``index_put``, whose kernel wraps ``-1``
    to 15: without the guard the runtime wrote position 15 where eager raises."""
    module = ReadsOldCache()
    lowered = _lower(module, backend, (_values(0), torch.tensor([0])))
    assert not lowered.decisions["k"].accepted
    _run(lowered, module, [(_values(s), torch.tensor([p])) for s, p in enumerate([2, 15, 0])])
    _rejects_like_eager(lowered, module, (_values(1), torch.tensor([4])), (_values(2), torch.tensor([-1])))

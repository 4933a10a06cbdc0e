"""One ``Method`` serves one call at a time and says so; separate methods run concurrently.

The racing runs happen in a subprocess (``isolated_worker``), so a crash shows up
as a failed test rather than a dead pytest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from writeback_core.registry import load_registry
from writeback_pybind_runtime import DelegateError, Method, Runtime

from tests.pybind_runtime.conftest import Lower
from tests.pybind_runtime.doubler import DoublerDelegate, DoublerPartitioner, DoublerPlugin
from tests.pybind_runtime.isolated_worker import run_isolated

BUSY = r"in use by another call"


@pytest.fixture
def mlp_ptes(mlp_pte_bytes: dict[str, bytes], tmp_path: Path) -> list[Path]:
    """The worker's stateful MLP, with inputs and outputs memory planned and not (the
    session's lowering, see conftest's ``mlp_pte_bytes``)."""
    paths = []
    for name in ("planned", "unplanned"):
        path = tmp_path / f"mlp_{name}.pte"
        path.write_bytes(mlp_pte_bytes[name])
        paths.append(path)
    return paths


def test_concurrent_calls_on_one_method_raise_never_wrong_or_crash(mlp_ptes: list[Path]) -> None:
    result = run_isolated("shared-method", *mlp_ptes)
    counts = result["counts"]
    assert counts.get("wrong", 0) == 0 and counts.get("other", 0) == 0, result
    assert counts.get("correct", 0) > 0, result
    assert sum(counts.values()) == 2 * 4 * 30


def test_separate_methods_of_one_program_run_concurrently_and_match_eager(mlp_ptes: list[Path]) -> None:
    result = run_isolated("separate-methods", *mlp_ptes)
    assert result["counts"] == {"correct": 2 * 4 * 30}, result


class Blocking(DoublerDelegate):
    """Doubles, after waiting until released: holds a call inside execute()."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def execute(self, handle: Any, args: Sequence[Any]) -> None:
        self.entered.set()
        assert self.release.wait(timeout=30)
        super().execute(handle, args)


class DoubleThenShift(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + x) + 1


def _delegated(lower: Lower, delegate: DoublerDelegate) -> Method:
    pte = lower(DoubleThenShift(), (torch.zeros(2, 3),), partitioners=[DoublerPartitioner()], planned_outputs=False)
    runtime = Runtime(load_registry(entry_points=False, plugins=[DoublerPlugin(delegate)]))
    return runtime.load_program(pte).load_method("forward")


def test_every_entry_point_refuses_a_method_that_another_thread_is_running(lower: Lower) -> None:
    delegate = Blocking()
    method = _delegated(lower, delegate)
    x = torch.arange(6.0).view(2, 3)
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.append(method([x])[0]))
    runner.start()
    try:
        assert delegate.entered.wait(timeout=30)
        other = torch.full((2, 3), 5.0)
        bound = torch.zeros(2, 3)
        attempts: dict[str, Callable[[], object]] = {
            "set_inputs": lambda: method.set_inputs([other]),
            "execute": lambda: method.execute(),
            "get_outputs": lambda: method.get_outputs(),
            "call": lambda: method([other]),
            "set_output": lambda: method.set_output(bound, 0),
        }
        for attempt in attempts.values():
            with pytest.raises(RuntimeError, match=rf"method 'forward' refused this call: .*{BUSY}"):
                attempt()
    finally:
        delegate.release.set()
        runner.join(timeout=30)
    # The running call was not disturbed, and nothing the refused calls passed was used.
    torch.testing.assert_close(results[0], 2 * x + 1)
    assert bound.tolist() == [[0.0] * 3] * 2 and not method.metadata.outputs[0].bound
    # The flag is cleared: the method serves the next call.
    torch.testing.assert_close(method([other])[0], 2 * other + 1)


def test_delegate_calling_back_into_its_method_is_refused_and_method_stays_usable(lower: Lower) -> None:
    holder: list[Method] = []

    class Reentrant(DoublerDelegate):
        def execute(self, handle: Any, args: Sequence[Any]) -> None:
            holder[0]([torch.ones(2, 3)])

    holder.append(_delegated(lower, Reentrant()))
    with pytest.raises(DelegateError) as info:
        holder[0]([torch.ones(2, 3)])
    assert isinstance(info.value.__cause__, RuntimeError) and BUSY in str(info.value.__cause__)
    holder[0].set_inputs([torch.ones(2, 3)])  # not left busy after the failure


def test_busy_flag_is_cleared_when_a_call_raises(lower: Lower, load: Callable[[bytes], Method]) -> None:
    method = load(lower(DoubleThenShift(), (torch.zeros(2, 3),)))
    with pytest.raises(ValueError, match=r"input 0 .*expected dtype float32"):
        method([torch.zeros(2, 3, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"inputs have not been set"):
        method.execute()
    with pytest.raises(ValueError, match=r"has no outputs"):
        method.get_outputs()
    with pytest.raises(IndexError):
        method.set_output(torch.zeros(2, 3), 3)
    x = torch.arange(6.0).view(2, 3)
    torch.testing.assert_close(method([x])[0], 2 * x + 1)

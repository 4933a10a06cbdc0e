"""Python delegates from the ``writeback_runtime_delegates`` hook run as ExecuTorch backends."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from writeback_core.registry import load_registry
from writeback_pybind_runtime import DelegateError, Runtime

from tests.pybind_runtime.conftest import Lower, stock_method
from tests.pybind_runtime.doubler import BACKEND_ID, DoublerDelegate, DoublerPartitioner, DoublerPlugin


class DoubleThenShift(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + x) + 1


def _runtime_with(delegate: DoublerDelegate) -> Runtime:
    return Runtime(load_registry(entry_points=False, plugins=[DoublerPlugin(delegate)]))


@pytest.fixture
def doubled_pte(lower: Lower) -> bytes:
    return lower(DoubleThenShift(), (torch.randn(2, 3),), partitioners=[DoublerPartitioner()])


def test_writeback_runtime_delegates_hook_registers_a_backend_that_runs(doubled_pte: bytes) -> None:
    delegate = DoublerDelegate()
    runtime = _runtime_with(delegate)
    method = runtime.load_program(doubled_pte).load_method("forward")
    assert method.metadata.backends == (BACKEND_ID,)
    assert BACKEND_ID in runtime.backend_ids
    x = torch.arange(6.0).view(2, 3)
    (out,) = method([x])
    torch.testing.assert_close(out, 2 * x + 1)
    assert delegate.inits == [(b"doubler-v1", {"factor": b"2"})]
    assert len(delegate.calls) == 1


def test_delegate_gets_zero_copy_views_inputs_then_outputs(lower: Lower) -> None:
    seen: list[tuple[int, int]] = []

    class Recording(DoublerDelegate):
        def execute(self, handle, args):  # type: ignore[no-untyped-def]
            seen.append((args[0].data_ptr(), args[1].data_ptr()))
            super().execute(handle, args)

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + x

    pte = lower(
        Double(), (torch.randn(4),), partitioners=[DoublerPartitioner()], planned_inputs=False, planned_outputs=False
    )
    method = _runtime_with(Recording()).load_program(pte).load_method("forward")
    x = torch.arange(4.0)
    out = torch.empty(4)
    method.set_output(out, 0)
    (result,) = method([x])
    # Unplanned input and bound output: the delegate saw the caller's own memory.
    assert seen == [(x.data_ptr(), out.data_ptr())]
    assert result is out
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_delegate_exception_becomes_delegate_error_naming_backend_and_cause(doubled_pte: bytes) -> None:
    runtime = _runtime_with(DoublerDelegate(fail_with=ZeroDivisionError("boom in delegate")))
    method = runtime.load_program(doubled_pte).load_method("forward")
    with pytest.raises(DelegateError, match=rf"{BACKEND_ID}.*ZeroDivisionError: boom in delegate") as info:
        method([torch.ones(2, 3)])
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    # The method is still usable once the delegate stops failing.
    runtime.register_delegates(load_registry(entry_points=False, plugins=[DoublerPlugin(DoublerDelegate())]))
    (out,) = runtime.load_program(doubled_pte).load_method("forward")([torch.ones(2, 3)])
    torch.testing.assert_close(out, torch.full((2, 3), 3.0))


def test_delegate_init_failure_is_a_delegate_error_at_load_method(doubled_pte: bytes) -> None:
    class BadInit(DoublerDelegate):
        def init(self, processed, compile_specs):  # type: ignore[no-untyped-def]
            raise KeyError("no such engine")

    program = _runtime_with(BadInit()).load_program(doubled_pte)
    with pytest.raises(DelegateError, match=r"KeyError") as info:
        program.load_method("forward")
    assert isinstance(info.value.__cause__, KeyError)


def test_delegate_destroy_runs_when_method_is_dropped(doubled_pte: bytes) -> None:
    delegate = DoublerDelegate()
    method = _runtime_with(delegate).load_program(doubled_pte).load_method("forward")
    method([torch.ones(2, 3)])
    del method
    gc.collect()
    assert delegate.destroyed == [{"factor": 2.0}]


def test_stock_runtime_runs_the_python_delegate_registered_here(doubled_pte: bytes) -> None:
    _runtime_with(DoublerDelegate()).register_delegates()
    x = torch.randn(2, 3)
    (out,) = stock_method(doubled_pte).execute([x])
    torch.testing.assert_close(out, 2 * x + 1)


def test_delegate_runs_from_another_thread_with_gil_released(doubled_pte: bytes) -> None:
    method = _runtime_with(DoublerDelegate()).load_program(doubled_pte).load_method("forward")
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                results.append(method([torch.ones(2, 3)])[0])
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not errors and len(results) == 20
    assert all(torch.equal(r, torch.full((2, 3), 3.0)) for r in results)


def test_delegate_without_execute_is_refused_naming_it() -> None:
    class Incomplete:
        backend_id = "WritebackTestIncomplete"

        def init(self, processed, compile_specs):  # type: ignore[no-untyped-def]
            return None

    class Plugin:
        writeback_name = "incomplete"

        from writeback_core.registry import hookimpl

        @hookimpl
        def writeback_runtime_delegates(self):  # type: ignore[no-untyped-def]
            return [Incomplete()]

    runtime = Runtime(load_registry(entry_points=False, plugins=[Plugin()]))
    with pytest.raises(TypeError, match=r"WritebackTestIncomplete.*execute"):
        runtime.register_delegates()


def test_backend_id_of_a_compiled_backend_is_refused() -> None:
    class Shadow(DoublerDelegate):
        backend_id = "XnnpackBackend"

    import executorch.runtime  # noqa: F401 - loads the compiled backends

    runtime = Runtime(load_registry(entry_points=False, plugins=[DoublerPlugin(Shadow())]))
    if "XnnpackBackend" not in runtime.backend_ids:
        pytest.skip("this executorch build registers no XnnpackBackend")
    with pytest.raises(ValueError, match=r"XnnpackBackend.*compiled"):
        runtime.register_delegates()


def test_use_delegates_runs_the_delegate_handed_over_last(doubled_pte: bytes) -> None:
    """A pipeline hands its delegates over at every load (``use_delegates``): the same
    object again changes nothing, another one for the id replaces it."""
    runtime = Runtime(load_registry(entry_points=False))
    first, second = DoublerDelegate(), DoublerDelegate()
    for delegate in (first, first, second):
        runtime.use_delegates({BACKEND_ID: delegate})
        (out,) = runtime.load_program(doubled_pte).load_method("forward")([torch.ones(2, 3)])
        torch.testing.assert_close(out, torch.full((2, 3), 3.0))
    assert (len(first.inits), len(first.calls)) == (2, 2)
    assert (len(second.inits), len(second.calls)) == (1, 1)


def test_registering_a_backend_id_again_replaces_its_python_object_process_wide(doubled_pte: bytes) -> None:
    """ExecuTorch cannot unregister a backend: the id stays, the object behind it is the last
    registered, for every runtime of the process."""
    first, second = DoublerDelegate(), DoublerDelegate()
    early = _runtime_with(first)
    early.register_delegates()
    _runtime_with(second).register_delegates()
    x = torch.arange(6.0).view(2, 3)
    (out,) = early.load_program(doubled_pte).load_method("forward")([x])
    torch.testing.assert_close(out, 2 * x + 1)
    assert first.calls == [] and len(second.calls) == 1

"""Python delegates from the ``writeback_runtime_delegates`` hook run as ExecuTorch backends."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch
from writeback_core.registry import load_registry
from writeback_pybind_runtime import DelegateError, Runtime

from tests.pybind_runtime.conftest import Lower, stock_method
from tests.pybind_runtime.doubler import BACKEND_ID, DoublerDelegate, DoublerPartitioner, DoublerPlugin
from tests.pybind_runtime.isolated_worker import run_isolated


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


class _ViewDoubler(DoublerDelegate):
    """The doubler, asking for its blob as a memoryview (``processed_as_memoryview``) and
    keeping what it was given."""

    processed_as_memoryview = True

    def __init__(self) -> None:
        super().__init__()
        self.given: list[object] = []

    def init(self, processed, compile_specs):  # type: ignore[no-untyped-def]
        self.given.append(processed)
        assert isinstance(processed, memoryview) and processed.readonly
        return super().init(bytes(processed), compile_specs)


def test_a_delegate_asking_for_a_memoryview_gets_the_blob_uncopied_and_a_kept_view_raises_never_reads_freed_memory(
    doubled_pte: bytes, tmp_path: Path
) -> None:
    """``processed_as_memoryview = True``: ``init`` gets a read-only memoryview of the
    runtime's buffer (the file's mapping while the method loads) holding the blob, and
    the method runs as with bytes. The view is released when ``init`` returns: reading
    the one the delegate kept raises ``ValueError`` instead of reading freed memory."""
    path = tmp_path / "doubled.pte"
    path.write_bytes(doubled_pte)
    for source in (doubled_pte, path):
        delegate = _ViewDoubler()
        method = _runtime_with(delegate).load_program(source).load_method("forward")
        x = torch.arange(6.0).view(2, 3)
        torch.testing.assert_close(method([x])[0], 2 * x + 1)
        assert delegate.inits == [(b"doubler-v1", {"factor": b"2"})]
        (kept,) = delegate.given
        assert isinstance(kept, memoryview)
        with pytest.raises(ValueError, match="released memoryview"):
            bytes(kept)


def test_a_memoryview_delegate_that_raises_in_init_fails_the_load_naming_it_and_the_process_lives(
    doubled_pte: bytes,
) -> None:
    """An ``init`` that raises while a view of the blob is alive in its frame: the load
    fails with ``DelegateError`` naming the delegate and its error."""

    class Refusing(_ViewDoubler):
        def init(self, processed, compile_specs):  # type: ignore[no-untyped-def]
            header = processed[:4]  # a view of the blob, alive in this frame
            raise ValueError(f"refused blob starting {bytes(header)!r}")

    with pytest.raises(DelegateError, match=r"raised ValueError: refused blob starting b'doub'"):
        _runtime_with(Refusing()).load_program(doubled_pte).load_method("forward")


def test_a_numpy_view_of_the_blob_kept_past_init_stays_valid_after_the_file_is_cut(
    doubled_pte: bytes, tmp_path: Path
) -> None:
    """A delegate keeping a numpy array over its memoryview blob (the view cannot be
    released): the runtime keeps the buffer, copied out of the file's mapping when the
    load ends, so the array still reads the blob after the file is cut to 0 bytes."""
    path = tmp_path / "doubled.pte"
    path.write_bytes(doubled_pte)
    assert run_isolated("numpy-view-of-blob", path) == {"same": True}

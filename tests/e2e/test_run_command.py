"""`writeback run`: the README's main command, end to end through real plugins (MLX delegate,
passes, pybind-runtime), checked against eager PyTorch computed here."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, final

import pytest
import torch
from click.testing import CliRunner
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from torch.export import ExportedProgram
from writeback.cli import main
from writeback.process_memory import return_freed_memory
from writeback.session import Session, assemble, lower_case
from writeback.zoo import CallerCacheDecoder, DecoderConfig, decoder_case
from writeback_core.registry import load_registry


def test_run_default_model_matches_eager_and_writes_the_pte(tmp_path: Path) -> None:
    pte = tmp_path / "out" / "decoder.pte"
    result = CliRunner().invoke(main, ["run", "--steps", "3", "--output", str(pte)])
    assert result.exit_code == 0, result.output
    assert "decoder-caller-cache" in result.output
    assert "backend mlx, runtime pybind" in result.output
    assert "whole-state copies left per call: none" in result.output
    for name in ("caches_0", "caches_1"):
        assert f"{name} (2.0 KiB): caller tensor, written in place by delegate 0 (mlx); no copy left" in result.output
    assert "all 3 steps match eager PyTorch" in result.output
    # The table has one row per step; its state write-back column shows no copy.
    rows = [line for line in result.output.splitlines() if line.startswith("│")]
    assert len(rows) == 3 and all("0 B" in row for row in rows)
    assert pte.read_bytes()[4:8] == b"ET12"  # an ExecuTorch flatbuffer program


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "place", "copies"),
    [
        # The MLX delegate takes the caches with it: they live inside it, written in place.
        ("mlx", "inside delegate 0 (mlx), written in place; no copy left", "none"),
        # No delegate: mutable buffers of the .pte, copied back whole every call (2 KiB each).
        ("none", "program buffer; whole-state copy left (2.0 KiB/call): no backend was chosen", "2 (4.0 KiB/call)"),
    ],
)
def test_run_says_where_each_cache_of_the_buffer_decoder_lives_and_what_copy_is_left(
    backend: str, place: str, copies: str
) -> None:
    result = CliRunner().invoke(main, ["run", "decoder", "--backend", backend, "--steps", "2"])
    assert result.exit_code == 0, result.output
    assert f"whole-state copies left per call: {copies}" in result.output
    for name in ("blocks.0.k_cache", "blocks.0.v_cache"):
        assert f"{name} (2.0 KiB): {place}" in result.output
    assert "written in place by the backend" not in result.output


def test_run_cache_is_updated_in_place_in_caller_memory_like_eager() -> None:
    """The pipeline API under `writeback run`: the caller's cache tensors are the ones the
    runtime writes, step after step, and they equal eager's caches."""
    cfg = DecoderConfig(max_seq=8, layers=2)
    case = decoder_case(cfg, caller_cache=True)
    pipeline = assemble(load_registry())
    lowered = lower_case(case, pipeline)
    assert lowered.write_back_bytes == {}
    assert {d.target for d in lowered.decisions.values() if d.accepted} == {f"caches_{i}" for i in range(4)}
    session = Session.open(pipeline, lowered)
    pointers = [t.data_ptr() for t in session.state]
    model = CallerCacheDecoder(cfg).eval()
    eager_caches = [torch.zeros(cfg.cache_shape) for _ in range(4)]
    for step in range(10):  # wraps around max_seq: slots are overwritten
        result = session.step(step)
        with torch.no_grad():
            expected = model(*case.step_inputs(step), *eager_caches)
        torch.testing.assert_close(result.outputs[0], expected, rtol=1e-4, atol=1e-5)
        for mine, theirs in zip(session.state, eager_caches, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        # Only the step's token and position (8 B each) are copied into MLX, never a cache.
        assert result.delegate_copied_bytes == 16
        assert result.copied_bytes == 16
    assert [t.data_ptr() for t in session.state] == pointers


MISMATCH = '''
import torch

class Drifts(torch.nn.Module):
    """Eager multiplies by a Python call counter; export bakes in the value it saw."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, state):
        self.calls += 1
        state.add_(x)
        return state * self.calls

def make():
    return Drifts(), (torch.ones(4), torch.zeros(4))
'''


def test_run_exits_non_zero_naming_the_first_step_that_differs_from_eager(tmp_path: Path) -> None:
    source = tmp_path / "drifts.py"
    source.write_text(MISMATCH)
    result = CliRunner().invoke(main, ["run", f"{source}:make", "--steps", "3"])
    assert result.exit_code == 1, result.output
    # Step 0 matches (both multiply by 1); from step 1 eager multiplies by 2, 3.
    assert "2 of 3 steps differ from eager PyTorch" in result.output
    assert "first at step 1: output 0 (4,) differs from eager by" in result.output


def test_run_unknown_backend_is_a_usage_error_listing_installed_backends() -> None:
    result = CliRunner().invoke(main, ["run", "--backend", "nope", "--steps", "1"])
    assert result.exit_code == 2
    assert "no backend named 'nope'" in result.output and "mlx" in result.output


def test_a_session_opened_from_the_written_file_loads_that_file(tmp_path: Path) -> None:
    """``Session.open(..., path=)`` (what `writeback run` does once the `.pte` is written) hands
    the runtime the file, not the bytes: the file's program runs as eager does, and a path with
    no file is an error naming it, nothing loaded."""
    from writeback_pybind_runtime import ProgramError

    cfg = DecoderConfig(max_seq=8, layers=1)
    case = decoder_case(cfg, caller_cache=True)
    pipeline = assemble(load_registry())
    lowered = lower_case(case, pipeline)
    pte = tmp_path / "decoder.pte"
    pte.write_bytes(lowered.pte)
    session = Session.open(pipeline, lowered, path=pte)
    model = CallerCacheDecoder(cfg).eval()
    eager_caches = [torch.zeros(cfg.cache_shape) for _ in range(2)]
    with torch.no_grad():
        expected = model(*case.step_inputs(0), *eager_caches)
    torch.testing.assert_close(session.step(0).outputs[0], expected, rtol=1e-4, atol=1e-5)
    missing = tmp_path / "missing.pte"
    with pytest.raises(ProgramError, match=f"cannot open program file '{missing}'"):
        Session.open(pipeline, lowered, path=missing)


def test_run_no_check_builds_no_eager_model_and_says_nothing_was_compared(tmp_path: Path) -> None:
    """`run --no-check`: the model is built once (for export), never a second time for an eager
    reference; the table and the last line say the steps were not compared."""
    import dataclasses

    from writeback.run import run_model

    case = decoder_case(DecoderConfig(max_seq=8, layers=1), caller_cache=True)
    builds: list[int] = []

    def build() -> torch.nn.Module:
        builds.append(1)
        return case.build()

    counted = dataclasses.replace(case, build=build)
    pipeline = assemble(load_registry(), "none")  # what is built does not depend on the backend
    report = run_model(pipeline, counted, 2, tmp_path / "a.pte", check=False)
    assert len(builds) == 1 and not report.checked and report.failures == []
    assert [check for _, check in report.steps] == [None, None]
    checked = run_model(pipeline, counted, 2, tmp_path / "b.pte")
    # Checked, the model is built once more: eager runs a copy of that build (--eager-weights auto).
    assert len(builds) == 2 and checked.checked and checked.failures == []

    result = CliRunner().invoke(main, ["run", "ema", "--backend", "none", "--no-check", "--steps", "2"])
    assert result.exit_code == 0, result.output
    assert "2 steps not compared with eager (--no-check)" in result.output
    assert "2 steps ran; not compared with eager PyTorch (--no-check): outputs and state are unchecked" in result.output
    assert "match eager" not in result.output


def test_run_model_releases_the_export_before_its_steps_and_still_reports_every_place(tmp_path: Path) -> None:
    """The steps run with the runtime's copy of the weights alone: the exported program is
    gone once the program is loaded (a weak reference dies), the report's places, copies and
    .pte size equal those of an independent lowering, and reading the released program says
    what happened."""
    import dataclasses
    import gc
    import weakref

    from writeback.model_build import export_case
    from writeback.run import run_model
    from writeback_core.lowered import ReleasedError, state_places

    case = decoder_case(DecoderConfig(max_seq=8, layers=1), caller_cache=False)
    seen: list[weakref.ref[torch.export.ExportedProgram]] = []

    def exported() -> torch.export.ExportedProgram:
        program = export_case(case)
        seen.append(weakref.ref(program))
        return program

    pipeline = assemble(load_registry(), "none")
    pte = tmp_path / "a.pte"
    report = run_model(pipeline, dataclasses.replace(case, exported=exported), 2, pte)
    gc.collect()
    assert len(seen) == 1 and seen[0]() is None
    assert report.checked and report.failures == [] and report.lowered.released
    independent = lower_case(case, pipeline)
    assert report.lowered.pte_nbytes == pte.stat().st_size == len(independent.pte)
    assert state_places(report.lowered) == state_places(independent)
    assert report.lowered.copies_left == independent.copies_left and independent.copies_left
    for read in (lambda: report.lowered.pte[:4], lambda: report.lowered.program.exported_program()):
        with pytest.raises(ReleasedError, match=r"released once its \.pte was written and loaded .*lower again"):
            read()


def test_write_pte_streams_exirs_bytes_without_joining_them_and_refuses_once_released(tmp_path: Path) -> None:
    """``Lowered.write_pte`` writes exir's serialized program to the file byte for byte (the
    same bytes as exir's own ``ExecutorchProgramManager.buffer``) without first joining them
    into ``Lowered.pte``; after a read of ``pte`` it writes those bytes; a released lowering
    refuses to write and leaves the existing file as it was."""
    from writeback_core.lowered import ReleasedError

    case = decoder_case(DecoderConfig(max_seq=8, layers=1), caller_cache=False)
    lowered = lower_case(case, assemble(load_registry(), "none"))
    streamed = tmp_path / "streamed.pte"
    lowered.write_pte(streamed)
    assert lowered._pte is None  # nothing joined
    assert lowered.pte_nbytes == streamed.stat().st_size
    assert streamed.read_bytes() == bytes(lowered.program.buffer)
    joined = tmp_path / "joined.pte"
    assert lowered.pte[:8] == streamed.read_bytes()[:8]
    lowered.write_pte(joined)
    assert joined.read_bytes() == streamed.read_bytes()
    lowered.release()
    with pytest.raises(ReleasedError, match=r"\.pte bytes was released"):
        lowered.write_pte(streamed)
    assert streamed.read_bytes() == joined.read_bytes()


def test_release_frees_every_xnnpack_delegate_and_its_weights_no_cache_keeps_them(tmp_path: Path) -> None:
    """After ``Lowered.release`` and the housekeeping ``writeback run`` asks for next
    (``writeback.process_memory.return_freed_memory``) nothing in the process keeps the
    lowering's XNNPACK delegates
    (each ``LoweredBackendModule`` holds a ``submodule_program`` with the weights it took):
    torch's fake-tensor dispatch cache, exir's ``is_same_node`` cache and the partitioners'
    module-level ``WhyNoPartition`` reporters held them for the life of the process, which
    kept 1.95 GB of a 0.5B decoder's weights beside the runtime's copy in ``writeback run``."""
    import gc
    import weakref

    from executorch.exir.lowered_backend_module import LoweredBackendModule

    case = decoder_case(DecoderConfig(max_seq=8, layers=1), caller_cache=False)
    lowered = lower_case(case, assemble(load_registry(), "xnnpack"))
    lowered.write_pte(tmp_path / "model.pte")
    module = lowered.program.exported_program().graph_module
    delegates = [weakref.ref(m) for m in module.modules() if isinstance(m, LoweredBackendModule)]
    assert delegates, "the decoder lowers to XNNPACK delegates"
    del module
    lowered.release()
    return_freed_memory()
    gc.collect()
    alive = [ref() for ref in delegates if ref() is not None]
    assert not alive, f"{len(alive)} of {len(delegates)} XNNPACK delegates outlive Lowered.release"


@final
class WritebackTestRecordingBackend(BackendDetails):  # type: ignore[misc]  # executorch is untyped: its bases are Any
    """exir side of a test delegate: ``preprocess`` records the program it is handed (its
    graph module and the storage of each weight) and returns a fixed blob."""

    handed: ClassVar[list[tuple[torch.fx.GraphModule, dict[str, int]]]] = []

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        storages = {name: t.untyped_storage().data_ptr() for name, t in edge_program.state_dict.items()}
        WritebackTestRecordingBackend.handed.append((edge_program.graph_module, storages))
        return PreprocessResult(processed_bytes=b"recorded")


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _TakeEverything(Partitioner):  # type: ignore[misc]  # executorch is untyped: its bases are Any
    """One partition for the recording backend: every operator and every weight."""

    def __init__(self) -> None:
        super().__init__()
        self.delegation = DelegationSpec(WritebackTestRecordingBackend.__name__, [])

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        weights = exported_program.graph_signature.inputs_to_parameters
        for node in exported_program.graph_module.graph.nodes:
            if node.op == "call_function" or node.name in weights:
                node.meta["delegation_tag"] = "recording_0"
        return PartitionResult(
            tagged_exported_program=exported_program, partition_tags={"recording_0": self.delegation}
        )


def test_a_delegates_preprocess_shares_its_partitions_weights_instead_of_a_copy() -> None:
    """exir copies every partition before the first ``preprocess`` runs; writeback's lowering
    hands the backend a copy whose graph is its own and whose weights are the partition's
    (exir's default copy clones them: on a 0.5B decoder lowered to XNNPACK, 1.97 GB beside
    the serialized weights, which set ``writeback run``'s peak). Outside the lowering, exir's
    own copy is back."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules
    from writeback_core.exporting import export_model
    from writeback_core.lowering import partition
    from writeback_core.types import BackendSpec

    program = export_model(_Mlp(), (torch.randn(2, 8),), name="mlp")
    spec = BackendSpec("recording", WritebackTestRecordingBackend.__name__, lambda registry, **_: _TakeEverything())
    WritebackTestRecordingBackend.handed.clear()
    edge = partition(program, load_registry(), spec).edge
    ((_, lowered_module, _),) = get_lowered_submodules(edge.exported_program().graph_module)
    taken = lowered_module.original_module  # the partition exir copied for preprocess
    ((graph, storages),) = WritebackTestRecordingBackend.handed
    assert graph is not taken.graph_module
    assert sorted(storages) == ["down.bias", "down.weight", "up.bias", "up.weight"]
    assert storages == {name: t.untyped_storage().data_ptr() for name, t in taken.state_dict.items()}
    copied = WritebackTestRecordingBackend.copy_exported_program_for_preprocess(taken, [])
    assert all(copied.state_dict[n].data_ptr() != t.data_ptr() for n, t in taken.state_dict.items())

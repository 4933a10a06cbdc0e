"""A program loaded from a file whose constant segment is small (under the 8 MiB from
which it is mapped: ``test_mapped_constants``) owns every byte a loaded method uses: what
happens to the file after a method is loaded does not reach the method, and a file changed
before or while a method loads is an error naming it, never a crash or a wrong
answer (the delegate data a method load maps from the file included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from writeback_pybind_runtime import ProgramError, Runtime

from tests.pybind_runtime.conftest import Lower
from tests.pybind_runtime.doubler import DoublerPartitioner
from tests.pybind_runtime.isolated_worker import StatefulMLP, run_isolated


def _ptes(mlp_pte_bytes: dict[str, bytes], tmp_path: Path) -> list[Path]:
    """The MLP with planned and unplanned inputs, and lowered to XNNPACK (its
    weights in a delegate blob read at ``load_method``), each in this test's own file
    (the session's lowering, see conftest's ``mlp_pte_bytes``)."""
    paths = []
    for name in ("planned", "unplanned", "xnnpack"):
        path = tmp_path / f"mlp_{name}.pte"
        path.write_bytes(mlp_pte_bytes[name])
        paths.append(path)
    return paths


def test_truncated_pte_after_load_method_still_runs_correctly(mlp_pte_bytes: dict[str, bytes], tmp_path: Path) -> None:
    """Truncated to 0 bytes after the method loaded, then rewritten with other bytes:
    the method runs and matches eager (a mapped file dies of SIGBUS)."""
    result = run_isolated("truncate", *_ptes(mlp_pte_bytes, tmp_path))
    assert result["matched"] == [[True, True]] * 3, result


def test_file_changed_before_load_method_is_an_error_not_a_crash(
    mlp_pte_bytes: dict[str, bytes], tmp_path: Path
) -> None:
    """Cut in half, cut to 0 bytes, rewritten in place, or rewritten in place at the
    same size with its modification time set back to the nanosecond, between
    ``load_program`` and ``load_method``: the XNNPACK program's method refuses to
    load, naming the file and the change and what to do. The portable programs hold
    every byte they need from ``load_program`` on (their constants are read then),
    so they load."""
    paths = _ptes(mlp_pte_bytes, tmp_path)
    errors = run_isolated("truncate-before-method", *paths)["errors"]
    assert errors[:8] == [None] * 8, errors
    size = str(paths[2].stat().st_size)
    changes = (
        f"{size} bytes then, {int(size) // 2} now",
        f"{size} bytes then, 0 now",
        f"{size} bytes then and now, written since",
        f"{size} bytes then and now, written since",
    )
    for error, change in zip(errors[8:], changes, strict=True):
        assert error is not None, errors
        assert error.startswith("ProgramError: cannot load method 'forward'"), error
        assert f"'{paths[2]}': the file changed since load_program ({change})" in error
        assert "load it again" in error


def test_bytes_a_program_was_loaded_from_can_change_after_load(
    mlp_pte_bytes: dict[str, bytes], runtime: Runtime
) -> None:
    data = bytearray(mlp_pte_bytes["planned"])
    program = runtime.load_program(data)
    data[:] = b"\0" * len(data)
    x = torch.ones(16, 64)
    with torch.no_grad():
        expected = StatefulMLP()(x, torch.zeros(16, 64))
    torch.testing.assert_close(program.load_method("forward")([x, torch.zeros(16, 64)])[1], expected)


def test_cut_file_is_refused_at_load_program_naming_both_sizes(
    mlp_pte_bytes: dict[str, bytes], runtime: Runtime, tmp_path: Path
) -> None:
    """A file shorter than the program its header declares fails at ``load_program``."""
    data = mlp_pte_bytes["xnnpack"]
    declared = int.from_bytes(data[16:24], "little")
    path = tmp_path / "cut.pte"
    path.write_bytes(data[: declared - 1])
    expected = rf"header says the program is {declared} bytes, but the file has {declared - 1}"
    with pytest.raises(ProgramError, match=expected):
        runtime.load_program(path)


def test_file_cut_while_a_method_loads_is_a_clear_error_not_a_crash(
    mlp_pte_bytes: dict[str, bytes], tmp_path: Path
) -> None:
    """While a method loads, the runtime maps the delegate data it asks for; the file
    cut (to half, then to 0 bytes) after the mapping and before the bytes are read
    faults (SIGBUS) on the read: the load fails naming the file and the change, and
    the process lives on."""
    path = _ptes(mlp_pte_bytes, tmp_path)[2]
    size = path.stat().st_size
    errors = run_isolated("cut-while-mapped", path)["errors"]
    assert len(errors) == 2, errors
    for error, now in zip(errors, (size // 2, 0), strict=True):
        assert error is not None, errors
        assert f"'{path}': the file changed since load_program ({size} bytes then, {now} now)" in error
        assert "load it again" in error


def test_delegate_data_kept_past_the_load_no_longer_reads_a_cut_file_changes_nothing(
    mlp_pte_bytes: dict[str, bytes], tmp_path: Path
) -> None:
    """Delegate data still held when the load ends is copied into the runtime's memory at
    the same address: the file cut to 0 bytes and rewritten afterwards changes nothing
    of it (a mapping would die of SIGBUS, or read the new bytes)."""
    path = _ptes(mlp_pte_bytes, tmp_path)[2]
    assert run_isolated("cut-after-kept", path)["same"] == [True]


def test_sigbus_sent_while_a_method_loads_reaches_the_handler_installed_before_no_crash(
    lower: Lower, tmp_path: Path
) -> None:
    """The runtime's SIGBUS handler, installed while a method loads, passes a SIGBUS that
    is not a fault in its mappings to the handler it found (here Python's), and puts
    that one back once the load ends."""

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + x

    path = tmp_path / "doubler.pte"
    path.write_bytes(lower(Double(), (torch.randn(2, 3),), partitioners=[DoublerPartitioner()]))
    assert run_isolated("sigbus-sent-while-loading", path) == {"received": 1, "kept": True, "doubled": True}

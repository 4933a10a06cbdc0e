"""A program whose constant segment is large (a decoder's embedding table, read by
portable kernels at every call) maps it from its file for the program's life instead of
reading it into memory at ``load_program``, as stock's mmap loader does. The file is the
program's data from then on: a file changed between calls refuses the next call and
changes nothing; a file cut while a call runs is an error naming it, never a crash, and
the method refuses every later call. Small constant segments are still read whole (what
``test_program_owns_its_bytes`` pins)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.pybind_runtime.conftest import Lower
from tests.pybind_runtime.doubler import DoublerPartitioner
from tests.pybind_runtime.isolated_worker import TABLE_EXAMPLE, TableLookup, TableOutput, run_isolated


def _table_pte(lower: Lower, tmp_path: Path) -> Path:
    path = tmp_path / "table.pte"
    path.write_bytes(lower(TableLookup(), TABLE_EXAMPLE, partitioners=[DoublerPartitioner()]))
    assert path.stat().st_size > TableLookup.ROWS * TableLookup.WIDTH * 4, "the table is in the file"
    return path


def test_large_constants_are_mapped_and_a_file_changed_between_calls_refuses_the_next_call_changes_nothing(
    lower: Lower, tmp_path: Path
) -> None:
    """The 12 MiB table is mapped from the file at ``load_program``; a call matches eager;
    the file cut to half its size, the next call is refused naming the file and both
    sizes, and neither the state input nor the earlier output changed."""
    path = _table_pte(lower, tmp_path)
    size = path.stat().st_size
    result = run_isolated("mapped-constants", path)
    assert result["mapped"] is True, result
    assert result["matched"] is True, result
    error = result["error"]
    assert error is not None, result
    assert error.startswith("ProgramError: method 'forward' refused this call, which changed nothing"), error
    assert f"'{path}': the file changed since load_program ({size} bytes then, {size // 2} now)" in error
    assert "load it again" in error
    assert result["unchanged"] is True, result


def test_file_cut_while_a_call_reads_mapped_constants_is_a_clear_error_not_a_crash(
    lower: Lower, tmp_path: Path
) -> None:
    """The doubler delegate cuts the file to 0 bytes in the middle of the call, before the
    portable kernels read the mapped table (a SIGBUS without the runtime's guard): the
    call ends in an error naming the file and the change and saying the outputs and state
    are not to be used; the process lives, and the next call is refused."""
    path = _table_pte(lower, tmp_path)
    size = path.stat().st_size
    first, second = run_isolated("cut-while-running", path)["errors"]
    assert first is not None and second is not None, (first, second)
    assert first.startswith("ProgramError: method 'forward' ran while its program's file changed"), first
    assert f"'{path}': the file changed since load_program ({size} bytes then, 0 now)" in first
    assert "the state it wrote are not to be used" in first and "load the program again" in first
    assert second.startswith("ProgramError: method 'forward' refused this call: its program's file changed"), second


def test_an_uncloned_output_that_is_a_mapped_constant_is_a_copy_a_later_cut_cannot_crash_its_reader(
    lower: Lower, tmp_path: Path
) -> None:
    """An output that is the mapped table itself, returned with ``clone_outputs=False``, is
    copied out of the mapping: Python reads it outside the runtime's SIGBUS guard, so a
    view of the file would kill the process once the file is cut. After the cut it still
    equals the table."""
    path = tmp_path / "table_output.pte"
    path.write_bytes(lower(TableOutput(), (torch.zeros(2),)))
    assert run_isolated("constant-output", path) == {"before": True, "after": True}

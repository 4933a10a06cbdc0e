"""A loaded program owns its bytes: what happens to its file afterwards does not reach it."""

from __future__ import annotations

from pathlib import Path

import torch
from writeback_pybind_runtime import Runtime

from tests.pybind_runtime.conftest import Lower
from tests.pybind_runtime.isolated_worker import EXAMPLE, StatefulMLP, run_isolated


def test_truncated_pte_after_load_still_runs_correctly(lower: Lower, tmp_path: Path) -> None:
    """Truncated to 0 bytes after load, then rewritten with other bytes: the method
    still loads and runs, and matches eager (a mapped file dies of SIGBUS)."""
    paths = []
    for planned in (True, False):
        path = tmp_path / f"mlp_{planned}.pte"
        path.write_bytes(lower(StatefulMLP(), EXAMPLE, planned_inputs=planned, planned_outputs=planned))
        paths.append(path)
    result = run_isolated("truncate", *paths)
    assert result["matched"] == [[True, True], [True, True]], result


def test_bytes_a_program_was_loaded_from_can_change_after_load(lower: Lower, runtime: Runtime) -> None:
    data = bytearray(lower(StatefulMLP(), EXAMPLE))
    program = runtime.load_program(data)
    data[:] = b"\0" * len(data)
    x = torch.ones(16, 64)
    with torch.no_grad():
        expected = StatefulMLP()(x, torch.zeros(16, 64))
    torch.testing.assert_close(program.load_method("forward")([x, torch.zeros(16, 64)])[1], expected)

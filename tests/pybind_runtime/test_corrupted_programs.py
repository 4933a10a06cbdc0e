"""Robustness: 500 truncated or byte-flipped ``.pte`` files each fail cleanly, none crashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.pybind_runtime.conftest import Lower


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(4) * 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.weight + y, torch.relu(x - y)


def test_500_corrupted_pte_files_error_without_crash(lower: Lower, tmp_path: Path) -> None:
    pte = tmp_path / "small.pte"
    pte.write_bytes(lower(Small(), (torch.ones(4, 4), torch.ones(4, 4)), planned_outputs=False))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-m", "pybind_runtime.corrupt_worker", str(pte), "1234", "500"],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"worker crashed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    truncated, flipped = counts["truncated"], counts["flipped"]
    assert sum(truncated.values()) + sum(flipped.values()) == 500
    # Every truncation is an error: a cut program cannot verify.
    assert set(truncated) <= {"ProgramError"}, truncated
    # A flip may land in constant data or padding and still load; it must never crash,
    # and most flips in a small program are caught.
    assert set(flipped) <= {"ProgramError", "ValueError", "RuntimeError", "ran"}, flipped
    assert flipped.get("ran", 0) < sum(flipped.values())

"""writeback's runtime runs an XNNPACK program in a fresh interpreter that never imports
executorch's own bindings (``executorch.runtime``): the XNNPACK backend's library is loaded
with the runtime's, so the program is not refused as using an unregistered backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

from tests.pybind_runtime.conftest import Lower

CHILD = """
import json, sys, torch
from writeback_core.registry import load_registry
from writeback_pybind_runtime import Runtime
method = Runtime(load_registry(entry_points=False)).load_program(sys.argv[1]).load_method("forward")
out = method([torch.arange(8, dtype=torch.float32).reshape(2, 4) / 8])[0]
bindings = [m for m in ("executorch.runtime", "executorch.extension.pybindings.portable_lib") if m in sys.modules]
print(json.dumps({"out": out.tolist(), "bindings": bindings}))
"""


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x).relu()
        return out


def test_an_xnnpack_program_runs_as_eager_without_executorchs_bindings_imported(lower: Lower, tmp_path: Path) -> None:
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 8
    pte = tmp_path / "linear.pte"
    pte.write_bytes(lower(Linear(), (x,), partitioners=[XnnpackPartitioner()]))
    done = subprocess.run([sys.executable, "-c", CHILD, str(pte)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bindings"] == []
    with torch.no_grad():
        expected = Linear()(x)
    torch.testing.assert_close(torch.tensor(result["out"]), expected, rtol=1e-5, atol=1e-6)

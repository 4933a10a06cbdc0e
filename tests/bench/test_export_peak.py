"""`writeback export --quantize 8da4w-e8` of bench-scale's default Llama folder (8 layers, hidden
512, vocab 32,000: 221 MiB of fp32 weights) with XNNPACK peaks at most 1.75x the fp32 weights
above the process's resident memory once its toolchain is imported (1.49x measured; 2.52x
before). Issue 54 asks the 0.5B export to peak at 1.5x its weights in all (measured: 1.15x);
here the imported toolchain alone is 3.6x the weights, so the bound is on what the export adds.
Measured in a child process from the kernel's high-water mark (``VmHWM``). What keeps it there:
the fp32 weights' file pages given back as each is quantized, the LM head and the 8-bit lookup
computed a slice at a time in eager (the state check before export runs eager twice), and freed
temporaries handed back to the system.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from writeback_bench.llama_scale import LlamaShape, llama_folder

from tests.bench.test_run_peak import CHILD

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status"),
]


def test_quantized_export_of_the_8_layer_folder_adds_at_most_1_75x_its_fp32_weights_at_peak(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    weights = llama_folder(folder, LlamaShape())
    output = tmp_path / "model.pte"
    command = ["export", str(folder), "--backend", "xnnpack", "--quantize", "8da4w-e8", "--output", str(output)]
    done = subprocess.run([sys.executable, "-c", CHILD, *command], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert output.stat().st_size > 0
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    ratio = (figures["peak"] - figures["base"]) / weights
    assert ratio <= 1.75, (
        f"peak {figures['peak'] / 2**20:.1f} MiB, base {figures['base'] / 2**20:.1f} MiB: {ratio:.2f}x"
    )

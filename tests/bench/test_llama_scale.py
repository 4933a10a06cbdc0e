"""`writeback bench-scale` at a mid size (a 4-layer Llama, hidden 256, vocab 32,000: 78 MB of
fp32 weights), stock ExecuTorch + XNNPACK beside writeback + XNNPACK, every phase in a process
of its own. Times are printed, never asserted; memory is deterministic enough to bound:

- writeback's lowering peaks no higher than stock's lowering of the same program (+10%; each
  lower phase alone, 4 runs: 0.29-0.30 GB above the child's baseline, stock's alike), both
  streaming the `.pte` to its file;
- once the method is loaded, writeback's runtime holds no more than the `.pte` (+10%): the
  delegate's blob is read from the file and freed once XNNPACK has packed it;
- loading and decoding peak no higher than stock's (+15%), and below 6x the weights above a
  bare child's baseline (the decode steps' greedy tokens come from the program's logits: no
  eager model is built beside it);
- with ``--quantize 8da4w`` the same bounds hold and the .pte keeps about a sixth of the linear
  layers' fp32 bytes.
"""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from writeback.cli import main

pytestmark = pytest.mark.slow

SHAPE = ["--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--intermediate", "768"]


# fp32 bytes of that shape's linear layers: 4 x (q, o 256x256; k, v 256x128; gate, up, down
# 256x768) and the 32,000 x 256 output layer; the embedding (32.8 MB) stays fp32.
LINEAR_GB = (4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768) + 32000 * 256) * 4 / 1e9


@pytest.mark.parametrize("quantize", [[], ["--quantize", "8da4w"]], ids=["fp32", "8da4w"])
def test_bench_scale_bounds_writeback_memory_by_stock_and_the_weights(quantize: list[str]) -> None:
    command = ["bench-scale", *SHAPE, "--vocab", "32000", "--positions", "512", "--steps", "4", *quantize]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "0.078 GB of fp32 weights" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("stock+", "writeback+"))}
    assert set(rows) == {"stock+xnnpack", "stock+xnnpack:", "writeback+xnnpack", "writeback+xnnpack:"}, out
    assert any(line.split()[:3] == ["contender", "export", "s"] for line in out.splitlines()), out
    stock, ours = (float(rows[name][2]) for name in ("stock+xnnpack", "writeback+xnnpack"))  # lower peak GB
    peaks = {}
    for line in out.splitlines():
        found = re.match(
            r"(\S+): peaks above a bare child's ([\d.]+) GB, in weights \(([\d.]+) GB\): lowering ([\d.]+)x, "
            r"run ([\d.]+)x; after load ([\d.]+)x the \.pte",
            line,
        )
        if found:
            peaks[found[1]] = [float(v) for v in found.groups()[1:]]
    base, weights, _, run, after_load = peaks["writeback+xnnpack"]
    stock_base, _, _, stock_run, _ = peaks["stock+xnnpack"]
    assert ours - base <= 1.1 * (stock - stock_base), out
    assert after_load <= 1.1, out
    # At 78 MB a runtime's fixed costs weigh: 2.1x to 4.4x from one run to another on one machine,
    # stock's alike (1.2x at 2.5 GB of weights). Stock's is the bound that holds.
    assert run <= 1.15 * stock_run and run <= 6.0, out
    assert weights == pytest.approx(0.078, abs=0.001)
    pte = float(rows["writeback+xnnpack"][3])
    if quantize:
        assert "weights quantized 8da4w before export" in out
        assert pte < weights - 0.7 * LINEAR_GB, out
    else:
        assert pte >= weights, out  # every weight, fp32

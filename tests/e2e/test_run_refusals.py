"""`writeback run` on a step the runtime refuses: when eager PyTorch refuses the same inputs the
run stops with exit 2 and eager's own message (state, index, size), and the caller's state is
checked unchanged; no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from writeback.cli import main

MODEL = """
import torch
from writeback_core.types import ModelCase


class Cache(torch.nn.Module):
    def forward(self, v, pos, cache):
        cache.index_copy_(2, pos, v)
        return (cache * 2).sum(-1)


def case():
    positions = [3, {bad}]
    return ModelCase(
        name="cache",
        description="a caller-owned cache written at a position",
        build=Cache,
        step_inputs=lambda step: (torch.ones(1, 2, 1, 4) * (step + 1), torch.tensor([positions[step]])),
        make_state=lambda: (torch.zeros(1, 2, 16, 4),),
    )
"""


@pytest.mark.parametrize("bad", [-1, 16])
def test_a_step_eager_refuses_exits_2_with_eagers_message_and_nothing_written(tmp_path: Path, bad: int) -> None:
    (tmp_path / "cache.py").write_text(MODEL.replace("{bad}", str(bad)))
    result = CliRunner().invoke(main, ["run", f"{tmp_path / 'cache.py'}:case", "--backend", "portable", "--steps", "2"])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "step 1: the program refused the call" in result.output
    assert f"index {bad} is out of bounds for dimension 2 with size 16" in result.output
    assert "States written at a run-time index: cache (index_copy along dim 2 of size 16)." in result.output
    assert "Nothing was written: every caller-owned state is as before the call." in result.output

"""`writeback run` lists, for its backend, the program passes that ran and why: MLX runs none of
the passes that write state and check indices for the stock runtime's kernels, nor the LLM
runner's attention; xnnpack and portable run every pass."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from writeback.cli import main

from tests.passes.lowering import MLX_PASSES, PASSES_IN_ORDER

# The passes for the stock runtime's kernels alone (the LLM runner's attention, in-place state
# writes by index_put_ and by the kernel computing a whole state, indices and the runner's inputs
# checked first), and the attention rewrites MLX shares.
STOCK_ONLY = (
    "runner_attention",
    "reinplace_state_writes",
    "check_indices_first",
    "check_runner_inputs",
    "whole_state_writes",
)
ATTENTION_REWRITES = ("bound_attention", "scale_smaller_operand")


def _passes_run(output: str, backend: str) -> dict[str, str]:
    """The pass lines under ``program passes run for backend B``: name -> why."""
    lines = output.splitlines()
    start = lines.index(f"program passes run for backend {backend}, with the backends each serves and why:")
    found = {}
    for line in lines[start + 1 :]:
        if line.startswith("   ") and found:  # a reason wrapped under its pass
            found[list(found)[-1]] += " " + line.strip()
            continue
        if not line.startswith("  "):
            break
        name, why = line.strip().split(maxsplit=1)
        found[name] = why
    return found


@pytest.mark.parametrize("backend", ["mlx", "xnnpack", "portable"])
def test_run_lists_the_passes_its_backend_runs_with_why_and_still_matches_eager(backend: str) -> None:
    result = CliRunner().invoke(main, ["run", "--backend", backend, "--steps", "2"])
    assert result.exit_code == 0, result.output
    assert "all 2 steps match eager PyTorch" in result.output
    ran = _passes_run(result.output, backend)
    assert list(ran) == list(MLX_PASSES if backend == "mlx" else PASSES_IN_ORDER)
    for name, why in ran.items():
        if name in STOCK_ONLY:
            assert why.startswith("none, portable, xnnpack: ")
        elif name in ATTENTION_REWRITES:
            assert why.startswith("mlx, none, portable, xnnpack: ")
        else:
            assert why.startswith("every backend: ")
    if backend == "mlx":
        summary = result.output.split("writeback run decoder-caller-cache")[0]
        assert not any(name in summary for name in STOCK_ONLY)

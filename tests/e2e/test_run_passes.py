"""`writeback run` lists, for its backend, the program passes that ran and why: MLX runs none of
the passes that rewrite a program for the stock runtime's kernels; xnnpack and portable run them."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from writeback.cli import main

from tests.passes.lowering import DELEGATE_PASSES, PASSES_IN_ORDER

# The passes that rewrite a program for the stock runtime's kernels.
STOCK_RUNTIME_PASSES = tuple(name for name in PASSES_IN_ORDER if name not in DELEGATE_PASSES)
assert STOCK_RUNTIME_PASSES == (
    "runner_attention",
    "bound_attention",
    "scale_smaller_operand",
    "reinplace_state_writes",
    "check_indices_first",
)


def _passes_run(output: str, backend: str) -> dict[str, str]:
    """The pass lines under ``program passes run for backend B``: name -> why."""
    lines = output.splitlines()
    start = lines.index(f"program passes run for backend {backend}, with the backends each serves and why:")
    found = {}
    for line in lines[start + 1 :]:
        if not line.startswith("  ") or line.startswith("   "):
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
    expected = DELEGATE_PASSES if backend == "mlx" else (*STOCK_RUNTIME_PASSES, *DELEGATE_PASSES)
    assert sorted(ran) == sorted(expected)
    for name in DELEGATE_PASSES:
        assert ran[name].startswith("every backend: ")
    for name in set(ran) & set(STOCK_RUNTIME_PASSES):
        assert ran[name].startswith("none, portable, xnnpack: ")
    if backend == "mlx":
        summary = result.output.split("writeback run decoder-caller-cache")[0]
        assert not any(name in summary for name in STOCK_RUNTIME_PASSES)

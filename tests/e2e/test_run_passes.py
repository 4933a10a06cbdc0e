"""`writeback run` lists, for its backend, the program passes that ran and why: MLX runs none of
the passes for the stock runtime's kernels (the LLM runner's attention, attention bounded and
scaled for those kernels, state written in place, indices checked first): its delegate does
each itself; xnnpack and portable run every pass."""

from __future__ import annotations

import functools

import pytest
from click.testing import CliRunner
from writeback.cli import main

from tests.passes.lowering import MLX_PASSES, PASSES_IN_ORDER

# The passes for the stock runtime's kernels alone (the LLM runner's attention, attention bounded
# to the keys its mask opens and scaled on its smaller operand, in-place state writes by
# index_put_ and by the kernel computing a whole state, indices and the runner's inputs checked
# first): worked out by hand from what each pass is for.
STOCK_ONLY = (
    "runner_attention",
    "bound_attention",
    "scale_smaller_operand",
    "reinplace_state_writes",
    "check_indices_first",
    "check_runner_inputs",
    "whole_state_writes",
)
# The five issue 53 names: MLX's lowering must list none of them among the passes run.
NOT_FOR_MLX = (
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
        if line.startswith("   ") and found:  # a reason wrapped under its pass
            found[list(found)[-1]] += " " + line.strip()
            continue
        if not line.startswith("  "):
            break
        name, why = line.strip().split(maxsplit=1)
        found[name] = why
    return found


@functools.cache
def _run_output(backend: str) -> str:
    """What ``writeback run --backend B --steps 2`` (the tiny built-in model) prints; one run
    per backend for the tests below."""
    result = CliRunner().invoke(main, ["run", "--backend", backend, "--steps", "2"])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("backend", ["mlx", "xnnpack", "portable"])
def test_run_lists_the_passes_its_backend_runs_with_why_and_still_matches_eager(backend: str) -> None:
    output = _run_output(backend)
    assert "all 2 steps match eager PyTorch" in output
    ran = _passes_run(output, backend)
    assert list(ran) == list(MLX_PASSES if backend == "mlx" else PASSES_IN_ORDER)
    for name, why in ran.items():
        if name in STOCK_ONLY:
            assert why.startswith("none, portable, xnnpack: ")
        else:
            assert why.startswith("every backend: ")
    if backend == "mlx":
        summary = output.split("writeback run decoder-caller-cache")[0]
        assert not any(name in summary for name in STOCK_ONLY)


def test_run_on_mlx_lists_none_of_the_stock_runtime_passes_while_xnnpack_and_portable_list_each() -> None:
    """Issue 53's check, by name: ``run --backend mlx`` runs none of the five passes for the
    stock runtime's kernels (its delegate bounds and scales attention, writes state and checks
    indices itself), and each stock pass still runs for xnnpack and for portable."""
    mlx_ran = _passes_run(_run_output("mlx"), "mlx")
    assert mlx_ran, "run printed no pass for mlx"
    assert [name for name in NOT_FOR_MLX if name in mlx_ran] == []
    for backend in ("xnnpack", "portable"):
        ran = _passes_run(_run_output(backend), backend)
        assert [name for name in STOCK_ONLY if name not in ran] == [], backend

"""`writeback run` checks the program against the very weights exported, even when the
factory initialises them randomly (unseeded, as a tutorial's toy model does)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from writeback.cli import main
from writeback.eager_weights import ExportedWeights, WeightsDiffer
from writeback.model_build import export_case
from writeback_core.registry import load_registry
from writeback_core.types import ModelCase

# A toy with a running state and weights nn.Linear draws at random on every build, unseeded;
# the factory returns a ModelCase whose build() makes a new module each time.
UNSEEDED = """
import torch
from writeback_core.types import ModelCase


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.total.add_(self.proj(x))
        return self.total * 2


def make():
    return ModelCase("toy", "an unseeded toy", Toy, lambda step: (torch.ones(4) * (step + 1),))
"""


def _backends() -> list[str]:
    """Every backend `run --backend` takes here: each one registered, and none."""
    return [*sorted(load_registry().backends()), "none"]


@pytest.mark.parametrize("backend", _backends())
def test_unseeded_random_weights_match_eager_on_every_backend_no_silent_wrong_answer(
    tmp_path: Path, backend: str
) -> None:
    source = tmp_path / "toy.py"
    source.write_text(UNSEEDED)
    result = CliRunner().invoke(main, ["run", f"{source}:make", "--backend", backend, "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "all 3 steps match eager PyTorch" in result.output


def test_rebuild_with_unseeded_weights_is_refused_naming_the_first_tensor_clear_error(tmp_path: Path) -> None:
    source = tmp_path / "toy.py"
    source.write_text(UNSEEDED)
    args = ["run", f"{source}:make", "--backend", "none", "--steps", "2", "--eager-weights", "rebuild"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "building it again for eager PyTorch gave other weights than the build that was exported" in message
    assert "parameter 'proj.weight' was exported with shape [4, 4], torch.float32, first element" in message
    assert "--eager-weights copy" in message
    assert "Traceback" not in result.output and "steps differ" not in result.output


def test_rebuild_of_a_seeded_factory_passes(tmp_path: Path) -> None:
    source = tmp_path / "toy.py"
    init = "        super().__init__()\n"
    seeded = UNSEEDED.replace(init, init + "        torch.manual_seed(7)\n")
    source.write_text(seeded)
    args = ["run", f"{source}:make", "--backend", "none", "--steps", "2", "--eager-weights", "rebuild"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "all 2 steps match eager PyTorch" in result.output


def _toy_case(first: float, second: float) -> tuple[ModelCase, list[int]]:
    """A case whose first build has weight ``first`` everywhere, every later one ``second``."""
    builds: list[int] = []

    def build() -> torch.nn.Module:
        module = torch.nn.Linear(2, 2, bias=False)
        torch.nn.init.constant_(module.weight, first if not builds else second)
        builds.append(1)
        return module

    return ModelCase("toy", "a linear layer", build, lambda step: (torch.ones(1, 2),)), builds


def test_copy_builds_once_and_eager_gets_the_exported_weights() -> None:
    case, builds = _toy_case(0.5, 3.0)
    weights = ExportedWeights(case, "copy")
    program = export_case(weights.case)
    weights.record(program)
    eager = weights.eager_module()
    assert len(builds) == 1
    assert torch.equal(eager.weight, torch.full((2, 2), 0.5))
    assert eager is not program.module()


def test_rebuild_names_the_tensor_and_both_first_elements_clear_error() -> None:
    case, builds = _toy_case(0.5, 3.0)
    weights = ExportedWeights(case, "rebuild")
    weights.record(export_case(weights.case))
    with pytest.raises(WeightsDiffer) as refused:
        weights.eager_module()
    assert len(builds) == 2
    assert (
        "parameter 'weight' was exported with shape [2, 2], torch.float32, first element 0.5 and is now "
        "shape [2, 2], torch.float32, first element 3" in str(refused.value)
    )


def test_auto_keeps_a_copy_when_it_fits_in_memory() -> None:
    case, builds = _toy_case(0.5, 3.0)
    weights = ExportedWeights(case)
    weights.record(export_case(weights.case))
    assert weights.chosen == "copy" and torch.equal(weights.eager_module().weight, torch.full((2, 2), 0.5))
    assert len(builds) == 1


class _Unseeded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(self.proj(x))
        return self.total * 2


def test_bench_of_a_factory_whose_builds_differ_is_refused_naming_the_tensor_no_silent_wrong_answer() -> None:
    """The model bench builds per row (one model's weights alive at a time); a build whose weights
    are not the first build's would time and compare another model, so it is refused."""
    from writeback_bench.model_steps import run_model_bench

    case = ModelCase("toy", "an unseeded toy", _Unseeded, lambda step: (torch.ones(4) * (step + 1),))
    result = run_model_bench(load_registry(), case, steps=2, contenders=["eager", "writeback+portable"])
    # The first build serves the shared export; each row's own build differs from it.
    for row in result.rows:
        assert not row.times, row
        assert row.error is not None and "WeightsDiffer: model 'toy': a bench builds it once per row" in row.error


def test_bench_of_a_seeded_factory_builds_per_row_and_matches_eager() -> None:
    from writeback_bench.model_steps import run_model_bench

    def seeded() -> torch.nn.Module:
        torch.manual_seed(0)
        return _Unseeded()

    case = ModelCase("toy", "a seeded toy", seeded, lambda step: (torch.ones(4) * (step + 1),))
    result = run_model_bench(load_registry(), case, steps=2, contenders=["eager", "writeback+portable"])
    assert [(row.name, row.error) for row in result.rows] == [("eager", None), ("writeback+portable", None)]

"""`writeback run` judges a step beyond the fixed tolerance against float64 eager: fp32's own
rounding passes, a real fault (weights off by 1e-2) still fails, both errors named."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from click.testing import CliRunner
from writeback.cli import main

# Two large projections whose difference is small (an ill-conditioned subtraction): fp32
# rounds each product at ~1e3 x 6e-8 per term, so the result carries ~1e-3 of rounding on
# values ~0.2, far past rtol = atol = 1e-4, on eager and on every backend alike. A running
# total is the state the program keeps in a buffer. PERTURB > 0 makes the exported program
# compute with weights `b` off by PERTURB (a lowering that changed the weights), eager not.
MODEL = """
import torch
from writeback_core.types import ModelCase

PERTURB = {perturb}


class Cancelling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(256, 64, generator=generator) * 100
        self.a = torch.nn.Parameter(weight)
        self.b = torch.nn.Parameter(weight + torch.randn(256, 64, generator=generator) * 0.01)
        self.register_buffer("total", torch.zeros(64))

    def forward(self, x):
        b = self.b + PERTURB if torch.compiler.is_exporting() else self.b
        self.total.add_(x @ self.a - x @ b)
        return self.total * 1.0


def step_inputs(step):
    return (torch.randn(256, generator=torch.Generator().manual_seed(step + 1)),)


def make():
    return ModelCase("cancelling", "an ill-conditioned subtraction", Cancelling, step_inputs)
"""

# Every backend a fault must fail on; XNNPACK's sums run in another order than eager's
# (ExecuTorch's portable mm sums as eager does here), so its steps are beyond rtol = atol = 1e-4.
BACKENDS = ["none", "xnnpack"]


def _model(tmp_path: Path, perturb: float) -> tuple[Path, ModuleType]:
    source = tmp_path / f"cancelling_{'ok' if perturb == 0 else 'perturbed'}.py"
    source.write_text(MODEL.format(perturb=perturb))
    spec = importlib.util.spec_from_file_location(source.stem, source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return source, module


def test_the_model_is_beyond_the_fixed_tolerance_in_eager_fp32_itself(tmp_path: Path) -> None:
    """The premise, measured: eager fp32 is more than rtol = atol = 1e-4 from the model in float64."""
    _, loaded = _model(tmp_path, 0.0)
    fp32, fp64 = loaded.Cancelling(), loaded.Cancelling().double()
    x = loaded.step_inputs(0)[0]
    with torch.no_grad():
        low, high = fp32(x), fp64(x.double())
    assert not torch.allclose(low.double(), high, rtol=1e-4, atol=1e-4)
    assert float((low.double() - high).abs().max()) > 1e-4


def test_fp32_rounding_beyond_the_fixed_tolerance_matches_against_float64_eager(tmp_path: Path) -> None:
    source, _ = _model(tmp_path, 0.0)
    result = CliRunner().invoke(main, ["run", f"{source}:make", "--backend", "xnnpack", "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert result.output.count("yes (f64)") == 3, result.output
    message = " ".join(result.output.split())
    assert "all 3 steps match eager PyTorch: 0 within rtol=0.0001, atol=0.0001, 3 within fp32's own" in message
    assert "against float64 eager the program is at most" in message and "eager fp32 itself" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_off_by_1e_2_fail_against_float64_eager_naming_both_errors(tmp_path: Path, backend: str) -> None:
    source, _ = _model(tmp_path, 1e-2)
    args = ["run", f"{source}:make", "--backend", backend, "--steps", "3", "--eager-weights", "copy"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "3 of 3 steps differ from eager PyTorch" in message, message
    assert "Beyond fp32's own rounding error, judged against float64 eager: " in message
    assert "output 0 (64,) is" in message and "from float64 eager, where eager fp32 itself is" in message


def test_a_model_with_no_float64_copy_stays_refused_saying_why(tmp_path: Path) -> None:
    """A module deepcopy cannot copy (it holds a lock) has no float64 reference: the steps beyond
    the fixed tolerance stay refused, and the error says no reference could judge them and why."""
    source, _ = _model(tmp_path, 0.0)
    source.write_text(
        source.read_text().replace("import torch\n", "import threading\nimport torch\n", 1)
        + "\n\ndef make_locked():\n    case = make()\n    build = case.build\n\n"
        "    def locked():\n        module = build()\n        module.lock = threading.Lock()\n        return module\n\n"
        "    return ModelCase(case.name, case.description, locked, case.step_inputs)\n"
    )
    args = ["run", f"{source}:make_locked", "--backend", "xnnpack", "--steps", "2", "--eager-weights", "rebuild"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "2 of 2 steps differ from eager PyTorch" in message and "differs from eager by" in message
    assert "No float64 reference could judge whether that is fp32's own rounding" in message, message
    assert "copying the module before its first step failed: TypeError" in message


def test_an_unseeded_factory_gets_no_float64_reference_and_stays_refused_naming_the_tensor(tmp_path: Path) -> None:
    """Eager's weights are freed with the delegated ones, so the float64 reference is a new build:
    one whose weights differ from those exported (a factory seeded anew on every call) is not
    used; the steps beyond the fixed tolerance stay refused, naming the first tensor that differs."""
    source, _ = _model(tmp_path, 0.0)
    source.write_text(
        source.read_text().replace("torch.Generator().manual_seed(0)", "torch.Generator().manual_seed(torch.seed())")
    )
    args = ["run", f"{source}:make", "--backend", "xnnpack", "--steps", "2", "--eager-weights", "copy"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "2 of 2 steps differ from eager PyTorch" in message, message
    assert "No float64 reference could judge whether that is fp32's own rounding" in message, message
    assert "building it again for its float64 reference gave other weights than the build that was exported" in message
    assert "parameter 'a'" in message and "seed it (torch.manual_seed)" in message

"""`writeback run path/to/file.py:factory` with a factory that returns a ModelCase: strict
export, keyword arguments and per-step inputs work from a file. The `.pte` run writes is
stepped again here with inputs flattened by hand and checked against eager PyTorch computed
here; the tuple forms say that every step gets the same inputs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from click.testing import CliRunner, Result
from writeback.cli import main
from writeback.session import assemble
from writeback_core.registry import load_registry

# Cache tensors in a list attribute aliasing registered buffers, as Hugging Face's
# StaticCache keeps them; forward takes its position and scale as keyword arguments.
MODEL_FILE = """
import torch
from torch import nn
from writeback_core.types import ModelCase

SLOTS = 6


class ListCache(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.proj = nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(4, 4, generator=gen))
            self.proj.bias.copy_(torch.randn(4, generator=gen))
        self.caches = []
        for i in range(2):
            self.register_buffer(f"cache_{i}", torch.zeros(SLOTS, 4))
            self.caches.append(getattr(self, f"cache_{i}"))

    def forward(self, x, *, cache_position, scale):
        y = self.proj(x)
        self.caches[0].index_copy_(0, cache_position, y)
        self.caches[1].index_copy_(0, cache_position, y * scale)
        return self.caches[0].sum(0) - self.caches[1].mean(0)


def inputs(step):
    return (torch.randn(1, 4, generator=torch.Generator().manual_seed(100 + step)),)


def kwargs(step):
    # The keywords in another order than forward declares them, as a user may write them.
    return {"scale": torch.tensor(1.0 + step), "cache_position": torch.tensor([step % SLOTS])}


def make(strict=True):
    return ModelCase(
        name="list-cache",
        description="caches in a list aliasing registered buffers, keyword inputs",
        build=ListCache,
        step_inputs=inputs,
        step_kwargs=kwargs,
        strict=strict,
    )


def make_non_strict():
    return make(strict=False)


class Accumulate(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x, *, scale):
        self.total.add_(x * scale)
        return self.total * 2


def make_tuple():
    return Accumulate(), (torch.arange(4.0),), {"scale": torch.tensor(0.5)}
"""


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("list_cache_model_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, ["run", *args])


@pytest.mark.slow  # strict export (dynamo) and a lowering: about 20 s
def test_file_factory_returning_a_strict_case_with_keyword_inputs_matches_eager_every_step(tmp_path: Path) -> None:
    source = tmp_path / "list_cache.py"
    source.write_text(MODEL_FILE)
    pte = tmp_path / "list_cache.pte"
    steps = 8  # past the 6 slots: slots are overwritten
    result = _run(f"{source}:make", "--backend", "none", "--steps", str(steps), "--output", str(pte))
    assert result.exit_code == 0, result.output
    assert f"all {steps} steps match eager PyTorch" in result.output
    assert "cache_0 (96 B): program buffer" in result.output
    assert "every step gets the same inputs" not in result.output

    # The .pte again, inputs flattened by hand as torch.export flattens
    # (x, then the keywords in the order step 0 gave them), against eager here.
    model = _load(source)
    eager = model.ListCache().eval()
    pipeline = assemble(load_registry(), "none")
    method = pipeline.runtime.load_program(pte.read_bytes(), pipeline.delegates).load_method("forward")
    for step in range(steps):
        (x,) = model.inputs(step)
        keywords = model.kwargs(step)
        outputs = method.execute([x, keywords["scale"], keywords["cache_position"]])
        with torch.no_grad():
            expected = eager(x, cache_position=keywords["cache_position"], scale=keywords["scale"])
        # The output reads every slot of both caches: a write at the wrong position or
        # with step 0's inputs (position 0, scale 1) shows in it.
        torch.testing.assert_close(outputs[-1], expected, rtol=1e-5, atol=1e-5)


def test_file_factory_exported_non_strict_says_the_caches_became_constants_and_to_export_strictly(
    tmp_path: Path,
) -> None:
    source = tmp_path / "list_cache.py"
    source.write_text(MODEL_FILE)
    result = _run(f"{source}:make_non_strict", "--backend", "none", "--steps", "1")
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "lifted tensors of the model's state as constants" in text
    assert "shares storage with registered buffer 'cache_0'" in text
    assert "strict=True" in text
    assert "expected compiled_fn" not in text


def test_file_factory_tuple_with_keywords_runs_and_says_every_step_gets_the_same_inputs(tmp_path: Path) -> None:
    source = tmp_path / "list_cache.py"
    source.write_text(MODEL_FILE)
    result = _run(f"{source}:make_tuple", "--backend", "none", "--steps", "3")
    assert result.exit_code == 0, result.output
    assert "total (16 B): program buffer; whole-state copy left (16 B/call)" in result.output
    assert "note: every step gets the same inputs" in result.output
    assert "all 3 steps match eager PyTorch" in result.output


@pytest.mark.slow  # strict export and every explain column's lowering
def test_explain_exports_a_strict_keyword_case_from_a_file_as_run_does(tmp_path: Path) -> None:
    source = tmp_path / "list_cache.py"
    source.write_text(MODEL_FILE)
    result = CliRunner().invoke(main, ["explain", f"{source}:make"])
    assert result.exit_code == 0, result.output
    # Both caches are registered buffers written at the keyword argument's position.
    assert result.output.count("index_copy(dim=0, index=cache_position)") == 2
    assert "cache_0" in result.output and "cache_1" in result.output


def test_explain_of_a_non_strict_export_says_to_export_strictly_without_a_traceback(tmp_path: Path) -> None:
    source = tmp_path / "list_cache.py"
    source.write_text(MODEL_FILE)
    result = CliRunner().invoke(main, ["explain", f"{source}:make_non_strict"])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    text = " ".join(result.output.split())
    assert "Error: model 'list-cache': torch.export lifted tensors" in text and "strict=True" in text

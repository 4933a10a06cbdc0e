"""optimum-executorch's own CLI finds writeback's recipe with nothing imported by the user:
``optimum-cli export executorch --recipe writeback-xnnpack`` (alone, with ``--use_custom_sdpa``,
and with ``--use_custom_kv_cache``) writes a ``.pte`` that ExecuTorch's ``TextLLMRunner``
runs to transformers' greedy tokens, with no cache copied back whole.

optimum-executorch 1.1.0 pins transformers==5.0.0rc1, which this workspace's decoders cannot
share, so the recipe runs in an environment of its own, built here with uv as the README says
(slow tier: a second torch + executorch environment and three exports). The folder and the
expected tokens come from the workspace's transformers (tests/decoders/test_llm_runner.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.decoders.test_llm_runner import folder, runner_generates  # noqa: F401  # folder: the shared model fixture

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def optimum_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with optimum-executorch and writeback's recipe, as the README installs it."""
    from importlib.metadata import version

    venv = tmp_path_factory.mktemp("optimum-env") / "venv"
    subprocess.run(["uv", "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    install = [
        "uv", "pip", "install", "--quiet", "--no-config", "--python", str(venv / "bin" / "python"),
        f"torch=={version('torch')}", f"executorch=={version('executorch')}",
        str(ROOT / "packages" / "core"), str(ROOT / "packages" / "passes"),
        str(ROOT / "integrations" / "optimum-executorch"),
    ]  # fmt: skip
    done = subprocess.run(install, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


# optimum-cli's console script, run with a CopyLeftWarning turned into an error.
STRICT_CLI = """
import sys, warnings
from writeback_core.copies import CopyLeftWarning
warnings.filterwarnings("error", category=CopyLeftWarning)
from optimum.commands.optimum_cli import main
sys.argv = ["optimum-cli", *sys.argv[1:]]
main()
"""


def test_the_optimum_cli_console_script_finds_the_recipe_with_nothing_imported(
    optimum_env: Path,
    folder: tuple[Path, list[str]],  # noqa: F811  # the fixture imported above
    tmp_path: Path,
) -> None:
    model, expected = folder
    command = [
        str(optimum_env / "bin" / "optimum-cli"), "export", "executorch", "--model", str(model),
        "--task", "text-generation", "--recipe", "writeback-xnnpack", "--output_dir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert runner_generates(tmp_path / "model.pte", model / "tokenizer.json")[0] == expected


@pytest.mark.parametrize("options", [[], ["--use_custom_sdpa"], ["--use_custom_sdpa", "--use_custom_kv_cache"]])
def test_optimum_cli_exports_with_the_writeback_recipe_and_the_runner_gives_transformers_greedy_tokens(
    optimum_env: Path,
    folder: tuple[Path, list[str]],  # noqa: F811  # the fixture imported above
    tmp_path: Path,
    options: list[str],
) -> None:
    from writeback_core.llm_runner import load_runner_kernels

    model, expected = folder
    arguments = ["export", "executorch", "--model", str(model), "--task", "text-generation"]
    arguments += ["--recipe", "writeback-xnnpack", "--output_dir", str(tmp_path), *options]
    # optimum-cli's own entry point, with every whole-state copy left (a CopyLeftWarning) an error.
    done = subprocess.run(
        [str(optimum_env / "bin" / "python"), "-c", STRICT_CLI, *arguments], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    load_runner_kernels()
    pieces, stats = runner_generates(tmp_path / "model.pte", model / "tokenizer.json")
    assert pieces == expected
    assert stats[-1].num_prompt_tokens == 3


def test_an_unknown_recipe_name_is_not_ours_to_answer(optimum_env: Path, tmp_path: Path) -> None:
    """The recipe is registered under its one name: optimum lists it among the registered recipes."""
    script = (
        "import optimum.commands.register.writeback_recipes\n"
        "from optimum.exporters.executorch.recipe_registry import recipe_registry\n"
        "print(sorted(recipe_registry))\n"
    )
    done = subprocess.run([str(optimum_env / "bin" / "python"), "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'writeback-xnnpack'" in done.stdout

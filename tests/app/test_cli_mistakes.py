"""A user's mistake is one paragraph and exit status 2, found before anything is exported or
lowered: errors raised by the code in a model file (naming the file and line), unknown names
of models, backends, runtimes and engines, absurd sizes, paths that cannot be written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from writeback.cli import main

# A model file that leaves a marker when imported: a test that finds no marker knows the
# command stopped before loading the model, let alone exporting or lowering it.
MARKED_MODEL = """
from pathlib import Path
import torch

Path(__file__).with_suffix(".imported").touch()

class Acc(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 1

def make():
    return Acc(), (torch.ones(3),)
"""


def _invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def _error_lines(result: Result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("Error:")]


def _line_of(source: str, text: str) -> int:
    """The 1-based number of the one line of ``source`` containing ``text``."""
    (number,) = [n for n, line in enumerate(source.splitlines(), start=1) if text in line]
    return number


def _write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(source)
    return path


def _assert_user_mistake(result: Result, *texts: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    (line,) = _error_lines(result)
    for text in texts:
        assert text in line, line


@pytest.fixture
def marked_model(tmp_path: Path) -> Path:
    return _write(tmp_path, "marked.py", MARKED_MODEL)


def _was_imported(model: Path) -> bool:
    return model.with_suffix(".imported").exists()


# --- errors raised by the code in a model file --------------------------------------------

IMPORT_RAISES = """import torch
x = 1
raise RuntimeError("the weights file is missing")
def make():
    return None
"""


def test_model_file_raising_on_import_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    model = _write(tmp_path, "broken_import.py", IMPORT_RAISES)
    result = _invoke("explain", f"{model}:make")
    line = _line_of(IMPORT_RAISES, "raise RuntimeError")
    _assert_user_mistake(result, str(model), f"line {line}", "RuntimeError: the weights file is missing")


FACTORY_RAISES = """import torch

def _load_config():
    settings = {"dim": 8}
    return settings["heads"]

def make():
    heads = _load_config()
    return torch.nn.Linear(heads, heads), (torch.ones(heads),)

def make_bad_value():
    raise ValueError("dim must be even")
"""


def test_factory_raising_runtime_error_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    model = _write(tmp_path, "factory.py", FACTORY_RAISES)
    pte = tmp_path / "out.pte"
    result = _invoke("run", f"{model}:make", "--output", str(pte))
    # The innermost frame in the user's file: the helper the factory called, not the factory.
    line = _line_of(FACTORY_RAISES, 'return settings["heads"]')
    _assert_user_mistake(result, str(model), f"line {line}", "in _load_config", "KeyError: 'heads'", "make()")
    assert not pte.exists()


def test_model_file_in_the_working_directory_is_named_as_the_user_typed_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, "factory.py", FACTORY_RAISES)
    monkeypatch.chdir(tmp_path)
    result = _invoke("explain", "factory.py:make")
    line = _line_of(FACTORY_RAISES, 'return settings["heads"]')
    _assert_user_mistake(result, f"(factory.py, line {line}, in _load_config)")


def test_factory_raising_value_error_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    model = _write(tmp_path, "factory.py", FACTORY_RAISES)
    result = _invoke("explain", f"{model}:make_bad_value")
    line = _line_of(FACTORY_RAISES, "dim must be even")
    _assert_user_mistake(result, str(model), f"line {line}", "ValueError: dim must be even")


SYNTAX_ERROR = """import torch

def make(:
    return None
"""


def test_model_file_syntax_error_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    model = _write(tmp_path, "typo.py", SYNTAX_ERROR)
    result = _invoke("explain", f"{model}:make")
    _assert_user_mistake(result, str(model), f"line {_line_of(SYNTAX_ERROR, 'def make(:')}", "not valid Python")


FORWARD_RAISES = """import torch

class Steps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count.add_(1)
        if x.shape[0] != 4:
            raise RuntimeError(f"expected 4 features, got {x.shape[0]}")
        return x * self.count

def make():
    return Steps(), (torch.ones(3),)
"""


def test_forward_raising_while_exporting_exits_2_naming_file_and_line(tmp_path: Path) -> None:
    model = _write(tmp_path, "steps.py", FORWARD_RAISES)
    result = _invoke("explain", f"{model}:make")
    line = _line_of(FORWARD_RAISES, "raise RuntimeError")
    _assert_user_mistake(result, str(model), f"line {line}", "in forward", "expected 4 features, got 3")


def test_traceback_env_shows_the_whole_traceback_of_a_model_file_error(tmp_path: Path) -> None:
    model = _write(tmp_path, "factory.py", FACTORY_RAISES)
    result = _invoke("explain", f"{model}:make", env={"WRITEBACK_TRACEBACK": "1"})
    assert result.exit_code == 2, result.output
    assert "Traceback (most recent call last)" in result.output
    assert "_load_config" in result.output and len(_error_lines(result)) == 1


def test_missing_factory_lists_the_functions_the_file_defines(tmp_path: Path) -> None:
    model = _write(tmp_path, "factory.py", FACTORY_RAISES)
    result = _invoke("explain", f"{model}:build")
    assert result.exit_code == 2, result.output
    assert "has no callable 'build'" in result.output
    assert "functions defined there: make, make_bad_value" in result.output


# --- unknown names ----------------------------------------------------------------------------


def test_run_unknown_model_refused_up_front_listing_built_in_models(tmp_path: Path) -> None:
    pte = tmp_path / "out.pte"
    result = _invoke("run", "decodr", "--output", str(pte))
    assert result.exit_code == 2, result.output
    assert "unknown model 'decodr'" in result.output and "decoder-caller-cache" in result.output
    assert not pte.exists()


def test_run_unknown_backend_refused_before_loading_the_model(tmp_path: Path, marked_model: Path) -> None:
    result = _invoke("run", f"{marked_model}:make", "--backend", "nosuch", "--output", str(tmp_path / "o.pte"))
    assert result.exit_code == 2, result.output
    assert "no backend named 'nosuch'" in result.output and "mlx" in result.output
    assert not _was_imported(marked_model) and not (tmp_path / "o.pte").exists()


def test_run_unknown_runtime_refused_before_loading_the_model(tmp_path: Path, marked_model: Path) -> None:
    result = _invoke("run", f"{marked_model}:make", "--runtime", "nosuch", "--output", str(tmp_path / "o.pte"))
    assert result.exit_code == 2, result.output
    assert "no runtime named 'nosuch'" in result.output and "pybind" in result.output
    assert not _was_imported(marked_model) and not (tmp_path / "o.pte").exists()


def test_bench_unknown_backend_refused_up_front(tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    result = _invoke("bench", "--sizes", "1", "--repeats", "1", "--backend", "nosuch", "--plot", str(plot))
    assert result.exit_code == 2, result.output
    assert "no backend named 'nosuch'" in result.output and "mlx" in result.output
    assert "decode step" not in result.output and not plot.exists()


def test_fuzz_unknown_backend_refused_up_front() -> None:
    result = _invoke("fuzz", "--programs", "2", "--jobs", "1", "--backend", "nosuch")
    assert result.exit_code == 2, result.output
    assert "no plugin offers backend(s) 'nosuch'; offered: example, mlx" in result.output
    # Refused before hypothesis drew anything: no program, no "failing test case".
    assert "Failing test case" not in result.output and "programs passed" not in result.output


@pytest.mark.parametrize(("option", "offered"), [("engine", "kv-alias"), ("runtime", "pybind")])
def test_fuzz_unknown_engine_or_runtime_refused_up_front(option: str, offered: str) -> None:
    result = _invoke("fuzz", "--programs", "2", "--jobs", "1", f"--{option}", "nosuch")
    assert result.exit_code == 2, result.output
    assert f"no plugin offers {option}" in result.output and "'nosuch'; offered: " + offered in result.output
    assert "Failing test case" not in result.output and "programs passed" not in result.output


def test_fuzz_more_jobs_than_four_per_core_refused() -> None:
    result = _invoke("fuzz", "--programs", "2", "--jobs", str(4 * (os.cpu_count() or 1) + 1))
    assert result.exit_code == 2, result.output
    assert "--jobs" in result.output and "programs passed" not in result.output


# --- absurd sizes -----------------------------------------------------------------------------


def test_run_absurd_cache_mib_refused_up_front_naming_the_limit(tmp_path: Path) -> None:
    pte = tmp_path / "out.pte"
    result = _invoke("run", "--cache-mib", "1e9", "--output", str(pte))
    assert result.exit_code == 2, result.output
    (line,) = _error_lines(result)
    assert "--cache-mib" in line and "1e+09 MiB is too large" in line
    # The limit itself, in MiB, and where it comes from.
    assert "so at most" in line or "65536 MiB is the largest" in line
    assert not pte.exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_run_cache_mib_that_is_not_a_positive_size_refused(value: str) -> None:
    result = _invoke("run", "--cache-mib", value)
    assert result.exit_code == 2, result.output
    assert "--cache-mib" in result.output and "give a positive number of MiB" in result.output


def test_bench_absurd_size_refused_up_front_naming_the_limit() -> None:
    result = _invoke("bench", "--sizes", "1,1e9", "--repeats", "1")
    assert result.exit_code == 2, result.output
    (line,) = _error_lines(result)
    assert "--sizes" in line and "1e+09 MiB is too large" in line
    assert "decode step" not in result.output


# --- paths that cannot be written -----------------------------------------------------------


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder no file can be created in: read-only for a normal user; ``/sys`` for root
    (permission bits do not stop root)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    if sys.platform != "linux":
        pytest.skip("needs a folder root cannot write to")
    return Path("/sys")


def _fifo(path: Path) -> Path:
    """A named pipe: not a regular file, like a device, but harmless to replace should the
    check ever let it through (``/dev/null`` here, run as root, would be replaced for good)."""
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("under_a_file", "is a file, not a folder"),
        ("a_directory", "is a directory"),
        ("unwritable_folder", "cannot create a file in"),
        ("a_device", "is not a regular file"),
    ],
)
def test_output_not_writable_refused_before_lowering(tmp_path: Path, marked_model: Path, where: str, why: str) -> None:
    (tmp_path / "plain").write_text("")
    (tmp_path / "folder").mkdir()
    output = {
        "under_a_file": tmp_path / "plain" / "model.pte",
        "a_directory": tmp_path / "folder",
        "unwritable_folder": _unwritable_folder(tmp_path) / "model.pte",
        "a_device": _fifo(tmp_path / "pipe"),
    }[where]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = _invoke("run", f"{marked_model}:make", "--backend", "none", "--output", str(output))
    assert result.exit_code == 2, result.output
    (line,) = _error_lines(result)
    assert "--output" in line and str(output) in line and why in line
    assert not _was_imported(marked_model), "the model was loaded before the output was checked"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, not even a probe


@pytest.mark.parametrize(
    ("name", "why"), [("plain/bench.png", "is a file, not a folder"), ("bench.pnj", "matplotlib writes")]
)
def test_plot_not_writable_refused_before_timing(tmp_path: Path, name: str, why: str) -> None:
    (tmp_path / "plain").write_text("")
    plot = tmp_path / name
    result = _invoke("bench", "--sizes", "1", "--repeats", "1", "--plot", str(plot))
    assert result.exit_code == 2, result.output
    (line,) = _error_lines(result)
    assert "--plot" in line and str(plot) in line and why in line
    assert "decode step" not in result.output and not plot.exists()


# --- errors raised while the model is built (its build() / __init__) ------------------------

BUILD_RAISES = """import functools
import torch
from writeback_core.types import ModelCase


class Seq2Seq(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = torch.nn.Linear(4, 4)
        self.head = self.lm_head  # as transformers' seq2seq wrapper reads a head Whisper lacks

    def forward(self, x):
        return self.head(x)


def make():
    return ModelCase(name="seq2seq", description="raises in __init__", build=Seq2Seq,
                     step_inputs=lambda step: (torch.ones(4),))


def make_library_raises():
    # The error is raised inside torch, in no frame of this file.
    build = functools.partial(torch.nn.Linear, -1, 4)
    return ModelCase(name="negative-linear", description="torch raises", build=build,
                     step_inputs=lambda step: (torch.ones(4),))
"""


def test_model_class_raising_in_init_exits_2_naming_the_models_error_not_a_lowering(tmp_path: Path) -> None:
    model = _write(tmp_path, "seq2seq.py", BUILD_RAISES)
    pte = tmp_path / "out.pte"
    result = _invoke("run", f"{model}:make", "--backend", "none", "--output", str(pte))
    line = _line_of(BUILD_RAISES, "self.head = self.lm_head")
    _assert_user_mistake(
        result, "model 'seq2seq'", "AttributeError", "lm_head", str(model), f"line {line}", "in __init__"
    )
    assert "lowering" not in result.output, result.output
    assert not pte.exists()


def test_model_built_by_a_library_that_raises_exits_2_naming_the_error(tmp_path: Path) -> None:
    model = _write(tmp_path, "library.py", BUILD_RAISES)
    result = _invoke("run", f"{model}:make_library_raises", "--backend", "none")
    _assert_user_mistake(result, "model 'negative-linear'", "building the model raised RuntimeError", "negative")
    assert "lowering" not in result.output, result.output


def test_explain_of_a_model_raising_in_init_exits_2(tmp_path: Path) -> None:
    model = _write(tmp_path, "seq2seq.py", BUILD_RAISES)
    result = _invoke("explain", f"{model}:make")
    _assert_user_mistake(result, "model 'seq2seq'", "AttributeError", "lm_head")

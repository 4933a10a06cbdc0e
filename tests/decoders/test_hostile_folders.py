"""Model folders a careless or hostile user hands a command (``tests.hostile.HOSTILE_FOLDERS``):
each is refused before a model is built, in one paragraph, exit 2, naming the real cause —
the file, the field or the tensor and its value — with no traceback, bounded memory and
nothing from the folder run or unpickled.

Fast tier: every case through :func:`check_folder` in this process, and the real
``writeback`` command in a child process for the folder claiming a model larger than
memory. Slow tier: every case through every command that reads folders (``export``,
``run``, ``explain``, ``bench --model``, ``bench-generate``), each case's commands in one child process under
a memory cap and a timeout, each command in its own copy of the folder.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from writeback_decoders.folder_checks import FolderRefused, check_folder

from tests.hostile import ACCEPTABLE, HOSTILE_FOLDERS, Q0, HostileFolder, write_folder

# The child's address space is capped here (torch and exir map a few GiB of libraries).
_ADDRESS_SPACE = 12 << 30
# A refusal comes before any model is built; this bounds a child (one command, or the
# whole matrix's 105) that hangs or builds.
_TIMEOUT_S = 300.0
# A refused folder's child never grows past this (a model built would).
_RESIDENT_BYTES = 1 << 30

_BY_NAME = {case.name: case for case in HOSTILE_FOLDERS}
# Advice the refusals used to give that does not apply: an option writeback does not have
# (a remote-code folder), an install that is not missing (a config that is not a file), the
# mlx backend (a runner failure on a portable program).
MISLEADING = ("trust_remote_code", "install", "mlx")


@dataclass(frozen=True)
class Child:
    status: int
    stdout: str
    stderr: str
    max_resident: int  # bytes
    cpu_seconds: float = 0.0  # user + system CPU time of the whole child (its imports included)


def _run_capped(command: list[str], cwd: Path) -> Child:
    """``command`` in a child process in ``cwd``, its address space capped, killed after
    ``_TIMEOUT_S``; its exit status, output and peak resident memory (``wait4``)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))

    out, err = cwd / "stdout.txt", cwd / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=cwd, preexec_fn=cap)
    deadline = time.monotonic() + _TIMEOUT_S
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            child.send_signal(signal.SIGKILL)
            _, status, usage = os.wait4(child.pid, 0)
            break
        time.sleep(0.1)
    child.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait for it again
    cpu = usage.ru_utime + usage.ru_stime
    return Child(child.returncode, out.read_text(), err.read_text(), usage.ru_maxrss * 1024, cpu)


def run_writeback(args: list[str], cwd: Path) -> Child:
    """The real ``writeback`` command (its console script) in a capped child process."""
    return _run_capped([str(Path(sys.executable).parent / "writeback"), *args], cwd)


def run_writeback_in_one_child(jobs: list[tuple[Path, list[str]]], cwd: Path) -> list[Child]:
    """Each job's ``writeback`` command run in its own directory, all in one capped child
    process that imports the command once (tests/decoders/hostile_folder_worker.py): per job
    its exit status, output and the child's peak resident memory once the job had ended. A
    job the child never finished (it hung, or died) gets the child's own status and stderr."""
    results = cwd / "results.json"
    worker = Path(__file__).with_name("hostile_folder_worker.py")
    listed = json.dumps([(str(directory), args) for directory, args in jobs])
    whole = _run_capped([sys.executable, str(worker), listed, str(results)], cwd)
    done = json.loads(results.read_text()) if results.exists() else []
    children = [Child(one["status"], one["stdout"], one["stderr"], one["max_resident"]) for one in done]
    return children + [whole] * (len(jobs) - len(children))


def assert_one_paragraph_refusal(child: Child, case: HostileFolder) -> None:
    """Exit 2, no traceback, one paragraph on stderr naming what ``case`` must name."""
    assert child.status == 2, (child.status, child.stderr[-2000:])
    assert "Traceback" not in child.stderr and "Traceback" not in child.stdout, child.stderr[-2000:]
    # click's usage lines, then one "Error: ..." paragraph; upstream import noise is not ours.
    error = child.stderr[child.stderr.index("Error: ") :].strip()
    assert "\n\n" not in error and len(error.splitlines()) == 1, error
    for words in case.says:
        assert words in error, (words, error)
    for misleading in MISLEADING:
        assert misleading not in error, (misleading, error)


@pytest.mark.parametrize("case", HOSTILE_FOLDERS, ids=lambda c: c.name)
def test_check_folder_refuses_each_hostile_folder_naming_the_cause_nothing_unpickled(
    case: HostileFolder, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    case.make(folder)
    with pytest.raises(FolderRefused) as refused:
        check_folder(folder)
    message = str(refused.value)
    assert "\n" not in message
    for words in case.says:
        assert words in message, (words, message)
    for misleading in MISLEADING:
        assert misleading not in message, (misleading, message)
    assert not (folder / "UNPICKLED").exists()


def test_check_folder_passes_the_tiny_llama_the_generator_starts_from(tmp_path: Path) -> None:
    """The hostile cases are each one change away from a folder that passes every check."""
    assert check_folder(write_folder(tmp_path / "model")) == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_check_folder_passes_a_float_models_fp16_and_bf16_weights(dtype: str, tmp_path: Path) -> None:
    """Half-precision weights convert exactly to the float model's fp32: nothing to refuse."""
    import torch

    from tests.hostile import tiny_llama_tensors

    tensors = {name: t.to(getattr(torch, dtype)) for name, t in tiny_llama_tensors().items()}
    assert check_folder(write_folder(tmp_path / "model", tensors=tensors)) == []


@pytest.mark.parametrize("name", sorted(ACCEPTABLE))
def test_accept_weights_lets_mismatched_weights_through_and_says_which(name: str, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    _BY_NAME[name].make(folder)
    accepted = check_folder(folder, accept_weights=True)
    assert len(accepted) == 1, accepted
    tensor = "model.layers.0.extra.weight" if name == "unexpected-tensor" else Q0
    assert tensor in accepted[0]


@pytest.mark.parametrize("name", ["config-symlink-loop", "config-directory", "config-dev-zero"])
def test_a_config_json_that_is_not_a_file_is_refused_by_the_folder_plugin_not_passed_over(
    name: str, tmp_path: Path
) -> None:
    """The plugin claims any folder with a config.json entry and refuses it naming the file;
    before, it passed such a folder over and the CLI suggested a missing install."""
    from writeback_core.registry import load_registry

    _BY_NAME[name].make(tmp_path / "model")
    with pytest.raises(FolderRefused, match=r"config\.json"):
        load_registry().model_from_path(str(tmp_path / "model"))


def test_what_accept_weights_let_through_stays_in_every_derived_cases_description(tmp_path: Path) -> None:
    """export takes the dynamic-prefill form, --quantize the quantized one: each still says it."""
    from writeback_core.registry import load_registry

    _BY_NAME["missing-q-proj"].make(tmp_path / "model")
    case = load_registry().model_from_path(str(tmp_path / "model"), accept_weights=True)
    said = f"--accept-weights accepted weights that do not match the model: parameter {Q0!r} is missing"
    derived = [case, case.dynamic_prefill(), case.quantized("8da4w"), case.quantized("8da4w").dynamic_prefill()]
    for one in derived:
        assert said in one.description, one.description


@pytest.mark.parametrize("name", sorted(set(_BY_NAME) - ACCEPTABLE))
def test_accept_weights_never_lets_a_broken_folder_through(name: str, tmp_path: Path) -> None:
    """A wrong shape, a lying header or an impossible config is refused with the option too."""
    folder = tmp_path / "model"
    _BY_NAME[name].make(folder)
    with pytest.raises(FolderRefused):
        check_folder(folder, accept_weights=True)


def test_a_folder_claiming_a_million_layers_is_refused_exit_2_before_any_allocation(tmp_path: Path) -> None:
    """The config alone says the model needs ~140 GiB: refused in one paragraph before
    anything is built, in under 10 s, the child's resident memory staying under 1 GiB (it
    used to grow to 5.4 GB in 148 s and end in a MemoryError traceback). The time is the
    child's CPU time, imports included (its wall time on a loaded machine counts others' work)."""
    case = _BY_NAME["layers-10^6"]
    case.make(tmp_path / "model")
    child = run_writeback(["export", "model", "--output", "model.pte"], tmp_path)
    assert_one_paragraph_refusal(child, case)
    assert child.max_resident < _RESIDENT_BYTES, child.max_resident
    assert child.cpu_seconds < 10.0, child.cpu_seconds
    assert not (tmp_path / "model.pte").exists()


_COMMANDS = {
    "export": ["export", "model", "--output", "model.pte"],
    "run": ["run", "model", "--steps", "1"],
    "explain": ["explain", "model"],
    "bench-generate": ["bench-generate", "model", "--rounds", "1"],
    "bench": ["bench", "--model", "model", "--steps", "1"],
}


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_every_command_that_reads_folders_has_the_accept_weights_option_its_refusals_advise(command: str) -> None:
    from click.testing import CliRunner
    from writeback.cli import main

    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "--accept-weights" in result.output, result.output


# Case name -> command -> (the directory it ran in, its child's result). Every case's
# commands run in one child process: its first command costs ~10 s (torch, exir and the
# plugins imported, the registry loaded), each later refusal milliseconds, so the matrix
# costs about one command instead of 105 (measurement log, 2026-12-07). Each command runs in
# a directory of its own holding a fresh copy of its folder; the child's peak memory is
# read after each command. Filled by the first matrix test a pytest process runs.
_MATRIX: dict[str, dict[str, tuple[Path, Child]]] = {}


def _matrix_of(case: HostileFolder, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Child]]:
    if not _MATRIX:
        root = tmp_path_factory.mktemp("hostile-matrix")
        directories = {
            (one.name, command): root / f"{index}-{command}"
            for index, one in enumerate(HOSTILE_FOLDERS)
            for command in sorted(_COMMANDS)
        }
        for (name, _), directory in directories.items():
            _BY_NAME[name].make(directory / "model")
        jobs = [(directory, _COMMANDS[command]) for (_, command), directory in directories.items()]
        children = run_writeback_in_one_child(jobs, root)
        for ((name, command), directory), child in zip(directories.items(), children, strict=True):
            _MATRIX.setdefault(name, {})[command] = (directory, child)
    return _MATRIX[case.name]


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(_COMMANDS))
@pytest.mark.parametrize("case", HOSTILE_FOLDERS, ids=lambda c: c.name)
def test_every_command_refuses_each_hostile_folder_exit_2_one_paragraph_bounded_memory(
    case: HostileFolder, command: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory, child = _matrix_of(case, tmp_path_factory)[command]
    assert_one_paragraph_refusal(child, case)
    assert child.max_resident < _RESIDENT_BYTES, child.max_resident
    assert not (directory / "model" / "UNPICKLED").exists()
    assert not (directory / "model.pte").exists()


@pytest.mark.slow
def test_export_with_accept_weights_loads_a_missing_tensor_and_says_so_in_its_output(tmp_path: Path) -> None:
    """The option is the user's explicit word, and the output repeats it naming the tensor."""
    _BY_NAME["missing-q-proj"].make(tmp_path / "model")
    args = ["export", "model", "--backend", "portable", "--output", "model.pte", "--accept-weights"]
    child = run_writeback(args, tmp_path)
    assert child.status == 0, child.stderr[-3000:]
    text = " ".join(child.stdout.split())  # the console wraps the description line
    assert "--accept-weights accepted" in text and f"parameter {Q0!r} is missing" in text, child.stdout
    assert (tmp_path / "model.pte").is_file()


def test_an_attention_free_config_is_sized_without_heads_and_a_huge_one_still_refused_clear_error(
    tmp_path: Path,
) -> None:
    """Mamba and Mamba2 configs give no num_attention_heads: their size is worked out without
    attention (no K+V cache), and a claim larger than memory is still refused before building."""
    import json

    from writeback_decoders.folder_checks import check_config, model_nbytes

    mamba = {
        "model_type": "mamba",
        "vocab_size": 96,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
    }
    parameters, weights, cache = model_nbytes(check_config(mamba, "config.json"))
    assert (parameters, weights, cache) == (96 * 64 * 2 + 2 * (3 * 64 * 128 + 2 * 64) + 64, parameters * 4, 0)
    huge = {**mamba, "num_hidden_layers": 10**6, "hidden_size": 4096, "intermediate_size": 16384}
    (tmp_path / "config.json").write_text(json.dumps(huge))
    with pytest.raises(FolderRefused, match="too large to build"):
        check_folder(tmp_path)


def _moe_folder(path: Path) -> Path:
    """A tiny Qwen3-MoE folder as transformers saves it: one tensor per expert on disk, stacked
    into one parameter per layer in the model (``mlp.experts.gate_up_proj``)."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_check_folder_reads_experts_saved_one_tensor_per_expert_as_the_stacked_parameter(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _moe_folder(tmp_path / "moe")
    saved = load_file(folder / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in saved  # the per-expert form on disk
    assert check_folder(folder) == []
    del saved["model.layers.0.mlp.experts.3.up_proj.weight"]  # one expert's half of a stacked parameter
    save_file(saved, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FolderRefused, match=r"parameter 'model\.layers\.0\.mlp\.experts\.gate_up_proj' is missing"):
        check_folder(folder)

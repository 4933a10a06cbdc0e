"""No command prints ExecuTorch's ``register_pal() called multiple times`` line: writeback's
runtime and ExecuTorch's own bindings both load in one process (the XNNPACK partitioner, the
stock runtime and the LLM runner import the bindings), and only the bindings register a
platform layer. Real commands in fresh processes, their stderr read whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WRITEBACK = str(Path(sys.executable).with_name("writeback"))
MODEL = f"{Path(__file__).parents[1] / 'core' / 'lazy_state_model.py'}:kept_case"
LINE = "register_pal() called multiple times"


def _writeback(*arguments: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([WRITEBACK, *arguments], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_both_runtimes_load_in_one_process_without_the_register_pal_line() -> None:
    """Either import order: the stock bindings first (as run's lowering then runtime load
    them), then writeback's runtime first."""
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    native, stock = "writeback_pybind_runtime._native", "executorch.extension.pybindings._C"
    for order in ((stock, native), (native, stock)):
        done = subprocess.run([sys.executable, "-c", code, *order], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert LINE not in done.stderr, (order, done.stderr)


def test_run_on_xnnpack_prints_no_register_pal_line() -> None:
    done = _writeback("run", MODEL, "--backend", "xnnpack", "--steps", "2")
    assert "all 2 steps match eager" in done.stdout
    assert LINE not in done.stderr, done.stderr


@pytest.mark.slow
def test_export_explain_and_generate_print_no_register_pal_line(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["ab ba"] * 4, trainers.BpeTrainer(vocab_size=16, special_tokens=["<s>", "</s>"]))
    assert tokenizer.get_vocab_size() <= 16  # the model's vocabulary
    pte = tmp_path / "model.pte"
    stderr = [
        _writeback("export", MODEL, "--backend", "xnnpack", "--output", str(pte)).stderr,
        _writeback("explain", MODEL).stderr,
    ]
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    generated = _writeback("generate", str(pte), "--prompt", "ab", "--max-new-tokens", "3")
    assert "new tokens 3" in generated.stdout
    for text in [*stderr, generated.stderr]:
        assert LINE not in text, text

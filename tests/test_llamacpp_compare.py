"""docs/llamacpp_compare.py refuses with exit 2 and one paragraph where llama.cpp is not installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "llamacpp_compare.py"


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed")
def test_llamacpp_compare_exits_2_naming_what_is_missing_and_how_to_install_it(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "llama-cpp-python" in message and "is not installed" in message
    assert "-DGGML_NATIVE=OFF" in message
    assert "convert_hf_to_gguf.py" in message
    assert list(tmp_path.iterdir()) == [tmp_path / "tokenizer.json"]  # nothing written

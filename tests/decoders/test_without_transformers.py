"""Without transformers (the optional ``hf`` extra) the package imports, registers and offers
ExecuTorch's Llama example; the Hugging Face entry points say what to install.

transformers is made unimportable in a fresh interpreter (``sys.modules["transformers"] =
None``, as for a package that is not installed), before anything imports it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys
sys.modules["transformers"] = None  # not installed
from writeback_core.registry import load_registry
models = load_registry().models()
import writeback_decoders
errors = {}
for label, call in [
    ("hf_case", lambda: writeback_decoders.hf_case("some/folder")),
    ("sized_case", lambda: writeback_decoders.sized_case("hf-llama", 1)),
]:
    try:
        call()
    except writeback_decoders.TransformersMissingError as error:
        errors[label] = str(error)
case = models["et-llama"]
case.build()
print(json.dumps({
    "offered": sorted(n for n in models if n.startswith(("et-", "hf-"))),
    "sized": sorted(writeback_decoders.sizers()),
    "errors": errors,
    "tokens": [int(case.step_inputs(s)[0]) for s in range(3)],
}))
"""


def test_without_transformers_the_package_offers_et_llama_and_names_the_extra() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["offered"] == ["et-lfm2", "et-llama", "et-qwen3.5"]
    assert report["sized"] == ["et-lfm2", "et-llama", "et-qwen3.5"]
    assert set(report["errors"]) == {"hf_case", "sized_case"}
    for message in report["errors"].values():
        assert "pip install 'writeback-decoders[hf]'" in message
        assert "et-llama" in message
    assert report["tokens"][0] == 1 and len(report["tokens"]) == 3

"""A decoder `.pte` written by `writeback export` from a tiny Llama folder (its caches written by
``llama::update_cache``, read by ``llama::custom_sdpa``), fed the calls a careless or hostile
caller makes, in writeback's runtime and in ExecuTorch's stock runtime (``executorch.runtime``):
each is refused with an error (never a SIGABRT from a kernel's ``ET_CHECK``, never NaN logits),
and the caches are left as they were (the next call gives the logits it gives with no refused
call between). The calls run in a child process (tests/e2e/hostile_call_worker.py), so an
abort shows as this case failing, not as a dead pytest; after an abort the cases left run in a
new child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from writeback.cli import main

from tests.e2e.hostile_call_worker import CACHE, PROMPT, _cases

CASES = sorted(_cases())
RUNTIMES = ("writeback", "stock")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("hostile-llama")
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=CACHE,
        bos_token_id=0,
        eos_token_id=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pte(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile-pte") / "model.pte"
    result = CliRunner().invoke(main, ["export", str(folder), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "llama::update_cache" in " ".join(result.output.split())
    return out


def _run(pte: Path, pairs: list[str]) -> dict[str, dict[str, Any]]:
    """Each ``runtime/case`` pair's outcome, all in one child while none aborts; a case during
    which the child died is ``{"outcome": "abort"}``, and the cases after it run in a new child."""
    tests = Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    outcomes: dict[str, dict[str, Any]] = {}
    remaining = list(pairs)
    while remaining:
        done = subprocess.run(
            [sys.executable, "-m", "tests.e2e.hostile_call_worker", str(pte), *remaining],
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            env=env,
            timeout=600,
            check=False,
        )
        started = None
        for line in done.stdout.splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "start" in record:
                started = record["start"]
            else:
                outcomes[record["case"]] = record
                started = None
        if started is None and done.returncode != 0:
            pytest.fail(f"the worker failed outside a case (exit {done.returncode}):\n{done.stderr[-3000:]}")
        if started is not None:
            outcomes[started] = {"outcome": "abort", "exit": done.returncode, "stderr": done.stderr[-1500:]}
        remaining = [n for n in remaining if n not in outcomes]
    return outcomes


@pytest.fixture(scope="module")
def outcomes(pte: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """runtime -> case -> outcome; both runtimes' cases in one child process."""
    found = _run(pte, [f"{runtime}/{case}" for runtime in RUNTIMES for case in CASES])
    return {runtime: {case: found[f"{runtime}/{case}"] for case in CASES} for runtime in RUNTIMES}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_hostile_call_gets_a_clear_error_no_crash_no_partial_write(
    outcomes: dict[str, dict[str, dict[str, Any]]], runtime: str, case: str
) -> None:
    result = outcomes[runtime][case]
    assert result["outcome"] != "abort", f"{case} killed the {runtime} runtime's process: {result}"
    if result["outcome"] == "ok":
        # Only a layout the runtime makes correct may run: the same numbers as the contiguous call.
        assert case == "non_contiguous_tokens" and result["equals_contiguous_call"], result
        assert not result["nan"], result
    else:
        assert result["type"] in ("RuntimeError", "ValueError", "TypeError"), result
    assert result["unchanged"], f"{case}: the caches changed under a refused call in the {runtime} runtime"


def test_writeback_runtime_errors_name_the_input_expected_and_actual(
    outcomes: dict[str, dict[str, dict[str, Any]]],
) -> None:
    mine = outcomes["writeback"]
    assert "input 0" in mine["int32_tokens"]["message"] and "int64" in mine["int32_tokens"]["message"]
    assert "int32" in mine["int32_tokens"]["message"]
    assert "input 1" in mine["int32_positions"]["message"]
    assert "input 0" in mine["tokens_of_rank_1"]["message"] and "[3]" in mine["tokens_of_rank_1"]["message"]
    assert "input 0" in mine["tokens_of_batch_2"]["message"], mine["tokens_of_batch_2"]


def test_a_good_prefill_gives_transformers_logits_in_both_runtimes(folder: Path, pte: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.e2e.hostile_call_worker import _method

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        # The program returns the last position's logits only (what the runner reads).
        expected = model(PROMPT).logits[:, -1:]
    for runtime in RUNTIMES:
        got = _method(runtime, str(pte))([PROMPT, torch.arange(3)])[0]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# What writeback's runtime must say for each refused call: the input (index and name), the value
# the caller passed and the bound it broke, worked out by hand from the test folder (cache 16,
# vocabulary 96) and the case's inputs.
_NAMED = {
    "three_tokens_one_position": ("input 1 (positions)", "1 entry for 3 tokens", "takes 3"),
    "three_tokens_four_positions": ("input 1 (positions)", "4 entries for 3 tokens", "takes 3"),
    "tokens_of_batch_2": ("input 0 (tokens)", "batch 2", "batch 1"),
    "negative_positions": ("input 1 (positions)", "position -5 is below 0", f"[0, {CACHE})"),
    "huge_positions": ("input 1 (positions)", f"position {(1 << 40) + 2} ", f"[0, {CACHE})"),
    "positions_past_the_cache": ("input 1 (positions)", f"position {CACHE} ", f"[0, {CACHE})"),
    "zero_tokens": ("input 0 (tokens)", "0 tokens", f"1 to {CACHE}"),
    "zero_tokens_one_position": ("input 0 (tokens)", "0 tokens", f"1 to {CACHE}"),
    "more_tokens_than_the_cache": ("input 0 (tokens)", f"{CACHE + 1} tokens", f"1 to {CACHE}"),
    "token_id_past_the_vocabulary": ("input 0 (tokens)", "token id 1000", "[0, 96)"),
    "int32_tokens": ("input 0", "int32", "int64"),
    "float_tokens": ("input 0", "float32", "int64"),
    "int32_positions": ("input 1", "int32", "int64"),
    "tokens_of_rank_1": ("input 0", "[3]", "[1, 16]"),
    "positions_of_rank_2": ("input 1", "[1, 3]", "[16]"),
}


@pytest.mark.parametrize("case", sorted(_NAMED))
def test_writeback_runtime_refusal_names_the_input_the_value_and_the_bound(
    outcomes: dict[str, dict[str, dict[str, Any]]], case: str
) -> None:
    result = outcomes["writeback"][case]
    assert result["outcome"] == "error", result
    for fragment in _NAMED[case]:
        assert fragment in result["message"], f"{case}: {fragment!r} not in {result['message']!r}"


def test_every_refused_case_has_its_expected_message() -> None:
    assert set(_NAMED) == set(CASES) - {"non_contiguous_tokens"}


@pytest.mark.slow
def test_executorch_llama_input_pos_program_runs_the_runner_s_calls_and_refuses_a_bad_position(
    tmp_path: Path,
) -> None:
    """ExecuTorch's own Llama (`et-llama`, positions ``input_pos [1]``, 32-position cache): the
    runner's calls (a 3-token prefill at 0, a decode step at 3) give the stock runtime's logits in
    writeback's runtime, and a negative ``input_pos`` is refused naming the input, value and bound."""
    out = tmp_path / "et.pte"
    result = CliRunner().invoke(main, ["export", "et-llama", "--output", str(out)])
    assert result.exit_code == 0, result.output
    from tests.e2e.hostile_call_worker import _method

    calls = [[torch.tensor([[1, 2, 3]]), torch.tensor([0])], [torch.tensor([[4]]), torch.tensor([3])]]
    mine, stock = _method("writeback", str(out)), _method("stock", str(out))
    for inputs in calls:
        torch.testing.assert_close(mine(inputs)[0], stock(inputs)[0], rtol=0, atol=0)
    with pytest.raises(ValueError) as refused:
        mine([torch.tensor([[4]]), torch.tensor([-3])])
    for words in ("input 1 (positions)", "position -3 is below 0", "[0, 32)"):
        assert words in str(refused.value), str(refused.value)

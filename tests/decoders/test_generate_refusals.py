"""``writeback generate`` given what a careless or hostile user gives it: a damaged .pte, a
tokenizer that is a device, not JSON, broken or larger than the model's vocabulary, more new
tokens than the cache holds, a prompt longer than the cache. Each is exit 2 in one paragraph
naming the cause — the runner's own reason where the runner is the one that refuses —
never a traceback, never "Generation failed" alone.

Fast tier: the checks made before the runner starts, in this process. Slow tier: the real
command in a child process against a .pte that ``writeback export`` wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from writeback.generate_checks import RunnerLog, tokenizer_problem

from tests.decoders.test_hostile_folders import MISLEADING, Child, run_writeback
from tests.hostile import write_folder

_BPE = {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}


def _tokenizer_json(path: Path, added_ids: tuple[int, ...] = ()) -> Path:
    added = [{"id": i, "content": f"<t{i}>", "special": True} for i in added_ids]
    path.write_text(json.dumps({"version": "1.0", "model": _BPE, "added_tokens": added}))
    return path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: Path("/dev/zero"), "/dev/zero is not a regular file"),
        (lambda p: p, "is not a regular file"),  # the temporary directory itself
        (lambda p: (p / "t.json").touch() or p / "t.json", "t.json is empty"),
        (lambda p: (p / "t.json").write_text("garbage") and p / "t.json", "t.json is not valid JSON"),
        (lambda p: (p / "t.json").write_text("[1]") and p / "t.json", "not a tokenizer.json"),
        (
            lambda p: _tokenizer_json(p / "t.json", (7, 300)),
            "token ids up to 300, but the program's vocabulary holds 128",
        ),
    ],
    ids=["dev-zero", "directory", "empty", "not-json", "json-array", "ids-past-vocabulary"],
)
def test_tokenizer_problem_names_the_file_and_the_cause_before_anything_reads_it(
    make: object, says: str, tmp_path: Path
) -> None:
    path = make(tmp_path)  # type: ignore[operator]  # the parametrized makers
    problem = tokenizer_problem(path, vocab_size=128)
    assert problem is not None and says in problem, problem


def test_tokenizer_problem_passes_a_tokenizer_inside_the_vocabulary(tmp_path: Path) -> None:
    assert tokenizer_problem(_tokenizer_json(tmp_path / "t.json", (3,)), vocab_size=4) is None
    # One id past: the highest id must be below the vocabulary size.
    assert tokenizer_problem(_tokenizer_json(tmp_path / "t.json", (4,)), vocab_size=4) is not None


def test_runner_reason_keeps_the_runner_lines_that_say_why_and_drops_its_noise() -> None:
    log = RunnerLog(
        "[llm_runner_helper.cpp:294] Using method: forward\n"
        "[cpuinfo_utils.cpp:87] Failed to open midr file /sys/devices/soc0/image_version\n"
        "[text_llm_runner.cpp:153] pos_ 0 + num_prompt_tokens 20 >= max_context_len 16, Max seq length exceeded\n"
    )
    assert log.reason() == "pos_ 0 + num_prompt_tokens 20 >= max_context_len 16, Max seq length exceeded"


def test_max_new_tokens_past_int32_is_refused_exit_2_not_a_type_error(tmp_path: Path) -> None:
    (tmp_path / "model.pte").write_bytes(b"\0" * 64)
    child = run_writeback(["generate", "model.pte", "--prompt", "a", "--max-new-tokens", "2147483648"], tmp_path)
    _assert_refused(child, "2147483648 is not in the range 1<=x<=2147483647")


def _assert_refused(child: Child, *says: str) -> None:
    assert child.status == 2, (child.status, child.stderr[-2000:])
    assert "Traceback" not in child.stderr, child.stderr[-2000:]
    error = child.stderr[child.stderr.index("Error: ") :].strip()
    assert len(error.splitlines()) == 1, error
    for words in says:
        assert words in error, (words, error)
    for misleading in MISLEADING:
        assert misleading not in error, (misleading, error)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder (cache of 32 positions) exported for the stock runner, with a
    tokenizer trained here whose ids lie inside the model's 128-token vocabulary."""
    from tests.decoders.test_llm_runner import _tokenizer

    root = tmp_path_factory.mktemp("generate")
    write_folder(root / "model")
    assert _tokenizer(root / "model").get_vocab_size() <= 128
    child = run_writeback(["export", "model", "--backend", "portable", "--output", "out/model.pte"], root)
    assert child.status == 0, child.stderr[-3000:]
    return root / "out"


_LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["damaged.pte", "--tokenizer", "tokenizer.json"], ("damaged.pte", "File size is too small")),
        (["model.pte", "--tokenizer", "/dev/zero"], ("/dev/zero", "not a regular file")),
        (["model.pte", "--tokenizer", "broken.model"], ("broken.model", "could not parse")),
        (["model.pte", "--tokenizer", "wide.json"], ("wide.json", "token ids up to 4000", "holds 128")),
        (["model.pte", "--max-new-tokens", "32"], ("--max-new-tokens 32", "holds 32 positions", "at most 31")),
        (["model.pte", "--max-new-tokens", "4", "--prompt", _LONG_PROMPT], ("num_prompt_tokens", "max_context_len 32")),
    ],
    ids=["damaged-pte", "tokenizer-dev-zero", "broken-tokenizer", "ids-past-vocabulary", "new-tokens", "long-prompt"],
)
def test_generate_refuses_exit_2_naming_the_cause(exported: Path, args: list[str], says: tuple[str, ...]) -> None:
    (exported / "damaged.pte").write_bytes((exported / "model.pte").read_bytes()[:3000])
    (exported / "broken.model").write_bytes(b"not a sentencepiece model")
    wide = json.loads((exported / "tokenizer.json").read_text())
    wide["added_tokens"].append({"id": 4000, "content": "<wide>", "special": True})
    (exported / "wide.json").write_text(json.dumps(wide))
    prompt = [] if "--prompt" in args else ["--prompt", "the quick"]
    child = run_writeback(["generate", *args, *prompt], exported)
    _assert_refused(child, *says)


@pytest.mark.slow
def test_generate_still_generates_within_the_cache(exported: Path) -> None:
    """The checks refuse only what the runner cannot do: the default asks for no more than fits."""
    child = run_writeback(["generate", "model.pte", "--prompt", "the quick"], exported)
    assert child.status == 0, child.stderr[-3000:]
    assert "new tokens" in child.stdout

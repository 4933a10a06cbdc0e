"""The LLM runner's contract: each rule refuses the program that breaks it, naming what is wrong,
and a program that keeps it passes (the runner itself loading one is tested in
tests/decoders/test_llm_runner.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from writeback_core.llm_runner import (
    RunnerContractError,
    check_runner_contract,
    runner_contract_problems,
    runner_metadata,
)

VOCAB = 11


class _Decoder(nn.Module):
    """forward(tokens [1, n], positions) -> logits, with a cache buffer written at the positions."""

    def __init__(self, outputs: int = 1, flat_logits: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, VOCAB)
        self.register_buffer("cache", torch.zeros(8, 4))
        self.outputs = outputs
        self.flat_logits = flat_logits

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> Any:
        x = self.embed(tokens)
        self.cache.index_copy_(0, positions, x[0, -1:])
        logits = self.head(x + self.cache.sum())
        if self.flat_logits:
            logits = logits[:, -1]
        return (logits, x) if self.outputs == 2 else logits


def _export(module: nn.Module, *args: torch.Tensor, dynamic: bool = False) -> Any:
    shapes = None
    if dynamic:
        n = torch.export.Dim("n", min=1, max=8)
        shapes = ({1: n}, None)
    return torch.export.export(module, args, dynamic_shapes=shapes, strict=False)


def _tokens(n: int = 1) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64).reshape(1, n)


def _position() -> torch.Tensor:
    return torch.tensor([0], dtype=torch.int64)


def _meta(**changes: Any) -> dict[str, Any]:
    meta = runner_metadata(
        max_seq_len=1, max_context_len=8, vocab_size=VOCAB, bos_id=0, eos_ids=[1], dynamic_shape=False
    )
    meta.update(changes)
    return meta


@pytest.mark.parametrize("flat", [False, True])
def test_a_program_keeping_the_contract_passes(flat: bool) -> None:
    program = _export(_Decoder(flat_logits=flat), _tokens(), _position())
    assert runner_contract_problems(program, _meta()) == []
    check_runner_contract(program, _meta())


def test_a_dynamic_token_dimension_with_enable_dynamic_shape_passes() -> None:
    program = _export(_Decoder(), _tokens(3), _position(), dynamic=True)
    assert runner_contract_problems(program, _meta(enable_dynamic_shape=True, get_max_seq_len=8)) == []


def test_refused_missing_max_seq_len_the_runner_requires() -> None:
    program = _export(_Decoder(), _tokens(), _position())
    meta = _meta()
    del meta["get_max_seq_len"]
    with pytest.raises(RunnerContractError, match="get_max_seq_len is missing"):
        check_runner_contract(program, meta)


def test_refused_a_second_output_which_aborts_the_runner() -> None:
    program = _export(_Decoder(outputs=2), _tokens(), _position())
    with pytest.raises(RunnerContractError, match="returns 2 outputs; the runner takes exactly one"):
        check_runner_contract(program, _meta())


def test_refused_a_third_input_such_as_a_caller_owned_cache() -> None:
    class WithState(nn.Module):
        def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
            cache.index_copy_(0, positions, tokens.float())
            return cache.sum(0, keepdim=True).unsqueeze(0).expand(1, 1, VOCAB).clone()

    program = _export(WithState(), _tokens(), _position(), torch.zeros(8, 1))
    with pytest.raises(RunnerContractError, match=r"forward takes 3 inputs.*keep it as a module buffer"):
        check_runner_contract(program, _meta())


def test_refused_enable_dynamic_shape_on_a_static_token_dimension() -> None:
    program = _export(_Decoder(), _tokens(), _position())
    with pytest.raises(RunnerContractError, match="enable_dynamic_shape is true but the token dimension is static"):
        check_runner_contract(program, _meta(enable_dynamic_shape=True))


def test_refused_a_dynamic_token_dimension_the_metadata_hides() -> None:
    program = _export(_Decoder(), _tokens(3), _position(), dynamic=True)
    with pytest.raises(RunnerContractError, match="dynamic but enable_dynamic_shape is false"):
        check_runner_contract(program, _meta())


def test_refused_a_static_token_dimension_above_one() -> None:
    program = _export(_Decoder(), _tokens(4), _position())
    with pytest.raises(RunnerContractError, match="static token dimension of 4"):
        check_runner_contract(program, _meta())


def test_refused_a_vocab_size_the_logits_do_not_have() -> None:
    program = _export(_Decoder(), _tokens(), _position())
    with pytest.raises(RunnerContractError, match=f"get_vocab_size is 12 but the logits' last dimension is {VOCAB}"):
        check_runner_contract(program, _meta(get_vocab_size=12))


def test_refused_tokens_that_are_not_int64() -> None:
    class FloatTokens(_Decoder):
        def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> Any:
            return super().forward(tokens.long(), positions)

    program = _export(FloatTokens(), _tokens().int(), _position())
    with pytest.raises(RunnerContractError, match=r"input 0 \(tokens\) must be int64 \[1, n\], got int32 \[1, 1\]"):
        check_runner_contract(program, _meta())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"get_max_seq_len": 0}, "get_max_seq_len must be a positive int, got 0"),
        ({"get_max_context_len": 4, "get_max_seq_len": 8}, r"get_max_context_len \(4\) is below get_max_seq_len \(8\)"),
        ({"use_kv_cache": 1}, "use_kv_cache must be a bool, got 1"),
        ({"use_kv_cache": False}, "use_kv_cache is false"),
        ({"get_bos_id": "1"}, "get_bos_id must be an int"),
        ({"get_eos_ids": [1, "2"]}, "get_eos_ids must be a list of ints"),
    ],
)
def test_refused_metadata_of_the_wrong_kind_naming_the_method(change: dict[str, Any], message: str) -> None:
    program = _export(_Decoder(), _tokens(), _position())
    with pytest.raises(RunnerContractError, match=message):
        check_runner_contract(program, _meta(**change))


def test_every_problem_is_named_at_once() -> None:
    program = _export(_Decoder(outputs=2), _tokens(), _position())
    problems = runner_contract_problems(program, _meta(get_vocab_size=12, enable_dynamic_shape=True))
    assert len(problems) == 3, problems

"""``DecoderContract.check`` on ExecuTorch's own decoder form, whose positions input is
``input_pos [1]`` (the first position of the call), and on the per-token form's bounds at the
cache's last row. The Hugging Face form through a real exported program is in
tests/e2e/test_hostile_calls.py; these contracts are written by hand (a 32-position cache,
calls of up to 32 tokens, a 128-token vocabulary)."""

from __future__ import annotations

import pytest
import torch
from writeback_pybind_runtime import DecoderContract

ET_FORM = DecoderContract(cache=32, per_call=32, vocab=128, one_position=True)
HF_FORM = DecoderContract(cache=32, per_call=32, vocab=128, one_position=False)


def test_input_pos_form_takes_a_prefill_and_a_decode_step_that_fit() -> None:
    ET_FORM.check([torch.tensor([[1, 2, 3]]), torch.tensor([0])])
    ET_FORM.check([torch.tensor([[4]]), torch.tensor([31])])
    ET_FORM.check([torch.ones(1, 32, dtype=torch.int64), torch.tensor([0])])


@pytest.mark.parametrize(
    ("tokens", "positions", "says"),
    [
        ([[1, 2, 3]], [0, 1, 2], ("input 1 (positions)", "3 entries for 3 tokens", "takes 1", "input_pos")),
        ([[1, 2]], [31], ("input 1 (positions)", "rows 31 to 32", "below 32")),
        ([[1]], [-1], ("input 1 (positions)", "position -1 is below 0", "[0, 32)")),
        ([[1]], [32], ("input 1 (positions)", "position 32 ", "[0, 32)")),
        ([[128]], [0], ("input 0 (tokens)", "token id 128", "[0, 128)")),
        ([[-1]], [0], ("input 0 (tokens)", "token id -1", "[0, 128)")),
    ],
    ids=["one-per-token", "last-row-past-the-end", "negative", "at-the-end", "token-past-vocab", "negative-token"],
)
def test_input_pos_form_refuses_naming_the_input_the_value_and_the_bound(
    tokens: list[list[int]], positions: list[int], says: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as refused:
        ET_FORM.check([torch.tensor(tokens), torch.tensor(positions)])
    for words in says:
        assert words in str(refused.value), (words, str(refused.value))


def test_per_token_form_takes_the_cache_s_last_row_and_refuses_one_past_it() -> None:
    HF_FORM.check([torch.tensor([[1, 2]]), torch.tensor([30, 31])])
    with pytest.raises(ValueError, match=r"position 32 is past the cache's end"):
        HF_FORM.check([torch.tensor([[1, 2]]), torch.tensor([31, 32])])


def test_inputs_of_another_dtype_or_rank_are_left_to_the_method_s_own_checks() -> None:
    HF_FORM.check([torch.tensor([[1.0, 2.0]]), torch.tensor([-7, 99])])
    HF_FORM.check([torch.tensor([1, 2]), torch.tensor([-7, 99])])

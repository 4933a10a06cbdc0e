"""``writeback explain`` says how the MLX delegate will execute a program: the path a
run gets (compiled, with its attention windows, or interpreted and why), worked out by
lowering the program as ``run --backend mlx`` does and loading each partition."""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from writeback.explain import explain_notes
from writeback.model_build import export_case
from writeback.zoo import DecoderConfig, decoder_case

from tests.mlx_backend.lowering import export_module, registry


class CallerRows(torch.nn.Module):
    """Writes a row of a caller's tensor: the write needs its region mid-graph."""

    def forward(self, pos: torch.Tensor, row: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, row)
        return cache.sum(0)


class OwnRows(torch.nn.Module):
    """The same write into a buffer the delegate owns: nothing forces the interpreted path."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, row)
        return self.cache.sum(0)


def _notes_of(program: ExportedProgram) -> list[str]:
    return explain_notes(program, registry())


def _notes(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> list[str]:
    return _notes_of(export_module(module, args))


def test_explain_says_a_caller_write_is_interpreted_and_why() -> None:
    notes = _notes(CallerRows(), (torch.tensor([0]), torch.ones(1, 4), torch.zeros(8, 4)))
    assert len(notes) == 1
    head, path = notes[0].split(": ", 1)
    assert head.startswith("mlx execution, partition 1 of 1 (") and head.endswith(" ops)")
    assert path.startswith("interpreted: it writes a caller's tensor in place")


def test_explain_says_an_owned_buffer_write_is_compiled() -> None:
    (note,) = _notes(OwnRows(), (torch.tensor([0]), torch.ones(1, 4)))
    assert note.endswith("): compiled")


def test_explain_of_a_long_cache_decoder_names_its_attention_window() -> None:
    """The built-in decoder at 64 positions: the causal mask from the position input bounds
    each layer's softmax (two layers: two softmaxes), and explain's mlx execution line says so,
    with the window lengths a call can take (32 and 48 of 64). Through the notes hook alone
    (the README's explain block runs the same line through the CLI)."""
    program = export_case(decoder_case(DecoderConfig(max_seq=64, layers=2)))
    (last,) = [line for line in _notes_of(program) if line.startswith("mlx execution, partition")]
    assert last.startswith("mlx execution, partition 1 of 1 ("), last
    assert last.endswith(
        "compiled; attention over 2 masked softmax(es) bounded by input_pos: "
        "32..48 of 64 positions where the mask allows; bounded only where the removed rows are "
        "known finite, else over the whole axis; 5 RMSNorm(s) as mx.fast.rms_norm; "
        "2 attention(s) as mx.fast.scaled_dot_product_attention"
    ), last

"""The words `writeback run` uses for where a state lives and what copy is left, for every
kind of place, and the grouped lines past eight states (a many-layer decoder)."""

from __future__ import annotations

import torch
from writeback.lowered_lines import place_text, state_lines
from writeback_core.lowered import StatePlace
from writeback_core.mutations import Mutation, MutationKind, WriteKind, WriteShape


def _place(target: str, owner: str, **fields: object) -> StatePlace:
    kind = MutationKind.USER_INPUT if owner == "caller" else MutationKind.BUFFER
    mutation = Mutation(kind, target, target, "v", 0, WriteShape(WriteKind.INDEX_COPY), (4, 8), torch.float32)
    values: dict[str, object] = {"backend": "mlx", "delegate": None, "writers": (), "in_place": False, "copy_bytes": 0}
    values.update(fields)
    return StatePlace(mutation, owner, **values)  # type: ignore[arg-type]  # each field's own type


def test_each_place_is_named_with_its_delegate_and_whether_a_copy_is_left() -> None:
    assert place_text(_place("k", "delegate", delegate=1, in_place=True)) == (
        "inside delegate 1 (mlx), written in place; no copy left"
    )
    assert place_text(_place("k", "delegate", delegate=0)) == "inside delegate 0 (mlx); no copy left"
    assert place_text(_place("c", "caller", delegate=0, writers=(0,), in_place=True)) == (
        "caller tensor, written in place by delegate 0 (mlx); no copy left"
    )
    assert place_text(_place("c", "caller", copy_bytes=128)) == "caller tensor; whole-state copy left (128 B/call)"
    assert place_text(_place("b", "program", copy_bytes=2048)) == "program buffer; whole-state copy left (2.0 KiB/call)"
    assert place_text(_place("b", "program", writers=(0, 2), in_place=True)) == (
        "program buffer, written in place by one of delegates 0, 2 (mlx); no copy left"
    )


def test_past_eight_states_one_line_per_kind_of_place_names_count_bytes_first_and_last() -> None:
    places = [_place(f"layers.{i}.k_cache", "delegate", delegate=0, in_place=True) for i in range(9)]
    places.append(_place("layers.9.k_cache", "program", copy_bytes=128))
    lines = state_lines(places)
    assert lines == [
        "  9 states, 1.1 KiB (layers.0.k_cache ... layers.8.k_cache): inside delegate 0 (mlx), written in place; "
        "no copy left",
        "  1 state, 128 B (layers.9.k_cache): program buffer; whole-state copy left (128 B/call)",
    ]


def test_up_to_eight_states_one_line_each_with_its_size() -> None:
    lines = state_lines([_place("a", "program", copy_bytes=128), _place("b", "caller")])
    assert lines == [
        "  a (128 B): program buffer; whole-state copy left (128 B/call)",
        "  b (128 B): caller tensor; no copy left",
    ]

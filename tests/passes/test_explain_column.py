"""The ``writeback_explain_columns`` hookimpl of writeback-passes: the "early write-back" column."""

from __future__ import annotations

import re

from click.testing import CliRunner
from writeback.cli import main
from writeback.model_build import export_case
from writeback.zoo import builtin_models
from writeback_core import MutationKind, find_mutations, load_registry
from writeback_passes import plugin

from tests.conftest import Decomposition

_CELL = re.compile(r"node (\d+) \(value ready at (\d+)\); value lives (\d+) steps, (-?\d+) fewer than stock")


def _columns(name: str) -> dict[str, tuple[MutationKind, str]]:
    program = export_case(builtin_models()[name])
    registry = load_registry(entry_points=False, plugins=[plugin])
    found = {}
    for mutation in find_mutations(program.run_decompositions()):
        answers = registry.hook.writeback_explain_columns(program=program, mutation=mutation)
        cells = [a["early write-back"] for a in answers if a and "early write-back" in a]
        assert len(cells) == 1
        found[mutation.target] = (mutation.kind, cells[0])
    return found


def test_writeback_explain_columns_places_decoder_copies_right_after_their_values() -> None:
    cells = _columns("decoder")
    assert set(cells) == {"blocks.0.k_cache", "blocks.0.v_cache"}
    for _kind, cell in cells.values():
        match = _CELL.fullmatch(cell)
        assert match, cell
        copy, value, _lives, saved = map(int, match.groups())
        assert copy == value + 1
        assert saved > 0


def test_writeback_explain_columns_moves_caller_cache_copies_too() -> None:
    for kind, cell in _columns("decoder-caller-cache").values():
        assert kind is MutationKind.USER_INPUT
        match = _CELL.fullmatch(cell)
        assert match, cell
        copy, value, _lives, saved = map(int, match.groups())
        assert copy == value + 1
        assert saved > 0


def test_explain_command_shows_the_early_write_back_column() -> None:
    result = CliRunner().invoke(main, ["explain", "ema"])
    assert result.exit_code == 0, result.output
    # rich wraps cells, so look for single words of the column title and cell.
    assert "early" in result.output and "fewer" in result.output


def test_the_early_write_back_column_decomposes_the_program_once_for_both_of_its_lowerings(
    decompositions: list[Decomposition],
) -> None:
    """Its stock and early lowerings start from one ``to_edge`` (the decomposition is the
    costly step of a lowering at real size); the second lowers a copy of the graphs."""
    from writeback_passes.explain_columns import early_write_back_columns

    program = export_case(builtin_models()["decoder"])
    mutation = find_mutations(program.run_decompositions())[0]
    decompositions.clear()
    cell = early_write_back_columns(program, mutation)["early write-back"]
    assert _CELL.fullmatch(cell), cell
    assert len(decompositions) == 1, f"the column decomposed the program {len(decompositions)} times"

"""The one derivation of a write's arguments that the predictor and the lowering share."""

from __future__ import annotations

import pytest
import torch
from writeback_core.mutations import Dynamic, find_mutations
from writeback_core.types import EngineWrite
from writeback_trt_copyback import KVAliasEngine, WriteStatus, engine_write, resolve_bounds
from writeback_trt_copyback._blob import Blob

from tests.trt_copyback.conftest import compile_quietly, export
from tests.trt_copyback.models import SliceWrite

S = slice(None)


def _write(index: tuple[slice, ...], update: tuple[int, ...], shape: tuple[int, ...] = (1, 2, 16, 4)) -> EngineWrite:
    program = export(SliceWrite(shape, index), (torch.zeros(update),)).run_decompositions()
    (mutation,) = find_mutations(program)
    nodes = {n.name: n for n in program.graph.nodes}
    return engine_write(nodes[mutation.value], nodes[mutation.placeholder])


@pytest.mark.parametrize("step", [1, 2, 3])
def test_step_is_returned_unchanged(step: int) -> None:
    count = len(range(0, 9, step))
    bounds = resolve_bounds(_write((S, S, slice(0, 9, step), S), (1, 2, count, 4)))
    assert bounds.status is WriteStatus.OK and bounds.step == step and bounds.length == count


def test_negative_bounds_are_counted_from_the_end() -> None:
    bounds = resolve_bounds(_write((S, S, slice(-4, -2), S), (1, 2, 2, 4)))
    assert (bounds.dim, bounds.start, bounds.length) == (2, 12, 2)


def test_open_end_is_clamped_and_said_so() -> None:
    open_end = _write((S, S, slice(3, None), S), (1, 2, 13, 4))
    assert open_end.clamped and resolve_bounds(open_end).length == 13
    closed = _write((S, S, slice(3, 16), S), (1, 2, 13, 4))
    assert not closed.clamped


@pytest.mark.parametrize("index", [(S, S, slice(0, 16), S), (S, S, S, S)], ids=["explicit", "omitted"])
def test_full_overwrite_is_its_own_status(index: tuple[slice, ...]) -> None:
    assert resolve_bounds(_write(index, (1, 2, 16, 4))).status is WriteStatus.FULL_OVERWRITE


def test_runtime_bound_is_dynamic_never_a_guess() -> None:
    write = _write((S, S, slice(3, 4), S), (1, 2, 1, 4))
    shape = write.write
    dynamic = EngineWrite(
        write=type(shape)(**{**shape.__dict__, "end": Dynamic("s0 + 3")}), shape=write.shape, direct_input=True
    )
    assert resolve_bounds(dynamic).status is WriteStatus.DYNAMIC_BOUNDS
    assert "run time" in str(KVAliasEngine().alias_refusal(dynamic))


def test_bad_dim_is_its_own_status_and_refused() -> None:
    write = _write((S, S, slice(3, 4), S), (1, 2, 1, 4))
    bad = EngineWrite(
        write=type(write.write)(**{**write.write.__dict__, "dim": 7}), shape=write.shape, direct_input=True
    )
    assert resolve_bounds(bad).status is WriteStatus.BAD_DIM
    assert "does not index the cache" in str(KVAliasEngine().alias_refusal(bad))


def test_the_lowering_writes_the_slots_the_predictor_derived() -> None:
    # -4:-2 of 16 slots is 12:14; the engine's in-place step must say so, not -4 or 2.
    compiled = compile_quietly(export(SliceWrite((1, 2, 16, 4), (S, S, slice(-4, -2), S)), (torch.zeros(1, 2, 2, 4),)))
    program = compiled.exported_program()
    (lowered,) = [m for _, m in program.graph_module.named_children() if hasattr(m, "processed_bytes")]
    (step,) = [s for s in Blob.from_bytes(lowered.processed_bytes).steps if "update" in s]
    assert (step["update"], step["dim"], step["start"], step["length"]) == ("slice", 2, 12, 2)

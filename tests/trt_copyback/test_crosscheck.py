"""After lowering: the prediction against the engine's real aliased_io, and the markers, both ways."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.export import ExportedProgram
from writeback_core import meta
from writeback_trt_copyback import (
    AliasMismatchError,
    KVAliasEngine,
    MarkerFaultError,
    UninitializedCopyBackWarning,
    check_aliasing,
    check_markers,
    declare_copy_back,
    lift_mutated_buffers,
)

from tests.trt_copyback.conftest import compile_quietly, export
from tests.trt_copyback.models import DeadAndLive, IndexCopyWrite, ReadOutside


def _args() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, 1, 4, generator=torch.Generator().manual_seed(3)), torch.tensor([2])


def _lower(module: torch.nn.Module, engine: KVAliasEngine, partitioners: list[Any] | None = None) -> ExportedProgram:
    """Lift, declare and lower, stopping before the checks."""
    from executorch.exir import to_edge_transform_and_lower

    lifted = lift_mutated_buffers(export(module, _args()), engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UninitializedCopyBackWarning)
        declared = declare_copy_back(lifted.program)
    edge = to_edge_transform_and_lower(
        declared, partitioner=partitioners if partitioners is not None else [engine.partitioner()]
    )
    program: ExportedProgram = edge.exported_program()
    return program


def test_predicted_aliased_write_that_the_engine_did_not_alias_raises_naming_min_block_size() -> None:
    engine = KVAliasEngine(min_block_size=50)
    with pytest.raises(AliasMismatchError) as error:
        compile_quietly(export(IndexCopyWrite((1, 2, 16, 4), 2), _args()), engine)
    message = str(error.value)
    assert "['cache']" in message and "write-back would be lost" in message
    assert "min_block_size (50)" in message and "min_block_size=1 rules that out" in message


def test_at_min_block_size_1_the_message_names_what_kept_the_write_out_instead() -> None:
    # The predicate knows of no exclusion, the partitioner it is paired with does.
    engine = KVAliasEngine()
    partitioner = KVAliasEngine(excluded_ops=("aten.index_put",)).partitioner()
    with pytest.raises(AliasMismatchError) as error:
        lowered = _lower(IndexCopyWrite((1, 2, 16, 4), 2), engine, [partitioner])
        check_aliasing(lowered, engine)
    message = str(error.value)
    assert "['cache']" in message and "not offered to the engine" in message
    assert "min_block_size" not in message


def test_copy_back_write_that_the_engine_aliased_raises() -> None:
    engine = KVAliasEngine(excluded_ops=("aten.amax",))
    lifted = lift_mutated_buffers(export(ReadOutside(), _args()), engine)
    assert lifted.copy_back == ["cache"]  # the classifier sees amax read the old cache
    with pytest.raises(AliasMismatchError) as error:
        check_aliasing(_lower(ReadOutside(), engine), engine)
    message = str(error.value)
    assert "wrote ['cache'] in place, but they were filed copy-back" in message
    assert "read outside the engine" in message


def test_both_directions_pass_when_prediction_and_engine_agree() -> None:
    engine = KVAliasEngine()
    lowered = _lower(DeadAndLive(), engine)
    aliasing = check_aliasing(lowered, engine)
    assert aliasing.buffers == {"live"} and aliasing.engines == 1


def test_no_cross_check_when_no_engine_was_built() -> None:
    engine = KVAliasEngine(min_block_size=50)
    compiled = compile_quietly(export(IndexCopyWrite((1, 2, 16, 4), 2), _args()), engine, dryrun=True)
    assert compiled.lifted.aliased == ["cache"] and compiled.aliased == []
    # It is the flag that skips, not the absence of engines: the same program, checked, raises.
    lowered = _lower(IndexCopyWrite((1, 2, 16, 4), 2), engine, [])
    assert check_aliasing(lowered, engine, engines_built=False).engines == 0
    with pytest.raises(AliasMismatchError):
        check_aliasing(lowered, engine, engines_built=True)


def _write_of(program: ExportedProgram, buffer: str) -> torch.fx.Node:
    """The write into ``buffer`` inside the engine's delegate."""
    from writeback_trt_copyback.crosscheck import _graphs, _writes_into

    for _, caches in list(_graphs(program))[1:]:
        if buffer in caches:
            (write,) = _writes_into(caches[buffer])
            return write
    raise AssertionError(f"no write of {buffer} in a delegate")


def _strip(node: torch.fx.Node) -> None:
    custom = dict(node.meta.get("custom", {}))
    custom.pop(meta.NO_ALIAS, None)
    node.meta["custom"] = custom


@pytest.fixture
def lowered() -> ExportedProgram:
    program = _lower(DeadAndLive(), KVAliasEngine())
    check_markers(program, ["dead"])  # as lowered: the marker is where lift put it
    return program


def test_marker_lost_is_detected(lowered: ExportedProgram) -> None:
    _strip(_write_of(lowered, "dead"))
    with pytest.raises(MarkerFaultError, match=r"lost: the write of 'dead'"):
        check_markers(lowered, ["dead"])


def test_marker_gained_is_detected(lowered: ExportedProgram) -> None:
    meta.set_custom(_write_of(lowered, "live"), meta.NO_ALIAS, "live")
    with pytest.raises(MarkerFaultError, match=r"gained: .* for 'live', which lift never marked"):
        check_markers(lowered, ["dead"])


def test_marker_moved_is_detected(lowered: ExportedProgram) -> None:
    _strip(_write_of(lowered, "dead"))
    meta.set_custom(_write_of(lowered, "live"), meta.NO_ALIAS, "dead")
    with pytest.raises(MarkerFaultError, match=r"moved: the marker of 'dead' is on"):
        check_markers(lowered, ["dead"])


def test_marker_recorded_but_never_set_is_detected(lowered: ExportedProgram) -> None:
    with pytest.raises(MarkerFaultError, match=r"lost: the write of 'live'"):
        check_markers(lowered, ["dead", "live"])

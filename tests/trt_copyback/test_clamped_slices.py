"""Slice writes whose bounds Python slicing clamps: aliased, and written exactly where eager writes.

``cache[:, :, 3:, :] = v`` is exported with its end as ``2**63-1``; a bound past
the end or before the start is kept as written too. The rule decides on the
bounds clamped as Python slicing clamps them (as Torch-TensorRT does before it
aliases such a write), and the engine writes exactly those slots. Each case runs
through the real lowering and the pybind-runtime against eager PyTorch, and the
slots the engine's blob names are checked against the ones worked out by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
from writeback_trt_copyback import KVAliasEngine, TensorRTCacheRule, engine_write, lift_mutated_buffers, resolve_bounds
from writeback_trt_copyback.kv_alias_backend import _check_slice_source
from writeback_trt_copyback.kv_alias_delegate import KVAliasRuntimeDelegate

from tests.trt_copyback.conftest import compile_quietly, export, run_against_eager
from tests.trt_copyback.models import SliceWrite

S = slice(None)
SHAPE = (1, 2, 16, 4)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _blob(module: torch.nn.Module, update: torch.Tensor) -> dict[str, object]:
    """The engine's blob for ``module``, as the lowering wrote it."""
    program = compile_quietly(export(module, (update,))).exported_program()
    (lowered,) = [m for _, m in program.graph_module.named_children() if hasattr(m, "processed_bytes")]
    record: dict[str, object] = json.loads(lowered.processed_bytes)
    return record


def _slice_steps(record: dict[str, object]) -> list[dict[str, object]]:
    steps = record["steps"]
    assert isinstance(steps, list)
    return [s for s in steps if s.get("update") == "slice"]


@pytest.mark.parametrize(
    ("bounds", "slots"),
    [
        # By hand, in a 16-slot sequence dim: 3: is 3..15 (13 slots); 14:20 stops at the end,
        # 14..15; -20:2 starts at 0 (-20 + 16 < 0), 0..1; -3: is 13..15.
        pytest.param(slice(3, None), (3, 13), id="open_end"),
        pytest.param(slice(14, 20), (14, 2), id="end_past_the_end"),
        pytest.param(slice(-20, 2), (0, 2), id="negative_start_before_the_start"),
        pytest.param(slice(-3, None), (13, 3), id="negative_start_open_end"),
    ],
)
def test_clamped_slice_write_is_aliased_and_matches_eager(bounds: slice, slots: tuple[int, int]) -> None:
    index = (S, S, bounds, S)
    length = slots[1]
    (cls,) = lift_mutated_buffers(export(SliceWrite(SHAPE, index), (_rand(1, 2, length, 4),)), KVAliasEngine()).buffers
    assert cls.aliased, cls.reason
    (step,) = _slice_steps(_blob(SliceWrite(SHAPE, index), _rand(1, 2, length, 4)))
    assert (step["dim"], step["start"], step["length"]) == (2, *slots)
    compiled = run_against_eager(lambda: SliceWrite(SHAPE, index), lambda s: (_rand(1, 2, length, 4, seed=s),))
    assert compiled.aliased == ["cache"] and compiled.copy_back == []


def test_slice_write_clamped_to_no_slot_is_copied_back_and_matches_eager() -> None:
    # 20: of 16 slots is empty: nothing to alias; the rule says why and eager's no-op holds.
    index = (S, S, slice(20, None), S)
    (cls,) = lift_mutated_buffers(export(SliceWrite(SHAPE, index), (_rand(1, 2, 0, 4),)), KVAliasEngine()).buffers
    assert not cls.aliased and "writes no slot once its bounds are clamped" in str(cls.reason), cls.reason
    compiled = run_against_eager(lambda: SliceWrite(SHAPE, index), lambda s: (_rand(1, 2, 0, 4, seed=s),))
    assert compiled.aliased == []


def test_lowering_refuses_a_value_that_does_not_fill_the_clamped_slots_no_silent_wrong_answer() -> None:
    # torch.export checks this shape, so a real graph never disagrees; a graph edited by a
    # pass could. 3: of 16 slots is 13 slots: a one-slot value would be broadcast over them.
    program = export(SliceWrite(SHAPE, (S, S, slice(3, None), S)), (_rand(1, 2, 13, 4),)).run_decompositions()
    (node,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.slice_scatter.default]
    write = engine_write(node, node.args[0])
    bounds = resolve_bounds(write)
    _check_slice_source(node, write.shape, bounds)  # as exported: the value fills the slots
    node.args[1].meta["val"] = torch.empty(1, 2, 1, 4)
    with pytest.raises(
        ValueError,
        match=r"13 slot\(s\) of dim 2 from 3 .* expected a value of shape \[1, 2, 13, 4\], got \[1, 2, 1, 4\]",
    ):
        _check_slice_source(node, write.shape, bounds)


def _tampered_slots_run(start: int, length: int) -> tuple[KVAliasRuntimeDelegate, object, list[torch.Tensor]]:
    """The real blob of ``cache[:, :, 15:, :] = x`` (one slot), its slots rewritten to ``start``/``length``."""
    record = _blob(SliceWrite(SHAPE, (S, S, slice(15, None), S)), _rand(1, 2, 1, 4))
    (step,) = _slice_steps(record)
    step.update(start=start, length=length)
    delegate = KVAliasRuntimeDelegate()
    handle = delegate.init(json.dumps(record).encode(), {})
    inputs = record["inputs"]
    assert inputs == ["b_cache", "x", "_lifted_tensor_constant1"], inputs
    cache = _rand(*SHAPE, seed=7)
    args = [cache, _rand(1, 2, 1, 4, seed=8), torch.tensor(2.0), torch.zeros(1, 2, 16)]
    return delegate, handle, args


def test_slice_update_whose_value_would_broadcast_raises_no_silent_wrong_answer() -> None:
    # One slot of value written into 4 slots (12..15) would broadcast it over all four.
    delegate, handle, args = _tampered_slots_run(12, 4)
    before = args[0].clone()
    with pytest.raises(ValueError, match=r"expected a value of shape \[1, 2, 4, 4\] .* got \[1, 2, 1, 4\]"):
        delegate.execute(handle, args)
    assert torch.equal(args[0], before), "no partial write: the cache must be as it was"


def test_slice_update_past_the_cache_end_raises_no_partial_write() -> None:
    delegate, handle, args = _tampered_slots_run(16, 1)
    before = args[0].clone()
    with pytest.raises(ValueError, match=r"slots 16:17 of dim 2 lie outside the input of shape \[1, 2, 16, 4\]"):
        delegate.execute(handle, args)
    assert torch.equal(args[0], before)


def test_untampered_blob_writes_the_one_slot_eager_writes() -> None:
    # The control for the two tests above: the same direct call with the blob as lowered.
    delegate, handle, args = _tampered_slots_run(15, 1)
    want = args[0].clone()
    want[:, :, 15:, :] = args[1]
    delegate.execute(handle, args)
    torch.testing.assert_close(args[0], want)
    torch.testing.assert_close(args[3], want.sum(-1) * 2.0)


def test_value_longer_than_its_clamped_slice_is_not_aliased_as_tensorrt_expects() -> None:
    """Ported from Torch-TensorRT's KV-cache fast path: ``slice_scatter`` of an 8-slot value at
    start -4, end 20 on a 16-slot cache. Torch-TensorRT wraps the start to 12 and aliases only
    when ``start + value length <= slots`` (12 + 8 = 20 > 16): it takes its scatter fallback,
    not the aliased layer. The clamped bounds name 4 slots (12..15); the rule must not alias it."""
    program = export(SliceWrite(SHAPE, (S, S, slice(-4, 20), S)), (_rand(1, 2, 4, 4),)).run_decompositions()
    (node,) = [n for n in program.graph.nodes if n.target is torch.ops.aten.slice_scatter.default]
    assert node.args[3:5] == (-4, 20)
    as_exported = engine_write(node, node.args[0])
    assert TensorRTCacheRule().alias_refusal(as_exported) is None  # 4 slots, a 4-slot value: aliased
    node.args[1].meta["val"] = torch.empty(1, 2, 8, 4)  # the graph a pass could leave: 8 slots written
    longer = engine_write(node, node.args[0])
    start, length, slots = 16 - 4, 8, 16  # Torch-TensorRT's eligibility, worked out by hand
    assert start + length > slots
    refusal = TensorRTCacheRule().alias_refusal(longer)
    assert refusal is not None and refusal.startswith(
        "its value has 8 slot(s) along dim 2 but its bounds, clamped to the cache, name 4 from 12"
    ), refusal

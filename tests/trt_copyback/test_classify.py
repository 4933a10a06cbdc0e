# Models defined inline register buffers, which torch types as ``Tensor | Module``.
# mypy: disable-error-code="operator"
"""Which writes the engine aliases and which are copied back: the hazards of the review, by name.

Each class is stated by hand; where a write is run, the engine's result is
compared with eager PyTorch over several calls.
"""

from __future__ import annotations

import pytest
import torch
from writeback_core import meta
from writeback_trt_copyback import BufferClass, KVAliasEngine, lift_mutated_buffers
from writeback_trt_copyback.lift import DEAD_WRITE

from tests.trt_copyback.conftest import EngineRun, compile_quietly, export, run_against_eager
from tests.trt_copyback.models import ClonedWrite, IndexCopyWrite, Nested, SliceWrite

S = slice(None)


def _only(module: torch.nn.Module, *args: object, engine: KVAliasEngine | None = None) -> BufferClass:
    lifted = lift_mutated_buffers(export(module, args), engine or KVAliasEngine())
    (cls,) = lifted.buffers
    return cls


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_cache_write_on_the_sequence_dim_of_a_4d_cache_is_aliased() -> None:
    assert _only(SliceWrite((1, 2, 16, 4), (S, S, slice(3, 4), S)), _rand(1, 2, 1, 4)).aliased
    assert _only(IndexCopyWrite((1, 2, 16, 4), 2), _rand(1, 2, 1, 4), torch.tensor([5])).aliased


def test_ineligible_index_copy_into_2d_cache_goes_to_copy_back() -> None:
    cls = _only(IndexCopyWrite((16, 4), 0), _rand(1, 4), torch.tensor([5]))
    assert not cls.aliased and "2-D" in str(cls.reason)
    run_against_eager(lambda: IndexCopyWrite((16, 4), 0), lambda s: (_rand(1, 4, seed=s), torch.tensor([s + 2])))


@pytest.mark.parametrize(
    ("shape", "index", "update", "why"),
    [
        pytest.param((1, 2, 16, 4), (S, slice(1, 2), S, S), (1, 1, 16, 4), "dim 1", id="wrong_dim"),
        pytest.param((2, 16, 4), (S, slice(3, 4), S), (2, 1, 4), "3-D", id="3d_cache"),
        pytest.param(
            (1, 2, 16, 4), (S, S, slice(0, 16), S), (1, 2, 16, 4), "no cache slot", id="full_overwrite_explicit_bounds"
        ),
        pytest.param((1, 2, 16, 4), (S, S, S, S), (1, 2, 16, 4), "no cache slot", id="full_overwrite_bounds_omitted"),
        pytest.param((1, 2, 16, 4), (S, S, slice(20, None), S), (1, 2, 0, 4), "no slot", id="clamped_to_no_slot"),
    ],
)
def test_ineligible_slice_scatter_goes_to_copy_back(
    shape: tuple[int, ...], index: tuple[slice, ...], update: tuple[int, ...], why: str
) -> None:
    cls = _only(SliceWrite(shape, index), _rand(*update))
    assert not cls.aliased and why in str(cls.reason), cls.reason
    # A full overwrite never reads the cache, so the engine never sees it: the output
    # (the cache's sum) is what shows it, every call.
    run_against_eager(
        lambda: SliceWrite(shape, index), lambda s: (_rand(*update, seed=s),), check_buffers="no cache slot" not in why
    )


def test_slice_scatter_dynamic_bound_goes_to_copy_back() -> None:
    class Prefix(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(1, 2, 16, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.cache[:, :, 2 : 2 + x.shape[2], :] = x
            return self.cache.sum(-1)

    n = torch.export.Dim("n", min=1, max=8)
    program = export(Prefix(), (_rand(1, 2, 3, 4),), dynamic_shapes={"x": {2: n}})
    (cls,) = lift_mutated_buffers(program, KVAliasEngine()).buffers
    assert not cls.aliased and "run time" in str(cls.reason), cls.reason


def test_negative_start_is_normalised_before_the_rule() -> None:
    # -4:-3 in a 16-slot cache is slot 12: one slot, in range, so aliased and written there.
    index = (S, S, slice(-4, -3), S)
    assert _only(SliceWrite((1, 2, 16, 4), index), _rand(1, 2, 1, 4)).aliased
    compiled = run_against_eager(lambda: SliceWrite((1, 2, 16, 4), index), lambda s: (_rand(1, 2, 1, 4, seed=s),))
    assert compiled.aliased == ["cache"]


def test_strided_write_is_copied_back_and_lands_in_every_other_slot() -> None:
    index = (S, S, slice(0, 8, 2), S)
    cls = _only(SliceWrite((1, 1, 8, 1), index), _rand(1, 1, 4, 1))
    assert not cls.aliased and "strided (step 2)" in str(cls.reason)
    update = torch.tensor([1.0, 2, 3, 4]).view(1, 1, 4, 1)
    compiled = compile_quietly(export(SliceWrite((1, 1, 8, 1), index), (update,)))
    assert compiled.aliased == []
    run = EngineRun(compiled, init_buffers=["b_cache"])
    (out,) = run(update)
    # By hand: slots 0, 2, 4, 6 hold 1..4 (an engine ignoring the step would fill 0..3).
    assert run.buffer("cache").flatten().tolist() == [1, 0, 2, 0, 3, 0, 4, 0]
    assert out.flatten().tolist() == [2, 0, 4, 0, 6, 0, 8, 0]


@pytest.mark.parametrize("op", ["slice", "index_copy"])
def test_cloned_cache_write_sole_use_clone_is_peeled_and_aliased(op: str) -> None:
    cls = _only(ClonedWrite(op), _rand(1, 2, 1, 4), torch.tensor([3]))
    assert cls.aliased, cls.reason
    compiled = run_against_eager(lambda: ClonedWrite(op), lambda s: (_rand(1, 2, 1, 4, seed=s), torch.tensor([s + 3])))
    assert compiled.aliased == ["cache"]


@pytest.mark.parametrize("op", ["slice", "index_copy"])
def test_cloned_cache_write_shared_clone_is_not_peeled(op: str) -> None:
    cls = _only(ClonedWrite(op, shared=True), _rand(1, 2, 1, 4), torch.tensor([3]))
    assert not cls.aliased and "direct input" in str(cls.reason)
    compiled = run_against_eager(
        lambda: ClonedWrite(op, shared=True), lambda s: (_rand(1, 2, 1, 4, seed=s), torch.tensor([s + 3]))
    )
    assert compiled.aliased == []


def test_dead_cache_write_is_rerouted_to_copy_back_and_marked() -> None:
    index = (S, S, slice(3, 4), S)
    module = SliceWrite((1, 2, 16, 4), index, read=False)
    lifted = lift_mutated_buffers(export(module, (_rand(1, 2, 1, 4),)), KVAliasEngine())
    (cls,) = lifted.buffers
    assert not cls.aliased and cls.marked and cls.reason == DEAD_WRITE
    marked = [n.name for n in lifted.program.graph.nodes if meta.get_custom(n, meta.NO_ALIAS)]
    assert marked == [cls.value]
    compiled = run_against_eager(
        lambda: SliceWrite((1, 2, 16, 4), index, read=False),
        lambda s: (_rand(1, 2, 1, 4, seed=s),),
        check_buffers=False,
    )
    assert compiled.aliased == [] and compiled.copy_back == ["cache"]


def test_live_cache_write_is_not_marked() -> None:
    module = SliceWrite((1, 2, 16, 4), (S, S, slice(3, 4), S), read=True)
    lifted = lift_mutated_buffers(export(module, (_rand(1, 2, 1, 4),)), KVAliasEngine())
    assert lifted.buffers[0].aliased and not lifted.buffers[0].marked
    assert not [n for n in lifted.program.graph.nodes if meta.get_custom(n, meta.NO_ALIAS)]


def test_copy_back_write_that_the_engine_would_not_alias_is_not_marked() -> None:
    module = SliceWrite((2, 16, 4), (S, slice(3, 4), S), read=False)
    lifted = lift_mutated_buffers(export(module, (_rand(2, 1, 4),)), KVAliasEngine())
    assert not lifted.buffers[0].aliased and not lifted.buffers[0].marked
    assert not [n for n in lifted.program.graph.nodes if meta.get_custom(n, meta.NO_ALIAS)]


def test_write_excluded_from_the_engine_goes_to_copy_back() -> None:
    engine = KVAliasEngine(excluded_ops=("aten.index_put",))
    cls = _only(IndexCopyWrite((1, 2, 16, 4), 2), _rand(1, 2, 1, 4), torch.tensor([5]), engine=engine)
    assert not cls.aliased and "excluded" in str(cls.reason)
    compiled = run_against_eager(
        lambda: IndexCopyWrite((1, 2, 16, 4), 2),
        lambda s: (_rand(1, 2, 1, 4, seed=s), torch.tensor([s])),
        engine=engine,
        check_buffers=False,
    )
    assert compiled.copy_back == ["cache"]


def test_nested_buffers_are_resolved_and_named_by_their_full_path() -> None:
    lifted = lift_mutated_buffers(export(Nested(), (_rand(1, 2, 1, 4), torch.tensor([1]))), KVAliasEngine())
    assert sorted(lifted.aliased) == ["layers.0.attn.k_cache", "layers.1.attn.k_cache"]
    assert sorted(lifted.copy_back) == ["layers.0.attn.state", "layers.1.attn.state"]
    compiled = run_against_eager(Nested, lambda s: (_rand(1, 2, 1, 4, seed=s), torch.tensor([s])))
    assert compiled.aliased == ["layers.0.attn.k_cache", "layers.1.attn.k_cache"]


def test_keep_all_mode_needs_no_prediction_and_aliases_the_dead_write() -> None:
    # Non-destructive: every value is kept for copy-back until aliased_io settles it, so a
    # write nothing reads stays alive and the engine may alias it; no marker is needed.
    from writeback_trt_copyback import Mode

    from tests.trt_copyback.models import DeadAndLive

    lifted = lift_mutated_buffers(
        export(DeadAndLive(), (_rand(1, 2, 1, 4), torch.tensor([1]))), KVAliasEngine(), Mode.KEEP_ALL
    )
    assert not any(b.marked for b in lifted.buffers)
    compiled = run_against_eager(
        DeadAndLive, lambda s: (_rand(1, 2, 1, 4, seed=s), torch.tensor([s])), mode=Mode.KEEP_ALL
    )
    assert compiled.aliased == ["dead", "live"] and compiled.copy_back == []


@pytest.mark.parametrize("mode_name", ["KEEP_ALL", "PREDICT"])
def test_alias_whose_old_value_a_later_partition_reads_is_refused(mode_name: str) -> None:
    # amax, kept out of the engine, splits it in two; the second partition reads the old
    # cache (through a clone) after the first has written it in place.
    from writeback_trt_copyback import AliasMismatchError, Mode

    from tests.trt_copyback.conftest import compile_quietly
    from tests.trt_copyback.models import ReadLater

    engine = KVAliasEngine(excluded_ops=("aten.amax",))
    program = export(ReadLater(), (_rand(1, 2, 1, 4), torch.tensor([1])))
    expected = {
        "KEEP_ALL": (ValueError, r"'cache' in place .* \['executorch_call_delegate_1'\] read"),
        "PREDICT": (AliasMismatchError, r"wrote \['cache'\] in place, but they were filed copy-back"),
    }[mode_name]
    with pytest.raises(expected[0], match=expected[1]):
        compile_quietly(program, engine, Mode[mode_name])


def test_nested_buffer_names_survive_into_the_pte() -> None:
    # Without an engine (dry run) every buffer is copied back, so stock ExecuTorch runs it;
    # its mutable buffers are emitted under their full path.
    from tests.trt_copyback.conftest import compile_quietly, stock_run

    compiled = compile_quietly(export(Nested(), (_rand(1, 2, 1, 4), torch.tensor([1]))), dryrun=True)
    assert compiled.lifted.aliased == ["layers.0.attn.k_cache", "layers.1.attn.k_cache"]
    method = stock_run(compiled.to_executorch(init_buffers=[b.placeholder for b in compiled.lifted.buffers]))
    eager = Nested().eval()
    for step in range(2):
        args = (_rand(1, 2, 1, 4, seed=step), torch.tensor([step]))
        (out,) = method.execute(args)
        with torch.no_grad():
            torch.testing.assert_close(out, eager(*args))
        for name, want in eager.named_buffers():
            torch.testing.assert_close(method.buffer(name), want)


class _ReadAfter(torch.nn.Module):
    """The written cache is read by ``amax`` only (keep it out of the engine to read it outside)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 2, 16, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(2, pos, x)
        return self.cache.amax(-1)


def test_aliased_write_whose_result_is_read_outside_the_engine_reads_the_buffer() -> None:
    # amax, outside the engine, reads the written cache: the engine leaves that delegate
    # output unwritten and settle points amax at the buffer, which holds the value. The
    # engine's second output (x.sum() * 2) keeps the delegate alive.
    class ReadAfter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(1, 2, 16, 4))

        def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.cache.index_copy_(2, pos, x)
            return self.cache.amax(-1), x.sum() * 2.0

    engine = KVAliasEngine(excluded_ops=("aten.amax",))
    compiled = run_against_eager(ReadAfter, lambda s: (_rand(1, 2, 1, 4, seed=s), torch.tensor([s])), engine=engine)
    assert compiled.aliased == ["cache"]
    (site,) = compiled.aliasing.sites["cache"]
    assert site.output_index is not None  # the write is also a delegate output, left unwritten


def test_delegate_whose_only_outputs_are_aliased_writes_is_refused_not_dropped() -> None:
    from tests.trt_copyback.conftest import compile_quietly

    engine = KVAliasEngine(excluded_ops=("aten.amax",))
    with pytest.raises(ValueError, match=r"would drop it as dead code, losing the writes of \['cache'\]"):
        compile_quietly(export(_ReadAfter(), (_rand(1, 2, 1, 4), torch.tensor([1]))), engine)


class _ConvertedThenWritten(torch.nn.Module):
    """An int64 cache converted (unused: export keeps only a dtype assertion on the old cache),
    then written at ``pos`` and read."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 2, 8, 4, dtype=torch.int64))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor]:
        self.cache.to(torch.float32)
        self.cache.index_copy_(2, pos, x)
        return (self.cache * 2,)


def test_dtype_assertion_on_the_old_cache_is_no_read_and_the_write_is_aliased() -> None:
    def inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((1, 2, 1, 4), step + 1, dtype=torch.int64), torch.tensor([step])

    cls = _only(_ConvertedThenWritten(), *inputs(0))
    assert (cls.aliased, cls.read_before_write) == (True, False), cls.reason
    compiled = run_against_eager(_ConvertedThenWritten, inputs)
    assert compiled.aliased == ["cache"] and compiled.copy_back == []


def test_keep_all_mode_plans_the_aliased_cache_once_more_than_predict() -> None:
    """The README's known limit: under KEEP_ALL an aliased write keeps a delegate output the
    engine never writes, planned memory the size of the cache (memory, not time)."""
    from writeback_passes import memory_plan_report
    from writeback_trt_copyback import Mode

    from tests.trt_copyback.conftest import compile_quietly
    from tests.trt_copyback.models import IndexCopyWrite

    shape = (1, 2, 64, 8)
    planned = {}
    for mode in (Mode.PREDICT, Mode.KEEP_ALL):
        program = export(IndexCopyWrite(shape, 2), (_rand(1, 2, 1, 4 * 2), torch.tensor([1])))
        compiled = compile_quietly(program, mode=mode)
        assert compiled.aliased == ["cache"], mode
        planned[mode] = memory_plan_report(compiled.to_executorch()).total_bytes
    assert planned[Mode.KEEP_ALL] - planned[Mode.PREDICT] >= 1 * 2 * 64 * 8 * 4  # one fp32 cache

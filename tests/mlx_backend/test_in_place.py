"""User inputs written in place by the MLX delegate, through the real runtime: the seed's
tests (axis 0 and 1, negative index, several calls) and the hazards its reviews name."""

from __future__ import annotations

import pytest
import torch
from writeback_core import Mutation, PartitionView, hookimpl
from writeback_pybind_runtime import DelegateError

from tests.mlx_backend.lowering import lower_mlx, registry


class IndexCopyAxis(torch.nn.Module):
    """``cache.index_copy_(dim, idx, update)``, returning a reduction of the new cache."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, idx: torch.Tensor, update: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(self.dim, idx, update)
        return cache.sum(self.dim) * 2.0


class SnapshotBeforeMutation(torch.nn.Module):
    """The review's module: a clone taken before the write must keep the old values."""

    def forward(
        self, cache: torch.Tensor, indices: torch.Tensor, update: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        before = cache.clone()
        cache.index_copy_(0, indices, update)
        return before, cache


class SnapshotViewBeforeMutation(torch.nn.Module):
    """The variant that returns ``before.view(2, 2)``, which flips the output order."""

    def forward(
        self, cache: torch.Tensor, indices: torch.Tensor, update: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        before = cache.clone()
        cache.index_copy_(0, indices, update)
        return before.view(2, 2), cache


class ReadBeforeIndexCopy(torch.nn.Module):
    """A read of the cache before ``index_copy_`` must see the old values."""

    def forward(self, cache: torch.Tensor, idx: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        old = cache * 3.0
        cache.index_copy_(0, idx, update)
        return old + cache


def _eager(module: torch.nn.Module, *args: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run eager on clones; return (outputs, the mutated inputs after the call)."""
    inputs = [a.clone() for a in args]
    with torch.no_grad():
        out = module(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    return outs, inputs


@pytest.mark.parametrize("dim", [0, 1])
def test_index_copy_into_input_is_written_in_place_over_calls(dim: int) -> None:
    cache_shape = (6, 4) if dim == 0 else (4, 6)
    update_shape = (2, 4) if dim == 0 else (4, 2)
    module = IndexCopyAxis(dim)
    example = (torch.tensor([1, 3]), torch.ones(update_shape), torch.zeros(cache_shape))
    lowered = lower_mlx(module, example)
    assert lowered.only_delegate_runs()
    assert lowered.write_backs() == []  # no write-back copy_ left in the program
    method = lowered.method()
    # The method's first output is the input value itself (index 2: the cache).
    assert method.metadata.outputs[0].is_input == 2
    cache = torch.zeros(cache_shape)
    eager_cache = torch.zeros(cache_shape)
    gen = torch.Generator().manual_seed(dim)
    for step in range(4):
        idx = torch.tensor([step % cache_shape[dim], (step + 2) % cache_shape[dim]])
        update = torch.randn(update_shape, generator=gen)
        outs = method.execute([idx, update, cache])
        with torch.no_grad():
            expected = module(idx, update, eager_cache)
        torch.testing.assert_close(outs[1], expected)
        torch.testing.assert_close(cache, eager_cache)


def test_negative_index_copy_index_raises_and_writes_nothing() -> None:
    module = IndexCopyAxis(0)
    example = (torch.tensor([1]), torch.ones(1, 4), torch.zeros(5, 4))
    method = lower_mlx(module, example).method()
    cache = torch.arange(20.0).reshape(5, 4)
    with pytest.raises(IndexError, match="out of bounds"):
        torch.zeros(5, 4).index_copy_(0, torch.tensor([-1]), torch.ones(1, 4))  # ATen rejects it
    with pytest.raises(DelegateError, match=r"index -1 .*negative indices are rejected"):
        method.execute([torch.tensor([-1]), torch.ones(1, 4), cache])
    torch.testing.assert_close(cache, torch.arange(20.0).reshape(5, 4))


class ZeroDimIndex(torch.nn.Module):
    def forward(self, x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return x.index_copy(0, torch.tensor(2), src) + 1.0


class ZeroDimDestination(torch.nn.Module):
    def forward(self, x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return x.index_copy(0, torch.tensor([0]), src) + 1.0


@pytest.mark.parametrize(
    ("module", "args"),
    [
        (ZeroDimIndex(), (torch.zeros(4), torch.tensor(5.0))),
        (ZeroDimDestination(), (torch.tensor(3.0), torch.tensor(5.0))),
    ],
    ids=["0d_index", "0d_destination"],
)
def test_zero_dim_index_copy_is_not_delegated_as_index_copy_and_matches_eager(
    module: torch.nn.Module, args: tuple[torch.Tensor, ...]
) -> None:
    """ATen accepts these; the MLX index_copy handler would not, so it must not take them."""
    lowered = lower_mlx(module, args)
    assert "aten.index_copy.default" not in lowered.delegated_ops()
    out = lowered.method().execute(list(args))
    torch.testing.assert_close(out[0], module(*args))


@pytest.mark.parametrize(
    "module", [SnapshotBeforeMutation(), SnapshotViewBeforeMutation()], ids=["snapshot", "snapshot_view"]
)
def test_snapshot_before_mutation(module: torch.nn.Module) -> None:
    cache = torch.tensor([1.0, 2.0, 3.0, 4.0])
    indices = torch.tensor([1, 3], dtype=torch.int64)
    update = torch.tensor([20.0, 40.0])
    lowered = lower_mlx(module, (cache.clone(), indices, update))
    assert lowered.write_backs() == []
    method = lowered.method()
    caller = cache.clone()
    outs = method.execute([caller, indices, update])
    expected, after = _eager(module, cache, indices, update)
    # The method returns the mutated input first, then the module's outputs.
    torch.testing.assert_close(outs[1:], expected)  # before: [1, 2, 3, 4]
    torch.testing.assert_close(caller, after[0])  # after: [1, 20, 3, 40]
    torch.testing.assert_close(outs[0], after[0])


def test_read_before_index_copy_sees_old_values() -> None:
    module = ReadBeforeIndexCopy()
    cache = torch.arange(8.0).reshape(4, 2)
    idx, update = torch.tensor([2]), torch.full((1, 2), 100.0)
    lowered = lower_mlx(module, (cache.clone(), idx, update))
    assert lowered.write_backs() == []
    caller = cache.clone()
    outs = lowered.method().execute([caller, idx, update])
    expected, after = _eager(module, cache, idx, update)
    torch.testing.assert_close(outs[-1], expected[0])
    torch.testing.assert_close(caller, after[0])


class TwoCaches(torch.nn.Module):
    """K and V caches mutated by one delegate."""

    def forward(
        self,
        pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
    ) -> torch.Tensor:
        kc.index_copy_(0, pos, k)
        vc.index_copy_(0, pos, v)
        return kc.sum() + vc.sum()


class DeclineV:
    """A plugin that declines the ``vc`` mutation for the MLX backend (and nothing else)."""

    writeback_name = "decline-vc"

    @hookimpl
    def writeback_accepts_in_place(self, backend: str, partition: PartitionView, mutation: Mutation) -> bool | None:
        return False if mutation.target == "vc" else None


def test_backend_declining_one_mutation_keeps_that_copy_and_drops_the_other() -> None:
    args = (torch.tensor([1]), torch.ones(1, 3), torch.ones(1, 3), torch.zeros(4, 3), torch.zeros(()))

    class Slice(torch.nn.Module):
        def forward(
            self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
        ) -> torch.Tensor:
            kc.index_copy_(0, pos, k)
            vc.copy_(vc * 0.5 + v.sum())  # a 0-d state has no region to write: the backend declines it
            return kc.sum() + vc

    lowered = lower_mlx(Slice(), args)
    decisions = {d.target: d.accepted for d in lowered.decisions}
    assert decisions == {"kc": True, "vc": False}
    assert lowered.write_backs() == ["vc"]
    method = lowered.method()
    kc, vc = torch.zeros(4, 3), torch.zeros(())
    ekc, evc = torch.zeros(4, 3), torch.zeros(())
    for step in range(3):
        pos, k, v = torch.tensor([step]), torch.full((1, 3), step + 1.0), torch.ones(1, 3) * step
        out = method.execute([pos, k, v, kc, vc])
        with torch.no_grad():
            expected = Slice()(pos, k, v, ekc, evc)
        torch.testing.assert_close(out[-1], expected)
        torch.testing.assert_close(kc, ekc)
        torch.testing.assert_close(vc, evc)


def test_two_inputs_written_in_place_by_one_delegate() -> None:
    module = TwoCaches()
    args = (torch.tensor([1]), torch.ones(1, 3), torch.ones(1, 3), torch.zeros(4, 3), torch.zeros(4, 3))
    lowered = lower_mlx(module, args)
    assert lowered.write_backs() == []
    method = lowered.method()
    kc, vc, ekc, evc = (torch.zeros(4, 3) for _ in range(4))
    for step in range(4):
        pos, k, v = torch.tensor([step]), torch.full((1, 3), step + 1.0), torch.ones(1, 3) * -step
        out = method.execute([pos, k, v, kc, vc])
        with torch.no_grad():
            expected = module(pos, k, v, ekc, evc)
        torch.testing.assert_close(out[-1], expected)
        torch.testing.assert_close(kc, ekc)
        torch.testing.assert_close(vc, evc)


def test_declining_plugin_conflicts_with_mlx_and_core_names_both() -> None:
    """``writeback_accepts_in_place``: another plugin saying no where MLX says yes is an error."""
    from writeback_core import InPlaceConflictError

    module = TwoCaches()
    args = (torch.tensor([1]), torch.ones(1, 3), torch.ones(1, 3), torch.zeros(4, 3), torch.zeros(4, 3))
    with pytest.raises(InPlaceConflictError, match=r"mlx-backend.*decline-vc"):
        lower_mlx(module, args, registry_=registry(DeclineV()))


def test_plain_torch_cache_is_copied_into_mlx_but_updated_in_place() -> None:
    module = IndexCopyAxis(0)
    example = (torch.tensor([0]), torch.ones(1, 4), torch.zeros(6, 4))
    lowered = lower_mlx(module, example, planned_inputs=False)
    method = lowered.method()
    cache, eager_cache = torch.zeros(6, 4), torch.zeros(6, 4)
    for step in range(3):
        idx, update = torch.tensor([step]), torch.full((1, 4), float(step + 1))
        method.execute([idx, update, cache])
        with torch.no_grad():
            module(idx, update, eager_cache)
        torch.testing.assert_close(cache, eager_cache)
    assert 6 * 4 * 4 in lowered.delegate().copied_input_bytes


def test_allocator_cache_is_read_without_copy_and_updated_in_place() -> None:
    from writeback_mlx_backend import empty

    module = IndexCopyAxis(0)
    example = (torch.tensor([0]), torch.ones(1, 4), torch.zeros(6, 4))
    lowered = lower_mlx(module, example, planned_inputs=False)
    method = lowered.method()
    cache, eager_cache = empty((6, 4)), torch.zeros(6, 4)
    for step in range(3):
        idx, update = torch.tensor([step + 1]), torch.full((1, 4), float(-step))
        out = method.execute([idx, update, cache])
        with torch.no_grad():
            expected = module(idx, update, eager_cache)
        torch.testing.assert_close(out[-1], expected)
        torch.testing.assert_close(cache, eager_cache)
    # Only the small index/update inputs were copied into MLX, never the cache.
    assert 6 * 4 * 4 not in lowered.delegate().copied_input_bytes


class OnlyWrites(torch.nn.Module):
    """A delegate whose only outputs are the two cache writes."""

    def forward(self, pos: torch.Tensor, k: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> None:
        kc.index_copy_(0, pos, k)
        vc.index_copy_(0, pos, k * 2.0)


def test_delegate_that_only_writes_state_drops_every_write_back_and_stays_in_the_program() -> None:
    """Dropping every write-back once left the delegate unused, and exir deleted it; the
    passes now keep the call reachable without a copy, so both caches are written in place."""
    args = (torch.tensor([1]), torch.ones(1, 3), torch.zeros(4, 3), torch.zeros(4, 3))
    lowered = lower_mlx(OnlyWrites(), args)
    assert "executorch_call_delegate" in lowered.graph_targets()
    assert lowered.write_backs() == []
    method = lowered.method()
    kc, vc, ekc, evc = (torch.zeros(4, 3) for _ in range(4))
    for step in range(3):
        pos, k = torch.tensor([step]), torch.full((1, 3), step + 1.0)
        method.execute([pos, k, kc, vc])
        OnlyWrites()(pos, k, ekc, evc)
        torch.testing.assert_close(kc, ekc)
        torch.testing.assert_close(vc, evc)


class TwoIndexedCaches(torch.nn.Module):
    def forward(
        self, pk: torch.Tensor, pv: torch.Tensor, k: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> torch.Tensor:
        kc.index_copy_(0, pk, k)
        vc.index_copy_(0, pv, k * 2.0)
        return kc.sum() + vc.sum()


def test_bad_index_in_a_later_write_leaves_every_cache_unchanged() -> None:
    args = (torch.tensor([0]), torch.tensor([1]), torch.ones(1, 3), torch.zeros(4, 3), torch.zeros(4, 3))
    # Unplanned inputs: the delegate writes the caller's tensors directly.
    lowered = lower_mlx(TwoIndexedCaches(), args, planned_inputs=False)
    assert lowered.write_backs() == []
    method = lowered.method()
    kc, vc = torch.zeros(4, 3), torch.zeros(4, 3)
    with pytest.raises(DelegateError, match=r"index -2 .*negative indices are rejected"):
        method.execute([torch.tensor([1]), torch.tensor([-2]), torch.ones(1, 3), kc, vc])
    torch.testing.assert_close(kc, torch.zeros(4, 3))
    torch.testing.assert_close(vc, torch.zeros(4, 3))


def test_dropped_write_back_reserves_no_memory_for_the_unused_delegate_output() -> None:
    """The delegate's output for the written input is never read: it gets no arena space."""
    mib = 1 << 20
    example = (torch.tensor([1]), torch.ones(1, 256), torch.zeros(1024, 256))  # a 1 MiB cache
    stock = lower_mlx(IndexCopyAxis(0), example, passes=False).method()
    dropped = lower_mlx(IndexCopyAxis(0), example).method()
    # Stock: the planned input cache, the delegate's new cache and its copy back.
    assert sum(stock.metadata.memory_planned_buffers) >= 2 * mib
    # Dropped: the planned input cache only (plus a few small tensors).
    assert sum(dropped.metadata.memory_planned_buffers) < mib + 64 * 1024


class ViewReadAfterWrite(torch.nn.Module):
    """A view of the cache taken before the write, read after it: like eager, it sees the write."""

    def forward(self, cache: torch.Tensor, idx: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        rows = cache[1:3]
        cache.index_copy_(0, idx, update)
        return rows * 1.0 + cache.sum()


def _shared_cache_case(module: torch.nn.Module) -> None:
    from writeback_mlx_backend import empty

    start = torch.arange(8.0).reshape(4, 2)
    idx, update = torch.tensor([2]), torch.full((1, 2), 100.0)
    lowered = lower_mlx(module, (start.clone(), idx, update), planned_inputs=False)
    assert lowered.write_backs() == []
    cache = empty((4, 2))
    cache.copy_(start)
    outs = lowered.method().execute([cache, idx, update])
    expected, after = _eager(module, start, idx, update)
    torch.testing.assert_close(list(outs[-len(expected) :]), expected)
    torch.testing.assert_close(cache, after[0])  # row 2 is [100, 100]
    assert 4 * 2 * 4 not in lowered.delegate().copied_input_bytes


@pytest.mark.parametrize("module", [SnapshotBeforeMutation(), ReadBeforeIndexCopy()], ids=["clone", "read"])
def test_old_value_of_a_shared_cache_read_after_its_in_place_write_is_snapshotted(
    module: torch.nn.Module,
) -> None:
    """The snapshot hazard where it bites: the cache is the MLX array itself (allocator-made),
    so a lazy value over it evaluated after the write would see the new rows."""
    _shared_cache_case(module)


def test_view_of_a_shared_cache_taken_before_its_write_sees_the_write_like_eager() -> None:
    """The other side: a view is not a snapshot; eager's view shows row 2 as [100, 100]."""
    _shared_cache_case(ViewReadAfterWrite())

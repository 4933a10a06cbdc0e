"""The mutation model on the zoo and on each write form, with shapes worked out by hand."""

from __future__ import annotations

import pytest
import torch
from writeback.model_build import export_case
from writeback.zoo import builtin_models
from writeback_core import Dynamic, MutationKind, WriteKind, find_mutations


def _by_target(program):  # type: ignore[no-untyped-def]
    return {m.target: m for m in find_mutations(program)}


ZOO_EXPECTED = {
    # model: {target: (kind, write kind, dim, shape)}
    "decoder": {
        "blocks.0.k_cache": (MutationKind.BUFFER, WriteKind.INDEX_COPY, 2, (1, 2, 16, 16)),
        "blocks.0.v_cache": (MutationKind.BUFFER, WriteKind.INDEX_COPY, 2, (1, 2, 16, 16)),
    },
    "decoder-caller-cache": {
        "caches_0": (MutationKind.USER_INPUT, WriteKind.INDEX_COPY, 2, (1, 2, 16, 16)),
        "caches_1": (MutationKind.USER_INPUT, WriteKind.INDEX_COPY, 2, (1, 2, 16, 16)),
    },
    "recurrent": {
        "conv_state": (MutationKind.BUFFER, WriteKind.FULL, None, (1, 16, 4)),
        "recurrent_state": (MutationKind.BUFFER, WriteKind.FULL, None, (1, 2, 8, 8)),
    },
    "ema": {
        "running_mean": (MutationKind.BUFFER, WriteKind.FULL, None, (8,)),
        "steps": (MutationKind.BUFFER, WriteKind.FULL, None, ()),
    },
    "no-input": {"count": (MutationKind.BUFFER, WriteKind.FULL, None, (2,))},
}


@pytest.mark.parametrize("stage", ["aten", "edge"])
@pytest.mark.parametrize("name", sorted(ZOO_EXPECTED))
def test_zoo_mutations_match_hand_worked_shapes(name: str, stage: str) -> None:
    from executorch.exir import to_edge

    program = export_case(builtin_models()[name])
    program = program.run_decompositions() if stage == "aten" else to_edge(program).exported_program()
    found = _by_target(program)
    assert set(found) == set(ZOO_EXPECTED[name])
    for target, (kind, write, dim, shape) in ZOO_EXPECTED[name].items():
        m = found[target]
        assert (m.kind, m.write.kind, m.write.dim, m.shape) == (kind, write, dim, shape), target
        assert m.dtype in (torch.float32, torch.int64)
        if write is WriteKind.INDEX_COPY:
            assert m.write.index == "input_pos"


def test_decoder_index_copy_bytes_are_whole_cache() -> None:
    program = export_case(builtin_models()["decoder"]).run_decompositions()
    m = _by_target(program)["blocks.0.k_cache"]
    assert m.nbytes == 1 * 2 * 16 * 16 * 4


class SliceWrites(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name in ("neg", "open", "full", "step", "tail"):
            self.register_buffer(name, torch.zeros(4, 10))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        self.neg[:, -8:-4] = v[:, :4]  # 2:6
        self.open[:, 3:] = v[:, :7]  # 3:10
        self.full[:, :] = v  # the whole buffer
        self.step[:, 1:9:3] = v[:, :3]  # 1, 4, 7
        self.tail[:, -3:100] = v[:, :3]  # 7:10 (end clamped)
        return v.sum()


def test_slice_scatter_bounds_are_normalized(aten) -> None:  # type: ignore[no-untyped-def]
    found = _by_target(aten(SliceWrites(), (torch.ones(4, 10),)))
    neg, opened, full, step, tail = (found[n].write for n in ("neg", "open", "full", "step", "tail"))
    assert (neg.kind, neg.dim, neg.start, neg.end, neg.step) == (WriteKind.SLICE_SCATTER, 1, 2, 6, 1)
    assert (opened.start, opened.end, opened.step) == (3, 10, 1)
    assert full.kind is WriteKind.FULL
    assert (step.kind, step.start, step.end, step.step) == (WriteKind.SLICE_SCATTER, 1, 9, 3)
    assert (tail.start, tail.end) == (7, 10)
    assert found["step"].update_nbytes == 4 * 3 * 4
    assert found["neg"].update_nbytes == 4 * 4 * 4


class DynamicSlice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(16, 4))

    def forward(self, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        start = pos.item()
        torch._check(start >= 0)
        torch._check(start + v.shape[0] <= 16)
        self.cache[start : start + v.shape[0]] = v
        return self.cache.sum()


def test_dynamic_slice_bounds_are_reported_dynamic_not_guessed(aten) -> None:  # type: ignore[no-untyped-def]
    found = _by_target(aten(DynamicSlice(), (torch.ones(2, 4), torch.tensor(3))))
    write = found["cache"].write
    assert write.kind is WriteKind.SLICE_SCATTER
    assert write.dim == 0
    assert isinstance(write.start, Dynamic) and isinstance(write.end, Dynamic)
    assert not write.is_static
    assert found["cache"].update_nbytes is None


class IndexForms(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pair", torch.zeros(4, 5))
        self.register_buffer("acc", torch.zeros(6))
        self.register_buffer("row", torch.zeros(3, 5))

    def forward(self, i: torch.Tensor, j: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pair[i, j] = v
        self.acc.index_put_((i,), v, accumulate=True)
        self.row.diagonal().copy_(v[:2].repeat(2)[:3])  # diagonal_scatter: not a form we model
        return v


def test_index_put_and_unrecognized_partial_writes(aten) -> None:  # type: ignore[no-untyped-def]
    i, j = torch.tensor([0, 2]), torch.tensor([1, 3])
    found = _by_target(aten(IndexForms(), (i, j, torch.ones(2))))
    pair = found["pair"].write
    assert pair.kind is WriteKind.INDEX_PUT and pair.indices == ("i", "j")
    acc = found["acc"].write
    assert acc.kind is WriteKind.INDEX_PUT and acc.accumulate
    assert found["row"].write.kind is WriteKind.OTHER


class InputWrites(torch.nn.Module):
    def forward(self, cache: torch.Tensor, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(1, torch.tensor([2]), x)
        state.mul_(0.5)
        return cache.sum() + state.sum()


@pytest.mark.parametrize("stage", ["aten", "edge"])
def test_user_input_mutations(stage: str, aten, edge) -> None:  # type: ignore[no-untyped-def]
    args = (torch.zeros(3, 4), torch.ones(5), torch.ones(3, 1))
    program = aten(InputWrites(), args) if stage == "aten" else edge(InputWrites(), args).exported_program()
    found = _by_target(program)
    assert found["cache"].kind is MutationKind.USER_INPUT
    assert (found["cache"].write.kind, found["cache"].write.dim) == (WriteKind.INDEX_COPY, 1)
    assert found["state"].write.kind is WriteKind.FULL
    assert found["cache"].placeholder == "cache" and found["cache"].user_input_index == 0
    assert found["state"].user_input_index == 1


def test_index_copy_before_decomposition_is_recognized(export) -> None:  # type: ignore[no-untyped-def]
    class Functional(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(2, 8, 3))

        def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            self.cache.index_copy_(-2, pos, x)
            return self.cache.sum()

    program = export(Functional(), (torch.ones(2, 1, 3), torch.tensor([5])))
    program = program.run_decompositions({})
    m = _by_target(program)["cache"]
    assert (m.write.kind, m.write.dim) == (WriteKind.INDEX_COPY, 1)
    assert m.written_by_op is None  # index_copy_ is functionalized away: the program's write-back writes it


def test_after_to_executorch_the_value_is_what_copy_writes(edge) -> None:  # type: ignore[no-untyped-def]
    import warnings

    case = builtin_models()["ema"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        et = edge(case.build(), case.example_args(0)).to_executorch().exported_program()
    found = _by_target(et)
    assert set(found) == {"running_mean", "steps"}
    assert found["running_mean"].write.kind is WriteKind.FULL
    value = {n.name: n for n in et.graph.nodes}[found["running_mean"].value]
    assert value.op == "call_function"


def test_signature_naming_a_missing_node_is_a_clear_error(aten) -> None:  # type: ignore[no-untyped-def]
    program = aten(InputWrites(), (torch.zeros(3, 4), torch.ones(5), torch.ones(3, 1)))
    spec = next(s for s in program.graph_signature.output_specs if s.target == "state")
    spec.target = "ghost"
    with pytest.raises(ValueError, match="ghost"):
        find_mutations(program)


class ReturnsOneOfTwo(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kept", torch.zeros(4))
        self.register_buffer("returned", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kept.index_copy_(0, torch.tensor([1]), x)
        self.returned.index_copy_(0, torch.tensor([2]), x)
        return self.returned, x * 2.0


def test_also_returned_tells_a_returned_new_value_from_a_write_back_only(aten) -> None:  # type: ignore[no-untyped-def]
    program = aten(ReturnsOneOfTwo(), (torch.ones(1),))
    found = _by_target(program)
    assert found["returned"].also_returned(program.graph)  # written back and returned as output 2
    assert not found["kept"].also_returned(program.graph)  # written back only


def test_a_cache_a_custom_op_writes_is_written_in_place_by_that_op_not_a_full_overwrite() -> None:
    """Functionalization spells ``llama::update_cache(k, cache, start)`` (schema ``Tensor(a!)
    cache``) as ``auto_functionalized_v2`` and the cache's slot of its results: the write is
    the op's, in place, on the cache it names (each cache the op's own call, worked out from
    the model)."""
    from writeback_core.exporting import export_model

    from tests.core.update_cache_model import make

    program = export_model(*make()).run_decompositions()
    found = _by_target(program)
    assert sorted(found) == ["key_cache", "value_cache"]
    writers = {}
    for node in program.graph_module.graph.nodes:
        if "auto_functionalized" in str(node.target):
            (base,) = node.kwargs["_all_bases"]
            writers[base.name] = node.name
    for mutation in found.values():
        assert mutation.write.kind is WriteKind.MUTATING_OP, mutation.write
        assert mutation.write.op == "llama::update_cache"
        assert mutation.write.node == writers[mutation.placeholder]
        assert mutation.write.describe() == "in place by llama::update_cache"
        assert mutation.written_by_op == "llama::update_cache"
        assert mutation.shape == (1, 8, 2, 4)

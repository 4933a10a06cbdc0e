"""Hazards of ``copies_as_views`` and ``scale_smaller_operand``, each named after what would go
wrong, and every refusal of the two passes with the reason it gives.

Graphs are traced with ``make_fx`` over aten ops (real FakeTensor metadata) and run as
``GraphModule``s against the same function run eagerly on real tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from writeback_core.matmul_scaling import scale_smaller_operand
from writeback_passes.view_copies import copies_as_views

aten = torch.ops.aten


def _trace(fn: Callable[..., Any], *args: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def _clones(args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [a.clone() for a in args]


def _assert_vals_match_the_graph(gm: torch.fx.GraphModule, *args: torch.Tensor) -> None:
    """Each node's ``val`` has the dtype and shape the graph gives it when run on fake tensors."""
    stored = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    FakeTensorProp(gm).propagate(*args)
    for node in gm.graph.nodes:
        old, new = stored[node.name], node.meta.get("val")
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            assert (old.dtype, tuple(old.shape)) == (new.dtype, tuple(new.shape)), node.name


# copies_as_views: a write into the copy itself


def test_expand_copy_written_in_place_keeps_the_copy_and_the_input_is_unchanged() -> None:
    """``e = expand_copy(x); e.add_(1)``: dropping the copy would make the ``add_`` write ``x``."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = aten.expand_copy.default(x, [2, 3])
        aten.add_.Tensor(e, 1.0)
        return aten.mul.Tensor(x, 1.0), aten.mul.Tensor(e, 1.0)

    x = torch.arange(6.0).reshape(2, 3)
    gm = _trace(fn, x.clone())
    report = copies_as_views(gm)
    assert not report.removed
    (why,) = report.kept.values()
    assert why == "add_ writes the copy in place afterwards, which would then write x_1"
    given = x.clone()
    plain, written = gm(given)
    torch.testing.assert_close(given, x)  # the input is not written
    torch.testing.assert_close(plain, x)
    torch.testing.assert_close(written, x + 1.0)


def test_unsqueeze_copy_written_in_place_keeps_the_copy_and_the_input_is_unchanged() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = aten.unsqueeze_copy.default(x, 0)
        aten.mul_.Tensor(u, 3.0)
        return aten.add.Tensor(x, 0.0), aten.add.Tensor(u, 0.0)

    x = torch.arange(6.0).reshape(2, 3)
    gm = _trace(fn, x.clone())
    report = copies_as_views(gm)
    assert not report.viewed
    assert list(report.kept.values()) == ["mul_ writes the copy in place afterwards, which would then write x_1"]
    given = x.clone()
    plain, written = gm(given)
    torch.testing.assert_close(given, x)
    torch.testing.assert_close(plain, x)
    torch.testing.assert_close(written, x.unsqueeze(0) * 3.0)


# scale_smaller_operand: a multiply that changes the dtype, and the moved multiply's meta


def _int_cache_matmul(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``bmm(q, view(k * 0.5))`` with an integer ``k``: the multiply makes the float operand."""
    return aten.bmm.default(q, aten.view_copy.default(aten.mul.Scalar(k, 0.5), [2, 4, 16]))


def test_scalar_multiply_that_changes_the_dtype_stays_and_the_product_matches_eager() -> None:
    q, k = torch.randn(2, 1, 4), torch.randint(-8, 8, (2, 4, 16))
    gm = _trace(_int_cache_matmul, q, k)
    assert not scale_smaller_operand(gm).moved
    torch.testing.assert_close(gm(q, k), _int_cache_matmul(q, k))


def test_every_val_meta_matches_the_graph_after_scale_smaller_operand() -> None:
    q, k = torch.randn(2, 1, 4), torch.randint(-8, 8, (2, 4, 16))
    gm = _trace(_int_cache_matmul, q, k)
    scale_smaller_operand(gm)
    _assert_vals_match_the_graph(gm, q, k)


def test_moved_multiply_gets_the_products_val_not_the_operands_meta() -> None:
    """``q`` is int64 and scaled by an int: the product stays int64, the move is exact, and the new
    multiply carries its own ``val`` (a product of ``q``'s shape and dtype), none of ``q``'s other meta."""

    def fn(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return aten.bmm.default(q, aten.view_copy.default(aten.mul.Scalar(k, 3), [2, 4, 16]))

    q, k = torch.randint(-8, 8, (2, 1, 4)), torch.randint(-8, 8, (2, 4, 16))
    gm = _trace(fn, q, k)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    placeholder.meta["writeback.test_marker"] = "q's own"
    assert scale_smaller_operand(gm).moved
    (mul,) = [n for n in gm.graph.nodes if n.target == aten.mul.Scalar]
    assert mul.args[0] is placeholder
    assert "writeback.test_marker" not in mul.meta
    assert mul.meta["val"].dtype == torch.int64 and tuple(mul.meta["val"].shape) == (2, 1, 4)
    assert mul.meta["val"] is not placeholder.meta["val"]
    assert torch.equal(gm(q, k), fn(q, k))


# copies_as_views: each reason a copy stays, word for word


def test_copy_of_a_placeholder_stays_before_partitioning_with_its_reason() -> None:
    from writeback_passes.view_copies import functional_copies_as_views

    gm = _trace(lambda state: aten.mul.Tensor(aten.unsqueeze_copy.default(state, 0), 2.0), torch.ones(2, 3))
    report = functional_copies_as_views(gm)
    assert report.kept == {"unsqueeze_copy": "it reads a placeholder, whose old value a later state write may need"}
    torch.testing.assert_close(gm(torch.ones(2, 3)), torch.full((1, 2, 3), 2.0))


def test_reshape_of_a_non_contiguous_input_stays_with_its_reason() -> None:
    gm = _trace(lambda x: aten.mul.Tensor(aten.unsqueeze_copy.default(aten.t.default(x), 0), 1.0), torch.ones(2, 3))
    assert copies_as_views(gm).kept == {
        "unsqueeze_copy": "its input is not contiguous, so the reshape is no view of it"
    }


def test_copy_the_graph_returns_stays_with_its_reason() -> None:
    gm = _trace(lambda x: aten.unsqueeze_copy.default(aten.mul.Tensor(x, 2.0), 0), torch.ones(2, 3))
    assert copies_as_views(gm).kept == {"unsqueeze_copy": "the graph returns it"}


def test_copy_whose_input_is_written_afterwards_stays_with_its_reason() -> None:
    def fn(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        e = aten.expand_copy.default(x, [2, 3])
        aten.index_put_.default(x, [i], v)
        return aten.sum.default(e)

    args = (torch.zeros(2, 3), torch.tensor([0]), torch.full((1, 3), 10.0))
    gm = _trace(fn, *_clones(args))
    assert copies_as_views(gm).kept == {"expand_copy": "index_put_ writes storage it may share afterwards"}
    assert gm(*_clones(args)).item() == 0.0


# scale_smaller_operand: the cases that move nothing, and the one with the roles swapped


def test_multiply_behind_a_reshape_read_elsewhere_stays() -> None:
    """The reshape of ``k * 0.5`` is the matmul's operand and the multiply's only reader, but the
    multiply's result is also read through a second reshape: moving it would change that reader."""

    def fn(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = aten.mul.Scalar(k, 0.5)
        shaped = aten.view_copy.default(scaled, [2, 4, 16])
        return aten.bmm.default(q, aten.view_copy.default(shaped, [2, 4, 16])), aten.sum.default(shaped)

    q, k = torch.randn(2, 1, 4), torch.randn(2, 4, 16)
    gm = _trace(fn, q, k)
    assert not scale_smaller_operand(gm).moved
    for got, want in zip(gm(q, k), fn(q, k), strict=True):
        torch.testing.assert_close(got, want)


def test_multiply_by_a_tensor_stays() -> None:
    def fn(q: torch.Tensor, k: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return aten.bmm.default(q, aten.mul.Tensor(k, s))

    q, k, s = torch.randn(2, 1, 4), torch.randn(2, 4, 16), torch.randn(16)
    gm = _trace(fn, q, k, s)
    assert not scale_smaller_operand(gm).moved
    torch.testing.assert_close(gm(q, k, s), fn(q, k, s))


def test_operands_of_run_time_size_stay() -> None:
    def fn(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return aten.bmm.default(q, aten.mul.Scalar(k, 0.5))

    q, k = torch.randn(2, 3, 4), torch.randn(2, 4, 16)
    gm = _trace(fn, q, k)
    symbolic = make_fx(fn, tracing_mode="symbolic")(q, k)
    assert scale_smaller_operand(gm).moved  # the same graph with static sizes moves
    assert not scale_smaller_operand(symbolic).moved
    torch.testing.assert_close(symbolic(q, k), fn(q, k))


def test_multiply_of_the_first_operand_moves_to_a_smaller_second() -> None:
    """``bmm(view(k * 0.5), q)``, ``k`` the big operand on the left: the multiply moves to ``q``."""

    def fn(k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return aten.bmm.default(aten.view_copy.default(aten.mul.Scalar(k, 0.5), [2, 16, 4]), q)

    k, q = torch.randn(2, 16, 4), torch.randn(2, 4, 1)
    gm = _trace(fn, k, q)
    assert scale_smaller_operand(gm).moved == ["bmm"]
    (mul,) = [n for n in gm.graph.nodes if n.target == aten.mul.Scalar]
    assert mul.args[0].name == "q_1" and tuple(mul.meta["val"].shape) == (2, 4, 1)
    torch.testing.assert_close(gm(k, q), fn(k, q))


# copies_as_views and delegate calls: a delegate writes an input only where its compile spec says so


class _Lowered(torch.nn.Module):
    """What ``copies_as_views`` reads of a lowered module: its compile specs (or none at all)."""

    def __init__(self, specs: list[Any] | None) -> None:
        super().__init__()
        if specs is not None:
            self.compile_specs = specs


def _copy_then_delegate(specs: list[Any] | None) -> torch.fx.GraphModule:
    """``e = expand_copy(x)`` (same shape), a delegate call that takes ``x``, then a reader of ``e``."""
    from executorch.exir.delegate import executorch_call_delegate

    gm = _trace(lambda x: aten.mul.Tensor(aten.expand_copy.default(x, [2, 3]), 1.0), torch.ones(2, 3))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    expand = next(n for n in gm.graph.nodes if n.target == aten.expand_copy.default)
    gm.add_module("lowered_module_0", _Lowered(specs))
    with gm.graph.inserting_after(expand):
        lowered = gm.graph.get_attr("lowered_module_0")
    with gm.graph.inserting_after(lowered):
        gm.graph.call_function(executorch_call_delegate, (lowered, x))
    return gm


def test_copy_read_after_a_delegate_told_to_write_its_input_stays() -> None:
    from executorch.exir.backend.compile_spec_schema import CompileSpec
    from writeback_core import meta

    gm = _copy_then_delegate([CompileSpec(meta.IN_PLACE_OUTPUTS_SPEC, b'[{"input": 0, "output": 0}]')])
    report = copies_as_views(gm)
    assert report.kept == {"expand_copy": "executorch_call_delegate writes storage it may share afterwards"}


def test_copy_read_after_a_delegate_whose_specs_cannot_be_read_stays() -> None:
    report = copies_as_views(_copy_then_delegate(None))
    assert report.kept == {"expand_copy": "executorch_call_delegate writes storage it may share afterwards"}


def test_copy_read_after_a_delegate_that_writes_no_input_is_dropped() -> None:
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    report = copies_as_views(_copy_then_delegate([CompileSpec("other", b"")]))
    assert report.removed == ["expand_copy"] and report.kept == {}

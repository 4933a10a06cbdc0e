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
from writeback_passes.attention import scale_smaller_operand
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

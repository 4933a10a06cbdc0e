"""``copies_as_views``: a same-shape ``expand_copy`` is dropped and an ``unsqueeze``/``squeeze``
copy of a contiguous tensor becomes a ``view_copy`` (a view once exir plans memory), unless the
storage it reads is written at or after it, its input is not contiguous, or the graph returns it.

Graphs are traced with ``make_fx`` over aten ops (real FakeTensor metadata); what each case must
do is worked out by hand from the rule. The pipeline cases run the real lowering and runtimes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from writeback_passes.view_copies import copies_as_views

aten = torch.ops.aten


def _trace(fn: Callable[..., Any], *args: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_same_shape_expand_is_dropped_and_its_reader_reads_the_input() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return aten.mul.Tensor(aten.expand_copy.default(x, [2, 3]), 2.0)

    x = torch.arange(6.0).reshape(2, 3)
    gm = _trace(fn, x)
    report = copies_as_views(gm)
    assert report.removed and report.bytes_per_call == 24
    assert "aten.expand_copy.default" not in _targets(gm)
    torch.testing.assert_close(gm(x), x * 2.0)


def test_broadcasting_expand_is_a_real_copy_and_stays() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return aten.mul.Tensor(aten.expand_copy.default(x, [4, 3]), 2.0)

    gm = _trace(fn, torch.ones(1, 3))
    report = copies_as_views(gm)
    assert not report.removed and "aten.expand_copy.default" in _targets(gm)


def test_unsqueeze_and_squeeze_of_contiguous_input_become_view_copies_with_the_same_values() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        u = aten.unsqueeze_copy.default(x, 1)
        s = aten.squeeze_copy.dims(aten.mul.Tensor(u, 3.0), [1])
        return aten.add.Tensor(s, 1.0)

    x = torch.arange(6.0).reshape(2, 3)
    gm = _trace(fn, x)
    report = copies_as_views(gm)
    assert len(report.viewed) == 2
    assert _targets(gm).count("aten.view_copy.default") == 2
    torch.testing.assert_close(gm(x), x * 3.0 + 1.0)


def test_copy_whose_input_is_written_afterwards_keeps_the_copy_and_the_old_value() -> None:
    """The reader of ``e`` runs after ``index_put_`` writes ``x``: dropping the copy would make it
    read the new row 0 (10.0) where eager's copy holds the old one (0.0)."""

    def fn(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        e = aten.expand_copy.default(x, [2, 3])
        u = aten.unsqueeze_copy.default(x, 0)
        aten.index_put_.default(x, [i], v)
        return aten.add.Tensor(aten.sum.default(e), aten.sum.default(u))

    args = (torch.zeros(2, 3), torch.tensor([0]), torch.full((1, 3), 10.0))
    gm = _trace(fn, *[a.clone() for a in args])
    report = copies_as_views(gm)
    assert not report.removed and not report.viewed
    assert all("index_put_" in why for why in report.kept.values()) and len(report.kept) == 2
    assert gm(*[a.clone() for a in args]).item() == 0.0  # both read the old, all-zero x


def test_reshape_of_non_contiguous_input_stays_a_copy() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return aten.mul.Tensor(aten.unsqueeze_copy.default(aten.t.default(x), 0), 1.0)

    gm = _trace(fn, torch.ones(2, 3))
    report = copies_as_views(gm)
    assert not report.viewed
    assert "not contiguous" in next(iter(report.kept.values()))


def test_copy_the_graph_returns_stays() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return aten.unsqueeze_copy.default(aten.mul.Tensor(x, 2.0), 0)

    gm = _trace(fn, torch.ones(2, 3))
    report = copies_as_views(gm)
    assert not report.viewed and "returns" in next(iter(report.kept.values()))


def test_view_of_an_in_place_result_is_taken_of_the_tensor_it_wrote() -> None:
    """exir plans a view on its base's allocation; ``index_put_``'s result has none of its own."""

    def fn(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        written = aten.index_put_.default(x, [i], v)
        return aten.mul.Tensor(aten.unsqueeze_copy.default(written, 0), 1.0)

    gm = _trace(fn, torch.zeros(2, 3), torch.tensor([1]), torch.ones(1, 3))
    copies_as_views(gm)
    (view,) = [n for n in gm.graph.nodes if n.target == aten.view_copy.default]
    assert view.args[0].op == "placeholder" and view.args[1] == [1, 2, 3]
    x = torch.zeros(2, 3)
    expected = torch.zeros(2, 3)
    expected[1] = 1.0
    torch.testing.assert_close(gm(x, torch.tensor([1]), torch.ones(1, 3)), expected.unsqueeze(0))


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_decoder_attention_reads_its_cache_without_copying_it(backend: str) -> None:
    """A decoder that repeats K/V with ``unsqueeze -> expand -> reshape`` (one KV head per query
    head, as ExecuTorch's Llama example does) and attends through ``scaled_dot_product_attention``:
    through writeback, no ``unsqueeze_copy`` or ``expand_copy`` of the cache's size is left outside
    a delegate, and every step of stock ``executorch.runtime`` equals eager."""
    from executorch.runtime import Runtime
    from writeback_core import load_registry
    from writeback_core.exporting import export_model
    from writeback_core.lowering import lower
    from writeback_passes import plugin as passes_plugin

    torch.manual_seed(0)
    model = RepeatKV().eval()
    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    lowered = lower(export_model(copy.deepcopy(model), _step(0)), registry, registry.backends()[backend], "planned")
    cache_numel = model.k.numel()
    graph = lowered.program.exported_program().graph
    cache_sized = [
        n.name
        for n in graph.nodes
        if n.op == "call_function"
        and any(k in str(n.target) for k in ("unsqueeze_copy", "expand_copy"))
        and isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].numel() >= cache_numel
    ]
    assert cache_sized == []
    program = Runtime.get().load_program(lowered.pte)  # kept alive: its methods read its memory
    method = program.load_method("forward")
    for step in range(4):
        got = method.execute(list(_step(step)))[0]
        with torch.no_grad():
            want = model(*_step(step))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"step {step}")


class RepeatKV(torch.nn.Module):
    """One attention layer over a KV cache [1, heads, 16, 8], K/V repeated ``n_rep = 1`` times."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 16, 8))
        self.register_buffer("v", torch.zeros(1, 2, 16, 8))
        self.proj = torch.nn.Linear(8, 48)

    def forward(self, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).view(1, 1, 6, 8).transpose(1, 2).split(2, dim=1)
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        keys = self.k.unsqueeze(2).expand(1, 2, 1, 16, 8).reshape(1, 2, 16, 8)
        values = self.v.unsqueeze(2).expand(1, 2, 1, 16, 8).reshape(1, 2, 16, 8)
        mask = torch.arange(16).view(1, 1, 1, 16) <= pos.view(1, 1, 1, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def _step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([step]), torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(step))


def test_scalar_multiply_of_the_big_matmul_operand_moves_to_the_small_one() -> None:
    """``bmm(q * a, view(k * a))`` (decomposed attention: ``k`` is the whole cache) becomes
    ``bmm(q * a * a, view(k))``: the same product, and no multiply of the cache-sized operand."""
    from writeback_core.matmul_scaling import scale_smaller_operand

    def fn(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        small = aten.mul.Scalar(q, 0.5)
        big = aten.view_copy.default(aten.mul.Scalar(k, 0.5), [2, 4, 16])
        return aten.bmm.default(small, big)

    q, k = torch.randn(2, 1, 4), torch.randn(2, 4, 16)
    gm = _trace(fn, q, k)
    report = scale_smaller_operand(gm)
    assert report.moved
    muls = [n for n in gm.graph.nodes if n.target == aten.mul.Scalar]
    assert [tuple(n.meta["val"].shape) for n in muls] == [(2, 1, 4), (2, 1, 4)]
    torch.testing.assert_close(gm(q, k), (q * 0.5) @ (k * 0.5))


def test_scalar_multiply_read_elsewhere_or_of_the_small_operand_stays() -> None:
    from writeback_core.matmul_scaling import scale_smaller_operand

    def read_twice(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = aten.mul.Scalar(k, 0.5)
        return aten.bmm.default(q, scaled), aten.sum.default(scaled)

    def small_scaled(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return aten.bmm.default(q, aten.mul.Scalar(k, 0.5))

    q = torch.randn(2, 1, 4)
    assert not scale_smaller_operand(_trace(read_twice, q, torch.randn(2, 4, 16))).moved
    # k [2, 4, 1] has fewer elements than q [2, 1, 4]... equal: nothing is gained, nothing moves.
    assert not scale_smaller_operand(_trace(small_scaled, q, torch.randn(2, 4, 1))).moved


def test_functional_pass_drops_a_plain_clone_but_not_one_of_a_placeholder() -> None:
    """Before partitioning: ``clone(unsqueeze(x * 2))`` is the value of ``x * 2``, so both copies
    go; ``clone(state)`` stays, since a later in-place write of the state may need its old value."""
    from writeback_passes.view_copies import functional_copies_as_views

    def fn(x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        made = aten.clone.default(aten.unsqueeze_copy.default(aten.mul.Tensor(x, 2.0), 0))
        kept = aten.clone.default(state)
        return aten.add.Tensor(made, 1.0), aten.add.Tensor(kept, 1.0)

    x, state = torch.randn(2, 3), torch.randn(2, 3)
    gm = _trace(fn, x, state)
    report = functional_copies_as_views(gm)
    assert report.viewed and report.removed
    assert [str(n.target) for n in gm.graph.nodes if "clone" in str(n.target)] == ["aten.clone.default"]
    assert any("placeholder" in why for why in report.kept.values())
    made, kept = gm(x, state)
    torch.testing.assert_close(made, (x * 2.0).unsqueeze(0) + 1.0)
    torch.testing.assert_close(kept, state + 1.0)

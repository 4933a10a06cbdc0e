"""Attention reads only the keys its mask opens (``writeback_passes.bounded_attention``).

A tiny decoder layer written the way ExecuTorch's Llama example writes it with a dynamic
token dimension (cache written by ``index_copy_`` at ``arange(n) + start``, mask rows
``[start, start + n)`` of a causal table) is lowered through writeback and run in stock
``executorch.runtime`` over prompts of several lengths: logits and cache equal eager's.
Each refusal rule is made to fire on a variant of that layer, and the whole et-llama case
is checked through ``writeback run``'s path.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from writeback.model_build import export_case
from writeback_core import load_registry
from writeback_core.exporting import export_model
from writeback_core.lowering import lower
from writeback_passes import plugin as passes_plugin
from writeback_passes.bounded_attention import BoundReport, bound_attention
from writeback_passes.runner_attention import attention_to_runner_kernels

RUNNER = "runner_attention"

POSITIONS, HEADS, DIM = 16, 2, 8


class Layer(torch.nn.Module):
    """One attention over a ``[1, HEADS, POSITIONS, DIM]`` cache; variants break one rule each."""

    cache_k: torch.Tensor
    cache_v: torch.Tensor
    table: torch.Tensor

    def __init__(self, variant: str = "") -> None:
        super().__init__()
        self.variant = variant
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(DIM, 3 * HEADS * DIM)
        table: torch.Tensor = torch.tril(torch.ones(POSITIONS, POSITIONS, dtype=torch.bool))
        if variant == "opens-past-diagonal":
            table = torch.tril(torch.ones(POSITIONS, POSITIONS, dtype=torch.bool), diagonal=1)
        elif variant == "finfo-min":
            table = torch.zeros(POSITIONS, POSITIONS).masked_fill(~table, torch.finfo(torch.float32).min)
        elif variant == "float":
            table = torch.zeros(POSITIONS, POSITIONS).masked_fill(~table, float("-inf"))
        elif variant == "window":  # a sliding window of 4: causal, not exactly is_causal
            table = torch.tril(torch.ones(POSITIONS, POSITIONS, dtype=torch.bool)).triu(-3)
        elif variant == "float-window":
            window = torch.tril(torch.ones(POSITIONS, POSITIONS, dtype=torch.bool)).triu(-3)
            table = torch.zeros(POSITIONS, POSITIONS).masked_fill(~window, float("-inf"))
        elif variant == "one-column":  # broadcast along the keys: every key open
            table = torch.ones(POSITIONS, 1, dtype=torch.bool)
        self.register_buffer("table", table, persistent=False)
        start = torch.full((1, HEADS, POSITIONS, DIM), float("inf")) if variant == "inf-cache" else None
        self.register_buffer("cache_k", torch.zeros(1, HEADS, POSITIONS, DIM) if start is None else start)
        self.register_buffer("cache_v", torch.zeros(1, HEADS, POSITIONS, DIM))

    def project(self, x: torch.Tensor, start: Any) -> torch.Tensor:
        """Queries, keys and values of ``x`` as ``[3, 1, heads, n, dim]``, ``start`` checked in range."""
        n = x.shape[1]
        torch._check(start >= 0)
        torch._check(start + n <= POSITIONS)
        return self.proj(x).view(1, n, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        start = input_pos.max().item() if self.variant == "start-from-max" else input_pos[0].item()
        q, k, v = self.project(x, start)
        rows = torch.arange(n) + start
        if self.variant == "rows-from-input":
            rows = input_pos + torch.arange(n)
        keys = self.cache_k.index_copy_(2, rows, k)
        values = self.cache_v.index_copy_(2, rows, v)
        if self.variant == "slice-assigned":  # the cache written as k_cache[:, :, rows] = k
            self.cache_k[:, :, rows] = k
            keys = self.cache_k
        if self.variant == "computed-keys":
            keys = keys * 2
        if self.variant == "repeat-along-keys":
            keys = keys.repeat_interleave(1, dim=2)
        mask = self.table.narrow(0, start, n)
        if self.variant == "index-rows":
            mask = self.table[rows]
        if self.variant == "written-table":
            self.table.logical_and_(torch.ones_like(self.table))
        dropout = 0.5 if self.variant == "dropout" else 0.0
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout)
        if self.variant == "cache-read-twice":
            out = out + keys.mean()
        return out.transpose(1, 2).reshape(1, n, HEADS * DIM)


class CallerCache(Layer):
    """The same attention over a cache the caller passes (an input written in place)."""

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # a third input: the caller's key cache
        n = x.shape[1]
        start = input_pos[0].item()
        q, k, v = self.project(x, start)
        keys = cache.index_copy_(2, torch.arange(n) + start, k)
        values = self.cache_v.index_copy_(2, torch.arange(n) + start, v)
        mask = self.table.narrow(0, start, n)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return out.transpose(1, 2).reshape(1, n, HEADS * DIM)


def _export(module: torch.nn.Module, caller_cache: bool = False) -> Any:
    tokens = torch.export.Dim("tokens", min=1, max=POSITIONS)
    args: tuple[Any, ...] = (torch.randn(1, 2, DIM), torch.tensor([0]))
    shapes: tuple[Any, ...] = ({1: tokens}, None)
    if caller_cache:
        args, shapes = (*args, torch.zeros(1, HEADS, POSITIONS, DIM)), (*shapes, None)
    return export_model(module, args, strict=False, dynamic_shapes=shapes)


def _report(variant: str) -> BoundReport:
    return bound_attention(_export(Layer(variant).eval()))


@pytest.mark.parametrize(
    ("variant", "pass_name"),
    [
        ("window", "bound_attention"),
        # the float-mask window is bounded by the same rule; its run over every prompt is slow-tier
        pytest.param("float-window", "bound_attention", marks=pytest.mark.slow),
        ("", RUNNER),
        ("float", RUNNER),
    ],
)
@pytest.mark.parametrize("backend", ["portable", pytest.param("xnnpack", marks=pytest.mark.slow)])
def test_attention_answers_as_eager_over_prompts_of_several_lengths(variant: str, pass_name: str, backend: str) -> None:
    """A sliding-window table is bounded (``bound_attention``); an exactly causal one moves onto
    the runner's kernels (``runner_attention``, which reports it and leaves nothing to bound)."""
    from executorch.runtime import Runtime

    module = Layer(variant).eval()
    eager = copy.deepcopy(module)
    exported = _export(module)
    runner = attention_to_runner_kernels(copy.deepcopy(exported))
    assert len(runner.rewritten) == (pass_name == RUNNER)
    if pass_name != RUNNER:
        assert "not exactly causal" in next(iter(runner.refused.values()))
        assert len(bound_attention(copy.deepcopy(exported)).bounded) == 1
    registry = load_registry(entry_points=False, plugins=[passes_plugin])
    lowered = lower(exported, registry, registry.backends()[backend], "planned")
    assert lowered.passes[:2] == (RUNNER, "bound_attention")
    assert lowered.write_back_bytes == {}  # the caches stay written in place
    operators = {op.name for op in lowered.program.executorch_program.execution_plan[0].operators}
    assert ("llama::custom_sdpa" in operators) == (pass_name == RUNNER)
    method = Runtime.get().load_program(lowered.pte).load_method("forward")
    start = 0
    torch.manual_seed(1)
    with torch.no_grad():
        for n in (5, 1, 1, 3, 6):
            x = torch.randn(1, n, DIM)
            got = method.execute([x, torch.tensor([start])])[0]
            torch.testing.assert_close(got, eager(x, torch.tensor([start])), rtol=1e-5, atol=1e-5)
            start += n
    assert start == POSITIONS  # the last call ends at the last position
    del method


def test_bounded_attention_reads_a_shorter_key_axis_than_the_cache() -> None:
    """The attention's keys are ``[0, start + n)``: at start 3 with 2 tokens, 5 of 16 positions,
    and the answer is eager's."""
    module = Layer("window").eval()
    eager = copy.deepcopy(module)
    exported = _export(module)
    bound_attention(exported)
    graph_module = exported.module()
    seen: list[tuple[int, ...]] = []

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            if n.target is torch.ops.aten.scaled_dot_product_attention.default:
                seen.append(tuple(self.env[n.args[1]].shape))
            return result

    x = torch.randn(1, 3, DIM)
    with torch.no_grad():
        eager(x, torch.tensor([0]))
        Recorder(graph_module).run(x, torch.tensor([0]))
        x = torch.randn(1, 2, DIM)
        got = Recorder(graph_module).run(x, torch.tensor([3]))
    assert seen == [(1, HEADS, 3, DIM), (1, HEADS, 5, DIM)]
    torch.testing.assert_close(got, eager(x, torch.tensor([3])), rtol=1e-5, atol=1e-5)


REFUSALS: list[tuple[str, str]] = [
    ("index-rows", "not rows [start, start + n) of a constant table"),
    ("opens-past-diagonal", "row 0 opens column 1 past its own position"),
    ("finfo-min", "only -inf closes a column exactly"),
    ("one-column", "its columns must be the 16 key positions"),
    ("dropout", "dropout_p is not 0"),
    ("computed-keys", "the key is computed by"),
    ("repeat-along-keys", "the key is reshaped along its key axis"),
    ("written-table", "is written by the program"),
    ("inf-cache", "starts with non-finite values"),
]


@pytest.mark.parametrize(("variant", "reason"), REFUSALS)
def test_each_refusal_rule_fires_and_leaves_the_attention_whole(variant: str, reason: str) -> None:
    exported = _export(Layer(variant).eval())
    before = [str(n.args) for n in exported.graph_module.graph.nodes]
    report = bound_attention(exported)
    assert report.bounded == []
    (why,) = report.refused.values()
    assert reason in why
    assert [str(n.args) for n in exported.graph_module.graph.nodes] == before  # nothing changed


def test_a_cache_the_caller_passes_is_refused_naming_the_input() -> None:
    report = bound_attention(_export(CallerCache().eval(), caller_cache=True))
    assert report.bounded == []
    (why,) = report.refused.values()
    assert "read from input 'cache'" in why and "non-finite" in why
    runner = attention_to_runner_kernels(_export(CallerCache().eval(), caller_cache=True))
    assert runner.rewritten == [] and "read from input 'cache'" in next(iter(runner.refused.values()))


RUNNER_REFUSALS: list[tuple[str, str]] = [
    ("window", "not exactly causal"),
    ("rows-from-input", "rows are not written at arange(n) + start"),
    ("cache-read-twice", "is read by more than this attention"),
    ("repeat-along-keys", "reshaped along its key axis"),
    ("slice-assigned", "is not a cache written by index_copy_"),
    ("start-from-max", "the mask's start is not an element of a one-element input"),
]


class CallerMask(Layer):
    """The same attention with the mask table passed by the caller."""

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # a third input: the caller's mask table
        n = x.shape[1]
        start = input_pos[0].item()
        q, k, v = self.project(x, start)
        keys = self.cache_k.index_copy_(2, torch.arange(n) + start, k)
        values = self.cache_v.index_copy_(2, torch.arange(n) + start, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=table.narrow(0, start, n))
        return out.transpose(1, 2).reshape(1, n, HEADS * DIM)


def test_a_mask_table_the_caller_passes_is_refused_by_both_passes() -> None:
    def exported() -> Any:
        tokens = torch.export.Dim("tokens", min=1, max=POSITIONS)
        table = torch.tril(torch.ones(POSITIONS, POSITIONS, dtype=torch.bool))
        args = (torch.randn(1, 2, DIM), torch.tensor([0]), table)
        return export_model(CallerMask().eval(), args, strict=False, dynamic_shapes=({1: tokens}, None, None))

    bounded = bound_attention(exported())
    assert bounded.bounded == [] and "is not a constant of the program" in next(iter(bounded.refused.values()))
    runner = attention_to_runner_kernels(exported())
    assert runner.rewritten == [] and "is not a constant of the program" in next(iter(runner.refused.values()))


@pytest.mark.parametrize(("variant", "reason"), RUNNER_REFUSALS)
def test_each_runner_kernel_refusal_fires_and_leaves_the_graph_unchanged(variant: str, reason: str) -> None:
    exported = _export(Layer(variant).eval())
    before = [str(n.args) for n in exported.graph_module.graph.nodes]
    report = attention_to_runner_kernels(exported)
    assert report.rewritten == []
    (why,) = report.refused.values()
    assert reason in why
    assert [str(n.args) for n in exported.graph_module.graph.nodes] == before


def test_runner_kernels_store_the_cache_positions_first_with_the_same_bytes() -> None:
    """The rewritten program keeps the cache buffer (same name, same bytes) as ``[1, positions,
    heads, dim]``, and answers as eager over two calls."""
    module = Layer().eval()
    eager = copy.deepcopy(module)
    exported = _export(module)
    assert attention_to_runner_kernels(exported).rewritten == ["scaled_dot_product_attention"]
    assert exported.state_dict["cache_k"].shape == (1, POSITIONS, HEADS, DIM)
    targets = {str(n.target) for n in exported.graph_module.graph.nodes}
    assert {"llama.update_cache.default", "llama.custom_sdpa.default"} <= targets
    assert "aten.index_copy_.default" not in targets
    runnable = exported.module()
    with torch.no_grad():
        for start, n in ((0, 4), (4, 1)):
            x = torch.randn(1, n, DIM)
            got = runnable(x, torch.tensor([start]))
            torch.testing.assert_close(got, eager(x, torch.tensor([start])), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
def test_et_llama_prefill_in_one_call_bounds_every_layer_and_answers_as_eager(backend: str) -> None:
    """ExecuTorch's Llama exported as ``export_llama --enable_dynamic_shape`` does: every
    layer's attention bounded, caches in place, the stock runtime equal to eager over a
    prompt, single tokens and a short chunk, up to the last position."""
    from executorch.runtime import Runtime

    registry = load_registry()
    case = registry.models()["et-llama"].dynamic_prefill
    assert case is not None
    prefill = case()
    assert prefill.constant_methods["enable_dynamic_shape"] is True
    assert prefill.constant_methods["get_max_seq_len"] == 32
    assert len(bound_attention(export_case(prefill)).bounded) == 2
    lowered = lower(export_case(prefill), registry, registry.backends()[backend], "state", prefill)
    assert lowered.write_back_bytes == {}
    eager = prefill.build()
    method = Runtime.get().load_program(lowered.pte).load_method("forward")
    start = 0
    with torch.no_grad():
        for ids in ([1, 5, 9, 2, 7, 3, 3], [4], [8], [6, 6, 1], *([[2]] * 20)):
            tokens, pos = torch.tensor([ids]), torch.tensor([start])
            got = method.execute([tokens, pos])[0]
            torch.testing.assert_close(got, eager(tokens, attn_options={"input_pos": pos}), rtol=1e-4, atol=1e-4)
            start += len(ids)
    assert start == 32
    del method

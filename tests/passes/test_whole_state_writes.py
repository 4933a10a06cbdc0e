"""A state the model rewrites whole every call, written once by the kernel that computes it.

Each form (a shift register, an SSM-style elementwise update, a DeltaNet-style matmul update,
a counter) is lowered through the pipeline on portable and xnnpack and run for several calls:
the outputs and the state after every call equal eager PyTorch's, and the program has no
whole-state write-back ``copy_`` left, or each one left is named with the model's source line
and its reason. Each refusal rule of ``whole_state_writes`` (and, on xnnpack, of
``delegate_output_refusal``) is made to fire.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch import nn
from writeback.run import run_model
from writeback.session import assemble
from writeback_core.registry import load_registry
from writeback_core.types import ModelCase

CALLS = 4


class ShiftRegister(nn.Module):
    """LFM2's short-convolution state: the last two columns of ``cat([state, x])``."""

    state: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(1, 8, 2))
        self.weight = nn.Parameter(torch.randn(8, 1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        window = torch.cat([self.state, x], dim=-1)
        self.state.copy_(window[..., -2:])
        return torch.nn.functional.conv1d(window, self.weight, groups=8)


class Ssm(nn.Module):
    """An SSM-style update ``h = a * h + b * x``."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.zeros(4, 8))
        self.a = nn.Parameter(torch.rand(4, 8))
        self.b = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = self.a * self.h + self.b * x
        self.h.copy_(new)
        return new.sum(0)


class DeltaRule(nn.Module):
    """A DeltaNet-style state: ``S = g * S + k^T (v - k S)`` (a product reads the old state)."""

    s: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.zeros(8, 8))
        # Three projections, not one split three ways.
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x).sigmoid(), self.k(x).sigmoid(), self.v(x)
        # As ExecuTorch's _naive_gated_delta_rule spells its products (mul and sum): stock
        # XNNPACK partitioning of mm reading a mutated buffer fails in ExecuTorch 1.5.1 too.
        delta = v - (k.transpose(0, 1) * self.s).sum(0, keepdim=True)
        new = 0.9 * self.s + k.transpose(0, 1) * delta  # the outer product k^T delta
        self.s.copy_(new)
        result: torch.Tensor = (q.transpose(0, 1) * new).sum(0)
        return result


class Counter(nn.Module):
    """A counter bumped every call, read by the output."""

    n: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        return x * self.n


FORMS = {
    "shift-register": (ShiftRegister, (1, 8, 1)),
    "ssm": (Ssm, (4, 8)),
    "delta-rule": (DeltaRule, (1, 8)),
    "counter": (Counter, (3,)),
}


def _case(name: str) -> ModelCase:
    build, shape = FORMS[name]

    def built() -> nn.Module:
        torch.manual_seed(0)
        return build().requires_grad_(False)

    return ModelCase(
        name=name,
        description=f"whole-state form {name}",
        build=built,
        step_inputs=lambda step: (torch.randn(shape, generator=torch.Generator().manual_seed(step)),),
    )


def _run(case: ModelCase, backend: str, tmp_path: Path) -> tuple[object, list[torch.Tensor]]:
    report = run_model(assemble(load_registry(), backend), case, CALLS, tmp_path / "model.pte")
    assert not report.failures
    return report, [result.outputs[-1] for result, _ in report.steps]


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
@pytest.mark.parametrize("name", sorted(FORMS))
def test_whole_state_written_once_and_state_after_every_call_equals_eager(
    name: str, backend: str, tmp_path: Path
) -> None:
    case = _case(name)
    report, outputs = _run(case, backend, tmp_path)
    eager = case.build().eval()
    # Every form's output reads the state the call left (or the one before it): equal outputs
    # call after call are equal states.
    for step in range(CALLS):
        with torch.no_grad():
            expected = eager(*case.step_inputs(step))
        torch.testing.assert_close(outputs[step], expected, rtol=1e-5, atol=1e-5, msg=f"{name} call {step}")
    copies = report.lowered.write_back_bytes  # type: ignore[attr-defined]
    kept = {c.state: c.reason for c in report.lowered.copies_left}  # type: ignore[attr-defined]
    # On portable the kernel computing the new value writes the state; on xnnpack the
    # delegate's result is planned onto the state's memory: no copy either way.
    assert copies == {}, f"{name}: {kept}"


class FromInput(nn.Module):
    """The state replaced by the caller's tensor: no kernel computes the new value."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.h * 2
        self.h.copy_(x)
        return out


class FromView(nn.Module):
    """The new value is a view (a reshape) of a kernel's output, not a kernel's own output."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.h.reshape(32) * 0.5 + x
        self.h.copy_(flat.view(4, 8))
        return flat


class ReadAfter(nn.Module):
    """The old state is read after its new value is computed."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = self.h * 0.5 + x
        old = self.h.sum(0)
        self.h.copy_(new)
        return new.sum(0) + old


class Flipped(nn.Module):
    """The kernel computing the new value reads the state in reverse order."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.arange(8.0).reshape(1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h.copy_(self.h.flip(-1))
        return self.h + x


REFUSALS = {
    "from-input": (FromInput, (4, 8), "is the program's input 'x', which no kernel of the program computes"),
    "from-view": (FromView, (32,), "is not the single output, of the state's shape, dtype and layout"),
    "read-after": (ReadAfter, (4, 8), "reads the old value after the new one is computed"),
    "flipped": (Flipped, (1, 8), "reads the state in another element order"),
}


def _copies_kept(name: str, build: type[nn.Module], shape: tuple[int, ...], backend: str, tmp_path: Path) -> list[str]:
    """Run form ``name`` on ``backend``, check every call's output against eager's, and return
    the reasons of the copies the lowering kept."""
    FORMS[name] = (build, shape)
    try:
        case = _case(name)
        report, outputs = _run(case, backend, tmp_path)
    finally:
        del FORMS[name]
    eager = case.build().eval()
    for step in range(CALLS):
        with torch.no_grad():
            torch.testing.assert_close(outputs[step], eager(*case.step_inputs(step)), msg=f"{name} call {step}")
    return [c.reason for c in report.lowered.copies_left]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_each_refusal_keeps_the_copy_names_the_source_line_and_matches_eager(name: str, tmp_path: Path) -> None:
    build, shape, words = REFUSALS[name]
    kept = _copies_kept(name, build, shape, "portable", tmp_path)
    assert len(kept) == 1 and words in kept[0], kept
    lines, first = inspect.getsourcelines(build.forward)
    assert name == "from-input" or any(
        f"test_whole_state_writes.py:{first + i}" in kept[0] for i in range(len(lines))
    ), kept[0]
    assert "_default" not in kept[0] and "aten_" not in kept[0]  # the model's terms, no graph-node names


class IndexWrite(nn.Module):
    cache: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum(0)


@pytest.mark.parametrize("reader", ["_assert_tensor_metadata", "sum"])
def test_a_metadata_only_node_after_the_write_is_no_read_of_the_old_value(reader: str) -> None:
    """``explain``'s false positive: ``_assert_tensor_metadata`` checks dtype and shape and
    reads no element, so it never keeps a write from being made in place; a real read (``sum``)
    of the old value after the write still does."""
    from writeback_passes.state_write_refusals import in_place_kernel_refusal

    args = (torch.ones(1, 4), torch.tensor([2]))
    program = torch.export.export(IndexWrite(), args, strict=False).run_decompositions()
    graph = program.graph_module.graph
    state = next(n for n in graph.nodes if n.op == "placeholder" and "cache" in n.name)
    write = next(n for n in graph.nodes if n.op == "call_function" and "index_put" in str(n.target))
    with graph.inserting_after(write):
        if reader == "sum":
            graph.call_function(torch.ops.aten.sum.default, (state,))
        else:
            graph.call_function(torch.ops.aten._assert_tensor_metadata.default, (state,), {"dtype": torch.float32})
    refusal = in_place_kernel_refusal(graph, state.name, write.name)
    if reader == "sum":
        assert refusal is not None and "reads the old value" in refusal
    else:
        assert refusal is None


class ReadAfterInDelegate(nn.Module):
    """XNNPACK computes the new state, then reads the old one in the same delegate."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.arange(32.0).reshape(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = self.h * 0.5 + x
        old = self.h * 2.0
        self.h.copy_(new)
        return new + old


class TransposedInDelegate(nn.Module):
    """The new state is the old one transposed: XNNPACK's transpose reads it in another order."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.arange(64.0).reshape(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h.copy_(self.h.transpose(0, 1).clone())
        return self.h * x


class ReturnedFromDelegate(nn.Module):
    """The new state is also the program's output: it must not live in the state's memory."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.arange(32.0).reshape(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = self.h * 0.5 + x
        self.h.copy_(new)
        return new


class ReadByLaterDelegate(nn.Module):
    """A second XNNPACK delegate, after a portable ``cumsum``, reads the old state."""

    h: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.arange(32.0).reshape(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = self.h * 0.5 + x
        later = new.cumsum(0) + self.h
        self.h.copy_(new)
        return later


XNNPACK_REFUSALS = {
    "read-by-later-delegate": (
        ReadByLaterDelegate,
        (4, 8),
        "reads the old value after the delegate computes the new one",
    ),
    "read-after-in-delegate": (
        ReadAfterInDelegate,
        (4, 8),
        "reads the old value inside the delegate after the operator computing the new one",
    ),
    "transposed-in-delegate": (TransposedInDelegate, (8, 8), "permute_copy) reads the state in another element order"),
    "returned-from-delegate": (ReturnedFromDelegate, (4, 8), "the program also returns the new value"),
}


@pytest.mark.parametrize("name", sorted(XNNPACK_REFUSALS))
def test_each_xnnpack_refusal_keeps_the_copy_names_the_source_line_and_matches_eager(name: str, tmp_path: Path) -> None:
    """Where a delegate operator would read the old state after (or while) the new one is
    written into its memory, the copy stays, named with the model's line, and the state after
    every call equals eager's (each form's output reads it)."""
    build, shape, words = XNNPACK_REFUSALS[name]
    kept = _copies_kept(name, build, shape, "xnnpack", tmp_path)
    assert len(kept) == 1 and words in kept[0] and "inside delegate XnnpackBackend" in kept[0], kept
    lines, first = inspect.getsourcelines(build.forward)
    assert any(f"test_whole_state_writes.py:{first + i}" in kept[0] for i in range(len(lines))), kept[0]
    assert "_default" not in kept[0] and "aten_" not in kept[0]

"""The MLX delegate's compiled path: a static program is traced once at ``init`` and each
call checks its indices on the host, builds nothing in Python and evaluates MLX once; a
program that writes a caller's tensor in place takes the interpreted path and says why.
Real lowering, real pybind-runtime, real MLX; every value compared with eager PyTorch."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
import writeback_mlx_backend.fast.rms_norm as rms_norm_module
import writeback_mlx_backend.fast.rope as rope_module
import writeback_mlx_backend.fast.sdpa as sdpa_module
import writeback_mlx_backend.op_indexing as op_indexing_module
import writeback_mlx_backend.op_math as op_math_module
import writeback_mlx_backend.op_shapes as op_shapes_module
import writeback_mlx_backend.op_table as op_table_module
from executorch.exir.lowered_backend_module import LoweredBackendModule
from writeback.zoo import DecoderConfig, TinyDecoder
from writeback_mlx_backend import MLXDelegate

from tests.mlx_backend.lowering import lower_mlx

# The op handlers: ATen ops (op_math.py, op_shapes.py, op_indexing.py, the table in op_table.py)
# and the fused steps the runtime makes (fast/).
OPS_FILES = {
    str(Path(m.__file__).resolve())
    for m in (
        op_table_module,
        op_math_module,
        op_shapes_module,
        op_indexing_module,
        rms_norm_module,
        sdpa_module,
        rope_module,
    )
}


def _within(frame: FrameType | None, function: str) -> bool:
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


@contextmanager
def counted(monkeypatch: pytest.MonkeyPatch, besides: str | None = None) -> Iterator[dict[str, int]]:
    """Count ``mx.eval`` calls and Python calls into the delegate's op handlers (except, with
    ``besides``, those made within the runtime function of that name)."""
    counts = {"eval": 0, "op calls": 0}
    real_eval = mx.eval

    def eval_(*arrays: Any) -> None:
        counts["eval"] += 1
        real_eval(*arrays)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and str(Path(frame.f_code.co_filename).resolve()) in OPS_FILES:
            if besides is None or not _within(frame, besides):
                counts["op calls"] += 1

    monkeypatch.setattr(mx, "eval", eval_)
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)
        monkeypatch.setattr(mx, "eval", real_eval)


def _blob(module: torch.nn.Module, args: tuple[Any, ...]) -> bytes:
    lowered = lower_mlx(module, args)
    assert lowered.only_delegate_runs()
    (found,) = [
        m for m in lowered.program.exported_program().graph_module.children() if isinstance(m, LoweredBackendModule)
    ]
    return bytes(found.processed_bytes)


def _decoder() -> tuple[TinyDecoder, TinyDecoder]:
    cfg = DecoderConfig(vocab=32, dim=64, heads=4, max_seq=16, layers=2, hidden=128)
    return TinyDecoder(cfg), TinyDecoder(cfg)


def test_decoder_call_runs_no_op_in_python_and_evaluates_once_and_matches_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mine, eager = _decoder()
    lowered = lower_mlx(mine, (torch.tensor([[1]]), torch.tensor([0])))
    assert lowered.only_delegate_runs()
    method = lowered.method()
    delegate = lowered.delegate()
    # Each layer's two RMSNorms and the final one run as mx.fast.rms_norm, and each layer's
    # attention as mx.fast.scaled_dot_product_attention.
    norms = sum(1 for m in eager.modules() if type(m).__name__ == "RMSNorm")
    assert norms == 5
    assert list(delegate.execution_paths) == [
        f"compiled; {norms} RMSNorm(s) as mx.fast.rms_norm; 2 attention(s) as mx.fast.scaled_dot_product_attention"
    ]
    for step in range(6):
        tokens, pos = torch.tensor([[(5 * step + 2) % 32]]), torch.tensor([step])
        with counted(monkeypatch) as counts:
            (logits,) = method.execute([tokens, pos])
        assert counts == {"eval": 1, "op calls": 0}, f"step {step}"
        with torch.no_grad():
            expected = eager(tokens, pos)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_weights_read_through_a_transpose_are_laid_out_once_at_init() -> None:
    mine, _ = _decoder()
    handle = MLXDelegate().init(_blob(mine, (torch.tensor([[1]]), torch.tensor([0]))), {})
    transposed = [
        s.name
        for s in handle.steps
        if s.handler is op_table_module.OPS["aten.permute_copy.default"] and s.args[0].name in handle.constants
    ]
    assert transposed == []
    # The weights the program read only through their transpose are gone; their
    # transposes are the constants now, contiguous.
    assert not any(name.startswith("p_") and name.endswith("wq_weight") for name in handle.constants)


class RowCache(torch.nn.Module):
    def __init__(self, rows: int = 8, width: int = 4) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(rows, width))
        self.register_buffer("table", torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3))

    def forward(self, pos: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.index_copy_(0, pos, row)
        return self.cache.sum(0), self.table[pos]


def _call(delegate: MLXDelegate, handle: Any, pos: int, value: float) -> list[torch.Tensor]:
    outputs = [torch.full((4,), -7.0), torch.full((1, 3), -7.0)]
    delegate.execute(handle, [torch.tensor([pos]), torch.full((1, 4), value), *outputs])
    return outputs


def test_index_out_of_range_on_the_compiled_path_is_named_and_writes_nothing() -> None:
    delegate = MLXDelegate()
    handle = delegate.init(_blob(RowCache(), (torch.tensor([0]), torch.ones(1, 4))), {})
    assert handle.path == "compiled"
    eager = RowCache()
    for pos in (2, 5):
        got = _call(delegate, handle, pos, pos + 0.5)
        with torch.no_grad():
            expected = eager(torch.tensor([pos]), torch.full((1, 4), pos + 0.5))
        for mine, theirs in zip(got, expected, strict=True):
            torch.testing.assert_close(mine, theirs)
    before = {k: np.array(v) for k, v in handle.state.items()}
    outputs = [torch.full((4,), -7.0), torch.full((1, 3), -7.0)]
    with pytest.raises(IndexError, match=r"index 8 .*out of range for dimension 0 of size 8"):
        delegate.execute(handle, [torch.tensor([8]), torch.ones(1, 4), *outputs])
    for output in outputs:
        assert bool((output == -7.0).all())
    for name, array in handle.state.items():
        np.testing.assert_array_equal(np.array(array), before[name])
    # The next call goes on from the state before the refused one.
    got = _call(delegate, handle, 7, 9.0)
    with torch.no_grad():
        expected = eager(torch.tensor([7]), torch.full((1, 4), 9.0))
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs)


class Gather(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(24, dtype=torch.float32).reshape(8, 3))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.table[pos] * 2.0


def test_gather_runs_inside_the_delegate_wraps_a_negative_index_and_refuses_one_out_of_range() -> None:
    lowered = lower_mlx(Gather(), (torch.tensor([0]),))
    assert "aten.index.Tensor" in lowered.delegated_ops()
    delegate = MLXDelegate()
    first = delegate.init(_blob(Gather(), (torch.tensor([0]),)), {})
    assert first.path == "compiled"
    eager = Gather()
    for pos in ([3], [-1], [0, -8, 7]):
        index = torch.tensor(pos)
        handle = delegate.init(_blob(Gather(), (index,)), {})
        out = torch.empty(len(pos), 3)
        delegate.execute(handle, [index, out])
        torch.testing.assert_close(out, eager(index))
    out = torch.full((1, 3), -7.0)
    with pytest.raises(IndexError, match=r"index: index 8 is out of range for dimension 0 of size 8"):
        delegate.execute(first, [torch.tensor([8]), out])
    assert bool((out == -7.0).all())


class CallerRows(torch.nn.Module):
    def forward(self, pos: torch.Tensor, row: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, row)
        return cache.sum(0)


def test_a_write_into_a_caller_tensor_takes_the_interpreted_path_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from writeback_mlx_backend import empty

    lowered = lower_mlx(CallerRows(), (torch.tensor([0]), torch.ones(1, 4), torch.zeros(8, 4)))
    method = lowered.method()
    (path,) = lowered.delegate().execution_paths
    assert path.startswith("interpreted: it writes a caller's tensor in place")
    cache, expected = empty((8, 4)), torch.zeros(8, 4)
    with counted(monkeypatch) as counts:
        *_, total = method.execute([torch.tensor([3]), torch.full((1, 4), 2.0), cache])
    assert counts["op calls"] > 0  # ops run one by one in Python
    expected[3] = 2.0
    torch.testing.assert_close(cache, expected)
    torch.testing.assert_close(total, expected.sum(0))


class CounterCache(torch.nn.Module):
    """Writes row ``count + shift`` of its cache, then counts: the index is computed inside
    the program from a buffer and an input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(6, 4))

    def forward(self, row: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, self.count.reshape(1) + shift, row)
        self.count.add_(1)
        return self.cache * 1.0


def test_index_computed_from_state_and_input_is_checked_before_the_graph_and_a_bad_one_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mine, eager = CounterCache(), CounterCache()
    lowered = lower_mlx(mine, (torch.ones(1, 4), torch.tensor([0])))
    assert lowered.only_delegate_runs()
    method, delegate = lowered.method(), lowered.delegate()
    assert list(delegate.execution_paths) == ["compiled"]

    def step(value: float, shift: int) -> None:
        row, moved = torch.full((1, 4), value), torch.tensor([shift])
        with counted(monkeypatch) as counts:
            (out,) = method.execute([row, moved])
        # The index alone first (a small graph), then the step: two evaluations, no op in Python.
        assert counts == {"eval": 2, "op calls": 0}
        with torch.no_grad():
            torch.testing.assert_close(out, eager(row, moved))

    for value in (1.0, 2.0, 3.0):
        step(value, 0)
    with pytest.raises(Exception, match=r"IndexError: index_copy: index 13 .* out of range for dimension 0 of size 6"):
        method.execute([torch.full((1, 4), 9.0), torch.tensor([10])])
    with pytest.raises(IndexError):
        eager(torch.full((1, 4), 9.0), torch.tensor([10]))
    # Nothing changed: row 3 is written next, and the count goes on from 3.
    step(4.0, 0)
    step(5.0, -2)


# hf-llama in the fast tier; the other architectures in the slow tier (CI runs both).
@pytest.mark.parametrize(
    "name",
    ["hf-llama", pytest.param("hf-qwen3", marks=pytest.mark.slow), pytest.param("hf-gemma", marks=pytest.mark.slow)],
)
def test_hugging_face_decoder_runs_compiled_in_one_delegate_with_bounded_attention_and_matches_eager(
    name: str, tmp_path: Path
) -> None:
    from writeback.run import run_model
    from writeback.session import assemble
    from writeback_core.registry import load_registry
    from writeback_decoders import hf_case, hf_config

    registry = load_registry()
    pipeline = assemble(registry, "mlx")
    case = hf_case(hf_config(name.removeprefix("hf-")), name=name, max_cache_len=64)
    report = run_model(pipeline, case, 40, tmp_path / "model.pte")
    assert not report.failures, report.failures[0][1].problems
    delegate = pipeline.delegates["WritebackMLXBackend"]
    assert isinstance(delegate, MLXDelegate)
    (path,) = delegate.execution_paths
    # The cache position is the mask's input; the write index is computed from the cache's
    # own length counter, evaluated alone before the graph.
    assert path.startswith("compiled; attention over 2 masked softmax(es) bounded by cache_position"), path
    # Every RMSNorm of the model (Qwen3 and Gemma also normalize q and k per head) is one
    # mx.fast.rms_norm; Gemma's weight is (1 + w), computed in the program.
    # Each layer's attention (two layers), exported as PyTorch's SDPA with its safe softmax,
    # is one mx.fast.scaled_dot_product_attention.
    norms = sum(1 for m in case.build().modules() if type(m).__name__.endswith("RMSNorm"))
    # And q and k of each layer are rotated by one mx.fast.rope each.
    suffix = (
        f"; {norms} RMSNorm(s) as mx.fast.rms_norm; 2 attention(s) as mx.fast.scaled_dot_product_attention; "
        "4 RoPE(s) as mx.fast.rope"
    )
    assert path.endswith(suffix), path
    assert list(delegate.attention_lengths)[-40:] == [32] * 32 + [48] * 8
    assert all(result.copied_bytes - result.delegate_copied_bytes == 0 for result, _ in report.steps)


class BigCache(torch.nn.Module):
    """A 96 MiB delegate-owned cache, one row written per call, the cache read after."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(6144, 4096))

    def forward(self, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, row)
        return self.cache[:8].sum(0)


def test_loading_a_large_cache_does_not_copy_it_and_calls_write_it_in_place() -> None:
    """Tracing at load must not evaluate the step on the real cache: without donation each
    updated state would be copied whole, doubling the cache's memory while the program
    loads (a 1 GiB cache needing 2 GiB). Load, then each call, peak at the cache's size
    plus small change."""
    cache_bytes = 6144 * 4096 * 4
    lowered = lower_mlx(BigCache(), (torch.tensor([0]), torch.ones(1, 4096)))
    assert lowered.only_delegate_runs()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    method = lowered.method()
    assert mx.get_peak_memory() - before < cache_bytes * 1.25
    (path,) = lowered.delegate().execution_paths
    assert path == "compiled"
    expected = torch.zeros(8, 4096)
    for step in range(3):
        pos, row = torch.tensor([step * 2]), torch.full((1, 4096), step + 1.0)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        (total,) = method.execute([pos, row])
        assert mx.get_peak_memory() - before < cache_bytes * 0.25, f"call {step}"
        expected[step * 2] = step + 1.0
        torch.testing.assert_close(total, expected.sum(0))

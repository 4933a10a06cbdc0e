"""Decode-step time against cache size: ``python -m writeback_bench.mlx``.

(``--vs-mlx`` runs another benchmark: the delegate against the same models written
by hand in MLX, see :func:`run_vs_mlx`.)

One decode step of an attention layer writes one slot of a static K and V cache
``[1, heads, S, head_dim]`` with ``index_copy_`` and attends over a fixed window
of the first ``window`` positions. The window keeps the step's arithmetic the
same at every cache size, so what grows with the cache is only what the
pipeline does with the state: copies back, copies in, failed buffer reuse.
(Attention over the whole cache reads all of it each step, which is O(cache)
for any implementation; that is not what this measures.)

Columns, each the median of ``--steps`` steps after warm-up, run side by side in
one process (every cell is prepared first, then the steps are interleaved across
all cells in a shuffled order, so load from other processes falls on every cell
alike):

- ``stock``: the same step with the caches as registered buffers, lowered by
  stock ``to_edge(...).to_executorch()`` and run by stock ``executorch.runtime``
  (portable kernels; the whole cache is copied back every step).
- ``mlx owned``: caches as buffers the MLX delegate owns (updated by donation).
- ``mlx caller (empty)``: caches owned by the caller, allocated with
  :func:`writeback_mlx_backend.empty`, written in place.
- ``mlx caller (torch)``: the same with plain torch caches, which MLX must copy
  in on every step (what ``writeback explain`` reports as a copy).

The MLX columns call the runtime delegate's ``execute`` on the blob of the
lowered ``.pte`` with the arguments the runtime would pass (the cache tensor as
both input and in-place output); the runtime's own overhead is not included.
"""

from __future__ import annotations

import argparse
import math
import operator
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from writeback_core.quiet import known_warnings_ignored

if TYPE_CHECKING:
    from writeback_core.types import ModelCase

    from writeback_bench.mlx_handwritten import Attend

__all__ = ["WindowDecodeStep", "main", "one_core", "run_vs_mlx"]


class WindowDecodeStep(nn.Module):
    """One attention decode step over a fixed window of a static KV cache.

    ``forward(x, pos)`` with buffer caches, or ``forward(x, pos, k_cache, v_cache)``
    with caller caches; the caches are ``[1, heads, max_seq, head_dim]``.
    """

    def __init__(
        self, max_seq: int, caller_cache: bool, heads: int = 8, head_dim: int = 64, window: int = 64, seed: int = 0
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.window = heads, head_dim, window
        self.max_seq = max_seq
        self.caller_cache = caller_cache
        dim = heads * head_dim
        gen = torch.Generator().manual_seed(seed)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            for layer in (self.wq, self.wk, self.wv, self.wo):
                layer.weight.copy_(torch.randn(dim, dim, generator=gen) / math.sqrt(dim))
        if not caller_cache:
            self.register_buffer("k_cache", torch.zeros(self.cache_shape))
            self.register_buffer("v_cache", torch.zeros(self.cache_shape))

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return (1, self.heads, self.max_seq, self.head_dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, *caches: torch.Tensor) -> torch.Tensor:
        if self.caller_cache:
            k_cache, v_cache = caches
        else:
            k_cache, v_cache = self.get_buffer("k_cache"), self.get_buffer("v_cache")
        shape = (1, 1, self.heads, self.head_dim)
        q = self.wq(x).view(shape).transpose(1, 2)
        k_cache.index_copy_(2, pos, self.wk(x).view(shape).transpose(1, 2))
        v_cache.index_copy_(2, pos, self.wv(x).view(shape).transpose(1, 2))
        keys = k_cache[:, :, : self.window]
        values = v_cache[:, :, : self.window]
        visible = torch.arange(self.window).view(1, self.window) <= pos.view(1, 1)
        scores = q @ keys.transpose(2, 3) / math.sqrt(self.head_dim)
        scores = scores + torch.where(visible, 0.0, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(1, 1, self.heads * self.head_dim))
        return projected


def _max_seq(cache_bytes: int, heads: int = 8, head_dim: int = 64) -> int:
    return max(64, cache_bytes // (2 * heads * head_dim * 4))


def _export(module: nn.Module, args: tuple[Any, ...]) -> Any:
    from writeback_core.program import export_model

    return export_model(module, args)


def _inputs(step: int, dim: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(1, 1, dim, generator=gen), torch.tensor([step % window])


def _medians_ms(runners: Sequence[Runner], steps: int, warmup: int = 3) -> list[float]:
    """Run every runner once per step, in turn, and return each one's median time."""
    times: list[list[float]] = [[] for _ in runners]
    for step in range(warmup + steps):
        # A fresh order each round, so no cell always follows the same neighbour
        # (a stock step evicts the CPU caches of whatever runs next).
        for index in random.Random(step).sample(range(len(runners)), len(runners)):
            run = runners[index]
            start = time.perf_counter()
            run(step)
            if step >= warmup:
                times[index].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


Runner = Callable[[int], object]


def _stock(max_seq: int, folder: Path) -> Runner:
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    module = WindowDecodeStep(max_seq, caller_cache=False)
    dim = module.heads * module.head_dim
    with known_warnings_ignored():
        pte = to_edge(_export(module, _inputs(0, dim, module.window))).to_executorch().buffer
    path = folder / f"stock_{max_seq}.pte"
    path.write_bytes(pte)
    method = Runtime.get().load_program(path).load_method("forward")
    return lambda step: method.execute(list(_inputs(step, dim, module.window)))


@dataclass
class _Direct:
    """A lowered MLX delegate called the way the runtime calls it."""

    delegate: Any
    handle: Any
    arg_names: list[str]
    outputs: list[torch.Tensor]


def _lower_mlx(module: WindowDecodeStep, args: tuple[Any, ...]) -> _Direct:
    from executorch.exir.delegate import executorch_call_delegate
    from writeback.lowering import lower
    from writeback_core import load_registry
    from writeback_mlx_backend.runtime import MLXDelegate

    registry = load_registry()
    # The one lowering path `writeback run --backend mlx` takes: with writeback-passes
    # installed its passes drop the cache write-backs the delegate accepted.
    program = lower(_export(module, args), registry, registry.backends()["mlx"]).program
    gm = program.exported_program().graph_module
    calls = [n for n in gm.graph.nodes if n.target is executorch_call_delegate]
    others = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target not in (executorch_call_delegate, operator.getitem)
    ]
    if len(calls) != 1 or others:
        raise RuntimeError(f"the step did not lower whole to MLX: {[str(n) for n in others]}")
    lowered = getattr(gm, str(calls[0].args[0].target))
    delegate = MLXDelegate()
    specs = {spec.key: spec.value for spec in lowered.compile_specs}
    handle = delegate.init(bytes(lowered.processed_bytes), specs)
    vals = calls[0].meta["val"]
    outputs = [torch.empty(v.shape, dtype=v.dtype) for v in (vals if isinstance(vals, (list, tuple)) else [vals])]
    return _Direct(delegate, handle, [a.name for a in calls[0].args[1:]], outputs)


def _mlx(max_seq: int, caller: str | None) -> Runner:
    from writeback_mlx_backend.memory import empty

    module = WindowDecodeStep(max_seq, caller_cache=caller is not None)
    dim = module.heads * module.head_dim
    caches: tuple[torch.Tensor, ...] = ()
    if caller == "empty":
        caches = (empty(module.cache_shape), empty(module.cache_shape))
    elif caller == "torch":
        caches = (torch.zeros(module.cache_shape), torch.zeros(module.cache_shape))
    direct = _lower_mlx(module, (*_inputs(0, dim, module.window), *caches))
    in_place = {c.output: c.input for c in direct.handle.program.in_place}

    def run(step: int) -> None:
        x, pos = _inputs(step, dim, module.window)
        by_name = {"x": x, "pos": pos, **{f"caches_{i}": c for i, c in enumerate(caches)}}
        args = [by_name[name] for name in direct.arg_names]
        outputs = [args[in_place[j]] if j in in_place else t for j, t in enumerate(direct.outputs)]
        direct.delegate.execute(direct.handle, [*args, *outputs])

    return run


def _table(rows: Sequence[tuple[str, list[float]]], columns: Sequence[str]) -> str:
    widths = [max(len(c), 9) for c in columns]
    lines = ["cache     " + "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    for label, values in rows:
        cells = "  ".join(f"{v:{w}.2f}" for v, w in zip(values, widths, strict=True))
        lines.append(f"{label:<10}{cells}")
    return "\n".join(lines)


# ``--vs-mlx``: the delegate against the same models written by hand in MLX.

_VS_WARMUP = 2
_IDLE_CALLS_PER_ROUND = 20
_STEP_GOAL = 1.2  # the delegate's step, as a multiple of hand-written MLX's
_IDLE_GOAL = 50e-6  # seconds per idle call through the delegate
# fp32 on both sides; MLX's fused kernels sum in another order than torch's.
_ATOL = _RTOL = 1e-4
_MIB = 1 << 20
_EAGER = "eager PyTorch"
_HANDWRITTEN = "hand-written MLX"
_MASKED = "hand-written MLX, masked whole cache"
_DELEGATE = "writeback+mlx delegate"

# One call at a step: ``(seconds, outputs)``; the clock covers the work alone, the
# step's inputs are made before it starts.
Timed = Callable[[int], tuple[float, list[Any]]]


@dataclass
class _Contender:
    """One row of the ``--vs-mlx`` table: its calls, their times, and what went wrong."""

    model: str
    name: str
    call: Timed | None = None
    calls_per_round: int = 1
    # Entered around each round's calls of this row (the one-core rows pin the threads).
    around: Callable[[], AbstractContextManager[None]] = nullcontext
    note: str = ""
    error: str | None = None
    max_error: float = 0.0
    times: list[float] = field(default_factory=list)

    def median(self) -> float | None:
        return statistics.median(self.times) if self.times and self.error is None else None


class _AddOne(nn.Module):
    """The idle program: one op on a small tensor, so a call costs what calling costs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def _decoder_case(cache_mib: float) -> ModelCase:
    from writeback.zoo import DecoderConfig, decoder_case

    return decoder_case(DecoderConfig.for_cache_bytes(int(cache_mib * _MIB)))


def _et_llama_case(cache_mib: float, seed: int = 0) -> ModelCase:
    """ExecuTorch's Llama example (``construct_transformer``, KV cache in buffers), sized as
    writeback-decoders sizes it for ``--cache-mib`` (4 layers, 16 heads of 128, dim 128),
    weights drawn from ``seed``, called as ``export_llama`` calls it:
    ``model(tokens, attn_options={"input_pos": pos})``, exported non-strict.

    Step ``s`` feeds token ``(7 s + 3) % vocab`` at position ``s % max_seq`` (a fixed
    sequence rather than greedy decoding: every contender is fed the same tokens).
    """
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs
    from writeback_core.types import ModelCase

    layers, heads, head_dim, vocab = 4, 16, 128, 256
    max_seq = max(8, int(cache_mib * _MIB) // (layers * 2 * heads * head_dim * 4))
    args = ModelArgs(
        dim=128,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=head_dim,
        hidden_dim=256,
        vocab_size=vocab,
        max_batch_size=1,
        max_seq_len=max_seq,
        max_context_len=max_seq,
        use_kv_cache=True,
    )

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module: nn.Module = construct_transformer(args)
        return module.eval().requires_grad_(False)

    return ModelCase(
        name="et-llama",
        description=f"ExecuTorch's Llama example, {layers} layers, dim 128, {max_seq} positions",
        build=build,
        step_inputs=lambda step: (torch.tensor([[(7 * step + 3) % vocab]]),),
        step_kwargs=lambda step: {"attn_options": {"input_pos": torch.tensor([step % max_seq])}},
        strict=False,
    )


def _token_position(case: ModelCase, step: int) -> tuple[int, int]:
    """The step's token and cache position: the first and the last input of both models."""
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves((case.step_inputs(step), case.example_kwargs(step)))
    return int(leaves[0]), int(leaves[-1])


def _eager_timed(case: ModelCase) -> Timed:
    module = case.build().eval().requires_grad_(False)
    state = case.make_state()

    def call(step: int) -> tuple[float, list[Any]]:
        args, kwargs = case.step_inputs(step), case.example_kwargs(step)
        with torch.no_grad():
            start = time.perf_counter()
            out = module(*args, *state, **kwargs)
            seconds = time.perf_counter() - start
        return seconds, [out]

    return call


def _handwritten_timed(case: ModelCase, attend: Attend) -> Timed:
    from writeback_bench.mlx_handwritten import HandwrittenDecoder, HandwrittenETLlama

    module = case.build()
    model = HandwrittenETLlama(module, attend) if case.name == "et-llama" else HandwrittenDecoder(module, attend)

    def call(step: int) -> tuple[float, list[Any]]:
        token, position = _token_position(case, step)
        start = time.perf_counter()
        logits = model.step(token, position)
        return time.perf_counter() - start, [logits]

    return call


def _delegate_timed(case: ModelCase, registry: Any) -> tuple[Timed, str]:
    """The case lowered as ``writeback run --backend mlx`` lowers it and run by writeback's
    runtime; the time is the runtime's execute alone. Also returns a note on what stayed
    outside the delegate."""
    from executorch.exir import memory
    from executorch.exir.delegate import executorch_call_delegate
    from writeback.pipeline import Session, assemble, lower

    pipeline = assemble(registry, "mlx")
    with known_warnings_ignored():
        lowered = lower(case, pipeline)
    session = Session.open(pipeline, lowered)
    graph = lowered.program.exported_program().graph_module.graph
    delegated = sum(1 for n in graph.nodes if n.target is executorch_call_delegate)
    # Ops the runtime runs on its own kernels (the memory planner's allocations are not ops).
    outside = Counter(
        str(getattr(n.target, "__name__", n.target))
        for n in graph.nodes
        if n.op == "call_function" and n.target not in (executorch_call_delegate, operator.getitem, memory.alloc)
    )
    ops = ", ".join(f"{name} x{count}" for name, count in sorted(outside.items())) or "none"
    note = f"{delegated} delegate call(s); ops outside: {ops}; {lowered.copied_per_call} B copied per call"

    def call(step: int) -> tuple[float, list[Any]]:
        result = session.step(step)  # times the runtime's execute alone
        return result.seconds, result.outputs

    return call, note


def _idle_case() -> ModelCase:
    from writeback_core.types import ModelCase

    return ModelCase(
        name="idle",
        description="x + 1 on 4 floats",
        build=_AddOne,
        step_inputs=lambda step: (torch.full((4,), float(step)),),
    )


@contextmanager
def one_core() -> Iterator[None]:
    """Every thread of this process (the caller, MLX's stream thread, torch's) on one CPU,
    the lowest this process may use, for the block; each thread's CPUs are restored after.

    MLX on the CPU computes on its stream thread while the caller waits in ``mx.eval``:
    on one core nothing runs less in parallel, and no evaluation waits for a thread to
    wake on another core. Linux only (``/proc/self/task``).
    """
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    cpu = min(os.sched_getaffinity(0))
    before: dict[int, set[int]] = {}
    for thread in threads:
        try:
            before[thread] = os.sched_getaffinity(thread)
            os.sched_setaffinity(thread, {cpu})
        except OSError:  # the thread ended meanwhile
            continue
    try:
        yield
    finally:
        for thread, cpus in before.items():
            try:
                os.sched_setaffinity(thread, cpus)
            except OSError:
                continue


def _can_pin() -> bool:
    return hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


_ONE_CORE = ", one core"
_MLX_IDLE = "hand-written MLX: mx.eval(x + 1)"


def _idle_contenders(registry: Any) -> list[_Contender]:
    import mlx.core as mx

    case = _idle_case()
    rows = [
        _Contender("idle", _DELEGATE, calls_per_round=_IDLE_CALLS_PER_ROUND),
        _Contender("idle", _MLX_IDLE, calls_per_round=_IDLE_CALLS_PER_ROUND),
        _Contender("idle", _EAGER, calls_per_round=_IDLE_CALLS_PER_ROUND),
    ]
    try:
        rows[0].call, rows[0].note = _delegate_timed(case, registry)
    except Exception as error:  # reported in its cell; the other rows go on
        rows[0].error = f"failed to lower or load: {_short(error)}"
    pinned = [
        _Contender("idle", _DELEGATE + _ONE_CORE, calls_per_round=_IDLE_CALLS_PER_ROUND, around=one_core),
        _Contender("idle", _MLX_IDLE + _ONE_CORE, calls_per_round=_IDLE_CALLS_PER_ROUND, around=one_core),
    ]
    if not _can_pin():
        for row in pinned:
            row.error = "not measured: this OS cannot pin threads to a CPU from Python"
    elif rows[0].error is not None:
        pinned[0].error = rows[0].error
    else:
        try:
            pinned[0].call, pinned[0].note = _delegate_timed(case, registry)
        except Exception as error:
            pinned[0].error = f"failed to lower or load: {_short(error)}"

    def mlx_call(step: int) -> tuple[float, list[Any]]:
        x = mx.full((4,), float(step))
        mx.eval(x)
        start = time.perf_counter()
        y = x + 1
        mx.eval(y)
        return time.perf_counter() - start, [y]

    def eager_call(step: int) -> tuple[float, list[Any]]:
        x = torch.full((4,), float(step))
        start = time.perf_counter()
        y = x + 1
        return time.perf_counter() - start, [y]

    rows[1].call, rows[2].call = mlx_call, eager_call
    if pinned[1].error is None:
        pinned[1].call = mlx_call
    return [*rows, *pinned]


def _model_contenders(case: ModelCase, registry: Any) -> list[_Contender]:
    makers: list[tuple[str, Callable[[], Timed]]] = [
        (_EAGER, lambda: _eager_timed(case)),
        (_HANDWRITTEN, lambda: _handwritten_timed(case, "filled")),
        (_MASKED, lambda: _handwritten_timed(case, "masked")),
    ]
    rows = []
    for name, make in makers:
        row = _Contender(case.name, name)
        try:
            row.call = make()
        except Exception as error:  # reported in its cell; the other rows go on
            row.error = f"failed to build: {_short(error)}"
        rows.append(row)
    row = _Contender(case.name, _DELEGATE)
    try:
        row.call, row.note = _delegate_timed(case, registry)
    except Exception as error:
        row.error = f"failed to lower or load: {_short(error)}"
    rows.append(row)
    return rows


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) < 160 else text[:157] + "..."


def _numpy(value: Any) -> Any:
    import numpy as np

    if isinstance(value, torch.Tensor):
        return value.detach().numpy()
    return np.array(value)


def _check(row: _Contender, outputs: list[Any], expected: list[Any]) -> str | None:
    """Why ``outputs`` differ from eager's (``None``: they match); tracks the largest error."""
    import numpy as np

    if len(outputs) != len(expected):
        return f"{len(outputs)} outputs, eager {len(expected)}"
    for index, (mine, theirs) in enumerate(zip(outputs, expected, strict=True)):
        found, wanted = _numpy(mine), _numpy(theirs)
        if found.shape != wanted.shape:
            return f"output {index} has shape {found.shape}, eager {wanted.shape}"
        error = float(np.abs(found.astype(np.float64) - wanted.astype(np.float64)).max(initial=0.0))
        row.max_error = max(row.max_error, error)
        if not np.allclose(found, wanted, rtol=_RTOL, atol=_ATOL):
            return f"output {index} differs from eager by {error:.3g}"
    return None


def _warm_up(rows: Sequence[_Contender], case: ModelCase, start: int) -> None:
    """Run each row's warm-up steps, each checked against a separate eager copy; a row that
    fails or differs keeps the reason in its cell and is not timed."""
    from writeback.pipeline import Eager

    eager = Eager(case)
    reference = [[o.clone() for o in eager.step(step)] for step in range(start, start + _VS_WARMUP)]
    for row in rows:
        for offset, expected in enumerate(reference):
            if row.call is None or row.error is not None:
                break
            step = start + offset
            try:
                _, outputs = row.call(step)
            except Exception as error:
                row.error = f"failed at run time: {_short(error)}"
                break
            problem = _check(row, outputs, expected)
            if problem is not None:
                row.error = f"wrong at warm-up step {step}: {problem}"


def _rounds(rows: Sequence[_Contender], first: int, steps: int) -> None:
    """Steps ``first`` .. ``first + steps - 1``, every row in each, in a fresh shuffled order per step."""
    live = [row for row in rows if row.call is not None and row.error is None]
    for step in range(first, first + steps):
        for row in random.Random(step).sample(live, len(live)):
            assert row.call is not None
            with row.around():
                for _ in range(row.calls_per_round):
                    if row.error is not None:
                        break
                    try:
                        seconds, _ = row.call(step)
                    except Exception as error:
                        row.error = f"failed at run time, step {step}: {_short(error)}"
                        break
                    row.times.append(seconds)


def _time_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.3f} ms"


def _goal_text(value: float | None, limit: float, text: str) -> str:
    if value is None:
        return "not measured"
    return f"{text} ({'met' if value <= limit else 'MISSED'})"


def _model_table(case: ModelCase, rows: Sequence[_Contender], start: int, steps: int) -> list[str]:
    by_name = {row.name: row for row in rows}
    anchor = by_name[_HANDWRITTEN].median()
    lines = [
        f"{case.name}: {case.description}; steps {start + _VS_WARMUP}..{start + _VS_WARMUP + steps - 1}",
        f"  {'contender':<46}{'step (median)':>14}{'/ hand-written':>16}  check against eager",
    ]
    for row in rows:
        median = row.median()
        times = "-" if median is None or anchor is None else f"{median / anchor:.2f}x"
        check = row.error or f"ok, max |err| {row.max_error:.2g}"
        note = f"; {row.note}" if row.note else ""
        lines.append(f"  {row.name:<46}{_time_text(median):>14}{times:>16}  {check}{note}")
    delegate = by_name[_DELEGATE].median()
    ratio = None if delegate is None or anchor is None else delegate / anchor
    text = "" if ratio is None else f"{ratio:.2f}x"
    lines.append(f"  goal: {_DELEGATE} step <= {_STEP_GOAL}x {_HANDWRITTEN}: {_goal_text(ratio, _STEP_GOAL, text)}")
    return lines


def _idle_table(rows: Sequence[_Contender]) -> list[str]:
    lines = [
        f"idle call: x + 1 on a [4] fp32 tensor, median of {_IDLE_CALLS_PER_ROUND} calls per round",
        f"  {'contender':<46}{'call (median)':>14}  check against eager",
    ]
    for row in rows:
        check = row.error or f"ok, max |err| {row.max_error:.2g}"
        note = f"; {row.note}" if row.note else ""
        lines.append(f"  {row.name:<46}{_time_text(row.median()):>14}  {check}{note}")
    by_name = {row.name: row for row in rows}
    delegate, pinned = by_name[_DELEGATE].median(), by_name[_DELEGATE + _ONE_CORE].median()
    lines.append(
        f"  goal: {_DELEGATE} idle call <= 50 µs: {_goal_text(delegate, _IDLE_GOAL, _time_text(delegate))}; "
        f"on one core: {_goal_text(pinned, _IDLE_GOAL, _time_text(pinned))}"
    )
    own = [
        f"{where}: {_time_text(call - floor)}"
        for where, call, floor in (
            ("threads free", delegate, by_name[_MLX_IDLE].median()),
            ("one core", pinned, by_name[_MLX_IDLE + _ONE_CORE].median()),
        )
        if call is not None and floor is not None
    ]
    if own:
        lines.append(f"  the delegate's own cost (its call minus mx.eval's): {', '.join(own)}")
    floor = by_name[_MLX_IDLE].median()
    if floor is not None and floor > _IDLE_GOAL:
        lines.append(
            f"  MLX's own mx.eval takes {_time_text(floor)} here with its threads free: no delegate that "
            "evaluates on MLX's stream can meet the goal so"
        )
    lines.append(
        "  (MLX computes on its stream thread while the caller waits: with the two on different cores each "
        "evaluation also waits for that thread to wake there; compare the mx.eval rows)"
    )
    return lines


def run_vs_mlx(cache_mib: float, steps: int, start: int) -> int:
    """Time the delegate against the same models written by hand in MLX; print the tables.

    For the built-in decoder and ExecuTorch's Llama example, each with a K+V cache of
    ``cache_mib`` MiB, the rows are: eager PyTorch; the model written by hand in MLX
    (:mod:`writeback_bench.mlx_handwritten`: attention over the filled cache slots,
    as mlx-lm does, and over the whole cache with a mask, which is the work a graph
    of static shapes does); and the model lowered by writeback's one lowering path
    with ``--backend mlx`` and run by writeback's runtime (the time of its execute).
    Then the idle call: ``x + 1`` through the delegate, in MLX, in eager PyTorch, and the
    first two again with every thread of the process on one core (:func:`one_core`).

    Every row runs ``2`` warm-up steps from ``start``, checked against eager
    PyTorch (``allclose``, ``rtol = atol = 1e-4``); a row that fails or differs
    shows why in its cell and is not timed. Then ``steps`` timed steps, every row
    once per step (the idle rows 20 times) in a fresh shuffled order, all in one
    process with one torch thread (the caller's thread count is restored after);
    the table gives medians.

    :returns: 0 (the goals are reported, not enforced).
    """
    from writeback_core import load_registry

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _vs_mlx(load_registry(), cache_mib, steps, start)
    finally:
        torch.set_num_threads(threads)
    return 0


def _vs_mlx(registry: Any, cache_mib: float, steps: int, start: int) -> None:
    cases = [_decoder_case(cache_mib), _et_llama_case(cache_mib)]
    model_rows = []
    for case in cases:
        rows = _model_contenders(case, registry)
        _warm_up(rows, case, start)
        model_rows.append(rows)
        print(f"{case.name} lowered and checked", flush=True)
    idle = _idle_contenders(registry)
    _warm_up(idle, _idle_case(), start)
    every = [row for rows in model_rows for row in rows] + idle
    _rounds(every, start + _VS_WARMUP, steps)
    print(f"MLX delegate against hand-written MLX, K+V cache {cache_mib:g} MiB per model, 1 torch thread")
    for case, rows in zip(cases, model_rows, strict=True):
        print("\n".join(_model_table(case, rows, start, steps)))
    print("\n".join(_idle_table(idle)))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table and the ``time(largest)/time(smallest)`` ratio of each column; with
    ``--vs-mlx``, the delegate against the same models hand-written in MLX instead
    (:func:`run_vs_mlx`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,32,128", help="K+V cache sizes in MiB")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per cell")
    parser.add_argument("--no-stock", action="store_true", help="skip the stock column")
    parser.add_argument(
        "--vs-mlx",
        action="store_true",
        help="the delegate's decode step and idle call against the same models hand-written in MLX",
    )
    parser.add_argument("--cache-mib", type=float, default=8.0, help="--vs-mlx: each model's K+V cache in MiB")
    parser.add_argument("--start", type=int, default=0, help="--vs-mlx: the first decode step (cache position)")
    options = parser.parse_args(argv)
    if options.vs_mlx:
        return run_vs_mlx(options.cache_mib, options.steps, options.start)
    sizes = [int(s) for s in options.sizes.split(",")]
    columns = ["mlx owned", "mlx caller (empty)", "mlx caller (torch)"]
    if not options.no_stock:
        columns.insert(0, "stock")
    runners: list[Runner] = []
    with tempfile.TemporaryDirectory() as folder:
        for mib in sizes:
            max_seq = _max_seq(mib << 20)
            if not options.no_stock:
                runners.append(_stock(max_seq, Path(folder)))
            runners += [_mlx(max_seq, caller) for caller in (None, "empty", "torch")]
            print(f"{mib} MiB lowered", flush=True)
        medians = _medians_ms(runners, options.steps)
    width = len(columns)
    rows = [(f"{mib} MiB", medians[i * width : (i + 1) * width]) for i, mib in enumerate(sizes)]
    print(_table(rows, columns))
    first, last = rows[0][1], rows[-1][1]
    ratios = [b / a for a, b in zip(first, last, strict=True)]
    print(
        f"ratio {rows[-1][0]}/{rows[0][0]}: " + "  ".join(f"{c}={r:.2f}" for c, r in zip(columns, ratios, strict=True))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

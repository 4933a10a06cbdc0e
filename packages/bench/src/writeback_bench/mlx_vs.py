"""``python -m writeback_bench.mlx --vs-mlx``: the MLX delegate against the same models written by hand in MLX.

It holds the rows of the comparison (each contender of a model and of the idle call, with
its times and what went wrong), their warm-up steps checked against eager PyTorch, the
timed rounds that run every row once per step in a shuffled order, the tables of medians
and goals that are printed, and :func:`run_vs_mlx`, which runs it all; the models and the
timed call of each contender come from :mod:`writeback_bench.mlx_vs_calls`.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from writeback_bench.mlx_vs_calls import (
    Timed,
    can_pin,
    decoder_case_for,
    delegate_timed,
    eager_timed,
    et_llama_case_for,
    handwritten_timed,
    idle_case,
    one_core,
)

if TYPE_CHECKING:
    from writeback_core.types import ModelCase

__all__ = ["run_vs_mlx"]


_VS_WARMUP = 2
_IDLE_CALLS_PER_ROUND = 20
_STEP_GOAL = 1.2  # the delegate's step, as a multiple of hand-written MLX's
_IDLE_GOAL = 50e-6  # seconds per idle call through the delegate
# fp32 on both sides; MLX's fused kernels sum in another order than torch's.
_ATOL = _RTOL = 1e-4
_EAGER = "eager PyTorch"
_HANDWRITTEN = "hand-written MLX"
_MASKED = "hand-written MLX, masked whole cache"
_DELEGATE = "writeback+mlx delegate"


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


_ONE_CORE = ", one core"
_MLX_IDLE = "hand-written MLX: mx.eval(x + 1)"


def _idle_contenders(registry: Any) -> list[_Contender]:
    import mlx.core as mx

    case = idle_case()
    rows = [
        _Contender("idle", _DELEGATE, calls_per_round=_IDLE_CALLS_PER_ROUND),
        _Contender("idle", _MLX_IDLE, calls_per_round=_IDLE_CALLS_PER_ROUND),
        _Contender("idle", _EAGER, calls_per_round=_IDLE_CALLS_PER_ROUND),
    ]
    try:
        rows[0].call, rows[0].note = delegate_timed(case, registry)
    except Exception as error:  # reported in its cell; the other rows go on
        rows[0].error = f"failed to lower or load: {_short(error)}"
    pinned = [
        _Contender("idle", _DELEGATE + _ONE_CORE, calls_per_round=_IDLE_CALLS_PER_ROUND, around=one_core),
        _Contender("idle", _MLX_IDLE + _ONE_CORE, calls_per_round=_IDLE_CALLS_PER_ROUND, around=one_core),
    ]
    if not can_pin():
        for row in pinned:
            row.error = "not measured: this OS cannot pin threads to a CPU from Python"
    elif rows[0].error is not None:
        pinned[0].error = rows[0].error
    else:
        try:
            pinned[0].call, pinned[0].note = delegate_timed(case, registry)
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
        (_EAGER, lambda: eager_timed(case)),
        (_HANDWRITTEN, lambda: handwritten_timed(case, "filled")),
        (_MASKED, lambda: handwritten_timed(case, "masked")),
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
        row.call, row.note = delegate_timed(case, registry)
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
    from writeback.session import Eager

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
    first two again with every thread of the process on one core
    (:func:`writeback_bench.mlx_vs_calls.one_core`).

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
    cases = [decoder_case_for(cache_mib), et_llama_case_for(cache_mib)]
    model_rows = []
    for case in cases:
        rows = _model_contenders(case, registry)
        _warm_up(rows, case, start)
        model_rows.append(rows)
        print(f"{case.name} lowered and checked", flush=True)
    idle = _idle_contenders(registry)
    _warm_up(idle, idle_case(), start)
    every = [row for rows in model_rows for row in rows] + idle
    _rounds(every, start + _VS_WARMUP, steps)
    print(f"MLX delegate against hand-written MLX, K+V cache {cache_mib:g} MiB per model, 1 torch thread")
    for case, rows in zip(cases, model_rows, strict=True):
        print("\n".join(_model_table(case, rows, start, steps)))
    print("\n".join(_idle_table(idle)))

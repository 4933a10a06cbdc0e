"""The program as the functions ``mx.compile`` traces: the step, ``(inputs, state) ->
[*outputs, *new state]``, with its attention bounded to a window's first ``L`` columns or
not, and the indices the program computes, traced apart (``writeback_mlx_backend.compile_at_init``
decides whether a program runs them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from writeback_core.blob import resolve

from writeback_mlx_backend._steps import Step, call, call_resolved, refs, resolve_kwargs
from writeback_mlx_backend.delegate_program import DelegateProgram
from writeback_mlx_backend.handle import Handle, ShapeOnly
from writeback_mlx_backend.op_handler import OpHandler, mlx_dtype
from writeback_mlx_backend.window import Window
from writeback_mlx_backend.window_trace import Unread


def written_values(step: Step) -> list[str]:
    """What a write step writes: its arguments other than the destination and the indices."""
    skip = {0, *step.handler.index_args}
    return refs([a for position, a in enumerate(step.args) if position not in skip])


def step_body(
    handle: Handle,
    state_keys: Sequence[str],
    update_keys: Sequence[str],
    window: Window | None,
    length: int,
    checks: list[tuple[OpHandler, list[Any], dict[str, Any]]] | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    pinned: Sequence[str] = (),
    cut: set[tuple[str, int]] | None = None,
) -> Callable[[list[Any], list[Any]], list[Any]]:
    """The step as a function to trace: ``(inputs, state) -> [*outputs, *new state]``; with
    ``window``, its attention bounded to ``length`` columns (see ``writeback_mlx_backend.window``).
    While tracing, records each index check into ``checks``, each value's shape into ``shapes``
    and the values the bounded trace cuts whole into ``cut``.
    The ``pinned`` values are read from the inputs past the program's own, not computed."""
    program = handle.program
    names = [*program.inputs, *pinned]
    skip = set(pinned)
    # Bounded, a write into a caller's tensor is not computed (see ``CallerWrite``): its
    # output is stored by the call, and the step returns the written values instead.
    writes = {c.node: c.output for c in handle.forced} if window is not None else {}
    sources = [n for s in handle.steps if s.name in writes for n in written_values(s)]

    def body(arrays: list[Any], state: list[Any]) -> list[Any]:
        env: dict[str, Any] = dict(handle.constants)
        env.update(zip(names, arrays, strict=True))
        env.update(zip(state_keys, state, strict=True))
        bounded = window.trace(env, length) if window is not None else None
        for step in handle.steps:
            if step.name in skip:
                continue
            if step.name in writes:
                env[step.name] = Unread(step.name)
                continue
            if bounded is not None and window is not None and window.bounds(step):
                bounded.run(step)
                continue
            args = resolve(step.args, env)
            unread = _unread(args) if writes else None
            if unread is not None:
                # Computed from a caller write: only a bounded step may read it, over
                # its first ``L`` columns (through ``window_trace.Bounded.pull``).
                env[step.name] = Unread(unread.name)
                continue
            if checks is not None and step.handler.validate is not None:
                checks.append((step.handler, _check_args(step, args), dict(step.kwargs)))
            env[step.name] = call(step, args, resolve_kwargs(step.kwargs, env), True)
        if cut is not None and bounded is not None:
            cut.update(bounded.sources)
        if shapes is not None:
            shapes.update({k: tuple(v.shape) for k, v in env.items() if isinstance(v, mx.array)})
        # An output the call stores itself (a caller write's) is returned empty, made in the
        # trace: a captured array returned by two traced functions breaks MLX's replay.
        results = [mx.zeros((0,)) if i in writes.values() else resolve(o, env) for i, o in enumerate(handle.outputs)]
        updates = [env[handle.state_updates[k]] for k in update_keys]
        for value in [*results, *updates]:
            if isinstance(value, Unread):
                raise value.whole("the step's outputs")
        return [*results, *updates, *(env[n] for n in sources)]

    return body


def _unread(args: Any) -> Unread | None:
    """The first :class:`Unread` among resolved arguments, if any."""
    for value in args if isinstance(args, list) else [args]:
        found = value if isinstance(value, Unread) else _unread(value) if isinstance(value, list) else None
        if found is not None:
            return found
    return None


def _check_args(step: Step, traced: Sequence[Any]) -> list[Any]:
    """A traced indexing step's arguments as its check reads them on each call: the indices
    as references (resolved from the call's inputs), arrays as their shapes, literals kept."""
    found = []
    for position, (raw, value) in enumerate(zip(step.args, traced, strict=True)):
        if position in step.handler.index_args:
            found.append(raw)
        elif isinstance(value, mx.array):
            found.append(ShapeOnly(tuple(value.shape)))
        else:
            found.append(raw)
    return found


def pinned_body(
    handle: Handle, steps: Sequence[Step], pinned: Sequence[str], state_keys: Sequence[str]
) -> Callable[[list[Any], list[Any]], list[Any]]:
    """The pinned indices as a function to trace: ``(inputs, state) -> [*pinned]``."""

    def body(arrays: list[Any], state: list[Any]) -> list[Any]:
        env: dict[str, Any] = dict(handle.constants)
        env.update(zip(handle.program.inputs, arrays, strict=True))
        env.update(zip(state_keys, state, strict=True))
        for step in steps:
            env[step.name] = call_resolved(step, env, True)
        return [env[name] for name in pinned]

    return body


def placeholder_inputs(program: DelegateProgram) -> list[Any]:
    """Zeros of each input's shape and dtype, to trace the program on."""
    return [mx.zeros(meta["shape"], dtype=mlx_dtype(meta["dtype"])) for meta in program.input_meta]

"""Tracing at ``init``: whether a program runs compiled, and its traced step (:class:`Compiled`).

The step is traced once with ``mx.compile`` when the program allows it: static shapes, no
scalar inputs, every index read from the delegate's inputs or constants (so it is checked
on them, before the graph is built) or computed in a few steps from inputs, constants and
state (those steps are traced apart and evaluated first, alone, so the index is checked on
the host too). A softmax whose mask rules out later positions is computed over the
positions it lets through (``writeback_mlx_backend.window``).

A write the program requires in a caller's tensor (guarantee 3 of
``writeback_mlx_backend.mlx_delegate``) runs compiled too when an attention window bounds every
read of it: the traced step reads the write over the window's first ``L`` columns only (the
same write into the first ``L`` columns of the destination, so no whole copy is made), and
returns the written values, which the call stores (``writeback_mlx_backend.compiled_call``). A
call whose written index or mask reaches past the longest traced length runs the
interpreted path, as does a program that reads the write whole, or one with no window.
:func:`compile_step` says which path a handle got and why (:meth:`MLXDelegate.path`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from writeback_core.blob import Ref, resolve

from writeback_mlx_backend._steps import Step, index_write_axes, refs, resolve_kwargs
from writeback_mlx_backend.handle import CallerWrite, Compiled, Handle, Written
from writeback_mlx_backend.op_handler import OpHandler
from writeback_mlx_backend.op_indexing import INDEX_COPY, INDEX_PUT, INDEX_WRITES
from writeback_mlx_backend.traced import pinned_body, placeholder_inputs, step_body, written_values
from writeback_mlx_backend.window import Window, lengths, plan
from writeback_mlx_backend.window_trace import WholeRead

# At load the traced step is evaluated once on placeholder inputs, so MLX builds its
# kernels then rather than in the first call, unless it updates more state than this:
# that trial copies each updated buffer (nothing is donated), briefly doubling it.
TRIAL_STATE_BYTES = 32 << 20


def compile_step(handle: Handle) -> tuple[Compiled | None, str]:
    """Trace ``handle``'s step with ``mx.compile`` if the program allows it (see the module
    docstring); else ``None`` and why, for :meth:`MLXDelegate.path`."""
    program = handle.program
    if any("scalar" in meta for meta in program.input_meta):
        return None, "interpreted: it has scalar inputs"
    if not all(isinstance(o, Ref) for o in handle.outputs):
        return None, "interpreted: an output is a literal"
    known = set(program.inputs) | set(handle.constants)
    pinned: list[str] = []
    for step in handle.steps:
        if step.handler.validate is None:
            continue
        if step.handler.trace is None or step.handler.bounds is None:
            return None, f"interpreted: {step.name} has no traced form"
        for position in step.handler.index_args:
            for name in refs(step.args[position : position + 1]):
                if name in known or name in pinned:
                    continue
                refusal = _index_cone(handle, name)
                if isinstance(refusal, str):
                    return None, f"interpreted: the indices of {step.name} are computed inside the program ({refusal})"
                pinned.append(name)
    writes = _caller_writes(handle)
    if isinstance(writes, str):
        return None, f"interpreted: it writes a caller's tensor in place ({writes})"
    pinned_steps = [s for s in handle.steps if s.name in _cone_names(handle, pinned)]
    state_keys = sorted(handle.state)
    update_keys = sorted(handle.state_updates)
    checks: list[tuple[OpHandler, list[Any], dict[str, Any]]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    # With caller writes this whole-axis trace gives shapes and index checks only: it
    # computes each written tensor whole, and is never called.
    fn = mx.compile(step_body(handle, state_keys, update_keys, None, 0, checks, shapes, pinned))
    placeholders = placeholder_inputs(program)
    pinned_fn = mx.compile(pinned_body(handle, pinned_steps, pinned, state_keys)) if pinned else None
    try:
        if pinned_fn is not None:
            placeholders += pinned_fn(placeholders, [handle.state[k] for k in state_keys])
        # Trace now; below, evaluate once (small state only) so MLX builds its fused
        # kernels here rather than in the first call. The handle keeps its state
        # referenced: nothing is donated.
        traced = fn(placeholders, [handle.state[k] for k in state_keys])
    except Exception as error:
        return None, f"interpreted: tracing failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    compiled = Compiled(fn, state_keys, update_keys, checks, pinned=pinned, pinned_fn=pinned_fn)
    by_node = {c.node: c for c in handle.forced}
    for step in writes:  # in program order, as the traced step returns their values
        candidate, destination = by_node[step.name], step.args[0]
        assert isinstance(destination, Ref)
        compiled.caller_writes.append(
            CallerWrite(step, candidate.input, candidate.output, shapes[destination.name], written_values(step))
        )
    names = [*program.inputs, *pinned]
    ranges: dict[int, tuple[int, int]] = {}
    for which, (handler, args, kwargs) in enumerate(checks):
        assert handler.bounds is not None and handler.validate is not None
        for ref, lo, hi in handler.bounds(*args, **kwargs):
            if not isinstance(ref, Ref):
                continue
            if ref.name in names:
                index = names.index(ref.name)
                compiled.bounds.append((index, lo, hi, which))
                old = ranges.get(index, (lo, hi))
                ranges[index] = (max(lo, old[0]), min(hi, old[1]))
            else:  # a constant: checked once, here
                handler.validate(*resolve(args, handle.constants), **resolve_kwargs(kwargs, handle.constants))
    # Evaluated only when every index of the placeholders is in range (MLX writes out of
    # bounds silently), and only when the state it updates is small: the handle keeps its
    # state, so the trial copies every updated buffer whole. Past the limit the first
    # call builds the kernels instead, and updates the state in place by donation.
    updated = sum(handle.state[k].nbytes for k in update_keys)
    if (
        not writes
        and updated <= TRIAL_STATE_BYTES
        and all(inside(np.asarray(placeholders[i]), lo, hi) for i, lo, hi, _ in compiled.bounds)
    ):
        try:
            mx.eval(*traced)
        except Exception as error:
            return None, f"interpreted: tracing failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    del traced
    kept = [*refs(handle.outputs), *handle.state_updates.values()]
    window = plan(handle.steps, shapes, handle.constants, program.inputs, program.input_meta, ranges, kept)
    if writes and not isinstance(window, Window):
        why = window or f"no masked softmax over more than {lengths(2 << 30)[0]} positions"
        return None, (
            "interpreted: it writes a caller's tensor in place, and no attention window bounds "
            f"what reads the write ({why})"
        )
    if window is None:
        return compiled, "compiled"
    if isinstance(window, str):
        return compiled, f"compiled; attention over the whole axis: {window}"
    compiled.window = window
    # Trace the shortest length now: it finds the values the window cuts whole (whose
    # removed rows must be finite), and a program that reads a write whole is refused here.
    shortest = lengths(window.size)[0]
    bounded: Callable[[list[Any], list[Any]], list[Any]] | None = mx.compile(
        step_body(handle, state_keys, update_keys, window, shortest, pinned=pinned, cut=compiled.sources)
    )
    try:
        assert bounded is not None
        bounded(placeholders, [handle.state[k] for k in state_keys])
    except WholeRead as error:
        if writes:
            return None, f"interpreted: it writes a caller's tensor in place, and {error}"
        return compiled, f"compiled; attention over the whole axis: {error}"
    except Exception as error:
        if writes:
            return None, f"interpreted: tracing failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
        compiled.window = None
        return compiled, f"compiled; attention over the whole axis: its bounded trace failed ({type(error).__name__})"
    compiled.bounded[shortest] = bounded
    compiled.watched = _watched(handle, compiled)
    handle.finite = {k: _all_finite(handle.state[k]) for k in compiled.watched}
    path = f"compiled; {window.describe()}; {_finite_rule(handle, compiled)}"
    if not writes:
        return compiled, path
    return compiled, (
        f"{path}; {len(writes)} write(s) into callers' tensors stored in place "
        "after the one evaluation (a call whose writes or attention reach past the longest bounded "
        "length is interpreted)"
    )


# A computed index is evaluated alone only when it takes at most this many steps.
_MAX_CONE = 16


def _cone_names(handle: Handle, names: Sequence[str]) -> set[str]:
    """The steps ``names`` are computed by (``names`` included)."""
    producers = {s.name: s for s in handle.steps}
    found: set[str] = set()
    pending = [n for n in names if n in producers]
    while pending:
        name = pending.pop()
        if name not in found:
            found.add(name)
            pending += [n for n in refs((producers[name].args, producers[name].kwargs)) if n in producers]
    return found


def _index_cone(handle: Handle, name: str) -> str | None:
    """``None`` when index ``name`` can be evaluated alone before the graph: computed in a few
    steps, none of them a write or an indexing op, from inputs, constants and the state as
    the call finds it; else why not."""
    cone = [s for s in handle.steps if s.name in _cone_names(handle, [name])]
    if len(cone) > _MAX_CONE:
        return f"{name}, from {len(cone)} steps"
    for step in cone:
        if step.handler.region is not None or step.handler.validate is not None:
            return f"{name}, through {step.name}, which writes or indexes"
    return None


def _caller_writes(handle: Handle) -> list[Step] | str:
    """The steps of the program's required writes into callers' tensors, in program order,
    or why the compiled path cannot store them."""
    found = []
    forced = {c.node: c for c in handle.forced}
    for step in [s for s in handle.steps if s.name in forced]:
        if step.op not in INDEX_WRITES:
            return f"{step.name} is {step.op}; only index_copy and index_put are stored after the evaluation"
        destination = handle.program.inputs[forced[step.name].input]
        if step.args[0] != Ref(destination):
            return f"{step.name} does not write input {destination} itself"
        if step.op == INDEX_PUT and len(step.args) > 3 and step.args[3]:
            return f"{step.name} accumulates"
        found.append(step)
    return found


def inside(host: np.ndarray, lo: int, hi: int) -> bool:
    """Whether every value of ``host`` lies in ``[lo, hi)``."""
    if host.size == 1:
        return lo <= int(host.reshape(-1)[0]) < hi
    return host.size == 0 or (lo <= int(host.min()) and int(host.max()) < hi)


def written_rows(step: Step, rank: int) -> Written | None:
    """The rows ``step`` writes along one axis, when it is an index write along one axis whose
    index the call can read on the host (see ``window_trace._pull_write``); else ``None``."""
    axes = index_write_axes(step, rank)
    if len(axes) != 1:
        return None
    index = step.args[2] if step.op == INDEX_COPY else step.args[1][axes[0]]
    return Written(axes[0], index) if isinstance(index, Ref) else None


def _watched(handle: Handle, compiled: Compiled) -> dict[str, Written | None]:
    """The delegate-owned states whose removed rows a bounded call reads (a source, or the
    destination of a write that is one), each with how a call's write into it is checked:
    its written rows (``Written``), or the whole new value (``None``)."""
    producers = {s.name: s for s in handle.steps}
    found: dict[str, Written | None] = {}
    for name, _ in compiled.sources:
        step = producers.get(name)
        dest = step.args[0] if step is not None and step.op in INDEX_WRITES else Ref(name)
        if isinstance(dest, Ref) and dest.name in handle.state and dest.name not in found:
            update = producers.get(handle.state_updates.get(dest.name, ""))
            rank = handle.state[dest.name].ndim
            keep = update is not None and update.op in INDEX_WRITES and update.args[0] == dest
            found[dest.name] = written_rows(update, rank) if keep and update is not None else None
    return found


def _finite_rule(handle: Handle, compiled: Compiled) -> str:
    """How a call knows the rows its window removes are finite, for :meth:`MLXDelegate.path`."""
    inputs = sorted({n for n, _ in compiled.sources if n in handle.program.inputs})
    said = "bounded only where the removed rows are known finite, else over the whole axis"
    if inputs:
        said += f" (callers' tensors {', '.join(inputs)}: scanned past the bounded length on every call)"
    return said


# Elements one step of ``_all_finite`` reads: its temporaries stay small beside the state.
_FINITE_CHUNK = 1 << 22


def _all_finite(value: Any) -> bool:
    """Whether every value of an MLX array is finite (a non-floating dtype always is), read
    a chunk at a time."""
    if not isinstance(value, mx.array) or not mx.issubdtype(value.dtype, mx.floating):
        return True
    flat = mx.reshape(value, (-1,))
    return all(
        bool(mx.all(mx.isfinite(flat[start : start + _FINITE_CHUNK])).item())
        for start in range(0, flat.size, _FINITE_CHUNK)
    )


def trace_bounded(
    handle: Handle, compiled: Compiled, window: Window, length: int
) -> Callable[[list[Any], list[Any]], list[Any]] | None:
    """The step traced with its attention bounded to ``length`` columns, made once per length.

    Traced here on placeholders (nothing is evaluated); a trace that fails leaves that
    length on the whole-axis step (with caller writes: interpreted, ``None``), and
    :meth:`MLXDelegate.path` says so."""
    fn: Callable[[list[Any], list[Any]], list[Any]] | None = mx.compile(
        step_body(
            handle,
            compiled.state_keys,
            compiled.update_keys,
            window,
            length,
            pinned=compiled.pinned,
            cut=compiled.sources,
        )
    )
    try:
        placeholders = placeholder_inputs(handle.program)
        if compiled.pinned_fn is not None:
            placeholders += compiled.pinned_fn(placeholders, [handle.state[k] for k in compiled.state_keys])
        assert fn is not None
        fn(placeholders, [handle.state[k] for k in compiled.state_keys])
    except Exception as error:
        fallback = "is interpreted" if compiled.caller_writes else "runs the whole axis"
        handle.path += f"; length {length} {fallback} (its trace failed: {type(error).__name__})"
        fn = None if compiled.caller_writes else compiled.fn
    compiled.bounded[length] = fn
    for name, written in _watched(handle, compiled).items():
        if name not in compiled.watched:
            # Not checked over the calls before: not known finite from here on.
            compiled.watched[name] = written
            handle.finite[name] = False
    return fn

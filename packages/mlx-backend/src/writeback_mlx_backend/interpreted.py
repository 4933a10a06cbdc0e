"""The interpreted path: the program run a step at a time, evaluating at each in-place write.

A write into a caller's tensor is done in place here when the runtime passed the same
memory as that input and as the write's output (guarantee 3 of
``writeback_mlx_backend.mlx_delegate``): the values still needed after it are evaluated first,
those sharing the destination's memory snapshotted, and only the written region stored.
:func:`memory_plan` decides once, at ``init``, which values each such write must watch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import torch
from writeback_core.blob import Ref, resolve

from writeback_mlx_backend._steps import Step, call_resolved, refs, resolve_kwargs
from writeback_mlx_backend.calls import Calls, apply, check_whole, overlaps, same_memory, snapshot, span, tensor_span
from writeback_mlx_backend.delegate_program import DelegateProgram, InPlaceCandidate
from writeback_mlx_backend.handle import Handle
from writeback_mlx_backend.op_handler import UNKNOWN, Region


def _resolve_known(value: Any, env: Mapping[str, Any]) -> Any:
    if isinstance(value, Ref):
        return env.get(value.name, UNKNOWN)
    if isinstance(value, list):
        return [_resolve_known(v, env) for v in value]
    return value


def _validate_first(handle: Handle, active: Mapping[str, InPlaceCandidate], env: Mapping[str, Any]) -> None:
    """Check, before the first in-place write, every index read after it whose value is known.

    So a bad index in a later write, an embedding or an ``index_select`` cannot leave
    an earlier write done in the caller's memory. Steps before the first write check
    their own indices when they run (nothing is written yet); indices computed inside
    the program are checked when their step is reached.
    """
    if not active:
        return
    after_write = False
    for step in handle.steps:
        if after_write and step.handler.validate is not None:
            step.handler.validate(*_resolve_known(step.args, env))
        after_write = after_write or step.name in active


def memory_plan(program: DelegateProgram, steps: Sequence[Step], last_use: Mapping[str, int]) -> dict[str, list[str]]:
    """For each in-place candidate, the values an in-place write by it may change, decided once.

    An MLX value can share or read a user input's memory only if it depends on
    that input, directly or through a write into it done in place (whose value
    *is* the input's memory). Anything else lives in MLX memory of its own, so
    an in-place write cannot change it. Conservative: every dependency counts,
    views or not.
    """
    by_node = {c.node: c.input for c in program.in_place}
    reaches: dict[str, frozenset[int]] = {name: frozenset({i}) for i, name in enumerate(program.inputs)}
    defined_at: dict[str, int] = {name: -1 for name in program.inputs}
    for position, step in enumerate(steps):
        found: set[int] = set()
        for name in refs((step.args, step.kwargs)):
            found |= reaches.get(name, frozenset())
        if step.name in by_node:
            found.add(by_node[step.name])
        reaches[step.name] = frozenset(found)
        defined_at[step.name] = position
    watch: dict[str, list[str]] = {}
    for candidate in program.in_place:
        position = defined_at[candidate.node]
        watch[candidate.node] = [
            name
            for name, at in defined_at.items()
            if at < position and last_use.get(name, -1) > position and candidate.input in reaches[name]
        ]
    return watch


class InterpretedPath(Calls):
    """The delegate's calls that interpret a handle's program."""

    def _execute_interpreted(self, handle: Handle, inputs: list[Any], outputs: list[Any]) -> None:
        """Run the program once on ``inputs``, a step at a time (see the module docstring),
        and write ``outputs``."""
        program = handle.program
        env: dict[str, Any] = dict(handle.constants)
        shared: dict[int, bool] = {}
        for index, (name, value) in enumerate(zip(program.inputs, inputs, strict=True)):
            env[name], shared[index] = self._bind(value)
        active = {c.node: c for c in handle.forced}
        for c in handle.candidates:
            if c.node not in active and same_memory(outputs[c.output], inputs[c.input]):
                active[c.node] = c
        # Two inputs over one MLX allocation (the caller passed the same cache twice)
        # defeat the per-input dependency plan: then every live value is checked.
        pointers = [inputs[i].data_ptr() for i, is_shared in shared.items() if is_shared]
        exact = len(pointers) == len(set(pointers))
        _validate_first(handle, active, env)
        old_state = handle.state
        handle.state = {}
        env.update(old_state)
        written: dict[int, Any] = {}
        try:
            for position, step in enumerate(handle.steps):
                if step.name in active:
                    candidate = active[step.name]
                    written[candidate.output] = self._write_in_place(
                        handle, step, position, env, candidate, inputs, shared, exact
                    )
                else:
                    env[step.name] = call_resolved(step, env, traced=False)
                for name in handle.dies_at[position]:
                    env.pop(name, None)
            results = [resolve(o, env) for o in handle.outputs]
            new_state = {k: env[v] for k, v in handle.state_updates.items()}
            untouched = {k: v for k, v in old_state.items() if k not in new_state}
        except BaseException:
            handle.state = old_state
            raise
        # Let MLX donate the old state buffers to their updates: drop every other reference.
        del old_state
        env.clear()
        handle.state = {**untouched, **new_state}
        # The interpreted path checks each watched state it wrote whole (see ``Handle.finite``).
        watched = handle.compiled.watched if handle.compiled is not None else {}
        checks = {k: mx.all(mx.isfinite(v)) for k, v in new_state.items() if k in watched and handle.finite.get(k)}
        self._evaluate(*[r for r in results if isinstance(r, mx.array)], *handle.state.values(), *checks.values())
        for name, check in checks.items():
            handle.finite[name] = bool(check.item())
        # An output that is the array written in place already holds its value.
        done = {index for index, array in written.items() if results[index] is array}
        done |= {c.output for c in handle.forced}  # nothing reads these outputs
        # An MLX array is in runtime-visible memory only over a shared input; unless an
        # output's destination overlaps one, no result can already be there or be
        # clobbered by writing another output, and the overlap checks are skipped.
        shared_spans = [tensor_span(inputs[i]) for i, is_shared in shared.items() if is_shared]
        maybe_shared = any(
            overlaps(tensor_span(tensor), shared_span)
            for index, tensor in enumerate(outputs)
            if isinstance(tensor, torch.Tensor) and index not in done
            for shared_span in shared_spans
        )
        check_whole(handle, results, inputs)
        self._write_outputs(results, outputs, done, maybe_shared)

    def _write_in_place(
        self,
        handle: Handle,
        step: Step,
        position: int,
        env: dict[str, Any],
        candidate: InPlaceCandidate,
        inputs: list[Any],
        shared: dict[int, bool],
        exact: bool,
    ) -> Any:
        assert step.handler.region is not None
        args = resolve(step.args, env)
        kwargs = resolve_kwargs(step.kwargs, env)
        dest = args[0]
        region = step.handler.region(*args, **kwargs)
        self.evaluations_total += 1  # the region's values are read on the host here
        view = np.asarray(dest)
        if region.values.dtype != view.dtype:
            region = Region(region.key, region.values.astype(view.dtype), region.accumulate)
        # Values read after this write must see the old contents: evaluate them now,
        # and copy those that share the destination's memory (the snapshot hazard).
        # Only values depending on the destination can (see memory_plan), unless two
        # inputs share one allocation.
        names = handle.watch[step.name] if exact else list(env)
        live = [
            n
            for n in names
            if isinstance(env.get(n), mx.array) and handle.last_use.get(n, -1) > position and n not in handle.constants
        ]
        if live:
            self._evaluate(*[env[n] for n in live])
            target = span(dest)
            for name in live:
                if overlaps(span(env[name]), target):
                    env[name] = snapshot(env[name])
        apply(view, region)
        if not shared[candidate.input]:
            # The MLX array is a private copy: the caller's memory gets the same region.
            apply(inputs[candidate.input].numpy(), region)
        env[step.name] = dest
        return dest

"""The compiled path: one call on the step traced at ``init`` (``writeback_mlx_backend.compile_at_init``).

A compiled call checks its indices, runs the traced graph, evaluates it once, then writes
outputs and state: no op is interpreted in Python and nothing is evaluated midway. With
writes the program requires in callers' tensors, after the one evaluation the call writes
the outputs, then stores each written region into the caller's memory on the host. Reads
before the write thus see the old contents. A call bounded by an attention window runs
bounded only where the rows the window removes are known finite, else over the whole axis
(``writeback_mlx_backend.window``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import torch
from writeback_core.blob import Ref, resolve
from writeback_core.ops import normalize_index

from writeback_mlx_backend._steps import refs, resolve_kwargs
from writeback_mlx_backend.allocations import lookup
from writeback_mlx_backend.calls import Calls, apply, check_whole, overlaps, snapshot, span, tensor_span
from writeback_mlx_backend.compile_at_init import TRIAL_STATE_BYTES, inside, trace_bounded, written_rows
from writeback_mlx_backend.handle import Compiled, Handle, ShapeOnly
from writeback_mlx_backend.op_handler import Region
from writeback_mlx_backend.op_indexing import INDEX_WRITES
from writeback_mlx_backend.window import Window, lengths


def _host_index(handle: Handle, compiled: Compiled, ref: Ref, inputs: list[Any], pinned: list[Any]) -> Any:
    """An index on the host: from the call's inputs, its computed indices or the constants."""
    if ref.name in handle.program.inputs:
        return inputs[handle.program.inputs.index(ref.name)].detach().numpy()
    if ref.name in compiled.pinned:
        return np.asarray(pinned[compiled.pinned.index(ref.name)])
    if ref.name in handle.constants:
        return np.asarray(handle.constants[ref.name])
    return None


def _host_indices(handle: Handle, compiled: Compiled, inputs: list[Any], pinned: list[Any]) -> dict[str, Any]:
    """The index values the caller writes read, on the host (:func:`_host_index`)."""
    return {
        name: _host_index(handle, compiled, Ref(name), inputs, pinned)
        for write in compiled.caller_writes
        for position in write.step.handler.index_args
        for name in refs(write.step.args[position : position + 1])
    }


def _write_length(window: Window, length: int, host: Mapping[str, Any]) -> int:
    """The bounded length a call with caller writes runs at: at least the mask's, and past
    every written index (a write is computed over the first ``L`` columns only); 0 when none
    is long enough or an index is negative (the call is then interpreted)."""
    if not length:
        return 0
    reach = 0
    for value in host.values():
        if value.size:
            if int(value.min()) < 0:
                return 0
            reach = max(reach, int(value.max()) + 1)
    return next((n for n in lengths(window.size) if n >= max(length, reach)), 0)


def _caller_regions(
    compiled: Compiled, written: list[Any], inputs: list[Any], host: Mapping[str, Any]
) -> list[tuple[np.ndarray, Region]]:
    """Each caller write's destination (the caller's memory) and region, in program order,
    from the evaluated written values and the indices on the host (``_host_indices``)."""
    values = iter(written)
    found = []
    for write in compiled.caller_writes:
        env = {**host, **{name: np.asarray(next(values)) for name in write.sources}}
        args = [ShapeOnly(write.shape), *resolve(write.step.args[1:], env)]
        assert write.step.handler.region is not None
        region = write.step.handler.region(*args, **write.step.kwargs)
        dest = inputs[write.input].detach().numpy()
        if region.values.dtype != dest.dtype:
            region = Region(region.key, region.values.astype(dest.dtype), region.accumulate)
        found.append((dest, region))
    return found


def _store(handle: Handle, regions: Sequence[tuple[np.ndarray, Region]]) -> None:
    """Store ``regions`` into the callers' memory. A state value that reads that memory
    through an MLX view is copied first, so it keeps the contents the call found."""
    targets = [span(torch.from_numpy(dest)) for dest, _ in regions]
    for key, value in handle.state.items():
        if isinstance(value, mx.array) and any(overlaps(span(value), t) for t in targets):
            handle.state[key] = snapshot(value)
    for dest, region in regions:
        apply(dest, region)


def _removed_scan(value: Any, axis: int, length: int) -> Any:
    """A lazy boolean: every row of ``value`` from ``length`` on along ``axis`` is finite
    (``None`` for a dtype that holds only finite values). Zero times a row is 0 for a finite
    value and NaN otherwise, and one sum of those costs less than ``isfinite`` and ``all``."""
    if not isinstance(value, mx.array) or not mx.issubdtype(value.dtype, mx.floating):
        return None
    removed = value[(slice(None),) * axis + (slice(length, None),)]
    return mx.sum(removed * 0) == 0


def _below(rows: np.ndarray, size: int, length: int) -> bool:
    """Whether every index of ``rows`` (eager's rule: ``[-size, size)``) lands below ``length``."""
    return all(normalize_index(int(i), size, what="written row") < length for i in rows.reshape(-1))


def _write_checks(
    handle: Handle, compiled: Compiled, new_state: Mapping[str, Any], inputs: list[Any], pinned: list[Any]
) -> dict[str, Any]:
    """Per watched state this call wrote and still known finite: a lazy boolean, whether what
    the call stored is finite (its written rows, or the whole new value when the write is not
    one index along one axis); evaluated with the call's outputs."""
    found: dict[str, Any] = {}
    for name, written in compiled.watched.items():
        if name not in new_state or not handle.finite.get(name):
            continue
        value = new_state[name]
        if not mx.issubdtype(value.dtype, mx.floating):
            continue
        rows = _host_index(handle, compiled, written.index, inputs, pinned) if written is not None else None
        if written is not None and rows is not None:
            index = np.asarray(rows, dtype=np.int64).reshape(-1) % value.shape[written.axis]
            value = mx.take(value, mx.array(index), axis=written.axis)
        found[name] = mx.all(mx.isfinite(value))
    return found


def _as_mlx(value: Any) -> Any:
    """A tensor as an MLX array (the caller's own when MLX allocated it); anything else as is."""
    if not isinstance(value, torch.Tensor):
        return value
    found = lookup(value)
    return found if found is not None else mx.array(value.detach().contiguous().numpy())


class CompiledPath(Calls):
    """The delegate's calls on a handle's traced step."""

    def _execute_compiled(self, handle: Handle, compiled: Compiled, inputs: list[Any], outputs: list[Any]) -> bool:
        """One call on the traced step: check indices, build, evaluate once, write. ``False``
        (nothing done) when a program with caller writes has no bounded length for this call."""
        count = len(inputs)
        for position, lo, hi, which in compiled.bounds:
            if position < count and not inside(inputs[position].detach().numpy(), lo, hi):
                self._index_error(handle, compiled, which, inputs, [], position, lo, hi)
        arrays, shared_spans, copies = [], [], []  # type: tuple[list[Any], list[Any], list[int]]
        for value in inputs:
            array, shared = self._bind(value, copies)
            arrays.append(array)
            if shared:
                shared_spans.append(tensor_span(value))
        pinned: list[Any] = []
        if compiled.pinned_fn is not None:
            # Computed indices: evaluated alone (a small graph), checked like inputs.
            pinned = compiled.pinned_fn(arrays, [handle.state[k] for k in compiled.state_keys])
            self._evaluate(*pinned)
            for position, lo, hi, which in compiled.bounds:
                if position >= count and not inside(np.asarray(pinned[position - count]), lo, hi):
                    self._index_error(handle, compiled, which, inputs, pinned, position, lo, hi)
            arrays += pinned
        fn: Callable[[list[Any], list[Any]], list[Any]] | None = compiled.fn
        window = compiled.window
        host: Mapping[str, Any] = {}  # the caller writes' indices, read once per call
        # Scans of callers' tensors past the bounded length, evaluated with the call.
        scans: list[Any] = []
        if window is not None:
            length = window.length(int(inputs[window.input_index].reshape(-1)[0]))
            if compiled.caller_writes:
                host = _host_indices(handle, compiled, inputs, pinned)
                length = _write_length(window, length, host)
            if length:
                fn = (
                    compiled.bounded[length]
                    if length in compiled.bounded
                    else trace_bounded(handle, compiled, window, length)
                )
                if fn is not compiled.fn:
                    found = self._removed_finite(handle, compiled, length, inputs, arrays, pinned)
                    if found is False:
                        # A removed row may hold inf or nan: the whole axis answers as eager.
                        self.exact_calls += 1
                        fn, length = compiled.fn, 0
                    elif found is not True:
                        scans = found
            if not length and compiled.caller_writes:
                fn = None
            if fn is not None:
                self.attention_lengths.append(length or window.size)
        if fn is None:
            return False  # a caller write past every bounded length: interpreted
        for nbytes in copies:  # counted only now: the interpreted path binds its own
            self._count_copy(nbytes)
        state = [handle.state[k] for k in compiled.state_keys]
        kept = {k: v for k, v in handle.state.items() if k not in compiled.update_keys}
        # Drop the handle's references so MLX can donate each buffer to its update.
        handle.state = {}
        try:
            values = fn(arrays, state)
        except BaseException:
            handle.state = {**kept, **dict(zip(compiled.state_keys, state, strict=True))}
            raise
        # With scans pending, the state as the call found it is kept to restore (small, see
        # ``_removed_finite``); otherwise dropped, so MLX donates it.
        undo = dict(zip(compiled.state_keys, state, strict=True)) if scans else {}
        del state, arrays
        count, updates = len(handle.outputs), len(compiled.update_keys)
        results, new_state = values[:count], values[count : count + updates]
        written = values[count + updates :]
        handle.state = {**kept, **dict(zip(compiled.update_keys, new_state, strict=True))} if new_state or kept else {}
        stored = dict(zip(compiled.update_keys, new_state, strict=True))
        checks = _write_checks(handle, compiled, stored, inputs, pinned)
        self._evaluate(*values, *checks.values(), *scans)
        for name, check in checks.items():
            handle.finite[name] = bool(check.item())
        if not all(bool(scan.item()) for scan in scans):
            # A caller's removed row holds inf or nan: nothing is written yet; the state goes
            # back to how the call found it, and the call runs again, unbounded.
            handle.state = {**kept, **undo}
            self.exact_calls += 1
            self.attention_lengths.pop()  # the interpreted path reads the whole axis
            return False
        del values, new_state
        done = {w.output for w in compiled.caller_writes}
        # A result can be in runtime-visible memory only over a shared input (see
        # ``InterpretedPath._execute_interpreted``).
        maybe_shared = bool(shared_spans) and any(
            overlaps(tensor_span(tensor), shared_span)
            for index, tensor in enumerate(outputs)
            if isinstance(tensor, torch.Tensor) and index not in done
            for shared_span in shared_spans
        )
        # Every region is worked out before anything is written (a bad one writes nothing);
        # the outputs go first, so those read before a write keep the old contents.
        regions = _caller_regions(compiled, written, inputs, host) if compiled.caller_writes else []
        check_whole(handle, results, inputs)
        self._write_outputs(results, outputs, done, maybe_shared)
        if regions:
            _store(handle, regions)
        return True

    def _removed_finite(
        self,
        handle: Handle,
        compiled: Compiled,
        length: int,
        inputs: list[Any],
        arrays: list[Any],
        pinned: list[Any],
    ) -> bool | list[Any]:
        """Whether every row a call bounded to ``length`` removes from the values it cuts whole
        is known finite: a delegate-owned state by its flag; a write into one by its flag when
        every written index lies below ``length``; a constant or a caller's tensor by a scan of
        those rows (a caller may store anything between calls). Anything else is not known.

        The scans are returned lazy, to be evaluated with the call itself (one evaluation),
        when the delegate-owned state the call updates is small (``TRIAL_STATE_BYTES``): the
        call keeps it to restore should a scan fail. Otherwise they are evaluated here, before
        the call (a second evaluation), so the state can be donated to its update."""
        producers = {s.name: s for s in handle.steps}
        scans: list[Any] = []
        for name, axis in sorted(compiled.sources):
            step = producers.get(name)
            if name in handle.state:
                known = handle.finite.get(name, False)
            elif step is not None and step.op in INDEX_WRITES and step.args[0] in [Ref(k) for k in handle.state]:
                dest = step.args[0].name
                written = written_rows(step, handle.state[dest].ndim)
                rows = _host_index(handle, compiled, written.index, inputs, pinned) if written else None
                known = (
                    handle.finite.get(dest, False)
                    and written is not None
                    and written.axis == axis
                    and rows is not None
                    and _below(rows, handle.state[dest].shape[axis], length)
                )
            elif name in handle.program.inputs or name in handle.constants:
                value = arrays[handle.program.inputs.index(name)] if name in handle.program.inputs else None
                scans.append(_removed_scan(handle.constants[name] if value is None else value, axis, length))
                continue
            else:
                known = False
            if not known:
                return False
        scans = [s for s in scans if s is not None]
        if not scans:
            return True
        self.finite_scans += 1
        if sum(handle.state[k].nbytes for k in compiled.update_keys) <= TRIAL_STATE_BYTES:
            return scans
        self._evaluate(*scans)
        return all(bool(s.item()) for s in scans)

    @staticmethod
    def _index_error(
        handle: Handle,
        compiled: Compiled,
        which: int,
        inputs: list[Any],
        pinned: list[Any],
        position: int,
        lo: int,
        hi: int,
    ) -> None:
        """Raise ``IndexError`` naming the bad index (nothing is written yet)."""
        # Only to name the bad index: read the inputs without counting a copy.
        bound = {n: _as_mlx(v) for n, v in zip(handle.program.inputs, inputs, strict=True)}
        env = {**handle.constants, **bound, **dict(zip(compiled.pinned, pinned, strict=False))}
        handler, args, kwargs = compiled.checks[which]
        assert handler.validate is not None
        handler.validate(*resolve(args, env), **resolve_kwargs(kwargs, env))
        names = [*handle.program.inputs, *(f"{n} (computed from the inputs and state)" for n in compiled.pinned)]
        raise IndexError(f"input {names[position]}: an index is outside [{lo}, {hi})")

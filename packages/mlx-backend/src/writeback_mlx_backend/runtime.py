"""The MLX runtime delegate: interprets a :class:`DelegateProgram` with MLX on each call.

``execute`` gets the delegate's arguments as torch tensors over the runtime's
memory (inputs, then outputs). What it guarantees:

1. Inputs allocated by :func:`writeback_mlx_backend.empty` are read in place
   (their MLX array is used directly); any other tensor is copied into MLX.
2. Delegate-owned buffers live as MLX arrays in the handle. Their writes are
   MLX updates whose input has no other reference when evaluated, so MLX
   reuses (donates) the buffer: a one-slot write costs O(update).
3. A write into a user input is done in place only when the runtime passed the
   same memory as that input and as the write's output (the write-back was
   dropped for it, see ``writeback_passes.reinplace_delegate_input_mutations``).
   Then, at the write: every value still needed later is evaluated first (so
   reads before the write see old values), any such value whose memory overlaps
   the destination is snapshotted, indices are validated, and only the written
   region is stored into the destination. Otherwise the write is functional.
4. Every output is evaluated before any output is written into runtime memory,
   and an output whose memory overlaps another output's destination is
   snapshotted first; an output already in its destination memory is not
   copied.
5. A bad index raises (``IndexError``) before anything is written.

How a call runs. At ``init`` every step whose arguments are all constants (the
transposes of weights that ``linear`` decomposes into, masks built from
``arange``) is computed once and kept contiguous, so matmuls read weights laid out
for them. Then the step is traced once with ``mx.compile`` when the program allows
it: static shapes, no scalar inputs, every index read from the delegate's inputs
or constants (so it is checked on them, before the graph is built) or computed in a
few steps from inputs, constants and state (those steps are traced apart and
evaluated first, alone, so the index is checked on the host too). A compiled call
checks its indices, runs the traced graph, evaluates it once, then writes outputs
and state: no op is interpreted in Python and nothing is evaluated midway. A
softmax whose mask rules out later positions is computed over the positions it
lets through (``writeback_mlx_backend.window``).

A write the program requires in a caller's tensor (guarantee 3) runs compiled too
when an attention window bounds every read of it: the traced step reads the write
over the window's first ``L`` columns only (the same write into the first ``L``
columns of the destination, so no whole copy is made), and returns the written
values; after the one evaluation the call writes the outputs, then stores each
written region into the caller's memory on the host. Reads before the write thus
see the old contents. A call whose written index or mask reaches past the longest
traced length runs the interpreted path, as does a program that reads the write
whole, or one with no window. The interpreted path evaluates at each in-place
write. :meth:`MLXDelegate.path` says which path a handle got and why.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import torch
from writeback_core.blob import BlobError, Kind, check_call, in_place_outputs
from writeback_core.meta import IN_PLACE_OUTPUTS_SPEC
from writeback_core.ops import normalize_dim, normalize_index

from writeback_mlx_backend._names import BACKEND_ID
from writeback_mlx_backend._steps import Ref, Step, call, refs, resolve
from writeback_mlx_backend.fast import fuse_attention, fuse_rms_norms, fuse_ropes
from writeback_mlx_backend.literals import check_literals
from writeback_mlx_backend.memory import lookup
from writeback_mlx_backend.ops import MX_DTYPES, OPS, UNKNOWN, OpHandler, Region
from writeback_mlx_backend.program import (
    DELEGATE,
    DelegateProgram,
    InPlaceCandidate,
    TensorRecord,
    float_value,
    torch_dtype,
)
from writeback_mlx_backend.window import Unread, WholeRead, Window, lengths, plan

__all__ = ["IN_PLACE_OUTPUTS_SPEC", "MLXDelegate"]

# How many of the latest input copies ``MLXDelegate.copied_input_bytes`` keeps.
COPY_HISTORY = 64


@dataclass
class _Handle:
    program: DelegateProgram
    steps: list[Step]
    constants: dict[str, Any]
    state: dict[str, Any]
    outputs: list[Any]
    last_use: dict[str, int]
    dies_at: list[list[str]]
    candidates: list[InPlaceCandidate]
    # Candidates the program requires in place (its write-back was dropped).
    forced: list[InPlaceCandidate]
    # For each candidate's node: the values defined before it and read after it
    # that may read or share the destination's memory (they depend on the
    # destination input or on a write into it). Only these can see the write.
    watch: dict[str, list[str]]
    # Which value each delegate-owned buffer becomes after a call (aliases folded).
    state_updates: dict[str, str]
    # ``(output, input)``: outputs the program requires written whole into an input's
    # memory (a state replaced by a new value, its write-back dropped), after every
    # output is evaluated, as the write-back would have.
    whole: list[tuple[int, int]] = field(default_factory=list)
    # The traced step (see the module docstring), or None with ``path`` saying why not.
    compiled: _Compiled | None = None
    path: str = "interpreted"
    # The candidates the caller may take in place or not (not forced), checked per call.
    optional: list[InPlaceCandidate] = field(init=False)
    # Per delegate-owned state: whether every value ever stored in it is finite (checked
    # over the whole value at ``init``, then over what each call writes; see ``_Finite``).
    finite: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        forced = {c.node for c in self.forced}
        self.optional = [c for c in self.candidates if c.node not in forced]


@dataclass(frozen=True)
class _ShapeOnly:
    """What an index check reads of the indexed tensor: its shape (for a traced step)."""

    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass
class _Compiled:
    """A program traced once: ``fn(inputs, state) -> [*outputs, *new state]``."""

    fn: Callable[[list[Any], list[Any]], list[Any]]
    state_keys: list[str]
    update_keys: list[str]
    # Each indexing step's check, recorded while tracing: ``validate`` and its
    # arguments, the indices as references to inputs or constants, the rest as
    # shapes or literals. It names the bad index when a bound below fails.
    checks: list[tuple[OpHandler, list[Any], dict[str, Any]]] = field(default_factory=list)
    # ``(position, lo, hi, check)``: the values of that input (or, past the inputs, of that
    # pinned index) must lie in ``[lo, hi)``; read on the host before the graph is built.
    bounds: list[tuple[int, int, int, int]] = field(default_factory=list)
    # The attention window (see ``writeback_mlx_backend.window``), and the step traced
    # per bounded length, made on the first call that needs it.
    window: Window | None = None
    bounded: dict[int, Callable[[list[Any], list[Any]], list[Any]] | None] = field(default_factory=dict)
    # Indices computed inside the program (from inputs, constants and the state at the
    # call's start): ``pinned_fn`` computes them alone, evaluated before the graph is
    # built so they are checked on the host; the traced step reads them as extra inputs.
    pinned: list[str] = field(default_factory=list)
    pinned_fn: Callable[[list[Any], list[Any]], list[Any]] | None = None
    # The writes the program requires in callers' tensors (see ``_CallerWrite``), in
    # program order. With any, only bounded steps run compiled; ``fn`` is never called.
    caller_writes: list[_CallerWrite] = field(default_factory=list)
    # The values a bounded trace cuts whole, with the axis (``window.Bounded.sources``), and
    # per delegate-owned state they read, how a call's write into it is checked (``_Finite``).
    sources: set[tuple[str, int]] = field(default_factory=set)
    watched: dict[str, _Written | None] = field(default_factory=dict)


@dataclass(frozen=True)
class _CallerWrite:
    """A write the program requires in a caller's tensor, on the compiled path.

    The bounded step never computes the written tensor whole (``window.Unread``): it
    reads the write over the first ``L`` columns only, and returns the written values
    (``sources``). After the one evaluation the call stores that region into the
    caller's memory on the host, as the interpreted path does at the write.
    """

    step: Step
    input: int
    output: int
    shape: tuple[int, ...]
    # The step's arguments other than the destination and the indices: the written values.
    sources: list[str]


@dataclass(frozen=True)
class _Written:
    """The rows a call's write into a delegate-owned state stores: ``index`` along ``axis``
    (a reference to an input, a computed index or a constant, read on the host)."""

    axis: int
    index: Ref


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "$v" in value:
            return Ref(str(value["$v"]))
        if "$dtype" in value:
            return MX_DTYPES[torch_dtype(str(value["$dtype"]))]
        if "$float" in value:
            return float_value(value["$float"])
        return {k: _decode(v) for k, v in value.items()}
    return value


def _kind(value: Any) -> Kind:
    if isinstance(value, Ref):
        return "ref"
    return "dtype" if isinstance(value, mx.Dtype) else None


def _span(value: Any) -> tuple[int, int] | None:
    """The byte range ``[lo, hi)`` an evaluated MLX array or a tensor points into."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return None
        lo = hi = value.data_ptr()
        for size, stride in zip(value.shape, value.stride(), strict=True):
            reach = (size - 1) * stride * value.element_size()
            lo, hi = min(lo, lo + reach), max(hi, hi + reach)
        return lo, hi + value.element_size()
    if not isinstance(value, mx.array) or value.size == 0:
        return None
    view = np.asarray(value)
    lo = hi = view.__array_interface__["data"][0]
    for size, stride in zip(view.shape, view.strides, strict=True):
        reach = (size - 1) * stride
        lo, hi = min(lo, lo + reach), max(hi, hi + reach)
    return lo, hi + view.itemsize


def _overlaps(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is not None and b is not None and a[0] < b[1] and b[0] < a[1]


def _snapshot(value: Any) -> Any:
    copy = mx.array(value)
    mx.eval(copy)
    return copy


def _apply(dest: np.ndarray, region: Region) -> None:
    if region.accumulate:
        np.add.at(dest, region.key, region.values)
    else:
        dest[region.key] = region.values


def _resolve_known(value: Any, env: Mapping[str, Any]) -> Any:
    if isinstance(value, Ref):
        return env.get(value.name, UNKNOWN)
    if isinstance(value, list):
        return [_resolve_known(v, env) for v in value]
    return value


def _validate_first(handle: _Handle, active: Mapping[str, InPlaceCandidate], env: Mapping[str, Any]) -> None:
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


def _forced(
    program: DelegateProgram,
    compile_specs: Mapping[str, bytes],
    outputs: Sequence[Any],
    info: Mapping[str, tuple[tuple[int, ...], Any]],
) -> tuple[list[InPlaceCandidate], list[tuple[int, int]]]:
    """The in-place outputs the compile specs require: writes into an input's region (in
    ``program.in_place``), and outputs written whole into an input (``(output, input)``),
    whose traced shape and dtype (``info``, by the name ``outputs`` gives) must be the input's."""
    unknown = sorted(set(compile_specs) - {IN_PLACE_OUTPUTS_SPEC})
    if unknown:
        # A newer pipeline may ask for behaviour this runtime does not have; running
        # anyway could return wrong results, so refuse by name.
        raise BlobError(
            DELEGATE,
            "compile_specs",
            unknown,
            f"this runtime knows only {[IN_PLACE_OUTPUTS_SPEC]}; upgrade writeback-mlx-backend",
        )
    forced, whole = [], []
    for output, input_ in in_place_outputs(compile_specs, DELEGATE, len(program.inputs), len(program.outputs)):
        match = [c for c in program.in_place if c.output == output and c.input == input_]
        if match:
            forced.append(match[0])
            continue
        value, meta = outputs[output], program.input_meta[input_]
        # A program whose steps did not trace at init (scalar inputs) has no shape here;
        # each call then checks the value before writing anything (``_check_whole``).
        traced = info.get(value.name) if isinstance(value, Ref) else None
        want = (tuple(meta.get("shape", ())), MX_DTYPES[torch_dtype(meta["dtype"])]) if "dtype" in meta else None
        if not isinstance(value, Ref) or want is None or (traced is not None and traced != want):
            raise ValueError(
                f"the program asks the MLX delegate to write output {output} into input {input_} in place, "
                f"but that output ({traced}) is neither a write into that input (writes it can do in place: "
                f"{program.in_place}) nor a new value of its shape and dtype ({want}); was the write-back "
                "dropped for a mutation this backend did not accept?"
            )
        whole.append((output, input_))
    return forced, whole


def _check_whole(handle: _Handle, results: Sequence[Any], inputs: Sequence[Any]) -> None:
    """Before any output is written: each value written whole into an input has its shape."""
    for output, input_ in handle.whole:
        shape, expected = tuple(getattr(results[output], "shape", ())), tuple(inputs[input_].shape)
        if shape != expected:
            raise ValueError(
                f"MLX delegate output {output} has shape {shape}, but it replaces input "
                f"{handle.program.inputs[input_]} of shape {expected} in place; nothing was written"
            )


def _rename(value: Any, renames: Mapping[str, str]) -> Any:
    if isinstance(value, Ref):
        return Ref(renames.get(value.name, value.name))
    if isinstance(value, list):
        return [_rename(v, renames) for v in value]
    if isinstance(value, dict):
        return {k: _rename(v, renames) for k, v in value.items()}
    return value


def _fold_aliases(steps: Sequence[Step]) -> tuple[list[Step], dict[str, str]]:
    """Drop the steps whose op returns its argument itself; later uses name that argument.

    Every write keeps its own step. Returns the steps left and ``{alias: value}``.
    """
    renames: dict[str, str] = {}
    kept = []
    for step in steps:
        args, kwargs = _rename(step.args, renames), _rename(step.kwargs, renames)
        if step.handler.alias and args and isinstance(args[0], Ref):
            renames[step.name] = args[0].name
            continue
        kept.append(Step(step.name, step.op, step.handler, args, kwargs, step.dtype))
    return kept, renames


def _memory_plan(program: DelegateProgram, steps: Sequence[Step], last_use: Mapping[str, int]) -> dict[str, list[str]]:
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


# At load the traced step is evaluated once on placeholder inputs, so MLX builds its
# kernels then rather than in the first call, unless it updates more state than this:
# that trial copies each updated buffer (nothing is donated), briefly doubling it.
TRIAL_STATE_BYTES = 32 << 20

# A folded constant may be at most this many bytes larger than the constants it
# is computed from (a mask built from ``arange`` is allowed; an ``expand`` of a
# weight into a much larger array is left to run per call).
_FOLD_GROWTH = 1 << 20


def _fold_constants(steps: Sequence[Step], constants: dict[str, Any], kept: Sequence[str]) -> list[Step]:
    """Compute once every step whose arguments are all constants; return the steps left.

    Each folded value joins ``constants`` contiguous (``permute_copy`` of a weight
    becomes the transposed weight laid out for the matmul that reads it); a constant
    nothing reads any more is dropped. Writes are never folded, nor a step that
    raises here (it raises on each call instead) or whose value would be much larger
    than its inputs.
    """
    left = []
    for step in steps:
        names = refs((step.args, step.kwargs))
        if step.handler.region is not None or not all(name in constants for name in names):
            left.append(step)
            continue
        try:
            kwargs = {k: resolve(v, constants) for k, v in step.kwargs.items()}
            value = call(step, resolve(step.args, constants), kwargs, traced=False)
        except Exception:
            left.append(step)
            continue
        budget = sum(constants[name].nbytes for name in set(names)) + _FOLD_GROWTH
        if not isinstance(value, mx.array) or value.nbytes > budget:
            left.append(step)
            continue
        value = mx.contiguous(value)
        mx.eval(value)
        constants[step.name] = value
    read = set(refs([[(s.args, s.kwargs) for s in left], list(kept)])) | set(kept)
    for name in [n for n in constants if n not in read]:
        del constants[name]
    return left


def _compile(handle: _Handle) -> tuple[_Compiled | None, str]:
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
    fn = mx.compile(_body(handle, state_keys, update_keys, None, 0, checks, shapes, pinned))
    placeholders = _placeholders(program)
    pinned_fn = mx.compile(_pinned_body(handle, pinned_steps, pinned, state_keys)) if pinned else None
    try:
        if pinned_fn is not None:
            placeholders += pinned_fn(placeholders, [handle.state[k] for k in state_keys])
        # Trace now; below, evaluate once (small state only) so MLX builds its fused
        # kernels here rather than in the first call. The handle keeps its state
        # referenced: nothing is donated.
        traced = fn(placeholders, [handle.state[k] for k in state_keys])
    except Exception as error:
        return None, f"interpreted: tracing failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    compiled = _Compiled(fn, state_keys, update_keys, checks, pinned=pinned, pinned_fn=pinned_fn)
    by_node = {c.node: c for c in handle.forced}
    for step in writes:  # in program order, as the traced step returns their values
        candidate, destination = by_node[step.name], step.args[0]
        assert isinstance(destination, Ref)
        compiled.caller_writes.append(
            _CallerWrite(step, candidate.input, candidate.output, shapes[destination.name], _written_values(step))
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
                handler.validate(
                    *resolve(args, handle.constants), **{k: resolve(v, handle.constants) for k, v in kwargs.items()}
                )
    # Evaluated only when every index of the placeholders is in range (MLX writes out of
    # bounds silently), and only when the state it updates is small: the handle keeps its
    # state, so the trial copies every updated buffer whole. Past the limit the first
    # call builds the kernels instead, and updates the state in place by donation.
    updated = sum(handle.state[k].nbytes for k in update_keys)
    if (
        not writes
        and updated <= TRIAL_STATE_BYTES
        and all(_inside(np.asarray(placeholders[i]), lo, hi) for i, lo, hi, _ in compiled.bounds)
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
        _body(handle, state_keys, update_keys, window, shortest, pinned=pinned, cut=compiled.sources)
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


_WRITES = ("aten.index_copy.default", "aten.index_put.default")


def _written(step: Step, rank: int) -> _Written | None:
    """The rows ``step`` writes along one axis, when it is an index write along one axis whose
    index the call can read on the host (see ``window._pull_write``); else ``None``."""
    rest = step.args[1:]
    if step.op == "aten.index_copy.default" and isinstance(rest[1], Ref):
        return _Written(normalize_dim(rest[0], rank, what=f"{step.name} ({step.op}) dim"), rest[1])
    if step.op == "aten.index_put.default" and not (len(rest) > 2 and rest[2]):
        along = [(p, index) for p, index in enumerate(rest[0]) if index is not None]
        if len(along) == 1 and isinstance(along[0][1], Ref):
            return _Written(along[0][0], along[0][1])
    return None


def _watched(handle: _Handle, compiled: _Compiled) -> dict[str, _Written | None]:
    """The delegate-owned states whose removed rows a bounded call reads (a source, or the
    destination of a write that is one), each with how a call's write into it is checked:
    its written rows (``_Written``), or the whole new value (``None``)."""
    producers = {s.name: s for s in handle.steps}
    found: dict[str, _Written | None] = {}
    for name, _ in compiled.sources:
        step = producers.get(name)
        dest = step.args[0] if step is not None and step.op in _WRITES else Ref(name)
        if isinstance(dest, Ref) and dest.name in handle.state and dest.name not in found:
            update = producers.get(handle.state_updates.get(dest.name, ""))
            rank = handle.state[dest.name].ndim
            keep = update is not None and update.op in _WRITES and update.args[0] == dest
            found[dest.name] = _written(update, rank) if keep and update is not None else None
    return found


def _finite_rule(handle: _Handle, compiled: _Compiled) -> str:
    """How a call knows the rows its window removes are finite, for :meth:`MLXDelegate.path`."""
    inputs = sorted({n for n, _ in compiled.sources if n in handle.program.inputs})
    said = "bounded only where the removed rows are known finite, else over the whole axis"
    if inputs:
        said += f" (callers' tensors {', '.join(inputs)}: scanned past the bounded length on every call)"
    return said


# The writes into a caller's tensor the compiled path can bound: one index along one axis.
_CALLER_WRITE_OPS = ("aten.index_copy.default", "aten.index_put.default")


def _caller_writes(handle: _Handle) -> list[Step] | str:
    """The steps of the program's required writes into callers' tensors, in program order,
    or why the compiled path cannot store them."""
    found = []
    forced = {c.node: c for c in handle.forced}
    for step in [s for s in handle.steps if s.name in forced]:
        if step.op not in _CALLER_WRITE_OPS:
            return f"{step.name} is {step.op}; only index_copy and index_put are stored after the evaluation"
        destination = handle.program.inputs[forced[step.name].input]
        if step.args[0] != Ref(destination):
            return f"{step.name} does not write input {destination} itself"
        if step.op == "aten.index_put.default" and len(step.args) > 3 and step.args[3]:
            return f"{step.name} accumulates"
        found.append(step)
    return found


def _written_values(step: Step) -> list[str]:
    """What a write step writes: its arguments other than the destination and the indices."""
    skip = {0, *step.handler.index_args}
    return refs([a for position, a in enumerate(step.args) if position not in skip])


def _body(
    handle: _Handle,
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
    # Bounded, a write into a caller's tensor is not computed (see ``_CallerWrite``): its
    # output is stored by the call, and the step returns the written values instead.
    writes = {c.node: c.output for c in handle.forced} if window is not None else {}
    sources = [n for s in handle.steps if s.name in writes for n in _written_values(s)]

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
                # its first ``L`` columns (through ``window.Bounded.pull``).
                env[step.name] = Unread(unread.name)
                continue
            if checks is not None and step.handler.validate is not None:
                checks.append((step.handler, _check_args(step, args), dict(step.kwargs)))
            env[step.name] = call(step, args, {k: resolve(v, env) for k, v in step.kwargs.items()}, True)
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


def _placeholders(program: DelegateProgram) -> list[Any]:
    return [mx.zeros(meta["shape"], dtype=MX_DTYPES[torch_dtype(meta["dtype"])]) for meta in program.input_meta]


# A computed index is evaluated alone only when it takes at most this many steps.
_MAX_CONE = 16


def _cone_names(handle: _Handle, names: Sequence[str]) -> set[str]:
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


def _index_cone(handle: _Handle, name: str) -> str | None:
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


def _pinned_body(
    handle: _Handle, steps: Sequence[Step], pinned: Sequence[str], state_keys: Sequence[str]
) -> Callable[[list[Any], list[Any]], list[Any]]:
    """The pinned indices as a function to trace: ``(inputs, state) -> [*pinned]``."""

    def body(arrays: list[Any], state: list[Any]) -> list[Any]:
        env: dict[str, Any] = dict(handle.constants)
        env.update(zip(handle.program.inputs, arrays, strict=True))
        env.update(zip(state_keys, state, strict=True))
        for step in steps:
            env[step.name] = call(
                step, resolve(step.args, env), {k: resolve(v, env) for k, v in step.kwargs.items()}, True
            )
        return [env[name] for name in pinned]

    return body


def _host_indices(handle: _Handle, compiled: _Compiled, inputs: list[Any], pinned: list[Any]) -> dict[str, Any]:
    """The index values the caller writes read, on the host: inputs, computed indices, constants."""
    host: dict[str, Any] = {}
    for write in compiled.caller_writes:
        for position in write.step.handler.index_args:
            for name in refs(write.step.args[position : position + 1]):
                if name in handle.program.inputs:
                    host[name] = inputs[handle.program.inputs.index(name)].detach().numpy()
                elif name in compiled.pinned:
                    host[name] = np.asarray(pinned[compiled.pinned.index(name)])
                else:
                    host[name] = np.asarray(handle.constants[name])
    return host


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
    compiled: _Compiled, written: list[Any], inputs: list[Any], host: Mapping[str, Any]
) -> list[tuple[np.ndarray, Region]]:
    """Each caller write's destination (the caller's memory) and region, in program order,
    from the evaluated written values and the indices on the host (``_host_indices``)."""
    values = iter(written)
    found = []
    for write in compiled.caller_writes:
        env = {**host, **{name: np.asarray(next(values)) for name in write.sources}}
        args = [_ShapeOnly(write.shape), *resolve(write.step.args[1:], env)]
        assert write.step.handler.region is not None
        region = write.step.handler.region(*args, **write.step.kwargs)
        dest = inputs[write.input].detach().numpy()
        if region.values.dtype != dest.dtype:
            region = Region(region.key, region.values.astype(dest.dtype), region.accumulate)
        found.append((dest, region))
    return found


def _store(handle: _Handle, regions: Sequence[tuple[np.ndarray, Region]]) -> None:
    """Store ``regions`` into the callers' memory. A state value that reads that memory
    through an MLX view is copied first, so it keeps the contents the call found."""
    targets = [_span(torch.from_numpy(dest)) for dest, _ in regions]
    for key, value in handle.state.items():
        if isinstance(value, mx.array) and any(_overlaps(_span(value), t) for t in targets):
            handle.state[key] = _snapshot(value)
    for dest, region in regions:
        _apply(dest, region)


def _inside(host: np.ndarray, lo: int, hi: int) -> bool:
    if host.size == 1:
        return lo <= int(host.reshape(-1)[0]) < hi
    return host.size == 0 or (lo <= int(host.min()) and int(host.max()) < hi)


def _check_args(step: Step, traced: Sequence[Any]) -> list[Any]:
    """A traced indexing step's arguments as its check reads them on each call: the indices
    as references (resolved from the call's inputs), arrays as their shapes, literals kept."""
    found = []
    for position, (raw, value) in enumerate(zip(step.args, traced, strict=True)):
        if position in step.handler.index_args:
            found.append(raw)
        elif isinstance(value, mx.array):
            found.append(_ShapeOnly(tuple(value.shape)))
        else:
            found.append(raw)
    return found


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


def _removed_scan(value: Any, axis: int, length: int) -> Any:
    """A lazy boolean: every row of ``value`` from ``length`` on along ``axis`` is finite
    (``None`` for a dtype that holds only finite values). Zero times a row is 0 for a finite
    value and NaN otherwise, and one sum of those costs less than ``isfinite`` and ``all``."""
    if not isinstance(value, mx.array) or not mx.issubdtype(value.dtype, mx.floating):
        return None
    removed = value[(slice(None),) * axis + (slice(length, None),)]
    return mx.sum(removed * 0) == 0


def _host_index(handle: _Handle, compiled: _Compiled, ref: Ref, inputs: list[Any], pinned: list[Any]) -> Any:
    """An index on the host: from the call's inputs, its computed indices or the constants."""
    if ref.name in handle.program.inputs:
        return inputs[handle.program.inputs.index(ref.name)].detach().numpy()
    if ref.name in compiled.pinned:
        return np.asarray(pinned[compiled.pinned.index(ref.name)])
    if ref.name in handle.constants:
        return np.asarray(handle.constants[ref.name])
    return None


def _below(rows: np.ndarray, size: int, length: int) -> bool:
    """Whether every index of ``rows`` (eager's rule: ``[-size, size)``) lands below ``length``."""
    return all(normalize_index(int(i), size, what="written row") < length for i in rows.reshape(-1))


def _write_checks(
    handle: _Handle, compiled: _Compiled, new_state: Mapping[str, Any], inputs: list[Any], pinned: list[Any]
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


def _lazy_info(
    program: DelegateProgram, steps: Sequence[Step], constants: Mapping[str, Any], state: Mapping[str, Any]
) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Each value's shape and dtype, from the traced steps on placeholder inputs, nothing
    evaluated; it stops at the first step that cannot be traced (the values after it are
    left out, and no pattern is matched over them)."""
    env: dict[str, Any] = {**constants, **state}
    try:
        env.update(zip(program.inputs, _placeholders(program), strict=True))
        for step in steps:
            kwargs = {k: resolve(v, env) for k, v in step.kwargs.items()}
            env[step.name] = call(step, resolve(step.args, env), kwargs, True)
    except Exception:  # the compiled path says why when it traces; here only patterns are lost
        pass
    return {k: (tuple(v.shape), v.dtype) for k, v in env.items() if isinstance(v, mx.array)}


def _load(program: DelegateProgram, record: TensorRecord) -> Any:
    """A record as an MLX array of its own: zeros allocated here, or a copy of its bytes."""
    if record.zeros:
        return mx.zeros(record.shape, dtype=MX_DTYPES[torch_dtype(record.dtype)])
    return mx.array(program.array(record))


def _as_mlx(value: Any) -> Any:
    """A tensor as an MLX array (the caller's own when MLX allocated it); anything else as is."""
    if not isinstance(value, torch.Tensor):
        return value
    found = lookup(value)
    return found if found is not None else mx.array(value.detach().contiguous().numpy())


def _tensor_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``_span`` of a tensor, quick for the contiguous case."""
    if tensor.is_contiguous():
        if tensor.numel() == 0:
            return None
        start = tensor.data_ptr()
        return start, start + tensor.numel() * tensor.element_size()
    return _span(tensor)


def _same_memory(a: Any, b: Any) -> bool:
    """Two tensors over the same bytes."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensor_span(a) == _tensor_span(b)


class MLXDelegate:
    """The runtime side of the MLX backend (a ``writeback_core.RuntimeDelegate``)."""

    backend_id = BACKEND_ID

    def __init__(self) -> None:
        # Bytes copied into MLX to bind inputs that MLX did not own: the total over
        # all calls (what ``writeback run`` reports) and the last few copies, one
        # entry each (bounded: a long decode loop must not grow it), for tests.
        self.copied_input_bytes_total = 0
        self.copied_input_bytes: deque[int] = deque(maxlen=COPY_HISTORY)
        # Evaluations of MLX graphs over all calls: explicit ones, and host reads of a
        # value mid-graph (an in-place write's region on the interpreted path).
        self.evaluations_total = 0
        # How each handle initialized since the delegate was made runs (see ``path``),
        # the latest few: what ``writeback run`` reports as the delegate's execution.
        self.execution_paths: deque[str] = deque(maxlen=COPY_HISTORY)
        # For each of the latest calls of a program with an attention window, how many
        # positions its attention read (see ``writeback_mlx_backend.window``).
        self.attention_lengths: deque[int] = deque(maxlen=COPY_HISTORY)
        # Calls a window would have bounded that ran over the whole axis because a removed
        # row was not known finite, and scans of callers' tensors past the bounded length.
        self.exact_calls = 0
        self.finite_scans = 0

    def init(self, processed: bytes, compile_specs: Mapping[str, bytes]) -> _Handle:
        """Parse the blob, load weights into MLX and precompute value lifetimes."""
        program = DelegateProgram.from_bytes(processed)
        steps = []
        for position, node in enumerate(program.nodes):
            handler = OPS.get(node["op"])
            if handler is None:
                raise BlobError(
                    DELEGATE, f"nodes[{position}].op", node["op"], "not an op this runtime has a handler for"
                )
            if node["op"].startswith("dim_order_ops."):
                import executorch.exir.passes.dim_order_ops_registry  # noqa: F401  (registers their schemas)
            dtype = MX_DTYPES[torch_dtype(node["dtype"])] if node["dtype"] else None
            args, kwargs = _decode(node["args"]), _decode(node["kwargs"])
            check_call(node["op"], args, kwargs, DELEGATE, f"nodes[{position}]", _kind)
            steps.append(Step(node["name"], node["op"], handler, args, kwargs, dtype))
        records = {name: (r.shape, r.dtype) for name, r in [*program.constants.items(), *program.state.items()]}
        check_literals(steps, dict(zip(program.inputs, program.input_meta, strict=True)), records, torch_dtype)
        steps, renames = _fold_aliases(steps)
        outputs = _rename(_decode(program.outputs), renames)
        state_updates = {k: renames.get(v, v) for k, v in program.state_updates.items()}
        constants = {k: _load(program, r) for k, r in program.constants.items()}
        kept = [*refs(outputs), *state_updates.values()]
        steps = _fold_constants(steps, constants, kept)
        steps, norms = fuse_rms_norms(steps, constants, kept)
        state = {k: _load(program, r) for k, r in program.state.items()}
        info = _lazy_info(program, steps, constants, state)
        steps, attentions = fuse_attention(steps, info, constants, kept)
        steps, ropes = fuse_ropes(steps, info, constants, kept)
        end = len(steps)
        last_use: dict[str, int] = {}
        for position, step in enumerate(steps):
            for name in refs((step.args, step.kwargs)):
                last_use[name] = position
        for name in [*refs(outputs), *state_updates.values()]:
            last_use[name] = end
        dies_at: list[list[str]] = [[] for _ in range(end + 1)]
        for name, position in last_use.items():
            if name not in constants:
                dies_at[position].append(name)
        mx.eval(*constants.values(), *state.values())
        watch = _memory_plan(program, steps, last_use)
        forced, whole = _forced(program, compile_specs, outputs, info)
        handle = _Handle(
            program,
            steps,
            constants,
            state,
            outputs,
            last_use,
            dies_at,
            list(program.in_place),
            forced,
            watch,
            state_updates,
            whole,
        )
        handle.compiled, handle.path = _compile(handle)
        if norms:
            handle.path += f"; {norms} RMSNorm(s) as mx.fast.rms_norm"
        if attentions:
            handle.path += f"; {attentions} attention(s) as mx.fast.scaled_dot_product_attention"
        if ropes:
            handle.path += f"; {ropes} RoPE(s) as mx.fast.rope"
        self.execution_paths.append(handle.path)
        return handle

    @staticmethod
    def path(handle: _Handle) -> str:
        """``"compiled"``, or ``"interpreted: <why>"``: how ``execute`` runs this handle."""
        return handle.path

    def destroy(self, handle: _Handle) -> None:
        """Drop the handle's MLX arrays."""
        handle.constants.clear()
        handle.state.clear()

    # -- execute --------------------------------------------------------------------

    def execute(self, handle: _Handle, args: Sequence[Any]) -> None:
        """Run the program once on ``args`` (inputs then outputs, see the module docstring)."""
        program = handle.program
        count = len(program.inputs)
        inputs, outputs = list(args[:count]), list(args[count:])
        if len(outputs) != len(handle.outputs):
            raise ValueError(
                f"MLX delegate expects {count} inputs and {len(handle.outputs)} outputs, got "
                f"{len(args)} arguments in all"
            )
        for output, input_ in handle.whole:
            # The write-back of this input was dropped: its new value goes into its memory.
            outputs[output] = inputs[input_]
        compiled = handle.compiled
        if (
            compiled is not None
            and not any(_same_memory(outputs[c.output], inputs[c.input]) for c in handle.optional)
            and self._execute_compiled(handle, compiled, inputs, outputs)
        ):
            return
        env: dict[str, Any] = dict(handle.constants)
        shared: dict[int, bool] = {}
        for index, (name, value) in enumerate(zip(program.inputs, inputs, strict=True)):
            env[name], shared[index] = self._bind(value)
        active = {c.node: c for c in handle.forced}
        for c in handle.candidates:
            if c.node not in active and _same_memory(outputs[c.output], inputs[c.input]):
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
                    kwargs = {k: resolve(v, env) for k, v in step.kwargs.items()}
                    env[step.name] = call(step, resolve(step.args, env), kwargs, traced=False)
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
        # The interpreted path checks each watched state it wrote whole (see ``_Handle.finite``).
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
        shared_spans = [_tensor_span(inputs[i]) for i, is_shared in shared.items() if is_shared]
        maybe_shared = any(
            _overlaps(_tensor_span(tensor), span)
            for index, tensor in enumerate(outputs)
            if isinstance(tensor, torch.Tensor) and index not in done
            for span in shared_spans
        )
        _check_whole(handle, results, inputs)
        self._write_outputs(results, outputs, done, maybe_shared)

    def _evaluate(self, *arrays: Any) -> None:
        self.evaluations_total += 1
        mx.eval(*arrays)

    def _execute_compiled(self, handle: _Handle, compiled: _Compiled, inputs: list[Any], outputs: list[Any]) -> bool:
        """One call on the traced step: check indices, build, evaluate once, write. ``False``
        (nothing done) when a program with caller writes has no bounded length for this call."""
        count = len(inputs)
        for position, lo, hi, which in compiled.bounds:
            if position < count and not _inside(inputs[position].detach().numpy(), lo, hi):
                self._index_error(handle, compiled, which, inputs, [], position, lo, hi)
        arrays, shared_spans, copies = [], [], []  # type: tuple[list[Any], list[Any], list[int]]
        for value in inputs:
            array, shared = self._bind(value, copies)
            arrays.append(array)
            if shared:
                shared_spans.append(_tensor_span(value))
        pinned: list[Any] = []
        if compiled.pinned_fn is not None:
            # Computed indices: evaluated alone (a small graph), checked like inputs.
            pinned = compiled.pinned_fn(arrays, [handle.state[k] for k in compiled.state_keys])
            self._evaluate(*pinned)
            for position, lo, hi, which in compiled.bounds:
                if position >= count and not _inside(np.asarray(pinned[position - count]), lo, hi):
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
                    else self._bounded(handle, compiled, window, length)
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
        # A result can be in runtime-visible memory only over a shared input (see execute).
        maybe_shared = bool(shared_spans) and any(
            _overlaps(_tensor_span(tensor), span)
            for index, tensor in enumerate(outputs)
            if isinstance(tensor, torch.Tensor) and index not in done
            for span in shared_spans
        )
        # Every region is worked out before anything is written (a bad one writes nothing);
        # the outputs go first, so those read before a write keep the old contents.
        regions = _caller_regions(compiled, written, inputs, host) if compiled.caller_writes else []
        _check_whole(handle, results, inputs)
        self._write_outputs(results, outputs, done, maybe_shared)
        if regions:
            _store(handle, regions)
        return True

    def _removed_finite(
        self,
        handle: _Handle,
        compiled: _Compiled,
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
            elif step is not None and step.op in _WRITES and step.args[0] in [Ref(k) for k in handle.state]:
                dest = step.args[0].name
                written = _written(step, handle.state[dest].ndim)
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
        handle: _Handle,
        compiled: _Compiled,
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
        handler.validate(*resolve(args, env), **{k: resolve(v, env) for k, v in kwargs.items()})
        names = [*handle.program.inputs, *(f"{n} (computed from the inputs and state)" for n in compiled.pinned)]
        raise IndexError(f"input {names[position]}: an index is outside [{lo}, {hi})")

    @staticmethod
    def _bounded(
        handle: _Handle, compiled: _Compiled, window: Window, length: int
    ) -> Callable[[list[Any], list[Any]], list[Any]] | None:
        """The step traced with its attention bounded to ``length`` columns, made once per length.

        Traced here on placeholders (nothing is evaluated); a trace that fails leaves that
        length on the whole-axis step (with caller writes: interpreted, ``None``), and
        :meth:`path` says so."""
        fn: Callable[[list[Any], list[Any]], list[Any]] | None = mx.compile(
            _body(
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
            placeholders = _placeholders(handle.program)
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

    def _bind(self, value: Any, copies: list[int] | None = None) -> tuple[Any, bool]:
        """An input as MLX: the caller's MLX array (shared) or a copy (not shared). A copy's
        size is counted, or added to ``copies`` for the caller to count."""
        if not isinstance(value, torch.Tensor):
            return value, False
        found = lookup(value)
        if found is not None:
            return found, True
        nbytes = value.numel() * value.element_size()
        if copies is None:
            self._count_copy(nbytes)
        else:
            copies.append(nbytes)
        host = (
            value.numpy() if value.is_contiguous() and not value.requires_grad else value.detach().contiguous().numpy()
        )
        return mx.array(host), False

    def _count_copy(self, nbytes: int) -> None:
        self.copied_input_bytes_total += nbytes
        self.copied_input_bytes.append(nbytes)

    def _write_in_place(
        self,
        handle: _Handle,
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
        kwargs = {k: resolve(v, env) for k, v in step.kwargs.items()} if step.kwargs else {}
        dest = args[0]
        region = step.handler.region(*args, **kwargs)
        self.evaluations_total += 1  # the region's values are read on the host here
        view = np.asarray(dest)
        if region.values.dtype != view.dtype:
            region = Region(region.key, region.values.astype(view.dtype), region.accumulate)
        # Values read after this write must see the old contents: evaluate them now,
        # and copy those that share the destination's memory (the snapshot hazard).
        # Only values depending on the destination can (see _memory_plan), unless two
        # inputs share one allocation.
        names = handle.watch[step.name] if exact else list(env)
        live = [
            n
            for n in names
            if isinstance(env.get(n), mx.array) and handle.last_use.get(n, -1) > position and n not in handle.constants
        ]
        if live:
            self._evaluate(*[env[n] for n in live])
            target = _span(dest)
            for name in live:
                if _overlaps(_span(env[name]), target):
                    env[name] = _snapshot(env[name])
        _apply(view, region)
        if not shared[candidate.input]:
            # The MLX array is a private copy: the caller's memory gets the same region.
            _apply(inputs[candidate.input].numpy(), region)
        env[step.name] = dest
        return dest

    def _write_outputs(
        self,
        results: list[Any],
        outputs: list[Any],
        done: set[int],
        maybe_shared: bool,
    ) -> None:
        if maybe_shared:
            self._snapshot_overlapping(results, outputs, done)
            pending = [i for i in range(len(outputs)) if i not in done]
        else:
            pending = [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and i not in done]
        for index in pending:
            tensor = outputs[index]
            source = np.asarray(results[index])
            if source.shape != tensor.shape:
                if math.prod(source.shape) != tensor.numel():
                    raise ValueError(
                        f"MLX delegate output {index} has shape {source.shape}, the runtime "
                        f"allocated {tuple(tensor.shape)}"
                    )
                source = source.reshape(tuple(tensor.shape))
            np.copyto(tensor.numpy(), source, casting="unsafe")

    @staticmethod
    def _snapshot_overlapping(results: list[Any], outputs: list[Any], done: set[int]) -> None:
        """Mark outputs already in their destination as done; copy results another output would clobber."""
        spans = [_span(t) if isinstance(t, torch.Tensor) else None for t in outputs]
        pending = []
        for index, (value, tensor) in enumerate(zip(results, outputs, strict=True)):
            if not isinstance(tensor, torch.Tensor) or index in done:
                done.add(index)
                continue
            if isinstance(value, mx.array) and _span(value) == spans[index]:
                done.add(index)  # already in the destination's memory
                continue
            pending.append(index)
        targets = [spans[i] for i in pending]
        for index, value in enumerate(results):
            if isinstance(value, mx.array) and any(
                _overlaps(_span(value), t) for j, t in zip(pending, targets, strict=True) if j != index
            ):
                results[index] = _snapshot(value)

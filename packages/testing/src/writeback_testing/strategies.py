"""Hypothesis strategies for :class:`~writeback_testing.program_spec.ProgramSpec`.

``programs()`` draws one to three registered buffers and zero to two
caller-owned state inputs, then a forward of reads (clones, computed values,
views: ``view``, ``transpose``, ``slice``, ``select``), writes in every form
the pipeline classifies (``index_copy_``, strided slice assignment,
``index_put_`` with and without accumulate, ``copy_``, ``add_``/``mul_``,
whole replacement (``s[...] = new``), writes through ``select``/``transpose``/``view`` views),
functional ``index_copy`` of state (which must leave it unchanged), values
computed early and used late, dead writes, and outputs that are state
itself or views of it. About one program in ten takes no input at all; about one
state in four is a 4-D `[batch, heads, seq, head_dim]` cache, the shape an
aliasing engine writes in place.

Shapes stay tiny (at most 24 elements per state): the oracle's cost is
lowering, not arithmetic, and small shapes shrink to readable reproducers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

from writeback_testing.program_spec import (
    X_LEN,
    Combine,
    Compute,
    Derive,
    DType,
    ProgramSpec,
    Read,
    Source,
    State,
    StateKind,
    Statement,
    TempWrite,
    Write,
)

__all__ = ["ALL_WRITES", "cache_shapes", "programs", "shapes"]

MAX_NUMEL = 24

# Every write form the generator draws (keys of ``program._WRITES``).
ALL_WRITES: tuple[str, ...] = (
    "index_copy",
    "slice",
    "index_put",
    "copy",
    "add",
    "mul",
    "replace",
    "select_copy",
    "flat_add",
    "transposed_row",
    "pos_put",
    "roll",
)

_INDEX_WRITES = frozenset({"index_copy", "index_put", "pos_put"})

_READS: tuple[str, ...] = ("clone", "view", "transpose", "slice", "select", "compute", "sum", "conv")

# How a run-time index is drawn (``program.POS_MODES``): in range most of the time, at
# every boundary eager accepts, and out of range (eager raises at call 2) now and then.
_POS_MODES: tuple[str, ...] = (
    "wrap",
    "wrap",
    "wrap",
    "negative",
    "negative",
    "zero",
    "last",
    "minus_size",
    "out_of_range",
)
# index_copy_ draws every mode: eager refuses a negative index, and every target must too.
_COPY_MODES: tuple[str, ...] = ("wrap", "wrap", "wrap", "negative", "zero", "last", "minus_size", "out_of_range")


@st.composite
def shapes(draw: st.DrawFn, max_rank: int = 3, max_numel: int = MAX_NUMEL) -> tuple[int, ...]:
    """A shape of rank 1..``max_rank`` with sides 1..4 and at most ``max_numel`` elements."""
    rank = draw(st.integers(1, max_rank))
    dims: list[int] = []
    for _ in range(rank):
        room = max_numel // max(1, math.prod(dims))
        dims.append(draw(st.integers(1, max(1, min(4, room)))))
    return tuple(dims)


@st.composite
def cache_shapes(draw: st.DrawFn, max_numel: int = MAX_NUMEL) -> tuple[int, int, int, int]:
    """A 4-D ``[batch, heads, seq, head_dim]`` cache shape (seq 2..4), at most ``max_numel`` elements.

    The shape a KV-cache update layer (TensorRT's, the kv-alias engine's) writes
    in place along ``seq``; the other shapes the generator draws never are.
    """
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    seq = draw(st.integers(2, 4))
    room = max(1, max_numel // (batch * heads * seq))
    return (batch, heads, seq, draw(st.integers(1, min(3, room))))


@dataclass
class _Temp:
    name: str
    shape: tuple[int, ...]
    dtype: DType
    view_of: str | None  # the state this temp is a view of


@dataclass
class _Scope:
    """What the generator knows while drawing statements in order."""

    states: dict[str, State]
    has_x: bool
    has_pos: bool
    index_modes: bool = True  # run-time indices at boundaries and out of range (POS_MODES)
    temps: list[_Temp] = field(default_factory=list)
    no_write: set[str] = field(default_factory=set)  # states only the hazard block writes
    keep: list[str] = field(default_factory=list)  # temps that must be outputs (else dead)

    def writable(self) -> list[State]:
        return sorted((s for s in self.states.values() if s.name not in self.no_write), key=lambda s: s.name)

    def new_temp(self, shape: tuple[int, ...], dtype: DType, view_of: str | None) -> str:
        name = f"t{len(self.temps)}"
        self.temps.append(_Temp(name, shape, dtype, view_of))
        return name


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


@st.composite
def _source(draw: st.DrawFn, scope: _Scope, shape: tuple[int, ...]) -> Source:
    n = _numel(shape)
    kinds: list[str] = []
    if scope.has_x:
        # A source wider than the input vector (a big cache-shaped write) takes a constant.
        kinds += ["const", "x", "x"] if n <= X_LEN else ["const"]
    temps = [t for t in scope.temps if _numel(t.shape) >= n]
    if temps:
        kinds.append("temp")
    wholes = [t for t in scope.temps if t.shape == shape and t.dtype == "float32"]
    if wholes:
        kinds += ["whole", "whole"]
    states = [s for s in scope.states.values() if s.numel >= n]
    if states:
        kinds.append("state")
    if not kinds:
        # In an input-free program exir folds constant expressions into lifted
        # constants and then trips over them (see ``programs``), so a constant
        # is drawn there only when nothing else fits.
        kinds.append("const")
    kind = draw(st.sampled_from(kinds))
    scale = draw(st.sampled_from((0.5, -1.0, 2.0, 0.25))) if scope.has_x else 1.0
    if kind == "x":
        return Source("x", shape, scale, offset=draw(st.integers(0, X_LEN - n)))
    if kind == "const":
        return Source("const", shape, scale, offset=draw(st.integers(0, 5)))
    if kind == "whole":
        return Source("whole", shape, ref=draw(st.sampled_from(wholes)).name)
    if kind == "temp":
        temp = draw(st.sampled_from(temps))
        offset = draw(st.integers(0, _numel(temp.shape) - n))
        return Source("temp", shape, scale, offset=offset, ref=temp.name)
    state = draw(st.sampled_from(states))
    return Source("state", shape, scale, offset=draw(st.integers(0, state.numel - n)), ref=state.name)


def _with(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return (*shape[:dim], size, *shape[dim + 1 :])


def _without(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return shape[:dim] + shape[dim + 1 :]


@st.composite
def _write(draw: st.DrawFn, scope: _Scope, forms: Sequence[str]) -> Write:
    state = draw(st.sampled_from(scope.writable()))
    how = draw(st.sampled_from(tuple(forms)))
    shape, rank = state.shape, len(state.shape)
    if how == "pos_put" and not scope.has_pos:
        how = "index_put"  # a run-time index needs the per-call pos
    if how == "roll" and shape[-1] < 2:
        how = "copy"  # nothing to roll along a last dim of one
    # A cache is written along its sequence dim half the time: the write an engine aliases.
    dim = 2 if rank == 4 and draw(st.booleans()) else draw(st.integers(0, rank - 1))
    if how == "index_copy":
        # Eager's index_copy_ refuses negative indices (stock ExecuTorch's index_put would
        # wrap them): every target must refuse them as eager does.
        index = None if scope.has_pos and draw(st.booleans()) else draw(st.integers(0, shape[dim] - 1))
        src = draw(_source(scope, _with(shape, dim, 1)))
        return Write(state.name, how, src, dim=dim, index=index, pos_mode=draw(_pos_mode(scope, _COPY_MODES)))
    if how == "pos_put":
        src = draw(_source(scope, _with(shape, dim, 1)))
        return Write(state.name, how, src, dim=dim, index=None, pos_mode=draw(_pos_mode(scope)))
    if how == "roll":
        src = draw(_source(scope, _with(shape, rank - 1, 1)))
        return Write(state.name, how, src)
    if how in ("slice", "flat_add"):
        size = shape[dim] if how == "slice" else state.numel
        start, stop, step = draw(_slice(size))
        length = len(range(*slice(start, stop, step).indices(size)))
        src_shape = _with(shape, dim, length) if how == "slice" else (length,)
        src = draw(_source(scope, src_shape))
        return Write(state.name, how, src, dim=dim, start=start, stop=stop, step=step)
    if how == "index_put":
        accumulate = draw(st.booleans())
        count = draw(st.integers(1, min(2, shape[0]) if not accumulate else 2))
        # Distinct elements when not accumulating (-1 and size-1 are one element).
        wrapped = draw(st.lists(st.integers(0, shape[0] - 1), min_size=count, max_size=count, unique=not accumulate))
        indices = [i - shape[0] if draw(st.booleans()) else i for i in wrapped]
        src = draw(_source(scope, (count, *shape[1:])))
        return Write(state.name, how, src, indices=tuple(indices), accumulate=accumulate)
    if how == "select_copy":
        index = draw(st.integers(-shape[dim], shape[dim] - 1))
        return Write(state.name, how, draw(_source(scope, _without(shape, dim))), dim=dim, index=index)
    if how == "transposed_row":
        swapped = list(shape)
        swapped[0], swapped[-1] = swapped[-1], swapped[0]
        index = draw(st.integers(-swapped[0], swapped[0] - 1))
        return Write(state.name, how, draw(_source(scope, tuple(swapped[1:]))), index=index)
    return Write(state.name, how, draw(_source(scope, shape)))


@st.composite
def _pos_mode(draw: st.DrawFn, scope: _Scope, modes: tuple[str, ...] = ()) -> str:
    """How a write at ``pos`` maps it (``program.POS_MODES``); "wrap" unless ``scope`` allows more."""
    return draw(st.sampled_from(modes or _POS_MODES)) if scope.index_modes else "wrap"


@st.composite
def _slice(draw: st.DrawFn, size: int) -> tuple[int | None, int | None, int]:
    """A non-empty ``start:stop:step`` over ``size``, bounds possibly negative or open."""
    step = draw(st.integers(1, 3))
    first = draw(st.integers(0, size - 1))
    last = draw(st.integers(first, size - 1))
    start: int | None = draw(st.sampled_from((first, first - size, None if first == 0 else first)))
    if first == 0 and draw(st.integers(0, 5)) == 0:
        start = -size - draw(st.integers(1, 3))  # below -size: eager clamps it to 0
    stop: int | None = draw(st.sampled_from((last + 1, last + 1 - size if last + 1 < size else None, None)))
    if stop is None and last + 1 != size:
        stop = last + 1
    if last + 1 == size and draw(st.integers(0, 3)) == 0:
        stop = size + draw(st.integers(1, 5))  # past the end: eager clamps it to size
    return start, stop, step


@st.composite
def _read(
    draw: st.DrawFn,
    scope: _Scope,
    state: State | None = None,
    hows: tuple[str, ...] | None = None,
) -> Read:
    if state is None:
        state = draw(st.sampled_from(sorted(scope.states.values(), key=lambda s: s.name)))
    if hows is None:
        # "compute" multiplies by a scalar: see ``programs`` on input-free programs.
        hows = _READS if scope.has_x else tuple(h for h in _READS if h != "compute")
    how = draw(st.sampled_from(hows))
    shape, rank = state.shape, len(state.shape)
    dim = draw(st.integers(0, rank - 1))
    views = {"view", "transpose", "slice", "select"}
    dtype: DType = state.dtype if how in views else "float32"
    if how == "view":
        out_shape: tuple[int, ...] = (state.numel,)
        read = Read("", state.name, how)
    elif how == "transpose":
        swapped = list(shape)
        swapped[0], swapped[-1] = swapped[-1], swapped[0]
        out_shape, read = tuple(swapped), Read("", state.name, how)
    elif how == "slice":
        start = draw(st.integers(0, shape[dim] - 1))
        stop = draw(st.integers(start + 1, shape[dim]))
        out_shape = _with(shape, dim, stop - start)
        read = Read("", state.name, how, dim=dim, start=start, stop=stop)
    elif how == "select":
        index = draw(st.integers(0, shape[dim] - 1))
        out_shape, read = _without(shape, dim), Read("", state.name, how, dim=dim, index=index)
    elif how == "sum":
        out_shape, read = _with(shape, 0, 1), Read("", state.name, how)
    elif how == "conv":
        out_shape, read = (1, 1, state.numel), Read("", state.name, how)
    elif how == "qlinear":
        out_shape, read = (1, 4), Read("", state.name, how)
    else:
        scale = draw(st.sampled_from((0.5, 3.0))) if how == "compute" else 1.0
        out_shape, read = shape, Read("", state.name, how, scale=scale)
    name = scope.new_temp(out_shape, dtype, state.name if how in views else None)
    return Read(name, read.state, read.how, read.dim, read.index, read.start, read.stop, read.scale)


@st.composite
def _statement(draw: st.DrawFn, scope: _Scope, forms: Sequence[str]) -> Statement:
    choices = ["read", "read", "compute"]
    if scope.writable():
        choices += ["write", "write", "write"]
    if "index_copy" in forms and scope.writable():
        choices.append("derive")
    if scope.temps:
        choices.append("combine")
    floats = [t for t in scope.temps if t.dtype == "float32" and t.shape and t.view_of not in scope.no_write]
    if floats:
        choices.append("temp_write")
    choice = draw(st.sampled_from(choices))
    if choice == "write":
        return draw(_write(scope, forms))
    if choice == "read":
        return draw(_read(scope))
    if choice == "derive":
        write = draw(_write(scope, ("index_copy",)))
        state = scope.states[write.state]
        return Derive(scope.new_temp(state.shape, state.dtype, None), write)
    if choice == "compute":
        # Half the time a state's shape, so it can later be written whole (early value).
        state_shapes = sorted({s.shape for s in scope.states.values()})
        shape = draw(st.one_of(shapes(), st.sampled_from(state_shapes)))
        source = draw(_source(scope, shape))
        return Compute(scope.new_temp(shape, "float32", None), source)
    if choice == "combine":
        a = draw(st.sampled_from(scope.temps))
        b = draw(st.sampled_from(scope.temps))
        scale = draw(st.sampled_from((1.0, -0.5))) if scope.has_x else 1.0
        # ``a + b.sum()`` of two integer temps (views of int64 state) stays int64 unless scaled.
        dtype: DType = "int64" if a.dtype == b.dtype == "int64" and scale == 1.0 else "float32"
        return Combine(scope.new_temp(a.shape, dtype, None), a.name, b.name, scale)
    temp = draw(st.sampled_from(floats))
    return TempWrite(temp.name, draw(_source(scope, temp.shape)))


@st.composite
def _early_value_block(draw: st.DrawFn, scope: _Scope) -> list[Statement]:
    """A value computed early, an old-value read through a view, then the value written whole.

    ``new = f(x); v = view(state); y = v + ...; state.copy_(new)``: in the
    graph ``new`` precedes the read of ``v``, so a write-back placed right
    after ``new`` must still wait for that read (through the view). Drawn
    on purpose because random statements rarely line these four up.
    """
    state = draw(st.sampled_from(sorted(scope.states.values(), key=lambda s: s.name)))
    source = draw(_source(scope, state.shape))
    early = Compute(scope.new_temp(state.shape, "float32", None), source)
    view = draw(_read(scope, state=state, hows=("view", "view", "transpose", "slice", "select")))
    first, second = (early, view) if draw(st.booleans()) else (view, early)
    reader = Combine(scope.new_temp(_shape_of(scope, view.result), "float32", None), view.result, early.result)
    write = Write(state.name, "copy", Source("whole", state.shape, ref=early.result))
    scope.keep.append(reader.result)  # an unused read is dead code: no hazard left
    return [first, second, reader, write]


def _shape_of(scope: _Scope, name: str) -> tuple[int, ...]:
    return next(t.shape for t in scope.temps if t.name == name)


@st.composite
def programs(
    draw: st.DrawFn,
    max_buffers: int = 3,
    max_inputs: int = 2,
    max_statements: int = 8,
    writes: Sequence[str] = ALL_WRITES,
    dtypes: Sequence[DType] = ("float32", "float32", "float32", "int64"),
    no_input_chance: bool = True,
    state_outputs: bool = True,
    cache_chance: int = 4,
    index_modes: bool = True,
    quantized_chance: int = 25,
) -> ProgramSpec:
    """A small stateful program (see the module docstring for what it may contain).

    :param max_buffers: at most this many registered buffers (at least one).
    :param max_inputs: at most this many caller-owned state inputs.
    :param max_statements: at most this many ``forward`` statements (at least one write).
    :param writes: the write forms to draw from (a subset of :data:`ALL_WRITES`).
    :param dtypes: state dtypes to draw from (repeats weight the draw).
    :param no_input_chance: allow programs whose ``forward`` takes nothing.
    :param state_outputs: allow returning a state itself (not only temps).
    :param cache_chance: about one state in this many is a 4-D cache
        (:func:`cache_shapes`), written along its sequence dim half the time;
        0 for none.
    :param index_modes: draw run-time indices at every boundary eager accepts (negative,
        0, size-1, -size) and out of range (eager raises at the third call), not only
        wrapped into range (``program.POS_MODES``).
    :param quantized_chance: about one program in this many ends with a read of a state
        by a PT2E-quantized linear (dynamic per-channel int8); 0 for none.
    """
    no_input = no_input_chance and draw(st.integers(0, 9)) == 0
    n_buffers = draw(st.integers(1, max_buffers))
    n_inputs = 0 if no_input else draw(st.integers(0, max_inputs))
    states: dict[str, State] = {}
    for i in range(n_buffers + n_inputs):
        name = f"s{i}"
        kind: StateKind = "buffer" if i < n_buffers else "input"
        cache = cache_chance > 0 and draw(st.integers(0, cache_chance - 1)) == 0
        shape = draw(cache_shapes()) if cache else draw(shapes())
        states[name] = State(name, kind, shape, draw(st.sampled_from(tuple(dtypes))))
    has_x = not no_input
    if no_input:
        # exir 1.5.1's to_edge fails on an input-free program holding more than
        # one lifted constant (index tensors, scalars it turns into tensors):
        # "Input spec name _lifted_tensor_constant2 does not match node name
        # ...", an upstream defect. So such programs get no index writes, no
        # scalar factors (scale 1.0 renders as nothing) and no constant sources.
        writes = [w for w in writes if w not in _INDEX_WRITES] or ["copy"]
    has_pos = not no_input and draw(st.booleans())
    scope = _Scope(states, has_x, has_pos, index_modes)
    first_state = next(iter(states.values()))
    count = draw(st.integers(1, max_statements))
    if "copy" in writes and draw(st.integers(0, 3)) == 0:
        # The hazard block first, on a state nothing else writes: its write is then the
        # state's final value and its view read a read of the old one.
        statements: list[Statement] = draw(_early_value_block(scope))
        scope.no_write.add(statements[-1].state)  # type: ignore[union-attr]  # the block ends with its Write
    else:
        statements = [draw(_write(scope, writes))]
    for _ in range(count - 1):
        statements.append(draw(_statement(scope, writes)))
    first = statements[0]
    if isinstance(first, Write) and draw(st.booleans()):
        # The first write was drawn before any temp existed, so it uses none and may move
        # anywhere: reads then come before and after it.
        statements.insert(draw(st.integers(0, len(statements) - 1)), statements.pop(0))
    if has_x and quantized_chance > 0 and draw(st.sampled_from(range(quantized_chance))) == 1:
        # The new value of a state, read by a quantized linear (ops a delegate may leave outside).
        state = draw(st.sampled_from(sorted(states.values(), key=lambda s: s.name)))
        statements.append(draw(_read(scope, state=state, hows=("qlinear",))))
        scope.keep.append(scope.temps[-1].name)
    names = [t.name for t in scope.temps] + (list(states) if state_outputs else [])
    if not names:
        statements.append(Read(scope.new_temp(first_state.shape, "float32", None), first_state.name, "clone"))
        names = [scope.temps[-1].name]
    outputs = scope.keep + draw(st.lists(st.sampled_from(names), min_size=1, max_size=3))
    return ProgramSpec(
        states=tuple(states.values()),
        statements=tuple(statements),
        outputs=tuple(outputs[:3]),
        has_x=has_x,
        has_pos=has_pos,
        temps=tuple((t.name, t.shape) for t in scope.temps),
    )

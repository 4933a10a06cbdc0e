"""A generated stateful program: a plain description, rendered to Python source and built from it.

A :class:`ProgramSpec` lists the state (registered buffers and caller-owned
inputs), the statements of ``forward`` in eager order, and the outputs.
:func:`render_source` turns it into the source of a self-contained module
(``FuzzModule``, ``step_inputs(step)``, ``make_state()``); :func:`build`
executes that source. The source is therefore exactly the reproducer a
mismatch prints: paste it into a file and the model is there.

Semantics are eager PyTorch's, whatever the statements do: a view read
early sees later writes, a write through a view lands in its state, a
returned state is the state itself. The generator (``strategies``) only has
to produce code that runs eagerly and exports; the oracle decides what is
right by running it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import torch

__all__ = [
    "POS_MODES",
    "X_LEN",
    "Built",
    "Combine",
    "Compute",
    "Derive",
    "ProgramSpec",
    "Read",
    "Source",
    "State",
    "Statement",
    "TempWrite",
    "Write",
    "build",
    "render_source",
]

# Length of the per-call float input ``x`` every source slices from.
X_LEN = 32

StateKind = Literal["buffer", "input"]
DType = Literal["float32", "int64"]


@dataclass(frozen=True)
class State:
    """One piece of state: ``kind`` "buffer" (``self.<name>``) or "input" (a ``forward`` argument)."""

    name: str
    kind: StateKind
    shape: tuple[int, ...]
    dtype: DType = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Source:
    """Where a written or computed value comes from, always ``numel(shape)`` elements.

    ``kind``: "x" (``x[offset:offset+n]``), "const" (an arange), "temp"
    (``ref`` names a temp, read at this point), "state" (``ref`` names a
    state, read at this point: read-modify-write when it is the destination),
    "whole" (the temp ``ref`` itself, of exactly ``shape``: a value computed
    earlier and written late, with no op at the write site). The value is
    scaled by ``scale`` and reshaped to ``shape``.
    """

    kind: Literal["x", "const", "temp", "state", "whole"]
    shape: tuple[int, ...]
    scale: float = 1.0
    offset: int = 0
    ref: str | None = None


@dataclass(frozen=True)
class Write:
    """A write to state ``state``. ``how`` selects the form (see :data:`_WRITES`).

    ``dim``/``index``/``start``/``stop``/``step``/``indices``/``accumulate``
    parametrize it; ``index`` None means "at the per-call ``pos`` input", mapped
    onto the written dim by ``pos_mode`` (a key of :data:`POS_MODES`).
    """

    state: str
    how: str
    source: Source
    dim: int = 0
    index: int | None = 0
    start: int | None = None
    stop: int | None = None
    step: int = 1
    indices: tuple[int, ...] = ()
    accumulate: bool = False
    pos_mode: str = "wrap"


@dataclass(frozen=True)
class Read:
    """``result = <read of state>``; ``how`` in :data:`_READS`. Views alias the state."""

    result: str
    state: str
    how: str
    dim: int = 0
    index: int = 0
    start: int = 0
    stop: int = 1
    scale: float = 1.0


@dataclass(frozen=True)
class Compute:
    """``result = <source>``: a value computed now and maybe used much later."""

    result: str
    source: Source


@dataclass(frozen=True)
class Combine:
    """``result = a * scale + b.sum()``: mixes two temps (``b`` may be a view of state)."""

    result: str
    a: str
    b: str
    scale: float = 1.0


@dataclass(frozen=True)
class TempWrite:
    """``temp.add_(source)``: writes a temp, and through it its state when the temp is a view."""

    temp: str
    source: Source


@dataclass(frozen=True)
class Derive:
    """``result = state.index_copy(dim, index, source)``: a functional write; the state is unchanged.

    ``write`` must be an ``index_copy`` :class:`Write` (its ``state`` is read, not written).
    """

    result: str
    write: Write


Statement = Write | Read | Compute | Combine | TempWrite | Derive


@dataclass(frozen=True)
class ProgramSpec:
    """A whole program. ``outputs`` name temps or states (a state output is the state itself).

    ``has_x``/``has_pos``: whether ``forward`` takes the per-call float
    vector ``x`` (length :data:`X_LEN`) and int64 position ``pos`` (shape
    ``[1]``); with neither and no input state, ``forward`` takes nothing.
    ``temps`` records each temp's shape (the renderer needs none of it; the
    generator and the contract suite read it). ``offset_initial`` shifts
    initial state off the values constants take (floats by 0.125, ints by
    100). Drawn programs start on the constants' grid, where a mutated buffer
    merged with an equal constant would show
    (``tests/fuzz/test_regressions.py`` pins that case).
    """

    states: tuple[State, ...]
    statements: tuple[Statement, ...]
    outputs: tuple[str, ...]
    has_x: bool = True
    has_pos: bool = True
    temps: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), compare=False)
    offset_initial: bool = False

    def state(self, name: str) -> State:
        for state in self.states:
            if state.name == name:
                return state
        raise KeyError(f"program has no state {name!r}; states: {[s.name for s in self.states]}")

    @property
    def buffers(self) -> tuple[State, ...]:
        return tuple(s for s in self.states if s.kind == "buffer")

    @property
    def inputs(self) -> tuple[State, ...]:
        return tuple(s for s in self.states if s.kind == "input")


def _dtype(name: DType) -> str:
    return f"torch.{name}"


def _num(value: float) -> str:
    return repr(float(value))


class _Renderer:
    """Renders statements; knows which names are states and of which kind."""

    def __init__(self, spec: ProgramSpec) -> None:
        self.spec = spec
        self.kinds = {s.name: s for s in spec.states}

    def ref(self, name: str) -> str:
        state = self.kinds.get(name)
        if state is None:
            return name
        return f"self.{name}" if state.kind == "buffer" else name

    def source(self, src: Source, dtype: DType = "float32") -> str:
        n = math.prod(src.shape)
        shape = repr(tuple(src.shape))
        if src.kind == "whole":
            assert src.ref is not None
            return src.ref if dtype == "float32" else f"{src.ref}.to({_dtype(dtype)})"
        if src.kind == "x":
            flat = f"x[{src.offset}:{src.offset + n}]"
        elif src.kind == "const":
            flat = f"torch.arange({src.offset}, {src.offset + n}, dtype=torch.float32)"
        else:
            assert src.ref is not None
            base = self.ref(src.ref)
            cast = ""
            state = self.kinds.get(src.ref)
            if state is not None and state.dtype != "float32":
                cast = ".to(torch.float32)"
            flat = f"{base}{cast}.reshape(-1)[{src.offset}:{src.offset + n}]"
        scaled = "" if src.scale == 1.0 else f" * {_num(src.scale)}"
        text = f"({flat}.reshape({shape}){scaled})"
        if dtype != "float32":
            text = f"{text}.to({_dtype(dtype)})"
        return text

    def statement(self, stmt: Statement) -> str:
        renderer = _STATEMENTS[type(stmt)]
        return renderer(self, stmt)


# How a write at the per-call ``pos`` maps it onto a dim of ``size`` (``pos`` is
# ``3 * step + 1``: 1, 4, 7, ...). Every index is computed at run time, from ``pos``:
#   wrap:         pos mod size, in [0, size)
#   negative:     pos mod size - size, in [-size, 0): eager wraps it
#   zero:         0
#   last:         size - 1
#   minus_size:   -size, the lowest index eager takes
#   out_of_range: pos mod size, plus size from call 2 on (pos >= 7): eager raises at call 2
POS_MODES: dict[str, Callable[[int], str]] = {
    "wrap": lambda size: f"torch.remainder(pos, {size})",
    "negative": lambda size: f"(torch.remainder(pos, {size}) - {size})",
    "zero": lambda size: "(pos * 0)",
    "last": lambda size: f"(pos * 0 + {size - 1})",
    "minus_size": lambda size: f"(pos * 0 - {size})",
    "out_of_range": lambda size: f"(torch.remainder(pos, {size}) + pos // 7 * {size})",
}


def _index_expr(r: _Renderer, write: Write, size: int) -> str:
    if write.index is None:
        return POS_MODES[write.pos_mode](size)
    return _index_tensor((write.index,))


def _index_tensor(values: Sequence[int]) -> str:
    """An int64 index tensor made by an op, not a tensor literal.

    ``torch.tensor([...])`` inside ``forward`` becomes a lifted constant, and
    exir 1.5.1's ``to_edge`` trips on several of them (``Input spec name
    _lifted_tensor_constant2 does not match node name ...``): an upstream
    defect the fuzzer is not after. An ``arange`` is an op.
    """
    first = values[0]
    if len(values) == 1:
        return f"torch.arange({first}, {first + 1})"
    step = values[1] - values[0]
    assert len(values) == 2, "index lists have at most two entries"
    return f"(torch.arange(2) * {step} + {first})"


def _slice_text(rank: int, dim: int, piece: str) -> str:
    return "[" + ", ".join([":"] * dim + [piece]) + "]"


def _bound(value: int | None) -> str:
    return "" if value is None else str(value)


def _write_index_copy(r: _Renderer, w: Write) -> str:
    state = r.kinds[w.state]
    index = _index_expr(r, w, state.shape[w.dim])
    return f"{r.ref(w.state)}.index_copy_({w.dim}, {index}, {r.source(w.source, state.dtype)})"


def _write_slice(r: _Renderer, w: Write) -> str:
    state = r.kinds[w.state]
    piece = f"{_bound(w.start)}:{_bound(w.stop)}:{w.step}"
    return f"{r.ref(w.state)}{_slice_text(len(state.shape), w.dim, piece)} = {r.source(w.source, state.dtype)}"


def _write_index_put(r: _Renderer, w: Write) -> str:
    state = r.kinds[w.state]
    index = _index_tensor(w.indices)
    return f"{r.ref(w.state)}.index_put_(({index},), {r.source(w.source, state.dtype)}, accumulate={w.accumulate})"


def _write_method(method: str) -> Callable[[_Renderer, Write], str]:
    def render(r: _Renderer, w: Write) -> str:
        state = r.kinds[w.state]
        return f"{r.ref(w.state)}.{method}({r.source(w.source, state.dtype)})"

    return render


def _write_replace(r: _Renderer, w: Write) -> str:
    """Whole replacement by assignment, ``state[...] = new``.

    Rebinding the attribute (``self.b = new``) is not used: torch 2.13's
    non-strict export turns the new value into lifted constants that exir
    1.5.1's ``to_edge`` rejects (``Input spec name _lifted_tensor_constant2
    does not match node name ...``), an upstream limit, not a write form.
    """
    state = r.kinds[w.state]
    return f"{r.ref(w.state)}[...] = {r.source(w.source, state.dtype)}"


def _write_select_copy(r: _Renderer, w: Write) -> str:
    state = r.kinds[w.state]
    return f"{r.ref(w.state)}.select({w.dim}, {w.index}).copy_({r.source(w.source, state.dtype)})"


def _write_flat_add(r: _Renderer, w: Write) -> str:
    state = r.kinds[w.state]
    piece = f"{_bound(w.start)}:{_bound(w.stop)}:{w.step}"
    return f"{r.ref(w.state)}.view(-1)[{piece}].add_({r.source(w.source, state.dtype)})"


def _write_transposed_row(r: _Renderer, w: Write) -> str:
    state = r.kinds[w.state]
    last = len(state.shape) - 1
    return f"{r.ref(w.state)}.transpose(0, {last})[{w.index}].copy_({r.source(w.source, state.dtype)})"


def _write_pos_put(r: _Renderer, w: Write) -> str:
    """``state[:, idx] = src``: index assignment at a run-time index (``k[pos] = v``), an ``index_put_``."""
    state = r.kinds[w.state]
    index = _index_expr(r, w, state.shape[w.dim])
    return f"{r.ref(w.state)}{_slice_text(len(state.shape), w.dim, index)} = {r.source(w.source, state.dtype)}"


def _write_roll(r: _Renderer, w: Write) -> str:
    """A rolling buffer: drop the oldest column of the last dim, append the new one."""
    state = r.kinds[w.state]
    ref = r.ref(w.state)
    return f"{ref}.copy_(torch.cat([{ref}[..., 1:], {r.source(w.source, state.dtype)}], -1))"


# Every write form, keyed by ``Write.how``.
_WRITES: dict[str, Callable[[_Renderer, Write], str]] = {
    "index_copy": _write_index_copy,
    "slice": _write_slice,
    "index_put": _write_index_put,
    "copy": _write_method("copy_"),
    "add": _write_method("add_"),
    "mul": _write_method("mul_"),
    "replace": _write_replace,
    "select_copy": _write_select_copy,
    "flat_add": _write_flat_add,
    "transposed_row": _write_transposed_row,
    "pos_put": _write_pos_put,
    "roll": _write_roll,
}


def _float(r: _Renderer, name: str) -> str:
    state = r.kinds[name]
    return r.ref(name) if state.dtype == "float32" else f"{r.ref(name)}.to(torch.float32)"


# Every read form, keyed by ``Read.how``: views alias the state, the rest copy.
_READS: dict[str, Callable[[_Renderer, Read], str]] = {
    "clone": lambda r, rd: f"{_float(r, rd.state)}.clone()",
    "view": lambda r, rd: f"{r.ref(rd.state)}.view(-1)",
    "transpose": lambda r, rd: f"{r.ref(rd.state)}.transpose(0, {len(r.kinds[rd.state].shape) - 1})",
    "slice": lambda r, rd: (
        f"{r.ref(rd.state)}{_slice_text(len(r.kinds[rd.state].shape), rd.dim, f'{rd.start}:{rd.stop}')}"
    ),
    "select": lambda r, rd: f"{r.ref(rd.state)}.select({rd.dim}, {rd.index})",
    "compute": lambda r, rd: f"({_float(r, rd.state)} * {_num(rd.scale)} + 1.0)",
    "sum": lambda r, rd: f"{_float(r, rd.state)}.sum(0, keepdim=True)",
    # Ops a delegate may not take, reading the state's current value.
    "conv": lambda r, rd: (
        f"torch.nn.functional.conv1d({_float(r, rd.state)}.reshape(1, 1, -1), torch.ones(1, 1, 3), padding=1)"
    ),
    "qlinear": lambda r, rd: f"self.{_qlinear_name(rd)}({_float(r, rd.state)}.reshape(1, -1))",
}


def _qlinear_name(rd: Read) -> str:
    return f"q_{rd.result}"


# The helper a program with a quantized read defines: a Linear quantized by PT2E with
# XNNPACK's quantizer (dynamic, per-channel int8), as a user quantizes a model. Built once
# per size and seed (cached), a submodule of every FuzzModule instance.
_QUANTIZED_HELPER = """_QUANTIZED = {}


def quantized_linear(features, seed):
    if (features, seed) not in _QUANTIZED:
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )
        from torchao.quantization.pt2e import allow_exported_model_train_eval
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        gen = torch.Generator().manual_seed(seed)
        layer = torch.nn.Linear(features, 4).eval()
        with torch.no_grad():
            layer.weight.copy_(torch.randn(4, features, generator=gen) / features)
            example = torch.randn(1, features, generator=gen)
            graph = torch.export.export(layer, (example,)).module()
        config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
        prepared = prepare_pt2e(graph, XNNPACKQuantizer().set_global(config))
        prepared(example)
        converted = convert_pt2e(prepared)
        allow_exported_model_train_eval(converted)
        _QUANTIZED[(features, seed)] = converted
    return _QUANTIZED[(features, seed)]
"""


def _render_write(r: _Renderer, w: Write) -> str:
    return _WRITES[w.how](r, w)


def _render_read(r: _Renderer, rd: Read) -> str:
    return f"{rd.result} = {_READS[rd.how](r, rd)}"


def _render_compute(r: _Renderer, c: Compute) -> str:
    return f"{c.result} = {r.source(c.source)}"


def _render_combine(r: _Renderer, c: Combine) -> str:
    scaled = "" if c.scale == 1.0 else f" * {_num(c.scale)}"
    return f"{c.result} = {r.ref(c.a)}{scaled} + {r.ref(c.b)}.sum()"


def _render_derive(r: _Renderer, d: Derive) -> str:
    w = d.write
    state = r.kinds[w.state]
    index = _index_expr(r, w, state.shape[w.dim])
    return f"{d.result} = {r.ref(w.state)}.index_copy({w.dim}, {index}, {r.source(w.source, state.dtype)})"


def _render_temp_write(r: _Renderer, t: TempWrite) -> str:
    return f"{t.temp}.add_({r.source(t.source)})"


_STATEMENTS: dict[type, Callable[[_Renderer, Any], str]] = {
    Write: _render_write,
    Read: _render_read,
    Compute: _render_compute,
    Combine: _render_combine,
    TempWrite: _render_temp_write,
    Derive: _render_derive,
}


def _initial(state: State, salt: int, offset: bool) -> str:
    """Deterministic, non-zero, non-constant initial contents (catches a lost initial state).

    With ``offset`` the values sit off the grid of the constants programs use
    (floats shifted by 0.125, ints by 100), so no buffer's bytes equal a lifted
    constant's: see :attr:`ProgramSpec.offset_initial`.
    """
    n = state.numel
    shift = " + 0.125" if offset and state.dtype == "float32" else ""
    int_shift = " + 100" if offset and state.dtype != "float32" else ""
    return (
        f"((torch.arange({n}, dtype=torch.float32) % 5 - 2 + {salt}) * 0.5{shift})"
        f".reshape({tuple(state.shape)!r}).to({_dtype(state.dtype)}){int_shift}"
    )


def forward_params(spec: ProgramSpec) -> list[str]:
    """The parameter names of ``forward``, in order (after ``self``)."""
    params = (["x"] if spec.has_x else []) + (["pos"] if spec.has_pos else [])
    return params + [s.name for s in spec.inputs]


def render_source(spec: ProgramSpec) -> str:
    """The program as the source of a self-contained Python module.

    It defines ``FuzzModule`` (buffers initialised in ``__init__``),
    ``step_inputs(step) -> tuple`` (the per-call ``x``/``pos``, deterministic
    in ``step``) and ``make_state() -> tuple`` (fresh caller-owned state, in
    ``forward`` order).
    """
    r = _Renderer(spec)
    quantized = [st for st in spec.statements if isinstance(st, Read) and st.how == "qlinear"]
    lines = ["import torch", "", ""]
    if quantized:
        lines += [*_QUANTIZED_HELPER.splitlines(), "", ""]
    lines += ["class FuzzModule(torch.nn.Module):"]
    lines += ["    def __init__(self):", "        super().__init__()"]
    for k, read in enumerate(quantized):
        features = r.kinds[read.state].numel
        lines.append(f"        self.{_qlinear_name(read)} = quantized_linear({features}, {k})")
    for i, state in enumerate(spec.buffers):
        init = _initial(state, i, spec.offset_initial)
        lines.append(f"        self.register_buffer({state.name!r}, {init})")
    lines += ["", f"    def forward(self{''.join(', ' + p for p in forward_params(spec))}):"]
    lines += [f"        {r.statement(s)}" for s in spec.statements]
    outputs = ", ".join(r.ref(o) for o in spec.outputs)
    lines += [f"        return ({outputs},)", "", ""]
    lines += ["def step_inputs(step):"]
    step_values = []
    if spec.has_x:
        step_values.append(f"torch.randn({X_LEN}, generator=torch.Generator().manual_seed(1000 + step))")
    if spec.has_pos:
        step_values.append("torch.tensor([3 * step + 1])")
    lines.append(f"    return ({''.join(v + ', ' for v in step_values)})")
    lines += ["", "", "def make_state():"]
    inputs = [_initial(s, 7 + i, spec.offset_initial) for i, s in enumerate(spec.inputs)]
    lines.append(f"    return ({''.join(v + ', ' for v in inputs)})")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Built:
    """A program made real: its source and the objects that source defines."""

    spec: ProgramSpec
    source: str
    module_class: type[torch.nn.Module]
    step_inputs: Callable[[int], tuple[torch.Tensor, ...]]
    make_state: Callable[[], tuple[torch.Tensor, ...]]

    def new_module(self) -> torch.nn.Module:
        """A fresh module in eval mode with no parameter requiring grad."""
        return self.module_class().eval().requires_grad_(False)


def build(spec: ProgramSpec, name: str = "writeback_fuzz_program") -> Built:
    """Render ``spec`` and execute the source as a module named ``name``.

    Exported programs keep a module's source file in their stack traces, so
    the source is compiled under a ``<writeback-fuzz ...>`` file name.
    """
    source = render_source(spec)
    module = ModuleType(name)
    code = compile(source, f"<writeback-fuzz {name}>", "exec")
    exec(code, module.__dict__)
    return Built(
        spec=spec,
        source=source,
        module_class=module.__dict__["FuzzModule"],
        step_inputs=module.__dict__["step_inputs"],
        make_state=module.__dict__["make_state"],
    )

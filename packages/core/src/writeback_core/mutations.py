"""The mutation model: one :class:`Mutation` per state write of an ``ExportedProgram``.

``find_mutations`` reads the graph signature (``BUFFER_MUTATION`` and
``USER_INPUT_MUTATION`` outputs) and, for each, walks from the value written
back to the placeholder it replaces to classify the shape of the write. It works
on the aten program (``torch.export`` then ``run_decompositions()``) and on the
edge program from ``executorch.exir.to_edge``, whose ops wrap the same aten ops.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from writeback_core.ops import aten_op, normalize_dim, op_name, packet_name, write_back_copies

__all__ = [
    "Dynamic",
    "Mutation",
    "MutationKind",
    "WriteKind",
    "WriteShape",
    "classify_write",
    "find_mutations",
]


class MutationKind(enum.Enum):
    """Whose state is written: a registered buffer, or a tensor the caller passed."""

    BUFFER = "buffer"
    USER_INPUT = "user_input"


class WriteKind(enum.Enum):
    """The shape of a write, from most to least structured."""

    INDEX_COPY = "index_copy"  # one index tensor along one dim: buf.index_copy_(d, idx, src)
    SLICE_SCATTER = "slice_scatter"  # a strided range along one dim: buf[..., a:b:s] = src
    INDEX_PUT = "index_put"  # advanced indexing: buf[i, j] = src (or += with accumulate)
    FULL = "full"  # the whole tensor replaced by a new value
    MUTATING_OP = "mutating_op"  # an op whose schema writes the tensor (Tensor(a!)), e.g. llama::update_cache
    OTHER = "other"  # a partial write of a form we do not recognise


@dataclass(frozen=True)
class Dynamic:
    """A bound known only at run time; ``expr`` is its symbolic expression."""

    expr: str

    def __str__(self) -> str:
        return self.expr


Bound = int | Dynamic


@dataclass(frozen=True)
class WriteShape:
    """Where in the destination a write lands.

    ``dim`` is normalized to be non-negative. For slice writes ``start``/``end``
    are normalized to ``0 <= start <= end <= size`` (negative bounds wrapped, open
    ends resolved, out-of-range ends clamped as Python slicing does); a bound
    that is a runtime value is a :class:`Dynamic`, never a guess. ``op`` is the
    aten op that performs the write and ``node`` the graph node performing it.
    """

    kind: WriteKind
    op: str | None = None
    node: str | None = None
    dim: int | None = None
    index: str | None = None
    indices: tuple[str | None, ...] | None = None
    start: Bound | None = None
    end: Bound | None = None
    step: Bound | None = None
    accumulate: bool = False
    source: str | None = None

    @property
    def is_static(self) -> bool:
        """False when a bound of the write is only known at run time."""
        return not any(isinstance(b, Dynamic) for b in (self.start, self.end, self.step))

    def describe(self) -> str:
        """A one-line human description, e.g. ``slice_scatter(dim=1, 4:7:2)``."""
        kind = self.kind
        if kind is WriteKind.INDEX_COPY:
            return f"index_copy(dim={self.dim}, index={self.index})"
        if kind is WriteKind.SLICE_SCATTER:
            return f"slice_scatter(dim={self.dim}, {self.start}:{self.end}:{self.step})"
        if kind is WriteKind.INDEX_PUT:
            names = ", ".join("None" if i is None else i for i in self.indices or ())
            acc = ", accumulate" if self.accumulate else ""
            return f"index_put([{names}]{acc})"
        if kind is WriteKind.FULL:
            return "full overwrite" if self.op is None else f"full overwrite ({self.op})"
        if kind is WriteKind.MUTATING_OP:
            return f"in place by {self.op}"
        return f"other ({self.op})" if self.op else "other"


@dataclass(frozen=True)
class Mutation:
    """One piece of state an ``ExportedProgram`` writes.

    ``target`` is the buffer's fully qualified name (``layers.0.k_cache``) or the
    user input's name; ``placeholder`` the graph placeholder holding the old
    value; ``value`` the graph node whose result is written back;
    ``output_index`` the position of that value among the graph's outputs;
    ``user_input_index`` the position of a mutated user input among the
    program's user inputs (what a runtime's ``set_inputs`` indexes), else ``None``.
    """

    kind: MutationKind
    target: str
    placeholder: str
    value: str
    output_index: int
    write: WriteShape
    shape: tuple[int | Dynamic, ...]
    dtype: torch.dtype
    user_input_index: int | None = field(default=None)

    @property
    def written_by_op(self) -> str | None:
        """The op that writes this buffer in place wherever the program runs, else ``None``.

        A buffer an op's schema declares written (``Tensor(a!)``, ``WriteKind.MUTATING_OP``,
        e.g. ``llama::update_cache``) is written by that op on the program's own buffer: no
        backend copies it back, and no write-back of it costs a byte per call. A caller's
        tensor so written is not covered: whether the runtime writes it into the caller's
        memory is the runtime's rule.
        """
        if self.kind is MutationKind.BUFFER and self.write.kind is WriteKind.MUTATING_OP:
            return self.write.op
        return None

    def also_returned(self, graph: torch.fx.Graph) -> bool:
        """Whether ``graph`` (the program's, or a partition's view of it) also returns this
        state's new value as an output of its own, besides writing it back.

        A buffer's new value returned that way must live outside the buffer's
        planned memory, so a copy is needed whether or not a backend writes the
        buffer in place: a backend should decline such a buffer mutation.
        """
        outputs = graph.output_node().args[0]
        if not isinstance(outputs, (list, tuple)):
            return False
        return any(
            isinstance(out, torch.fx.Node) and out.name == self.value and index != self.output_index
            for index, out in enumerate(outputs)
        )

    @property
    def nbytes(self) -> int | None:
        """Bytes of the whole state tensor (what a full write-back copies), if static."""
        sizes = [s for s in self.shape if isinstance(s, int)]
        if len(sizes) != len(self.shape):
            return None
        return math.prod(sizes) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def update_nbytes(self) -> int | None:
        """Bytes the write itself touches, when the write shape tells; else ``None``."""
        total = self.nbytes
        if total is None:
            return None
        w = self.write
        if w.kind is WriteKind.FULL:
            return total
        if w.kind is WriteKind.SLICE_SCATTER and w.is_static and w.dim is not None:
            size = self.shape[w.dim]
            assert isinstance(size, int) and isinstance(w.start, int)
            assert isinstance(w.end, int) and isinstance(w.step, int)
            count = len(range(w.start, w.end, w.step))
            return total // size * count if size else 0
        return None


_PEEL = {"clone", "alias", "alias_copy", "_clone_dim_order", "detach", "detach_copy"}
_PEEL_NAMESPACES = {"aten", "dim_order_ops"}


def _peel(node: Any) -> Any:
    """Strip copies and aliases that do not change which values a write produced."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        op = aten_op(node.target)
        trusted = isinstance(op, torch._ops.OpOverload) and op.namespace in _PEEL_NAMESPACES
        if not trusted or op._opname not in _PEEL or not node.args:
            break
        node = node.args[0]
    return node


def _bound(value: Any) -> Bound | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, int):
            return val
        return Dynamic(str(val) if val is not None else value.name)
    if isinstance(value, torch.SymInt):
        return Dynamic(str(value))
    return Dynamic(repr(value))


def _dim_size(node: torch.fx.Node, dim: int) -> int | Dynamic:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return Dynamic(f"{node.name}.size({dim})")
    size = val.shape[dim]
    return int(size) if isinstance(size, int) else Dynamic(str(size))


def _rank(node: torch.fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else None


def _norm_dim(dim: int, rank: int | None) -> int:
    return dim if rank is None else normalize_dim(dim, rank, what="mutation write dim")


def _arg(node: torch.fx.Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _slice_write(node: torch.fx.Node, dest: torch.fx.Node) -> WriteShape:
    """Classify ``slice_scatter(dest, src, dim, start, end, step)``."""
    rank = _rank(dest)
    dim = _norm_dim(int(_arg(node, 2, "dim", 0)), rank)
    start = _bound(_arg(node, 3, "start", None))
    end = _bound(_arg(node, 4, "end", None))
    step = _bound(_arg(node, 5, "step", 1))
    size = _dim_size(dest, dim) if rank is not None and 0 <= dim < rank else Dynamic("?")
    source = node.args[1].name if isinstance(node.args[1], torch.fx.Node) else None
    shape = partial(WriteShape, op=op_name(node.target), node=node.name, dim=dim, source=source)
    if isinstance(size, int):
        start, end = _normalize_range(start, end, size)
    if isinstance(size, int) and start == 0 and end == size and step == 1:
        return shape(WriteKind.FULL, start=0, end=size, step=1)
    return shape(WriteKind.SLICE_SCATTER, start=start, end=end, step=step)


def _normalize_range(start: Bound | None, end: Bound | None, size: int) -> tuple[Bound, Bound]:
    """Python slicing's rules: negative wraps once, then clamp to [0, size]."""

    def norm(b: Bound | None, default: int) -> Bound:
        if b is None:
            return default
        if isinstance(b, Dynamic):
            return b
        if b < 0:
            b += size
        return min(max(b, 0), size)

    s, e = norm(start, 0), norm(end, size)
    if isinstance(s, int) and isinstance(e, int) and e < s:
        e = s
    return s, e


def _index_copy_write(node: torch.fx.Node, dest: torch.fx.Node) -> WriteShape:
    dim = _norm_dim(int(_arg(node, 1, "dim", 0)), _rank(dest))
    index = node.args[2]
    source = node.args[3]
    return WriteShape(
        WriteKind.INDEX_COPY,
        op=op_name(node.target),
        node=node.name,
        dim=dim,
        index=index.name if isinstance(index, torch.fx.Node) else None,
        source=source.name if isinstance(source, torch.fx.Node) else None,
    )


def _index_put_write(node: torch.fx.Node, dest: torch.fx.Node) -> WriteShape:
    """``index_put(dest, [None, .., idx], src)`` with one 1-D index is an index_copy.

    That is the form ``torch.export`` decomposes ``index_copy_`` into; any other
    index list (several index tensors, or accumulate) stays an ``INDEX_PUT``.
    """
    indices = list(_arg(node, 1, "indices", []))
    accumulate = bool(_arg(node, 3, "accumulate", False))
    source = node.args[2]
    names = tuple(i.name if isinstance(i, torch.fx.Node) else None for i in indices)
    shape = partial(
        WriteShape,
        op=op_name(node.target),
        node=node.name,
        source=source.name if isinstance(source, torch.fx.Node) else None,
    )
    present = [k for k, i in enumerate(indices) if i is not None]
    if not accumulate and len(present) == 1 and present[0] == len(indices) - 1:
        only = indices[present[0]]
        val = only.meta.get("val") if isinstance(only, torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dim() == 1 and val.dtype in (torch.int64, torch.int32):
            return shape(WriteKind.INDEX_COPY, dim=present[0], index=names[-1])
    return shape(WriteKind.INDEX_PUT, indices=names, accumulate=accumulate)


def _copy_write(node: torch.fx.Node, dest: torch.fx.Node) -> WriteShape:
    return WriteShape(WriteKind.FULL, op=op_name(node.target), node=node.name)


# Ops whose first argument is the destination they write into, keyed by aten packet.
_WRITE_CLASSIFIERS = {
    "slice_scatter": _slice_write,
    "index_copy": _index_copy_write,
    "index_copy_": _index_copy_write,
    "index_put": _index_put_write,
    "index_put_": _index_put_write,
    "copy": _copy_write,
    "copy_": _copy_write,
}

# Scatter-like ops that write part of their first argument in forms we do not model.
_OTHER_WRITES = {
    "select_scatter",
    "diagonal_scatter",
    "as_strided_scatter",
    "scatter",
    "scatter_",
    "scatter_add",
    "scatter_add_",
    "scatter_reduce",
    "masked_scatter",
    "masked_fill",
    "masked_fill_",
    "index_fill",
    "index_fill_",
    "index_add",
    "index_add_",
}


def _mutating_op_write(node: torch.fx.Node, placeholder: torch.fx.Node) -> WriteShape | None:
    """``MUTATING_OP`` when ``node`` is the value functionalization gives ``placeholder``
    after an op that writes it: ``getitem(auto_functionalized[_v2](op, ...), i)`` whose
    ``i`` is the slot of ``placeholder`` among the op's written arguments."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

    if node.target is not operator.getitem or len(node.args) != 2:
        return None
    wrapper, index = node.args
    if not isinstance(wrapper, torch.fx.Node) or wrapper.op != "call_function" or not wrapper.args:
        return None
    if wrapper.target is not auto_functionalized and wrapper.target is not auto_functionalized_v2:
        return None
    op = wrapper.args[0]
    schema = getattr(op, "_schema", None)
    if not isinstance(schema, torch.FunctionSchema) or not isinstance(index, int) or isinstance(index, bool):
        return None
    # The wrapper returns the op's own results, then each written tensor: v2 names them
    # in ``_all_bases``, v1 by the schema's written arguments.
    if wrapper.target is auto_functionalized_v2:
        bases = wrapper.kwargs.get("_all_bases")
        written = list(bases) if isinstance(bases, (list, tuple)) else []
    else:
        written = [
            wrapper.kwargs.get(a.name) for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
        ]
    slot = index - len(schema.returns)
    if not 0 <= slot < len(written) or _peel(written[slot]) is not placeholder:
        return None
    # Named as its schema names it (``llama::update_cache``), the overload only when not the default.
    name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
    return WriteShape(WriteKind.MUTATING_OP, op=name, node=wrapper.name)


def classify_write(value: torch.fx.Node, placeholder: torch.fx.Node) -> WriteShape:
    """Classify how ``value`` (the new state) was produced from ``placeholder`` (the old).

    Copies and aliases of the written value are peeled first. A write op whose
    destination is the placeholder is classified by :data:`_WRITE_CLASSIFIERS`;
    a scatter-like op or a chain of writes reaching the placeholder is
    ``OTHER``; the placeholder's slot of a functionalized op that writes it
    (:func:`_mutating_op_write`) is ``MUTATING_OP``; a value not built by writing into
    the placeholder is ``FULL``.
    """
    node = _peel(value)
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return WriteShape(WriteKind.FULL)
    by_op = _mutating_op_write(node, placeholder)
    if by_op is not None:
        return by_op
    packet = packet_name(node.target)
    dest = _peel(node.args[0]) if node.args else None
    if packet == "copy" and dest is placeholder and isinstance(node.args[1], torch.fx.Node):
        # ``copy(input, new)``: how functionalization spells "write ``new`` back
        # into the input"; the shape of the write is how ``new`` was made.
        inner = classify_write(node.args[1], placeholder)
        if inner.kind is not WriteKind.FULL:
            return inner
    classify = _WRITE_CLASSIFIERS.get(packet or "")
    if classify is not None and dest is placeholder:
        return classify(node, placeholder)
    if (classify is not None or packet in _OTHER_WRITES) and _reaches(dest, placeholder):
        return WriteShape(WriteKind.OTHER, op=op_name(node.target), node=node.name)
    return WriteShape(WriteKind.FULL, op=op_name(node.target), node=node.name)


def _reaches(node: Any, placeholder: torch.fx.Node, limit: int = 64) -> bool:
    """Whether following destination (first) arguments from ``node`` reaches ``placeholder``."""
    for _ in range(limit):
        if not isinstance(node, torch.fx.Node):
            return False
        if node is placeholder:
            return True
        if node.op != "call_function" or not node.args:
            return False
        node = node.args[0]
    return False


def _shape(node: torch.fx.Node) -> tuple[tuple[int | Dynamic, ...], torch.dtype]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(
            f"placeholder {node.name!r} has no tensor 'val' in node.meta; "
            "find_mutations needs a program produced by torch.export"
        )
    shape = tuple(int(s) if isinstance(s, int) else Dynamic(str(s)) for s in val.shape)
    return shape, val.dtype


def _write_back_copies(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    """The last ``copy_(placeholder, value)`` of each placeholder, keyed by its name."""
    return {str(node.args[0]): node for node in write_back_copies(graph)}


def find_mutations(ep: ExportedProgram) -> list[Mutation]:
    """Return one :class:`Mutation` per state write of ``ep``, in output order.

    Covers ``BUFFER_MUTATION`` and ``USER_INPUT_MUTATION`` outputs, for the aten
    program from ``torch.export`` (``run_decompositions()`` or not) and for the
    edge program from ``to_edge``, and for the program after ``to_executorch``
    (where the value is what the write-back ``copy_`` writes). Raises ``ValueError`` when the signature names
    a placeholder or value that is not in the graph.
    """
    sig = ep.graph_signature
    graph = ep.graph_module.graph
    by_name = {n.name: n for n in graph.nodes}
    output = graph.output_node()
    outputs = output.args[0]
    outputs = list(outputs) if isinstance(outputs, Sequence) else [outputs]
    input_for_buffer = {
        spec.target: spec.arg.name
        for spec in sig.input_specs
        if spec.kind is InputKind.BUFFER and hasattr(spec.arg, "name")
    }
    user_inputs = {name: i for i, name in enumerate(sig.user_inputs)}
    # After to_executorch the state outputs are gone from the output node: each
    # is applied by a write-back ``copy_(placeholder, value)`` inside the graph.
    written_back = len(outputs) != len(sig.output_specs)
    copies = _write_back_copies(graph) if written_back else {}
    found: list[Mutation] = []
    for index, spec in enumerate(sig.output_specs):
        if spec.kind is OutputKind.BUFFER_MUTATION:
            kind = MutationKind.BUFFER
            target = str(spec.target)
            ph_name = input_for_buffer.get(target)
        elif spec.kind is OutputKind.USER_INPUT_MUTATION:
            kind = MutationKind.USER_INPUT
            target = str(spec.target)
            ph_name = target
        else:
            continue
        placeholder = by_name.get(ph_name or "")
        if written_back:
            copy = copies.get(ph_name or "")
            value = copy.args[1] if copy is not None else None
        else:
            value = outputs[index] if index < len(outputs) else None
        if placeholder is None or not isinstance(value, torch.fx.Node):
            raise ValueError(
                f"output {index} is a {spec.kind.name} of {target!r} but the graph has "
                f"no placeholder {ph_name!r} or no node value for it; was the graph "
                "edited without updating its signature?"
            )
        shape, dtype = _shape(placeholder)
        found.append(
            Mutation(
                kind=kind,
                target=target,
                placeholder=placeholder.name,
                value=value.name,
                output_index=index,
                write=classify_write(value, placeholder),
                shape=shape,
                dtype=dtype,
                user_input_index=user_inputs.get(placeholder.name) if kind is MutationKind.USER_INPUT else None,
            )
        )
    return found

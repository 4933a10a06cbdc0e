"""The one derivation of a state write's arguments, shared by prediction and lowering.

A predicate is only as good as its arguments: if the classifier and the
engine's lowering each read ``dim``/``start``/``end``/``step`` off the node
their own way, they disagree on exactly the corners that matter (defaults,
negative indices, open ends, full overwrites, runtime bounds, a bad dim). Both
call :func:`engine_write` on the node that performs the write, and both read
slice bounds through :func:`resolve_bounds`.

The normalization itself is core's (:class:`writeback_core.mutations.WriteShape`);
this module adds what an aliasing engine needs on top: whether the destination
reaches the engine as a direct input, whether a bound as written was clamped,
whether the write carries the no-alias marker, and a status naming which early
exit a write takes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch.fx
from writeback_core import meta
from writeback_core.mutations import Dynamic, WriteKind, WriteShape, classify_write
from writeback_core.ops import packet_name, schema_of
from writeback_core.types import EngineWrite

from writeback_trt_copyback.clones import peeled_input

__all__ = [
    "Bounds",
    "WriteStatus",
    "engine_write",
    "old_value_readers",
    "resolve_bounds",
    "write_node_of",
]


class WriteStatus(enum.Enum):
    """Which exit a write takes before an engine could emit an in-place update."""

    OK = "ok"  # a static, in-range write along one dim
    FULL_OVERWRITE = "full overwrite"  # the whole destination replaced: nothing to alias
    DYNAMIC_BOUNDS = "dynamic bounds"  # a bound known only at run time
    BAD_DIM = "bad dim"  # the dim does not index the destination
    NOT_A_SLICE_OR_INDEX = "not a slice or index write"  # index_put, other, or no write op


@dataclass(frozen=True)
class Bounds:
    """A write's resolved arguments; ``start``/``length``/``step`` are set only when ``OK``.

    For an index write (``index_copy``), ``start``/``length`` stay ``None``:
    its positions are the index tensor's values, known at run time.
    """

    status: WriteStatus
    dim: int | None = None
    start: int | None = None
    length: int | None = None
    step: int | None = None


def write_node_of(shape: WriteShape, graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The graph node that performs the write ``shape`` describes, if it has one."""
    if shape.node is None:
        return None
    nodes: Iterable[torch.fx.Node] = graph.nodes
    for node in nodes:
        if node.name == shape.node:
            return node
    return None


def _clamped(node: torch.fx.Node, shape: WriteShape, size: int | Dynamic) -> bool:
    """Whether a slice bound as written lies outside ``[-size, size]`` (so it was clamped)."""
    if shape.op is None or "slice_scatter" not in shape.op or not isinstance(size, int):
        return False
    raw = [node.args[i] if len(node.args) > i else node.kwargs.get(k) for i, k in ((3, "start"), (4, "end"))]
    return any(isinstance(b, int) and not -size <= b <= size for b in raw)


# Ops whose first argument is only the destination they land in: its untouched part is
# kept, never read into a computation.
_LANDING_WRITES = {"index_put", "slice_scatter", "index_copy", "copy"}


def _shape_only(node: torch.fx.Node) -> bool:
    """A slice of the destination used only as ``copy(self=slice, src)``: only its shape is read.

    ``cache[:, :, 3:4] = x`` functionalizes to
    ``slice_scatter(cache, copy(slice(cache, ...), x), ...)``; the ``copy``
    takes its values from ``x`` alone.
    """
    if packet_name(node.target) not in ("slice", "slice_copy"):
        return False
    return bool(node.users) and all(packet_name(u.target) == "copy" and u.args[0] is node for u in node.users)


def _metadata_check(node: torch.fx.Node) -> bool:
    """``aten._assert_tensor_metadata(cache, ...)`` (what an unused ``cache.to(dtype)`` leaves):
    it reads the dtype and device only, which no write changes, and exir erases it."""
    schema = schema_of(node.target)
    return schema is not None and schema.name == "aten::_assert_tensor_metadata"


def old_value_readers(cache: torch.fx.Node, write: torch.fx.Node | None) -> list[torch.fx.Node]:
    """The nodes that read ``cache``'s old values, other than ``write`` landing in it.

    ``write`` lands in ``cache`` only when it is a write op whose destination
    is ``cache``; a computed value (``cache * 0.9 + x``) reads it.

    A clone of ``cache`` that the lowering peels counts as ``cache`` itself;
    a slice whose values are only overwritten (:func:`_shape_only`) and a
    metadata assertion (:func:`_metadata_check`) are no reads.
    """
    lands = write is not None and packet_name(write.target) in _LANDING_WRITES
    dest = write.args[0] if lands and write is not None and write.args else None
    holders = [cache]
    if isinstance(dest, torch.fx.Node) and dest is not cache and peeled_input(dest) is cache:
        holders.append(dest)
    return [
        u
        for h in holders
        for u in h.users
        if not (lands and u is write) and u not in holders and not _shape_only(u) and not _metadata_check(u)
    ]


def engine_write(value: torch.fx.Node, cache: torch.fx.Node) -> EngineWrite:
    """Describe how ``value`` (the new state) is written into ``cache`` (its placeholder).

    ``direct_input`` holds when the write's destination is ``cache`` itself, or
    a clone of it that :func:`peeled_input` says the lowering removes, and
    nothing else reads its old values (:func:`old_value_readers`). Works on aten
    and edge graphs alike.
    """
    shape = classify_write(value, cache)
    val = cache.meta.get("val")
    dims: tuple[int | Dynamic, ...] = ()
    if isinstance(val, torch.Tensor):
        dims = tuple(int(s) if isinstance(s, int) else Dynamic(str(s)) for s in val.shape)
    node = write_node_of(shape, value.graph)
    if node is None or (shape.kind is WriteKind.FULL and shape.op is None):
        return EngineWrite(write=shape, shape=dims, direct_input=False)
    dest = node.args[0] if node.args else None
    direct = peeled_input(dest) is cache and not old_value_readers(cache, node)
    size = dims[shape.dim] if shape.dim is not None and 0 <= shape.dim < len(dims) else 0
    return EngineWrite(
        write=shape,
        shape=dims,
        direct_input=direct,
        clamped=_clamped(node, shape, size),
        no_alias=meta.get_custom(node, meta.NO_ALIAS) is not None,
        source_shape=_source_shape(node) if shape.kind is WriteKind.SLICE_SCATTER else None,
    )


def _source_shape(node: torch.fx.Node) -> tuple[int | Dynamic, ...] | None:
    """The shape of the value a ``slice_scatter`` writes (its second argument), if recorded."""
    src = node.args[1] if len(node.args) > 1 else node.kwargs.get("src")
    val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(int(s) if isinstance(s, int) else Dynamic(str(s)) for s in val.shape)


def resolve_bounds(write: EngineWrite) -> Bounds:
    """The status and resolved arguments of ``write``, read once for every caller.

    1. A full overwrite (including a slice covering the whole dim with step 1)
       is ``FULL_OVERWRITE``.
    2. Anything but a slice or index-copy write is ``NOT_A_SLICE_OR_INDEX``.
    3. A dim outside ``[0, rank)`` is ``BAD_DIM``.
    4. A slice with a runtime bound (or a runtime size along its dim) is
       ``DYNAMIC_BOUNDS``.
    5. Otherwise ``OK``: for a slice, ``start`` and ``length = len(range(start, end, step))``
       with core's normalized bounds; ``step`` comes back as it went in.
    """
    shape = write.write
    if shape.kind is WriteKind.FULL:
        return Bounds(WriteStatus.FULL_OVERWRITE)
    if shape.kind not in (WriteKind.SLICE_SCATTER, WriteKind.INDEX_COPY):
        return Bounds(WriteStatus.NOT_A_SLICE_OR_INDEX)
    dim = shape.dim
    if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < len(write.shape):
        return Bounds(WriteStatus.BAD_DIM, dim=dim if isinstance(dim, int) else None)
    if shape.kind is WriteKind.INDEX_COPY:
        return Bounds(WriteStatus.OK, dim=dim)
    start, end, step = shape.start, shape.end, shape.step
    if not (isinstance(start, int) and isinstance(end, int) and isinstance(step, int)):
        return Bounds(WriteStatus.DYNAMIC_BOUNDS, dim=dim)
    if isinstance(write.shape[dim], Dynamic):
        return Bounds(WriteStatus.DYNAMIC_BOUNDS, dim=dim)
    return Bounds(
        WriteStatus.OK,
        dim=dim,
        start=start,
        length=len(range(start, end, step)) if step > 0 else 0,
        step=step,
    )

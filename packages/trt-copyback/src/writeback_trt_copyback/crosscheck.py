"""After lowering: what the engine really aliased, checked against the prediction, both ways."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from writeback_core import meta
from writeback_core.ops import packet_name
from writeback_core.types import AliasingEngine

from writeback_trt_copyback.clones import peeled_input
from writeback_trt_copyback.derive import engine_write

__all__ = [
    "AliasMismatchError",
    "AliasSite",
    "EngineAliasing",
    "MarkerFaultError",
    "check_aliasing",
    "check_markers",
    "engine_aliasing",
]

_WRITES = {"index_put", "slice_scatter", "index_copy"}


class AliasMismatchError(RuntimeError):
    """The engine aliased a different set of buffers than the classifier predicted."""


class MarkerFaultError(RuntimeError):
    """A no-alias marker was lost, gained or moved between classification and lowering."""


@dataclass(frozen=True)
class AliasSite:
    """One in-place write of a lowered delegate: ``binding`` writes delegate input ``input_index``.

    ``output_index`` is the delegate output the write also is (the engine leaves
    it unwritten), ``None`` for a write internal to the delegate.
    """

    call: str
    binding: str
    input_index: int
    output_index: int | None
    input_node: str


@dataclass(frozen=True)
class EngineAliasing:
    """The engine's real ``aliased_io`` over a lowered program, keyed by what each write lands in.

    Keys are buffer names (fully qualified) for buffers, and ``<node name>`` for
    anything else an engine wrote in place. ``engines`` counts the delegates of
    this engine in the program.
    """

    sites: dict[str, list[AliasSite]] = field(default_factory=dict)
    engines: int = 0

    @property
    def buffers(self) -> set[str]:
        return set(self.sites)


def _delegate_calls(program: ExportedProgram) -> Iterator[tuple[torch.fx.Node, Any]]:
    """Each ``executorch_call_delegate`` node and its ``LoweredBackendModule``."""
    module = program.graph_module
    for node in module.graph.nodes:
        if node.op != "call_function" or "executorch_call_delegate" not in str(node.target):
            continue
        handle = node.args[0]
        assert isinstance(handle, torch.fx.Node)
        yield node, getattr(module, str(handle.target))


def engine_aliasing(program: ExportedProgram, engine: AliasingEngine) -> EngineAliasing:
    """Read ``engine.aliased_io`` off every lowered delegate of ``engine`` in ``program``."""
    buffers = program.graph_signature.inputs_to_buffers
    result = EngineAliasing()
    count = 0
    for call, lowered in _delegate_calls(program):
        if lowered.backend_id != engine.backend_id:
            continue
        count += 1
        for binding, index in engine.aliased_io(lowered.processed_bytes).items():
            node = call.args[1 + index]
            assert isinstance(node, torch.fx.Node)
            key = buffers.get(node.name, f"<{node.name}>")
            out = int(binding[len("output") :]) if binding.startswith("output") else None
            result.sites.setdefault(key, []).append(AliasSite(call.name, binding, index, out, node.name))
    return EngineAliasing(result.sites, count)


def _classes(program: ExportedProgram) -> dict[str, dict[str, object]]:
    found = {}
    for node in program.graph_module.graph.nodes:
        record = meta.get_custom(node, meta.COPY_BACK_CLASS) if node.op == "placeholder" else None
        if isinstance(record, dict):
            found[str(record["buffer"])] = record
    return found


def _graphs(program: ExportedProgram) -> Iterator[tuple[torch.fx.Graph, dict[str, torch.fx.Node]]]:
    """The top graph, then each delegate's graph, each with a map buffer name -> its cache node."""
    buffers = program.graph_signature.inputs_to_buffers
    nodes = {n.name: n for n in program.graph_module.graph.nodes}
    yield program.graph_module.graph, {b: nodes[p] for p, b in buffers.items() if p in nodes}
    for node, lowered in _delegate_calls(program):
        inner = lowered.original_module
        placeholders = {n.name: n for n in inner.graph.nodes if n.op == "placeholder"}
        caches = {}
        for position, name in enumerate(inner.graph_signature.user_inputs):
            outer = node.args[1 + position]
            if isinstance(outer, torch.fx.Node) and outer.name in buffers:
                caches[buffers[outer.name]] = placeholders[name]
        yield inner.graph, caches


def _writes_into(cache: torch.fx.Node) -> list[torch.fx.Node]:
    holders = [cache] + [u for u in cache.users if peeled_input(u) is cache and u.op != "placeholder"]
    return [u for h in holders for u in h.users if packet_name(u.target) in _WRITES and u.args and u.args[0] is h]


def _why_not_aliased(program: ExportedProgram, engine: AliasingEngine, buffer: str) -> str:
    for _, caches in list(_graphs(program))[1:]:
        cache = caches.get(buffer)
        if cache is None:
            continue
        for write in _writes_into(cache):
            refusal = engine.alias_refusal(engine_write(write, cache))
            return (
                f"its write {write.name} reached the engine, whose lowering refused it: "
                f"{refusal or 'no reason given (the engine and its rule disagree)'}"
            )
    size = getattr(engine, "min_block_size", 1)
    if size > 1:
        return (
            f"its write stayed outside the engine, most often because min_block_size "
            f"({size}) left the group of ops it landed in to ExecuTorch's kernels; "
            "min_block_size=1 rules that out"
        )
    return (
        "its write stayed outside the engine: its op, or an op next to it, was not "
        "offered to the engine (an exclusion, or an op the partitioner does not take)"
    )


def check_aliasing(program: ExportedProgram, engine: AliasingEngine, engines_built: bool = True) -> EngineAliasing:
    """Check the classes lift recorded on ``program``'s placeholders against the real aliasing.

    Both directions raise :class:`AliasMismatchError`, naming the buffers:
      1. a buffer predicted aliased that the engine did not alias (its write
         would be lost): the message names the likely cause;
      2. anything the engine aliased that was not predicted aliased — a
         copy-back buffer (the program would copy the engine's unwritten output
         over it every call) or a value that is no buffer at all.
    Skipped when ``engines_built`` is False (nothing was lowered, so every
    prediction would look unfulfilled) and for programs lifted in ``KEEP_ALL``
    mode, which predict nothing. Returns what the engine aliased.
    """
    actual = engine_aliasing(program, engine)
    classes = _classes(program)
    predicting = any(c.get("mode") == "predict" for c in classes.values())
    if not engines_built or not predicting:
        return actual
    predicted = {b for b, c in classes.items() if c["class"] == "aliased"}
    missing = sorted(predicted - actual.buffers)
    if missing:
        causes = "; ".join(f"{b!r}: {_why_not_aliased(program, engine, b)}" for b in missing)
        raise AliasMismatchError(
            f"engine {engine.name!r} did not write {missing} in place, as predicted, so their "
            f"write-back would be lost. {causes}"
        )
    extra = sorted(actual.buffers - predicted)
    if extra:
        marked = [b for b in extra if classes.get(b, {}).get("marked")]
        hint = (
            f" {marked} carry the no-alias marker, which the engine ignored."
            if marked
            else " Most often the cache is also read outside the engine (the classifier saw that "
            "reader, the engine's lowering does not), or the prediction and the lowering "
            "disagree about a clone of the cache (clones.peeled_input is the rule both use)."
        )
        raise AliasMismatchError(
            f"engine {engine.name!r} wrote {extra} in place, but they were filed copy-back: "
            "the engine leaves their copy-back value unwritten, so the program would copy it "
            f"over the buffer on every call.{hint}"
        )
    return actual


def _marked_writes(graphs: Iterable[torch.fx.Graph]) -> dict[str, list[torch.fx.Node]]:
    """Write nodes carrying a no-alias marker, by the buffer the marker names.

    Only write nodes count: exir copies a node's ``custom`` meta onto the
    ``getitem`` that carries a delegate output, which is harmless because the
    engine reads markers off write nodes alone.
    """
    found: dict[str, list[torch.fx.Node]] = {}
    for graph in graphs:
        for node in graph.nodes:
            value = meta.get_custom(node, meta.NO_ALIAS)
            if value is not None and packet_name(node.target) in _WRITES:
                found.setdefault(str(value), []).append(node)
    return found


def check_markers(program: ExportedProgram, expected: Iterable[str]) -> None:
    """Check that the no-alias markers lift set are where lowering left the writes, both ways.

    ``expected`` names the buffers whose write lift marked. After lowering,
    each such buffer's write (found by what it writes into, in the top graph or
    a delegate's graph, since node names change) must carry the marker, and no
    other write may. Raises :class:`MarkerFaultError` naming every fault: a
    marker **lost** (the write is there, or gone, and nothing carries its
    marker), **moved** (the write lost it and another write carries it), or
    **gained** (a write carries a marker lift did not put there).
    """
    graphs = list(_graphs(program))
    markers = _marked_writes(g for g, _ in graphs)
    writes: dict[str, list[torch.fx.Node]] = {}
    for _, caches in graphs:
        for buffer, cache in caches.items():
            writes.setdefault(buffer, []).extend(_writes_into(cache))
    faults = []
    wanted = set(expected)
    for buffer in sorted(wanted):
        own = writes.get(buffer, [])
        marked = markers.get(buffer, [])
        bare = [w.name for w in own if w not in marked]
        elsewhere = [n.name for n in marked if n not in own]
        if (bare or not own) and elsewhere:
            faults.append(f"moved: the marker of {buffer!r} is on {elsewhere}, not on its write {bare or '(gone)'}")
        elif bare or not own:
            faults.append(f"lost: the write of {buffer!r} ({bare or 'gone'}) no longer carries its no-alias marker")
        elif elsewhere:
            faults.append(f"gained: {elsewhere} carry the marker of {buffer!r} besides its write")
    for buffer in sorted(set(markers) - wanted):
        faults.append(
            f"gained: {[n.name for n in markers[buffer]]} carry a no-alias marker "
            f"for {buffer!r}, which lift never marked"
        )
    if faults:
        raise MarkerFaultError(
            "no-alias markers changed between classification and lowering (a pass rebuilt a "
            "node without its meta, or copied it onto another): " + "; ".join(faults)
        )

"""Lift every mutated buffer and classify its write: engine-aliased or copy-back."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument
from writeback_core import meta
from writeback_core.alias import AliasAnalysis
from writeback_core.mutations import Mutation, MutationKind, find_mutations
from writeback_core.types import AliasingEngine

from writeback_trt_copyback._program import out_spec_of, output_values, rebuild, user_out_spec
from writeback_trt_copyback.derive import engine_write, old_value_readers, write_node_of

__all__ = ["COPY_BACK_RECORDS", "BufferClass", "Lifted", "Mode", "lift_decomposed", "lift_mutated_buffers"]

# graph_module.meta key of a lifted program: the copy-back records (buffer, value,
# state) and the model's own output pytree. Written by lift, read by declare.
COPY_BACK_RECORDS = "writeback.copy_back"

DEAD_WRITE = (
    "dead write: nothing reads its result once the write-back is gone, so it is "
    "copied back instead, and marked so the engine leaves it alone"
)

RETURNED_ONLY_WRITE = (
    "returned only: the program returns its result and computes nothing on it, so once "
    "that output is the buffer itself nothing would use the engine's call and ExecuTorch "
    "would drop it with the write; it is copied back instead, and marked so the engine "
    "leaves it alone"
)


# Outputs whose value is cloned where computed when it may view a written input (_detached).
_DETACHED_OUTPUTS = (OutputKind.USER_OUTPUT, OutputKind.USER_INPUT_MUTATION)


class Mode(enum.Enum):
    """``PREDICT`` decides each buffer before lowering and cross-checks after; ``KEEP_ALL``
    keeps every buffer's copy-back value until the engine's ``aliased_io`` settles it."""

    PREDICT = "predict"
    KEEP_ALL = "keep-all"


@dataclass(frozen=True)
class BufferClass:
    """How one mutated buffer is written back.

    ``aliased`` is the prediction: the engine writes the buffer in place. Otherwise
    ``reason`` says why it is copied back; ``marked`` when the write carries
    ``meta.NO_ALIAS``; ``read_before_write`` when its old value is read (so its
    initial value matters); ``nbytes`` the whole buffer, what copy-back costs.
    """

    target: str
    placeholder: str
    value: str
    write: str
    aliased: bool
    reason: str | None
    marked: bool
    read_before_write: bool
    nbytes: int | None

    def to_meta(self, mode: Mode) -> dict[str, object]:
        """The record kept under ``meta.COPY_BACK_CLASS`` on the buffer's placeholder."""
        return {
            "buffer": self.target,
            "class": "aliased" if self.aliased else "copy-back",
            "reason": self.reason,
            "marked": self.marked,
            "mode": mode.value,
            "read_before_write": self.read_before_write,
        }


@dataclass(frozen=True)
class Lifted:
    """A lifted program and the class of each of its mutated buffers."""

    program: ExportedProgram
    buffers: tuple[BufferClass, ...]
    mode: Mode

    @property
    def aliased(self) -> list[str]:
        """Buffers predicted to be written in place by the engine."""
        return [b.target for b in self.buffers if b.aliased]

    @property
    def copy_back(self) -> list[str]:
        """Buffers whose new value is copied back by the program."""
        return [b.target for b in self.buffers if not b.aliased]


def _copy_chain(value: torch.fx.Node, write: torch.fx.Node | None) -> list[torch.fx.Node]:
    """``value`` and the copies between it and the write node (core peels the same ones)."""
    chain = [value]
    node = value
    while write is not None and node is not write and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
        chain.append(node)
    return chain


def _live_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes the graph's output depends on: all that survive the lowering.

    exir erases graph assertions (``_assert_tensor_metadata`` that ``.to()``
    leaves on a tensor, ``_assert_scalar``) and then every node nothing reads,
    so a node the output does not depend on never reaches an engine, whatever
    reads it in the exported graph.
    """
    live: set[torch.fx.Node] = set()
    frontier = [graph.output_node()]
    while frontier:
        node = frontier.pop()
        if node not in live:
            live.add(node)
            frontier.extend(node.all_input_nodes)
    return live


def _unread(value: torch.fx.Node, write: torch.fx.Node | None, live: set[torch.fx.Node]) -> str | None:
    """Why an aliased write could never happen, or ``None`` when something computes on its result.

    Only readers in ``live`` (:func:`_live_nodes`) count: an assertion on the
    result is erased by the lowering, and the write with it.
    :data:`DEAD_WRITE`: nothing live but the (erased) write-back reads the
    result, so dead-code elimination takes the write before any engine sees it
    (``self.s2[:, :, i] = v`` followed by an unused ``self.s2.to(torch.float32)``,
    whose only trace is an assertion on the written cache: found by the fuzzer).
    :data:`RETURNED_ONLY_WRITE`: only the graph's output reads it (the model
    returns the cache it wrote); aliasing would point that output at the buffer,
    leaving the engine's call, and the write in it, unused (found by the fuzzer:
    ``tests/trt_copyback/test_fuzz_target.py``).
    """
    chain = _copy_chain(value, write)
    for later, node in itertools.pairwise(chain):
        if any(u is not later and u in live for u in node.users):
            return None
    readers = [u for u in value.users if u in live]
    if any(u.op != "output" for u in readers):
        return None
    return RETURNED_ONLY_WRITE if readers else DEAD_WRITE


def _detached(
    value: torch.fx.Node, analysis: AliasAnalysis, inputs: list[torch.fx.Node], clones: dict[str, torch.fx.Node]
) -> torch.fx.Node:
    """``value``, or a clone of it when it may share storage with one of ``inputs``.

    A value leaving the graph (an output or a copy-back value) that is a view
    of a written input (``s1.copy_(s0[0:1])`` before ``s0.add_(...)`` leaves
    s1's new value a view of the old s0; ``t = s0.view(-1)`` before
    ``s0.copy_(s1)`` leaves the output ``t`` a view of the old s1) is right in
    this graph, but ``to_edge`` decomposes the program again by running it with
    each write-back applied before it returns: the view then shows the
    written input's new values (found by the fuzzer, both ways). An engine
    writing that input in place would do the same at run time. A clone taken
    where the value is computed keeps the old values through any retrace.
    A user output is checked against the written inputs only (a view of an
    input nothing writes keeps its values); a write-back value against every
    input, so no write-back is ever a view of another input. ``clones`` holds
    one clone per value, so an output that is also a copy-back value is
    copied once.
    """
    if not any(analysis.may_alias(value, p) for p in inputs):
        return value
    if value.name in clones:
        return clones[value.name]
    with value.graph.inserting_after(value):
        clone = value.graph.call_function(torch.ops.aten.clone.default, (value,))
    for key in ("val", "tensor_meta", "stack_trace", "nn_module_stack"):
        if key in value.meta:
            clone.meta[key] = value.meta[key]
    clones[value.name] = clone
    return clone


def _classify(
    mutation: Mutation,
    by_name: dict[str, torch.fx.Node],
    engine: AliasingEngine,
    mode: Mode,
    live: set[torch.fx.Node],
) -> tuple[BufferClass, torch.fx.Node | None]:
    placeholder, value = by_name[mutation.placeholder], by_name[mutation.value]
    write = engine_write(value, placeholder)
    node = write_node_of(write.write, value.graph)
    refusal = engine.alias_refusal(write)
    marked = False
    unread = _unread(value, node, live) if refusal is None and mode is Mode.PREDICT else None
    if unread is not None:
        refusal, marked = unread, True
    cls = BufferClass(
        target=mutation.target,
        placeholder=placeholder.name,
        value=value.name,
        write=mutation.write.describe(),
        aliased=refusal is None,
        reason=refusal,
        marked=marked,
        read_before_write=bool(old_value_readers(placeholder, node)),
        nbytes=mutation.nbytes,
    )
    return cls, node


def lift_mutated_buffers(program: ExportedProgram, engine: AliasingEngine, mode: Mode = Mode.PREDICT) -> Lifted:
    """Lift the buffer mutations of ``program`` off its outputs and classify each write.

    Algorithm:
      1. Decompose a copy of ``program`` (``run_decompositions``; the caller's
         program is not touched) and find its buffer mutations (core's model).
      2. Drop every ``BUFFER_MUTATION`` output: the write-back is erased, the
         write stays in the graph for whatever reads its result.
      3. Ask ``engine.alias_refusal`` about each write, derived by
         ``derive.engine_write`` as the engine's lowering derives it.
         ``PREDICT``: an accepted write is aliased, unless nothing reads its
         result (it would be dead code, and the engine could never alias it) or
         only the graph's output does (the engine's call would be left unused):
         that one is copied back and its write node gets ``meta.NO_ALIAS``.
         ``KEEP_ALL``: every buffer is kept for copy-back; the engine settles it.
      4. Append each copy-back value as a trailing output (a clone of it when it
         may be a view of an input: :func:`_detached`; user-input mutations get
         the same, and user outputs that may view an input some write-back
         changes), record
         ``{buffer, value, state}`` in ``graph_module.meta[COPY_BACK_RECORDS]``
         for :func:`~writeback_trt_copyback.declare.declare_copy_back`, and record
         each buffer's class under ``meta.COPY_BACK_CLASS`` on its placeholder and
         on the node performing its write (the engine aliases no other write).

    The result returns the trailing values as extra user outputs until declared.
    User-input mutations are left as they are. Nested buffers keep their fully
    qualified names (``layers.0.attn.k_cache``) throughout.
    """
    return lift_decomposed(program.run_decompositions(), engine, mode)


def lift_decomposed(lifted: ExportedProgram, engine: AliasingEngine, mode: Mode = Mode.PREDICT) -> Lifted:
    """:func:`lift_mutated_buffers` of a program already decomposed to core ATen
    (``run_decompositions()``), which it changes: hand it a copy
    (:func:`writeback_core.program_passes.graphs_copy` of ``writeback_core.program_passes.decomposed``,
    as ``writeback explain``'s column does)."""
    found = find_mutations(lifted)
    mutations = [m for m in found if m.kind is MutationKind.BUFFER]
    module = lifted.graph_module
    graph = module.graph
    specs = list(lifted.graph_signature.output_specs)
    kept = [
        (v, s) for v, s in zip(output_values(module), specs, strict=True) if s.kind is not OutputKind.BUFFER_MUTATION
    ]
    old = graph.output_node()
    with graph.inserting_before(old):
        graph.output(tuple(v for v, _ in kept))
    graph.erase_node(old)
    by_name = {n.name: n for n in graph.nodes}
    live = _live_nodes(graph)
    classes = [_classify(m, by_name, engine, mode, live) for m in mutations]
    analysis = AliasAnalysis(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    written = [by_name[m.placeholder] for m in found]
    clones: dict[str, torch.fx.Node] = {}
    for i, (value, spec) in enumerate(kept):
        if not isinstance(value, torch.fx.Node) or spec.kind not in _DETACHED_OUTPUTS:
            continue
        inputs = written if spec.kind is OutputKind.USER_OUTPUT else placeholders
        detached = _detached(value, analysis, inputs, clones)
        if detached is not value:
            kept[i] = (detached, OutputSpec(spec.kind, TensorArgument(detached.name), spec.target))
    records: list[dict[str, str]] = []
    for cls, write_node in classes:
        meta.set_custom(by_name[cls.placeholder], meta.COPY_BACK_CLASS, cls.to_meta(mode))
        if write_node is not None and write_node.op != "placeholder":
            # The engine writes in place only a write that is some buffer's new value
            # (lowering._in_place_step): a functional write of a buffer is not one.
            meta.set_custom(write_node, meta.COPY_BACK_CLASS, cls.to_meta(mode))
        if write_node is not None and cls.marked:
            meta.set_custom(write_node, meta.NO_ALIAS, cls.target)
        if not cls.aliased or mode is Mode.KEEP_ALL:
            value = _detached(by_name[cls.value], analysis, placeholders, clones)
            kept.append((value, OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(value.name), None)))
            records.append({"buffer": cls.target, "value": value.name, "state": "pending"})
    model_out_spec = out_spec_of(lifted)
    result = rebuild(
        lifted,
        module,
        [v for v, _ in kept],
        [s for _, s in kept],
        out_spec=user_out_spec(model_out_spec, len(records)),
        meta={COPY_BACK_RECORDS: {"records": records, "out_spec": model_out_spec}},
    )
    return Lifted(result, tuple(c for c, _ in classes), mode)

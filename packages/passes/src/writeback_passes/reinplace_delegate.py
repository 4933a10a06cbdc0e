"""Drop the write-back of state (a user input or a buffer) that its delegate writes in place.

After ``to_executorch`` inserts write-backs, state ``P`` mutated inside a
delegate is written back by ``copy_(P, getitem(delegate, j))`` (often through
functional ``aten.copy(P, ...)`` nodes): the whole tensor is copied every call.
When the backend accepted that mutation (core's per-mutation decision recorded
on ``P``), the delegate can write ``P``'s memory itself, so the copy goes,
and the delegate call stays in the program even when that copy was its only
reader.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.delegate import executorch_call_delegate
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from writeback_core import ProgramPass, meta
from writeback_core.blob import encode_in_place_outputs, in_place_outputs
from writeback_core.ops import packet_name, write_back_copies
from writeback_core.registry import InPlaceDecision

from writeback_passes.backend_names import XNNPACK_BACKEND_ID
from writeback_passes.early_write_back import user_input_test
from writeback_passes.graph import views_of

__all__ = [
    "IN_PLACE_OUTPUTS_SPEC",
    "DroppedWriteBack",
    "KeptWriteBack",
    "ReinplaceReport",
    "reinplace_delegate_input_mutations",
    "reinplace_delegate_pass",
]

# The compile-spec key this pass adds (its meaning is documented in core).
IN_PLACE_OUTPUTS_SPEC = meta.IN_PLACE_OUTPUTS_SPEC


@dataclass(frozen=True)
class DroppedWriteBack:
    """A write-back removed: ``delegate`` now writes ``placeholder`` (its argument ``input``)."""

    placeholder: str
    delegate: str
    output: int
    input: int


@dataclass(frozen=True)
class KeptWriteBack:
    """A write-back of an accepted mutation that had to stay, and why."""

    placeholder: str
    reason: str


@dataclass
class ReinplaceReport:
    """What :func:`reinplace_delegate_input_mutations` did to one graph."""

    dropped: list[DroppedWriteBack] = field(default_factory=list)
    kept: list[KeptWriteBack] = field(default_factory=list)


def _is_packet(node: torch.fx.Node, name: str) -> bool:
    return node.op == "call_function" and packet_name(node.target) == name


def _peel_copies(value: object, placeholder: torch.fx.Node) -> tuple[object, list[torch.fx.Node]]:
    """Follow functional ``aten.copy(placeholder, x)`` nodes down to the value written."""
    chain: list[torch.fx.Node] = []
    while isinstance(value, torch.fx.Node) and _is_packet(value, "copy") and value.args[0] is placeholder:
        chain.append(value)
        value = value.args[1]
    return value, chain


def _delegate_output(value: object) -> tuple[torch.fx.Node, int] | None:
    if (
        isinstance(value, torch.fx.Node)
        and value.target is operator.getitem
        and isinstance(value.args[0], torch.fx.Node)
        and value.args[0].target is executorch_call_delegate
        and isinstance(value.args[1], int)
    ):
        return value.args[0], value.args[1]
    return None


def _check(
    graph_nodes: list[torch.fx.Node],
    copy: torch.fx.Node,
    placeholder: torch.fx.Node,
    call: torch.fx.Node,
    value: torch.fx.Node,
    skip: Iterable[torch.fx.Node],
    user_input: bool,
) -> str | None:
    """Why dropping ``copy`` would be wrong, or ``None`` when it is safe."""
    aliases = views_of(placeholder)
    args = list(call.args[1:])
    if args.count(placeholder) != 1:
        return f"{placeholder.name!r} is passed to the delegate {args.count(placeholder)} times"
    twice = [a.name for a in args if isinstance(a, torch.fx.Node) and a in aliases and a is not placeholder]
    if twice:
        return (
            f"an alias of {placeholder.name!r} ({', '.join(twice)}) is also passed to the "
            "delegate; writing in place would change that argument while it is read"
        )
    if not copy.users and not _other_results_used(call, value):
        return (
            f"the write-back of {placeholder.name!r} is the delegate's last used result "
            "and the program does not return it: nothing would keep the delegate call"
        )
    returned = copy.graph.output_node().all_input_nodes
    if not user_input and any(n in returned for n in (value, *skip)):
        return (
            f"the program also returns the new value of buffer {placeholder.name!r}: "
            "returning the buffer itself would make it a graph output, which unplanned "
            "outputs leave without a planned slot (exir then emits it as constant data)"
        )
    position = {n: i for i, n in enumerate(graph_nodes)}
    ignored = set(skip) | {copy} | {u for u in call.users if u.target is operator.getitem}
    for node in graph_nodes[position[call] + 1 : position[copy]]:
        if node in ignored:
            continue
        read = [a.name for a in node.all_input_nodes if a in aliases]
        if read:
            return (
                f"{node.name!r} reads {', '.join(read)} between the delegate and the "
                "write-back; it expects the old value"
            )
    return None


# The metadata that makes exir's passes (and a rerun of this one) see the
# ``getitem((P, out_j), 0)`` node as ``P`` itself.
_SAME_AS_PLACEHOLDER = ("val", "tensor_meta", "spec")


def _other_results_used(call: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether a result of ``call`` other than ``value`` is still read."""
    return any(u.users for u in call.users if u is not value)


def _returned_in_place_of_copy(
    graph: torch.fx.Graph,
    placeholder: torch.fx.Node,
    value: torch.fx.Node,
    call: torch.fx.Node,
    user_input: bool,
) -> torch.fx.Node:
    """What the output returns where it returned the dropped write-back ``copy_``.

    exir's dead-code elimination keeps a call only while one of its results is
    read (``executorch_call_delegate`` is a pure higher-order op to
    ``Node.is_impure``), so the delegate's now unread result ``value`` must
    stay reachable from the output when nothing else reads the call:

    * a mutable buffer: the output returns ``value`` itself. exir drops buffer
      outputs before emitting, so it costs nothing; and returning the buffer
      placeholder instead would make the buffer a graph output, which with
      unplanned outputs (``alloc_graph_output=False``) loses its planned slot
      and is emitted as constant data.
    * a user input: the method must return the input itself (the caller reads
      the new state there), so the output returns ``getitem((placeholder,
      value), 0)``: to exir's passes, its planner and its emitter that *is*
      ``placeholder`` (same spec, same value, no instruction), and it keeps
      ``value``, hence the call, alive. When another result of the call is
      still read, the output returns ``placeholder`` directly.
    """
    if not user_input:
        return value
    if _other_results_used(call, value):
        return placeholder
    with graph.inserting_after(value):
        after = graph.call_function(operator.getitem, ((placeholder, value), 0))
    after.meta.update({k: v for k, v in placeholder.meta.items() if k in _SAME_AS_PLACEHOLDER})
    return after


def _results(call: torch.fx.Node, gm: torch.fx.GraphModule) -> list[object]:
    """The values ``call`` returns now, in order.

    exir removes the outputs of buffers the delegate owns from the call (and
    renumbers its ``getitem`` users) but leaves the call's ``val`` as it was, so
    the lowered program says what the call returns: its outputs that are not
    buffer mutations.
    """
    lowered = getattr(gm, str(call.args[0].target))  # type: ignore[union-attr]  # args[0] is a get_attr node
    program: ExportedProgram = lowered.original_module
    found = program.graph.output_node().args[0]
    outputs = list(found) if isinstance(found, (list, tuple)) else [found]
    specs = program.graph_signature.output_specs
    return [
        out.meta.get("val") if isinstance(out, torch.fx.Node) else out
        for out, spec in zip(outputs, specs, strict=True)
        if spec.kind is not OutputKind.BUFFER_MUTATION
    ]


def _release_output(call: torch.fx.Node, gm: torch.fx.GraphModule, output: int) -> None:
    """Give the now unread delegate output ``output`` an empty tensor spec.

    exir keeps a delegate call's ``spec`` through its later passes, so the
    planner reserves nothing for an output the delegate no longer writes.
    """
    from executorch.exir.tensor import TensorSpec

    vals = _results(call, gm)
    specs = call.meta.get("spec")
    if specs is None:
        specs = [TensorSpec.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in vals]
    specs = list(specs)
    released = vals[output]
    assert isinstance(released, torch.Tensor)
    specs[output] = TensorSpec.from_tensor(torch.empty(0, dtype=released.dtype))
    call.meta["spec"] = tuple(specs)


def _record(call: torch.fx.Node, gm: torch.fx.GraphModule, output: int, input_index: int) -> None:
    lowered = getattr(gm, str(call.args[0].target))  # type: ignore[union-attr]  # args[0] is a get_attr node
    specs: list[CompileSpec] = lowered.compile_specs
    n_outputs = len(_results(call, gm))
    # Read back what earlier drops recorded with the one parser of the spec, then re-encode.
    pairs = [
        (entry.output, entry.input)
        for entry in in_place_outputs(
            {s.key: bytes(s.value) for s in specs}, lowered.backend_id, len(call.args) - 1, n_outputs
        )
    ]
    specs[:] = [s for s in specs if s.key != IN_PLACE_OUTPUTS_SPEC]
    specs.append(CompileSpec(IN_PLACE_OUTPUTS_SPEC, encode_in_place_outputs([*pairs, (output, input_index)])))


def reinplace_delegate_input_mutations(
    program: ExportedProgram | torch.fx.GraphModule,
) -> ReinplaceReport:
    """Drop write-backs of user inputs whose delegate accepted to write them in place.

    Runs after exir inserted its write-backs (``to_executorch``'s
    ``before_memory_planning`` stage). Algorithm, per ``copy_(P, value)`` where
    ``P`` is a placeholder:

    1. Skip unless ``P`` carries an in-place decision that was accepted
       (``writeback_core.InPlaceDecision``; backends that did not accept are
       untouched).
    2. Peel functional ``aten.copy(P, x)`` nodes off ``value``; what remains
       must be output ``j`` of an ``executorch_call_delegate``.
    3. Refuse (keep the copy, report why) when ``P`` is not passed to that
       delegate exactly once, when an alias of ``P`` is passed to it as another
       argument, when any node between the delegate and the copy reads ``P``
       or an alias of it (it expects the old value), when ``P`` is a buffer
       whose new value the program also returns (a buffer returned as a graph
       output loses its planned slot under unplanned outputs), or when the
       copy is the delegate's last used result and the program does not
       return it (nothing would keep the call).
    4. Otherwise point the other readers of output ``j`` at ``P``, and make
       the output return, where it returned the copy: for a buffer, output
       ``j`` itself (exir drops buffer outputs before emitting); for a user
       input, ``P`` — as ``getitem((P, out_j), 0)`` when nothing else reads
       the delegate, which emits as ``P`` but keeps the call reachable, since
       exir's dead-code elimination deletes a delegate call none of whose
       results is read, and with it the in-place write. Erase the copy and
       the peeled nodes, and record ``{"output": j, "input": i}`` in the
       lowered module's compile spec :data:`IN_PLACE_OUTPUTS_SPEC`, so the
       runtime delegate writes argument ``i`` in place. Output ``j`` stays in
       the delegate's signature (exir retraces it from the lowered program)
       and gets an empty tensor spec, so the memory plan reserves nothing for
       it. (Sharing ``P``'s spec instead is not possible here: exir makes new
       placeholder specs after this stage.)

    Example it must refuse::

        out = delegate(cache, x)      # writes cache in place if allowed
        y = cache.sum()               # reads the OLD cache
        cache.copy_(out[0])           # the write-back

    :return: the write-backs dropped and the accepted ones kept, with reasons.
    """
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    graph = gm.graph
    is_user_input = user_input_test(graph, program)
    report = ReinplaceReport()
    for copy in write_back_copies(graph):
        placeholder = copy.args[0]
        assert isinstance(placeholder, torch.fx.Node)
        decision = InPlaceDecision.from_node(placeholder)
        if decision is None or not decision.accepted:
            continue
        value, chain = _peel_copies(copy.args[1], placeholder)
        found = _delegate_output(value)
        if found is None:
            report.kept.append(KeptWriteBack(placeholder.name, "the value written back is not a delegate output"))
            continue
        call, output = found
        if getattr(getattr(gm, str(call.args[0].target), None), "backend_id", None) == XNNPACK_BACKEND_ID:  # type: ignore[union-attr]  # args[0] is a get_attr node
            # ExecuTorch's XNNPACK runtime reads no compile spec of ours: whole_state_writes
            # plans its result onto the state's memory instead, after exir's specs exist.
            continue
        assert isinstance(value, torch.fx.Node)
        user_input = is_user_input(placeholder)
        reason = _check(list(graph.nodes), copy, placeholder, call, value, chain, user_input)
        if reason is not None:
            report.kept.append(KeptWriteBack(placeholder.name, reason))
            continue
        input_index = list(call.args[1:]).index(placeholder)
        returned = _returned_in_place_of_copy(graph, placeholder, value, call, user_input)
        for reader in list(value.users):
            if reader is not returned:
                reader.replace_input_with(value, placeholder)
        copy.replace_all_uses_with(returned)
        graph.erase_node(copy)
        for node in chain:
            if not node.users:
                graph.erase_node(node)
        if not value.users:
            graph.erase_node(value)
        _record(call, gm, output, input_index)
        _release_output(call, gm, output)
        report.dropped.append(DroppedWriteBack(placeholder.name, call.name, output, input_index))
    if report.dropped:
        graph.lint()
        gm.recompile()
    return report


def reinplace_delegate_pass() -> ProgramPass:
    """This pass as a ``"before_memory_planning"`` :class:`~writeback_core.ProgramPass`. The
    passes that need the write-backs that remain (``reinplace_state_writes``,
    ``insert_write_back_early``) say they run after it."""

    def run(gm: torch.fx.GraphModule) -> None:
        reinplace_delegate_input_mutations(gm)

    return ProgramPass(
        name="reinplace_delegate_input_mutations",
        stage="before_memory_planning",
        run=run,
        reason="no write-back where a delegate writes the state in place",
    )

"""When an XNNPACK delegate may write a state's new value straight into the state's memory.

A state rewritten whole inside an XNNPACK partition (an SSM update ``h = a*h + b*x``, a
shift register, a DeltaNet state, a counter) reaches the program as
``copy_(P, getitem(executorch_call_delegate(lowered, ..., P, ...), j))``: the delegate
computes the new value into output ``j`` and the copy moves it into ``P``. XNNPACK writes its
outputs through the pointers the runtime hands it and runs its operators one after another,
each over whole tensors, in the order of the delegated graph. So output ``j`` may be planned
onto ``P``'s own memory (the delegate then writes the state, and the copy is a self-copy to
drop) exactly when nothing reads the old value of ``P`` once the operator producing output
``j`` starts writing it.

:func:`delegate_output_refusal` checks that, and says in the model's terms why not:

1. ``P`` is a buffer of the program (a caller's input is not in its memory plan), passed to
   the delegate at most once and with no view of it passed beside it; output ``j`` has
   ``P``'s shape, dtype and strides and is not also returned by the program.
2. No node of the program between the delegate call and the write-back reads ``P`` (it
   expects the old value); metadata-only nodes read no value.
3. Inside the delegated graph, output ``j`` is computed by an operator (the *writer*). XNNPACK
   fuses a clamp or a reshape into the operator that produces its input, so the writer is
   found by walking back from the output through those (:data:`FUSED_INTO_PRODUCER`). The
   writer reads ``P`` at most as an elementwise operand of exactly its output's shape
   (element ``i`` is read before element ``i`` is written, and no other), never through a
   view; the operators fused after it do not read ``P``.
4. No operator of the delegated graph that runs after the writer reads ``P`` or a view of it.

Example it must refuse (the old state read after the new one is written)::

    new = add(mul(h, 0.5), x)      # delegate output j, written into h
    old = sum(h, 0)                # runs after add in the delegate: would read the new h
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx
from executorch.exir.delegate import executorch_call_delegate
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from writeback_core import meta
from writeback_core.ops import aten_op, source_of

from writeback_passes.graph import StorageAliases, reads_no_value, tensor_value, views_of

__all__ = [
    "FUSED_INTO_PRODUCER",
    "XNNPACK_ELEMENTWISE",
    "delegate_output_refusal",
    "delegate_writer",
    "is_delegate_output",
]

# Ops XNNPACK may fuse into the operator that produces their input (an output clamp, a
# reshape or copy eliding to the producer's buffer): the producer then writes the output.
FUSED_INTO_PRODUCER = frozenset(
    {
        "clamp",
        "hardtanh",
        "relu",
        "view_copy",
        "squeeze_copy",
        "unsqueeze_copy",
        "clone",
        "_clone_dim_order",
        "_to_copy",
        "_to_dim_order_copy",
    }
)

# XNNPACK operators whose output element i is computed from element i of each operand of the
# output's shape alone (broadcast operands aside): one of them may write over such an operand.
XNNPACK_ELEMENTWISE = frozenset(
    {
        "abs",
        "add",
        "clamp",
        "div",
        "exp",
        "hardtanh",
        "maximum",
        "minimum",
        "mul",
        "neg",
        "pow",
        "relu",
        "rsqrt",
        "sigmoid",
        "sqrt",
        "sub",
        "tanh",
    }
)


def delegate_writer(call: torch.fx.Node, output: int) -> tuple[ExportedProgram, torch.fx.Node] | None:
    """The delegated program of ``call`` and the node of it that computes its result
    ``output`` (``None`` when the call holds no lowered program or that result is an input)."""
    program = getattr(_lowered(call), "original_module", None)
    if not isinstance(program, ExportedProgram):
        return None
    found = program.graph.output_node().args[0]
    outputs = list(found) if isinstance(found, (list, tuple)) else [found]
    results = [
        out
        for out, spec in zip(outputs, program.graph_signature.output_specs, strict=True)
        if spec.kind is not OutputKind.BUFFER_MUTATION
    ]
    node = results[output] if output < len(results) else None
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    return program, node


def delegate_output_refusal(state: torch.fx.Node, new: torch.fx.Node, copy: torch.fx.Node) -> str | None:
    """Why output ``new`` (``getitem(call, j)``) of an XNNPACK delegate call may not be planned
    onto ``state``'s memory, in the model's terms, or ``None`` when it may (module docstring)."""
    call = new.args[0]
    output = new.args[1]
    assert isinstance(call, torch.fx.Node) and isinstance(output, int)
    if meta.get_custom(state, meta.USER_INPUT):
        return "the state is the caller's input, which the program's memory plan does not hold"
    have, want = tensor_value(new), tensor_value(state)
    if (
        have is None
        or want is None
        or (have.shape, have.dtype, have.stride())
        != (
            want.shape,
            want.dtype,
            want.stride(),
        )
    ):
        return "the delegate's result differs from the state in shape, dtype or layout"
    if any(n in new.graph.output_node().all_input_nodes for n in views_of(new)):
        return "the program also returns the new value, which must not share the state's memory"
    reason = _program_refusal(state, call, copy)
    if reason is not None:
        return reason
    found = delegate_writer(call, output)
    if found is None:
        return "the delegate passes the value through unchanged or holds no graph to check"
    program, produced = found
    try:
        inside = _inner_state(program, call, state)
    except _Unmatched as unmatched:
        return f"{unmatched}; which of them is the state cannot be told"
    if inside is None:
        return None  # the delegate never reads the state: nothing can see it change
    return _inner_refusal(program, produced, inside)


def _program_refusal(state: torch.fx.Node, call: torch.fx.Node, copy: torch.fx.Node) -> str | None:
    """Rules 1 and 2 on the program around the call."""
    aliases = views_of(state)
    args = list(call.args[1:])
    if args.count(state) > 1:
        return f"the state is passed to the delegate {args.count(state)} times"
    views = [a for a in args if isinstance(a, torch.fx.Node) and a in aliases and a is not state]
    if views:
        return (
            f"a view of the state ({source_of(views[0])}) is passed to the delegate beside it; "
            "writing the state would change that argument while it is read"
        )
    nodes = list(call.graph.nodes)
    for node in nodes[nodes.index(call) + 1 : nodes.index(copy)]:
        if node is copy or node.op == "output" or reads_no_value(node) or node in aliases:
            continue
        read = next((a for a in node.all_input_nodes if a in aliases), None)
        if read is not None:
            return (
                f"{_reader_source(node, read)} reads the old value after the delegate computes the "
                "new one; writing it in place would change what it reads"
            )
    return None


def _reader_source(node: torch.fx.Node, read: torch.fx.Node) -> str:
    """Where the model reads ``read`` in ``node``: for another delegate call, the first
    operator of its delegated graph that reads that argument (the call has no source line)."""
    if node.target is executorch_call_delegate:
        program = getattr(_lowered(node), "original_module", None)
        if isinstance(program, ExportedProgram):
            with contextlib.suppress(_Unmatched):
                inside = _inner_state(program, node, read)
                if inside is not None and inside.users:
                    return source_of(next(iter(inside.users)))
    return source_of(node)


def _inner_state(program: ExportedProgram, call: torch.fx.Node, state: torch.fx.Node) -> torch.fx.Node | None:
    """The placeholder of the delegated program that receives ``state``: the call passes one
    argument per user input of that program, in order (the weights it owns are not passed)."""
    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind is InputKind.USER_INPUT]
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    args = list(call.args[1:])
    if len(names) != len(args) or any(name not in placeholders for name in names):
        raise _Unmatched(len(names), len(args))
    return next((placeholders[n] for n, a in zip(names, args, strict=True) if a is state), None)


class _Unmatched(Exception):
    """The delegate call's arguments do not match its program's placeholders one to one."""

    def __init__(self, placeholders: int, args: int) -> None:
        super().__init__(f"the delegated graph has {placeholders} user inputs where the call passes {args}")


def _inner_refusal(program: ExportedProgram, produced: torch.fx.Node, inside: torch.fx.Node) -> str | None:
    """Rules 3 and 4 inside the delegated graph, ``inside`` being the state's placeholder."""
    storage = StorageAliases(program.graph)
    aliases = storage.members(inside)
    fused = [produced]
    while _op_name(fused[-1].target) in FUSED_INTO_PRODUCER:
        source = fused[-1].args[0] if fused[-1].args else None
        if not isinstance(source, torch.fx.Node) or source.op != "call_function" or source in aliases:
            break
        fused.append(source)
    writer = fused[-1]
    where = source_of(produced)
    for node in fused[:-1]:
        if any(a in aliases for a in node.all_input_nodes):
            return f"the operator writing it ({where}) reads the state through a view or copy of it"
    if any(a in aliases for a in writer.all_input_nodes) and not _elementwise_read(writer, inside, aliases):
        return (
            f"the operator computing it ({source_of(writer)}, {_op_name(writer.target)}) reads the "
            "state in another element order (a shift, a reduction, a broadcast or a view); writing its "
            "output into the state would overwrite elements it has yet to read"
        )
    nodes = list(program.graph.nodes)
    for node in nodes[nodes.index(writer) + 1 :]:
        if node in fused or node.op != "call_function" or reads_no_value(node):
            continue
        if any(a in aliases for a in node.all_input_nodes):
            return (
                f"{source_of(node)} reads the old value inside the delegate after the operator "
                f"computing the new one ({where}) writes it"
            )
    return None


def _elementwise_read(writer: torch.fx.Node, inside: torch.fx.Node, aliases: frozenset[torch.fx.Node]) -> bool:
    """Whether ``writer`` reads the state only directly, as an elementwise operand of exactly
    its output's shape and layout."""
    if _op_name(writer.target) not in XNNPACK_ELEMENTWISE:
        return False
    if any(a in aliases and a is not inside for a in writer.all_input_nodes):
        return False
    out, val = tensor_value(writer), tensor_value(inside)
    return (
        out is not None
        and val is not None
        and out.shape == val.shape
        and out.stride() == val.stride()
        and inside not in writer.kwargs.values()
    )


def _op_name(target: object) -> str | None:
    """``"mul"`` for ``aten.mul.Tensor``, ``"_clone_dim_order"`` for exir's dim-order clone (any
    namespace: the delegated graph holds both), ``None`` for what is no op overload."""
    op = aten_op(target)
    return str(op._opname) if isinstance(op, torch._ops.OpOverload) else None


def _lowered(call: torch.fx.Node) -> object | None:
    module = call.args[0] if call.args else None
    if not isinstance(module, torch.fx.Node) or module.op != "get_attr":
        return None
    return getattr(module.graph.owning_module, str(module.target), None)


def is_delegate_output(node: object) -> bool:
    """Whether ``node`` is ``getitem(executorch_call_delegate(...), j)``."""
    return (
        isinstance(node, torch.fx.Node)
        and node.target is operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].target is executorch_call_delegate
        and isinstance(node.args[1], int)
    )

"""Write a state the model rewrites whole every call into the state's own memory, once.

A shift register (``state.copy_(cat([state, x], -1)[..., -n:])``), an SSM update
(``h.copy_(a * h + b * x)``), a DeltaNet-style state (``S.copy_(S * g + k.T @ d)``) or a
counter (``n.copy_(n + 1)``) reaches exir as ``new = op(...)`` followed by the write-back
``copy_(P, new)``: the kernel computes the new value into a temporary and the copy moves
the whole state again, every call. After exir's out-variant pass the op is
``op.out(..., out=alloc)``; this pass hands it ``out=P`` instead, and drops the copy and
the temporary: the kernel that computes the new value writes it into the state.

Algorithm, per write-back ``copy_(P, new)`` whose state was accepted in place (core's
decision on ``P``):

1. ``new`` must be computed by an out-variant kernel of the stock runtime writing one
   output (``out=alloc``) of ``P``'s shape and dtype, or be a result of an XNNPACK delegate
   (step 5). Another delegate's result, a view, an op with several outputs: keep the copy,
   say why.
2. No node that runs after ``new``'s kernel may read the old value of ``P`` (through ``P``
   or a view of it); metadata-only nodes (``sym_size``, ``_assert_tensor_metadata``, ...)
   read no value and do not count.
3. ``new``'s kernel itself may read ``P`` only as an elementwise operand of exactly the
   output's shape, or as the base a scatter (``slice_scatter``, ``index_put``, ...) writes
   over: element ``i`` of the output is then computed from element ``i`` of ``P`` alone,
   read before it is written, so writing into ``P`` is exact. Any other read
   (a shifted slice, a reduction, a broadcast operand, a matmul) may read an element the
   kernel has already overwritten: keep the copy.
4. Otherwise set ``out=P``, erase the ``alloc``, point the copy's users at ``new`` and
   erase the copy.
5. A result of an XNNPACK delegate: where
   :func:`~writeback_passes.delegate_state_outputs.delegate_output_refusal` finds nothing
   against it (no operator reads the old state once the new one is written), give the
   delegate's result ``P``'s ``TensorSpec``: memory planning and the emitter then make it
   the state's own value, so XNNPACK writes the state, and the copy (now of ``P`` onto
   itself) is erased. Otherwise keep the copy and say why.

Example it must refuse (a shift register written from the state itself)::

    shifted = cat.out([slice_copy(P, -1, 1), x], -1, out=alloc)   # reads P one column ahead
    copy_(P, shifted)

``slice_copy(P, ...)`` is a temporary here, but once exir makes it a view of ``P`` the
kernel writing column ``j`` of ``P`` would read column ``j + 1``: correct walking forwards,
wrong walking backwards or in blocks. The pass writes over an operand only where the kernel
reads the same element it writes; every other read of ``P`` keeps the copy. (The ordinary
shift register, ``slice_copy(cat([P, x]), ...)``, reads a temporary and is written in place.)

Each copy kept is named on the copy node (:data:`writeback_core.meta.COPY_LEFT_REASON`) in the
model's terms: the module path and source line of the write (from the node's
``nn_module_stack`` and ``stack_trace``), so ``run``, ``export`` and ``CopyLeftWarning`` say it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx
from executorch.exir import memory
from executorch.exir.delegate import executorch_call_delegate
from writeback_core import ProgramPass, meta
from writeback_core.ops import packet_name, source_of, write_back_copies
from writeback_core.registry import InPlaceDecision

from writeback_passes.backend_names import XNNPACK_BACKEND_ID
from writeback_passes.delegate_state_outputs import delegate_output_refusal, delegate_writer, is_delegate_output
from writeback_passes.graph import StorageAliases, reads_no_value, tensor_value

__all__ = ["ELEMENTWISE", "SCATTERS", "WholeStateReport", "whole_state_writes", "whole_state_writes_pass"]

# Kernels whose output element i is computed from element i of each operand of the output's
# shape alone (portable and optimized libraries): one of them may write over such an operand.
ELEMENTWISE = frozenset(
    {
        "abs",
        "add",
        "clamp",
        "clone",
        "_clone_dim_order",
        "div",
        "exp",
        "maximum",
        "minimum",
        "mul",
        "neg",
        "pow",
        "relu",
        "rsqrt",
        "sigmoid",
        "silu",
        "sqrt",
        "sub",
        "tanh",
        "where",
        "_to_copy",
        "_to_dim_order_copy",
    }
)


# Kernels whose output element i is its base operand's (argument 0) element i or a value from
# another operand: a scatter writing over its own base reads each element before writing it.
SCATTERS = frozenset({"slice_scatter", "select_scatter", "index_put", "index_copy"})


@dataclass
class WholeStateReport:
    """What :func:`whole_state_writes` did: states written by their kernel, copies kept and why."""

    graph_module: torch.fx.GraphModule
    written: dict[str, str] = field(default_factory=dict)  # placeholder -> the kernel's node
    kept: dict[str, str] = field(default_factory=dict)  # placeholder -> reason

    @property
    def modified(self) -> bool:
        return bool(self.written)


def whole_state_writes(gm: torch.fx.GraphModule) -> WholeStateReport:
    """Hand each accepted whole-state write's kernel the state as its ``out``, or plan an
    XNNPACK delegate's result onto the state (see the module docstring); record on every copy
    kept (a declined one too) why, where this pass can say."""
    report = WholeStateReport(gm)
    graph = gm.graph
    storage = StorageAliases(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    plans: list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]] = []
    shared: list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]] = []
    for copy in write_back_copies(graph):
        state = copy.args[0]
        assert isinstance(state, torch.fx.Node)
        decision = InPlaceDecision.from_node(state)
        if decision is None:
            continue
        new = copy.args[1]
        if _backend_of(new) == XNNPACK_BACKEND_ID:
            assert isinstance(new, torch.fx.Node)
            reason = _xnnpack_refusal(state, new, copy, decision.accepted)
            if reason is None:
                shared.append((copy, state, new))
        else:
            reason = _refusal(state, new, copy, storage, order.__getitem__)
            if reason is None and decision.accepted:
                assert isinstance(new, torch.fx.Node)
                plans.append((copy, state, new))
        if reason is not None:
            report.kept[state.name] = reason
            meta.set_custom(copy, meta.COPY_LEFT_REASON, reason)
    for copy, state, new in shared:
        _share_state_memory(copy, state, new)
        report.written[state.name] = new.name
    for copy, state, new in plans:
        alloc = new.kwargs["out"]
        assert isinstance(alloc, torch.fx.Node)
        new.kwargs = {**new.kwargs, "out": state}
        graph.erase_node(alloc)
        copy.replace_all_uses_with(new)
        graph.erase_node(copy)
        meta.set_custom(state, meta.WRITTEN_BY, source_of(new))
        report.written[state.name] = new.name
    if report.modified:
        graph.lint()
        gm.recompile()
    return report


def _backend_of(new: object) -> str | None:
    """The backend id of the delegate call ``new`` is a result of, ``None`` for any other value."""
    if not is_delegate_output(new):
        return None
    assert isinstance(new, torch.fx.Node) and isinstance(new.args[0], torch.fx.Node)
    return _backend_id(new.args[0])


def _xnnpack_refusal(state: torch.fx.Node, new: torch.fx.Node, copy: torch.fx.Node, accepted: bool) -> str | None:
    """Why XNNPACK's result ``new`` may not be written into ``state``'s memory, or ``None``."""
    call = new.args[0]
    assert isinstance(call, torch.fx.Node) and isinstance(new.args[1], int)
    found = delegate_writer(call, new.args[1])
    where = source_of(found[1]) if found is not None else source_of(new)
    why = delegate_output_refusal(state, new, copy)
    if why is None and accepted:
        return None
    if why is None:
        why = "the backend declined to write it in place (it is not rewritten whole)"
    return f"the new value ({where}) is computed inside delegate {XNNPACK_BACKEND_ID} and copied into the state: {why}"


def _share_state_memory(copy: torch.fx.Node, state: torch.fx.Node, new: torch.fx.Node) -> None:
    """Plan the delegate's result ``new`` onto ``state``'s memory (one ``TensorSpec``, so one
    value of the program: the delegate writes the state) and drop the copy, now a self-copy."""
    call = new.args[0]
    assert isinstance(call, torch.fx.Node) and isinstance(new.args[1], int)
    spec = state.meta["spec"]
    specs = call.meta["spec"]
    if isinstance(specs, (list, tuple)):
        updated = list(specs)
        updated[new.args[1]] = spec
        call.meta["spec"] = type(specs)(updated)
    else:
        call.meta["spec"] = spec
    new.meta["spec"] = spec
    copy.replace_all_uses_with(new)
    copy.graph.erase_node(copy)
    found = delegate_writer(call, new.args[1])
    meta.set_custom(state, meta.WRITTEN_BY, source_of(found[1] if found is not None else new))


def _refusal(
    state: torch.fx.Node,
    new: object,
    copy: torch.fx.Node,
    storage: StorageAliases,
    position: Callable[[torch.fx.Node], int],
) -> str | None:
    """Why ``copy_(state, new)`` must stay, in the model's terms, or ``None``."""
    if isinstance(new, torch.fx.Node) and new.op == "placeholder":
        return f"its new value is the program's input {new.name!r}, which no kernel of the program computes"
    if not isinstance(new, torch.fx.Node) or new.op != "call_function":
        return "its new value is not computed by a kernel of the program"
    where = source_of(new)
    source = new.args[0] if new.target is operator.getitem and new.args else None
    if isinstance(source, torch.fx.Node) and source.target is executorch_call_delegate:
        return (
            f"the new value ({where}) is computed inside delegate {_backend_id(source)}, which writes "
            "its results into memory the runtime allocates; it is then copied into the state"
        )
    out = new.kwargs.get("out")
    have, want = tensor_value(new), tensor_value(state)
    if (
        not isinstance(out, torch.fx.Node)
        or out.target is not memory.alloc
        or len(out.users) != 1
        or have is None
        or want is None
        or (have.shape, have.dtype, have.stride()) != (want.shape, want.dtype, want.stride())
    ):
        return (
            f"the new value ({where}) is not the single output, of the state's shape, dtype and "
            f"layout, of one kernel ({packet_name(new.target)})"
        )
    for old in storage.members(state):
        for reader in old.users:
            if reader in (copy, new) or reader.op == "output" or reads_no_value(reader):
                continue
            if reader in storage.members(state):
                continue  # a view of the state: its own readers are checked
            if position(reader) > position(new):
                return (
                    f"{source_of(reader)} reads the old value after the new one is computed "
                    f"({where}); writing it in place would change what it reads"
                )
        if new in old.users and not _same_element_read(new, old, state):
            return (
                f"the kernel computing it ({where}, {packet_name(new.target)}) reads the state in "
                "another element order (a shift, a reduction or a broadcast); writing its output "
                "into the state would overwrite elements it has yet to read"
            )
    return None


def _backend_id(call: torch.fx.Node) -> str:
    """The backend of the delegate ``call`` runs (``XnnpackBackend``), or the call's name."""
    module = call.args[0] if call.args else None
    if isinstance(module, torch.fx.Node) and module.op == "get_attr":
        lowered = getattr(module.graph.owning_module, str(module.target), None)
        backend = getattr(lowered, "backend_id", None)
        if isinstance(backend, str):
            return backend
    return repr(call.name)


def _same_element_read(new: torch.fx.Node, old: torch.fx.Node, state: torch.fx.Node) -> bool:
    """Whether ``new`` reads ``old`` (``state`` or a view of it) only as an elementwise operand
    of exactly its output's shape."""
    if old is not state or old in new.kwargs.values():
        return False
    name = packet_name(new.target)
    if name in SCATTERS:
        return new.args[0] is old and old not in new.args[1:] and not _in_lists(old, new.args[1:])
    if name not in ELEMENTWISE:
        return False
    out, val = tensor_value(new), tensor_value(old)
    return out is not None and val is not None and out.shape == val.shape


def _in_lists(node: torch.fx.Node, args: tuple[object, ...]) -> bool:
    """Whether ``node`` is an element of a list argument (``index_put``'s indices)."""
    return any(isinstance(a, (list, tuple)) and node in a for a in args)


def whole_state_writes_pass() -> ProgramPass:
    """This pass as an ``"after_out_variants"`` :class:`~writeback_core.ProgramPass`, for the
    stock runtime's kernels and its XNNPACK delegate (another delegate writes its own
    states: ``reinplace_delegate_input_mutations``)."""
    from writeback_passes.backend_names import STOCK_RUNTIME

    return ProgramPass(
        name="whole_state_writes",
        stage="after_out_variants",
        run=whole_state_writes,
        backends=STOCK_RUNTIME,
        reason="a state rewritten whole written by the kernel that computes it",
    )

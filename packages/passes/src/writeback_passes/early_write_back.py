"""Move each write-back ``copy_(state, value)`` to the earliest point that keeps its meaning.

Stock ExecuTorch (``insert_write_back_for_buffers_pass``) puts every write-back
just before the graph's output. That keeps ``value`` alive to the end of the
graph, so the memory planner cannot reuse its bytes for the temporaries that
follow. This pass moves each write-back up, as far as the end-of-graph meaning
allows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from writeback_core import ProgramPass, meta
from writeback_core.ops import aten_op, packet_name, write_back_copies

from writeback_passes.graph import StorageAliases

__all__ = [
    "EarlyWriteBack",
    "WriteBackPlacement",
    "early_write_back_pass",
    "insert_write_back_early",
    "user_input_test",
]

__all__ = ["EarlyWriteBack", "WriteBackPlacement", "insert_write_back_early", "user_input_test"]

_COPY_PACKET = "copy_"


@dataclass(frozen=True)
class WriteBackPlacement:
    """Where one write-back ``copy_`` was and where the pass put it.

    Positions count every node of the graph (placeholders included) at the time
    the pass ran. ``after`` names the node the copy now directly follows (the
    binding constraint, or the previous copy placed at the same point).
    ``lifetime_saved`` is by how many nodes the live range of ``value`` (from
    itself to its last user other than the output) shrank.
    """

    state: str
    copy: str
    value: str
    after: str
    stock_position: int
    early_position: int
    lifetime_saved: int


@dataclass
class EarlyWriteBack:
    """What :func:`insert_write_back_early` did.

    ``analysed`` is False when the graph had no write-back copy (no alias
    analysis was built). ``fallback`` names the pair of write-backs that may
    interfere when all copies were kept at the end in their original order.
    ``modified`` says whether the graph changed; with ``graph_module`` it makes
    this usable as an exir ``PassResult``.
    """

    graph_module: torch.fx.GraphModule
    placements: tuple[WriteBackPlacement, ...] = ()
    analysed: bool = False
    fallback: tuple[str, str] | None = None
    modified: bool = field(default=False)

    def by_state(self) -> dict[str, WriteBackPlacement]:
        """Placements keyed by the name of the state placeholder they write."""
        return {p.state: p for p in self.placements}


@dataclass(frozen=True)
class _WriteBack:
    copy: torch.fx.Node
    dest: torch.fx.Node
    value: torch.fx.Node


def _write_backs(graph: torch.fx.Graph) -> list[_WriteBack]:
    """The write-back copies: ``copy_(placeholder, value)`` nodes whose result or placeholder
    the output returns (exir returns the copy; this pass, once run, the placeholder)."""
    output = graph.output_node()
    returned = set(output.all_input_nodes)
    found = []
    for node in write_back_copies(graph):
        dest, value = (*node.args, None, None)[:2]
        if not (isinstance(dest, torch.fx.Node) and isinstance(value, torch.fx.Node)):
            continue
        if node in returned or (dest in returned and not node.users):
            found.append(_WriteBack(node, dest, value))
    return found


def _latest(nodes: Iterable[torch.fx.Node], position: dict[torch.fx.Node, int], limit: int) -> torch.fx.Node | None:
    """The latest of ``nodes`` placed before position ``limit``.

    Nodes at or after ``limit`` already run after the copy and see the new
    contents; moving the copy up never passes them, so they bind nothing.
    """
    best: torch.fx.Node | None = None
    for node in nodes:
        if node not in position or position[node] >= limit:
            continue
        if best is None or position[node] > position[best]:
            best = node
    return best


def _interference(write_backs: Sequence[_WriteBack], storage: StorageAliases) -> tuple[str, str] | None:
    """The first pair of write-backs whose order matters, or ``None`` when all are independent.

    Write-back ``a`` and ``b`` interfere when ``a``'s state may share storage
    with ``b``'s value or ``b``'s state: then which copy runs first changes what
    a state holds at the end.
    """
    owner: dict[torch.fx.Node, _WriteBack] = {}
    for wb in write_backs:
        owner.setdefault(wb.value, wb)
        owner.setdefault(wb.dest, wb)
    for wb in write_backs:
        for member in storage.members(wb.dest):
            other = owner.get(member)
            if other is not None and other is not wb:
                return (wb.copy.name, other.copy.name)
    return None


def _anchor(
    wb: _WriteBack,
    storage: StorageAliases,
    copies: frozenset[torch.fx.Node],
    position: dict[torch.fx.Node, int],
    last_placeholder: torch.fx.Node | None,
) -> torch.fx.Node:
    """The node the write-back must follow: the latest of the four rules of the pass."""
    readers = (user for member in storage.members(wb.dest) for user in member.users if user not in copies)
    writers = (w for w in storage.writers(wb.value) if w not in copies)
    floor = [wb.value] if last_placeholder is None else [wb.value, last_placeholder]
    anchor = _latest([*floor, *readers, *writers], position, position[wb.copy])
    assert anchor is not None  # the value precedes its copy, so it is always a candidate
    return anchor


def _lifetime(value: torch.fx.Node, position: dict[torch.fx.Node, int]) -> int:
    """How many nodes ``value`` stays alive for: from itself to its last non-output user."""
    users = [position[u] for u in value.users if u.op != "output"]
    return max(users, default=position[value]) - position[value]


def _fallback_order(write_backs: Sequence[_WriteBack], storage: StorageAliases) -> list[_WriteBack]:
    """The order for end-of-graph copies: the original one, unless a copy would read a state
    an earlier copy already overwrote.

    ``a`` must precede ``b`` when ``a``'s value may be ``b``'s state: ``a`` takes
    ``b``'s old contents. exir's own order (the signature's) breaks that when
    ``b`` comes first and ``a``'s value is a ``view_copy`` of ``b``, which exir
    turns into a view. A stable topological sort keeps the original order
    wherever it is already right; with a cycle (two states swapping contents)
    no order works and the original one is kept.
    """
    index = {wb.dest: k for k, wb in enumerate(write_backs)}
    before: list[set[int]] = [set() for _ in write_backs]  # before[k]: copies that must run before k
    for k, wb in enumerate(write_backs):
        for member in storage.members(wb.value):
            other = index.get(member)
            if other is not None and other != k:
                before[other].add(k)
    order: list[int] = []
    placed: set[int] = set()
    while len(order) < len(write_backs):
        ready = [k for k in range(len(write_backs)) if k not in placed and before[k] <= placed]
        if not ready:
            return list(write_backs)
        order.append(ready[0])
        placed.add(ready[0])
    return [write_backs[k] for k in order]


def _move_to_end(write_backs: Sequence[_WriteBack], graph: torch.fx.Graph) -> bool:
    """Put every copy just before the output, in the order given; True if any moved."""
    output = graph.output_node()
    before = list(graph.nodes)
    for wb in write_backs:
        output.prepend(wb.copy)
    return before != list(graph.nodes)


def _written_in_place(node: torch.fx.Node) -> torch.fx.Node | None:
    """The argument an aten in-place op writes and returns (``copy_``, ``index_put_``, ...), if any."""
    op = aten_op(node.target)
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    schema = op._schema
    if not (schema.arguments and schema.returns and node.args and isinstance(node.args[0], torch.fx.Node)):
        return None
    written, returned = schema.arguments[0].alias_info, schema.returns[0].alias_info
    if written is None or returned is None or not written.is_write:
        return None
    if not set(written.after_set) & set(returned.after_set):
        return None
    return node.args[0]


def _state_placeholder(node: torch.fx.Node) -> torch.fx.Node | None:
    """The placeholder a returned node is, through a chain of in-place writes into it."""
    seen = 0
    current: torch.fx.Node | None = node
    while current is not None and current.op != "placeholder" and seen < 64:
        current = _written_in_place(current)
        seen += 1
    return current if current is not None and current.op == "placeholder" else None


def user_input_test(graph: torch.fx.Graph, program: object) -> Callable[[torch.fx.Node], bool]:
    """Tell user-input placeholders from buffers: from the signature of an
    ``ExportedProgram``, else from the mark ``writeback_passes.to_executorch`` puts on
    them; a bare ``GraphModule`` with no mark falls back on ``torch.export``'s
    naming (lifted buffers are ``b_*``, parameters ``p_*``, constants ``c_*``)."""
    if isinstance(program, ExportedProgram):
        names = set(program.graph_signature.user_inputs)
        return lambda node: node.name in names
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if any(meta.get_custom(n, meta.USER_INPUT) is not None for n in placeholders):
        return lambda node: meta.get_custom(node, meta.USER_INPUT) is True
    return lambda node: not node.name.startswith(("b_", "p_", "c_", "_lifted_tensor_constant"))


def _name_states_at_output(graph: torch.fx.Graph, program: object) -> bool:
    """Make the output return each state placeholder instead of the in-place op that wrote it.

    That op is a write-back ``copy_`` (or an in-place op left by exir's
    reinplace pass). exir 1.5.1's memory planner skips in-place nodes when it
    computes lifetimes, so a user input returned through one would have its
    planned slot freed after its last use in graph order and overwritten by
    later temporaries before the caller reads it (stock placement hides this
    for ``copy_`` by putting it last, but not for a reinplaced op). Returning
    the placeholder keeps the slot alive to the end. The emitted program is
    the same (an in-place op's value is its first argument's). Only user
    inputs are renamed: a mutable buffer's slot lives for the whole method
    anyway, and a buffer placeholder returned by the output would, with
    unplanned outputs (``alloc_graph_output=False``), lose its planned slot and
    be emitted as constant data (merged with any constant of equal bytes, so
    every write corrupts that constant; found by the fuzzer). An
    ``ExportedProgram``'s signature is renamed to match. Returns whether
    anything changed.
    """
    output = graph.output_node()
    renamed: dict[str, str] = {}
    is_user_input = user_input_test(graph, program)
    for node in list(output.all_input_nodes):
        placeholder = _state_placeholder(node)
        if placeholder is not None and placeholder is not node and is_user_input(placeholder):
            output.replace_input_with(node, placeholder)
            renamed[node.name] = placeholder.name
    if renamed and isinstance(program, ExportedProgram):
        for spec in program.graph_signature.output_specs:
            name = getattr(spec.arg, "name", None)
            if name in renamed:
                spec.arg.name = renamed[name]
    return bool(renamed)


def _graph_module(program: ExportedProgram | torch.fx.GraphModule) -> torch.fx.GraphModule:
    if isinstance(program, torch.fx.GraphModule):
        return program
    if isinstance(program, ExportedProgram):
        if _needs_write_backs(program):
            from executorch.exir.passes.insert_write_back_for_buffers_pass import (
                insert_write_back_for_buffers_pass,
            )

            # exir's own pass adds the copies (at the end) and renames the
            # signature's outputs in place; this pass then moves them.
            insert_write_back_for_buffers_pass(program)
        graph_module: torch.fx.GraphModule = program.graph_module
        return graph_module
    raise TypeError(
        f"insert_write_back_early takes an ExportedProgram or a torch.fx.GraphModule, got {type(program).__name__}"
    )


def _needs_write_backs(program: ExportedProgram) -> bool:
    """Whether some state output is still a plain value (no write-back ``copy_`` yet)."""
    outputs = list(program.graph_module.graph.output_node().args[0])
    for spec, node in zip(program.graph_signature.output_specs, outputs, strict=False):
        if spec.kind not in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION):
            continue
        # A copy_ is exir's write-back; a placeholder is one this pass already
        # moved (or a state written fully in place, which needs none).
        if not (
            isinstance(node, torch.fx.Node) and (node.op == "placeholder" or packet_name(node.target) == _COPY_PACKET)
        ):
            return True
    return False


def insert_write_back_early(program: ExportedProgram | torch.fx.GraphModule) -> EarlyWriteBack:
    """Move every write-back ``copy_(state, value)`` to its earliest safe point, in place.

    ``program`` is either a ``GraphModule`` whose write-backs exir already
    inserted (what ``ExecutorchBackendConfig.passes`` receive), or an
    ``ExportedProgram``: an edge program whose state outputs are still values
    gets its copies from exir's ``insert_write_back_for_buffers_pass`` first.
    Buffer mutations and user-input mutations are handled alike.

    Algorithm:

    1. Collect the write-backs: ``copy_`` nodes with a placeholder as first
       argument that the output returns (or, once this pass ran, whose
       placeholder the output returns). If there are none, no alias analysis is
       built (``analysed`` is False) and only step 5 runs (which changes
       nothing unless the output returns an in-place write of a placeholder).
    2. Build one :class:`writeback_core.AliasAnalysis` of the graph (``aten::``
       schemas trusted; any other op, including a custom op whose schema has no
       ``(a!)``, assumed to alias and write its tensor arguments; exir's
       ``_share_alloc_with_arg_idx`` annotation counted as an alias edge) and
       widen each alias class across ``view_copy`` edges, because exir turns
       those into real views after this pass runs.
    3. If one write-back's state may share storage with another's value or
       state, their relative order matters: keep all copies at the end of the
       graph in their original order (``fallback`` names the pair) and go to 5.
       One exception: when a copy's value may be the state of a copy that
       comes before it, it is moved ahead of that copy (it must take the old
       contents; exir's own order gets this wrong once its ``view_copy`` is a
       view). With no consistent order (two states swapping contents) the
       original order stays.
    4. Otherwise place each copy directly after the latest of:

       a. its value (it must exist);
       b. every reader of the state or of anything that may alias it (they
          must see the old contents; a writer of the state is a reader too);
       c. every writer of the value or of anything that may alias it (the copy
          must take the final value);
       d. the last placeholder (if the graph has any).

       Only nodes before the copy's current place count: later ones already
       see the new contents, and a copy only ever moves up. Copies that land
       at the same point keep their original order.
    5. Make the output return each state placeholder instead of the in-place
       op that wrote it (its copy, or an op exir's reinplace pass made in
       place), so exir's memory planner keeps a user input's slot alive to the
       end (it skips in-place nodes when it computes lifetimes; without this a
       caller's new state is overwritten before the caller sees it).

    Safety rules, with the example each one refuses:

    - ``new = buf * 2; y = buf + 1; buf.copy_(new)``: the copy may not go right
      after ``new``, because ``y`` reads the old ``buf`` (rule b).
    - ``v = view_copy(buf); new = f(x); out = v * 3``: ``v`` becomes a view of
      ``buf`` once exir replaces view copies, so ``out`` reads ``buf`` (rule b
      through step 2).
    - ``new = f(x); new.mul_(2)`` or a custom op writing ``new``: the copy must
      follow the write (rule c).
    - ``a.copy_(f(b)); b.copy_(g(x))`` where ``f`` is a view: ``a``'s value is
      ``b``'s storage, so moving ``b``'s copy before ``a``'s changes ``a``
      (step 3).

    :param program: the graph to edit in place.
    :return: what moved where, usable as an exir ``PassResult``.
    :raises TypeError: ``program`` is neither an ``ExportedProgram`` nor a ``GraphModule``.
    """
    gm = _graph_module(program)
    graph = gm.graph
    write_backs = _write_backs(graph)
    if not write_backs:
        renamed = _name_states_at_output(graph, program)
        if renamed:
            gm.recompile()
        return EarlyWriteBack(gm, modified=renamed)
    order = {n: i for i, n in enumerate(graph.nodes)}
    write_backs.sort(key=lambda wb: order[wb.copy])
    storage = StorageAliases(graph)
    clash = _interference(write_backs, storage)
    if clash is not None:
        moved = _move_to_end(_fallback_order(write_backs, storage), graph)
        moved = _name_states_at_output(graph, program) or moved
        if moved:
            gm.recompile()
        return EarlyWriteBack(gm, analysed=True, fallback=clash, modified=moved)
    copies = frozenset(wb.copy for wb in write_backs)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last_placeholder = placeholders[-1] if placeholders else None
    anchors = [_anchor(wb, storage, copies, order, last_placeholder) for wb in write_backs]
    stock_lifetime = {wb.value: _lifetime(wb.value, order) for wb in write_backs}
    tail: dict[torch.fx.Node, torch.fx.Node] = {}
    for wb, anchor in zip(write_backs, anchors, strict=True):
        follow = tail.get(anchor, anchor)
        follow.append(wb.copy)
        tail[anchor] = wb.copy
    after = {n: i for i, n in enumerate(graph.nodes)}
    placements = tuple(
        WriteBackPlacement(
            state=wb.dest.name,
            copy=wb.copy.name,
            value=wb.value.name,
            after=wb.copy.prev.name,
            stock_position=order[wb.copy],
            early_position=after[wb.copy],
            lifetime_saved=stock_lifetime[wb.value] - _lifetime(wb.value, after),
        )
        for wb in write_backs
    )
    renamed = _name_states_at_output(graph, program)
    modified = renamed or any(p.stock_position != p.early_position for p in placements)
    if modified:
        graph.lint()
        gm.recompile()
    return EarlyWriteBack(gm, placements, analysed=True, modified=modified)


def early_write_back_pass() -> ProgramPass:
    """:func:`insert_write_back_early` as a ``"before_memory_planning"`` :class:`ProgramPass`.

    It must see the graph's final readers and writers, so it runs after every pass of
    this package that adds or drops one (write-backs a delegate takes in place, state
    written in place by the kernels, copies made views). A plugin's pass that edits the
    graph says ``before=("insert_write_back_early",)``. Those relations are ``optional``: a
    plugin may offer this pass without the others (early write-back alone).
    """
    earlier = ("reinplace_delegate_input_mutations", "reinplace_state_writes", "copies_as_views")
    return ProgramPass(
        name="insert_write_back_early",
        stage="before_memory_planning",
        run=insert_write_back_early,
        after=earlier,
        optional=earlier,
        reason="each write-back moved up to where its value is ready",
    )

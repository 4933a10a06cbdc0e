"""Copies that only reshape: make them views, so a decoder's attention stops copying its cache.

The edge dialect has no view ops: every ``unsqueeze``, ``squeeze`` and ``expand``
of a model becomes a ``*_copy`` op, and the stock runtime runs each as a full copy.
exir turns only ``view_copy`` into a view (``ReplaceViewCopyWithViewPass``, at memory
planning). A decoder reads its KV cache through such chains every step: ExecuTorch's
Llama example repeats K and V for grouped-query attention as
``unsqueeze -> expand -> view`` (an expand to the same shape when every query head
has its own KV head) and the decomposed ``scaled_dot_product_attention`` expands K^T
and V to the shape they already have before each ``bmm``. At a 32 MiB cache that is
six whole-cache copies per layer per step, outside any delegate.

This pass, per node, in graph order:

==========================================  =========================================
edge op                                     becomes
==========================================  =========================================
``expand_copy(x, size)``, result shaped      ``x`` itself (every reader reads ``x``)
like ``x``
``unsqueeze_copy(x, d)``,                    ``view_copy(x, result shape)``, a view
``squeeze_copy(x, dims)`` of a contiguous    once exir replaces view copies
``x``
==========================================  =========================================

Readers that ran on a copy now read ``x``'s storage, and writers of the copy would
write it, so a change is refused when the copy (or anything aliasing it) is written in
place (``e = expand_copy(x); e.add_(1)`` must leave ``x`` as it was), and when
storage ``x`` may share is written at or after the node (an in-place kernel, a
write-back ``copy_``, a delegate told to write an input in place: its compile spec
names it): the reader would see the new value where it read the old one. A
delegate is trusted not to write its inputs otherwise (ExecuTorch's delegate
contract; writeback's in-place protocol is declared in the spec). A result the
graph returns is left alone (exir does not let an output be a view either).
Runs after :mod:`writeback_passes.reinplace_state_writes`, so the reads it makes
views of are checked against the in-place writes that pass placed; a view of an
in-place op's result is taken of the tensor that op wrote (exir plans views on their
base's allocation, and an in-place result has none of its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from writeback_core import ProgramPass, meta
from writeback_core.alias import AliasAnalysis
from writeback_core.ops import VIEWS_AND_EXPANDS, packet_name

from writeback_passes.graph import CLONES, UNIT_DIM_RESHAPES, tensor_value

__all__ = [
    "ViewCopyReport",
    "copies_as_views",
    "copies_as_views_pass",
    "functional_copies_as_views",
    "functional_copies_as_views_pass",
]

_VIEW_LIKE = VIEWS_AND_EXPANDS | UNIT_DIM_RESHAPES | CLONES


@dataclass
class ViewCopyReport:
    """What :func:`copies_as_views` changed: node names, and the bytes no longer copied per call.

    Carries the edited ``graph_module`` and ``modified``, as exir's ``PassResult`` does.
    """

    graph_module: torch.fx.GraphModule
    removed: list[str] = field(default_factory=list)  # same-shape expand_copy nodes
    viewed: list[str] = field(default_factory=list)  # unsqueeze/squeeze copies now view_copy
    rerooted: list[str] = field(default_factory=list)  # view_copy of an in-place result, now of its input
    kept: dict[str, str] = field(default_factory=dict)  # node name -> why it stays a copy
    bytes_per_call: int = 0

    @property
    def modified(self) -> bool:
        return bool(self.removed or self.viewed or self.rerooted)


def _static_shape(val: torch.Tensor) -> tuple[int, ...] | None:
    shape = tuple(val.shape)
    return shape if all(isinstance(d, int) for d in shape) else None


def _nbytes(val: torch.Tensor) -> int:
    return int(val.numel()) * val.element_size()


def _writes_its_inputs(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether a delegate call may write into an input: only when its compile spec says so."""
    lowered = node.args[0] if node.args else None
    target = lowered.target if isinstance(lowered, torch.fx.Node) else None
    module = getattr(gm, target, None) if isinstance(target, str) else None
    specs = getattr(module, "compile_specs", None)
    if specs is None:
        return True  # not a lowered module we can read: assume the worst
    return any(spec.key == meta.IN_PLACE_OUTPUTS_SPEC for spec in specs)


def _is_delegate_call(node: torch.fx.Node) -> bool:
    from executorch.exir.delegate import executorch_call_delegate

    return node.op == "call_function" and node.target is executorch_call_delegate


def copies_as_views(program: ExportedProgram | torch.fx.GraphModule) -> ViewCopyReport:
    """Remove same-shape ``expand_copy`` nodes and make ``unsqueeze``/``squeeze`` copies views.

    See the module docstring for the rule and the refusals. Edits the graph in place.
    """
    return _copies_as_views(program, functional=False)


def functional_copies_as_views(program: ExportedProgram | torch.fx.GraphModule) -> ViewCopyReport:
    """:func:`copies_as_views` on the functional edge graph, before partitioning; also drops a
    ``clone`` that changes no layout. Nothing writes in place yet, so a copy whose input comes
    from a placeholder (through reshapes) is left alone: a later in-place state write may need
    it to keep the old value, and keeping it lets that write happen."""
    return _copies_as_views(program, functional=True)


def _copies_as_views(program: ExportedProgram | torch.fx.GraphModule, functional: bool) -> ViewCopyReport:
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    graph = gm.graph
    report = ViewCopyReport(gm)
    analysis = AliasAnalysis(graph)
    view_copy: Any = None
    for node in list(graph.nodes):
        name = packet_name(node.target) if node.op == "call_function" else None
        if name == "view_copy" and not functional and isinstance(node.args[0], torch.fx.Node):
            # A view exir plans on an in-place result (which has no allocation of its own) is
            # taken of the tensor the op wrote: the same storage, with a plan behind it.
            root = _written_root(node.args[0])
            if root is not node.args[0]:
                node.args = (root, *node.args[1:])
                report.rerooted.append(node.name)
            continue
        if name != "expand_copy" and name not in UNIT_DIM_RESHAPES and not (functional and name in CLONES):
            continue
        base = node.args[0] if node.args else None
        out, val = tensor_value(node), tensor_value(base)
        if not isinstance(base, torch.fx.Node) or out is None or val is None:
            continue
        shape = _static_shape(out)
        if shape is None or out.dtype != val.dtype:
            continue
        if name == "expand_copy" and tuple(val.shape) != shape:
            continue  # a real broadcast: the copy makes the data
        if name in CLONES and not _plain_clone(node, val):
            continue  # a clone that changes the layout makes the data
        if functional and _read_from_placeholder(base):
            report.kept[node.name] = "it reads a placeholder, whose old value a later state write may need"
            continue
        if name in UNIT_DIM_RESHAPES and node.users and all(_broadcasts(user, shape) for user in node.users):
            continue  # feeds only a real broadcast, which copies anyway (and keeps a pattern readable)
        if name in UNIT_DIM_RESHAPES and not val.is_contiguous():
            report.kept[node.name] = "its input is not contiguous, so the reshape is no view of it"
            continue
        if any(user.op == "output" for user in node.users):
            report.kept[node.name] = "the graph returns it"
            continue
        later = [
            w
            for w in analysis.writers_of(base)
            if analysis.position(w) >= analysis.position(node)
            and (not _is_delegate_call(w) or _writes_its_inputs(w, gm))
        ]
        if later:
            report.kept[node.name] = f"{later[0].name} writes storage it may share afterwards"
            continue
        writes_copy = [w for w in analysis.writers_of(node) if w is not node]
        if writes_copy:
            # Once the copy is x itself (or a view of it), a write into the copy writes x.
            report.kept[node.name] = (
                f"{writes_copy[0].name} writes the copy in place afterwards, which would then write {base.name}"
            )
            continue
        report.bytes_per_call += _nbytes(out)
        if name == "expand_copy" or name in CLONES:
            node.replace_all_uses_with(base)
            graph.erase_node(node)
            report.removed.append(node.name)
        else:
            if view_copy is None:
                view_copy = _view_copy_like(node.target)
            node.target = view_copy
            # exir plans a view on its base's allocation: an in-place op's result has none of
            # its own, so the view is of the tensor the op wrote.
            node.args = (_written_root(base), list(shape))
            node.kwargs = {}
            report.viewed.append(node.name)
    if report.modified:
        graph.lint()
        gm.recompile()
    return report


def _broadcasts(node: torch.fx.Node, shape: tuple[int, ...]) -> bool:
    """Whether ``node`` is an ``expand_copy`` to a shape other than ``shape``."""
    out = tensor_value(node)
    return packet_name(node.target) == "expand_copy" and out is not None and tuple(out.shape) != shape


def _plain_clone(node: torch.fx.Node, val: torch.Tensor) -> bool:
    """A clone of a contiguous tensor into the same, contiguous layout (no dim order, no format)."""
    layout = {k: v for k, v in node.kwargs.items() if v is not None}
    order = layout.pop("dim_order", None)
    if order is not None and (not isinstance(order, list | tuple) or list(order) != list(range(val.dim()))):
        return False
    if layout.pop("memory_format", torch.contiguous_format) not in (torch.contiguous_format, torch.preserve_format):
        return False
    return not layout and val.is_contiguous()


def _read_from_placeholder(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a placeholder or reshapes one (through the ops this pass rewrites)."""
    while node.op == "call_function" and packet_name(node.target) in _VIEW_LIKE and node.args:
        if not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
    return node.op == "placeholder"


def _written_root(node: torch.fx.Node) -> torch.fx.Node:
    """``node``, or for the result of an in-place op (``index_put_``, ``copy_``) the tensor it
    wrote, followed down to one that is not such a result."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        name = packet_name(node.target)
        inner, val = tensor_value(node.args[0]), tensor_value(node)
        if name is None or not name.endswith("_") or inner is None or val is None or inner.shape != val.shape:
            break
        node = node.args[0]
    return node


def _view_copy_like(target: Any) -> Any:
    """``view_copy.default`` in the dialect of ``target`` (edge in exir's pipeline, aten otherwise)."""
    if isinstance(target, torch._ops.OpOverload):
        return torch.ops.aten.view_copy.default
    from executorch.exir.dialects._ops import ops as exir_ops

    return exir_ops.edge.aten.view_copy.default


def copies_as_views_pass() -> ProgramPass:
    """This pass as a ``"before_memory_planning"`` :class:`~writeback_core.ProgramPass`, after
    ``reinplace_state_writes`` (which decides on the functional graph; the reads this pass
    makes views of are checked against the in-place writes it placed); early write-back,
    which must see every read, runs after this one."""
    return ProgramPass(
        name="copies_as_views",
        stage="before_memory_planning",
        run=copies_as_views,
        after=("reinplace_state_writes",),
        reason="reshape copies outside every delegate made views",
    )


def functional_copies_as_views_pass() -> ProgramPass:
    """:func:`functional_copies_as_views` as a ``"before_partition"`` :class:`~writeback_core.ProgramPass`
    (so a delegate, which would copy a reshape it takes, sees none)."""
    return ProgramPass(
        name="functional_copies_as_views",
        stage="before_partition",
        run=functional_copies_as_views,
        reason="reshape copies made views before a delegate copies them",
    )

"""Scale the small side of a matmul: attention stops rewriting its whole key cache every step.

``scaled_dot_product_attention``, decomposed for a backend without a fused kernel,
multiplies both ``q`` and ``K^T`` by ``sqrt(scale)`` before their ``bmm``. In a decode
step ``q`` is one position and ``K^T`` is the whole cache, so the second multiply
writes a cache-sized tensor per layer per step. Since ``(s*A) @ B == A @ (s*B)``, the
multiply can move to the operand with fewer elements.

For each ``bmm(A, B)`` (and ``mm``) of the functional edge graph: when ``B`` is
``mul.Scalar(X, s)`` reached through reshape-only ops (``view_copy``, ``expand_copy``)
that nothing else reads, and ``A`` has fewer elements than ``X``, the ``bmm`` reads
``X`` through the same reshapes and ``A`` becomes ``mul.Scalar(A, s)``. The same
with the roles of ``A`` and ``B`` swapped. Results differ from the original by
floating-point rounding only (one multiply moves; none is added).

Refused: a multiply whose result has another dtype than its input or than the other
operand (``bmm(q, int_cache * 0.5)``: the matmul needs the converted operand), and
any operand whose ``val`` is unknown. The moved multiply gets its own ``val``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from writeback_core import ProgramPass
from writeback_core.ops import aten_op, packet_name

from writeback_passes.graph import MATMULS, VIEWS_AND_EXPANDS, tensor_value

__all__ = ["ScaleReport", "scale_smaller_operand", "scale_smaller_operand_pass"]


@dataclass
class ScaleReport:
    """Which matmuls had a scalar multiply moved to their smaller operand (a PassResult for exir)."""

    graph_module: torch.fx.GraphModule
    moved: list[str] = field(default_factory=list)  # matmul node names

    @property
    def modified(self) -> bool:
        return bool(self.moved)


def _numel(node: Any) -> int | None:
    val = tensor_value(node)
    if val is None or not all(isinstance(d, int) for d in val.shape):
        return None
    return int(val.numel())


def _scaled_source(operand: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(mul node, the node whose only reader is ...)`` when ``operand`` is a scalar multiply
    reached through single-reader reshapes; ``None`` otherwise."""
    node = operand
    while packet_name(node.target) in VIEWS_AND_EXPANDS and node.op == "call_function":
        inner = node.args[0] if node.args else None
        if not isinstance(inner, torch.fx.Node) or len(inner.users) != 1:
            return None
        node = inner
    if node.op != "call_function" or packet_name(node.target) != "mul" or len(node.users) != 1:
        return None
    if len(node.args) != 2 or not isinstance(node.args[0], torch.fx.Node) or not isinstance(node.args[1], float | int):
        return None
    if node.kwargs or getattr(aten_op(node.target), "_overloadname", None) != "Scalar":
        return None
    return node, node.args[0]


def _same_dtype(*nodes: torch.fx.Node) -> bool:
    """Whether every node has a known ``val`` of one dtype."""
    dtypes = {val.dtype if val is not None else None for val in map(tensor_value, nodes)}
    return len(dtypes) == 1 and None not in dtypes


def _product(other: torch.fx.Node, scale: Any, target: Any) -> torch.Tensor | None:
    """The fake ``val`` of ``target(other, scale)``, computed in ``other``'s fake mode."""
    from torch._guards import detect_fake_mode

    val = tensor_value(other)
    fake = detect_fake_mode([val])
    if val is None or fake is None:
        return None
    with fake:
        product = aten_op(target)(val, scale)
    return product if isinstance(product, torch.Tensor) and product.dtype == val.dtype else None


def scale_smaller_operand(program: ExportedProgram | torch.fx.GraphModule) -> ScaleReport:
    """Move each scalar multiply of a matmul operand to the smaller operand (module docstring)."""
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    graph = gm.graph
    report = ScaleReport(gm)
    for node in list(graph.nodes):
        if node.op != "call_function" or packet_name(node.target) not in MATMULS or len(node.args) != 2:
            continue
        for big, small in ((1, 0), (0, 1)):
            operand, other = node.args[big], node.args[small]
            if not isinstance(operand, torch.fx.Node) or not isinstance(other, torch.fx.Node):
                continue
            found = _scaled_source(operand)
            if found is None:
                continue
            mul, source = found
            source_size, other_size = _numel(source), _numel(other)
            if source_size is None or other_size is None or other_size >= source_size:
                continue
            if not _same_dtype(mul, source, other):
                continue  # the multiply converts (an int cache times 0.5): the matmul needs its result
            scale, target = mul.args[1], mul.target
            assert callable(target)
            product = _product(other, scale, target)
            if product is None:
                continue
            mul.replace_all_uses_with(source)
            graph.erase_node(mul)
            with graph.inserting_before(node):
                scaled = graph.call_function(target, (other, scale))
            scaled.meta = {"val": product, **{k: v for k, v in mul.meta.items() if k in ("stack_trace", "custom")}}
            node.args = (scaled, node.args[1]) if small == 0 else (node.args[0], scaled)
            report.moved.append(node.name)
            break
    if report.moved:
        graph.lint()
        gm.recompile()
    return report


def scale_smaller_operand_pass() -> ProgramPass:
    """This pass as a ``"before_partition"`` :class:`~writeback_core.ProgramPass` (after the
    reshape copies are made views, which leaves the multiply next to its matmul)."""
    from writeback_passes.backend_names import ATTENTION_REWRITES

    return ProgramPass(
        name="scale_smaller_operand",
        stage="before_partition",
        run=scale_smaller_operand,
        after=("functional_copies_as_views",),
        backends=ATTENTION_REWRITES,
        reason="attention scaled on its smaller operand",
    )

"""Check a decoder program's caller inputs in the graph, before a kernel with preconditions reads them.

ExecuTorch's ``llama::update_cache(value, cache, start)`` and ``llama::custom_sdpa(q, k, v, start,
...)`` check their arguments with ``ET_CHECK``: a value whose batch or head count differs from
the cache's aborts the whole process (SIGABRT), and a negative ``start`` is not refused at all
(``update_cache`` writes before the cache's first row; the logits come back NaN). The runner's
contract says what a call may pass: tokens ``[1, n]``, positions of ``n`` entries (HF
``cache_position``) or of one (ET ``input_pos``), every position in ``[0, cache)``. A caller that
breaks it must get an error, from ExecuTorch's stock runtime, ``TextLLMRunner`` and writeback's
runtime alike, so the check has to be in the program itself.

What survives to the runtime, measured on ExecuTorch 1.5.1: ``to_executorch`` runs
``RemoveGraphAssertsPass`` after the config's passes, which erases every ``aten._assert_async``,
``aten._assert_scalar``, ``sym_constrain_range(_for_size)`` and ``_assert_tensor_metadata`` (so a
``torch._check`` in ``forward`` never reaches the runtime), and the portable library has no kernel
for them. What does survive is a kernel that refuses an index with an error instead of an abort:
``index.Tensor`` returns ``InvalidArgument`` (0x12) for an index outside ``[-size, size)`` and logs
the index and the size (``executorch.runtime`` raises ``RuntimeError ... error 0x12``, writeback's
runtime ``RuntimeError ... InvalidArgument (0x12)``), before any later instruction runs. The
sizes of the inputs as the caller passed them are read with ``sym_size`` (the exported program
assumes tokens and positions share one length; the runtime never checks it), turned into
tensors with ``scalar_tensor`` (both have kernels; the exported program already uses them).

The algorithm:

1. Find the ``llama::update_cache`` and ``llama::custom_sdpa`` calls; their cache length ``S``
   (dim 1 of the cache) is the bound of every position. None: nothing to do.
2. Find the caller's inputs: the integer placeholders no node writes, tokens of rank 2 and
   positions of rank 1. Exactly one of each, or nothing is done (the report says why).
3. Right after the placeholders, in this order: ``in_range(v, T)`` is
   ``zeros(T)[where(v < 0, v - T, v)]``, which the runtime refuses unless every ``v`` lies in
   ``[0, T)`` and otherwise is zeros. For each dim the program takes dynamically:
   batch ``b - 1`` in ``[0, 1)``; tokens ``n - 1`` in ``[0, S)``; positions' length ``m - n`` in
   ``[0, 1)`` (HF) or ``m - 1`` in ``[0, 1)`` (ET); then every position in ``[0, S)``, and the
   last written row, ``positions[0] + n - 1``, in ``[0, S)``.
4. Every reader of the positions reads ``positions + sum(checks)`` (the positions, unchanged),
   so the checks run first and are never dropped as dead code.

An input whose dims are all static needs no shape check (the runtime refuses to resize it); an
input with one dynamic dim can be resized to any shape of its rank that fits its capacity (tokens
``[2, 3]`` fit ``[1, 16]``), so its static dims are checked too. The positions are always checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from writeback_core import ProgramPass

from writeback_passes.index_checks import Inserter, fake_mode_of, written_placeholders

__all__ = ["InputCheckReport", "check_runner_inputs", "runner_input_checks_pass"]

# The kernels whose ``start`` argument is a caller's position, and the argument holding the cache.
_KERNELS = {"update_cache": 1, "custom_sdpa": 1}


@dataclass
class InputCheckReport:
    """What :func:`check_runner_inputs` did (usable as an exir ``PassResult``)."""

    graph_module: torch.fx.GraphModule
    checks: list[str] = field(default_factory=list)  # what each inserted check refuses, in order
    skipped: str | None = None  # why nothing was checked, where kernels were found

    @property
    def modified(self) -> bool:
        return bool(self.checks)


def _kernel_name(node: torch.fx.Node) -> str | None:
    target = node.target
    namespace = getattr(target, "namespace", None)
    name = getattr(target, "_opname", None) or getattr(getattr(target, "_op", None), "_opname", None)
    if namespace == "llama" or getattr(getattr(target, "_op", None), "namespace", None) == "llama":
        return str(name) if name in _KERNELS else None
    return None


def _cache_length(graph: torch.fx.Graph) -> int | None:
    """The shortest static cache length any of the kernels reads, or None without such kernels."""
    lengths: list[int] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = _kernel_name(node)
        if name is None or len(node.args) <= _KERNELS[name]:
            continue
        cache = node.args[_KERNELS[name]]
        value = cache.meta.get("val") if isinstance(cache, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.dim() == 4 and isinstance(value.shape[1], int):
            lengths.append(value.shape[1])
    return min(lengths) if lengths else None


def _caller_inputs(graph: torch.fx.Graph) -> tuple[torch.fx.Node, torch.fx.Node] | str:
    """``(tokens, positions)``, or why they cannot be told apart."""
    written = written_placeholders(graph)
    found: dict[int, list[torch.fx.Node]] = {1: [], 2: []}
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or node in written or not isinstance(value, torch.Tensor):
            continue
        if value.dtype in (torch.int64, torch.int32) and value.dim() in found:
            found[value.dim()].append(node)
    if len(found[2]) != 1 or len(found[1]) != 1:
        return (
            f"expected one integer input of rank 2 (tokens) and one of rank 1 (positions), found "
            f"{[n.name for n in found[2]]} and {[n.name for n in found[1]]}"
        )
    return found[2][0], found[1][0]


class _Checks(Inserter):
    """Builds the check nodes before ``anchor``, and keeps their zeros and what each refuses."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake: Any) -> None:
        super().__init__(graph, anchor, fake)
        self.zeros: list[torch.fx.Node] = []
        self.described: list[str] = []

    def size(self, tensor: torch.fx.Node, dim: int) -> torch.fx.Node:
        """The caller's size of ``dim``, as a 0-d int64 tensor."""
        size = self.call(torch.ops.aten.sym_size.int, (tensor, dim))
        return self.call("scalar_tensor.default", (size,), {"dtype": torch.int64})

    def in_range(self, value: torch.fx.Node, bound: int, what: str) -> None:
        """Refuse the call unless every element of ``value`` lies in ``[0, bound)``."""
        table = self.call("full.default", ([bound], 0), {"dtype": torch.int64})
        negative = self.call("lt.Scalar", (value, 0))
        below = self.call("add.Scalar", (value, -bound))
        index = self.call("where.self", (negative, below, value))
        self.zeros.append(self.call("index.Tensor", (table, [index])))
        self.described.append(what)


def check_runner_inputs(program: ExportedProgram | torch.fx.GraphModule) -> InputCheckReport:
    """Check the caller's tokens and positions against the runner's contract before any kernel
    reads them (see the module docstring); every reader of the positions reads them checked."""
    gm = program.graph_module if isinstance(program, ExportedProgram) else program
    graph = gm.graph
    report = InputCheckReport(gm)
    length = _cache_length(graph)
    if length is None:
        return report
    inputs = _caller_inputs(graph)
    if isinstance(inputs, str):
        report.skipped = inputs
        return report
    tokens, positions = inputs
    token_shape, position_shape = tokens.meta["val"].shape, positions.meta["val"].shape
    readers = list(positions.users)
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    checks = _Checks(graph, anchor, fake_mode_of(graph))
    n = checks.size(tokens, 1)
    # The runtime resizes an input with any dynamic dim to any shape of its rank that fits its
    # capacity: a static dim of such an input is not enforced, so it is checked too.
    if not all(isinstance(d, int) for d in token_shape):
        batch = checks.call("add.Scalar", (checks.size(tokens, 0), -1))
        checks.in_range(batch, 1, "tokens: batch must be 1")
    if not isinstance(token_shape[1], int):
        count = checks.call("add.Scalar", (n, -1))
        checks.in_range(count, length, f"tokens: between 1 and {length} per call")
    if not isinstance(position_shape[0], int):
        m = checks.size(positions, 0)
        # HF cache_position has one entry per token (the export gave both one symbol); ET input_pos one.
        if str(position_shape[0]) == str(token_shape[1]):
            checks.in_range(checks.call("sub.Tensor", (m, n)), 1, "positions: one per token")
        else:
            checks.in_range(checks.call("add.Scalar", (m, -1)), 1, "positions: one entry")
    checks.in_range(positions, length, f"positions: each in [0, {length})")
    first = checks.call("select_copy.int", (positions, 0, 0))
    last = checks.call("add.Tensor", (first, checks.call("add.Scalar", (n, -1))))
    checks.in_range(last, length, f"positions: the last row written, positions[0] + n - 1, below {length}")
    total = checks.zeros[0]
    for zero in checks.zeros[1:]:
        total = checks.call("add.Tensor", (total, zero))
    checked = checks.call("add.Tensor", (positions, total))
    for reader in readers:
        reader.replace_input_with(positions, checked)
    report.checks = checks.described
    graph.lint()
    gm.recompile()
    return report


def runner_input_checks_pass() -> ProgramPass:
    """This pass as a ``"before_memory_planning"`` :class:`~writeback_core.ProgramPass`, after the
    index checks (whose reordering it must not see: it only adds nodes at the head)."""
    from writeback_passes.backend_names import STOCK_RUNTIME

    return ProgramPass(
        name="check_runner_inputs",
        stage="before_memory_planning",
        run=check_runner_inputs,
        after=("check_indices_first",),
        backends=STOCK_RUNTIME,
        reason="tokens and positions checked before the llama:: kernels read them",
    )

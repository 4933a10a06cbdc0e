"""After lowering: make each buffer the engine wrote in place an in-place ``BUFFER_MUTATION``."""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument

from writeback_trt_copyback._program import output_values, rebuild
from writeback_trt_copyback.crosscheck import EngineAliasing

__all__ = ["settle_aliased"]


def settle_aliased(program: ExportedProgram, aliasing: EngineAliasing) -> ExportedProgram:
    """Declare each aliased buffer's new value to be its own placeholder.

    Algorithm:
      1. For each buffer the engine wrote in place, point every reader of the
         delegate output that holds the write (the engine leaves it unwritten)
         at the buffer's placeholder, which holds the new value once the
         delegate has run.
      2. Give the buffer one ``BUFFER_MUTATION`` whose value is its placeholder:
         replacing the copy-back one (``KEEP_ALL``) or adding it (``PREDICT``,
         where lift dropped it). exir inserts no write-back ``copy_`` for a
         value that is the buffer itself, and still plans the buffer as
         mutable state rather than a constant.
      3. Order mutations: copy-back ones, then in-place ones, then user outputs
         (exir pairs write-back copies with specs in that order). A user output
         that was an aliased write now returns its buffer, and its spec is
         renamed after the buffer's placeholder.

    Refused (``ValueError``): a delegate left with no user once its aliased
    outputs point at the buffers (exir would drop it as dead code, and its
    writes with it); and, naming buffer and reader, because the in-place write
    would change what it reads: a buffer some other node reads after the
    delegate has run (ExecuTorch runs nodes in graph order), e.g. an op kept out
    of the engine that reads the old cache; and anything aliased that is not a
    buffer (run :func:`~writeback_trt_copyback.crosscheck.check_aliasing` first).
    """
    module = copy.deepcopy(program.graph_module)
    nodes = {n.name: n for n in module.graph.nodes}
    order = {n: i for i, n in enumerate(module.graph.nodes)}
    in_place: dict[str, torch.fx.Node] = {}
    for buffer, sites in aliasing.sites.items():
        if buffer.startswith("<"):
            raise ValueError(
                f"the engine wrote {buffer} in place, which is not a buffer; check_aliasing refuses such a program"
            )
        placeholder = nodes[sites[0].input_node]
        _refuse_late_readers(buffer, placeholder, nodes[sites[0].call], order)
        in_place[buffer] = placeholder
        for site in sites:
            if site.output_index is None:
                continue
            for user in list(nodes[site.call].users):
                if user.target is operator.getitem and user.args[1] == site.output_index:
                    user.replace_all_uses_with(placeholder)
                    module.graph.erase_node(user)
    for call in {nodes[site.call] for sites in aliasing.sites.values() for site in sites}:
        if not call.users:
            raise ValueError(
                f"every output of {call.name} is a buffer its engine writes in place, so once "
                "those outputs point at the buffers nothing uses the delegate and ExecuTorch "
                f"would drop it as dead code, losing the writes of {sorted(in_place)}; keep an "
                "op that reads a result of the delegate inside the engine (do not exclude "
                "the op that reads the written cache)"
            )
    outputs = output_values(module)
    specs = list(program.graph_signature.output_specs)
    copies: list[tuple[Any, OutputSpec]] = []
    users: list[tuple[Any, OutputSpec]] = []
    for value, spec in zip(outputs, specs, strict=True):
        if spec.kind is OutputKind.BUFFER_MUTATION and spec.target in in_place:
            continue
        if spec.kind is OutputKind.USER_OUTPUT and isinstance(value, torch.fx.Node) and value.op == "placeholder":
            # A returned aliased write now returns its buffer: name the spec after it.
            spec = OutputSpec(spec.kind, TensorArgument(value.name), spec.target)
        (copies if spec.kind is not OutputKind.USER_OUTPUT else users).append((value, spec))
    settled = [
        (p, OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(p.name), b)) for b, p in sorted(in_place.items())
    ]
    merged = copies + settled + users
    return rebuild(program, module, [v for v, _ in merged], [s for _, s in merged])


def _refuse_late_readers(
    buffer: str, placeholder: torch.fx.Node, call: torch.fx.Node, order: dict[torch.fx.Node, int]
) -> None:
    late = [u.name for u in placeholder.users if u is not call and u.op != "output" and order[u] > order[call]]
    if late:
        raise ValueError(
            f"the engine writes buffer {buffer!r} in place in {call.name}, but {late} read "
            f"{placeholder.name} after it runs and would see the new value, not the old; keep "
            "those ops in the engine, or keep the engine from aliasing this write"
        )

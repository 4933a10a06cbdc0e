"""A static cache's attention computed by the LLM runner's kernels, with the cache laid out for them.

ExecuTorch's LLM runner (``llama_main``, the demo apps, the Python ``TextLLMRunner``) links
two kernels beside the stock ones: ``llama::update_cache(value, cache, start)`` writes ``n``
rows of a ``[1, positions, heads, dim]`` cache in place, and ``llama::custom_sdpa(q, k_cache,
v_cache, start, None, 0, True, scale)`` attends causally over rows ``[0, start + n)`` of it,
in place, grouped-query heads included. A model written with a ``[1, heads, positions, dim]``
cache (ExecuTorch's Llama example, transformers' ``StaticCache``) cannot call them; this pass
(stage ``"exported"``, before :mod:`writeback_passes.bounded_attention`) rewrites the graph
so it does, where it proves the result is the attention's:

- the attention's mask is rows ``[start, start + n)`` of a constant table that is exactly
  causal (row ``i`` opens columns ``0..i`` and nothing else: what ``is_causal`` computes);
- its keys and values are a cache buffer the program owns, ``[1, kv_heads, positions, dim]``,
  written by one ``index_copy_`` along the positions at ``arange(n) + start`` with the same
  ``start`` (the same element of the same one-element input) and the same ``n``, and read by
  nothing but this attention (through a grouped-query ``repeat_interleave`` over the heads);
- no dropout, no ``is_causal`` flag.

The cache buffer is then stored as ``[1, positions, kv_heads, dim]`` (its initial value
transposed; a buffer the program owns is not visible to the caller, and its bytes are the
same), written by ``update_cache`` and read by ``custom_sdpa``. Anything else is left for
:mod:`writeback_passes.bounded_attention`. Nothing is done when the executorch wheel does not
ship the kernels (:func:`writeback_core.llm_runner.load_runner_kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from writeback_core import ProgramPass

from writeback_passes.bounded_attention import _arg, _input_of, _plan, _Refused, _shape

__all__ = ["RunnerAttentionReport", "attention_to_runner_kernels", "runner_attention_pass"]

_aten = torch.ops.aten
_SDPA = _aten.scaled_dot_product_attention.default
_SWAP = [0, 2, 1, 3]


@dataclass
class RunnerAttentionReport:
    """Which attention calls now run on ``llama::custom_sdpa`` (``rewritten``) and why the
    others do not (``refused``: node name -> reason)."""

    rewritten: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


@dataclass
class _Cache:
    buffer: torch.fx.Node
    write: torch.fx.Node  # the index_copy_
    new: torch.fx.Node  # the rows written, [1, heads, n, dim]
    between: list[torch.fx.Node]  # the nodes from the write to the attention


def _element(node: Any) -> tuple[str, int] | None:
    """``(input, index)`` when ``node`` is ``input[i].item()`` of a one-element input."""
    if not isinstance(node, torch.fx.Node) or node.target is not _aten.item.default:
        return None
    picked = node.args[0]
    if not isinstance(picked, torch.fx.Node) or picked.target is not _aten.select.int:
        return None
    source, dim, index = picked.args
    if not isinstance(source, torch.fx.Node) or source.op != "placeholder" or _shape(source) != (1,):
        return None
    if dim not in (0, -1) or index not in (0, -1):
        return None
    return source.name, 0


def _same_element(a: Any, b: Any) -> bool:
    first, second = _element(a), _element(b)
    return first is not None and first == second


def _cache(program: ExportedProgram, node: Any, start: Any, length: Any, what: str) -> _Cache:
    between = []
    seen = node
    if isinstance(seen, torch.fx.Node) and seen.target is _aten.repeat_interleave.self_int:
        if _arg(seen, 2, "dim", None) != 1 or len(seen.users) != 1:
            raise _Refused(f"the {what} is repeated other than over its heads")
        between.append(seen)
        seen = seen.args[0]
    if not isinstance(seen, torch.fx.Node) or seen.target is not _aten.index_copy_.default:
        raise _Refused(f"the {what} is not a cache written by index_copy_")
    write = seen
    buffer, dim, index, new = write.args
    if not isinstance(buffer, torch.fx.Node) or buffer.op != "placeholder" or dim not in (2, -2):
        raise _Refused(f"the {what}'s index_copy_ does not write a buffer along its positions")
    found = _input_of(program, buffer)
    if found is None or found[0] != torch.export.graph_signature.InputKind.BUFFER or found[2] is None:
        raise _Refused(f"the {what}'s cache {buffer.name!r} is not a buffer the program owns")
    if found[2].dim() != 4 or found[2].shape[0] != 1:
        raise _Refused(f"the {what}'s cache {buffer.name!r} is not [1, heads, positions, dim]")
    if len(buffer.users) != 1 or len(write.users) != 1 or (between and write.users.keys() != {between[0]}):
        raise _Refused(f"the {what}'s cache {buffer.name!r} is read by more than this attention")
    if (
        not isinstance(index, torch.fx.Node)
        or index.target is not _aten.add.Tensor
        or not isinstance(index.args[0], torch.fx.Node)
        or index.args[0].target is not _aten.arange.default
        or index.args[0].args[0] is not length
        or not _same_element(index.args[1], start)
    ):
        raise _Refused(f"the {what}'s rows are not written at arange(n) + start of the mask's start")
    if not isinstance(new, torch.fx.Node):
        raise _Refused(f"the {what}'s new rows are not a tensor of the graph")
    return _Cache(buffer, write, new, between)


def _swaps_heads_and_positions(node: Any) -> bool:
    """Whether ``node`` is ``x.transpose(1, 2)`` (or the same permute) of a 4-D ``x``."""
    if not isinstance(node, torch.fx.Node) or len(_shape(node)) != 4:
        return False
    if node.target is _aten.transpose.int:
        return {d % 4 for d in node.args[1:3] if isinstance(d, int)} == {1, 2}
    dims = node.args[1] if len(node.args) > 1 else None
    if node.target is _aten.permute.default and isinstance(dims, (list, tuple)):
        return [d % 4 for d in dims if isinstance(d, int)] == _SWAP
    return False


def _exactly_causal(table: torch.Tensor) -> bool:
    rows, cols = table.shape
    opened = torch.arange(cols)[None, :] <= torch.arange(rows)[:, None]
    if table.dtype == torch.bool:
        return bool((table == opened).all())
    return bool((table[opened] == 0).all() and (table[~opened] == float("-inf")).all())


def _insert(graph: torch.fx.Graph, target: Any, args: tuple[Any, ...], fake: Any, **kwargs: Any) -> torch.fx.Node:
    def val(x: Any) -> Any:
        return x.meta["val"] if isinstance(x, torch.fx.Node) else x

    new = graph.call_function(target, args, kwargs)
    with fake.fake_mode:
        new.meta["val"] = target(*(val(a) for a in args), **{k: val(v) for k, v in kwargs.items()})
    return new


def _relayout(program: ExportedProgram, buffer: torch.fx.Node) -> None:
    """Store the buffer ``[1, heads, positions, dim]`` as ``[1, positions, heads, dim]``."""
    for spec in program.graph_signature.input_specs:
        if getattr(spec.arg, "name", None) == buffer.name and spec.target is not None:
            value = program.state_dict[spec.target]
            program.state_dict[spec.target] = value.transpose(1, 2).contiguous()
            fake = buffer.meta["val"]
            buffer.meta["val"] = fake.fake_mode.from_tensor(program.state_dict[spec.target], static_shapes=True)
            return


def attention_to_runner_kernels(program: ExportedProgram) -> RunnerAttentionReport:
    """Rewrite every attention of ``program`` the module's rules accept onto
    ``llama::update_cache``/``llama::custom_sdpa``; edits ``program`` in place."""
    from writeback_core.llm_runner import load_runner_kernels

    report = RunnerAttentionReport()
    graph = program.graph_module.graph
    attentions = [n for n in graph.nodes if n.op == "call_function" and n.target is _SDPA]
    if not attentions or not load_runner_kernels():
        return report
    for node in attentions:
        try:
            start, length = _plan(program, node)
            mask = _arg(node, 3, "attn_mask", None)
            table = _input_of(program, mask.args[0])
            assert table is not None and table[2] is not None
            if not _exactly_causal(table[2]):
                raise _Refused("the mask table is not exactly causal (custom_sdpa computes is_causal only)")
            if _element(start) is None:
                raise _Refused("the mask's start is not an element of a one-element input")
            key = _cache(program, node.args[1], start, length, "key")
            value = _cache(program, node.args[2], start, length, "value")
        except _Refused as why:
            report.refused[node.name] = str(why)
            continue
        query = node.args[0]
        scale = _arg(node, 6, "scale", None)
        fake = query.meta["val"]
        for cache in (key, value):
            _relayout(program, cache.buffer)
            with graph.inserting_before(cache.write):
                if _swaps_heads_and_positions(cache.new):
                    rows = cache.new.args[0]  # the rows as the model made them, [1, n, heads, dim]
                else:
                    rows = _insert(graph, _aten.permute.default, (cache.new, _SWAP), fake)
                    rows = _insert(graph, _aten.clone.default, (rows,), fake, memory_format=torch.contiguous_format)
                _insert(graph, torch.ops.llama.update_cache.default, (rows, cache.buffer, start), fake)
        with graph.inserting_before(node):
            # The kernel takes the query and gives its result [1, n, heads, dim]: a query
            # transposed from that layout is read untransposed, and a reader transposing the
            # result back reads the kernel's result (what RemoveRedundantTransposes does).
            if _swaps_heads_and_positions(query):
                swapped = query.args[0]
            else:
                swapped = _insert(graph, _aten.permute.default, (query, _SWAP), fake)
            attended = _insert(
                graph,
                torch.ops.llama.custom_sdpa.default,
                (swapped, key.buffer, value.buffer, start, None, 0.0, True, scale),
                fake,
            )
            back = _insert(graph, _aten.permute.default, (attended, _SWAP), fake)
        for reader in list(node.users):
            if _swaps_heads_and_positions(reader):
                reader.replace_all_uses_with(attended)
                graph.erase_node(reader)
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        for cache in (key, value):
            for done in reversed(cache.between):
                graph.erase_node(done)
            graph.erase_node(cache.write)
        report.rewritten.append(node.name)
    if report.rewritten:
        graph.eliminate_dead_code()
        graph.lint()
        program.graph_module.recompile()
    return report


def runner_attention_pass() -> ProgramPass:
    """This pass as an ``"exported"`` :class:`~writeback_core.ProgramPass` (before
    ``bound_attention``)."""
    return ProgramPass(name="runner_attention", stage="exported", run=attention_to_runner_kernels, order=-10)

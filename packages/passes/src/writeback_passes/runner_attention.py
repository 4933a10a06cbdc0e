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

A program that already calls ``custom_sdpa`` on a ``[1, kv_heads, positions, dim]`` cache
through ``transpose(1, 2)`` (optimum-executorch's ``--use_custom_sdpa`` on transformers'
``StaticCache``) makes the kernel read a transposed copy of every whole cache on every call.
Where the key and the value are each a buffer the program owns, written by one ``index_copy_``
along its positions (at any rows) and read by nothing but that transpose (then ``.to`` its own
dtype, a no-op), the buffer is stored ``[1, positions, kv_heads, dim]`` instead, written by
``index_copy_`` along dim 1 at the same rows with the new rows transposed, and handed to the
kernel as it is: the same values at every position, so the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from writeback_core import ProgramPass

from writeback_passes.bounded_attention import AttentionRefused, input_of, read_bound, shape_of
from writeback_passes.graph import arg_value

__all__ = ["RunnerAttentionReport", "attention_to_runner_kernels", "runner_attention_pass"]

_aten = torch.ops.aten
_SDPA = _aten.scaled_dot_product_attention.default
_CUSTOM_SDPA_NAME = "llama.custom_sdpa.default"


def _is_custom_sdpa(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls the runner's ``custom_sdpa`` (registered only once executorch's
    custom ops library is loaded, so matched by name)."""
    return isinstance(node.target, torch._ops.OpOverload) and str(node.target) == _CUSTOM_SDPA_NAME


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
    if not isinstance(source, torch.fx.Node) or source.op != "placeholder" or shape_of(source) != (1,):
        return None
    if dim not in (0, -1) or index not in (0, -1):
        return None
    return source.name, 0


def _same_element(a: Any, b: Any) -> bool:
    first, second = _element(a), _element(b)
    return first is not None and first == second


def _owned_cache_write(program: ExportedProgram, node: Any, what: str) -> _Cache:
    """``node``, checked to be ``index_copy_(buffer, 2, rows, new)`` of a ``[1, heads, positions,
    dim]`` buffer the program owns, read by nothing but ``node`` and written only there, whose
    result has one reader."""
    if not isinstance(node, torch.fx.Node) or node.target is not _aten.index_copy_.default:
        raise AttentionRefused(f"the {what} is not a cache written by index_copy_")
    buffer, dim = node.args[0], node.args[1]
    if not isinstance(buffer, torch.fx.Node) or buffer.op != "placeholder" or dim not in (2, -2):
        raise AttentionRefused(f"the {what}'s index_copy_ does not write a buffer along its positions")
    found = input_of(program, buffer)
    if found is None or found[0] != torch.export.graph_signature.InputKind.BUFFER or found[2] is None:
        raise AttentionRefused(f"the {what}'s cache {buffer.name!r} is not a buffer the program owns")
    if found[2].dim() != 4 or found[2].shape[0] != 1:
        raise AttentionRefused(f"the {what}'s cache {buffer.name!r} is not [1, heads, positions, dim]")
    if len(buffer.users) != 1 or len(node.users) != 1:
        raise AttentionRefused(f"the {what}'s cache {buffer.name!r} is read by more than this attention")
    new = node.args[3]
    if not isinstance(new, torch.fx.Node):
        raise AttentionRefused(f"the {what}'s new rows are not a tensor of the graph")
    return _Cache(buffer, node, new, [])


def _cache(program: ExportedProgram, node: Any, start: Any, length: Any, what: str) -> _Cache:
    between = []
    seen = node
    if isinstance(seen, torch.fx.Node) and seen.target is _aten.repeat_interleave.self_int:
        if arg_value(seen, 2, "dim", None) != 1 or len(seen.users) != 1:
            raise AttentionRefused(f"the {what} is repeated other than over its heads")
        between.append(seen)
        seen = seen.args[0]
    cache = _owned_cache_write(program, seen, what)
    index = cache.write.args[2]
    if between and cache.write.users.keys() != {between[0]}:
        raise AttentionRefused(f"the {what}'s cache {cache.buffer.name!r} is read by more than this attention")
    if (
        not isinstance(index, torch.fx.Node)
        or index.target is not _aten.add.Tensor
        or not isinstance(index.args[0], torch.fx.Node)
        or index.args[0].target is not _aten.arange.default
        or index.args[0].args[0] is not length
        or not _same_element(index.args[1], start)
    ):
        raise AttentionRefused(f"the {what}'s rows are not written at arange(n) + start of the mask's start")
    cache.between = between
    return cache


def _swaps_heads_and_positions(node: Any) -> bool:
    """Whether ``node`` is ``x.transpose(1, 2)`` (or the same permute) of a 4-D ``x``."""
    if not isinstance(node, torch.fx.Node) or len(shape_of(node)) != 4:
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
            # A persistent buffer is in the state dict, a non-persistent one among the constants.
            table: dict[str, Any] = program.state_dict if spec.target in program.state_dict else program.constants
            table[spec.target] = table[spec.target].transpose(1, 2).contiguous()
            fake = buffer.meta["val"]
            buffer.meta["val"] = fake.fake_mode.from_tensor(table[spec.target], static_shapes=True)
            return


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The users of ``node`` but the metadata assertions export adds beside ``.to`` calls."""
    return [user for user in node.users if user.target is not _aten._assert_tensor_metadata.default]


def _same_dtype_conversion(node: Any) -> bool:
    """Whether ``node`` is ``x.to(dtype)`` of an ``x`` already of that dtype (a no-op)."""
    if not isinstance(node, torch.fx.Node) or node.target is not _aten.to.dtype or len(_readers(node)) != 1:
        return False
    source = node.args[0]
    return isinstance(source, torch.fx.Node) and source.meta["val"].dtype == node.meta["val"].dtype


def _transposed_cache(program: ExportedProgram, node: Any, what: str) -> tuple[list[torch.fx.Node], _Cache]:
    """For a ``custom_sdpa`` key or value ``node`` that is a cache written by ``index_copy_``
    along its positions, then transposed (1, 2) (then converted to its own dtype): the nodes
    from the attention back to the write, and the write."""
    chain = []
    seen = node
    while _same_dtype_conversion(seen):
        chain.append(seen)
        seen = seen.args[0]
    if not _swaps_heads_and_positions(seen) or len(_readers(seen)) != 1:
        raise AttentionRefused(f"the {what} is not a cache transposed (1, 2) for this attention alone")
    chain.append(seen)
    return chain, _owned_cache_write(program, seen.args[0], what)


def _reads_transposed(node: Any) -> bool:
    while _same_dtype_conversion(node):
        node = node.args[0]
    return _swaps_heads_and_positions(node)


def _untranspose_caches(program: ExportedProgram, report: RunnerAttentionReport) -> None:
    """Give every ``llama::custom_sdpa`` that reads a ``[1, heads, positions, dim]`` cache
    through a transpose (optimum-executorch's ``--use_custom_sdpa``) the cache itself, stored
    ``[1, positions, heads, dim]`` and written by ``index_copy_`` along dim 1 at the same rows:
    the same values at every position, without the whole-cache transpose per call."""
    graph = program.graph_module.graph
    for node in [n for n in graph.nodes if _is_custom_sdpa(n)]:
        if not (_reads_transposed(node.args[1]) or _reads_transposed(node.args[2])):
            continue  # reads its caches as the kernel lays them out
        try:
            key = _transposed_cache(program, node.args[1], "key")
            value = _transposed_cache(program, node.args[2], "value")
        except AttentionRefused as why:
            report.refused[node.name] = str(why)
            continue
        fake = node.meta["val"]
        for chain, cache in (key, value):
            _relayout(program, cache.buffer)
            with graph.inserting_before(cache.write):
                # The rows transposed (a copy of ``n`` rows): never a view of what the model
                # made them from, which may share storage the write-back analysis cannot see.
                rows = _insert(graph, _aten.permute.default, (cache.new, _SWAP), fake)
                written = _insert(graph, _aten.index_copy_.default, (cache.buffer, 1, cache.write.args[2], rows), fake)
            node.replace_input_with(chain[0], written)
            for done in chain:
                for check in list(done.users):  # a dtype assertion on a value that is gone
                    graph.erase_node(check)
                graph.erase_node(done)
            graph.erase_node(cache.write)
        report.rewritten.append(node.name)


def attention_to_runner_kernels(program: ExportedProgram) -> RunnerAttentionReport:
    """Rewrite every attention of ``program`` the module's rules accept onto
    ``llama::update_cache``/``llama::custom_sdpa``; edits ``program`` in place."""
    from writeback_core.llm_runner import load_runner_kernels

    report = RunnerAttentionReport()
    graph = program.graph_module.graph
    if any(_is_custom_sdpa(n) for n in graph.nodes):
        _untranspose_caches(program, report)
    attentions = [n for n in graph.nodes if n.op == "call_function" and n.target is _SDPA]
    if not attentions or not load_runner_kernels():
        _finish(program, report)
        return report
    for node in attentions:
        try:
            start, length = read_bound(program, node)
            mask = arg_value(node, 3, "attn_mask", None)
            table = input_of(program, mask.args[0])
            assert table is not None and table[2] is not None
            if not _exactly_causal(table[2]):
                raise AttentionRefused("the mask table is not exactly causal (custom_sdpa computes is_causal only)")
            if _element(start) is None:
                raise AttentionRefused("the mask's start is not an element of a one-element input")
            key = _cache(program, node.args[1], start, length, "key")
            value = _cache(program, node.args[2], start, length, "value")
        except AttentionRefused as why:
            report.refused[node.name] = str(why)
            continue
        query = node.args[0]
        scale = arg_value(node, 6, "scale", None)
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
    _finish(program, report)
    return report


def _finish(program: ExportedProgram, report: RunnerAttentionReport) -> None:
    if report.rewritten:
        graph = program.graph_module.graph
        graph.eliminate_dead_code()
        graph.lint()
        program.graph_module.recompile()


def runner_attention_pass() -> ProgramPass:
    """This pass as an ``"exported"`` :class:`~writeback_core.ProgramPass`, before
    ``bound_attention``: an attention that pass bounded no longer matches here, and what
    this pass leaves is for that one."""
    from writeback_passes.backend_names import STOCK_RUNTIME

    return ProgramPass(
        name="runner_attention",
        stage="exported",
        run=attention_to_runner_kernels,
        before=("bound_attention",),
        backends=STOCK_RUNTIME,
        reason="attention on the LLM runner's stock kernels",
    )

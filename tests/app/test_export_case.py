"""`export_case` exports a ModelCase as the case says (strict, keyword arguments, its own
ExportedProgram), refuses state lifted as constants, and `flatten_step_inputs` hands the
runtime a step's inputs in the exported order, refusing a step that does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from writeback.model_build import export_case
from writeback.session import StepInputError, flatten_step_inputs
from writeback_core.exporting import export_model
from writeback_core.lowered import InputSignature
from writeback_core.types import LoweringError, ModelCase


class ListCache(nn.Module):
    """Cache tensors kept in a list attribute that alias registered buffers (as Hugging
    Face's StaticCache keeps them), written with ``index_copy_``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.caches: list[torch.Tensor] = []
        for i in range(2):
            self.register_buffer(f"cache_{i}", torch.zeros(8, 4))
            self.caches.append(getattr(self, f"cache_{i}"))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        for cache in self.caches:
            cache.index_copy_(0, pos, y)
        return self.caches[0].sum(0) + y


def _list_cache_case(strict: bool) -> ModelCase:
    return ModelCase(
        name="list-cache",
        description="caches in a list aliasing registered buffers",
        build=ListCache,
        step_inputs=lambda step: (torch.ones(1, 4), torch.tensor([step])),
        strict=strict,
    )


def test_non_strict_export_of_list_held_caches_is_refused_naming_constants_buffers_and_the_fix() -> None:
    with pytest.raises(LoweringError) as caught:
        export_case(_list_cache_case(strict=False))
    message = str(caught.value)
    assert "model 'list-cache'" in message
    for constant, buffer in (("lifted_tensor_0", "cache_0"), ("lifted_tensor_1", "cache_1")):
        assert (
            f"{constant} (written by aten.index_copy_.default, shares storage with registered buffer '{buffer}')"
            in (message)
        )
    assert "strict=True" in message and "register_buffer" in message


def test_strict_export_of_list_held_caches_mutates_the_registered_buffers() -> None:
    program = export_case(_list_cache_case(strict=True))
    assert program.graph_signature.inputs_to_lifted_tensor_constants == {}
    mutated = set(program.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert mutated == {"cache_0", "cache_1"}


def test_a_program_the_case_exported_itself_is_checked_for_written_constants_too() -> None:
    """No module to compare storage with: the write into a lifted constant is enough."""
    exported = torch.export.export(ListCache().eval(), (torch.ones(1, 4), torch.tensor([0])), strict=False)
    case = ModelCase(
        name="own-export",
        description="",
        build=ListCache,
        step_inputs=lambda step: (torch.ones(1, 4), torch.tensor([step])),
        exported=lambda: exported,
    )
    with pytest.raises(LoweringError, match=r"model 'own-export'.*lifted_tensor_0 \(written by aten.index_copy_"):
        export_case(case)


def test_a_read_only_constant_that_is_not_state_is_exported_without_complaint() -> None:
    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.arange(4.0)  # a plain attribute, neither buffer nor written

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.table

    program = export_model(Table(), (torch.ones(4),))
    assert list(program.graph_signature.inputs_to_lifted_tensor_constants.values()) == ["table"]


def test_exported_returning_something_else_is_a_type_error_naming_the_model() -> None:
    case = ModelCase(
        name="bad-export",
        description="",
        build=ListCache,
        step_inputs=lambda step: (),
        exported=lambda: "not a program",  # type: ignore[arg-type,return-value]  # the mistake under test
    )
    with pytest.raises(TypeError, match=r"model 'bad-export': its exported\(\) returned str"):
        export_case(case)


class Keywords(nn.Module):
    """Positional input, caller-owned state, then keyword-only inputs."""

    def forward(
        self, x: torch.Tensor, state: torch.Tensor, *, pos: torch.Tensor, scale: torch.Tensor, bias: float = 0.0
    ) -> torch.Tensor:
        state.index_copy_(0, pos, x * scale)
        return state.sum(0) + bias


def _keyword_case(kwargs: dict[int, dict[str, object]], inputs: object = None) -> ModelCase:
    return ModelCase(
        name="keywords",
        description="",
        build=Keywords,
        step_inputs=inputs or (lambda step: (torch.full((1, 3), float(step)),)),  # type: ignore[arg-type]
        make_state=lambda: (torch.zeros(4, 3),),
        step_kwargs=lambda step: dict(kwargs.get(step, kwargs[0])),
    )


def _kw(step: int, bias: float = 0.5) -> dict[str, object]:
    return {"scale": torch.tensor(2.0), "pos": torch.tensor([step]), "bias": bias}


def test_step_inputs_flatten_positional_state_then_keywords_in_the_exported_order() -> None:
    # Step 1 gives its keywords in another order than step 0 (the exported order).
    step1 = {"bias": 0.5, "pos": torch.tensor([1]), "scale": torch.tensor(3.0)}
    case = _keyword_case({0: _kw(0), 1: step1})
    program = export_case(case)
    state = (torch.zeros(4, 3),)
    flat = flatten_step_inputs(program, case, 1, state)
    assert len(flat) == 5
    torch.testing.assert_close(flat[0], torch.full((1, 3), 1.0))
    assert flat[1] is state[0]  # the caller's tensor itself, bound in place
    torch.testing.assert_close(flat[2], torch.tensor(3.0))  # scale, first in step 0's order
    torch.testing.assert_close(flat[3], torch.tensor([1]))  # pos
    assert flat[4] == 0.5


def test_a_step_with_another_keyword_is_refused_naming_model_step_and_keywords() -> None:
    case = _keyword_case({0: _kw(0), 2: {"scale": torch.tensor(1.0), "pos": torch.tensor([2]), "bais": 0.5}})
    program = export_case(case)
    with pytest.raises(StepInputError) as caught:
        flatten_step_inputs(program, case, 2, (torch.zeros(4, 3),))
    assert "model 'keywords', step 2" in str(caught.value)
    assert "lacks ['bias']" in str(caught.value) and "adds ['bais']" in str(caught.value)


def test_a_step_input_of_another_shape_is_refused_naming_it_and_both_shapes() -> None:
    case = _keyword_case({0: _kw(0)}, inputs=lambda step: (torch.ones(1, 3 + step),))
    program = export_case(case)
    with pytest.raises(StepInputError) as caught:
        flatten_step_inputs(program, case, 1, (torch.zeros(4, 3),))
    message = str(caught.value)
    assert "model 'keywords', step 1: step input 0 is torch.float32 (1, 4)" in message
    assert "exported for torch.float32 (1, 3)" in message


def test_a_state_tensor_of_another_dtype_is_refused_naming_the_state() -> None:
    case = _keyword_case({0: _kw(0)})
    program = export_case(case)
    with pytest.raises(StepInputError, match=r"step 0: state 0 is torch.float64 \(4, 3\)"):
        flatten_step_inputs(program, case, 0, (torch.zeros(4, 3, dtype=torch.float64),))


def test_a_changed_non_tensor_keyword_is_refused_not_silently_baked_in() -> None:
    """torch.export specializes ``bias``: a step giving another value would get step 0's."""
    case = _keyword_case({0: _kw(0), 3: _kw(3, bias=1.5)})
    program = export_case(case)
    flatten_step_inputs(program, case, 1, (torch.zeros(4, 3),))  # same bias: fine
    with pytest.raises(StepInputError, match=r"step 3: keyword 'bias' is 1.5; .* constant 0.5"):
        flatten_step_inputs(program, case, 3, (torch.zeros(4, 3),))


def test_a_signature_read_once_flattens_and_refuses_each_step_as_the_program_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ExportedProgram.call_spec`` builds a named-tuple type per read: a caller stepping a
    program reads it once, through ``InputSignature.of``."""
    case = _keyword_case({0: _kw(0), 1: _kw(1), 2: _kw(2), 3: _kw(3, bias=1.5)})
    program = export_case(case)
    reads: list[int] = []
    call_spec = type(program).call_spec
    assert isinstance(call_spec, property) and call_spec.fget is not None
    read = call_spec.fget
    monkeypatch.setattr(type(program), "call_spec", property(lambda self: reads.append(1) or read(self)))
    signature = InputSignature.of(program)
    state = (torch.zeros(4, 3),)
    for step in range(3):
        flat = flatten_step_inputs(signature, case, step, state)
        torch.testing.assert_close(flat[0], torch.full((1, 3), float(step)))
        assert flat[1] is state[0]
        torch.testing.assert_close(flat[3], torch.tensor([step]))
    with pytest.raises(StepInputError, match=r"step 3: keyword 'bias' is 1.5; .* constant 0.5"):
        flatten_step_inputs(signature, case, 3, state)
    assert len(reads) == 1


def test_a_step_with_more_positional_inputs_is_refused_naming_both_structures() -> None:
    case = _keyword_case({0: _kw(0)}, inputs=lambda step: (torch.ones(1, 3),) * (1 + step))
    program = export_case(case)
    with pytest.raises(StepInputError, match=r"step 1: the inputs .* have the structure .* exported with"):
        flatten_step_inputs(program, case, 1, (torch.zeros(4, 3),))


def test_a_factory_returning_another_shape_is_told_that_a_model_case_gives_per_step_inputs(tmp_path: Path) -> None:
    from writeback.loading import resolve_model

    source = tmp_path / "model.py"
    source.write_text("import torch\n\ndef make():\n    return torch.nn.Identity(), [torch.ones(2)]\n")
    with pytest.raises(ValueError) as caught:
        resolve_model(f"{source}:make", {})
    message = str(caught.value)
    assert "make() returned a tuple (Identity, list)" in message
    assert "ModelCase (how to give each step its own inputs" in message
    assert "(nn.Module, args, kwargs)" in message


def test_a_factory_tuple_with_keywords_gives_every_step_fresh_copies_of_the_same_inputs(tmp_path: Path) -> None:
    from writeback.loading import resolve_model

    source = tmp_path / "model.py"
    source.write_text(
        "import torch\n\ndef make():\n    return torch.nn.Identity(), (torch.ones(2),), {'scale': torch.tensor(2.0)}\n"
    )
    case = resolve_model(f"{source}:make", {})
    assert case.same_inputs_every_step
    first, second = case.example_kwargs(0), case.example_kwargs(5)
    assert first["scale"] is not second["scale"]  # no step sees another step's writes
    torch.testing.assert_close(second["scale"], torch.tensor(2.0))
    torch.testing.assert_close(case.step_inputs(3)[0], torch.ones(2))


def test_decomposed_is_made_once_per_program_its_mutations_named_as_in_core_aten_and_released_with_it() -> None:
    """``writeback_core.program_passes.decomposed``: the same decomposed program for every caller
    (explain's rows and each plugin's column), the core ATen one (``add_`` of the buffer is a
    functional ``add`` written back), and dropped once the exported program is."""
    import gc
    import weakref

    from writeback_core.mutations import find_mutations
    from writeback_core.program_passes import decomposed

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total.add_(x)
            return self.total * 2

    program = export_model(Counter(), (torch.ones(3),))
    shared = decomposed(program)
    assert decomposed(program) is shared
    (mutation,) = find_mutations(shared)
    value = next(n for n in shared.graph_module.graph.nodes if n.name == mutation.value)
    assert (mutation.target, value.target) == ("total", torch.ops.aten.add.Tensor)
    program_ref, shared_ref = weakref.ref(program), weakref.ref(shared)
    del program, shared, value
    gc.collect()
    assert program_ref() is None and shared_ref() is None


def test_a_program_reading_a_position_from_a_tensor_lowers_again_after_to_edge_no_pending_symbol_error() -> None:
    """``to_edge`` runs ``llama::update_cache`` (start ``pos[0].item()``) on fake tensors and
    leaves the unbacked symbols it made pending in the shape environment the program's
    values share; the next trace of the same program took them for its own and failed
    (``PendingUnbackedSymbolNotFound``), so ``writeback explain`` of a decoder using
    ExecuTorch's custom ops crashed at its second lowering. Inside
    ``unbacked_symbols_settled`` every ``to_edge`` of the program succeeds and gives the same
    graph, each cache still written by the op."""
    from executorch.exir import to_edge
    from writeback_core.program_passes import unbacked_symbols_settled
    from writeback_core.quiet import known_warnings_ignored

    from tests.core.update_cache_model import make

    program = export_model(*make())
    graphs = []
    for _ in range(3):
        with known_warnings_ignored(), unbacked_symbols_settled(program):
            edge = to_edge(program).exported_program()
        calls = [n for n in edge.graph_module.graph.nodes if n.op == "call_function"]
        graphs.append([f"{n.target}({n.args[0] if n.args else ''})" for n in calls])
    assert graphs[0] == graphs[1] == graphs[2]
    assert graphs[0].count("auto_functionalized_v2(llama.update_cache.default)") == 2, graphs[0]


def test_graphs_copy_shares_the_weights_and_changing_its_graph_leaves_the_programs_unchanged() -> None:
    """``writeback_core.program_passes.graphs_copy``: the copy's weights are the program's own tensors
    (no copy of them at any model size), its graph is its own (a node erased there is still
    in the program), for an exported program and for exir's edge program manager alike."""
    from executorch.exir import to_edge
    from writeback_core.program_passes import graphs_copy

    program = export_model(ListCache(), (torch.ones(1, 4), torch.tensor([1])), strict=True)
    edge = to_edge(program)
    pairs = [(program, graphs_copy(program)), (edge.exported_program(), graphs_copy(edge).exported_program())]
    for original, copied in pairs:
        for name, tensor in original.state_dict.items():
            assert copied.state_dict[name] is tensor, name
        before = [n.name for n in original.graph_module.graph.nodes]
        graph = copied.graph_module.graph
        assert [n.name for n in graph.nodes] == before and graph is not original.graph_module.graph
        output = graph.output_node()
        output.args = ((),)
        graph.eliminate_dead_code()
        assert len(graph.nodes) < len(before)
        assert [n.name for n in original.graph_module.graph.nodes] == before

"""Declaring copy-back values as buffer mutations: idempotent, paired by name, arity kept.

Programs here have no engine (``dryrun``, or declaration alone), so they run in
stock ``executorch.runtime``; buffers are read back with ``Method.get_attribute``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument
from writeback.zoo import EmaStat
from writeback_trt_copyback import (
    COPY_BACK_RECORDS,
    KVAliasEngine,
    UninitializedCopyBackWarning,
    declare_copy_back,
    lift_mutated_buffers,
)
from writeback_trt_copyback._program import output_values, rebuild

from tests.trt_copyback.conftest import compile_quietly, export, stock_run
from tests.trt_copyback.models import Hybrid, Overwrite, ReturnsWritten, ThreeStates, hybrid_inputs


def _lifted(module: torch.nn.Module, *args: Any) -> ExportedProgram:
    return lift_mutated_buffers(export(module, args), KVAliasEngine()).program


def _declare(program: ExportedProgram) -> ExportedProgram:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UninitializedCopyBackWarning)
        return declare_copy_back(program)


def _specs(program: ExportedProgram) -> list[tuple[str, str | None]]:
    return [(s.kind.name, s.target) for s in program.graph_signature.output_specs]


def _run_stock(
    program: ExportedProgram, buffers: list[str], inputs: list[tuple[Any, ...]]
) -> Iterator[tuple[list[Any], dict[str, torch.Tensor]]]:
    """Run ``program`` (edge + executorch, no delegate) in stock executorch.runtime."""
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    # Every buffer keeps its initial value (the remedy the warning names; tested below).
    placeholders = list(program.graph_signature.inputs_to_buffers)
    config = ExecutorchBackendConfig(
        emit_mutable_buffer_names=True, passes=[InitializedMutableBufferPass(placeholders)]
    )
    et = to_edge(program).to_executorch(config)
    method = stock_run(et)
    for args in inputs:
        outputs = method.execute(list(args))
        yield outputs, {b: method.buffer(b) for b in buffers}


def test_declaration_is_idempotent() -> None:
    lifted = _lifted(ThreeStates(), torch.tensor([1.0]))
    once = _declare(lifted)
    assert _declare(once) is once
    assert _specs(once) == [
        ("BUFFER_MUTATION", "a"),
        ("BUFFER_MUTATION", "b"),
        ("BUFFER_MUTATION", "c"),
        ("USER_OUTPUT", None),
    ]
    # The lifted program itself is untouched, so declaring it again gives the same answer.
    assert _specs(_declare(lifted)) == _specs(once)


@pytest.mark.parametrize("build", [ThreeStates, ReturnsWritten], ids=["other_output", "same_value"])
def test_second_declaration_does_not_destroy_a_user_output(build: type[torch.nn.Module]) -> None:
    x = torch.tensor([2.0])
    twice = _declare(_declare(_lifted(build(), x)))
    kinds = [k for k, _ in _specs(twice)]
    assert kinds.count("USER_OUTPUT") == 1 and kinds[-1] == "USER_OUTPUT"
    eager = build().eval()
    with torch.no_grad():
        want = eager(x)
    ((outputs, _),) = _run_stock(twice, [], [(x,)])
    assert len(outputs) == 1
    torch.testing.assert_close(outputs[0], want)


def _declare_by_hand(program: ExportedProgram, buffer: str, keep_value: bool) -> ExportedProgram:
    """What another exporter does: declare ``buffer`` itself, taking its trailing value or not."""
    (record,) = [r for r in program.graph_module.meta[COPY_BACK_RECORDS]["records"] if r["buffer"] == buffer]
    module = program.graph_module
    pairs = list(zip(output_values(module), program.graph_signature.output_specs, strict=True))
    value = next(v for v, s in pairs if s.kind is OutputKind.USER_OUTPUT and s.arg.name == record["value"])
    if not keep_value:
        pairs = [(v, s) for v, s in pairs if not (s.kind is OutputKind.USER_OUTPUT and s.arg.name == record["value"])]
    spec = OutputSpec(OutputKind.BUFFER_MUTATION, TensorArgument(value.name), buffer)
    pairs.insert(0, (value, spec))
    meta = dict(module.meta[COPY_BACK_RECORDS])
    out_spec = program.call_spec.out_spec
    return rebuild(
        program, module, [v for v, _ in pairs], [s for _, s in pairs], out_spec=out_spec, meta={COPY_BACK_RECORDS: meta}
    )


@pytest.mark.parametrize("keep_value", [False, True], ids=["value_taken", "value_left"])
def test_mixed_declared_and_undeclared_buffers_pair_each_value_with_its_own_buffer(
    keep_value: bool,
) -> None:
    x = torch.tensor([1.5])
    partly = _declare_by_hand(_lifted(ThreeStates(), x), "b", keep_value)
    declared = _declare(partly)
    targets = [str(t) for k, t in _specs(declared) if k == "BUFFER_MUTATION"]
    assert sorted(targets) == ["a", "b", "c"] and len(targets) == 3
    nodes = {n.name: n for n in declared.graph.nodes}
    shapes = {"a": (3,), "b": (2, 2), "c": (5,)}
    for spec in declared.graph_signature.output_specs:
        if spec.kind is OutputKind.BUFFER_MUTATION:
            assert tuple(nodes[spec.arg.name].meta["val"].shape) == shapes[spec.target]
    eager = ThreeStates().eval()
    steps = [(torch.tensor([float(s + 1)]),) for s in range(3)]
    for (outputs, buffers), args in zip(_run_stock(declared, ["a", "b", "c"], steps), steps, strict=True):
        with torch.no_grad():
            want = eager(*args)
        torch.testing.assert_close(outputs[0], want)
        for name, value in eager.named_buffers():
            torch.testing.assert_close(buffers[name], value)


def test_declaration_refuses_a_program_edited_after_lift_and_changes_nothing() -> None:
    lifted = _lifted(ThreeStates(), torch.tensor([1.0]))
    module = lifted.graph_module
    pairs = list(zip(output_values(module), lifted.graph_signature.output_specs, strict=True))
    # Someone dropped the last trailing output (c's new value, node ``sub``).
    edited = rebuild(lifted, module, [v for v, _ in pairs[:-1]], [s for _, s in pairs[:-1]], meta=dict(module.meta))
    before = _specs(edited)
    with pytest.raises(ValueError, match=r"missing \['sub'\].*edited after lift_mutated_buffers"):
        _declare(edited)
    assert _specs(edited) == before


def test_compiled_program_keeps_the_model_arity() -> None:
    compiled = compile_quietly(export(Hybrid(), hybrid_inputs(0)))
    program = compiled.exported_program()
    kinds = [s.kind for s in program.graph_signature.output_specs]
    assert kinds.count(OutputKind.USER_OUTPUT) == 2  # logits, centered: the model's two
    # The copy-back values are still on the graph, as buffer mutations for exporters.
    values = {
        s.target: s.arg.name for s in program.graph_signature.output_specs if s.kind is OutputKind.BUFFER_MUTATION
    }
    on_graph = {getattr(v, "name", None) for v in output_values(program.graph_module)}
    assert set(compiled.copy_back) <= set(values) and set(values.values()) <= on_graph
    et = compiled.to_executorch()
    assert len(et.exported_program().graph_signature.user_outputs) == 2


def test_lifted_program_returns_the_copy_back_values_until_declared() -> None:
    lifted = _lifted(ThreeStates(), torch.tensor([1.0]))
    assert len(lifted.graph_signature.user_outputs) == 4  # x * 3, then a, b, c's new values
    assert len(_declare(lifted).graph_signature.user_outputs) == 1


def test_warning_names_read_before_written_buffers_with_remedy_and_caveat_together() -> None:
    lifted = _lifted(EmaStat(), torch.randn(4, 8))
    with pytest.warns(UninitializedCopyBackWarning) as caught:
        declare_copy_back(lifted)
    (message,) = [str(w.message) for w in caught if w.category is UninitializedCopyBackWarning]
    assert "'running_mean'" in message and "'steps'" in message
    assert "serializes only their shape and dtype" in message
    assert "InitializedMutableBufferPass(['b_running_mean', 'b_steps'])" in message
    assert "GPU" in message and "crashes" in message


@pytest.mark.parametrize("build", [Overwrite], ids=["pure_overwrite"])
def test_no_warning_for_copy_back_buffers_never_read(build: type[torch.nn.Module]) -> None:
    lifted = _lifted(build(), torch.randn(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UninitializedCopyBackWarning)
        declare_copy_back(lifted)


def test_following_the_warning_keeps_the_initial_value() -> None:
    class Trained(EmaStat):
        def __init__(self) -> None:
            super().__init__()
            self.running_mean.fill_(3.0)

    x = torch.full((4, 8), 1.0)
    compiled = compile_quietly(export(Trained(), (x,)), dryrun=True)
    kept = stock_run(compiled.to_executorch(init_buffers=["b_running_mean", "b_steps"]))
    lost = stock_run(compiled.to_executorch())
    with torch.no_grad():
        want = Trained().eval()(x)  # x - 3
    torch.testing.assert_close(kept.execute([x])[0], want)
    assert not torch.allclose(lost.execute([x])[0], want)


def test_write_only_copy_back_buffer_reaches_the_pte_and_is_updated() -> None:
    # Nothing reads ``last``: after lift its placeholder has no user at all, yet the
    # declared mutation must keep it in the program and the runtime must write it.
    compiled = compile_quietly(export(Overwrite(), (torch.ones(4),)), dryrun=True)
    method = stock_run(compiled.to_executorch())
    for step in range(2):
        x = torch.arange(4.0) + step
        (out,) = method.execute([x])
        torch.testing.assert_close(out, x + 1.0)
        torch.testing.assert_close(method.buffer("last"), x * 2.0)

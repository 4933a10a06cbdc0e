"""Lowering and running helpers shared by the pass tests: real export, real exir, real runtime."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import writeback_passes
from executorch.exir import (
    EdgeCompileConfig,
    EdgeProgramManager,
    ExecutorchBackendConfig,
    ExecutorchProgramManager,
    to_edge,
)
from executorch.runtime import Runtime
from torch.export import ExportedProgram

# The passes of writeback-passes, in the order a lowering onto the stock runtime's kernels
# (portable, xnnpack, no backend) runs them: what `writeback run` printed before passes said
# their order by name, when every pass ran for every backend.
PASSES_IN_ORDER = (
    "runner_attention",
    "bound_attention",
    "functional_copies_as_views",
    "scale_smaller_operand",
    "reinplace_delegate_input_mutations",
    "reinplace_state_writes",
    "copies_as_views",
    "insert_write_back_early",
    "check_indices_first",
    "check_runner_inputs",
    "whole_state_writes",
)

# Worked out by hand from what each pass is for: a delegate's backend (the example backend)
# writes state itself, so it runs only the passes that serve any delegate: reshape copies made
# views before and after partitioning, the write-backs of the states its delegate writes in
# place dropped, and early write-back.
DELEGATE_PASSES = (
    "functional_copies_as_views",
    "reinplace_delegate_input_mutations",
    "copies_as_views",
    "insert_write_back_early",
)

# MLX runs the same passes as any delegate's backend: its delegate bounds attention to the
# window its masks leave (tests/mlx_backend/test_window.py) and moves attention's scale to
# the smaller operand in its own preprocess (tests/mlx_backend/test_fast_attention.py), so it
# runs none of the five passes for the stock runtime's kernels (the LLM runner's attention,
# bound_attention, scale_smaller_operand, in-place state writes, indices checked first).
MLX_PASSES = DELEGATE_PASSES

# What each backend's lowering runs, by the backend's name (None: no backend).
PASSES_BY_BACKEND: dict[str | None, tuple[str, ...]] = {
    "portable": PASSES_IN_ORDER,
    "xnnpack": PASSES_IN_ORDER,
    None: PASSES_IN_ORDER,
    "mlx": MLX_PASSES,
    "example": DELEGATE_PASSES,
}


def export_module(module: torch.nn.Module, args: tuple[Any, ...]) -> ExportedProgram:
    """torch.export as the project does: eval, no grad, non-strict."""
    module = module.eval().requires_grad_(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(module, args, strict=False)


def edge_of(module: torch.nn.Module, args: tuple[Any, ...], check_ir: bool = True) -> EdgeProgramManager:
    """The edge program manager of ``module``."""
    return to_edge(export_module(module, args), compile_config=EdgeCompileConfig(_check_ir_validity=check_ir))


def lower(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    early: bool = True,
    **config: Any,
) -> ExecutorchProgramManager:
    """``to_executorch`` with (``early``) or without the registered writeback passes.

    Mutable buffer names are emitted so a test can read the runtime's state.
    """
    backend_config = ExecutorchBackendConfig(emit_mutable_buffer_names=True, **config)
    edge = edge_of(module, args)
    if early:
        return writeback_passes.to_executorch(edge, backend_config)
    return edge.to_executorch(backend_config)


def call_positions(program: ExecutorchProgramManager) -> list[str]:
    """Names of the ``call_function`` nodes of the lowered forward graph, in order."""
    graph = program.exported_program().graph
    return [n.name for n in graph.nodes if n.op == "call_function"]


def _as_list(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return list(value)


def assert_runs_like_eager(
    program: ExecutorchProgramManager,
    module: torch.nn.Module,
    inputs: Callable[[int], tuple[torch.Tensor, ...]],
    calls: int = 4,
    caller_state: Sequence[torch.Tensor] = (),
    atol: float = 1e-5,
) -> None:
    """Run ``program`` in ``executorch.runtime`` and ``module`` eagerly, call by call.

    Outputs must match after every call, and so must every mutated buffer
    (read back with the method's ``get_attribute``). Caller-owned state
    (``caller_state``) is threaded through the returned state outputs, since
    stock ``executorch.runtime`` does not write the caller's tensor: those
    returned values are compared with the eager model's in-place updated state.
    """
    method = Runtime.get().load_program(program.buffer).load_method("forward")
    eager_state = [s.clone() for s in caller_state]
    runtime_state = [s.clone() for s in caller_state]
    buffers = dict(module.named_buffers())
    mutated = _mutated_buffers(program)
    for call in range(calls):
        step = inputs(call)
        with torch.no_grad():
            expected = _as_list(module(*step, *eager_state))
        got = list(method.execute([*step, *runtime_state]))
        returned, outputs = got[: len(runtime_state)], got[len(runtime_state) :]
        assert len(outputs) == len(expected), f"call {call}: output count"
        for index, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
            torch.testing.assert_close(out, ref, atol=atol, rtol=1e-5, msg=f"call {call} output {index}")
        for index, (new, ref) in enumerate(zip(returned, eager_state, strict=True)):
            torch.testing.assert_close(new, ref, atol=atol, rtol=1e-5, msg=f"call {call} state {index}")
        runtime_state = [t.clone() for t in returned]
        for fqn in mutated:
            got_state = method._method.get_attribute(fqn)  # Method exposes only execute/metadata
            torch.testing.assert_close(got_state, buffers[fqn], atol=atol, rtol=1e-5, msg=f"call {call} {fqn}")


def _mutated_buffers(program: ExecutorchProgramManager) -> list[str]:
    from torch.export.graph_signature import OutputKind

    signature = program.exported_program().graph_signature
    return [str(s.target) for s in signature.output_specs if s.kind is OutputKind.BUFFER_MUTATION]

"""Shared helpers of the trt-copyback tests: export, compile to the kv-alias engine, run.

Programs with the engine run in the pybind-runtime (the only runtime that loads
Python delegates); programs without it also run in stock ``executorch.runtime``.
Buffers are read back out of the runtime's own memory: stock through
``Method.get_attribute`` (``emit_mutable_buffer_names``), the pybind-runtime
through :class:`ProbeDelegate`, the real kv-alias delegate keeping the
zero-copy views of its inputs (the runtime's buffers) that it was handed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.export import ExportedProgram
from writeback_core.registry import Registry, hookimpl, load_registry
from writeback_core.types import RuntimeDelegate
from writeback_trt_copyback import CompiledProgram, KVAliasEngine, Mode, compile_for_engine
from writeback_trt_copyback.kv_alias_delegate import KVAliasRuntimeDelegate


def export(module: torch.nn.Module, args: tuple[Any, ...], dynamic_shapes: Any = None) -> ExportedProgram:
    """``torch.export`` (non-strict, eval, no grad), as the pipeline expects."""
    module = module.eval().requires_grad_(False)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(module, args, strict=False, dynamic_shapes=dynamic_shapes)


def compile_quietly(
    program: ExportedProgram,
    engine: KVAliasEngine | None = None,
    mode: Mode = Mode.PREDICT,
    dryrun: bool = False,
) -> CompiledProgram:
    """``compile_for_engine`` with the uninitialized-buffer warning silenced (tested on its own)."""
    from writeback_trt_copyback import UninitializedCopyBackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UninitializedCopyBackWarning)
        return compile_for_engine(program, engine or KVAliasEngine(), mode=mode, dryrun=dryrun)


class ProbeDelegate(KVAliasRuntimeDelegate):
    """The real kv-alias delegate; after each call it keeps its inputs, by placeholder name.

    The runtime hands ``execute`` zero-copy views of its own memory, so after
    ``Method.execute`` returns, a kept view of a buffer input shows that
    buffer as the runtime holds it (write-back copies included).
    """

    def __init__(self) -> None:
        self.views: dict[str, Any] = {}

    def execute(self, handle: Any, args: Sequence[Any]) -> None:
        super().execute(handle, args)
        self.views = dict(zip(handle.blob.inputs, args[: len(handle.blob.inputs)], strict=True))


class _ProbePlugin:
    writeback_name = "trt-copyback-probe"

    def __init__(self, delegate: ProbeDelegate) -> None:
        self.delegate = delegate

    @hookimpl
    def writeback_runtime_delegates(self) -> Sequence[RuntimeDelegate]:
        return [self.delegate]


class EngineRun:
    """A compiled program loaded in the pybind-runtime, with its buffers readable."""

    def __init__(self, compiled: CompiledProgram, init_buffers: Sequence[str] = ()) -> None:
        from writeback_pybind_runtime import Runtime

        self.compiled = compiled
        self.probe = ProbeDelegate()
        registry: Registry = load_registry(entry_points=False, plugins=[_ProbePlugin(self.probe)])
        self.runtime = Runtime(registry)
        self.runtime.register_delegates(registry)
        et = compiled.to_executorch(init_buffers=init_buffers)
        self.program = et.exported_program()
        self.method = self.runtime.load_program(bytes(et.buffer)).load_method("forward")
        sig = compiled.exported_program().graph_signature
        self.placeholder_of = {b: p for p, b in sig.inputs_to_buffers.items()}

    def __call__(self, *args: Any) -> list[Any]:
        return list(self.method.execute(list(args)))

    def buffer(self, name: str) -> torch.Tensor:
        """The runtime's buffer ``name`` (fully qualified), as it holds it now."""
        placeholder = self.placeholder_of[name]
        if placeholder not in self.probe.views:
            raise KeyError(
                f"buffer {name!r} ({placeholder}) is not an input of the engine; inputs: {sorted(self.probe.views)}"
            )
        return self.probe.views[placeholder].clone()


class StockMethod:
    """``forward`` of a program loaded in stock ``executorch.runtime``.

    Keeps the loaded program alive: a stock ``Method`` does not, and using one
    after its program is collected reads freed memory.
    """

    def __init__(self, program: Any) -> None:
        from executorch.runtime import Runtime

        self.program = Runtime.get().load_program(bytes(program.buffer))
        self.method = self.program.load_method("forward")

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        return list(self.method.execute(list(inputs)))

    def buffer(self, name: str) -> torch.Tensor:
        """Mutable buffer ``name`` (needs ``emit_mutable_buffer_names``)."""
        value: torch.Tensor = self.method._method.get_attribute(name)
        return value.clone()


def stock_run(program: Any) -> StockMethod:
    """Load an ``ExecutorchProgramManager`` in stock ``executorch.runtime``."""
    return StockMethod(program)


@pytest.fixture
def engine() -> KVAliasEngine:
    return KVAliasEngine()


Export = Callable[..., ExportedProgram]


def note(prefix: str) -> Callable[[str], str]:
    """An ``assert_close`` message that says where: ``"<prefix>: <torch's message>"``."""
    return lambda message: f"{prefix}: {message}"


def run_against_eager(
    build: Callable[[], torch.nn.Module],
    inputs: Callable[[int], tuple[Any, ...]],
    steps: int = 3,
    engine: KVAliasEngine | None = None,
    mode: Mode = Mode.PREDICT,
    check_buffers: bool = True,
) -> CompiledProgram:
    """Compile ``build()`` for the engine, run ``steps`` calls in the pybind-runtime and compare
    every output (and, with ``check_buffers``, every buffer) with a second ``build()`` run eagerly."""
    compiled = compile_quietly(export(build(), inputs(0)), engine, mode)
    run = EngineRun(compiled, init_buffers=[b.placeholder for b in compiled.lifted.buffers])
    eager = build().eval()
    for step in range(steps):
        args = inputs(step)
        got = run(*args)
        with torch.no_grad():
            want = eager(*args)
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        assert len(got) == len(want), f"step {step}: {len(got)} outputs, eager has {len(want)}"
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, msg=note(f"step {step} output"))
        if check_buffers:
            for name, w in eager.named_buffers():
                torch.testing.assert_close(run.buffer(name), w, msg=note(f"step {step} {name}"))
    return compiled

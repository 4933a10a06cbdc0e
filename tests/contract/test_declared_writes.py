"""A delegate writes an input only where its lowering declared it (the in-place compile spec,
or its engine's ``aliased_io``): every in-tree delegate (MLX, the example backend, the kv-alias
engine of trt-copyback) is run on its own on fresh inputs and the inputs it changed are
compared with what it declared; a kv-alias blob whose updates and ``aliased_io`` disagree is
refused at load, before it writes anything."""

from __future__ import annotations

import dataclasses
import importlib
import json
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, seed, settings
from writeback_core import exporting, lowering
from writeback_core.blob import BlobError
from writeback_core.registry import Registry, load_registry
from writeback_core.types import LoweringError
from writeback_testing.contract import ContractViolation, check_declared_writes
from writeback_testing.observations import InvalidProgram, eager_reference
from writeback_testing.program_spec import Built, build
from writeback_testing.strategies import programs

PLUGINS = (
    "writeback_passes.plugin",
    "writeback_pybind_runtime.plugin",
    "writeback_example_backend.plugin",
    "writeback_trt_copyback.plugin",
)


class Caches(torch.nn.Module):
    """A 4-D cache buffer written at ``pos`` (the write kv-alias aliases), a caller cache written
    by ``index_copy_``, and a rolling state shifted by one each call."""

    k: torch.Tensor
    roll: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.arange(16, dtype=torch.float32).reshape(1, 2, 4, 2) * 0.5)
        self.register_buffer("roll", torch.arange(4, dtype=torch.float32))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.k.index_copy_(2, pos, x[:4].reshape(1, 2, 1, 2))
        cache.index_copy_(0, pos, x[4:7].reshape(1, 3))
        self.roll.copy_(torch.cat([self.roll[1:], x[7:8]]))
        return (self.k.sum(2) + cache.sum(), self.roll * 2)


def _registry(*extra: str) -> Registry:
    return load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in (*PLUGINS, *extra)])


def _args() -> tuple[torch.Tensor, ...]:
    return (torch.randn(8), torch.tensor([1]), torch.zeros(4, 3))


def _backend_program(registry: Registry, backend: str, module: torch.nn.Module, args: tuple[object, ...]) -> Any:
    exported = exporting.export_model(module, args)
    return lowering.lower(exported, registry, registry.backends()[backend], "state").program


def _engine_program(registry: Registry, module: torch.nn.Module, args: tuple[object, ...]) -> Any:
    engine = registry.engines()["kv-alias"]
    exported = exporting.export_model(module, args)
    with warnings.catch_warnings():
        # Copy-back buffers read before written: the lowering path keeps their initial values.
        warnings.filterwarnings("ignore", "copy-back buffers .* are read before they are written", UserWarning)
        edge = registry.hook.writeback_lower_for_engine(engine=engine, program=exported)
    assert not isinstance(edge, str), edge
    # An engine is no backend: its lowering runs the passes for none, as the fuzzer's does.
    return lowering.to_executorch(edge, registry=registry, plan="planned", backend=None, warn_copies=False)


def test_kv_alias_delegate_writes_exactly_the_inputs_its_aliased_io_declares() -> None:
    registry = _registry()
    records = check_declared_writes(_engine_program(registry, Caches(), _args()), registry)
    assert records, "the engine took no partition"
    # The 4-D cache write at pos is aliased (declared and done); nothing else is written.
    assert any(r.written for r in records), records
    assert all(r.written == r.declared for r in records), records


def test_example_backend_writes_only_declared_inputs() -> None:
    registry = _registry()
    records = check_declared_writes(_backend_program(registry, "example", Caches(), _args()), registry)
    assert records, "the example backend took no partition"
    assert all(r.written <= r.declared for r in records), records


def test_mlx_delegate_writes_only_declared_inputs() -> None:
    pytest.importorskip("mlx.core")
    registry = _registry("writeback_mlx_backend.plugin")
    records = check_declared_writes(_backend_program(registry, "mlx", Caches(), _args()), registry)
    assert records, "MLX took no partition"
    assert any(r.declared for r in records), records
    assert all(r.written <= r.declared for r in records), records


# --- load-time refusal of a kv-alias blob whose writes and declaration disagree -------------


def _kv_alias_module(registry: Registry) -> object:
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    program = _engine_program(registry, Caches(), _args())
    for _, module, _ in get_lowered_submodules(program.exported_program().graph_module):
        if json.loads(bytes(module.processed_bytes))["aliased_io"]:
            return module
    raise AssertionError("no kv-alias delegate aliases a write")


def _init(registry: Registry, module: object, blob: dict[str, object]) -> None:
    delegate = registry.runtime_delegates()[module.backend_id]  # type: ignore[attr-defined]
    specs = {s.key: bytes(s.value) for s in module.compile_specs}  # type: ignore[attr-defined]
    delegate.init(json.dumps(blob).encode(), specs)


def test_kv_alias_blob_writing_an_undeclared_input_is_refused_at_load_no_partial_write() -> None:
    registry = _registry()
    module = _kv_alias_module(registry)
    blob = json.loads(bytes(module.processed_bytes))  # type: ignore[attr-defined]
    _init(registry, module, blob)  # as lowered: accepted
    undeclared = dict(blob, aliased_io={})
    with pytest.raises(BlobError, match=r"writes input .* in place, but aliased_io declares"):
        _init(registry, module, undeclared)


def test_kv_alias_blob_declaring_a_write_no_step_performs_is_refused_at_load() -> None:
    registry = _registry()
    module = _kv_alias_module(registry)
    blob = json.loads(bytes(module.processed_bytes))  # type: ignore[attr-defined]
    extra = dict(blob, aliased_io={**blob["aliased_io"], "update:nothing": 0})
    with pytest.raises(BlobError, match="no update step writes it"):
        _init(registry, module, extra)


# --- generated programs ----------------------------------------------------------------------


@pytest.mark.slow  # a lowering per program and target
@seed(77)
@settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(programs(max_statements=5))
def test_generated_programs_every_delegate_writes_only_declared_inputs(spec: object) -> None:
    built: Built = build(spec)  # type: ignore[arg-type]
    try:
        eager_reference(built)
    except InvalidProgram:
        reject()
    registry = _registry()
    args = (*built.step_inputs(0), *built.make_state())
    try:
        engine = _engine_program(registry, built.new_module(), args)
        example = _backend_program(registry, "example", built.new_module(), args)
    except (LoweringError, AssertionError):
        reject()  # a program an engine or exir refuses: the oracle's business, not this rule's
    try:
        for program in (engine, example):
            check_declared_writes(program, registry)
    except ContractViolation as error:
        raise AssertionError(f"{error}\n--- program ---\n{built.source}") from error


class DividesByInput(torch.nn.Module):
    """A cache written at ``pos // d``: on the checker's fresh inputs (integers zero) the
    delegate divides by zero, as eager would on those inputs."""

    k: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 2, 4, 2))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.k.index_copy_(2, pos // d, x[:4].reshape(1, 2, 1, 2))
        return (self.k.sum(2),)


def test_delegate_refusing_the_fresh_inputs_is_recorded_and_changes_nothing() -> None:
    registry = _registry()
    args = (torch.randn(8), torch.tensor([2]), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        DividesByInput()(torch.randn(8), torch.tensor([0]), torch.tensor([0]))  # eager refuses it too
    records = check_declared_writes(_engine_program(registry, DividesByInput(), args), registry)
    refused = [r for r in records if r.refused is not None]
    assert refused, records
    assert all("ZeroDivisionError" in (r.refused or "") and r.written == frozenset() for r in refused), refused


def test_declared_writes_record_is_a_plain_value() -> None:
    from writeback_testing.contract import DelegateWrites

    record = DelegateWrites(0, "b", frozenset({1}), frozenset({1, 2}))
    assert record.undeclared == frozenset({2})
    assert dataclasses.replace(record, written=frozenset({1})).undeclared == frozenset()

"""The hooks `writeback run` is assembled from: writeback_program_passes (run by core's one
lowering path, from any plugin), writeback_runtimes (the pybind-runtime),
writeback_state_allocators (the MLX backend's allocator). Real plugins, real exir, real
runtime, real MLX; eager computed here."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest
import torch
import writeback_mlx_backend.plugin as mlx_plugin
import writeback_passes.plugin as passes_plugin
import writeback_pybind_runtime.plugin as runtime_plugin
from writeback.session import PipelineError, Session, assemble, lower_case
from writeback.zoo import CallerCacheDecoder, DecoderConfig, decoder_case
from writeback_core import hookimpl
from writeback_core.registry import DuplicateNameError, load_registry
from writeback_core.types import BackendSpec, RuntimeDelegate, RuntimeProgram, RuntimeSpec, StateAllocator

from tests.passes.lowering import MLX_PASSES

CFG = DecoderConfig(max_seq=8)
CACHE_BYTES = 1 * 2 * 8 * 16 * 4  # [1, heads=2, max_seq=8, head_dim=16] fp32


def _check_against_eager(session: Session, steps: int, expect_copied: int) -> None:
    case = session.lowered.case
    model = CallerCacheDecoder(CFG).eval()
    eager_caches = [torch.zeros(CFG.cache_shape) for _ in range(2)]
    for step in range(steps):
        result = session.step(step)
        with torch.no_grad():
            expected = model(*case.step_inputs(step), *eager_caches)
        torch.testing.assert_close(result.outputs[0], expected, rtol=1e-4, atol=1e-5)
        for mine, theirs in zip(session.state, eager_caches, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        assert result.copied_bytes == expect_copied


def test_registered_passes_drop_write_backs_the_delegate_accepted() -> None:
    registry = load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin, runtime_plugin])
    pipeline = assemble(registry)
    lowered = lower_case(decoder_case(CFG, caller_cache=True), pipeline)
    assert lowered.passes == MLX_PASSES  # none of the stock runtime's state-write passes
    assert lowered.write_back_bytes == {}
    # Only the token and the position (8 B each) are copied, into the delegate.
    _check_against_eager(Session.open(pipeline, lowered), steps=3, expect_copied=16)


def test_without_any_pass_plugin_no_pass_runs_and_every_copy_is_reported() -> None:
    registry = load_registry(entry_points=False, plugins=[mlx_plugin, runtime_plugin])
    pipeline = assemble(registry)
    lowered = lower_case(decoder_case(CFG, caller_cache=True), pipeline)
    assert lowered.passes == ()
    # Stock exir keeps a whole-cache write-back copy_ per cache, every call.
    assert lowered.write_back_bytes == {"caches_0": CACHE_BYTES, "caches_1": CACHE_BYTES}
    _check_against_eager(Session.open(pipeline, lowered), steps=3, expect_copied=16 + 2 * CACHE_BYTES)


def test_a_third_party_pass_runs_without_writeback_passes_installed() -> None:
    """Core runs every registered pass itself: a plugin's pass is not lost when
    writeback-passes (which once owned the to_executorch step) is not installed."""
    from writeback_core import ProgramPass

    seen: list[int] = []

    def count(gm: torch.fx.GraphModule) -> None:
        seen.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))

    class Counter:
        writeback_name = "counter"

        @hookimpl
        def writeback_program_passes(self, stage: str) -> list[ProgramPass]:
            return [ProgramPass("count", "before_memory_planning", count)] if stage == "before_memory_planning" else []

    registry = load_registry(entry_points=False, plugins=[mlx_plugin, runtime_plugin, Counter()])
    lowered = lower_case(decoder_case(CFG, caller_cache=True), assemble(registry))
    assert lowered.passes == ("count",)
    assert len(seen) == 1 and seen[0] > 0


def test_state_not_from_the_backend_allocator_is_copied_into_the_delegate_and_reported() -> None:
    """writeback_state_allocators: without the MLX allocator the delegate copies each cache into
    MLX every call; the run still matches eager and reports those bytes."""
    registry = load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin, runtime_plugin])
    assert set(registry.state_allocators()) == {"mlx"}
    pipeline = dataclasses.replace(assemble(registry), allocator=None)
    lowered = lower_case(decoder_case(CFG, caller_cache=True), pipeline)
    _check_against_eager(Session.open(pipeline, lowered), steps=2, expect_copied=16 + 2 * CACHE_BYTES)


def test_writeback_state_allocators_mlx_allocator_gives_zeroed_tensors_of_the_asked_shape() -> None:
    allocate = load_registry(entry_points=False, plugins=[mlx_plugin]).state_allocators()["mlx"]
    tensor = allocate((3, 5), torch.float32)
    assert tensor.shape == (3, 5) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert torch.equal(tensor, torch.zeros(3, 5))


def test_two_plugins_offering_an_allocator_for_one_backend_is_an_error_naming_both() -> None:
    class Other:
        writeback_name = "other-allocator"

        @hookimpl
        def writeback_state_allocators(self) -> dict[str, StateAllocator]:
            return {"mlx": lambda shape, dtype: torch.zeros(tuple(shape), dtype=dtype)}

    registry = load_registry(entry_points=False, plugins=[mlx_plugin, Other()])
    with pytest.raises(
        DuplicateNameError,
        match=r"'mlx-backend' and plugin 'other-allocator'|"
        r"'other-allocator' and plugin 'mlx-backend'",
    ):
        registry.state_allocators()


def test_two_plugins_offering_one_runtime_name_is_an_error_naming_both() -> None:
    class Another:
        writeback_name = "another-runtime"

        @hookimpl
        def writeback_runtimes(self) -> Sequence[RuntimeSpec]:
            def refuse(data: bytes, delegates: Mapping[str, RuntimeDelegate]) -> RuntimeProgram:
                raise AssertionError("never loaded: the registry refuses the duplicate first")

            return [RuntimeSpec("pybind", load_program=refuse)]

    registry = load_registry(entry_points=False, plugins=[runtime_plugin, Another()])
    with pytest.raises(DuplicateNameError, match=r"runtime 'pybind'.*another-runtime"):
        registry.runtimes()


def test_writeback_runtimes_none_installed_is_a_clear_error() -> None:
    registry = load_registry(entry_points=False, plugins=[mlx_plugin, passes_plugin])
    with pytest.raises(PipelineError, match=r"no plugin offers a runtime.*writeback-pybind-runtime"):
        assemble(registry)


class _Offers:
    """A plugin offering backends and runtimes by name, some of them preferred."""

    def __init__(self, name: str, backends: Mapping[str, bool], runtimes: Mapping[str, bool]) -> None:
        self.writeback_name = name
        self._backends = backends
        self._runtimes = runtimes

    @hookimpl
    def writeback_backends(self) -> Sequence[BackendSpec]:
        return [
            BackendSpec(name=n, backend_id="", partitioner=lambda registry: None, preferred=p)
            for n, p in self._backends.items()
        ]

    @hookimpl
    def writeback_runtimes(self) -> Sequence[RuntimeSpec]:
        return [RuntimeSpec(name=n, load_program=_never_loads, preferred=p) for n, p in self._runtimes.items()]


def _never_loads(data: object, delegates: object) -> RuntimeProgram:
    raise AssertionError("choosing a runtime loads nothing")


def _defaults(backends: Mapping[str, bool], runtimes: Mapping[str, bool]) -> tuple[str | None, str]:
    registry = load_registry(entry_points=False, plugins=[_Offers("offers", backends, runtimes)])
    pipeline = assemble(registry)
    return (pipeline.backend.name if pipeline.backend else None), pipeline.runtime.name


def test_the_default_backend_and_runtime_are_the_preferred_ones_not_names_in_the_application() -> None:
    # Names chosen so that the first by name is never the preferred one.
    assert _defaults({"aaa": False, "zzz": True}, {"aaa": False, "zzz": True}) == ("zzz", "zzz")
    # Of several preferred, the first by name; of none, the only backend / the first runtime by name.
    assert _defaults({"b": True, "c": True, "a": False}, {"y": True, "x": True}) == ("b", "x")
    assert _defaults({"only": False}, {"r2": False, "r1": False}) == ("only", "r1")
    # Two backends, none preferred: no delegate rather than a guess.
    assert _defaults({"a": False, "b": False}, {"r": False}) == (None, "r")


def test_the_installed_defaults_are_mlx_and_pybind() -> None:
    pipeline = assemble(load_registry())
    assert pipeline.backend is not None and pipeline.backend.name == "mlx"
    assert pipeline.runtime.name == "pybind"

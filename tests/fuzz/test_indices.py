"""Run-time indices at every boundary eager accepts give eager's answer in every runtime; an
index eager refuses is refused by every runtime with every state left as it was before the
call (the oracle compares the states before and after); the generator draws all of these,
and its programs stay printable reproducers."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, seed, settings
from writeback_core.registry import Registry
from writeback_testing.observations import Observation, compare_observations, eager_run
from writeback_testing.oracle import check_program, check_source
from writeback_testing.program_spec import POS_MODES, ProgramSpec, Read, Source, State, Write, build, render_source
from writeback_testing.strategies import programs
from writeback_testing.targets import StockTarget, Target, registry_runtime, runtime_targets


def _targets(registry: Registry) -> list[Target]:
    return [StockTarget(), *runtime_targets(registry_runtime(registry))]


def _cache_program(how: str, mode: str, dim: int = 0, first: Write | None = None) -> ProgramSpec:
    """A [4, 3] cache buffer written at a run-time index derived from ``pos``, and a caller
    running sum (written first when ``first`` is given)."""
    src = Source("x", (1, 3) if dim == 0 else (4, 1), 0.5)
    statements = ([first] if first else []) + [Write("s0", how, src, dim=dim, index=None, pos_mode=mode)]
    return ProgramSpec(
        states=(State("s0", "buffer", (4, 3)), State("s1", "input", (3,))),
        statements=(*statements, Read("t0", "s0", "sum")),
        outputs=("t0", "s1"),
    )


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("mode", ["negative", "zero", "last", "minus_size"])
def test_index_assignment_at_a_run_time_boundary_index_matches_eager_in_every_runtime(
    fuzz_registry: Registry, mode: str, dim: int
) -> None:
    # s0[:, idx] = v with idx in [-size, size): eager wraps a negative index.
    spec = _cache_program("pos_put", mode, dim)
    assert check_program(spec, _targets(fuzz_registry), fuzz_registry).targets == [
        "stock",
        "pybind-planned",
        "pybind-state",
        "pybind-unplanned-bound",
    ]


@pytest.mark.parametrize("how", ["pos_put", "index_copy"])
def test_out_of_range_index_at_call_2_is_refused_by_every_runtime_no_partial_write(
    fuzz_registry: Registry, how: str
) -> None:
    spec = _cache_program(how, "out_of_range", first=Write("s1", "add", Source("x", (3,), -1.0, offset=5)))
    expected = eager_run(build(spec))
    # Eager answers calls 0 and 1 and refuses call 2, which is compared against the states
    # before it, whatever eager had written before raising.
    assert [o.error is None for o in expected] == [True, True, False]
    assert "out of" in str(expected[2].error) or "index" in str(expected[2].error).lower()
    report = check_program(spec, _targets(fuzz_registry), fuzz_registry)
    assert len(report.targets) == 4, report


def test_index_copy_at_a_negative_constant_index_is_refused_by_every_runtime_as_eager_refuses_it(
    fuzz_registry: Registry,
) -> None:
    # index_copy_ at a constant -1: eager refuses (index_copy_ takes no negative index); stock
    # ExecuTorch's kernels wrote the last row until the passes rejected it as eager does.
    spec = ProgramSpec(
        states=(State("s0", "buffer", (4, 3)),),
        statements=(Write("s0", "index_copy", Source("x", (1, 3), 0.5), dim=0, index=-1),),
        outputs=("s0",),
    )
    (refused,) = eager_run(build(spec))
    assert refused.error is not None and "out of bounds" in refused.error
    assert len(check_program(spec, _targets(fuzz_registry), fuzz_registry).targets) == 4


def test_a_refused_call_that_changed_state_is_a_mismatch() -> None:
    import torch

    before = {"s0": torch.zeros(2)}
    refused = Observation((), before, "IndexError: index 7 is out of bounds")
    assert compare_observations(refused, Observation((), {"s0": torch.zeros(2)}, "RuntimeError: 0x12")) is None
    diff = compare_observations(refused, Observation((), {"s0": torch.ones(2)}, "RuntimeError: 0x12"))
    assert diff is not None and diff[0] == "state s0 after the refused call", diff
    answered = compare_observations(refused, Observation((torch.zeros(1),), before))
    assert answered is not None and answered[0] == "refusal"


def test_rendered_index_modes_are_run_time_expressions_of_pos() -> None:
    for mode, render in POS_MODES.items():
        assert "pos" in render(4), mode  # never a constant: the index reaches the runtime


def test_programs_with_bounds_rolls_convolutions_and_quantized_reads_print_as_modules() -> None:
    spec = ProgramSpec(
        states=(State("s0", "buffer", (2, 4)),),
        statements=(
            Write("s0", "slice", Source("x", (2, 2)), dim=1, start=-9, stop=12, step=2),
            Write("s0", "roll", Source("x", (2, 1), offset=4)),
            Read("t0", "s0", "conv"),
            Read("t1", "s0", "qlinear"),
        ),
        outputs=("t0", "t1"),
    )
    source = render_source(spec)
    assert "self.s0[:, -9:12:2] = " in source
    assert "torch.cat([self.s0[..., 1:]" in source
    assert "conv1d" in source and "quantized_linear(8, 0)" in source
    built = build(spec)
    assert len(eager_run(built)) == 3  # the source runs as it prints


@pytest.mark.slow  # a quantized read's PT2E and a lowering per target
def test_quantized_read_of_a_new_state_value_matches_eager(fuzz_registry: Registry) -> None:
    spec = ProgramSpec(
        states=(State("s0", "buffer", (2, 4)),),
        statements=(Write("s0", "roll", Source("x", (2, 1), offset=4)), Read("t0", "s0", "qlinear")),
        outputs=("t0", "s0"),
    )
    report = check_program(spec, _targets(fuzz_registry), fuzz_registry)
    assert len(report.targets) == 4
    assert check_source(report.source, [StockTarget()], fuzz_registry).targets == ["stock"]


@seed(3)
@settings(max_examples=300, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs())
def _draw_and_record(spec: ProgramSpec) -> None:
    """Not a test of its own (it asserts only that each drawn source is a program):
    :func:`test_generator_draws_them_all` runs it and checks what it recorded."""
    source = render_source(spec)
    code = compile(source, "<drawn program>", "exec")  # a SyntaxError fails the draw
    assert {"FuzzModule", "step_inputs", "make_state"} <= set(code.co_names), code.co_names
    _SEEN.update(k for k, text in _MARKERS.items() if text in source)


_MARKERS = {
    "negative": " - ",
    "out_of_range": "pos // 7",
    "minus_size": "pos * 0 - ",
    "last": "pos * 0 + ",
    "roll": "torch.cat([",
    "conv": "conv1d",
    "quantized": "quantized_linear(",
    "index assignment": "] = (",
}
_SEEN: set[str] = set()


def test_generator_draws_them_all() -> None:
    _SEEN.clear()
    _draw_and_record()
    assert _SEEN == set(_MARKERS), set(_MARKERS) - _SEEN


@pytest.mark.parametrize("mode", ["negative", "minus_size"])
def test_index_copy_at_a_negative_run_time_index_is_refused_by_every_runtime_and_engine_state_unchanged(
    mode: str,
) -> None:
    # index_copy_ at a run-time negative index: eager refuses at call 0. The kv-alias engine
    # ran the index_put that index_copy_ decomposes into, which wraps a negative index, and
    # answered instead; it now runs the index_copy eager runs.
    import importlib

    from writeback_core.registry import load_registry
    from writeback_testing.engines import engine_targets

    from .conftest import ENGINE_PLUGINS

    registry = load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in ENGINE_PLUGINS])
    spec = _cache_program("index_copy", mode)
    (refused, *_) = eager_run(build(spec))
    assert refused.error is not None and "out of bounds" in refused.error
    runtime = registry_runtime(registry)
    targets = [*_targets(registry), *engine_targets(registry, runtime)]
    report = check_program(spec, targets, registry)
    assert "kv-alias-stock" in report.targets and len(report.targets) == 6, report

"""The program description, its source, and the generator: checked against eager PyTorch
and against values worked out by hand (no lowering here, so these run in seconds)."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, assume, given, seed, settings
from hypothesis import strategies as st
from writeback_testing.observations import InvalidProgram, eager_run
from writeback_testing.oracle import check_program
from writeback_testing.overlap import OverlappingWrite
from writeback_testing.program_spec import (
    Combine,
    Compute,
    Derive,
    ProgramSpec,
    Read,
    Source,
    State,
    Write,
    build,
    render_source,
)
from writeback_testing.strategies import ALL_WRITES, _Scope, _statement, programs


def test_import_writeback_core_does_not_import_hypothesis() -> None:
    """Every `writeback` start loads writeback-testing's plugin and its command module: neither
    may import hypothesis (only `writeback fuzz` needs it)."""
    code = (
        "import sys, writeback_core, writeback.cli, writeback_testing.plugin, writeback_testing.cli\n"
        "assert 'hypothesis' not in sys.modules, 'hypothesis imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _counter_spec() -> ProgramSpec:
    """``s0 += x[0:2] * 0.5`` then ``s0[1] = 3 * s0[0]``-like writes, by hand below."""
    return ProgramSpec(
        states=(State("s0", "buffer", (2,)), State("s1", "input", (2, 2))),
        statements=(
            Read("t0", "s0", "clone"),
            Write("s0", "add", Source("x", (2,), 0.5, offset=0)),
            Write("s1", "index_copy", Source("state", (1, 2), 2.0, offset=0, ref="s0"), dim=0, index=None),
        ),
        outputs=("t0", "s1"),
        has_x=True,
        has_pos=True,
    )


def test_source_is_a_module_that_runs_like_hand_worked_values() -> None:
    built = build(_counter_spec())
    assert built.source == render_source(built.spec)
    module = ModuleType("reproducer")
    exec(compile(built.source, "<reproducer>", "exec"), module.__dict__)
    s0 = (torch.arange(2.0) % 5 - 2) * 0.5  # initial buffer, as the source has it
    s1 = ((torch.arange(4.0) % 5 - 2 + 7) * 0.5).reshape(2, 2)
    observed = eager_run(built, calls=3)
    for call in range(3):
        x, pos = module.step_inputs(call)
        old = s0.clone()
        s0 = s0 + x[0:2] * 0.5
        s1[int(pos) % 2] = s0 * 2.0
        torch.testing.assert_close(observed[call].outputs[0], old)
        torch.testing.assert_close(observed[call].outputs[1], s1)
        torch.testing.assert_close(observed[call].state["s0"], s0)
        torch.testing.assert_close(observed[call].state["s1"], s1)


def test_functional_index_copy_leaves_its_state_unchanged_eagerly() -> None:
    """``Derive`` is a read: the generator's ground truth for "not state" must hold."""
    write = Write("s0", "index_copy", Source("x", (1, 3)), dim=0, index=None)
    spec = ProgramSpec(states=(State("s0", "buffer", (4, 3)),), statements=(Derive("t0", write),), outputs=("t0",))
    first, *_ = eager_run(build(spec), calls=3)
    initial = ((torch.arange(12.0) % 5 - 2) * 0.5).reshape(4, 3)
    torch.testing.assert_close(first.state["s0"], initial)
    assert not torch.equal(first.outputs[0], initial)


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_combined_temp_is_declared_with_the_dtype_eager_gives_it_no_float_added_into_an_integer_one(
    data: st.DataObject,
) -> None:
    """``a + b.sum()`` of two views of int64 state is int64 (eager): the generator must know it,
    or it adds a float into that temp in place, which eager refuses ("result type Float can't be
    cast to the desired output type Long"; a random draw of the test below found it once).
    Each drawn combination of an int64 view and a float value is run eagerly."""
    scope = _Scope({"s0": State("s0", "input", (3,), "int64")}, has_x=True, has_pos=False)
    reads = (Read(scope.new_temp((3,), "int64", "s0"), "s0", "view"),)
    reads += (Compute(scope.new_temp((3,), "float32", None), Source("x", (3,))),)
    combine = data.draw(_statement(scope, ("copy",)))
    assume(isinstance(combine, Combine))
    assert isinstance(combine, Combine)
    spec = ProgramSpec(
        states=(State("s0", "input", (3,), "int64"),),
        statements=(*reads, combine),
        outputs=(combine.result,),
        has_x=True,
        temps=tuple((t.name, t.shape) for t in scope.temps),
    )
    (observed,) = eager_run(build(spec), calls=1)
    assert str(observed.outputs[0].dtype) == f"torch.{scope.temps[-1].dtype}", combine


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_generated_programs_run_eagerly_three_times(spec: ProgramSpec) -> None:
    """Every drawn program is valid eager PyTorch, but for one refusal the oracle rejects
    (``InvalidProgram``): an in-place write whose source overlaps its destination, refused by
    eager itself or by the oracle's check (``OverlappingWrite``); and an index drawn out of
    range, whose refused call every target must refuse too."""
    try:
        observed = eager_run(build(spec), calls=3)
    except OverlappingWrite:
        return
    except RuntimeError as error:
        assert "refer to a single memory location" in str(error), str(error)
        return
    # A call eager refuses (an index out of range) ends the run, with no outputs.
    assert len(observed) == 3 or observed[-1].error is not None
    assert all(o.error is None for o in observed[:-1])
    assert all(len(o.outputs) == len(spec.outputs) for o in observed if o.error is None)


# Found while adding the copy-back target: ``s0[:, :, 1] = s0.flat[0:4]`` reads elements the
# same copy_ writes. Eager copies element by element (the result depends on the kernel's
# order); the exported program reads the source first. Stock runs had reported these as
# "wrong without writeback's passes too (upstream)"; the oracle now refuses them as invalid.
OVERLAPPING_COPY = ProgramSpec(
    states=(State("s0", "buffer", (2, 2, 2)),),
    statements=(Write("s0", "select_copy", Source("state", (2, 2), ref="s0"), dim=2, index=1),),
    outputs=("s0",),
    has_x=False,
    has_pos=False,
)


def test_eager_refuses_a_write_whose_source_overlaps_its_destination() -> None:
    with pytest.raises(OverlappingWrite, match="writes elements it also reads"):
        eager_run(build(OVERLAPPING_COPY))
    with pytest.raises(InvalidProgram, match="OverlappingWrite"):
        check_program(OVERLAPPING_COPY, targets=[])
    # By hand, why it has no ground truth: flat [0, 1, 2, 3] lands in flat [1, 3, 5, 7], so
    # visiting elements in order copies flat 0 into 1 and then the new flat 1 into 3.
    flat = torch.arange(8.0)
    dest, src = flat.view(2, 2, 2).select(2, 1), flat[0:4].view(2, 2)
    functional = src.clone()
    dest.copy_(src)
    assert flat[3] == 0.0 and functional[0, 1] == 1.0


def test_elementwise_in_place_write_reading_itself_is_not_refused() -> None:
    """``s.add_(s)`` reads each element before writing that same element: well defined."""
    spec = ProgramSpec(
        states=(State("s0", "buffer", (2, 3)),),
        statements=(Write("s0", "add", Source("state", (2, 3), ref="s0")),),
        outputs=("s0",),
        has_x=False,
        has_pos=False,
    )
    first, second, _ = eager_run(build(spec))
    torch.testing.assert_close(second.state["s0"], first.state["s0"] * 2)


def test_generator_draws_every_write_form_and_input_free_programs() -> None:
    """Coverage of the generator itself: all write forms, caller state, no-input models, 4-D caches."""
    seen: set[str] = set()
    flags = {"no_input": False, "caller_state": False, "view_read": False, "cache": False}

    # A fixed seed: whether 300 draws cover every form is a matter of chance, not of the code.
    @seed(31337)
    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(programs())
    def collect(spec: ProgramSpec) -> None:
        seen.update(s.how for s in spec.statements if isinstance(s, Write))
        flags["no_input"] |= not spec.has_x and not spec.inputs
        flags["caller_state"] |= bool(spec.inputs)
        flags["cache"] |= any(len(s.shape) == 4 for s in spec.states)
        flags["view_read"] |= any(
            isinstance(s, Read) and s.how in ("view", "transpose", "slice", "select") for s in spec.statements
        )

    collect()
    assert seen == set(ALL_WRITES)
    assert all(flags.values()), flags


def test_strategy_restricts_write_forms() -> None:
    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(programs(writes=("index_copy",), no_input_chance=False), st.just(None))
    def only_index_copy(spec: ProgramSpec, _: None) -> None:
        assert {s.how for s in spec.statements if isinstance(s, Write)} <= {"index_copy"}

    only_index_copy()

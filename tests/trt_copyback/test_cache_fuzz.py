"""The engine's aliased path under core's differential oracle, in both modes.

With the fuzzer's general program mix the kv-alias engine aliases almost
nothing: a buffer is aliased only when its last write is one in-bounds,
step-1 write on the sequence dim of a 4-D cache that reaches the engine
directly, and something computes on the result. Over 20 programs drawn with
every state a cache and only index-copy and slice writes on that dim, one
buffer in 21 was aliased (the rest: strided or out-of-bounds slices, dead
or returned-only writes, later writes). So these programs are drawn as a
decoder step draws them: one to three caches, each maybe read before its
write (a clone, a view, a slice, a sum: old values a snapshot must keep), then
written at ``pos`` or a fixed slot (``index_copy_``) or over a slice of the
sequence dim, then read (the attention that makes the write live), maybe
returned itself. Each runs for 3 calls against eager PyTorch through the
engine in the pybind-runtime and in stock ``executorch.runtime``:

- ``Mode.PREDICT``: the plugin's own lowering (``writeback_lower_for_engine``),
  only watched to count what the engine aliased;
- ``Mode.KEEP_ALL``: the same hook routed through
  ``compile_for_engine(..., Mode.KEEP_ALL)``, which keeps every buffer's
  copy-back value until the engine's ``aliased_io`` settles it.
"""

from __future__ import annotations

import importlib

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from writeback_core.registry import load_registry
from writeback_testing.engines import engine_targets
from writeback_testing.oracle import check_program
from writeback_testing.program_spec import X_LEN, ProgramSpec, Read, Source, State, Write
from writeback_testing.strategies import cache_shapes
from writeback_testing.targets import registry_runtime

from tests.trt_copyback.test_fuzz_target import PLUGINS

# Slow tier: runs with --slow (CI does); see tests/conftest.py.
pytestmark = pytest.mark.slow

# Programs per mode; each is lowered once for the engine and run 3 calls in two runtimes.
EXAMPLES = 30
OLD_READS = ("clone", "view", "slice", "sum")


@st.composite
def decoder_steps(draw: st.DrawFn) -> ProgramSpec:
    caches = [State(f"s{i}", "buffer", draw(cache_shapes())) for i in range(draw(st.integers(1, 3)))]
    statements: list[Write | Read] = []
    outputs: list[str] = []

    def read(state: State, how: str) -> str:
        name = f"t{len(statements)}"
        seq = state.shape[2]
        start = draw(st.integers(0, seq - 1))
        statements.append(Read(name, state.name, how, dim=2, start=start, stop=start + 1))
        return name

    for cache in caches:
        batch, heads, seq, dim = cache.shape
        if draw(st.booleans()):
            outputs.append(read(cache, draw(st.sampled_from(OLD_READS))))
        if draw(st.booleans()):
            how, index, start, stop = "index_copy", draw(st.none() | st.integers(0, seq - 1)), None, None
            length = 1  # index None: at the call's pos
        else:
            how, index = "slice", 0
            start = draw(st.integers(0, seq - 1))
            stop = draw(st.integers(start + 1, seq))
            length = stop - start
            # The same slots written as Python lets one write them, bounds clamped as slicing
            # clamps them: an open end, an end past the cache, a start counted from the end.
            form = draw(st.sampled_from(("as is", "open end", "past the end", "negative start")))
            if form == "open end" and stop == seq:
                stop = None
            elif form == "past the end" and stop == seq:
                stop = seq + draw(st.integers(1, 4))
            elif form == "negative start":
                start -= seq
        shape = (batch, heads, length, dim)
        offset = draw(st.integers(0, X_LEN - batch * heads * length * dim))
        source = Source("x", shape, draw(st.sampled_from((0.5, -1.0))), offset)
        statements.append(Write(cache.name, how, source, dim=2, index=index, start=start, stop=stop))
        outputs.append(read(cache, draw(st.sampled_from(("sum", "compute")))))
        if draw(st.integers(0, 3)) == 0:
            outputs.append(cache.name)
    return ProgramSpec(
        states=tuple(caches), statements=tuple(statements), outputs=tuple(outputs), has_x=True, has_pos=True
    )


@pytest.mark.parametrize("mode_name", ["PREDICT", "KEEP_ALL"])
def test_decoder_step_programs_match_eager_through_the_engines_in_place_writes(
    monkeypatch: pytest.MonkeyPatch, mode_name: str
) -> None:
    import writeback_trt_copyback.compile as compile_module
    from writeback_trt_copyback import Mode

    mode = Mode[mode_name]
    aliased: list[str] = []

    def lower(program: object, engine: object) -> object:
        compiled = compile_module.compile_for_engine(program, engine, mode)  # type: ignore[arg-type]
        aliased.extend(compiled.aliased)
        return compiled.edge

    monkeypatch.setattr(compile_module, "lower_for_engine", lower)
    registry = load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in PLUGINS])
    targets = engine_targets(registry, registry_runtime(registry))
    checked: list[int] = []

    @seed(8086)
    @settings(
        max_examples=EXAMPLES, database=None, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck)
    )
    @given(decoder_steps())
    def check(spec: ProgramSpec) -> None:
        report = check_program(spec, targets, registry)
        assert report.targets == ["kv-alias-pybind", "kv-alias-stock"], report.skipped
        checked.append(1)

    check()
    assert len(checked) >= EXAMPLES
    # The engine really wrote in place, on most programs.
    print(f"{mode_name}: {len(checked)} programs, {len(aliased)} buffers aliased")
    assert len(aliased) >= EXAMPLES // 2, f"the engine aliased only {len(aliased)} buffers: {aliased}"

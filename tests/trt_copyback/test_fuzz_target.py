"""The copy-back path as a target of core's differential oracle, and the bugs the fuzzer found in it.

Core reaches the path only through hooks (``writeback_engines``,
``writeback_lower_for_engine``, ``writeback_runtime_delegates``); these tests
drive the same hooks on this package's plugin and compare with eager PyTorch.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from writeback_core.registry import Registry, load_registry
from writeback_testing.engines import engine_targets
from writeback_testing.lowered_plans import export_built
from writeback_testing.oracle import check_program, check_source
from writeback_testing.program_spec import Derive, ProgramSpec, Read, Source, State, Write, build
from writeback_testing.targets import registry_runtime
from writeback_trt_copyback import (
    KVAliasEngine,
    UninitializedCopyBackWarning,
    engine_aliasing,
    lift_mutated_buffers,
)
from writeback_trt_copyback.lift import DEAD_WRITE, RETURNED_ONLY_WRITE

from tests.trt_copyback.conftest import export, run_against_eager

PLUGINS = ("writeback_passes.plugin", "writeback_pybind_runtime.plugin", "writeback_trt_copyback.plugin")


@pytest.fixture
def registry() -> Registry:
    return load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in PLUGINS])


def _targets(registry: Registry) -> list[object]:
    return engine_targets(registry, registry_runtime(registry))  # type: ignore[return-value]


# A KV cache written at ``pos`` along its sequence dim and read after the write (aliased),
# and a running sum (copied back), with an old value read before the writes.
ALIASED_AND_COPIED = ProgramSpec(
    states=(State("s0", "buffer", (1, 2, 4, 3)), State("s1", "buffer", (3,))),
    statements=(
        Read("t0", "s1", "clone"),
        Write("s0", "index_copy", Source("x", (1, 2, 1, 3), 0.5), dim=2, index=None),
        Write("s1", "add", Source("x", (3,), -1.0, offset=7)),
        Read("t1", "s0", "sum"),
    ),
    outputs=("t0", "t1", "s1"),
)


def test_writeback_lower_for_engine_lowers_kv_alias_with_the_cache_aliased_and_the_rest_copied(
    registry: Registry,
) -> None:
    engine = registry.engines()["kv-alias"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UninitializedCopyBackWarning)  # s1 is read first; tested on its own
        edge = registry.hook.writeback_lower_for_engine(engine=engine, program=export_built(build(ALIASED_AND_COPIED)))
    assert engine_aliasing(edge.exported_program(), KVAliasEngine()).buffers == {"s0"}
    mutated = {
        str(s.target) for s in edge.exported_program().graph_signature.output_specs if s.kind.name == "BUFFER_MUTATION"
    }
    assert mutated == {"s0", "s1"}


def test_oracle_runs_every_call_of_the_kv_alias_path_against_eager(registry: Registry) -> None:
    report = check_program(ALIASED_AND_COPIED, _targets(registry), registry, calls=4)
    assert report.targets == ["kv-alias-pybind", "kv-alias-stock"] and not report.skipped


def test_writeback_lower_for_engine_answers_none_for_an_engine_it_does_not_own(registry: Registry) -> None:
    class Other:
        name, backend_id = "other", "OtherBackend"

    program = export_built(build(ALIASED_AND_COPIED))
    assert registry.hook.writeback_lower_for_engine(engine=Other(), program=program) is None


# Found by the fuzzer (kv-alias targets, first run): a cache written in place and only
# returned. Aliasing pointed the output at the buffer, which left the engine's call with no
# user; settle_aliased then refused the program ("nothing uses the delegate"). Fixed in
# lift.py: such a write is copied back, marked no-alias, like a dead write.
RETURNED_CACHE = ProgramSpec(
    states=(State("s0", "buffer", (1, 1, 2, 1)),),
    statements=(Write("s0", "index_copy", Source("const", (1, 1, 1, 1), 0.5), dim=2, index=0),),
    outputs=("s0",),
)


def test_cache_write_only_returned_is_copied_back_not_dropped_with_the_engine_call(registry: Registry) -> None:
    report = check_program(RETURNED_CACHE, _targets(registry), registry)
    assert report.targets == ["kv-alias-pybind", "kv-alias-stock"]
    (cls,) = lift_mutated_buffers(export_built(build(RETURNED_CACHE)), KVAliasEngine()).buffers
    assert not cls.aliased and cls.marked and cls.reason == RETURNED_ONLY_WRITE


class _ReturnsCache(torch.nn.Module):
    """A decode step that returns the cache it wrote and nothing computed on it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 2, 8, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.index_copy_(2, pos, x)
        return self.cache, x * 2.0


def test_cache_returned_beside_another_output_still_matches_eager() -> None:
    """The returned-only rule also takes a write whose engine call has another output; copied
    back, it is slower than aliasing but right: every step against eager."""
    (cls,) = lift_mutated_buffers(
        export(_ReturnsCache(), (torch.ones(1, 2, 1, 4), torch.tensor([1]))), KVAliasEngine()
    ).buffers
    assert cls.reason == RETURNED_ONLY_WRITE
    compiled = run_against_eager(_ReturnsCache, lambda s: (torch.full((1, 2, 1, 4), float(s + 1)), torch.tensor([s])))
    assert compiled.copy_back == ["cache"]


# Found by the fuzzer (kv-alias targets): ``t0 = s0.index_copy(2, i, v)`` on a buffer the
# program never writes. The engine's lowering took any cache-shaped write into one of its
# inputs for an in-place update, so it wrote the read-only buffer s0. Seen three ways: the
# cross-check refused it (another buffer was mutated: "wrote ['s0'] in place, but they were
# filed copy-back"), settle_aliased found the engine call unused, or exir's verifier refused
# the settled program. Fixed in lowering.py: only a write lift recorded as a buffer's new
# value (meta.COPY_BACK_CLASS on the write node) is made in place.
def _functional_write(other: tuple[Write, ...] = (), extra: tuple[str, ...] = ()) -> ProgramSpec:
    write = Write("s0", "index_copy", Source("x", (1, 1, 1, 1)), dim=2, index=0)
    return ProgramSpec(
        states=(State("s0", "buffer", (1, 1, 2, 1)), State("s1", "buffer", (1, 1, 2, 1))),
        statements=(*other, Derive("t0", write)),
        outputs=("t0", *extra),
    )


@pytest.mark.parametrize(
    "spec",
    [
        _functional_write(),
        _functional_write(extra=("t0",)),
        _functional_write(other=(Write("s1", "copy", Source("x", (1, 1, 2, 1), 0.5, offset=3)),)),
    ],
    ids=["only_output", "output_twice", "beside_a_mutated_buffer"],
)
def test_functional_index_copy_of_a_read_only_cache_is_not_written_in_place(
    registry: Registry, spec: ProgramSpec
) -> None:
    report = check_program(spec, _targets(registry), registry)
    assert report.targets == ["kv-alias-pybind", "kv-alias-stock"]


# Found by the fuzzer (kv-alias targets): ``s1.copy_(s0[0:1])`` then ``s0.add_(...)``. The
# copy-back value of s1 is a view of the old s0; to_edge decomposes the lifted program again
# by running it with the write-backs applied in order, so s0 was written first and s1 took
# the new s0. Fixed in lift.py (_detached): such a value is cloned where it is computed.
VIEW_OF_ANOTHER_BUFFER = ProgramSpec(
    states=(State("s0", "buffer", (2,)), State("s1", "buffer", (1,)), State("s2", "input", (1,))),
    statements=(
        Write("s1", "copy", Source("state", (1,), ref="s0")),
        Write("s2", "copy", Source("state", (1,), ref="s0", offset=1)),
        Write("s0", "add", Source("x", (2,), 0.5)),
    ),
    outputs=("s0",),
)


def test_copy_back_value_that_is_a_view_of_another_buffer_keeps_the_old_values(registry: Registry) -> None:
    report = check_program(VIEW_OF_ANOTHER_BUFFER, _targets(registry), registry)
    assert report.targets == ["kv-alias-pybind", "kv-alias-stock"]


# Found by the fuzzer (kv-alias targets, the 300-program run): a cache written in place,
# read after the write, and returned. settle_aliased pointed the returned value at the buffer
# but kept the output's old name in the signature, so exir's verifier refused the program
# ("User output b_s1 is not in the correct order"). Fixed in settle.py: the spec names the
# buffer it now returns.
RETURNED_AND_READ_CACHE = ProgramSpec(
    states=(State("s0", "buffer", (1,)), State("s1", "buffer", (1, 1, 2, 1))),
    statements=(
        Write("s1", "index_copy", Source("x", (1, 1, 1, 1), 0.5), dim=2, index=None),
        Read("t0", "s1", "clone"),
    ),
    outputs=("t0", "s1"),
)


def test_cache_written_in_place_read_and_returned_is_returned_as_its_buffer(registry: Registry) -> None:
    report = check_program(RETURNED_AND_READ_CACHE, _targets(registry), registry, calls=4)
    assert report.targets == ["kv-alias-pybind", "kv-alias-stock"]
    edge = registry.hook.writeback_lower_for_engine(
        engine=registry.engines()["kv-alias"], program=export_built(build(RETURNED_AND_READ_CACHE))
    )
    assert engine_aliasing(edge.exported_program(), KVAliasEngine()).buffers == {"s1"}


# Found by the CI fuzz run (seed 0, kv-alias targets): a value leaving the graph (an output,
# or a buffer's copy-back value) that is a view of a buffer written in the same call. to_edge
# decomposes the program again with every write-back applied before it returns, so the view
# showed the buffer's new value: -1 where eager returns -0.5, -2 where eager returns -1. Fixed
# in lift.py (_detached): such a value is cloned where it is computed.
COPY_FROM_A_VIEW_OF_A_WRITTEN_BUFFER = """import torch


class FuzzModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s0', ((torch.arange(2, dtype=torch.float32) % 5 - 2 + 0) * 0.5).reshape((1, 1, 2, 1)))
        self.register_buffer('s1', ((torch.arange(2, dtype=torch.float32) % 5 - 2 + 1) * 0.5).reshape((1, 1, 2, 1)))

    def forward(self):
        t1 = self.s0.view(-1)
        t0 = (self.s1.reshape(-1)[0:2].reshape((1, 1, 2, 1)))
        t2 = t1 + t0.sum()
        self.s0.copy_(t0)
        self.s1.add_((t0.reshape(-1)[0:2].reshape((1, 1, 2, 1))))
        return (t2, t1,)
"""

COPY_OF_A_BUFFER_WRITTEN_LATER = """import torch


class FuzzModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s0', ((torch.arange(4, dtype=torch.float32) % 5 - 2 + 0) * 0.5).reshape((2, 1, 2, 1)))
        self.register_buffer('s1', ((torch.arange(1, dtype=torch.float32) % 5 - 2 + 1) * 0.5).reshape((1,)))

    def forward(self):
        self.s1.copy_((self.s0.reshape(-1)[0:1].reshape((1,))))
        t0 = self.s0.sum(0, keepdim=True)
        self.s0.add_((self.s0.reshape(-1)[0:4].reshape((2, 1, 2, 1))))
        self.s0.copy_((self.s0.reshape(-1)[0:4].reshape((2, 1, 2, 1))))
        return (self.s1,)
"""

# The same view, where the written buffer is a cache with a one-slot write: the engine
# declines to alias it (its old value is read through the output), so it is copied back too.
VIEW_OF_AN_ALIASED_CACHE = """import torch


class FuzzModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s0', ((torch.arange(4, dtype=torch.float32) % 5 - 2 + 0) * 0.5).reshape((1, 1, 4, 1)))
        self.register_buffer('s1', ((torch.arange(4, dtype=torch.float32) % 5 - 2 + 1) * 0.5).reshape((1, 1, 4, 1)))
        self.register_buffer('pos', torch.tensor([1]))

    def forward(self):
        t0 = self.s0.view(-1)
        self.s0.copy_(self.s1)
        self.s1.index_copy_(2, self.pos, torch.full((1, 1, 1, 1), 7.0))
        return (t0, self.s1 * 2)
"""


@pytest.mark.parametrize(
    "source",
    [COPY_FROM_A_VIEW_OF_A_WRITTEN_BUFFER, COPY_OF_A_BUFFER_WRITTEN_LATER, VIEW_OF_AN_ALIASED_CACHE],
    ids=["copy-from-view", "copy-then-write", "view-of-aliased-cache"],
)
def test_output_that_views_a_buffer_written_in_the_same_call_keeps_the_old_values(
    registry: Registry,
    source: str,
) -> None:
    report = check_source(
        source + "\n\ndef step_inputs(step):\n    return ()\n\n\ndef make_state():\n    return ()\n",
        targets=_targets(registry),
        registry=registry,
    )  # type: ignore[arg-type]
    assert report.targets == ["kv-alias-pybind", "kv-alias-stock"] and not report.skipped


# Found by the CI fuzz run (chunk 0, kv-alias-pybind): an int64 cache written at a run-time
# slot, then converted and the conversion never used. The only trace of ``.to()`` left in
# the exported graph is an assertion on the written cache (``_assert_tensor_metadata``), so
# lift took the write for a live one and predicted it aliased; exir erases assertions, then
# the write nothing reads, and the engine never saw it: AliasMismatchError, s2's write lost.
# Fixed in lift.py (_live_nodes): only readers the output depends on keep a write alive.
WRITE_READ_ONLY_BY_AN_ASSERTION = """import torch


class FuzzModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s1', ((torch.arange(2, dtype=torch.float32) % 5 - 1) * 0.5).reshape((1, 1, 2, 1)))
        self.register_buffer('s2', torch.tensor([1, 2]).reshape((1, 1, 2, 1)))

    def forward(self, x, pos):
        self.s2[:, :, torch.remainder(pos, 2)] = torch.full((1, 1, 1, 1), 7, dtype=torch.int64)
        t0 = READ.to(torch.float32)
        return (self.s1 * 2,)


def step_inputs(step):
    return (torch.randn(4, generator=torch.Generator().manual_seed(step)), torch.tensor([3 * step + 1]))


def make_state():
    return ()
"""


@pytest.mark.parametrize("read", ["self.s2", "self.s2.view(-1)"], ids=["cache", "view-of-cache"])
def test_cache_write_read_only_by_an_erased_assertion_is_copied_back_not_lost(registry: Registry, read: str) -> None:
    source = WRITE_READ_ONLY_BY_AN_ASSERTION.replace("READ", read)
    report = check_source(source, targets=_targets(registry), registry=registry, calls=3)  # type: ignore[arg-type]
    assert report.targets == ["kv-alias-pybind", "kv-alias-stock"] and not report.skipped
    namespace: dict[str, object] = {}
    exec(compile(source, "<reproducer>", "exec"), namespace)
    module = namespace["FuzzModule"]()  # type: ignore[operator]  # the reproducer defines it
    lifted = lift_mutated_buffers(export(module, (torch.zeros(4), torch.tensor([1]))), KVAliasEngine())
    (cls,) = lifted.buffers
    assert (cls.target, cls.aliased, cls.marked, cls.reason) == ("s2", False, True, DEAD_WRITE)

"""The example backend writes a state in place only when every read of its old value is
ordered before the write by a data dependency (issue 29, found by the generated-program
contract run): otherwise it declines, the write-back stays, and every run matches eager."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch
from writeback_core.registry import Registry, load_registry
from writeback_testing.contract import check_backend_contract
from writeback_testing.program_spec import Built, ProgramSpec, State

PLUGINS = ("writeback_passes.plugin", "writeback_pybind_runtime.plugin", "writeback_example_backend.plugin")

_TAIL = """

def step_inputs(step):
    return (torch.randn(32, generator=torch.Generator().manual_seed(1000 + step)), torch.tensor([3 * step + 1]))


def make_state():
    return ()
"""

# The contract run's program: a clone of s0 taken before the write is read after it.
CLONE_READ_AFTER = """import torch


class FuzzModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s0', torch.tensor([-1.0]))

    def forward(self, x, pos):
        t0 = self.s0.clone()
        t1 = self.s0.view(-1)
        self.s0.index_copy_(0, torch.arange(0, 1), torch.tensor([0.5]))
        return (t0 + t1.sum(),)
"""

# Its shrunk sibling: a functional index_copy of the old s0, delegated too; exir placed that
# call after the in-place one, which then overwrote what it still had to read.
FUNCTIONAL_COPY_READ_AFTER = """import torch


class FuzzModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s0', torch.tensor([-1.0, -0.5, 0.0]).reshape((3, 1, 1)))

    def forward(self, x, pos):
        t0 = self.s0.clone()
        t1 = self.s0.index_copy(0, torch.remainder(pos, 3), x[31:32].reshape((1, 1, 1)) * 0.5)
        self.s0.index_copy_(0, torch.remainder(pos, 3), torch.full((1, 1, 1), 0.5))
        return (t0 + t1.sum(),)
"""

# The old value read only to compute what is written: ordered before the write, so accepted.
READ_FEEDS_THE_WRITE = """import torch


class FuzzModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer('s0', torch.tensor([-1.0, -0.5, 0.0]).reshape((3, 1, 1)))

    def forward(self, x, pos):
        self.s0.index_copy_(0, torch.remainder(pos, 3), self.s0[0:1] * 2 + x[0:1].reshape((1, 1, 1)))
        return (self.s0 * 1,)
"""


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(entry_points=False, plugins=[importlib.import_module(m) for m in PLUGINS])


def _built(body: str) -> Built:
    source = body + _TAIL
    module = ModuleType("writeback_example_reproducer")
    exec(compile(source, "<reproducer>", "exec"), module.__dict__)
    states = tuple(State(n, "buffer", tuple(b.shape)) for n, b in module.FuzzModule().named_buffers())
    spec = ProgramSpec(states=states, statements=(), outputs=())
    return Built(spec, source, module.FuzzModule, module.step_inputs, module.make_state)


@pytest.mark.parametrize(
    "body", [CLONE_READ_AFTER, FUNCTIONAL_COPY_READ_AFTER], ids=["clone-read-after", "functional-copy-read-after"]
)
def test_write_whose_old_value_is_read_unordered_is_declined_and_copied_back_matching_eager(
    registry: Registry, body: str
) -> None:
    # check_backend_contract also runs every target against eager over several calls.
    report = check_backend_contract(registry, "example", _built(body), calls=3)
    assert report.declined == ["s0"] and report.accepted == []
    assert report.write_backs == frozenset({"b_s0"})
    assert report.targets == ["example-state", "example-planned", "example-stock"]


def test_write_whose_old_value_only_feeds_the_write_is_accepted_and_not_copied_back(registry: Registry) -> None:
    report = check_backend_contract(registry, "example", _built(READ_FEEDS_THE_WRITE), calls=3)
    assert report.accepted == ["s0"] and report.write_backs == frozenset()
    assert report.delegated == 1


def test_clone_read_after_reads_the_old_value_in_eager() -> None:
    """The first program is what it claims: eager's answer needs the old s0."""
    module = ModuleType("writeback_example_reproducer")
    exec(compile(CLONE_READ_AFTER + _TAIL, "<reproducer>", "exec"), module.__dict__)
    (out,) = module.FuzzModule()(torch.zeros(32), torch.tensor([1]))
    # By hand: t0 is the old s0 (-1.0); t1 views s0, summed after the write (0.5).
    assert out.tolist() == [-0.5]

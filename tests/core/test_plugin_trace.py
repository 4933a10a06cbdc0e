"""``WRITEBACK_TRACE_PLUGINS=1`` sees every hook the registry calls: no hook is called past pluggy.

Real pluggy, the real installed plugins (entry points), a real ``torch.export``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import writeback_core.registry as registry_module
from writeback_core import PartitionView, Registry, find_mutations, hookspecs, load_registry

# Every hook the registry's typed methods call, and a call of that method.
_CALLS: dict[str, Callable[[Registry], Any]] = {
    "writeback_backends": lambda r: r.backends(),
    "writeback_runtime_delegates": lambda r: r.runtime_delegates(),
    "writeback_engines": lambda r: r.engines(),
    "writeback_runtimes": lambda r: r.runtimes(),
    "writeback_state_allocators": lambda r: r.state_allocators(),
    "writeback_models": lambda r: r.models(),
    "writeback_model_from_path": lambda r: r.model_from_path("no/such/model/folder"),
    "writeback_program_passes": lambda r: r.program_passes("before_memory_planning", None),
    "writeback_accepts_in_place": lambda r: _decide(r),
}


class _Cache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 2))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, x)
        return self.cache * 1


def _decide(reg: Registry) -> object:
    program = torch.export.export(_Cache(), (torch.ones(1, 2), torch.tensor([1]))).run_decompositions()
    (mutation,) = find_mutations(program)
    view = PartitionView("example", frozenset({mutation.write.node or ""}), program.graph_module.graph)
    return reg.decide_in_place("example", view, mutation)


def test_the_table_names_every_hook_the_registry_module_calls() -> None:
    specs = {name for name in dir(hookspecs) if name.startswith("writeback_")}
    called = set(re.findall(r'"(writeback_\w+)"', inspect.getsource(registry_module))) & specs
    assert called == set(_CALLS)


def test_every_hook_the_registry_calls_shows_up_in_the_trace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WRITEBACK_TRACE_PLUGINS", "1")
    reg = load_registry()
    for hook, call in _CALLS.items():
        capsys.readouterr()
        call(reg)
        trace = capsys.readouterr().err
        implementers = len(getattr(reg.hook, hook).get_hookimpls())
        assert implementers > 0, f"no installed plugin implements {hook}; the test proves nothing"
        # One traced call per implementing plugin: each answer keeps its plugin's name.
        assert trace.count(f"finish {hook} -->") == implementers, trace


def test_decision_from_traced_calls_still_names_the_answering_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WRITEBACK_TRACE_PLUGINS", "1")
    decision = _decide(load_registry())
    # The example backend takes an index_copy_ inside its partition in place (worked out by hand).
    assert getattr(decision, "accepted_by", None) == ("example-backend",)

"""The plugin registry: discovery, blocking, validation, conflicts and order independence.

A fresh registry per test; test plugins are small inline classes.
"""

from __future__ import annotations

import pluggy
import pytest
import torch
from writeback.model_build import export_case
from writeback.zoo import builtin_models
from writeback_core import InPlaceConflictError, Mutation, PartitionView, find_mutations, hookimpl, load_registry


def _decoder_mutation() -> tuple[Mutation, torch.fx.Graph]:
    program = export_case(builtin_models()["decoder"]).run_decompositions()
    return find_mutations(program)[0], program.graph_module.graph


class Accepts:
    writeback_name = "accepts"

    @hookimpl
    def writeback_accepts_in_place(self, backend: str, mutation: Mutation) -> bool | None:
        return True if backend == "toy" else None


class Declines:
    writeback_name = "declines"

    @hookimpl
    def writeback_accepts_in_place(self, backend: str) -> bool | None:
        return False if backend == "toy" else None


class Silent:
    writeback_name = "silent"

    @hookimpl
    def writeback_accepts_in_place(self) -> bool | None:
        return None


def test_entry_point_discovery_finds_the_example_third_party_backend() -> None:
    registry = load_registry()
    assert "example-backend" in registry.plugin_names()
    assert registry.backends()["example"].backend_id == "WritebackExampleBackend"
    assert "WritebackExampleBackend" in registry.runtime_delegates()


def test_no_entry_points_loads_only_the_given_plugins() -> None:
    registry = load_registry(entry_points=False, plugins=[Silent()])
    assert registry.plugin_names() == ["silent"]
    assert registry.models() == {}


def test_core_builtin_is_an_entry_point_and_can_be_given_explicitly() -> None:
    from writeback import default_plugin

    assert "writeback" in load_registry().plugin_names()
    registry = load_registry(entry_points=False, plugins=[default_plugin])
    assert registry.plugin_names() == ["writeback"]
    assert set(registry.models()) == set(builtin_models())


def test_blocked_plugin_is_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WRITEBACK_BLOCK_PLUGINS", "example-backend, accepts")
    registry = load_registry(plugins=[Accepts(), Silent()])
    names = registry.plugin_names()
    assert "example-backend" not in names and "accepts" not in names
    assert "silent" in names
    assert "example" not in registry.backends()


def test_unknown_hook_fails_clearly_naming_it() -> None:
    class Typo:
        writeback_name = "typo"

        @hookimpl
        def writeback_acepts_in_place(self) -> bool:
            return True

    with pytest.raises(pluggy.PluginValidationError, match="writeback_acepts_in_place"):
        load_registry(entry_points=False, plugins=[Typo()])


def test_disagreeing_plugins_raise_naming_both_and_record_nothing() -> None:
    mutation, graph = _decoder_mutation()
    registry = load_registry(entry_points=False, plugins=[Accepts(), Declines()])
    view = PartitionView("toy", frozenset({mutation.write.node or ""}), graph)
    with pytest.raises(InPlaceConflictError, match=r"accepts.*declines"):
        registry.annotate_in_place(graph, "toy", view, [mutation])
    placeholder = next(n for n in graph.nodes if n.name == mutation.placeholder)
    assert "writeback.in_place" not in placeholder.meta.get("custom", {})


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_registration_order_never_changes_the_decision(order: tuple[int, int, int]) -> None:
    mutation, graph = _decoder_mutation()
    plugins = [Accepts(), Silent(), type("Other", (Silent,), {"writeback_name": "other"})()]
    registry = load_registry(entry_points=False, plugins=[plugins[i] for i in order])
    view = PartitionView("toy", frozenset(), graph)
    decision = registry.decide_in_place("toy", view, mutation)
    assert decision.accepted is True
    assert decision.accepted_by == ("accepts",)
    assert decision.declined_by == ()


def test_no_answer_means_copy_back() -> None:
    mutation, graph = _decoder_mutation()
    registry = load_registry(entry_points=False, plugins=[Silent()])
    decision = registry.decide_in_place("toy", PartitionView("toy", frozenset(), graph), mutation)
    assert decision.accepted is False and decision.accepted_by == decision.declined_by == ()


def test_non_bool_answer_is_rejected_naming_the_plugin() -> None:
    class Sloppy:
        writeback_name = "sloppy"

        @hookimpl
        def writeback_accepts_in_place(self) -> object:
            return "yes"

    mutation, graph = _decoder_mutation()
    registry = load_registry(entry_points=False, plugins=[Sloppy()])
    with pytest.raises(TypeError, match="sloppy"):
        registry.decide_in_place("toy", PartitionView("toy", frozenset(), graph), mutation)


def test_duplicate_backend_name_raises_naming_both_plugins() -> None:
    from writeback_core import BackendSpec

    def offer(label: str) -> object:
        class Offer:
            writeback_name = label

            @hookimpl
            def writeback_backends(self) -> list[BackendSpec]:
                return [BackendSpec("same", "SameBackend", partitioner=lambda registry: None)]

        return Offer()

    registry = load_registry(entry_points=False, plugins=[offer("first"), offer("second")])
    with pytest.raises(ValueError, match=r"'same'.*first.*second"):
        registry.backends()

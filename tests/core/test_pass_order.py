"""Program passes say where and when they run: ``backends``, ``after`` and ``before``, by name.

A fresh registry per test, with inline plugins; orders are worked out by hand from the
relations (a topological order, ties broken by name).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import writeback.default_plugin as default_plugin
from writeback.explain import explain_notes
from writeback_core import BackendSpec, PassOrderError, ProgramPass, Stage, hookimpl, load_registry
from writeback_core.exporting import export_model


def _nothing(gm: torch.fx.GraphModule) -> None:
    return None


def _offering(label: str, *passes: ProgramPass, backends: Sequence[str] = ()) -> object:
    """A plugin called ``label`` offering ``passes`` (at their stages) and backends by those names."""

    class Offers:
        writeback_name = label

        @hookimpl
        def writeback_program_passes(self, stage: Stage) -> list[ProgramPass]:
            return [p for p in passes if p.stage == stage]

        @hookimpl
        def writeback_backends(self) -> list[BackendSpec]:
            return [BackendSpec(name, "", partitioner=lambda registry: None) for name in backends]

    return Offers()


def _pass(name: str, **where: Any) -> ProgramPass:
    return ProgramPass(name, "before_memory_planning", _nothing, **where)


def _names(registry: Any, backend: str | None = None) -> list[str]:
    return [p.name for p in registry.program_passes("before_memory_planning", backend)]


def test_passes_run_by_their_relations_whatever_the_registration_order() -> None:
    x = _offering("x", _pass("b-first", before=("a-second",)), _pass("c-last", after=("a-second",)))
    y = _offering("y", _pass("a-second"), _pass("d-free"), ProgramPass("edge-only", "edge", lambda ep: None))
    for plugins in ([x, y], [y, x]):
        registry = load_registry(entry_points=False, plugins=plugins)
        # b-first and d-free are free first: b-first by name; then a-second (now free) before
        # d-free by name; then c-last before d-free by name.
        assert _names(registry) == ["b-first", "a-second", "c-last", "d-free"]


def test_a_cycle_is_refused_naming_both_passes_and_their_plugins() -> None:
    one = _offering("one", _pass("a", after=("b",)))
    two = _offering("two", _pass("b", after=("a",)), _pass("free"))
    registry = load_registry(entry_points=False, plugins=[one, two])
    with pytest.raises(PassOrderError) as refused:
        registry.program_passes("before_memory_planning", None)
    message = str(refused.value)
    assert "stage 'before_memory_planning'" in message
    assert "'a' (plugin 'one') must run before 'b' (plugin 'two'), which must run before 'a'" in message
    assert "free" not in message
    assert isinstance(refused.value, ValueError)


def test_a_cycle_is_refused_for_every_backend_even_one_its_passes_are_not_for() -> None:
    three = _offering(
        "three",
        _pass("p", after=("r",), backends=frozenset({"mlx"})),
        _pass("q", after=("p",)),
        _pass("r", after=("q",)),
    )
    registry = load_registry(entry_points=False, plugins=[three])
    with pytest.raises(PassOrderError, match=r"'p' \(plugin 'three'\) must run before 'q' .* before 'r' .* before 'p'"):
        registry.program_passes("before_memory_planning", "xnnpack")


def test_a_pass_that_must_run_after_itself_is_refused() -> None:
    registry = load_registry(entry_points=False, plugins=[_offering("selfish", _pass("loop", before=("loop",)))])
    with pytest.raises(PassOrderError, match=r"'loop' \(plugin 'selfish'\) must run before 'loop'"):
        registry.program_passes("before_memory_planning", None)


@pytest.mark.parametrize("relation", ["after", "before"])
def test_an_unknown_relation_name_is_refused_naming_the_pass_and_its_plugin_clear_error(relation: str) -> None:
    typo = _offering("typo", _pass("b", **{relation: ("reinplace_stat_writes",)}), _pass("a"))
    registry = load_registry(entry_points=False, plugins=[_offering("other", _pass("c")), typo])
    with pytest.raises(PassOrderError) as refused:
        registry.program_passes("before_memory_planning", None)
    assert str(refused.value).startswith(
        f"program pass 'b' of plugin 'typo' runs {relation} 'reinplace_stat_writes', but no installed plugin "
        "offers a pass of that name at stage 'before_memory_planning' (offered there: a, b, c). Fix the name, or, "
        "when that pass belongs to a plugin that may not be installed, add it to the pass's "
        "optional=('reinplace_stat_writes',)"
    )


def test_a_pass_of_another_stage_is_no_relation_and_is_refused_unless_optional() -> None:
    edge = _offering("edge", ProgramPass("b-at-edge", "edge", lambda ep: None))
    strict = _offering("strict", _pass("a", after=("b-at-edge",)))
    with pytest.raises(PassOrderError, match=r"'a' of plugin 'strict' runs after 'b-at-edge'"):
        load_registry(entry_points=False, plugins=[strict, edge]).program_passes("before_memory_planning", None)


def test_an_optional_relation_to_a_pass_not_installed_is_ignored() -> None:
    lonely = _offering(
        "lonely",
        _pass("b", after=("not-installed",), optional=("not-installed",)),
        _pass("a", before=("also-missing",), optional=("also-missing",)),
    )
    registry = load_registry(entry_points=False, plugins=[lonely])
    # No relation holds: name order.
    assert _names(registry) == ["a", "b"]
    # Installed, the optional relation holds: b after it although it sorts first.
    present = _offering("present", _pass("not-installed"))
    registry = load_registry(entry_points=False, plugins=[lonely, present])
    assert _names(registry) == ["a", "not-installed", "b"]


def test_optional_naming_no_relation_of_the_pass_is_refused() -> None:
    with pytest.raises(TypeError, match=r"pass 'p': optional= names 'x', which neither after= nor before= names"):
        _pass("p", after=("y",), optional=("x",))


def test_a_pass_runs_only_for_its_backends_and_none_names_the_lowering_without_one() -> None:
    offers = _offering(
        "offers",
        _pass("everywhere"),
        _pass("mlx-only", backends=frozenset({"mlx"})),
        _pass("no-backend-only", backends=frozenset({"none"})),
    )
    registry = load_registry(entry_points=False, plugins=[offers])
    assert _names(registry, "mlx") == ["everywhere", "mlx-only"]
    assert _names(registry, "xnnpack") == ["everywhere"]
    assert _names(registry, None) == ["everywhere", "no-backend-only"]


def test_a_relation_through_a_pass_left_out_for_the_backend_still_holds() -> None:
    chain = _offering(
        "chain",
        _pass("z-first", before=("m-middle",)),
        _pass("m-middle", backends=frozenset({"mlx"})),
        _pass("a-last", after=("m-middle",)),
    )
    registry = load_registry(entry_points=False, plugins=[chain])
    assert _names(registry, "mlx") == ["z-first", "m-middle", "a-last"]
    # Without m-middle, z-first still runs before a-last (by name it would come after).
    assert _names(registry, "xnnpack") == ["z-first", "a-last"]


def test_two_passes_of_one_name_at_one_stage_are_refused_naming_both_plugins() -> None:
    registry = load_registry(
        entry_points=False, plugins=[_offering("first", _pass("same")), _offering("second", _pass("same"))]
    )
    with pytest.raises(PassOrderError, match=r"'same' .* plugin 'first' and plugin 'second'"):
        registry.program_passes("before_memory_planning", None)


@pytest.mark.parametrize("field", ["after", "before", "backends", "optional"])
def test_one_string_where_names_go_is_refused_saying_what_to_write(field: str) -> None:
    expected = rf"{field}= takes a tuple of names, not the string 'x': write {field}=\('x',\)"
    with pytest.raises(TypeError, match=expected):
        _pass("p", **{field: "x"})


def test_a_stage_that_is_none_is_refused() -> None:
    with pytest.raises(TypeError, match="stage 'late' is none of 'exported', "):
        ProgramPass("p", "late", _nothing)  # type: ignore[arg-type]  # the mistake under test


class _Noted:
    writeback_name = "noted"

    @hookimpl
    def writeback_explain_notes(self) -> list[str]:
        return ["another plugin's note"]


def _notes(*plugins: object) -> list[str]:
    registry = load_registry(entry_points=False, plugins=[default_plugin, _Noted(), *plugins])
    program = export_model(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    return explain_notes(program, registry)


def test_explain_lists_the_passes_per_backend_with_their_plugin_and_reasons() -> None:
    toy = _offering(
        "toy",
        _pass("common"),
        _pass("only-alpha", backends=frozenset({"alpha"}), after=("common",)),
        backends=("beta", "alpha"),
    )
    late = _offering(
        "late",
        _pass("tail", after=("common", "only-alpha"), before=("missing",), optional=("missing",), reason="to end"),
    )
    assert _notes(toy, late) == [
        "another plugin's note",
        "program passes in the order they run, with the plugin that offers each and why it runs there:",
        "for backend alpha:",
        "  before_memory_planning:",
        "    common      plugin toy; every backend",
        "    only-alpha  plugin toy; for alpha; after common",
        "    tail        plugin late; every backend; after common and only-alpha; before missing; to end",
        "for backends beta and none (no backend):",
        "  before_memory_planning:",
        "    common  plugin toy; every backend",
        "    tail    plugin late; every backend; after common and only-alpha; before missing; to end",
    ]


def test_explain_wraps_a_long_reason_under_its_pass_within_100_columns() -> None:
    names = tuple(f"a-rather-long-pass-name-{n}" for n in range(4))
    wide = _offering("wide", *(_pass(n) for n in names), _pass("last", after=names))
    notes = _notes(wide)
    assert max(len(line) for line in notes) <= 100
    start = notes.index("    last                       plugin wide; every backend; after a-rather-long-pass-name-0,")
    assert notes[start + 1 :] == [
        "                               a-rather-long-pass-name-1, a-rather-long-pass-name-2 and",
        "                               a-rather-long-pass-name-3",
    ]


def test_explain_says_when_no_pass_runs_and_when_passes_cannot_be_ordered() -> None:
    assert _notes()[1:] == [
        "program passes in the order they run, with the plugin that offers each and why it runs there:",
        "for backend none (no backend): none",
    ]
    one = _offering("one", _pass("a", after=("b",)))
    two = _offering("two", _pass("b", after=("a",)))
    reason = " ".join(line.strip() for line in _notes(one, two)[1:])
    assert reason.startswith("program passes: the program passes of stage 'before_memory_planning' cannot")
    assert "'a' (plugin 'one')" in reason and "'b' (plugin 'two')" in reason

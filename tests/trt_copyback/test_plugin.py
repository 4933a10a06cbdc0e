"""The plugin: its hooks (``writeback_engines``, runtime delegates, explain columns), thin import."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import pytest
from click.testing import CliRunner
from writeback.cli import main
from writeback.zoo import builtin_models
from writeback_core.registry import hookimpl, load_registry
from writeback_core.types import AliasingEngine, EngineWrite
from writeback_trt_copyback import BACKEND_ID, KVAliasEngine
from writeback_trt_copyback.alias_column import COLUMN, explain_columns


def _engines(registry: object) -> list[AliasingEngine]:
    return [e for found in registry.hook.writeback_engines() for e in found]  # type: ignore[attr-defined]


def test_writeback_engines_hook_offers_the_kv_alias_engine() -> None:
    engines = _engines(load_registry())
    (engine,) = [e for e in engines if e.name == "kv-alias"]
    assert isinstance(engine, AliasingEngine) and engine.backend_id == BACKEND_ID


def test_writeback_engines_hook_takes_an_inline_plugin() -> None:
    class Never:
        name = "never"
        backend_id = "NeverBackend"

        def alias_refusal(self, write: EngineWrite) -> str | None:
            return "this engine aliases nothing"

        def aliased_io(self, processed: bytes) -> dict[str, int]:
            return {}

    class Plugin:
        writeback_name = "never-plugin"

        @hookimpl
        def writeback_engines(self) -> Sequence[AliasingEngine]:
            return [Never()]

    engines = _engines(load_registry(entry_points=False, plugins=[Plugin()]))
    assert [e.name for e in engines] == ["never"] and isinstance(engines[0], AliasingEngine)


def test_two_plugins_offering_one_engine_name_is_an_error_naming_both() -> None:
    from writeback_core.registry import DuplicateNameError

    class Twin:
        def __init__(self, label: str) -> None:
            self.writeback_name = label

        @hookimpl
        def writeback_engines(self) -> Sequence[AliasingEngine]:
            return [KVAliasEngine()]

    registry = load_registry(entry_points=False, plugins=[Twin("twin-b"), Twin("twin-a")])
    with pytest.raises(DuplicateNameError, match="'kv-alias' is offered by both plugin 'twin-a' and plugin 'twin-b'"):
        registry.engines()
    assert "kv-alias" in load_registry().engines()


def test_runtime_delegate_is_offered_under_the_engine_backend_id() -> None:
    delegates = load_registry().runtime_delegates()
    assert delegates[BACKEND_ID].backend_id == BACKEND_ID


def test_plugin_module_imports_no_exir_backend_machinery() -> None:
    code = (
        "import sys, writeback_trt_copyback.plugin; "
        "print(any(m.startswith('executorch.exir.backend') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def _columns(name: str) -> dict[str, dict[str, str]]:
    from writeback.model_build import export_case
    from writeback_core.mutations import find_mutations

    program = export_case(builtin_models()[name])
    return {
        m.target: explain_columns(program, m, KVAliasEngine()) for m in find_mutations(program.run_decompositions())
    }


def test_explain_columns_show_aliased_and_copy_back_cost_per_call() -> None:
    decoder = _columns("decoder")
    assert decoder["blocks.0.k_cache"] == {COLUMN: "aliased, 0 B/call"}
    ema = _columns("ema")
    # running_mean: 8 fp32 = 32 B, materialized as an output and copied back: 64 B per call.
    assert ema["running_mean"] == {COLUMN: "copy-back, 64 B/call"}
    assert ema["steps"] == {COLUMN: "copy-back, 16 B/call"}


def test_writeback_explain_columns_hook_answers_through_the_registry() -> None:
    from writeback.model_build import export_case
    from writeback_core.mutations import find_mutations

    program = export_case(builtin_models()["recurrent"])
    registry = load_registry()
    costs = {}
    for mutation in find_mutations(program.run_decompositions()):
        for columns in registry.hook.writeback_explain_columns(program=program, mutation=mutation):
            if columns and COLUMN in columns:
                costs[mutation.target] = columns[COLUMN]
    # conv_state is 1x16x4 fp32 = 256 B, recurrent_state 1x2x8x8 fp32 = 512 B; each call
    # materializes the new value and copies it back: twice that.
    assert costs == {"conv_state": "copy-back, 512 B/call", "recurrent_state": "copy-back, 1.0 KiB/call"}


def test_writeback_explain_shows_the_columns() -> None:
    result = CliRunner().invoke(main, ["explain", "recurrent"])
    assert result.exit_code == 0, result.output
    # The table wraps cells at its fixed width; the exact values are checked above.
    assert "trt engine" in result.output and "copy-back" in result.output
    assert "/call" in result.output

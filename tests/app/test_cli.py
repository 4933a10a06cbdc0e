"""The writeback CLI: plugins, explain, and commands contributed through the hook."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from writeback.cli import main

from tests.conftest import Decomposition, explain_cells


def test_plugins_lists_every_plugin_and_its_hooks() -> None:
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "writeback" in result.output
    assert "example-backend" in result.output
    assert "writeback_accepts_in_place" in result.output
    assert "writeback_cli_commands" in result.output
    # The example backend's row: its three hooks, as its README says.
    (example,) = [line for line in result.output.splitlines() if "example-backend" in line]
    hooks = example.split("example-backend", 1)[1].strip(" │|").split(", ")
    assert hooks == ["writeback_accepts_in_place", "writeback_backends", "writeback_runtime_delegates"]


def test_explain_decoder_shows_each_cache_with_its_write_and_stock_cost(decompositions: list[Decomposition]) -> None:
    """Also: the rows and the columns that read the core ATen decomposition (mlx, stock
    kernels, trt engine: its lift changes a copy of the graphs) share one, made by
    ``writeback_core.program_passes.decomposed``. (exir's ``to_edge`` decomposes with its
    own table: not counted.)"""
    result = CliRunner().invoke(main, ["explain"])
    assert result.exit_code == 0, result.output
    for text in ("blocks.0.k_cache", "blocks.0.v_cache", "index_copy(dim=2", "1x2x16x16"):
        assert text in result.output
    # stock copies the whole cache (1*2*16*16 fp32 = 2 KiB) back every call
    assert "2.0 KiB" in result.output
    callers = sorted(d.caller for d in decompositions if not d.table)
    assert callers == ["writeback_core.program_passes"], callers


def test_explain_model_from_a_file_factory(tmp_path: Path) -> None:
    source = tmp_path / "mine.py"
    source.write_text(
        "import torch\n"
        "class Acc(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.register_buffer('total', torch.zeros(3))\n"
        "    def forward(self, x):\n"
        "        self.total[1:] = x\n"
        "        return self.total * 1\n"
        "def make():\n"
        "    return Acc(), (torch.ones(2),)\n"
    )
    result = CliRunner().invoke(main, ["explain", f"{source}:make"])
    assert result.exit_code == 0, result.output
    assert "total" in result.output and "slice_scatter(dim=0, 1:3:1)" in result.output


def test_explain_unknown_model_is_a_usage_error_listing_choices() -> None:
    result = CliRunner().invoke(main, ["explain", "nope"])
    assert result.exit_code == 2
    assert "unknown model 'nope'" in result.output and "decoder" in result.output


def test_plugin_contributed_subcommand_appears(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from writeback_core import hookimpl, registry

    class Adds:
        writeback_name = "adds"

        @hookimpl
        def writeback_cli_commands(self, group: click.Group) -> None:
            @group.command("hello")
            def hello() -> None:
                click.echo("hello from a plugin")

    real = registry.load_registry
    monkeypatch.setattr(
        "writeback.cli.load_registry",
        lambda: real(plugins=[Adds()]),
    )
    group = type(main)(name="writeback", callback=main.callback)
    result = CliRunner().invoke(group, ["hello"])
    assert result.exit_code == 0, result.output
    assert "hello from a plugin" in result.output


def test_console_script_entry_point_runs() -> None:
    script = Path(sys.executable).with_name("writeback")
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "explain" in done.stdout and "plugins" in done.stdout


def test_command_prints_no_known_upstream_noise_before_its_output() -> None:
    """`writeback plugins` loads every plugin (torchao and exir included): the import-time
    log lines named in writeback_core.quiet.NOISE never reach the user."""
    script = Path(sys.executable).with_name("writeback")
    done = subprocess.run([str(script), "plugins"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.lstrip().startswith("writeback plugins"), done.stdout[:300]
    assert "Could not load this library" not in done.stderr, done.stderr
    assert "is an Enum subclass" not in done.stderr, done.stderr
    assert done.stderr.strip() == "", done.stderr


def test_plugin_models_and_explain_columns_reach_explain(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch
    from writeback_core import ModelCase, hookimpl, registry

    class Tick(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("ticks", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.ticks.add_(x)
            return self.ticks.sum()

    class Offers:
        writeback_name = "offers"

        @hookimpl
        def writeback_models(self) -> dict[str, ModelCase]:
            return {"tick": ModelCase("tick", "a plugin's model", Tick, lambda step: (torch.ones(4),))}

        @hookimpl
        def writeback_explain_columns(self, mutation) -> dict[str, str] | None:  # type: ignore[no-untyped-def]
            return {"plugin says": f"saw {mutation.target}"}

        @hookimpl
        def writeback_explain_notes(self, program) -> list[str]:  # type: ignore[no-untyped-def]
            return [f"a note on a program of {len(program.graph.nodes)} nodes"]

    real = registry.load_registry
    monkeypatch.setattr("writeback.cli.load_registry", lambda: real(plugins=[Offers()]))
    group = type(main)(name="writeback", callback=main.callback)
    result = CliRunner().invoke(group, ["explain", "tick"])
    assert result.exit_code == 0, result.output
    assert "a plugin's model" in result.output
    assert "saw ticks" in result.output
    assert "16 B" in result.output  # 4 fp32 values copied back each call
    # The plugin's note on the whole program comes after the table.
    lines = result.output.splitlines()
    table_end = max(i for i, line in enumerate(lines) if line.startswith("└"))
    assert any(line.startswith("a note on a program of ") for line in lines[table_end + 1 :]), result.output


def test_explain_of_a_many_layer_model_keeps_every_name_whole_in_100_columns(tmp_path: Path) -> None:
    """Two caches per layer, six layers: twelve states, each named in full (an explain that
    cut them to `layers.1…` left a user unable to tell the layers apart), one row each, and
    no line wider than the terminal."""
    source = tmp_path / "layers.py"
    source.write_text(
        "import torch\n"
        "class Attn(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.register_buffer('key_cache', torch.zeros(1, 2, 8, 4))\n"
        "        self.register_buffer('value_cache', torch.zeros(1, 2, 8, 4))\n"
        "    def forward(self, x, pos):\n"
        "        self.key_cache.index_copy_(2, pos, x)\n"
        "        self.value_cache.index_copy_(2, pos, x * 2)\n"
        "        return self.key_cache.sum() + self.value_cache.sum()\n"
        "class Layer(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.self_attn = Attn()\n"
        "class Model(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layers = torch.nn.ModuleList(Layer() for _ in range(6))\n"
        "    def forward(self, x, pos):\n"
        "        return sum(layer.self_attn(x, pos) for layer in self.layers)\n"
        "def make():\n"
        "    return Model(), (torch.ones(1, 2, 1, 4), torch.tensor([3]))\n"
    )
    result = CliRunner(env={"COLUMNS": "100"}).invoke(main, ["explain", f"{source}:make"])
    assert result.exit_code == 0, result.output
    names = [f"layers.{i}.self_attn.{kind}_cache" for i in range(6) for kind in ("key", "value")]
    rows = [line for line in result.output.splitlines() if "self_attn" in line]
    for name in names:
        assert sum(1 for line in rows if name in line) == 1, (name, result.output)
    assert max(len(line) for line in result.output.splitlines()) <= 100, result.output


def test_explain_of_four_states_with_long_names_keeps_every_name_whole(tmp_path: Path) -> None:
    """Four states (few enough for a column each) whose names are too long for a column:
    ExecuTorch's Llama example names its caches layers.N.attention.kv_cache.k_cache, and a
    column per state cut them to `layers.0.attention.kv_c…`."""
    source = tmp_path / "long.py"
    source.write_text(
        "import torch\n"
        "class Cache(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.register_buffer('k_cache', torch.zeros(1, 2, 8, 4))\n"
        "        self.register_buffer('v_cache', torch.zeros(1, 2, 8, 4))\n"
        "class Attention(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.kv_cache = Cache()\n"
        "class Layer(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.attention = Attention()\n"
        "class Model(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layers = torch.nn.ModuleList(Layer() for _ in range(2))\n"
        "    def forward(self, x, pos):\n"
        "        for layer in self.layers:\n"
        "            layer.attention.kv_cache.k_cache.index_copy_(2, pos, x)\n"
        "            layer.attention.kv_cache.v_cache.index_copy_(2, pos, x * 2)\n"
        "        return sum(b.sum() for b in self.buffers())\n"
        "def make():\n"
        "    return Model(), (torch.ones(1, 2, 1, 4), torch.tensor([3]))\n"
    )
    result = CliRunner(env={"COLUMNS": "100"}).invoke(main, ["explain", f"{source}:make"])
    assert result.exit_code == 0, result.output
    for i in range(2):
        for kind in ("k", "v"):
            assert f"layers.{i}.attention.kv_cache.{kind}_cache" in result.output, result.output
    assert "…" not in result.output, result.output


@pytest.mark.slow
def test_explain_prints_nothing_on_stderr() -> None:
    """explain's columns lower the model several ways; the upstream warnings each lowering
    raises (torch's pytree deprecation, once per deep copy) are named and silenced."""
    script = Path(sys.executable).with_name("writeback")
    done = subprocess.run([str(script), "explain", "decoder"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "blocks.0.k_cache" in done.stdout
    assert done.stderr == ""


def test_explain_of_caches_written_by_llama_update_cache_shows_them_in_place_with_nothing_copied() -> None:
    """ExecuTorch's ``llama::update_cache`` writes each cache in place, so no lowering copies
    it: stock keeps no write-back (0 B), the stock kernels and MLX leave the op writing the
    program's buffer. explain used to crash on such a model (the stock program's signature
    still lists each cache, its graph no longer returns it) and, once past that, on its
    next lowering of the same program (pending unbacked symbols)."""
    from tests.core import update_cache_model

    result = CliRunner().invoke(main, ["explain", f"{update_cache_model.__file__}:make"])
    assert result.exit_code == 0, result.output
    cells = explain_cells(result.output)
    op = "llama::update_cache"
    assert cells["write"] == [f"in place by {op}"] * 2, result.output
    assert cells["stock write-back"] == ["none"] * 2
    assert cells["stock copies/call"] == ["0 B"] * 2
    assert cells["stock kernels"] == [f"in place ({op}), any runtime"] * 2
    assert cells["mlx"] == [f"in place by {op} outside the delegate, 0 B/call"] * 2

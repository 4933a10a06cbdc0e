"""One name per plugin, its entry point's, and the environment variables that choose plugins.

Real entry points: the installed packages', and, where a test needs a plugin
with a wrong name, a small distribution written to a temporary directory on
``sys.path`` that ``importlib.metadata`` discovers as it would any other.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from writeback_core import hookimpl, load_registry
from writeback_core.registry import PluginNameError


def _installed_names() -> list[str]:
    return sorted({point.name for point in metadata.entry_points(group="writeback")})


def _install(root: Path, module: str, entry_name: str, writeback_name: str) -> None:
    """A distribution ``writeback-probe`` whose ``writeback`` entry point ``entry_name`` is ``module``."""
    (root / f"{module}.py").write_text(
        "from writeback_core import hookimpl\n"
        f"writeback_name = {writeback_name!r}\n"
        "@hookimpl\n"
        "def writeback_models():\n"
        "    return {}\n"
    )
    info = root / "writeback_probe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: writeback-probe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[writeback]\n{entry_name} = {module}\n")


class Silent:
    writeback_name = "silent"

    @hookimpl
    def writeback_accepts_in_place(self) -> bool | None:
        return None


def test_every_installed_plugin_is_registered_under_its_entry_point_name_only() -> None:
    registry = load_registry()
    assert registry.plugin_names() == _installed_names()
    for point in metadata.entry_points(group="writeback"):
        assert getattr(point.load(), "writeback_name", point.name) == point.name


@pytest.mark.parametrize("name", _installed_names())
def test_blocking_the_name_writeback_plugins_lists_unloads_that_plugin(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = next(p for p in metadata.entry_points(group="writeback") if p.name == name).load()
    assert name in load_registry().plugin_names()
    monkeypatch.setenv("WRITEBACK_BLOCK_PLUGINS", name)
    registry = load_registry()
    assert name not in registry.plugin_names()
    assert not registry.manager.is_registered(module)


def test_blocking_mlx_backend_removes_the_mlx_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "mlx" in load_registry().backends()
    monkeypatch.setenv("WRITEBACK_BLOCK_PLUGINS", "mlx-backend")
    registry = load_registry()
    assert "mlx" not in registry.backends()
    assert "mlx" not in registry.state_allocators()


def test_block_list_naming_no_plugin_warns_listing_the_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WRITEBACK_BLOCK_PLUGINS", "mlx")
    with pytest.warns(UserWarning, match=r"'mlx'.*blocks nothing.*mlx-backend"):
        registry = load_registry()
    assert "mlx-backend" in registry.plugin_names()


def test_entry_point_whose_writeback_name_differs_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install(tmp_path, "writeback_probe_two_names", "probe", "probe-plugin")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginNameError, match=r"'probe'.*'probe-plugin'"):
        load_registry()


def test_entry_point_whose_writeback_name_agrees_is_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(tmp_path, "writeback_probe_one_name", "probe", "probe")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "probe" in load_registry().plugin_names()


def test_installed_plugin_given_again_under_entry_points_is_refused() -> None:
    import writeback_mlx_backend.plugin

    with pytest.raises(PluginNameError, match="mlx-backend"):
        load_registry(plugins=[writeback_mlx_backend.plugin])


def test_load_list_loads_only_those_and_the_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WRITEBACK_LOAD_PLUGINS", "example-backend")
    registry = load_registry(plugins=[Silent()])
    assert registry.plugin_names() == ["example-backend", "silent", "writeback"]
    assert set(registry.backends()) == {"example"}


def test_empty_load_list_loads_the_builtin_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WRITEBACK_LOAD_PLUGINS", "")
    assert load_registry().plugin_names() == ["writeback"]


def test_block_list_wins_over_load_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WRITEBACK_LOAD_PLUGINS", "example-backend,passes")
    monkeypatch.setenv("WRITEBACK_BLOCK_PLUGINS", "example-backend")
    assert load_registry().plugin_names() == ["passes", "writeback"]


def test_load_list_naming_no_installed_plugin_is_an_error_listing_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WRITEBACK_LOAD_PLUGINS", "passes, mlx")
    with pytest.raises(PluginNameError, match=r"WRITEBACK_LOAD_PLUGINS names 'mlx'.*installed plugins: .*mlx-backend"):
        load_registry()

"""One name per concept: no two source modules of the packages share a file name.

``writeback_mlx_backend/runtime.py`` beside ``writeback_trt_copyback/runtime.py`` makes a reader
(and a traceback, and a search) ask which one is meant. Only the names whose role is the same
everywhere may repeat: a package's ``__init__`` and ``__main__``, its entry-point ``plugin``
and the ``cli`` it adds to the ``writeback`` command.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]

ALLOWED = frozenset({"__init__.py", "__main__.py", "plugin.py", "cli.py"})

# File names still shared while their modules are being renamed in another change (issue 53's
# one lowering path): the app's and trt-copyback's lowering.py, the app's and the passes'
# pipeline.py. The change that renames one of a pair removes its name here; the set then ends
# empty.
PENDING: frozenset[str] = frozenset()


def shared_file_names() -> dict[str, list[str]]:
    """Every file name outside :data:`ALLOWED` that more than one module under
    ``packages/*/src`` has -> those modules' paths, from the repository root."""
    found: dict[str, list[str]] = {}
    for path in sorted(_ROOT.glob("packages/*/src/**/*.py")):
        if path.name not in ALLOWED:
            found.setdefault(path.name, []).append(str(path.relative_to(_ROOT)))
    return {name: paths for name, paths in found.items() if len(paths) > 1}


def test_no_two_source_modules_share_a_file_name() -> None:
    """Each name listed is in two packages at once: rename one module after what it holds and
    fix its imports (packages, tests, docs, entry points)."""
    shared = shared_file_names()
    assert {name: paths for name, paths in shared.items() if name not in PENDING} == {}
    # A pending name that is no longer shared is done: take it out of PENDING.
    assert sorted(PENDING - set(shared)) == []


def test_the_walk_names_a_shared_file_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk itself can fail: two packages' ``program.py`` (one in a sub-package) are named,
    their ``plugin.py`` and ``__init__.py`` are not, nor a name only one package has."""
    for package, files in (
        ("a", ["a_pkg/__init__.py", "a_pkg/plugin.py", "a_pkg/program.py", "a_pkg/only_here.py"]),
        ("b", ["b_pkg/__init__.py", "b_pkg/plugin.py", "b_pkg/fast/__init__.py", "b_pkg/fast/program.py"]),
    ):
        for file in files:
            path = tmp_path / "packages" / package / "src" / file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
    monkeypatch.setattr(sys.modules[__name__], "_ROOT", tmp_path)
    assert shared_file_names() == {
        "program.py": ["packages/a/src/a_pkg/program.py", "packages/b/src/b_pkg/fast/program.py"]
    }

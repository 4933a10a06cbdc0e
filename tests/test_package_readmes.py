"""What a package README names is there: its install lines install what its commands need,
the modules, functions and test files it names exist, and it states no measured figure (those
live in docs/measurements.md with their date and command)."""

from __future__ import annotations

import importlib
import pkgutil
import re
import shlex
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(
    p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("packages/*/README.md"), *ROOT.glob("examples/*/README.md")]
)
APP = "packages/app"
BENCH = "packages/bench"
# Strings that look like dotted names but are keys of a program's metadata or compile specs.
_META_KEYS_FROM = ("writeback_core.meta", "writeback_core.blob")
# A name ending in one of these is a file (``plugin.py``, ``_native.cpp``), not a module's attribute.
_FILE_SUFFIXES = {"py", "md", "cpp", "toml", "json", "pte"}


@cache
def _projects() -> dict[str, tuple[str, dict[str, Any]]]:
    """Distribution name -> (folder relative to the root, its [project] table)."""
    found = {}
    for pyproject in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("examples/*/pyproject.toml")]:
        project = tomllib.loads(pyproject.read_text())["project"]
        found[project["name"]] = (pyproject.parent.relative_to(ROOT).as_posix(), project)
    return found


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]


def _needs(folder: str) -> set[str]:
    """``folder`` and every workspace folder its dependencies reach."""
    by_folder = {f: project for f, project in _projects().values()}
    needed, pending = set(), [folder]
    while pending:
        current = pending.pop()
        if current in needed:
            continue
        needed.add(current)
        for requirement in by_folder[current].get("dependencies", []):
            name = _requirement_name(requirement)
            if name in _projects():
                pending.append(_projects()[name][0])
    return needed


def _import_name(readme: str) -> str:
    folder = str(Path(readme).parent)
    (name,) = [n for n, (f, _) in _projects().items() if f == folder]
    return "writeback" if name == "writeback" else name.replace("-", "_")


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)


def _install_lines(text: str) -> list[list[str]]:
    """The folders each ``pip install`` line of a code block names (extras dropped)."""
    lines = []
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            match = re.match(r"\s*(?:uv )?pip install (.*?)\s*(?:#.*)?$", line)
            if match:
                lines.append([re.sub(r"\[.*\]$", "", arg) for arg in shlex.split(match.group(1))])
    return lines


def _uses(text: str) -> set[str]:
    """The workspace folders that the commands and imports in code blocks need."""
    code = "\n".join(_code_blocks(text))
    needed = set()
    command = r"^\s*(?:uv run )?writeback\s|python -m writeback\b(?!_)"
    if re.search(rf"{command}|^\s*(?:from|import) writeback\b(?!_)", code, re.M):
        needed.add(APP)
    if "python -m writeback_bench" in code:
        needed.add(BENCH)
    return needed


@pytest.mark.parametrize("readme", READMES)
def test_every_install_line_installs_what_the_readmes_commands_need(readme: str) -> None:
    text = (ROOT / readme).read_text()
    own = str(Path(readme).parent)
    for folders in _install_lines(text):
        needed = set().union(*(_needs(f) for f in {own, *_uses(text), *folders}))
        missing = sorted(needed - set(folders))
        assert not missing, f"{readme}: `pip install {' '.join(folders)}` lacks {', '.join(missing)}"


def test_the_install_check_sees_a_missing_application_and_bench() -> None:
    text = "```sh\npip install packages/core packages/passes\npython -m writeback_bench.passes_scale\n```\n"
    assert _uses(text) == {BENCH}
    assert {APP, BENCH} <= set().union(*(_needs(f) for f in _uses(text)))
    assert _install_lines(text) == [["packages/core", "packages/passes"]]
    continued = "```sh\npip install packages/core \\\n  'packages/decoders[hf]'  # a comment\nwriteback run\n```\n"
    assert _install_lines(continued) == [["packages/core", "packages/decoders"]]
    assert _uses(continued) == {APP}


@cache
def _meta_keys() -> set[str]:
    keys = set()
    for module in _META_KEYS_FROM:
        keys |= {v for v in vars(importlib.import_module(module)).values() if isinstance(v, str)}
    return keys


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute reached from the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def _spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _dotted_names(readme: str) -> list[str]:
    """Every dotted ``writeback*`` name in a code span, and every ``module.name`` of the
    README's own package (``_pte.plan_io`` in writeback-pybind-runtime's)."""
    text = (ROOT / readme).read_text()
    package = importlib.import_module(_import_name(readme))
    submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    names = set()
    for span in [*_spans(text), *_code_blocks(text)]:
        names |= set(re.findall(r"\bwriteback(?:_[a-z]+)*(?:\.[A-Za-z_]\w*)+", span))
        for first, rest in re.findall(r"(?<![\w./-])([a-z_]\w*)((?:\.[A-Za-z_]\w*)+)", span):
            if first in submodules:
                names.add(f"{package.__name__}.{first}{rest}")
    return sorted(n for n in names if n not in _meta_keys() and n.rsplit(".", 1)[-1] not in _FILE_SUFFIXES)


@pytest.mark.parametrize("readme", READMES)
def test_every_dotted_name_a_readme_gives_exists(readme: str) -> None:
    missing = [name for name in _dotted_names(readme) if not _resolves(name)]
    assert not missing, f"{readme} names what does not exist: {', '.join(missing)}"


def test_the_name_check_refuses_the_modules_that_moved() -> None:
    assert _resolves("writeback_core.lowering.lower") and _resolves("writeback_core.exporting.export_model")
    moved = (
        "writeback.lowering",
        "writeback.pipeline",
        "writeback_core.program",
        "writeback_passes.pipeline",
        "writeback_core.zoo",
        "writeback_core.cli",
        "writeback_core.testing",
    )
    for name in moved:
        assert not _resolves(name), name


def _public_names(package_name: str) -> set[str]:
    package = importlib.import_module(package_name)
    names = set(getattr(package, "__all__", ()))
    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            names |= set(getattr(importlib.import_module(f"{package_name}.{module.name}"), "__all__", ()))
    return names


@pytest.mark.parametrize("readme", READMES)
def test_every_function_a_bullet_opens_with_is_public_in_its_package(readme: str) -> None:
    """A bullet opening with ``name(...)`` documents a public function of the README's package."""
    text = (ROOT / readme).read_text()
    opened = re.findall(r"^- `([a-z_]\w*)\(", text, flags=re.M)
    public = _public_names(_import_name(readme))
    missing = [name for name in opened if name not in public]
    assert not missing, f"{readme} documents functions its package does not offer: {', '.join(missing)}"


@pytest.mark.parametrize("readme", READMES)
def test_every_test_file_a_readme_cites_exists(readme: str) -> None:
    # Code blocks left out: an example's `tests/test_x.py` is the user's own.
    prose = re.sub(r"^```.*?^```", "", (ROOT / readme).read_text(), flags=re.M | re.S)
    cited = re.findall(r"\btests/[\w/]+\.py\b", prose)
    missing = [path for path in cited if not (ROOT / path).is_file()]
    assert not missing, f"{readme} cites test files that do not exist: {', '.join(missing)}"


_RANGE = "[-\u2013]"  # 155-225 or 155\u2013225 (an en dash)
_FIGURE = re.compile(
    rf"\d[\d.,]*(?:{_RANGE}\d[\d.,]*)?\s?(?:ms|µs|us)\b"  # a time
    rf"|\b\d+(?:\.\d+)?(?:{_RANGE}\d+(?:\.\d+)?)?x\b"  # a ratio (1.24x, 2.5-2.6x); 0x20 is a number
    r"|\d[\d,]*\s?MiB (?:anonymous|resident)"  # a resident-memory reading
)


@pytest.mark.parametrize("readme", READMES)
def test_no_readme_states_a_measured_figure(readme: str) -> None:
    """Timings and ratios belong in docs/measurements.md, dated, with their command."""
    figures = [m.group(0) for m in _FIGURE.finditer((ROOT / readme).read_text())]
    assert not figures, f"{readme} states measured figures ({', '.join(figures)}): move them to docs/measurements.md"


def test_the_figure_check_sees_times_and_ratios_but_not_hex() -> None:
    text = "3.41 ms, 155\u2013225 µs, 1.24x, 2.5-2.6x, +513 MiB anonymous; 0x20, 4,500 mutants"
    found = [m.group(0) for m in _FIGURE.finditer(text)]
    assert found == ["3.41 ms", "155\u2013225 µs", "1.24x", "2.5-2.6x", "513 MiB anonymous"]

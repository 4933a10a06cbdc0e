"""Check what every package's metadata promises a user (run by .ci/run and pre-commit).

- Dependencies are ranges with an upper bound, never exact pins: only the
  pybind-runtime pins executorch (its extension is compiled against one
  release). A requirement shared by several packages reads the same in each.
- requires-python is ">=3.11"; the license is BSD-3-Clause, each package ships
  the root LICENSE; classifiers and project URLs are there; each import
  package has a py.typed.
- The exact versions live only in the root's [tool.uv] constraint-dependencies,
  all pinned; no uv.lock is committed.
- Every ``type: ignore[code]`` in the packages says why, on its line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PINNED = {("writeback-pybind-runtime", "executorch")}
IGNORE = re.compile(r"#\s*type:\s*ignore\[[^\]]+\](?P<rest>.*)$")


def check() -> list[str]:
    problems: list[str] = []
    license_text = (ROOT / "LICENSE").read_text()
    seen: dict[str, tuple[str, str]] = {}
    projects = [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("examples/*/pyproject.toml")]
    folders = sorted(p.parent for p in projects)
    for folder in folders:
        where = folder.relative_to(ROOT)
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        name = project["name"]
        if project.get("requires-python") != ">=3.11":
            problems.append(f"{where}: requires-python is {project.get('requires-python')!r}, not '>=3.11'")
        if project.get("license") != "BSD-3-Clause" or project.get("license-files") != ["LICENSE"]:
            problems.append(f"{where}: license must be 'BSD-3-Clause' with license-files = ['LICENSE']")
        if not (folder / "LICENSE").is_file() or (folder / "LICENSE").read_text() != license_text:
            problems.append(f"{where}/LICENSE is missing or differs from the root LICENSE")
        if "Typing :: Typed" not in project.get("classifiers", []):
            problems.append(f"{where}: classifiers missing (at least 'Typing :: Typed')")
        if not project.get("urls"):
            problems.append(f"{where}: no [project.urls]")
        for package in (folder / "src").iterdir():
            if (package / "__init__.py").is_file() and not (package / "py.typed").is_file():
                problems.append(f"{package.relative_to(ROOT)}: no py.typed")
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        for text in requirements:
            req = Requirement(text)
            specs = list(req.specifier)
            exact = any(s.operator in ("==", "===") for s in specs)
            if (name, req.name) in PINNED:
                if not exact:
                    problems.append(f"{where}: {req.name} must stay pinned exactly ({text!r})")
                continue
            if exact:
                problems.append(f"{where}: {text!r} is an exact pin; declare a range (exact: root constraints)")
            elif not any(s.operator in ("<", "<=", "~=") for s in specs) or not any(
                s.operator in (">", ">=", "~=") for s in specs
            ):
                problems.append(f"{where}: {text!r} needs a lower and an upper bound")
            key = f"{req.name}{req.marker or ''}"
            if key in seen and seen[key][1] != str(req.specifier):
                problems.append(f"{where}: {text!r} differs from {seen[key][0]}'s {req.name}{seen[key][1]}")
            seen.setdefault(key, (str(where), str(req.specifier)))
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    if root["project"].get("requires-python") != ">=3.11":
        problems.append("pyproject.toml: requires-python must be '>=3.11'")
    uv = root["tool"]["uv"]
    for text in [*uv.get("constraint-dependencies", []), *uv.get("build-constraint-dependencies", [])]:
        if not any(s.operator == "==" for s in Requirement(text).specifier):
            problems.append(f"pyproject.toml: constraint {text!r} is not an exact version")
    tracked = subprocess.run(["git", "ls-files", "uv.lock"], cwd=ROOT, capture_output=True, text=True).stdout
    if tracked.strip():
        problems.append("uv.lock is committed (it records this machine's paths): git rm --cached uv.lock")
    for path in sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("examples/*/src/**/*.py")]):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = IGNORE.search(line)
            if match and not match.group("rest").strip().startswith("#"):
                problems.append(f"{path.relative_to(ROOT)}:{number}: type: ignore without a reason on its line")
    return problems


if __name__ == "__main__":
    found = check()
    for problem in found:
        print(problem, file=sys.stderr)
    print(f"package metadata: {len(found)} problem(s)")
    sys.exit(1 if found else 0)

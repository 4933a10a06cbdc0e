"""The README is short and links to per-topic pages: every relative link of README.md and
docs/*.md reaches a file of the repository, and a link to a heading (``page.md#anchor``)
reaches a heading of that page, spelled as GitHub spells its anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def _broken(page: str) -> list[str]:
    source = ROOT / page
    broken = []
    for target in _LINK.findall(source.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        reached = (source.parent / path).resolve() if path else source
        if not reached.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and reached.suffix == ".md" and anchor not in _anchors(reached):
            broken.append(f"{target}: {path or page} has no heading with the anchor #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_reaches_a_file_and_heading(page: str) -> None:
    broken = _broken(page)
    assert not broken, f"{page}: " + "; ".join(broken)


def test_the_anchor_rule_is_githubs() -> None:
    """Worked out by hand from GitHub's rendering of these two headings."""
    heading = "optimum-executorch: `--recipe writeback-xnnpack`"
    assert _anchor(heading) == "optimum-executorch---recipe-writeback-xnnpack"
    assert _anchor("Security: a `.pte` is data") == "security-a-pte-is-data"


def test_the_readme_links_each_topic_page() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in ["docs/install.md", "docs/commands.md", "docs/security.md", "docs/writing-a-backend.md"]:
        assert f"]({page}" in readme, page

"""The documentation a newcomer reads: every relative link in README.md and docs/*.md resolves (the file, and
the heading an anchor names), every whole profile a page shows validates as it stands, the README keeps to
about 200 lines (the rest lives in docs/), and its two commands are the set-up the CI script runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from abbench.profile import profile_from_dict

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The page without its fenced code blocks (a link inside code is not a link)."""
    return re.sub(r"(?ms)^ *```.*?^ *```", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"[`*_]", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"(?m)^#+ (.+)$", prose(page.read_text()))}


def links(page: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(prose(page.read_text()))]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_pages_link_each_other() -> None:
    """Every docs page is reachable from the README (directly)."""
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md")}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def test_whole_profiles_in_the_docs_validate() -> None:
    """A TOML block with a name and arms is a profile users copy: it must load as it stands."""
    seen = 0
    for page in PAGES:
        for block in re.findall(r"(?ms)^ *```toml\n(.*?)^ *```", page.read_text()):
            block = "\n".join(line.removeprefix("   ") for line in block.splitlines())  # a list item's indent
            data = tomllib.loads(block)
            if "name" in data and "arms" in data:
                profile_from_dict(data, where=str(page.relative_to(REPO)))
                seen += 1
    assert seen >= 2  # the README's five-step profile and the profile reference


def test_the_readme_is_short_and_its_commands_are_what_ci_runs() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "README.md is for a newcomer's first five minutes: move detail to docs/"
    setup = "python3.11 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '.[engine,test]'"
    assert f"{setup} && abbench run\n" in text and f"{setup} && python -m pytest\n" in text
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install -q torch==2.13.0" in ci and "pip install -q -e '.[engine,test]'" in ci
    assert "python -m pytest -q" in ci and "abbench run --out" in ci

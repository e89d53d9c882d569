"""Every relative link in README.md, bench/README.md and docs/*.md names a file that exists
(and a heading that exists, when it has a #fragment)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *DOCS]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"(?m)^#+ (.+)$", re.sub(r"(?ms)^```.*?^```", "", page.read_text()))
    return {_slug(h) for h in headings}


def relative_links(page: Path) -> list[str]:
    """Targets of the page's links that point into the repository."""
    targets = LINK.findall(_prose(page.read_text()))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def broken(page: Path) -> list[str]:
    bad = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            bad.append(f"{target}: no heading #{fragment} in {dest.name}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken(page) == []


def test_the_docs_are_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(ROOT / "README.md")}
    orphans = [p.name for p in DOCS if p.resolve() not in linked]
    assert orphans == []


def test_slug_follows_github():
    assert _slug("Tests and CI") == "tests-and-ci"
    assert _slug("Data parallel: `parallel.data`") == "data-parallel-paralleldata"

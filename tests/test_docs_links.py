"""Every link in README.md, bench/README.md, records/README.md and docs/*.md to a file of
the repository names a file that exists in this checkout (and a heading that exists, when
it has a #fragment): relative links, and README.md's absolute ones under the repository's
URL (README.md is the package index's page too, where relative links break: it links by
blob/main/ URLs, images by raw/main/, which map back to the checkout's files)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "records" / "README.md", *DOCS]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# Reference-style definitions: "[name]: target" on a line of its own.
REFERENCE = re.compile(r"(?m)^ {0,3}\[[^\]]+\]:\s*(\S+)")


def _targets(text: str) -> list[str]:
    return LINK.findall(text) + REFERENCE.findall(text)
REPO_URL = "https://github.com/pycomm/pycomm"
# An absolute link to a file of the repository: blob/ (a page), raw/ (an image), tree/ (a
# folder), on main.
REPO_FILE = re.compile(re.escape(REPO_URL) + r"/(?:blob|raw|tree)/main/(.*)")


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
    """Targets of the page's relative links (into the repository, from the page)."""
    targets = _targets(_prose(page.read_text()))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def repo_links(page: Path) -> list[tuple[str, Path, str]]:
    """(target, the checkout's file, #fragment) of every link of the page to a file of the
    repository: relative ones from the page's folder, absolute ones from the root."""
    out = []
    for target in _targets(_prose(page.read_text())):
        absolute = REPO_FILE.fullmatch(target)
        if absolute:
            base, rel = ROOT, absolute.group(1)
        elif re.match(r"[a-z]+:", target):
            continue
        else:
            base, rel = page.parent, target
        path, _, fragment = rel.partition("#")
        out.append((target, (base / path).resolve() if path else page, fragment))
    return out


def broken(page: Path) -> list[str]:
    bad = []
    for target, dest, fragment in repo_links(page):
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            bad.append(f"{target}: no heading #{fragment} in {dest.name}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken(page) == []


def test_the_docs_are_linked_from_the_readme():
    linked = {dest for _, dest, _ in repo_links(ROOT / "README.md")}
    orphans = [p.name for p in DOCS if p.resolve() not in linked]
    assert orphans == []


def test_readme_links_work_off_the_repository():
    """No relative link in README.md (the package index's page); images under raw/."""
    readme = ROOT / "README.md"
    assert relative_links(readme) == []
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", _prose(readme.read_text()))
    assert images and all(i.startswith(f"{REPO_URL}/raw/main/") for i in images), images
    assert len(repo_links(readme)) > 10


def test_an_absolute_repo_link_maps_to_the_checkout(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"[ok]({REPO_URL}/blob/main/docs/layout.md#tests-and-ci) "
                    f"[bad]({REPO_URL}/blob/main/docs/nope.md) [issues]({REPO_URL}/issues) "
                    f"[heading]({REPO_URL}/blob/main/README.md#no-such-heading)")
    assert broken(page) == [f"{REPO_URL}/blob/main/docs/nope.md: no such file",
                            f"{REPO_URL}/blob/main/README.md#no-such-heading: no heading "
                            "#no-such-heading in README.md"]


def test_slug_follows_github():
    assert _slug("Tests and CI") == "tests-and-ci"
    assert _slug("Data parallel: `parallel.data`") == "data-parallel-paralleldata"

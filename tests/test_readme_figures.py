"""The README's quoted figures are what the committed results give (bench.quotes), and
the headline figure regenerates from the committed raw files."""

import json
from pathlib import Path

import pytest

from bench import headline, quotes

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(quotes.QUOTES))
def test_readme_quotes_the_committed_results(name):
    text = quotes.QUOTES[name]()
    assert text in README, f"README should say {text!r} ({name}; python -m bench.quotes)"


def _summaries() -> list[Path]:
    """The committed collective summaries (not their jobs' raw files, not step times)."""
    found = sorted(p for p in quotes.RESULTS.glob("*.json")
                   if ".job" not in p.name and not p.name.startswith("step_time"))
    assert found, f"no summaries in {quotes.RESULTS}"
    return found


def test_every_summary_lists_raw_files_that_are_committed():
    for path in _summaries():
        s = json.loads(path.read_text())
        assert len(s["runs"]) == s["jobs"] >= 3, path
        for names in s["runs"]:
            for name in names:
                raw = json.loads((path.parent / name).read_text())
                assert raw["meta"]["provenance"]["commit"], (path, name)


def test_bench_readme_tables_are_the_committed_summaries():
    """Every table line bench.tables renders from a committed summary (remade from its
    raw files) is in bench/README.md word for word."""
    from bench import tables
    from bench._jobs import remake

    text = (ROOT / "bench" / "README.md").read_text()
    for path in _summaries():
        for line in tables.render_summary(remake(path), path.stem):
            assert line in text, f"bench/README.md lacks, from {path.name}: {line}"


def test_headline_regenerates_from_committed_files(tmp_path):
    out = tmp_path / "headline.png"
    assert headline.main(["--summary", str(ROOT / headline.README_SUMMARY), "--out",
                          str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

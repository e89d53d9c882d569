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
    text = quotes.marked(name, quotes.QUOTES[name]())
    assert text in README, (f"README should say {text!r} "
                            f"({name}; python -m bench.quotes --write-readme)")


def test_write_readme_rewrites_each_marked_phrase_and_refuses_a_missing_marker():
    text = "a <!-- q:x -->old one<!-- /q --> b <!-- q:y -->2<!-- /q -->"
    assert (quotes.write_readme(text, {"x": "new", "y": "3"})
            == "a <!-- q:x -->new<!-- /q --> b <!-- q:y -->3<!-- /q -->")
    with pytest.raises(SystemExit, match="no marker for the quote 'z'"):
        quotes.write_readme(text, {"z": "1"})


def _summaries() -> list[Path]:
    """The committed collective summaries (not their jobs' raw files)."""
    found = sorted(p for p in quotes.RESULTS.glob("*.json") if ".job" not in p.name)
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
    from bench._summary import remake

    text = (ROOT / "bench" / "README.md").read_text()
    for path in _summaries():
        for line in tables.render_summary(remake(path), path.stem):
            assert line in text, f"bench/README.md lacks, from {path.name}: {line}"


def test_headline_regenerates_from_committed_files(tmp_path):
    out = tmp_path / "headline.png"
    assert headline.main(["--summary", str(ROOT / headline.README_SUMMARY), "--out",
                          str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_readme_replaces_only_the_named_sections():
    """bench.tables --write-readme: untouched sections stay byte for byte, a named one is
    replaced where it stands, a new one is added before the end marker."""
    from bench import tables

    text = (ROOT / "bench" / "README.md").read_text()
    assert tables.replace_in_readme(text, {}) == text
    first = text.split(tables.BEGIN, 1)[1].split("#### ", 2)[1].split("\n", 1)[0].strip()
    changed = tables.replace_in_readme(text, {first: [f"#### {first}", "", "new", ""],
                                              "brand-new": ["#### brand-new", "", "x", ""]})
    block = changed.split(tables.BEGIN, 1)[1].split(tables.END, 1)[0]
    assert block.index(f"#### {first}\n\nnew\n") < block.index("#### brand-new")
    assert block.endswith("#### brand-new\n\nx\n\n")
    assert changed.split(tables.END, 1)[1] == text.split(tables.END, 1)[1]


def test_tables_over_a_results_folder_skip_what_is_no_summary(capsys):
    """``python -m bench.tables records/collectives/*.json`` (the documented form) meets each
    job's own results beside the summaries: it renders the summaries and names what it
    skipped, rather than failing on the first job file."""
    from pathlib import Path

    from bench import tables

    folder = Path(__file__).resolve().parent.parent / "records" / "collectives"
    summary = folder / "mpirun-2r-fp32-barrier.json"
    job = folder / "mpirun-2r-fp32-barrier.job1.json"
    tables.main([str(job), str(summary)])
    out, err = capsys.readouterr()
    assert "#### mpirun-2r-fp32-barrier" in out and "| 1 KB | " in out
    assert f"skipped {job}: not a --jobs summary" in err

"""Docs and code point only inside the repository: a user has none of the project's
private notes (the planning folder beside the checkout, its reviews and tools)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The private notes' names, and any path that climbs out of the checkout into them.
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(reviews|tools|hooks)\b"
                     r"|\b(BENCHMARKS|PAPERS|ARCHITECTURE|STYLE|C10D_NOTES)\.md\b")
TEXT = (".py", ".md", ".sh", ".toml", ".cfg", ".txt", ".cc", ".h", ".cu", ".cuh", ".yml")


def _a_record(name: str) -> bool:
    """A file of a run kept in records/ (its folders' logs, notes and scripts, as they ran,
    may name where they ran); records/README.md and the investigations are read."""
    parts = name.split("/")
    return parts[0] == "records" and len(parts) > 2 and parts[1] != "investigations"


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = []
    for name in files:
        if not name.endswith(TEXT) or _a_record(name):
            continue
        for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{name}:{i}: {line.strip()}")
    assert not hits, "references outside the repository:\n" + "\n".join(hits)

"""Where this copy of pycomm comes from, and the torch its build was compiled against.

A copy is either a source checkout (setup.py, pyproject.toml and csrc/ beside the
package: built with ``pip install --no-build-isolation -e .``, or not at all) or an
installed one (a wheel, or an sdist compiled on install). Installed metadata describes
this copy only when it points at it: an editable install of this checkout, or files
installed where this package is; another pycomm's metadata elsewhere on sys.path does
not count. setup.py pins a wheel's (and an editable install's) torch to the one it was
compiled against (``Requires-Dist: torch==2.13.0``), which is how the torch a build was
made for is known even when its extension does not load.
"""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

PACKAGE_DIR = Path(__file__).resolve().parent
# The distribution (pip's name) that installs pycomm and parallel: "pycomm" on PyPI is
# another project's.
DISTRIBUTION = "pycomm-collectives"


def checkout_root(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The source checkout this package lies in, else None (an installed copy)."""
    root = package_dir.parent
    if all((root / f).is_file() for f in ("setup.py", "pyproject.toml")) and (
            root / "csrc").is_dir():
        return root
    return None


def describes(dist: metadata.Distribution, package_dir: Path = PACKAGE_DIR) -> bool:
    """Whether ``dist`` is the installed metadata of the pycomm package at ``package_dir``."""
    direct = dist.read_text("direct_url.json")
    if direct:
        info = json.loads(direct)
        if info.get("dir_info", {}).get("editable"):
            url = urlparse(info.get("url", ""))
            return url.scheme == "file" and Path(unquote(url.path)).resolve() == (
                package_dir.resolve().parent)
    files = {str(f) for f in dist.files or []}
    return "pycomm/__init__.py" in files and Path(
        str(dist.locate_file("pycomm/__init__.py"))).resolve() == package_dir / "__init__.py"


def distribution(package_dir: Path = PACKAGE_DIR) -> metadata.Distribution | None:
    """pycomm's installed metadata when it describes this copy, else None."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    return dist if describes(dist, package_dir) else None


def built_against(package_dir: Path = PACKAGE_DIR) -> str | None:
    """The torch version this copy was built against (its metadata's ``torch==X`` pin), or
    None when unknown (no metadata for this copy, or the sdist's range)."""
    dist = distribution(package_dir)
    for req in (dist.requires or []) if dist is not None else []:
        m = re.fullmatch(r"torch\s*==\s*([^\s;,]+)", req.strip())
        if m:
            return m.group(1)
    return None


def version() -> str:
    """pycomm's version: pyproject.toml's (the one source), read back from the installed
    metadata; "0+unknown" for a source tree that was never installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"

"""torch's ``torch.backends`` entry point (pycomm_autoload): ``init_process_group("pycomm")``
works after ``import torch`` alone, loads pycomm only then, and can never break
``import torch`` (a pycomm that cannot load fails the group that asks for it instead).

Each case runs in a fresh interpreter: the entry point runs at ``import torch``.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest

from pycomm._install import DISTRIBUTION

ONE_RANK_GROUP = """
import datetime
import torch
import torch.distributed as dist
store = dist.HashStore()
dist.init_process_group("pycomm", store=store, rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
"""


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_the_installed_metadata_names_the_entry_point():
    (entry,) = [e for e in importlib.metadata.entry_points(group="torch.backends")
                if e.dist is not None and e.dist.name == DISTRIBUTION]
    assert (entry.name, entry.value) == ("pycomm", "pycomm_autoload:register_lazily")


def test_import_torch_alone_registers_the_name_and_loads_no_extension():
    done = _python("""
        import sys
        import torch
        import torch.distributed as dist
        assert "pycomm" in dist.Backend.backend_list, dist.Backend.backend_list
        assert "pycomm" not in sys.modules and "pycomm._C" not in sys.modules, \\
            sorted(m for m in sys.modules if m.startswith("pycomm"))
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_init_process_group_without_import_pycomm_runs_a_collective():
    done = _python(ONE_RANK_GROUP + """
import sys
t = torch.arange(4, dtype=torch.float64)
dist.all_reduce(t)
assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
assert type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__ == \\
    "ProcessGroupPycomm", dist.group.WORLD._get_backend(torch.device("cpu"))
assert "pycomm._C" in sys.modules
dist.destroy_process_group()
print("ok")
""")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_import_pycomm_after_the_autoload_keeps_one_registration():
    done = _python("""
        import torch
        import torch.distributed as dist
        import pycomm
        assert dist.Backend.backend_list.count("pycomm") == 1, dist.Backend.backend_list
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_pycomm_that_cannot_load_fails_the_group_not_import_torch():
    # sys.modules[name] = None makes that import fail, as a missing or stale _C does.
    done = _python(textwrap.dedent("""
        import sys
        import torch
        sys.modules["pycomm._C"] = None
    """) + ONE_RANK_GROUP)
    assert done.returncode != 0
    assert "pycomm._C cannot be loaded" in done.stderr, done.stderr[-3000:]
    assert "Failed to load the backend extension" not in done.stderr


@pytest.mark.parametrize("failure", ["register_backend", "import"])
def test_the_entry_point_never_raises(failure):
    """torch turns an exception from the entry point into a failed ``import torch``."""
    break_it = {"register_backend": "dist.Backend.register_backend = staticmethod(boom)",
                "import": "sys.modules['torch.distributed'] = None"}[failure]
    done = _python(f"""
        import sys
        import torch
        import torch.distributed as dist
        def boom(*args, **kwargs):
            raise RuntimeError("boom")
        dist.Backend.backend_list.remove("pycomm")
        {break_it}
        import pycomm_autoload
        pycomm_autoload.register_lazily()
        print("ok")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_autoload_can_be_turned_off_as_torch_documents():
    done = _python("""
        import torch
        import torch.distributed as dist
        print("pycomm" in dist.Backend.backend_list)
    """, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr

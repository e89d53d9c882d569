"""Parallel-training strategies built on torch.distributed (any backend; fastest on pycomm).

Each strategy is a sub-package that takes its process group explicitly: data parallel,
ZeRO, tensor parallel, pipeline parallel and recomputation arrive one issue at a time.
They share one random-number tracker, :mod:`pycomm.parallel.rng` (dropout streams per tensor-
and pipeline-parallel rank, replayed by every recomputation).
"""

# One name per module: run from a checkout's root, "import parallel" would find this folder
# and load a second copy of every module beside pycomm.parallel's (two trackers, two
# registries). The folder installs as pycomm.parallel (setup.py's PACKAGE_DIR).
if __name__ != "pycomm.parallel":
    raise ImportError(f"the strategies are pycomm.parallel, not {__name__}: install the "
                      "project (pip install -e .) and import pycomm.parallel")

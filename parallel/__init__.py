"""Parallel-training strategies built on torch.distributed (any backend; fastest on pycomm).

Each strategy is a sub-package that takes its process group explicitly: data parallel,
ZeRO, tensor parallel, pipeline parallel and recomputation arrive one issue at a time.
They share one random-number tracker, :mod:`parallel.rng` (dropout streams per tensor-
and pipeline-parallel rank, replayed by every recomputation).
"""

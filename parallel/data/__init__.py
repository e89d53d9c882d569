"""Data parallelism: bucketed (C_B), overlapped gradient all-reduce on a gradient arena (M_D)."""

from .data_parallel import DataParallel

__all__ = ["DataParallel"]

"""Benchmarks: pycomm against its peers, side by side in one run (see BENCHMARKS.md)."""

"""The collective benchmark's arithmetic, checker and report, plus one tiny gloo run."""

import json

import pytest
import torch

from bench import _report, _timing
from bench._cli import parse_args, parse_size, sizes
from bench.collectives import main


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("1K", 1024), ("64M", 64 << 20), ("1G", 1 << 30), ("100", 100), ("8B", 8), ("1.5k", 1536)],
)
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


def test_sizes_include_both_ends():
    assert sizes(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert sizes(1024, 60000, 8) == [1024, 8192]


def test_repeated_backend_gets_its_own_label():
    assert parse_args(["--backends", "gloo,gloo,gloo"]).backends == ["gloo", "gloo#2", "gloo#3"]


@pytest.mark.parametrize(
    ("op", "world", "factor"),
    [
        ("all_reduce", 4, 1.5),
        ("all_gather", 4, 0.75),
        ("broadcast", 4, 1.0),
        ("all_to_all", 2, 0.5),
    ],
)
def test_busbw_factor(op, world, factor):
    assert _timing.busbw_factor(op, world) == factor


def _simulate(op: str, count: int, dtype: torch.dtype, rank: int, world: int) -> torch.Tensor:
    """What a correct backend leaves in rank's result buffer, computed in ``dtype``."""
    ins = [_timing.make_buffers(op, count, dtype, r, world).src for r in range(world)]
    chunk = count // world
    mine = slice(rank * chunk, (rank + 1) * chunk)
    return {
        "all_reduce": lambda: sum(ins[1:], ins[0]),
        "reduce_scatter": lambda: sum(ins[1:], ins[0])[mine],
        "all_gather": lambda: torch.cat(ins),
        "broadcast": lambda: ins[_timing.ROOT],
        "all_to_all": lambda: torch.cat([x[mine] for x in ins]),
    }[op]()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("op", _timing.OPS)
def test_checker_counts_exactly_the_wrong_elements(op, dtype):
    world, rank = 3, 1
    count = _timing.total_count(op, 1000, dtype.itemsize, world)
    ref = _timing.expected(op, count, dtype, rank, world, "sum")
    result = _simulate(op, count, dtype, rank, world)
    assert _timing.count_wrong(result, ref, "sum") == 0  # exact even in bfloat16
    result[::7] += 1
    assert _timing.count_wrong(result, ref, "sum") == len(result[::7])


def test_summary_takes_slowest_rank_then_median():
    per_rank = [
        {"times": [1e-3, 5e-3, 2e-3], "wrong": 0},
        {"times": [2e-3, 1e-3, 3e-3], "wrong": 1},
    ]
    row = _report.summarize("all_reduce", "gloo", 4000, 1000, "float32", "sum", per_rank, 2)
    assert row["time_us"] == pytest.approx(3000)  # max per iteration: 2, 5, 3 ms
    assert row["algbw"] == pytest.approx(4000 / 3e-3 / 1e9)
    assert row["busbw"] == pytest.approx(row["algbw"])  # 2(n-1)/n = 1 at n = 2
    assert row["wrong"] == 1


def test_tiny_gloo_run_writes_a_clean_table(tmp_path):
    out = tmp_path / "c.json"
    argv = [
        "--backends",
        "gloo,gloo",
        "--ops",
        ",".join(_timing.OPS),
        "-b",
        "1K",
        "-e",
        "4K",
        "-n",
        "2",
        "-w",
        "1",
        "--out",
        str(out),
        "--quiet",
    ]
    main(argv)  # spawns two ranks
    doc = json.loads(out.read_text())
    assert len(doc["results"]) == len(_timing.OPS) * 2 * 2
    assert all(r["wrong"] == 0 for r in doc["results"])

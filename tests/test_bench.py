"""The collective benchmark's arithmetic, checker and report, plus tiny real runs."""

import importlib.util
import json
import statistics
from types import SimpleNamespace

import pytest
import torch

from bench import _limit, _mpi, _report, _timing
from bench._cli import parse_args, parse_size, sizes
from bench.collectives import main

# Faster than any CPU's caches, let alone its memory (a core's L1 moves ~0.2 TB/s): no
# rank moves an op's least traffic (bench._limit.least_bytes) faster than this.
MAX_BYTES_PER_S = 1e12
MIN_COLLECTIVE_S = 20e-9  # a result seen by another process: one core-to-core cache line


def check_rows(doc: dict) -> None:
    """Every row of a benchmark JSON is consistent, by nccl-tests' definitions, with its
    own times: ``time_us`` the median of ``times_us`` (one per timed iteration), ``algbw``
    = bytes / time, ``busbw`` = algbw * the op's factor at this world size, ``bytes`` =
    count * element size; and no time below what the hardware allows (the op's least
    traffic at ``MAX_BYTES_PER_S``, and one cache-line handoff)."""
    meta = doc["meta"]
    world, iters = meta["nproc"], meta["iters"]
    itemsize = getattr(torch, meta["datatype"]).itemsize
    assert doc["results"], "no rows"
    for r in doc["results"]:
        where = f"{r['backend']} {r['op']} {r['bytes']} B: {r}"
        assert r["bytes"] == r["count"] * itemsize, where
        assert len(r["times_us"]) == iters, where
        assert r["time_us"] == pytest.approx(statistics.median(r["times_us"]), rel=1e-12), where
        assert r["algbw"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9,
                                           rel=1e-9), where
        assert r["busbw"] == pytest.approx(
            r["algbw"] * _timing.busbw_factor(r["op"], world), rel=1e-9), where
        floor_s = max(MIN_COLLECTIVE_S,
                      _limit.least_bytes(r["op"], r["bytes"], world) / MAX_BYTES_PER_S)
        assert min(r["times_us"]) * 1e-6 >= floor_s, f"faster than {floor_s:.2g} s: {where}"


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
        ("reduce", 4, 1.0),
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
        "reduce": lambda: sum(ins[1:], ins[0]),  # the root's result
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
    check_rows(doc)


class _FakeComm:
    """A rank of a ``world``-rank group whose collective is ``write(bufs)``: what the
    backend leaves in the result buffer is up to the test (no processes, no backend)."""

    alloc = staticmethod(torch.empty)
    checked = True

    def __init__(self, rank: int, world: int, write):
        self.rank, self.world, self.write = rank, world, write

    def barrier(self) -> None:
        pass

    def launcher(self, op, bufs, redop):
        return lambda: self.write(bufs)


@pytest.mark.parametrize("timing", ["barrier", "b2b"])
@pytest.mark.parametrize("check", [1, 2])
@pytest.mark.parametrize("op", _timing.OPS)
def test_the_check_counts_a_backend_that_stops_writing_its_result(op, check, timing):
    """``#wrong`` is really counted, on a result the timed call itself wrote: a backend
    that writes the right result once (the warm-up) and nothing after is caught, with
    -c 1 as with -c 2 and in both timing modes (outputs poisoned, inputs restored, before
    a checked call); one that always writes it is not."""
    world = 2
    rank = _timing.ROOT if op == "reduce" else 1  # only reduce's root holds a result;
    count = _timing.total_count(op, 4096, 4, world)  # broadcast's root keeps its input
    right = _simulate(op, count, torch.float32, rank, world)
    args = SimpleNamespace(iters=3, warmup_iters=1, check=check, redop="sum", timing=timing)
    calls: list[int] = []

    def once(bufs):
        if not calls:
            bufs.result().copy_(right)
        calls.append(1)

    def always(bufs):
        bufs.result().copy_(right)

    stale = _timing.time_case(op, count, torch.float32, _FakeComm(rank, world, once), args)
    assert stale["wrong"] > 0, (stale, calls)
    good = _timing.time_case(op, count, torch.float32, _FakeComm(rank, world, always), args)
    assert good["wrong"] == 0 and len(good["times"]) == args.iters, good


def test_time_grows_with_size(tmp_path):
    """A 4 MB all_reduce takes longer than an 8 B one on pycomm (minimum over the
    iterations, the least noisy), and longer than its traffic at ``MAX_BYTES_PER_S`` on
    every backend: a backend that skipped the work, or a time in the wrong unit, fails.
    gloo's small calls are not compared: on a loaded VM its 8 B time is the wake-up of its
    threads (0.2-9 ms here, bench/README.md), which can exceed its 4 MB time (CI saw 3.9 ms
    against 2.4 ms)."""
    out = tmp_path / "sizes.json"
    backends = [b for b in _smoke_backends() if b in ("pycomm", "gloo")]
    main(["--backends", ",".join(backends), "--ops", "all_reduce", "-b", "8", "-e", "4M",
          "-f", str(512 << 10), "-n", "5", "-w", "1", "--out", str(out), "--quiet"])
    doc = json.loads(out.read_text())
    check_rows(doc)
    for b in backends:
        small, large = (min(r["times_us"]) for r in sorted(
            (r for r in doc["results"] if r["backend"] == b), key=lambda r: r["bytes"]))
        if b != "gloo":
            assert large > small, (b, small, large)
        assert large * 1e-6 > _limit.least_bytes("all_reduce", 4 << 20, 2) / MAX_BYTES_PER_S


def test_registered_goes_right_after_pycomm():
    args = parse_args(["--backends", "pycomm,gloo,mpi", "--registered"])
    assert args.backends == ["pycomm", "pycomm-registered", "gloo", "mpi"]


def test_default_backends_follow_open_mpi(monkeypatch):
    monkeypatch.setattr(_mpi, "missing", lambda: "")
    assert parse_args([]).backends == ["pycomm", "gloo", "mpi"]
    monkeypatch.setattr(_mpi, "missing", lambda: "mpi4py is not installed (...)")
    args = parse_args([])
    assert args.backends == ["pycomm", "gloo"]
    assert "mpi4py is not installed" in args.notes[0]


def test_ratio_columns_are_first_over_each_peer():
    rows = [
        {**dict.fromkeys(("count", "type", "redop"), 1), "bytes": 8, "backend": b,
         "time_us": t, "algbw": 1.0, "busbw": 8 / t, "wrong": 0}
        for b, t in (("pycomm", 1.0), ("gloo", 4.0), ("mpi", 2.0))
    ]
    table = _report.format_op("all_reduce", rows, ["pycomm", "gloo", "mpi"])
    assert "pycomm/gloo" in table[1] and "pycomm/mpi" in table[1]
    assert table[3].split("|")[-2:] == ["   0.25   4.00 ", "   0.50   2.00"]


def _smoke_backends() -> list[str]:
    """Every backend this machine has: pycomm (and its arena buffers), gloo, Open MPI."""
    import pycomm

    out = ["gloo"]
    if pycomm.extension_error() is None:
        out = ["pycomm", *(["pycomm-registered"] if hasattr(pycomm, "empty") else []), *out]
    return out + ([] if _mpi.missing() else ["mpi"])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One run of every op on every backend present, at 8 B, 512 B and 32 KB."""
    out = tmp_path_factory.mktemp("smoke") / "c.json"
    backends = _smoke_backends()
    argv = ["--backends", ",".join(backends), "--ops", ",".join(_timing.OPS),
            "-b", "8", "-e", "64K", "-f", "64", "-n", "2", "-w", "1", "--out", str(out), "--quiet"]
    main(argv)  # under mpirun when mpi is among them
    return backends, out


def test_smoke_every_op_and_backend_is_right(smoke):
    backends, out = smoke
    doc = json.loads(out.read_text())
    assert doc["meta"]["backends"] == backends, doc["meta"]["skipped"]
    cases = {(r["op"], r["backend"], r["bytes"]) for r in doc["results"]}
    assert len(cases) == len(_timing.OPS) * len(backends) * 3
    assert [r for r in doc["results"] if r["wrong"] != 0] == []
    check_rows(doc)
    png = out.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is None:  # optional ([bench]): no plot then
        assert not png.exists(), png
    else:
        assert png.stat().st_size > 0


@pytest.mark.skipif(bool(_mpi.missing()), reason=f"no Open MPI/mpi4py: {_mpi.missing()}")
def test_smoke_includes_open_mpi(smoke):
    doc = json.loads(smoke[1].read_text())
    assert {r["op"] for r in doc["results"] if r["backend"] == "mpi"} == set(_timing.OPS)


@pytest.mark.skipif(bool(_mpi.missing()), reason=f"no Open MPI/mpi4py: {_mpi.missing()}")
def test_open_mpi_moves_bfloat16_but_does_not_reduce_it(tmp_path, capfd):
    out = tmp_path / "bf16.json"
    main(["--backends", "mpi", "--ops", "all_reduce,all_gather", "-d", "bfloat16",
          "-b", "8", "-e", "512", "-f", "64", "-n", "2", "-w", "1", "--out", str(out), "--quiet"])
    rows = json.loads(out.read_text())["results"]
    assert {r["op"] for r in rows} == {"all_gather"}
    assert all(r["wrong"] == 0 for r in rows)
    assert "skipped mpi for all_reduce: Open MPI has no torch.bfloat16 reduction" in (
        capfd.readouterr().out
    )


@pytest.mark.usefixtures("require_pycomm")
def test_pycomm_fast_path_columns_time_right_results(tmp_path):
    """pycomm-native, pycomm-api and pycomm-op (all_reduce without torch.distributed's
    wrapper) are checked on every iteration like any column; their other ops are named
    unsupported, not timed as something else."""
    out = tmp_path / "c.json"
    fast = ["pycomm-native", "pycomm-api", "pycomm-op"]
    main(["--backends", ",".join(["pycomm", *fast]), "--ops", "all_reduce,all_gather",
          "-b", "16", "-e", "64K", "-f", "64", "-n", "3", "-w", "1", "-c", "2",
          "--out", str(out), "--quiet"])
    doc = json.loads(out.read_text())
    timed = {(r["backend"], r["op"]) for r in doc["results"]}
    assert {(b, "all_reduce") for b in fast} <= timed
    assert not {(b, "all_gather") for b in fast} & timed
    assert [r for r in doc["results"] if r["wrong"] != 0] == []
    check_rows(doc)


@pytest.mark.usefixtures("require_pycomm")
def test_torch_floor_column_times_dist_all_reduce_on_the_fake_backend(tmp_path):
    """torch-floor is torch's dispatch alone, timed like a column: all_reduce only, never
    counted as right or wrong (it computes nothing), and no faster than nothing."""
    out = tmp_path / "c.json"
    main(["--backends", "pycomm,torch-floor", "--ops", "all_reduce,all_gather",
          "-b", "16", "-e", "1K", "-f", "64", "-n", "20", "-w", "2", "-c", "2",
          "--out", str(out), "--quiet"])
    doc = json.loads(out.read_text())
    floor = [r for r in doc["results"] if r["backend"] == "torch-floor"]
    assert {r["op"] for r in floor} == {"all_reduce"}
    assert all(r["wrong"] == -1 for r in floor), floor
    ours = [r for r in doc["results"] if r["backend"] == "pycomm" and r["op"] == "all_reduce"]
    assert ours and all(r["wrong"] == 0 for r in ours)
    check_rows(doc)


@pytest.mark.usefixtures("require_pycomm")
def test_barrier_skew_times_every_barrier_and_op_pair():
    """records.investigations.barrier_skew: the four (barrier, op) cases, each a positive
    time."""
    from records.investigations import barrier_skew

    got = barrier_skew.main(["--nproc", "2", "--calls", "20", "--rounds", "2"])
    barriers, ops = {"dist.barrier", "barrier_now"}, {"dist.all_reduce", "pycomm.all_reduce_"}
    assert set(got) == {(b, o) for b in barriers for o in ops}
    # Each a median over calls of the slowest rank's time: no result reaches another
    # process faster than a core-to-core cache line moves, and a 16-byte op slower than
    # 100 ms is a stall, not a measurement, even on an oversubscribed machine.
    assert all(MIN_COLLECTIVE_S * 1e6 <= us < 1e5 for us in got.values()), got


@pytest.mark.usefixtures("require_pycomm")
def test_sched_share_accounts_each_ranks_call(capsys):
    """records.investigations.sched_share: a row per rank, with a positive wall time and
    counters that are counts."""
    from records.investigations import sched_share

    sched_share.main(["--backends", "pycomm", "--size", "1M", "--iters", "3", "--rounds", "1",
                      "--load", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("pycomm ")]
    assert [int(r[1]) for r in rows] == [0, 1], rows
    for _, _, wall, cpu, vol, invol, runq, slices in rows:
        assert float(wall) > 0 and float(cpu) >= 0 and float(runq) >= 0, rows
        assert all(float(x) == int(float(x)) >= 0 for x in (vol, invol, slices)), rows


def test_algo_crossover_times_each_variant_in_one_job(tmp_path, capsys):
    """bench.algo_crossover: one group per variant's settings, every size timed on each."""
    from bench import algo_crossover

    assert algo_crossover.parse_variant("x=PYCOMM_ALGO=ring,PYCOMM_SLOTS=3") == (
        "x", {"PYCOMM_ALGO": "ring", "PYCOMM_SLOTS": "3"})
    with pytest.raises(SystemExit, match="NAME=PYCOMM_X=V"):
        algo_crossover.parse_variant("x=NCCL_ALGO=ring")
    out = tmp_path / "c.json"
    algo_crossover.main(["--nproc", "2", "-b", "1K", "-e", "8K", "-f", "8", "--iters", "5",
                         "--warmup", "1", "--bind", "none", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [1024, 8192]
    assert all(r["pair"] > 0 and r["direct"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "direct/pair" in printed and "# c2c before: " in printed
    assert len(json.loads(out.read_text())["c2c"]) == 2


def test_algo_crossover_times_the_ring_beside_the_two_shot_at_more_ranks():
    from bench import algo_crossover

    names = [name for name, _ in algo_crossover.default_variants(1 << 20, 4)]
    assert names == ["two-shot", "ring", "direct"]
    assert [name for name, _ in algo_crossover.default_variants(1 << 20, 2)] == ["pair",
                                                                                  "direct"]

"""Zero-copy collectives on arena tensors (``pycomm.empty``) get the ring's coverage.

Every collective with a zero-copy path (all_reduce, reduce_scatter_tensor,
all_gather_into_tensor, broadcast, reduce, all_to_all_single) x every dtype (and the
reductions each allows) x element counts 0, 1, 7 and two odd counts above the direct
size, on 2 and 4 ranks, on the whole world and on the subgroups [0, 2] and [1, 2, 3];
with every rank's buffers in the arena, only the inputs, or only some ranks' (then all
must fall back together). Values are checked against float64 references on each rank,
results that must be equal everywhere by digest in the parent, and the path of every
call (zero-copy / fallback / direct / local) from pycomm's TRACE log. Ranks that
disagree on count or dtype must all raise, naming both calls, within the timeout.

One RankPool per world size runs every case (tests/_zero_copy_scenarios.py).
"""

from __future__ import annotations

import re

import _zero_copy_scenarios as sc
import pytest

from pycomm.testing import RankPool

pytestmark = pytest.mark.usefixtures("require_pycomm")

PG_TIMEOUT_S = 30.0
SLACK_S = 5.0


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def pool(request):
    with RankPool(request.param, backend="pycomm", pg_timeout_s=PG_TIMEOUT_S) as p:
        yield p


IN_PLACE = ("all_reduce", "broadcast", "reduce")  # one buffer: "inputs" is "all" there
OUT_OF_PLACE = ("reduce_scatter", "all_gather", "all_to_all")
CASES = [(op, who) for op in IN_PLACE + OUT_OF_PLACE
         for who in ("all", "inputs", "even", "last") if not (who == "inputs" and op in IN_PLACE)]


@pytest.mark.parametrize(("op", "who"), CASES, ids=[f"{op}-arena_{who}" for op, who in CASES])
def test_every_dtype_on_every_group(pool, op, who):
    results = pool.run(sc.run_case, op, who, timeout_s=600)
    bad = [line for r in results for line in r["bad"]]
    assert not bad, f"{len(bad)} problems:\n" + "\n".join(bad[:40])
    if op in ("all_reduce", "all_gather", "broadcast"):  # the same result on every rank
        for ranks in sc.layouts(pool.world_size):
            key = str(list(ranks))
            got = {r: results[r]["digests"][key] for r in ranks}
            first = got[ranks[0]]
            assert first, f"group {key}: no results"
            for r, d in got.items():
                assert d == first, f"group {key}: rank {r}'s results differ from rank {ranks[0]}'s"


MISMATCH_GROUPS = {2: [(0, 1)], 4: [(0, 1, 2, 3), (1, 2, 3)]}


@pytest.mark.parametrize("who", ["all", "even"])
@pytest.mark.parametrize("case", sorted(sc.MISMATCHES))
def test_ranks_that_disagree_all_raise_naming_both(pool, case, who):
    op, differs = sc.MISMATCHES[case]
    count = sc.big_count("float32")
    both = ((rf"\b{count}\b", rf"\b{count + 1}\b") if differs == "count"
            else (r"float32|\bFloat\b", r"float64|\bDouble\b"))
    for ranks in MISMATCH_GROUPS[pool.world_size]:
        results = pool.run(sc.mismatch, case, ranks, who, timeout_s=120)
        for rank in ranks:
            got = results[rank]
            where = f"{case}, arena={who}, group {list(ranks)}, rank {rank}"
            assert got["type"], f"{where}: the call succeeded"
            assert got["elapsed"] <= sc.MISMATCH_TIMEOUT_S + SLACK_S, (
                f"{where}: took {got['elapsed']:.1f} s to fail: {got['message']}")
            lacks = [p for p in ("pycomm", op, *both) if not re.search(p, got["message"])]
            assert not lacks, f"{where}: the error lacks {lacks}: {got['message']!r}"

"""PYCOMM_STRIPES: a large CPU all_reduce striped over several communicators per rank.

csrc/torch/backend/stripes.h cuts an all_reduce of at least PYCOMM_STRIPE_BYTES into
contiguous parts of whole cache lines and runs part 0 on the calling thread and the others
on their own communicators' threads. These tests hold its results to float64 through every entry
(dist.all_reduce, pycomm.all_reduce_, async, strided, coalesced, PREMUL_SUM, DDP), its
threads to the group's life, rank 0's setting to the group, and ranks that disagree to a
prompt error on every rank rather than a hang.
"""

from __future__ import annotations

import pytest

from pycomm import _C
from pycomm.testing import run_ranks
from tests import _stripes_ranks as ranks

pytestmark = pytest.mark.timeout(300)


def _tolerance(case: dict) -> float:
    if "bfloat16" in case["dtype"]:
        return 2 ** -7 * max(1.0, case["scale"]) * 2  # one rounding per rank's step
    if "float32" in case["dtype"]:
        return 1e-5 * max(1.0, case["scale"])
    return 1e-12 * max(1.0, case["scale"])


@pytest.mark.parametrize("world", [2, 3])
def test_striped_all_reduce_matches_float64_through_every_entry(world):
    per_rank = run_ranks(ranks.numerics, world)
    for rank, cases in enumerate(per_rank):
        assert len(cases) == 4 * len(ranks.CASES)
        for case in cases:
            assert case["err"] <= _tolerance(case), (rank, case)


def test_coalesced_and_premul_sum_on_a_striped_group():
    for rank, errs in enumerate(run_ranks(ranks.coalesced_and_premul, 2)):
        assert max(errs) <= 1e-12, (rank, errs)


def test_ddp_gradients_on_a_striped_group_match_one_process():
    for rank, diff in enumerate(run_ranks(ranks.ddp_step, 2)):
        assert diff <= 1e-12, (rank, diff)


def test_stripe_threads_live_with_the_group_and_rank_0s_count_applies():
    # Rank 1 asks for 2 stripes, rank 0 for 3: the group has rank 0's 3 (2 extra threads).
    per_rank = run_ranks(ranks.threads_and_settings, 2,
                         rank_env={0: {"STRIPES_HERE": "3"}, 1: {"STRIPES_HERE": "2"}})
    for rank, seen in enumerate(per_rank):
        assert seen["before"] == [], (rank, seen)
        assert seen["during"] == ["pycomm-stripe1", "pycomm-stripe2"], (rank, seen)
        assert seen["after"] == [], (rank, seen)
        assert seen["value"] == 2.0, (rank, seen)


@pytest.mark.parametrize("counts", [[100_000, 100_064], [100_000, 100]],
                         ids=["both-striped", "one-not-striped"])
def test_ranks_that_disagree_fail_promptly_on_every_rank(counts):
    per_rank = run_ranks(ranks.mismatch, 2, counts, pg_timeout_s=60.0)
    for rank, seen in enumerate(per_rank):
        assert seen["error"], f"rank {rank}: counts {counts} gave no error"
        assert seen["seconds"] < 20, (rank, seen)  # the group's timeout is 60 s
        # The user's whole op is named beside the part the ranks disagreed on; a rank
        # that did not stripe says that its peer's count may be a part's.
        striped = counts[rank] * 4 >= ranks.STRIPE_BYTES
        expect = (f"all_reduce of {counts[rank]} elements striped" if striped
                  else "a rank that striped this op shows the count of its part 0")
        assert expect in seen["error"], (rank, seen)


def test_stripes_settings_are_range_checked():
    import os
    for var, bad in (("PYCOMM_STRIPES", "0"), ("PYCOMM_STRIPES", "17"),
                     ("PYCOMM_STRIPE_BYTES", "100")):
        old = os.environ.get(var)
        os.environ[var] = bad
        try:
            with pytest.raises(ValueError, match=var):
                _C._segment_bytes(2)
        finally:
            if old is None:
                os.environ.pop(var)
            else:
                os.environ[var] = old

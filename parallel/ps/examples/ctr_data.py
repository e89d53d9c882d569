"""A click-through-like sparse data set generated from a seed: Zipf feature ids, logistic labels.

Every example is a set of binary features. Feature ids are drawn with Zipf frequencies
(rank ``r`` has probability proportional to ``r ** -zipf_exponent``) over a seeded
permutation of ``0..num_features-1``, so a few ids appear in almost every example and
most appear rarely, as in ad logs. A label is ``Bernoulli(sigmoid(x . w_true + b_true))``
with hidden weights drawn from the same seed, so logistic regression has something to
learn. Nothing is downloaded or stored: a batch is a pure function of
``(seed, worker, step)``, so any process can rebuild any worker's batch.

Example::

    data = ClickData(num_features=10**4, density=0.01, seed=0)
    b = data.batch(worker=1, step=7, size=32)
    b.keys            # sorted unique feature ids this batch touches (what a worker pulls)
    b.keys[b.cols]    # the feature id of every non-zero; b.rows is its example
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..._optional import missing

try:
    import numpy as np
except ModuleNotFoundError as err:
    raise missing("numpy", "pycomm.parallel.ps.examples (the CTR data)", err) from err
import torch

from ...train.data import derive_seed

# The draw rate per example is capped at this multiple of the wanted non-zeros; beyond it
# the Zipf tail is too thin to reach the density and the configuration is refused.
_MAX_OVERSAMPLING = 64
# Mean and std over examples of the hidden logit x . w_true + b_true: a click rate near
# 30%, and labels that carry signal without being deterministic.
_MEAN_LOGIT = -1.0
_LOGIT_STD = 3.0


@dataclass(frozen=True)
class SparseBatch:
    """A batch of binary sparse examples in COO form over the batch's own key list.

    Attributes:
        keys: int64 (K,), sorted unique global feature ids touched by the batch.
        rows: int64 (nnz,), the example of each non-zero, in ``[0, size)``, non-decreasing.
        cols: int64 (nnz,), each non-zero's index into ``keys``, ascending within a row.
        labels: float32 (size,), 0 or 1.
    """

    keys: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.labels.numel())

    @property
    def nnz(self) -> int:
        return int(self.rows.numel())

    def dense(self, num_features: int) -> torch.Tensor:
        """The (size, num_features) float32 0/1 matrix; for tests on small configurations."""
        x = torch.zeros(self.size, num_features)
        x[self.rows, self.keys[self.cols]] = 1.0
        return x


class ClickData:
    """Seeded sparse binary-classification data with Zipf-distributed feature ids.

    An example holds the ids of ``Poisson(rate)`` Zipf draws with repeats collapsed, so
    the feature of rank ``r`` is present independently with probability
    ``1 - exp(-rate * p_r)``; ``rate`` is solved so that ``density * num_features`` are
    present on average.

    Args:
        num_features: number of feature ids (keys ``0..num_features-1``).
        density: wanted mean fraction of features set per example (at least one feature).
        zipf_exponent: ``s`` in ``p_r ~ r ** -s``; 0 gives uniform ids.
        seed: everything (id permutation, hidden weights, every batch) follows from it.

    Raises:
        ValueError: a factor is out of range, or the density needs more than 64 Zipf
            draws per wanted feature to reach (the tail is too thin).
    """

    def __init__(
        self,
        num_features: int = 10**6,
        density: float = 0.01,
        zipf_exponent: float = 1.1,
        seed: int = 0,
    ) -> None:
        if num_features < 1 or not 0.0 < density <= 1.0 or zipf_exponent < 0.0:
            raise ValueError(
                f"ClickData: need num_features >= 1 (got {num_features}), 0 < density <= 1 "
                f"(got {density}) and zipf_exponent >= 0 (got {zipf_exponent})"
            )
        self.num_features = num_features
        self.density = density
        self.zipf_exponent = zipf_exponent
        self.seed = seed
        wanted = max(1, round(density * num_features))
        probs = torch.arange(1, num_features + 1, dtype=torch.float64).pow(-zipf_exponent)
        probs /= probs.sum()
        self._cdf = probs.cumsum(0)
        self.rate = self._calibrate_rate(probs, wanted)
        presence = -torch.expm1(-self.rate * probs)
        # The head's ranks get one Bernoulli test per example each (size x head tests,
        # about one per expected non-zero); the rarer tail is sampled by draws instead.
        self._head = min(num_features, wanted)
        self._head_presence = presence[: self._head].float()
        self._head_mass = float(self._cdf[self._head - 1])
        gen = torch.Generator().manual_seed(derive_seed(int(seed), "ctr-world"))
        # Frequent ids are spread over the key space, so range-partitioned servers share them.
        self.rank_to_id = torch.randperm(num_features, generator=gen)
        weights_by_rank = self._hidden_weights(presence, gen)
        self.true_weights = torch.empty(num_features)
        self.true_weights[self.rank_to_id] = weights_by_rank.float()
        # The bias cancels the weights' mean contribution so the click rate is set by
        # _MEAN_LOGIT alone, whatever the seed.
        self.true_bias = _MEAN_LOGIT - float((presence * weights_by_rank).sum())

    @staticmethod
    def _hidden_weights(presence: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Hidden weights by rank, with std proportional to ``sqrt(q (1 - q))`` for a
        feature present with probability ``q``.

        A feature in every example cannot tell examples apart and a feature almost never
        seen cannot be learnt, so the signal sits between (as a site or an ad category
        predicts clicks better than a rare user id); a few hundred examples then reveal
        part of it and the loss visibly falls. The scale makes the logit's std over
        examples ``_LOGIT_STD``, since ``Var(x . w) = sum_r q_r (1 - q_r) w_r^2``.
        """
        spread = presence * (1.0 - presence)
        std = spread.sqrt() * (_LOGIT_STD / math.sqrt(float((spread * spread).sum())))
        return torch.randn(presence.numel(), generator=gen, dtype=torch.float64) * std

    def _calibrate_rate(self, probs: torch.Tensor, wanted: int) -> float:
        """The Poisson draw rate whose expected distinct count ``sum_r 1 - exp(-rate p_r)``
        is ``wanted`` (bisection: the count grows with the rate)."""

        def expected_distinct(rate: float) -> float:
            return float(-torch.expm1(-rate * probs).sum())

        low, high = float(wanted), float(wanted * _MAX_OVERSAMPLING)
        if expected_distinct(high) < wanted * (1.0 - 1e-3):
            raise ValueError(
                f"ClickData: density={self.density} ({wanted} of num_features="
                f"{self.num_features}) needs over {int(high)} Zipf draws per example at "
                f"zipf_exponent={self.zipf_exponent}; lower the density or the exponent"
            )
        while high - low > 1e-6 * high:
            mid = 0.5 * (low + high)
            low, high = (low, mid) if expected_distinct(mid) >= wanted else (mid, high)
        return high

    def batch(self, worker: int, step: int, size: int) -> SparseBatch:
        """Worker ``worker``'s batch at ``step``: a pure function of (seed, worker, step).

        Raises:
            ValueError: ``size`` is negative.
        """
        if size < 0:
            raise ValueError(f"ClickData.batch: size={size} for worker {worker}, step {step}")
        # int(): the seed hashes repr(), and repr(np.int64(1)) is not repr(1).
        parts = (int(self.seed), "ctr-batch", int(worker), int(step))
        gen = torch.Generator().manual_seed(derive_seed(*parts))
        n = self.num_features
        # Head: each (example, rank) present with its own probability; pairs come sorted.
        hits = (torch.rand(size, self._head, generator=gen) < self._head_presence).nonzero()
        head_pairs = hits[:, 0] * n + self.rank_to_id[hits[:, 1]]
        # Tail: Poisson(rate * tail mass) inverse-CDF draws per example; float64 because
        # the tail's CDF steps are below float32's epsilon.
        tail_rate = torch.full((size,), self.rate * (1.0 - self._head_mass), dtype=torch.float64)
        counts = torch.poisson(tail_rate, generator=gen).long()
        u = torch.rand(int(counts.sum()), generator=gen, dtype=torch.float64)
        u = self._head_mass + u * (1.0 - self._head_mass)
        ranks = torch.searchsorted(self._cdf, u, right=True).clamp_(max=n - 1)
        tail_pairs = torch.arange(size).repeat_interleave(counts) * n + self.rank_to_id[ranks]
        # One sort orders non-zeros by example then id and collapses repeated tail draws.
        pairs = _sorted_unique(torch.cat([head_pairs, tail_pairs]))
        rows, ids = pairs // n, pairs % n
        keys, cols = _sorted_unique_with_index(ids, n)
        logits = torch.full((size,), self.true_bias).index_add_(0, rows, self.true_weights[ids])
        labels = torch.bernoulli(torch.sigmoid(logits), generator=gen)
        return SparseBatch(keys=keys, rows=rows, cols=cols, labels=labels)


def _sorted_unique(values: torch.Tensor) -> torch.Tensor:
    """``torch.unique(values)`` through numpy's sort, which is ~30x faster than
    ``torch.sort`` on int64 CPU tensors of a million elements (it vectorises the sort)."""
    ordered = torch.from_numpy(np.sort(values.numpy()))
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return ordered[first]


def _sorted_unique_with_index(ids: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(ids, return_inverse=True)`` for ids in ``[0, bound)``, by marking a
    table instead of sorting (3x faster at a million features)."""
    seen = torch.zeros(bound, dtype=torch.bool)
    seen[ids] = True
    keys = seen.nonzero().squeeze(1)
    position = torch.empty(bound, dtype=torch.int64)
    position[keys] = torch.arange(keys.numel())
    return keys, position[ids]


def concat(batches: Sequence[SparseBatch]) -> SparseBatch:
    """Stack batches' examples in order over the union of their keys.

    One process training on ``concat`` of every worker's batch is the reference a
    synchronous parameter-server run must reproduce.

    Raises:
        ValueError: ``batches`` is empty.
    """
    if not batches:
        raise ValueError("concat: no batches to join")
    keys = torch.unique(torch.cat([b.keys for b in batches]))
    offsets = [0]
    for b in batches[:-1]:
        offsets.append(offsets[-1] + b.size)
    rows = torch.cat([b.rows + offset for b, offset in zip(batches, offsets, strict=True)])
    # Keys are sorted, so each batch's key list maps into the union by binary search.
    cols = torch.cat([torch.searchsorted(keys, b.keys)[b.cols] for b in batches])
    labels = torch.cat([b.labels for b in batches])
    return SparseBatch(keys=keys, rows=rows, cols=cols, labels=labels)

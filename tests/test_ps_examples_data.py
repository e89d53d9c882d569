"""pycomm.parallel.ps.examples on one process: the seeded click data, sparse logistic regression
and the GPT helpers, and that the documented push scale makes a simulated BSP step equal
the one-process reference (no transport involved)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pycomm.parallel.models import GPTConfig, lm_loss
from pycomm.parallel.ps.examples.ctr_data import ClickData, SparseBatch, concat
from pycomm.parallel.ps.examples.dense_model import (
    flat_named_grads,
    flat_named_parameters,
    gpt_batch,
    init_gpt,
    load_named,
    train_one_process_gpt,
    train_one_process_gpt_state,
)
from pycomm.parallel.ps.examples.logreg_model import (
    loss_and_grad,
    train_one_process,
    train_one_process_state,
    worker_push_scale,
)

SMALL = 10**4
TINY_GPT = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
BYTE_GPT = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16)
TEXT = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 40), dtype=torch.uint8)


@pytest.fixture(scope="module")
def small() -> ClickData:
    return ClickData(num_features=SMALL, density=0.01, seed=0)


def _same(a: SparseBatch, b: SparseBatch) -> bool:
    return all(torch.equal(x, y) for x, y in zip(
        (a.keys, a.rows, a.cols, a.labels), (b.keys, b.rows, b.cols, b.labels), strict=True))


def _presence_by_rank(data: ClickData) -> torch.Tensor:
    probs = torch.arange(1, data.num_features + 1, dtype=torch.float64).pow(-data.zipf_exponent)
    return -torch.expm1(-data.rate * probs / probs.sum())


def _top_share(data: ClickData, examples: int) -> float:
    """Share of all non-zeros that fall on the empirically most frequent 1% of ids."""
    counts = torch.zeros(data.num_features)
    for step in range(4):
        b = data.batch(0, step, examples // 4)
        counts.index_add_(0, b.keys[b.cols], torch.ones(b.nnz))
    top = counts.sort(descending=True).values[: data.num_features // 100]
    return float(top.sum() / counts.sum())


def test_a_batch_is_a_function_of_seed_worker_and_step(small):
    again = ClickData(num_features=SMALL, density=0.01, seed=0)
    assert _same(small.batch(2, 5, 16), again.batch(2, 5, 16))
    # Numpy and tensor ints (what a launcher may hand over) name the same batch.
    same_ints = again.batch(np.int64(2), torch.tensor(5), 16)  # type: ignore[arg-type]
    assert _same(small.batch(2, 5, 16), same_ints)
    assert not torch.equal(small.batch(2, 5, 16).keys, small.batch(3, 5, 16).keys)
    assert not torch.equal(small.batch(2, 5, 16).keys, small.batch(2, 6, 16).keys)
    other_seed = ClickData(num_features=SMALL, density=0.01, seed=1)
    assert not torch.equal(other_seed.batch(2, 5, 16).keys, small.batch(2, 5, 16).keys)
    assert not torch.equal(other_seed.true_weights, small.true_weights)


def test_frequent_ids_carry_most_occurrences_and_are_scattered(small):
    # Measured: on the 1e4-feature config the top 1% of ids hold ~45% of non-zeros.
    assert _top_share(small, 512) > 0.3
    # The same measurement on uniform ids stays near 1%, so the bound above can fail.
    assert _top_share(ClickData(num_features=SMALL, zipf_exponent=0.0), 512) < 0.1
    # The most frequent ids are a seeded permutation, not 0..k.
    assert small.rank_to_id[:100].max() > 1000


def test_each_rank_is_present_as_often_as_the_model_says(small):
    b = small.batch(0, 0, 1024)
    seen = torch.zeros(SMALL, dtype=torch.float64).index_add_(
        0, b.keys[b.cols], torch.ones(b.nnz, dtype=torch.float64)) / b.size
    expected = _presence_by_rank(small)
    # Ranks 0..299 straddle the head (Bernoulli) / tail (draws) boundary at rank 100.
    observed = seen[small.rank_to_id[:300]]
    sigma = (expected[:300] * (1 - expected[:300]) / b.size).sqrt()
    assert ((observed - expected[:300]).abs() <= 5 * sigma + 1e-3).all()


@pytest.mark.parametrize("density,exponent", [(0.01, 1.1), (0.05, 1.1), (0.01, 0.0)])
def test_density_is_close_to_the_request(density, exponent):
    data = ClickData(num_features=SMALL, density=density, zipf_exponent=exponent, seed=3)
    b = data.batch(1, 1, 256)
    assert b.nnz / b.size / SMALL == pytest.approx(density, rel=0.05)


def test_the_default_config_has_ten_thousand_features_per_example():
    b = ClickData().batch(0, 0, 2)
    assert b.nnz / 2 == pytest.approx(10**4, rel=0.05)
    assert b.keys.max() < 10**6


def test_keys_are_sorted_unique_and_indexes_in_range(small):
    b = small.batch(4, 2, 64)
    assert b.keys.dtype == b.rows.dtype == b.cols.dtype == torch.int64
    assert b.labels.dtype == torch.float32 and b.labels.shape == (64,)
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert (b.keys[1:] > b.keys[:-1]).all()
    assert b.rows.min() >= 0 and b.rows.max() < 64 and (b.rows[1:] >= b.rows[:-1]).all()
    assert b.cols.min() >= 0 and b.cols.max() < b.keys.numel()
    # Every key is used, and no (example, feature) pair repeats: features are binary.
    assert torch.equal(b.cols.unique(), torch.arange(b.keys.numel()))
    assert (b.rows * SMALL + b.cols).unique().numel() == b.nnz


def test_concat_is_the_union_of_the_batches(small):
    parts = [small.batch(w, 3, size) for w, size in enumerate((5, 0, 8, 13))]
    joined = concat(parts)
    assert torch.equal(joined.keys, torch.cat([p.keys for p in parts]).unique())
    assert torch.equal(joined.dense(SMALL), torch.cat([p.dense(SMALL) for p in parts]))
    assert torch.equal(joined.labels, torch.cat([p.labels for p in parts]))
    assert _same(concat([parts[0]]), parts[0])
    with pytest.raises(ValueError, match="no batches"):
        concat([])


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="density"):
        ClickData(num_features=100, density=0.0)
    with pytest.raises(ValueError, match="lower the density"):
        ClickData(num_features=SMALL, density=0.5, zipf_exponent=2.0)


def _random_weights(batch: SparseBatch, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch.keys.numel(), 1, generator=gen) * 0.3, torch.tensor([[0.2]])


def test_loss_and_grad_equals_autograd_on_the_dense_matrix(small):
    b = small.batch(0, 9, 16)
    w_rows, bias = _random_weights(b, 1)
    loss, grad_w, grad_b = loss_and_grad(b, w_rows, bias)
    w_full = torch.zeros(SMALL, dtype=torch.float64)
    w_full[b.keys] = w_rows[:, 0].double()
    w_full.requires_grad_()
    b64 = bias.double().requires_grad_()
    logits = b.dense(SMALL).double() @ w_full + b64.reshape(1)
    want = F.binary_cross_entropy_with_logits(logits, b.labels.double())
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-6)
    assert w_full.grad is not None and b64.grad is not None
    torch.testing.assert_close(grad_w[:, 0].double(), w_full.grad[b.keys], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grad_b.double(), b64.grad, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match=r"must be \(\d+, 1\)"):
        loss_and_grad(b, w_rows[1:], bias)


def test_loss_is_stable_for_huge_logits(small):
    b = small.batch(0, 0, 8)
    loss, grad_w, _ = loss_and_grad(b, torch.full((b.keys.numel(), 1), 100.0), torch.zeros(1, 1))
    assert math.isfinite(loss) and torch.isfinite(grad_w).all()


def test_scaled_worker_grads_sum_to_the_concatenated_grad(small):
    parts = [small.batch(w, 1, size) for w, size in enumerate((5, 8, 13))]
    joined = concat(parts)
    w_all, bias = _random_weights(joined, 2)
    want_loss, want_w, want_b = loss_and_grad(joined, w_all, bias)
    got_w, got_b, got_loss = torch.zeros_like(want_w), torch.zeros(1, 1), 0.0
    for part in parts:
        where = torch.searchsorted(joined.keys, part.keys)  # the server's key lookup
        loss, grad_w, grad_b = loss_and_grad(part, w_all[where], bias)
        scale = worker_push_scale(part.size, joined.size)
        got_w.index_add_(0, where, grad_w * scale)
        got_b += grad_b * scale
        got_loss += loss * scale
    atol = 1e-6 * float(want_w.abs().max())  # float32 sums in another order near zero
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=atol)
    torch.testing.assert_close(got_b, want_b, rtol=1e-6, atol=1e-9)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    with pytest.raises(ValueError, match="rows_w=9"):
        worker_push_scale(9, 8)


def test_simulated_bsp_with_pushed_scaled_grads_equals_the_reference(small):
    workers, steps, size, lr = 3, 4, 16, 0.3
    want_losses, want_w, want_b = train_one_process_state(small, workers, steps, size, lr)
    store, bias = torch.zeros(SMALL), torch.zeros(1, 1)  # the server's values
    for step in range(steps):
        batches = [small.batch(w, step, size) for w in range(workers)]
        pushed, pushed_b = torch.zeros(SMALL), torch.zeros(1, 1)
        for b in batches:  # pull, compute, push
            _, grad_w, grad_b = loss_and_grad(b, store[b.keys].unsqueeze(1), bias)
            scale = worker_push_scale(b.size, size * workers)
            pushed.index_add_(0, b.keys, grad_w[:, 0] * scale)
            pushed_b += grad_b * scale
        store -= lr * pushed
        bias -= lr * pushed_b
    torch.testing.assert_close(store, want_w, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(bias, want_b, rtol=1e-5, atol=1e-7)
    assert len(want_losses) == steps and want_losses[0] == pytest.approx(math.log(2))


def test_the_reference_loss_falls_over_30_steps(small):
    # lr ~ 30 / non-zeros per example is about the largest plain SGD takes here.
    losses = train_one_process(small, workers=2, steps=30, batch_size=64, lr=0.3)
    assert losses[0] == pytest.approx(math.log(2))
    assert sum(losses[-10:]) / 10 < sum(losses[:5]) / 5 - 0.03


def test_parameters_round_trip_through_named_flat_tensors():
    source, target = init_gpt(TINY_GPT, seed=1), init_gpt(TINY_GPT, seed=2)
    values = flat_named_parameters(source)
    assert all(v.dim() == 1 for v in values.values())
    assert not torch.equal(values["lm_head.weight"],
                           flat_named_parameters(target)["lm_head.weight"])
    load_named(target, {name: v.clone() for name, v in values.items()})
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    # The views share storage: writing one writes the parameter.
    values["lm_head.weight"][0] = 7.0
    assert source.lm_head.weight[0, 0] == 7.0
    with pytest.raises(KeyError, match="missing"):
        load_named(target, {})
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_named(target, {**values, "lm_head.weight": torch.zeros(3)})


def test_gpt_batches_and_init_are_deterministic():
    tokens, targets = gpt_batch(1, 2, 4, TINY_GPT, seed=0)
    assert tokens.shape == targets.shape == (4, TINY_GPT.block_size)
    assert torch.equal(tokens, gpt_batch(1, 2, 4, TINY_GPT, seed=0)[0])
    assert not torch.equal(tokens, gpt_batch(0, 2, 4, TINY_GPT, seed=0)[0])
    assert not torch.equal(tokens, gpt_batch(1, 3, 4, TINY_GPT, seed=0)[0])
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = flat_named_parameters(init_gpt(TINY_GPT, seed=5))
    assert torch.equal(torch.rand(1), before)  # init left the global RNG alone
    b = flat_named_parameters(init_gpt(TINY_GPT, seed=5))
    assert all(torch.equal(a[name], b[name]) for name in a)
    with pytest.raises(ValueError, match="dropout"):
        init_gpt(GPTConfig(dropout=0.1), seed=0)
    with pytest.raises(ValueError, match="vocab_size >= 256"):
        gpt_batch(0, 0, 4, TINY_GPT, seed=0, corpus=TEXT)


def test_the_gpt_loss_falls_on_text_and_not_on_random_tokens():
    on_text = train_one_process_gpt(BYTE_GPT, 2, 20, 4, lr=1.0, seed=0, corpus=TEXT)
    assert sum(on_text[-5:]) / 5 < on_text[0] - 1.0
    tokens, targets = gpt_batch(1, 2, 4, BYTE_GPT, seed=0, corpus=TEXT)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    # Uniform random tokens hold nothing to learn: the loss stays at ln(vocab_size).
    on_noise = train_one_process_gpt(TINY_GPT, 2, 20, 4, lr=1.0, seed=0)
    assert sum(on_noise[-5:]) / 5 > math.log(TINY_GPT.vocab_size) - 0.1


def test_simulated_bsp_gpt_equals_the_reference():
    workers, steps, batch, lr, seed = 2, 3, 2, 0.5, 0
    want_losses, want_model = train_one_process_gpt_state(TINY_GPT, workers, steps, batch,
                                                          lr, seed)
    assert want_losses == train_one_process_gpt(TINY_GPT, workers, steps, batch, lr, seed)
    store = {n: v.clone() for n, v in flat_named_parameters(init_gpt(TINY_GPT, seed)).items()}
    replica = init_gpt(TINY_GPT, seed=99)
    for step in range(steps):
        pushed = {name: torch.zeros_like(v) for name, v in store.items()}
        for w in range(workers):
            load_named(replica, store)  # pull
            replica.zero_grad(set_to_none=True)
            tokens, targets = gpt_batch(w, step, batch, TINY_GPT, seed)
            lm_loss(replica(tokens), targets).backward()
            scale = worker_push_scale(batch, batch * workers)
            for name, grad in flat_named_grads(replica).items():  # push
                pushed[name] += grad * scale
        for name in store:
            store[name] -= lr * pushed[name]
    for name, value in flat_named_parameters(want_model).items():
        torch.testing.assert_close(store[name], value, rtol=1e-5, atol=1e-6, msg=name)

"""The project's GPT trained through push and pull: parameters as named flat tensors.

A parameter server stores each parameter as one flat float32 tensor under its name
(``flat_named_parameters``). A worker loads pulled values into its replica
(``load_named``), runs its batch (``gpt_batch``), and pushes
``flat_named_grads(model)[name] * worker_push_scale(batch_w, total_batch)`` per name
(the rule of :mod:`pycomm.parallel.ps.examples.logreg_model`: ``lm_loss`` is a mean over the
worker's positions, and every position counts once in the reference); the server sums
one step's pushes and applies ``value -= lr * summed_push``. Then BSP equals
:func:`train_one_process_gpt` up to float rounding.

Example::

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    losses = train_one_process_gpt(cfg, workers=2, steps=10, batch=4, lr=0.1, seed=0)
"""

from __future__ import annotations

import torch

from ...models import GPT, GPTConfig, lm_loss, synthetic_batch
from ...train.data import derive_seed, draw


def init_gpt(cfg: GPTConfig, seed: int) -> GPT:
    """A GPT whose initial weights follow from ``seed`` alone; the global RNG is untouched.

    Raises:
        ValueError: ``cfg.dropout`` is not 0 (dropout would make replicas' steps differ
            from the one-process reference).
    """
    if cfg.dropout != 0.0:
        raise ValueError(
            f"init_gpt: dropout={cfg.dropout} draws different masks per process; "
            "the push/pull examples need dropout=0.0"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(int(seed), "gpt-init"))
        return GPT(cfg)


def flat_named_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a detached 1-D view sharing its storage, by name."""
    return {name: p.detach().view(-1) for name, p in model.named_parameters()}


def flat_named_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a 1-D tensor, by name (zeros where none was made)."""
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
        for name, p in model.named_parameters()
    }


def load_named(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` (any shape with the right element count) into the parameters.

    Raises:
        KeyError: ``values`` lacks a parameter's name or has a name the model lacks.
        ValueError: a value's element count differs from its parameter's.
    """
    params = dict(model.named_parameters())
    missing, unknown = sorted(params.keys() - values.keys()), sorted(values.keys() - params.keys())
    if missing or unknown:
        raise KeyError(f"load_named: missing {missing}, not in the model {unknown}")
    with torch.no_grad():
        for name, p in params.items():
            value = values[name]
            if value.numel() != p.numel():
                raise ValueError(
                    f"load_named: {name!r} has {value.numel()} values {tuple(value.shape)} "
                    f"for a parameter of {p.numel()} {tuple(p.shape)}"
                )
            p.copy_(value.reshape(p.shape))


def gpt_batch(
    worker: int, step: int, batch: int, cfg: GPTConfig, seed: int,
    corpus: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s (tokens, targets) at ``step``, each (batch, block_size); a pure
    function of (seed, worker, step) and the corpus.

    Args:
        corpus: None for uniform random tokens (``synthetic_batch``: nothing to learn, the
            loss stays near ln(vocab_size)), or uint8 bytes to cut windows from
            (``pycomm.parallel.train.data.load_corpus(...).train``: the loss falls).

    Raises:
        ValueError: a corpus is given and ``cfg.vocab_size`` is under 256.
    """
    # int(): the seed hashes repr(), and repr(np.int64(1)) is not repr(1).
    batch_seed = derive_seed(int(seed), "gpt-batch", int(worker), int(step))
    if corpus is None:
        return synthetic_batch(cfg, batch, batch_seed)
    if cfg.vocab_size < 256:
        raise ValueError(f"gpt_batch: byte corpus needs vocab_size >= 256, got {cfg.vocab_size}")
    return draw(corpus, batch_seed, batch, cfg.block_size)


def train_one_process_gpt_state(
    cfg: GPTConfig, workers: int, steps: int, batch: int, lr: float, seed: int,
    corpus: torch.Tensor | None = None,
) -> tuple[list[float], GPT]:
    """:func:`train_one_process_gpt` that also returns the trained model."""
    model = init_gpt(cfg, seed)
    losses = []
    for step in range(steps):
        pairs = [gpt_batch(w, step, batch, cfg, seed, corpus) for w in range(workers)]
        tokens = torch.cat([tokens for tokens, _ in pairs])
        targets = torch.cat([targets for _, targets in pairs])
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return losses, model


def train_one_process_gpt(
    cfg: GPTConfig, workers: int, steps: int, batch: int, lr: float, seed: int,
    corpus: torch.Tensor | None = None,
) -> list[float]:
    """The BSP reference: plain SGD from ``init_gpt(cfg, seed)``, one step per ``step`` on
    workers ``0..workers-1``'s batches (:func:`gpt_batch`) concatenated; returns each step's
    loss (before that step's update)."""
    return train_one_process_gpt_state(cfg, workers, steps, batch, lr, seed, corpus)[0]

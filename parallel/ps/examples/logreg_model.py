"""Sparse logistic regression whose weights live on a parameter server, and its reference.

A worker pulls the weights of exactly the keys its batch touches (``batch.keys``),
computes :func:`loss_and_grad` on them, and pushes a scaled gradient for the same keys.

What a worker pushes so that BSP + SGD equals :func:`train_one_process`:

    The reference takes one SGD step on the mean loss over the concatenation of all
    workers' batches (``total_rows`` examples). Worker ``w``'s gradient ``grad_w`` is the
    mean over ITS ``rows_w`` examples, so the global gradient is
    ``sum_w (rows_w / total_rows) * grad_w``. Each worker therefore pushes
    ``grad_w * worker_push_scale(rows_w, total_rows)`` (weights and bias alike); the
    server sums the pushes of one step per key (a key no worker touched gets nothing)
    and then applies one ``value -= lr * summed_push``. With equal batch sizes the scale
    is ``1 / workers``. The loss to report is ``sum_w scale_w * loss_w``.

Example::

    data = ClickData(num_features=10**4)
    losses = train_one_process(data, workers=2, steps=30, batch_size=32, lr=1.0)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ctr_data import ClickData, SparseBatch, concat


def loss_and_grad(
    batch: SparseBatch, w_rows: torch.Tensor, bias: torch.Tensor
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Mean binary cross-entropy of the batch and its gradients, without autograd.

    Args:
        batch: the examples; ``batch.cols`` index ``w_rows``.
        w_rows: float32 (len(batch.keys), 1), the weights of ``batch.keys`` in order.
        bias: float32 (1, 1).

    Returns:
        (loss, d loss / d w_rows of shape (len(keys), 1), d loss / d bias of shape (1, 1)).

    Raises:
        ValueError: the batch is empty or a shape does not match.
    """
    keys = batch.keys.numel()
    if batch.size == 0:
        raise ValueError("loss_and_grad: the batch has no examples, so no mean loss")
    if w_rows.shape != (keys, 1) or bias.shape != (1, 1):
        raise ValueError(
            f"loss_and_grad: w_rows {tuple(w_rows.shape)} must be ({keys}, 1) for the "
            f"batch's keys and bias {tuple(bias.shape)} must be (1, 1)"
        )
    # Sparse-dense product x @ w: every non-zero adds its key's weight to its example.
    logits = bias.reshape(1).expand(batch.size).clone()
    logits.index_add_(0, batch.rows, w_rows[batch.cols, 0])
    labels = batch.labels
    # -[y log s(z) + (1 - y) log s(-z)], stable for any |z| (logsigmoid never takes exp(z)).
    loss = -(labels * F.logsigmoid(logits) + (1 - labels) * F.logsigmoid(-logits)).mean()
    d_logits = (torch.sigmoid(logits) - labels) / batch.size
    # Transposed product x^T d_logits: every non-zero sends its example's slope to its key.
    grad_w = torch.zeros(keys, 1).index_add_(0, batch.cols, d_logits[batch.rows].unsqueeze(1))
    return float(loss), grad_w, d_logits.sum().reshape(1, 1)


def worker_push_scale(rows_w: int, total_rows: int) -> float:
    """The factor a worker multiplies its mean gradient by before pushing (see module doc).

    Raises:
        ValueError: ``total_rows`` is not positive or ``rows_w`` is outside ``[0, total_rows]``.
    """
    if total_rows <= 0 or not 0 <= rows_w <= total_rows:
        raise ValueError(
            f"worker_push_scale: rows_w={rows_w} must lie in [0, total_rows={total_rows}] "
            "and total_rows must be positive"
        )
    return rows_w / total_rows


def step_batch(data: ClickData, workers: int, step: int, batch_size: int) -> SparseBatch:
    """Every worker's batch of ``step`` joined in worker order: what the reference sees."""
    return concat([data.batch(w, step, batch_size) for w in range(workers)])


def train_one_process_state(
    data: ClickData, workers: int, steps: int, batch_size: int, lr: float
) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """:func:`train_one_process` that also returns the final weights (num_features,) and
    bias (1, 1), for comparing a parameter server's stored values."""
    weights = torch.zeros(data.num_features)
    bias = torch.zeros(1, 1)
    losses = []
    for step in range(steps):
        batch = step_batch(data, workers, step, batch_size)
        loss, grad_w, grad_b = loss_and_grad(batch, weights[batch.keys].unsqueeze(1), bias)
        weights.index_add_(0, batch.keys, grad_w[:, 0], alpha=-lr)
        bias -= lr * grad_b
        losses.append(loss)
    return losses, weights, bias


def train_one_process(
    data: ClickData, workers: int, steps: int, batch_size: int, lr: float
) -> list[float]:
    """The BSP reference: plain SGD from zero weights, one step per ``step`` on the
    concatenation of workers ``0..workers-1``'s batches; returns each step's mean loss
    (computed before that step's update)."""
    return train_one_process_state(data, workers, steps, batch_size, lr)[0]

"""``--tensorboard DIR``: rank 0's step and validation scalars as TensorBoard event files
(``torch.utils.tensorboard.SummaryWriter``; tensorboard is the optional extra
``pip install 'pycomm-collectives[tensorboard]'``), beside the JSON lines of ``--metrics``.

Tags: ``train/loss``, ``train/grad_norm``, ``train/lr``, ``train/tokens_per_s``,
``train/trained_tokens`` per step and ``eval/loss`` per validation, at the step number.
A resumed run drops the events after its checkpoint's step (``purge_step``), so the
board reads as one run, as the metrics file does.
"""

from __future__ import annotations

from typing import Any

from .._optional import require

TRAIN_SCALARS = ("loss", "grad_norm", "lr", "tokens_per_s", "trained_tokens")


class Board:
    """A SummaryWriter on ``folder``; ``start``: the step a resumed run continues after."""

    def __init__(self, folder: str, start: int):
        require("tensorboard", "pycomm.parallel.train's --tensorboard")
        # torch's writer needs the tensorboard package (checked above, so a missing one
        # names the extra rather than torch's own ImportError)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(folder, purge_step=start + 1 if start else None)

    def train(self, rec: dict[str, Any]) -> None:
        for key in TRAIN_SCALARS:
            self.writer.add_scalar(f"train/{key}", rec[key], rec["step"])

    def eval(self, step: int, val_loss: float) -> None:
        self.writer.add_scalar("eval/loss", val_loss, step)
        self.writer.flush()  # a validation is a point worth seeing while the run goes on

    def close(self) -> None:
        self.writer.close()

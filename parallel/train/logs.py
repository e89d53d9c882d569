"""The trainer's lines on Python's ``logging``: the logger ``pycomm.parallel.train``.

Rank 0 logs a line every ``--log-every`` steps (step, loss, gradient norm, learning rate,
tokens per second, trained tokens) and each validation. When the program has set up no
logging of its own (``python -m pycomm.parallel.train``), the lines go to stderr through the
progress bar's ``tqdm.write``, so they land above the bar instead of through it; a program
that configured ``logging`` (a handler on the root or on ``pycomm.parallel.train``) gets them its
own way.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .._optional import available

LOGGER = logging.getLogger("pycomm.parallel.train")
_tqdm = available("tqdm")


class _AboveTheBar(logging.Handler):
    """Writes each record to stderr through ``tqdm.write`` (plainly without tqdm)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if _tqdm is not None:
                _tqdm.tqdm.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)
        except Exception:  # logging's contract: a handler reports, never raises
            self.handleError(record)


def log_to_stderr() -> None:
    """Rank 0's default: INFO lines of ``pycomm.parallel.train`` to stderr, unless logging is
    already configured (then the program's handlers and levels decide)."""
    if LOGGER.handlers or logging.getLogger().handlers:
        return
    handler = _AboveTheBar()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s",
                                           datefmt="%H:%M:%S"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)


def step_line(rec: dict[str, Any], steps: int) -> str:
    """``step 10/200 | loss 3.2145 | grad norm 0.8120 | lr 1.000e-03 | 5,120 tok/s |
    1,873 trained tokens`` from a step's metrics record."""
    aux = f" (aux {rec['aux_loss']:.4f})" if rec.get("aux_loss") else ""
    if rec.get("dropped"):
        aux += f" ({rec['dropped']:,} assignments over capacity dropped)"
    return (f"step {rec['step']}/{steps} | loss {rec['loss']:.4f}{aux} | grad norm "
            f"{rec['grad_norm']:.4f} | lr {rec['lr']:.3e} | {rec['tokens_per_s']:,.0f} tok/s | "
            f"{rec['trained_tokens']:,} trained tokens")

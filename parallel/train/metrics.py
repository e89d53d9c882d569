"""What rank 0 reports: a tqdm bar, one JSON line per step and per validation, a plot,
a ``logging`` line every ``--log-every`` steps (:mod:`~pycomm.parallel.train.logs`) and, with
``--tensorboard``, TensorBoard event files (:mod:`~pycomm.parallel.train.board`).

The lines (``--metrics FILE.jsonl``) are::

    {"kind": "config", ...every setting..., "world": 4, "params": 832768}
    {"kind": "train", "step": 1, "loss": 5.54, "grad_norm": 1.03, "lr": 0.0001,
     "step_s": 0.12, "tokens_per_s": 17066.7, "trained_tokens": 2048, "aux_loss": 0.0,
     "dropped": 0, "skipped": false, "loss_scale": 1.0, "peak_rss_mb": 612.3}
    {"kind": "eval", "step": 50, "val_loss": 3.21, "eval_s": 0.4}

``aux_loss`` is a mixture of experts' load-balancing loss (times its coefficient), part
of ``loss``; ``dropped`` the (token, expert) assignments its experts' capacity dropped in
the global batch (``--moe-capacity-factor``; 0 when dropless); ``lr`` is the rate the
step used; ``tokens_per_s`` is the global batch's tokens over the step's wall time on
rank 0 (the step ends in a world-wide collective, so that is the job's step time;
padding included); ``trained_tokens`` the targets the loss counts (not
-100: padding, SFT prompts and documents' last tokens are not); ``peak_rss_mb`` is the
largest peak resident set over all ranks (``getrusage``'s ``ru_maxrss``, gathered with a
MAX all-reduce); ``skipped`` and ``loss_scale`` are fp16's (an overflowed step is skipped
on every rank). A resumed run first drops the lines after its checkpoint's step, so the
file reads as one run.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._optional import available, note
from .board import Board
from .logs import LOGGER, log_to_stderr, step_line
from .plot import loss_curve

# optional (pip install 'pycomm-collectives[bench]'): without it, no bar, the lines still go out
_tqdm = available("tqdm")
tqdm = _tqdm.tqdm if _tqdm is not None else None


def peak_rss_mb() -> float:
    """The largest peak RSS of any rank, in MiB (collective over the world)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    peak = torch.tensor([kib / 1024.0], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def read_lines(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _kept_before_resume(path: Path, step: int) -> list[dict[str, Any]]:
    """The records of ``path`` up to ``step`` (what the checkpoint has seen)."""
    if not path.exists():
        return []
    return [r for r in read_lines(path) if r.get("step", 0) <= step]


class Metrics:
    """Rank 0's reporting; on other ranks every method does nothing."""

    def __init__(self, enabled: bool, metrics: str, plot: str, progress: bool,
                 steps: int, start: int, log_every: int = 0, tensorboard: str = ""):
        self.enabled, self.plot = enabled, plot
        self.path = Path(metrics) if metrics else None
        self.history: list[dict[str, Any]] = []
        self.bar = None
        self.steps, self.log_every = steps, log_every
        self.board: Board | None = None
        if not enabled:
            return
        log_to_stderr()
        if tensorboard:
            self.board = Board(tensorboard, start)
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.history = _kept_before_resume(self.path, start) if start else []
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        if tqdm is not None:
            self.bar = tqdm(total=steps, initial=start, disable=not progress, unit="step",
                            dynamic_ncols=True)

    def record(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.history.append(rec)
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    def train(self, rec: dict[str, Any]) -> None:
        self.record({"kind": "train", **rec})
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            self.bar.update(1)
        if self.board is not None:
            self.board.train(rec)
        if self.enabled and self.log_every and (rec["step"] % self.log_every == 0
                                                or rec["step"] == self.steps):
            LOGGER.info(step_line(rec, self.steps))

    def eval(self, step: int, val_loss: float, seconds: float) -> None:
        self.record({"kind": "eval", "step": step, "val_loss": val_loss, "eval_s": seconds})
        self.say(f"step {step}: val loss {val_loss:.4f}")
        if self.board is not None:
            self.board.eval(step, val_loss)

    def say(self, text: str) -> None:
        """A line above the progress bar (rank 0 only)."""
        if self.enabled:
            tqdm.write(text) if tqdm is not None else print(text, flush=True)

    def close(self, title: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.board is not None:
            self.board.close()
        if self.plot:
            drawn = loss_curve(self.history, Path(self.plot), title)
            self.say(f"loss curve -> {self.plot}" if drawn else note("matplotlib", "plot"))

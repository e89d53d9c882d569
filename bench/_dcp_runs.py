"""Sharded checkpoints through a run: train, save in one layout, resume in another (or in
one process), and the HuggingFace export; with each rank's memory during the save."""

from __future__ import annotations

import resource
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from bench import _model_zoo as zoo
from pycomm.parallel._optional import require


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class PeakRSS:
    """The largest resident set while the block runs, sampled every millisecond, minus
    the resident set at its start: what the block itself added at its peak."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def added(self) -> int:
        return self.peak - self.start


def _engine(name: str, dp: int, tp: int, pp: int, recipe: zoo.Recipe, zero: int,
            size: zoo.Size) -> Any:
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh

    torch.set_num_threads(1)
    model = zoo.build(name, size=size)
    mesh = ParallelMesh(pp=pp, dp=dp, tp=tp)
    config = ParallelConfig(zero=zero, microbatches=2 if pp > 1 else 1,
                            max_grad_norm=recipe.clip, weight_decay=recipe.weight_decay,
                            lr_lambda=recipe.lr_lambda(), optimizer_kwargs={"lr": recipe.lr})
    return parallelize(model, mesh, config, zoo.plan_of(name, model)), mesh


def save_then_train(name: str, lay: tuple[int, int, int], zero: int, recipe: zoo.Recipe,
                    at: int, path: str, size: zoo.Size = zoo.TINY) -> dict[str, Any]:
    """Every step's loss of the uninterrupted run, saving after step ``at``; the memory
    the save added on this rank, the bytes of its files, and the logits at the save."""
    engine, mesh = _engine(name, *lay, recipe, zero, size)
    losses, added, logits = [], 0, None
    for step in range(recipe.steps):
        losses.append(engine.train_step(*zoo.batch(name, step, size=size)).loss)
        if step + 1 == at:
            with PeakRSS() as peak:
                engine.save(path, {"step": at})
            added = peak.added
            logits = engine.logits(zoo.batch(name, 0, size=size)[0])
    mesh.destroy()
    from pycomm.parallel.checkpointing.dcp_chunks import payload_by_file

    mine = f"__{dist.get_rank()}_"
    payload = sum(n for f, n in payload_by_file(path).items() if f.startswith(mine))
    return {"losses": losses, "save_added": added, "bytes": payload, "logits": logits}


def resume(name: str, lay: tuple[int, int, int], zero: int, recipe: zoo.Recipe,
           path: str, size: zoo.Size = zoo.TINY) -> dict[str, Any]:
    """The steps after the checkpoint, resumed in this layout."""
    engine, mesh = _engine(name, *lay, recipe, zero, size)
    start = engine.load(path)["step"]
    losses = [engine.train_step(*zoo.batch(name, s, size=size)).loss
              for s in range(start, recipe.steps)]
    mesh.destroy()
    return {"losses": losses, "start": start}


def exported_logits(name: str, path: str, out: str, size: zoo.Size = zoo.TINY) -> torch.Tensor:
    """The HuggingFace export of checkpoint ``path``, reloaded by ``from_pretrained``:
    its logits of the first batch (one process)."""
    from pycomm.parallel.compose.export import save_pretrained

    transformers = require("transformers", "bench's HuggingFace export check")

    save_pretrained(path, zoo.build(name, size=size).config, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    with torch.no_grad():
        return model(zoo.batch(name, 0, size=size)[0]).logits.float()

"""``python -m pycomm.parallel.train``: train a GPT (or a HuggingFace causal LM) on a (dp, tp, pp)
mesh with every strategy of ``parallel/`` at once, as torchtitan's and nanoGPT's
``train.py`` do, on bytes or on a tokenized dataset.

- :mod:`~pycomm.parallel.job.config`: the settings (TOML file, then flags);
- :mod:`~pycomm.parallel.train.data`: the byte corpus and batches drawn from (seed, step);
- :mod:`~pycomm.parallel.train.tokenizer`, :mod:`~pycomm.parallel.train.hf_data`,
  :mod:`~pycomm.parallel.train.batches`: ``--tokenizer``, ``--dataset`` and their padded or
  packed batches; :mod:`~pycomm.parallel.train.sources`: bytes or tokens, as the loop takes them;
- :mod:`~pycomm.parallel.train.loop`: one rank's run (engine, steps, validation, checkpoints);
- :mod:`~pycomm.parallel.train.launch`: torchrun or spawned ranks, and ``main``;
- :mod:`~pycomm.parallel.train.metrics`, :mod:`~pycomm.parallel.train.logs`,
  :mod:`~pycomm.parallel.train.board`, :mod:`~pycomm.parallel.train.plot`: what rank 0
  reports (bar, JSON lines, logging, TensorBoard).

Example::

    python -m pycomm.parallel.train --dp 2 --tp 2 --steps 200 --metrics runs/m.jsonl
    torchrun --nproc-per-node 4 -m pycomm.parallel.train --config train.toml --pp 2 --dp 2
"""

from ..job.config import TrainConfig, parse
from .launch import launch, main

__all__ = ["TrainConfig", "launch", "main", "parse"]

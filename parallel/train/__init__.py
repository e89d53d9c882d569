"""``python -m parallel.train``: train a GPT (or a HuggingFace causal LM) on a (dp, tp, pp)
mesh with every strategy of ``parallel/`` at once, as torchtitan's and nanoGPT's
``train.py`` do, on bytes or on a tokenized dataset.

- :mod:`~parallel.train.config`: the settings (TOML file, then flags);
- :mod:`~parallel.train.data`: the byte corpus and batches drawn from (seed, step);
- :mod:`~parallel.train.tokenizer`, :mod:`~parallel.train.hf_data`,
  :mod:`~parallel.train.batches`: ``--tokenizer``, ``--dataset`` and their padded or
  packed batches; :mod:`~parallel.train.sources`: bytes or tokens, as the loop takes them;
- :mod:`~parallel.train.loop`: one rank's run (engine, steps, validation, checkpoints);
- :mod:`~parallel.train.launch`: torchrun or spawned ranks, and ``main``;
- :mod:`~parallel.train.metrics`, :mod:`~parallel.train.logs`, :mod:`~parallel.train.board`,
  :mod:`~parallel.train.plot`: what rank 0 reports (bar, JSON lines, logging, TensorBoard).

Example::

    python -m parallel.train --dp 2 --tp 2 --steps 200 --metrics runs/m.jsonl
    torchrun --nproc-per-node 4 -m parallel.train --config train.toml --pp 2 --dp 2
"""

from parallel.train.config import TrainConfig, parse
from parallel.train.launch import launch, main

__all__ = ["TrainConfig", "launch", "main", "parse"]

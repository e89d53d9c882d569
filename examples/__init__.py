"""Examples, installed as pycomm.examples (setup.py maps the checkout's examples/ folder):

- ``train_ddp``: DDP over pycomm, ``torchrun --nproc-per-node 4 -m pycomm.examples.train_ddp``;
- ``train_gpt.toml``: every setting of ``python -m pycomm.parallel.train --config``;
- ``mixtral-tiny.json``: a tiny Mixtral config, ``--model hf:<this folder>/mixtral-tiny.json``.

The data files' folder: ``python -c "import pycomm.examples as e; print(e.FOLDER)"``.
"""

from pathlib import Path

FOLDER = Path(__file__).resolve().parent

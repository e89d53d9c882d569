"""Entry point of ``python -m parallel.train`` (see :mod:`parallel.train`)."""

import sys

from parallel.train.launch import main

sys.exit(main())

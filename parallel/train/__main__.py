"""Entry point of ``python -m pycomm.parallel.train`` (see :mod:`pycomm.parallel.train`)."""

import sys

from .launch import main

sys.exit(main())

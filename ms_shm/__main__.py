"""``python -m ms_shm``: the same command line as the ``ms-shm`` console script."""

from __future__ import annotations

import sys

from ms_shm.cli import main

sys.exit(main())

"""``python -m batchfit``: the same as the ``batchfit`` command (and what torchrun launches)."""

import sys

from .cli import main

sys.exit(main())

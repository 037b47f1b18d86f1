"""``python -m goodput``: the same as the ``goodput`` command (what torchrun ``-m`` runs)."""

import sys

from goodput.cli import main

sys.exit(main())

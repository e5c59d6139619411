"""``python -m lmforge.cli`` and ``torchrun -m lmforge.cli train ...``: the ``lmforge`` command."""

import sys

from lmforge.cli import main

if __name__ == "__main__":
    sys.exit(main())

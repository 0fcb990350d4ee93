"""``python -m async_ckpt``: the same command line as the ``async-ckpt`` console script."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())

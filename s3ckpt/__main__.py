"""``python -m s3ckpt``: the command line, for when the ``s3ckpt`` script is not on PATH."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

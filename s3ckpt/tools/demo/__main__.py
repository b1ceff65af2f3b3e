"""``python -m s3ckpt.tools.demo`` (``make demo``)."""

from . import main

raise SystemExit(main())

"""``python -m s3ckpt.demo`` (``make demo``)."""

from . import main

raise SystemExit(main())

"""async_save staging held by a writer, without a server (saves through it:
tests/integration/test_staging.py)."""

from __future__ import annotations

import pickle

import torch

from s3ckpt import S3Writer


def test_a_writer_with_staged_buffers_pickles_small() -> None:
    writer = S3Writer("bucket", "prefix")
    writer.stage({"w": torch.randn(1_000_000)})
    assert writer._staging.nbytes == 4_000_000
    copy = pickle.loads(pickle.dumps(writer))
    assert len(pickle.dumps(writer)) < 10_000
    assert copy._staging.nbytes == 0 and copy.location == writer.location

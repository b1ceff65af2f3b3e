"""Tools for testing code that checkpoints to S3: `faultproxy.FaultProxy`, a reverse proxy that
injects the failures of flaky networks and overloaded stores in front of a real server.

s3ckpt's own tests and fault benchmarks use it, and so can a user's: it ships in the wheel, as
zarr ships ``zarr.testing``. It imports nothing of s3ckpt (and nothing of s3ckpt imports it);
its TLS mode needs ``cryptography`` (the ``local`` extra). The in-memory store is
`s3ckpt.engine.memory`.
"""

"""The DCP adapters: `S3Writer`, `S3Reader`, staging, the commit protocol, the reading of what
a prefix holds, and incremental saves' bases and references.

They may import `s3ckpt.engine` (through its contract), `s3ckpt.format` and the foundation
modules (`config`, `errors`, `crc32c`); never `s3ckpt.tools` or `s3ckpt.cli`.
"""

"""The on-store format: keys, how items pack into objects, frames, codecs, the commit record,
and range planning for reads.

Pure: no I/O, no event loop. It may import `s3ckpt.config`, `s3ckpt.errors` and
`s3ckpt.crc32c`, torch's DCP metadata types, and nothing else of s3ckpt.
"""

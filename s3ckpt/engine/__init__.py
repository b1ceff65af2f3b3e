"""The async S3 transfer engine: clients, retries, request slots, uploads and ranged reads.

It knows S3 and bytes, nothing of DCP or of the checkpoint format. It may import
`s3ckpt.config`, `s3ckpt.errors` and `s3ckpt.crc32c`; nothing else of s3ckpt. The rest of
s3ckpt reaches it through `s3ckpt.engine.contract.ObjectStore` (`get_store`), and runs
coroutines on its private loop through `s3ckpt.engine.bridge`.
"""

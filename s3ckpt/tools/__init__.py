"""Operations on stored checkpoints for people and scripts: listing, describing, verifying,
removing and collecting garbage (`catalog` is the synchronous API), the embedded local server,
and the demo.

They may import everything below them (`dcp`, `format`, `engine`, the foundation modules); the
library proper never imports them, and `s3ckpt.cli` is their command-line face.
"""

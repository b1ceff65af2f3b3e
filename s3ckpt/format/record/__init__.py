"""The commit record ``.metadata``: DCP's ``Metadata`` plus where every item's bytes are, as JSON.

It is JSON, never pickle, because loading a checkpoint from a bucket you do not fully trust must not
run code. Writing this one object is what commits a checkpoint, so :func:`encode` refuses anything
inconsistent (a chunk without a locator, a locator outside its object) rather than commit a record
that cannot be loaded, and :func:`decode` checks every field so a truncated, garbled or hostile file
ends in one clear :class:`~s3ckpt.errors.MetadataError` instead of a ``KeyError`` deep inside DCP.
Both also check the record as a whole, since one that is legal field by field can still load wrong
data with every checksum passing: a chunk's locator holds exactly its elements' bytes, the chunks of
a tensor cover it exactly once, and every frame table fits its object.

Layout (the file is compact UTF-8 with sorted keys; spaced out here for reading)::

    {"format": "s3ckpt", "version": 1, "save_id": "...", "created": 1700000000.5,
     "dcp_version": "1.0.0", "objects": {"data/0.bin": 4096}, "extra": {...},
     "storage_meta": {"checkpoint_id": ..., "save_id": ..., "load_id": ..., "modules": []},
     "planner_data": {"model.w": {"__tuple__": ["model", "w"]}, ...},
     "state_dict": {
        "model.w": {"type": "tensor", "dtype": "bfloat16", "size": [4, 3], "layout": "strided",
                    "memory_format": "contiguous_format", "requires_grad": false,
                    "pin_memory": false,
                    "chunks": [{"offsets": [0, 0], "sizes": [4, 3],
                                "locator": {"key": "data/0.bin", "offset": 0, "length": 24}}]},
        "step": {"type": "bytes", "locator": {"key": "data/0.bin", "offset": 24, "length": 11}}}}

``planner_data`` is plain JSON except that a Python tuple is written as ``{"__tuple__": [...]}``,
so the default planners' ``{fqn: ("a", 0, "b")}`` paths come back as tuples, exactly.
"""

from .decoder import check_record_size, decode
from .encoder import encode
from .model import FORMAT, FORMAT_VERSION, Checkpoint, Locator

# The overlap sweep's budget, set here (where it was before the split) so lowering it on the
# package still takes effect: `tiling._check_disjoint` reads it from here.

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Checkpoint",
    "Locator",
    "check_record_size",
    "decode",
    "encode",
]

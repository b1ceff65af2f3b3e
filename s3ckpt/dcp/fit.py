"""Whether a state dict fits a checkpoint, checked before ``dcp.load`` plans anything.

DCP's planner finds the same misfits, but one at a time and as a bare ``ValueError`` or
``RuntimeError`` inside its ``CheckpointException`` (a ``BaseException``); this names every
misfit at once, as a `StateDictMismatch` carrying the checkpoint's URL. Keys are flattened the
way DCP's default planner flattens them, so they read as ``s3ckpt info`` lists them.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import StateDictMismatch

__all__ = ["check_fit", "misfits"]

_SHOWN = 8


def misfits(state_dict: dict[str, Any], metadata: Metadata, partial: bool = False) -> list[str]:
    """Each key of ``state_dict`` (flattened) that the checkpoint cannot fill: a tensor of
    another shape, or (unless ``partial``) a key it does not hold."""
    flat, _ = flatten_state_dict(state_dict)
    saved = metadata.state_dict_metadata
    found = []
    for fqn, value in sorted(flat.items()):
        entry = saved.get(fqn)
        if entry is None:
            if not partial:
                found.append(f"{fqn}: not in the checkpoint")
            continue
        size = getattr(value, "size", None)
        if isinstance(entry, TensorStorageMetadata) and callable(size):
            shape = tuple(size())
            if shape != tuple(entry.size):
                found.append(f"{fqn}: saved with shape {tuple(entry.size)}, loading into {shape}")
    return found


def check_fit(
    state_dict: dict[str, Any], metadata: Metadata, url: str, partial: bool = False
) -> None:
    """Raise `StateDictMismatch` naming each misfit (the first few) unless ``state_dict`` fits."""
    found = misfits(state_dict, metadata, partial)
    if not found:
        return
    shown = "; ".join(found[:_SHOWN])
    more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    lacking = any(f.endswith(": not in the checkpoint") for f in found)
    hint = " (to load only the keys the checkpoint holds: partial=True)" if lacking else ""
    raise StateDictMismatch(
        f"{url}: the state dict does not fit the checkpoint: {shown}{more}{hint}",
        url=url,
        mismatches=found,
    )

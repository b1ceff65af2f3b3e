"""Where each entry of a record sits in the state dict as it was saved: `nest`. No I/O, no torch.

DCP flattens a nested state dict into entries (``"optim.state.0.step"``) and keeps, in
``planner_data``, each one's path of keys and list indices (``("optim", "state", 0, "step")``).
A record is data from the bucket: its paths may not fit together (an entry holding a value where
another puts items inside it), and a list index could ask for a list of any length. `nest` checks
them as it builds, so that a bad record is a MetadataError naming the entries, not a TypeError (or
a billion-slot list) from DCP's own ``set_element``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from ...errors import MetadataError
from ..jsoncheck import show
from .model import Checkpoint

__all__ = ["nest"]

Path = tuple[str | int, ...]


def nest(checkpoint: Checkpoint, leaf: Callable[[str], Any]) -> dict[str, Any]:
    """The saved state dict, with ``leaf(fqn)`` at each entry's place: its path in
    ``planner_data`` when the record has one (a dict of paths, as DCP's default planner writes),
    else at its own name. Lists are padded with None up to each index, as DCP pads them; an index
    is at most the number of entries, the most a saved list can have had."""
    mapping = checkpoint.planner_data if isinstance(checkpoint.planner_data, dict) else {}
    limit = len(checkpoint.entries)
    root: dict[str, Any] = {}
    owners: dict[Path, str] = {}  # the entry that put a value, or first put items, at a path
    values: set[Path] = set()  # the paths that hold an entry's value
    placed: dict[str, Path] = {}
    for fqn in checkpoint.entries:
        path = _path(checkpoint.url, fqn, mapping.get(fqn, (fqn,)), limit)
        placed[fqn] = path
        container: Any = root
        for depth, key in enumerate(path[:-1]):
            here, inside = path[: depth + 1], path[depth + 1]
            if here in values:
                _conflict(checkpoint.url, fqn, path, owners[here], placed)
            child = _get(container, key)
            if child is None:
                child = {} if isinstance(inside, str) else []
                _set(container, key, child)
                owners[here] = fqn
            elif isinstance(child, dict) != isinstance(inside, str):
                _conflict(checkpoint.url, fqn, path, owners[here], placed)
            container = child
        if path in owners:
            _conflict(checkpoint.url, fqn, path, owners[path], placed)
        owners[path] = fqn
        values.add(path)
        _set(container, path[-1], leaf(fqn))
    return root


def _path(url: str, fqn: str, path: Any, limit: int) -> Path:
    """``path`` if it is one: keys and indices, starting with a key (the state dict's)."""
    if (
        isinstance(path, (tuple, list))
        and path
        and isinstance(path[0], str)
        and all(isinstance(key, str) or (type(key) is int and 0 <= key < limit) for key in path)
    ):
        return tuple(path)
    raise MetadataError(
        f"{url}: planner_data[{fqn!r}] is not a path of keys and list indices below {limit} "
        f"(the number of entries): {show(path)}",
        url=url,
    )


def _get(container: Any, key: Any) -> Any:
    """What a dict holds at a key, or a list at an index (None: nothing yet)."""
    if isinstance(container, dict):
        return container.get(key)
    return container[key] if key < len(container) else None


def _set(container: Any, key: Any, value: Any) -> None:
    if isinstance(container, list):
        container.extend([None] * (key + 1 - len(container)))
    container[key] = value


def _conflict(url: str, fqn: str, path: Path, other: str, placed: dict[str, Path]) -> NoReturn:
    raise MetadataError(
        f"{url}: the state dict's entries {other!r} and {fqn!r} cannot both be restored: "
        f"planner_data puts them at {placed[other]} and {path}, which do not fit in one state "
        "dict (a value where the other needs a dict or a list, or a dict where it needs a list)",
        url=url,
    )

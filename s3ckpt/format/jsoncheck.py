"""Typed access to parsed JSON whose every error names where it is. No I/O.

The commit record is checked field by field as it is decoded (`s3ckpt.format.record`); these helpers
raise `Invalid` with the field's path (``state_dict['w'].chunks[0].sizes[1]: expected ...``),
which the decoder turns into one MetadataError.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn, TypeVar

__all__ = [
    "MAX_INT",
    "Invalid",
    "all_counts",
    "as_bool",
    "as_count",
    "as_counts",
    "as_dict",
    "as_list",
    "as_str",
    "fail",
    "get_field",
    "is_count",
    "joined",
    "lookup",
    "opt_str",
    "reject_constant",
    "show",
    "unique_pairs",
]

MAX_INT = 2**63 - 1  # torch sizes and S3 byte offsets are int64; larger is garbage.

_T = TypeVar("_T")


class Invalid(Exception):
    """Internal: what is wrong and where; turned into a MetadataError at the API boundary."""


def fail(message: str) -> NoReturn:
    raise Invalid(message)


def show(value: Any) -> str:
    """A short repr, so a hostile multi-megabyte field cannot flood the error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def joined(where: str, name: str) -> str:
    """Joined only when an error is raised: building paths eagerly doubles the cost of a decode."""
    return f"{where}.{name}" if where and name else where or name


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def all_counts(values: list[Any]) -> bool:
    """The fast path for offsets and sizes, in C loops; exact ``int`` also rules out ``bool``."""
    return not values or (
        set(map(type, values)) == {int} and 0 <= min(values) <= max(values) <= MAX_INT
    )


def reject_constant(name: str) -> NoReturn:
    fail(f"not strict JSON: {name} is not a JSON number")


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                fail(f"not a valid commit record: key {show(key)} appears twice in one object")
            seen.add(key)
    return out


def get_field(obj: dict[str, Any], name: str, where: str) -> Any:
    if name not in obj:
        fail(f"{where + ': ' if where else ''}missing field {name!r}")
    return obj[name]


def as_dict(value: Any, where: str, name: str = "") -> dict[str, Any]:
    if type(value) is not dict:
        fail(f"{joined(where, name)}: expected a JSON object, got {show(value)}")
    return value


def as_list(value: Any, where: str, name: str = "") -> list[Any]:
    if type(value) is not list:
        fail(f"{joined(where, name)}: expected a JSON list, got {show(value)}")
    return value


def as_str(value: Any, where: str, name: str = "") -> str:
    if type(value) is not str:
        fail(f"{joined(where, name)}: expected a string, got {show(value)}")
    return value


def opt_str(value: Any, where: str, name: str = "") -> str | None:
    return None if value is None else as_str(value, where, name)


def as_bool(value: Any, where: str, name: str = "") -> bool:
    if type(value) is not bool:
        fail(f"{joined(where, name)}: expected true or false, got {show(value)}")
    return value


def as_count(value: Any, where: str, name: str = "") -> int:
    if not is_count(value):
        fail(f"{joined(where, name)}: expected a non-negative int, got {show(value)}")
    return int(value)


def as_counts(value: Any, where: str, name: str = "") -> list[int]:
    values = as_list(value, where, name)
    if not all_counts(values):
        path = joined(where, name)
        for i, v in enumerate(values):
            as_count(v, f"{path}[{i}]")
    return values


def lookup(table: Mapping[str, _T], value: Any, where: str, name: str = "") -> _T:
    found = table.get(value) if isinstance(value, str) else None
    if found is None:
        known = ", ".join(table)
        fail(f"{joined(where, name)}: unsupported value {show(value)} (known: {known})")
    return found

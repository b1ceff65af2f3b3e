"""`nesting.nest`: the saved state dict rebuilt from a record's planner_data, and the records
whose paths cannot all hold. No server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from s3ckpt.errors import MetadataError
from s3ckpt.format.record import BytesEntry, Checkpoint, Locator
from s3ckpt.format.record.nesting import nest

URL = "s3://b/ck/.metadata"


def _checkpoint(paths: dict[str, Any]) -> Checkpoint:
    entries = {fqn: BytesEntry(Locator("o", 0, 1)) for fqn in paths}
    planner_data = {
        fqn: {"__tuple__": list(path)} for fqn, path in paths.items() if path is not None
    }
    return Checkpoint(
        save_id="s",
        created=0.0,
        objects={"o": 1},
        extra={},
        frames={},
        entries=entries,
        planner_source=json.dumps(planner_data),
        storage_meta=None,
        dcp_version=None,
        url=URL,
    )


def test_entries_go_where_planner_data_puts_them_and_lists_are_padded() -> None:
    checkpoint = _checkpoint(
        {
            "model.w": ("model", "w"),
            "optim.state.0.step": ("optim", "state", 0, "step"),
            "groups.2.lr": ("groups", 2, "lr"),
            "step": None,  # no path: at its own name
        }
    )
    # An index makes a list, as DCP's set_element makes one (optimizer state too).
    assert nest(checkpoint, lambda fqn: fqn.upper()) == {
        "model": {"w": "MODEL.W"},
        "optim": {"state": [{"step": "OPTIM.STATE.0.STEP"}]},
        "groups": [None, None, {"lr": "GROUPS.2.LR"}],
        "step": "STEP",
    }


@pytest.mark.parametrize(
    ("paths", "named"),
    [
        (
            {"extra": ("extra",), "extra.lr": ("extra", "lr")},
            ("'extra' and 'extra.lr'", "('extra',)"),
        ),
        (
            {"extra.lr": ("extra", "lr"), "extra": ("extra",)},
            ("'extra.lr' and 'extra'", "('extra', 'lr')"),
        ),
        ({"a.0": ("a", 0), "a.b": ("a", "b")}, ("'a.0' and 'a.b'", "('a', 0)")),
        ({"x": ("x",), "y": ("x",)}, ("'x' and 'y'", "('x',)")),
    ],
    ids=["value-then-items", "items-then-value", "list-then-dict", "same-place"],
)
def test_paths_that_cannot_all_hold_name_both_entries(
    paths: dict[str, Any], named: tuple[str, str]
) -> None:
    with pytest.raises(MetadataError) as caught:
        nest(_checkpoint(paths), lambda fqn: 1)
    message = str(caught.value)
    assert URL in message and "cannot both be restored" in message
    assert all(part in message for part in named), message


@pytest.mark.parametrize(
    "path",
    [("a", 10**9), ("a", -1), (0, "a"), (), ("a", True), ("a", 1.5)],
    ids=["huge-index", "negative-index", "index-first", "empty", "bool", "float"],
)
def test_a_path_that_is_not_one_is_refused_before_anything_is_built(path: tuple[Any, ...]) -> None:
    """An index is at most the number of entries: ``("a", 10**9)`` would be a list of a
    billion Nones."""
    with pytest.raises(MetadataError, match="is not a path of keys and list indices below 1"):
        nest(_checkpoint({"a.b": path}), lambda fqn: 1)

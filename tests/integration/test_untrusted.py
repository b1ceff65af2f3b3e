"""Loading from a bucket you do not control must not run code that the checkpoint chose.

DCP stores each non-tensor value as a pickle, and its default planner unpickles it with
``weights_only=False``: a ``__reduce__`` payload would run on ``dcp.load``. `S3Reader` (and so
``s3ckpt export``) first checks each such value with torch's ``weights_only`` unpickler and refuses
it unless ``trust_pickles`` is on. The payload here touches a marker file, so the tests see
whether it ran.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import CheckpointError, S3Reader, S3Writer, UnsafeCheckpoint
from tests.conftest import Cli, S3Env
from tests.helpers import raised

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract


class _RunsCode:
    """Unpickling it touches ``marker``: a stand-in for whatever a hostile checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@dataclass
class _Point:
    """A user type that the loader allowlists with ``torch.serialization`` safe globals."""

    x: int
    y: float


def _save_hostile(s3: S3Env, bucket: str, marker: Path) -> None:
    state = {"w": torch.arange(6.0), "extra": {"hook": _RunsCode(marker)}}
    dcp.save(state, storage_writer=S3Writer(bucket, "ck", config=s3.config()))
    assert not marker.exists()  # saving only records the payload


def _hostile_template() -> dict[str, Any]:
    return {"w": torch.zeros(6), "extra": {"hook": None}}


def test_load_refuses_a_pickle_that_would_run_code(s3: S3Env, bucket: str, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    _save_hostile(s3, bucket, marker)
    reader = S3Reader(bucket, "ck", config=s3.config())
    error = raised(lambda: dcp.load(_hostile_template(), storage_reader=reader))
    assert not marker.exists()
    assert isinstance(error, UnsafeCheckpoint) and isinstance(error, CheckpointError)
    message = str(error)
    assert "extra.hook" in message and f"s3://{bucket}/ck/" in message
    assert "trust_pickles=True" in message and "--trust-pickles" in message
    assert "getattr" in message  # the cause: the global the check refused
    assert error.fqn == "extra.hook" and error.url == f"s3://{bucket}/ck"
    copy = pickle.loads(pickle.dumps(error))  # DCP ships it between ranks
    assert type(copy) is UnsafeCheckpoint and str(copy) == message and copy.fqn == "extra.hook"


def test_trust_pickles_loads_it_as_dcp_would(s3: S3Env, bucket: str, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    _save_hostile(s3, bucket, marker)
    state = _hostile_template()
    dcp.load(state, storage_reader=S3Reader(bucket, "ck", config=s3.config(), trust_pickles=True))
    assert marker.exists()
    assert torch.equal(state["w"], torch.arange(6.0))


def test_plain_values_and_allowlisted_types_load_unchanged_by_default(
    s3: S3Env, bucket: str
) -> None:
    saved = {
        "w": torch.randn(4, 3),
        "step": 12,
        "note": "resumable",
        "betas": (0.9, 0.999),
        "groups": [{"lr": 0.01, "params": ["w"]}, {"lr": 0.1, "nested": {"k": [1, 2]}}],
        "values": [1, 2.5, "x", None, True],
        "inside": ("t", {"tensor": torch.arange(5, dtype=torch.int32)}),
        "point": _Point(3, 0.5),
    }
    dcp.save(saved, storage_writer=S3Writer(bucket, "ok", config=s3.config()))
    loaded: dict[str, Any] = {key: None for key in saved}  # DCP flattens dicts and lists of dicts
    loaded |= {
        "w": torch.zeros(4, 3),
        "groups": [{"lr": 0, "params": 0}, {"lr": 0, "nested": {"k": 0}}],
    }
    with torch.serialization.safe_globals([_Point]):  # add_safe_globals, undone afterwards
        dcp.load(loaded, storage_reader=S3Reader(bucket, "ok", config=s3.config()))
    assert torch.equal(loaded["w"], saved["w"])
    inside = loaded.pop("inside")
    assert inside[0] == "t" and torch.equal(inside[1]["tensor"], torch.arange(5, dtype=torch.int32))
    assert {k: v for k, v in loaded.items() if k not in ("w", "inside")} == {
        k: v for k, v in saved.items() if k not in ("w", "inside")
    }


def test_a_type_not_allowlisted_is_refused_by_name(s3: S3Env, bucket: str) -> None:
    dcp.save({"point": _Point(1, 2.0)}, storage_writer=S3Writer(bucket, "p", config=s3.config()))
    reader = S3Reader(bucket, "p", config=s3.config())
    error = raised(lambda: dcp.load({"point": None}, storage_reader=reader))
    assert isinstance(error, UnsafeCheckpoint)
    assert "point" in str(error) and "_Point" in str(error)


@pytest.mark.parametrize("trusted", [False, True], ids=["default", "trust-pickles"])
def test_export_refuses_it_unless_told_to_trust_pickles(
    cli: Cli, s3: S3Env, bucket: str, tmp_path: Path, trusted: bool
) -> None:
    marker = tmp_path / "payload-ran"
    _save_hostile(s3, bucket, marker)
    out = tmp_path / "out.pt"
    flags = ["--trust-pickles"] if trusted else []
    code, _, stderr = cli("export", *flags, f"s3://{bucket}/ck", str(out))
    if trusted:
        assert code == 0, stderr
        assert marker.exists() and out.exists()
    else:
        assert code == 1
        assert "extra.hook" in stderr and "--trust-pickles" in stderr
        assert "Traceback" not in stderr
        assert not marker.exists() and not out.exists()

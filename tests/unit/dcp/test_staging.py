"""async_save staging held by a writer, without a server (saves through it:
tests/integration/test_staging.py)."""

from __future__ import annotations

import pickle
import sys

import torch

from s3ckpt import S3Writer


def test_a_writer_with_staged_buffers_pickles_small() -> None:
    writer = S3Writer("bucket", "prefix")
    writer.stage({"w": torch.randn(1_000_000)})
    assert writer._staging.nbytes == 4_000_000
    copy = pickle.loads(pickle.dumps(writer))
    assert len(pickle.dumps(writer)) < 10_000
    assert copy._staging.nbytes == 0 and copy.location == writer.location


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process holding ``address`` (Linux)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_cpu_staging_buffers_share_one_mapping_advised_for_huge_pages() -> None:
    # The first save faults in every page of its buffers; on 4 KiB pages that costs several
    # times the copy, so they are allocated where the kernel may use 2 MiB ones.
    writer = S3Writer("bucket", "prefix")
    state = {"a": torch.randn(300_000), "b": {"c": torch.arange(10, dtype=torch.int16)}, "n": 3}
    staged = writer.stage(state)
    assert isinstance(staged, dict)
    assert torch.equal(staged["a"], state["a"]) and torch.equal(staged["b"]["c"], state["b"]["c"])
    assert staged["n"] == 3
    storages = {staged["a"].untyped_storage(), staged["b"]["c"].untyped_storage()}
    assert len({s.data_ptr() for s in storages}) == 1, "one mapping for all buffers"
    if sys.platform.startswith("linux"):
        assert "hg" in _mapping_flags(staged["a"].data_ptr()), "advised MADV_HUGEPAGE"
    writer.close()

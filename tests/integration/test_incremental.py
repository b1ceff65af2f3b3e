"""Incremental saves: unchanged chunks referenced, never uploaded again; loads, verify, removals."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import (
    CheckpointManager,
    ChecksumMismatch,
    ConfigError,
    S3Config,
    S3Reader,
    S3Writer,
    SavePolicy,
    WriteOptions,
)
from s3ckpt.config import MiB
from s3ckpt.dcp.incremental import Pins
from s3ckpt.engine import bridge
from s3ckpt.engine.store import get_store
from s3ckpt.format import layout
from s3ckpt.format.layout import Location
from s3ckpt.format.record import decode
from s3ckpt.tools.catalog import delete, describe, gc, prune, read_state
from s3ckpt.tools.verify import verify
from tests.helpers import listing, raised

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}


def model(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "frozen.embed": torch.randn(1000, 512, generator=generator),
        "frozen.proj": torch.randn(512, 512, generator=generator).to(torch.bfloat16),
        "frozen.norm": torch.ones(512),
        "lora.a": torch.randn(512, 8, generator=generator),
        "lora.b": torch.zeros(8, 512),
        "step": 0,
    }


def trained(state: dict[str, Any], step: int) -> dict[str, Any]:
    out = dict(state)
    out["lora.a"] = state["lora.a"] + step
    out["lora.b"] = state["lora.b"] - step
    out["step"] = step
    return out


def save(s3: Any, bucket: str, state: dict[str, Any], step: int, **writer: Any) -> str:
    prefix = f"run/step-{step:06d}"
    options = WriteOptions(**writer.pop("options", {}))
    writer = {"incremental": True, **writer}
    config = s3.config(**PARTS)
    dcp.save(
        state, storage_writer=S3Writer(bucket, prefix, config=config, options=options, **writer)
    )
    return prefix


def load(s3: Any, bucket: str, prefix: str, like: dict[str, Any]) -> dict[str, Any]:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in like.items()}
    dcp.load(out, storage_reader=S3Reader(bucket, prefix, config=s3.config()))
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def data_bytes(s3: Any, bucket: str, prefix: str) -> int:
    return sum(
        size for key, size in listing(s3.client, bucket, prefix + "/").items() if "/data-" in key
    )


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_unchanged_chunks_are_referenced_and_load(s3: Any, bucket: str, compression: Any) -> None:
    base = model()
    first = save(s3, bucket, base, 1, options={"compression": compression})
    later = trained(base, 2)
    second = save(s3, bucket, later, 2, options={"compression": compression})
    lora = sum(later[k].numel() * later[k].element_size() for k in ("lora.a", "lora.b"))
    assert data_bytes(s3, bucket, second) < lora * 1.1 + 4096
    assert data_bytes(s3, bucket, first) > 2 * MiB
    assert same(load(s3, bucket, second, later), later)
    assert same(load(s3, bucket, first, base), base)
    info, _ = describe(f"s3://{bucket}/{second}", s3.config())
    assert info.referenced_bytes == sum(
        base[k].numel() * base[k].element_size() for k in base if k.startswith("frozen")
    )
    assert info.stored_bytes == data_bytes(s3, bucket, second)
    verify(f"s3://{bucket}/{second}", s3.config())


def dangling(s3: Any, bucket: str, run: str) -> list[str]:
    """Objects that a committed record under ``run`` lists and the bucket does not hold."""
    present = listing(s3.client, bucket, f"{run}/" if run else "")
    missing = []
    for key in present:
        if key.endswith("/.metadata"):
            location = Location(bucket, key.rpartition("/")[0])
            raw = s3.client.get_object(Bucket=bucket, Key=key)["Body"].read()
            for relative, size in decode(raw, url=key).objects.items():
                if present.get(location.key(relative)) != size:
                    missing.append(location.key(relative))
    return missing


def expire_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves leave their pins to expire LEASE_TTL after the commit (see `dcp.incremental`):
    here, at once, so that what removals keep is kept by references alone."""
    monkeypatch.setattr(layout, "LEASE_TTL", 0.0)


def frozen_objects(s3: Any, bucket: str, prefix: str) -> dict[str, int]:
    return {
        k: v for k, v in listing(s3.client, bucket, prefix + "/data-").items() if "lease" not in k
    }


def test_a_changed_state_references_nothing(s3: Any, bucket: str) -> None:
    save(s3, bucket, model(0), 1)
    changed = {k: v + 1 if isinstance(v, torch.Tensor) else v for k, v in model(0).items()}
    second = save(s3, bucket, changed, 2)
    info, _ = describe(f"s3://{bucket}/{second}", s3.config())
    assert info.references == () and info.referenced_bytes == 0
    assert same(load(s3, bucket, second, changed), changed)


def test_no_reference_across_compression_or_to_a_later_step(s3: Any, bucket: str) -> None:
    state = model()
    save(s3, bucket, state, 5)
    raw = save(s3, bucket, state, 1)  # step 5 is later: not a base of step 1
    assert describe(f"s3://{bucket}/{raw}", s3.config())[0].references == ()
    packed = save(s3, bucket, state, 6, options={"compression": "zstd"})
    assert describe(f"s3://{bucket}/{packed}", s3.config())[0].references == ()
    again = save(s3, bucket, state, 7, options={"compression": "zstd"})
    assert describe(f"s3://{bucket}/{again}", s3.config())[0].references == ("step-000006",)


def test_references_point_at_the_object_that_holds_the_bytes(s3: Any, bucket: str) -> None:
    state = model()
    for step in (1, 2, 3):
        last = save(s3, bucket, trained(state, step), step)
    info, _ = describe(f"s3://{bucket}/{last}", s3.config())
    assert info.references == ("step-000001",)  # not step 2, which references step 1 too
    assert same(load(s3, bucket, last, trained(state, 3)), trained(state, 3))


def test_full_every_keeps_references_within_a_window_of_steps(s3: Any, bucket: str) -> None:
    state = model()
    references = {}
    for step in range(1, 6):
        prefix = save(s3, bucket, trained(state, step), step, full_every=2)
        references[step] = describe(f"s3://{bucket}/{prefix}", s3.config())[0].references
    # Windows {1}, {2, 3}, {4, 5}: the first save of each is full.
    assert references == {1: (), 2: (), 3: ("step-000002",), 4: (), 5: ("step-000004",)}
    assert same(load(s3, bucket, "run/step-000005", trained(state, 5)), trained(state, 5))


def test_full_every_skips_base_chunks_held_before_the_window(s3: Any, bucket: str) -> None:
    state = model()
    save(s3, bucket, state, 1)
    second = trained(state, 2)
    save(s3, bucket, second, 2)  # references step 1's frozen tensors
    third = save(s3, bucket, second | {"step": 3}, 3, full_every=2)
    info, _ = describe(f"s3://{bucket}/{third}", s3.config())
    lora = sum(second[k].numel() * second[k].element_size() for k in ("lora.a", "lora.b"))
    assert info.references == ("step-000002",) and info.referenced_bytes == lora
    assert same(load(s3, bucket, third, second | {"step": 3}), second | {"step": 3})


def test_full_every_needs_incremental_and_a_positive_count() -> None:
    for options in ({"full_every": 10}, {"incremental": True, "full_every": 0}):
        with pytest.raises(ConfigError, match="full_every"):
            S3Writer("bucket", "run/step-1", config=S3Config(region="us-east-1"), **options)
    with pytest.raises(ConfigError, match="full_every"):
        SavePolicy(full_every=5)


def test_removing_the_base_keeps_what_later_checkpoints_reference(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = model()
    first = save(s3, bucket, state, 1)
    second = save(s3, bucket, trained(state, 2), 2)
    expire_leases(monkeypatch)
    removal = delete(f"s3://{bucket}/{first}", s3.config())
    assert removal.kept and f"{first}/.metadata" in removal.deleted
    assert f"{first}/.metadata" not in listing(s3.client, bucket, first + "/")
    assert same(load(s3, bucket, second, trained(state, 2)), trained(state, 2))
    verify(f"s3://{bucket}/{second}", s3.config())
    report = gc(f"s3://{bucket}/run", older_than=timedelta(0), config=s3.config())
    assert not set(report.deleted) & set(removal.kept)
    assert same(load(s3, bucket, second, trained(state, 2)), trained(state, 2))
    delete(f"s3://{bucket}/{second}", s3.config())  # the last reference goes
    gc(f"s3://{bucket}/run", older_than=timedelta(0), config=s3.config())
    assert not [k for k in listing(s3.client, bucket, "run/") if not k.endswith(".lease")]


def test_prune_keeps_the_referenced_base_and_storage_stays_small(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = model()
    first = save(s3, bucket, state, 1)
    full = sum(frozen_objects(s3, bucket, first).values())
    for step in range(2, 11):
        save(s3, bucket, trained(state, step), step)
    assert dangling(s3, bucket, "run") == []
    stored = sum(
        size for key, size in listing(s3.client, bucket, "run/").items() if "/data-" in key
    )
    assert stored < 1.5 * full  # ten checkpoints
    expire_leases(monkeypatch)
    pruned = prune(f"s3://{bucket}/run", 2, config=s3.config())
    assert sorted(info.step for info in pruned) == list(range(1, 9))
    assert dangling(s3, bucket, "run") == []
    assert set(frozen_objects(s3, bucket, first))  # kept for steps 9 and 10
    assert same(load(s3, bucket, "run/step-000010", trained(state, 10)), trained(state, 10))
    gc(f"s3://{bucket}/run", older_than=timedelta(0), config=s3.config())
    assert dangling(s3, bucket, "run") == []
    assert same(load(s3, bucket, "run/step-000009", trained(state, 9)), trained(state, 9))


def test_overwriting_the_base_keeps_what_later_checkpoints_reference(s3: Any, bucket: str) -> None:
    state = model()
    first = save(s3, bucket, state, 1)
    second = save(s3, bucket, trained(state, 2), 2)
    save(s3, bucket, model(5), 1, overwrite=True)
    assert dangling(s3, bucket, "run") == []
    assert same(load(s3, bucket, second, trained(state, 2)), trained(state, 2))
    assert same(load(s3, bucket, first, model(5)), model(5))


def test_verify_checks_referenced_bytes(s3: Any, bucket: str) -> None:
    state = model()
    first = save(s3, bucket, state, 1)
    second = save(s3, bucket, trained(state, 2), 2)
    key = max(frozen_objects(s3, bucket, first).items(), key=lambda kv: kv[1])[0]
    body = bytearray(s3.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    error = raised(lambda: verify(f"s3://{bucket}/{second}", s3.config()))
    assert isinstance(error, ChecksumMismatch) and key in str(error)


def test_the_manager_saves_incrementally_and_restores(s3: Any, bucket: str) -> None:
    state = model()
    url = f"s3://{bucket}/run"
    incremental = SavePolicy(incremental=True)
    with CheckpointManager(url, keep_last=2, saving=incremental, config=s3.config(**PARTS)) as mgr:
        for step in range(1, 6):
            mgr.save(step, trained(state, step), force=True)
        mgr.wait()
    assert dangling(s3, bucket, "run") == []
    restored = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()
    }
    with CheckpointManager(url, config=s3.config()) as mgr:
        assert mgr.restore(restored) == 5
    assert same(restored, trained(state, 5))
    assert describe(f"{url}/step-000000005", s3.config())[0].references == ("step-000000001",)


@pytest.mark.parametrize("writers", [1, 2])
def test_incremental_retention_converges_at_once(s3: Any, bucket: str, writers: int) -> None:
    """Each save pins the base it references until LEASE_TTL after its commit, but a pin
    protects what the record references, not the base's record: with keep_last=1 only the
    newest record stays, and of the older saves only the objects it references (two managers
    taking turns on one run, too)."""
    state, url = model(), f"s3://{bucket}/run"
    managers = [
        CheckpointManager(
            url, keep_last=1, saving=SavePolicy(incremental=True), config=s3.config(**PARTS)
        )
        for _ in range(writers)
    ]
    for step in range(1, 7):
        mgr = managers[step % writers]
        mgr.save(step, trained(state, step), force=True)
        mgr.wait()
    for mgr in managers:
        mgr.close()
    assert managers[0].steps() == [6]
    newest = describe(f"{url}/step-000000006", s3.config())[0]
    assert newest.references == ("step-000000001",)
    stored = {k for k in listing(s3.client, bucket, "run/") if not k.endswith(".lease")}
    raw = s3.client.get_object(Bucket=bucket, Key="run/step-000000006/.metadata")["Body"].read()
    needed = {Location(bucket, "run/step-000000006").key(k) for k in decode(raw, url="").objects}
    assert stored == needed | {"run/step-000000006/.metadata"}, "nothing else is left"
    assert dangling(s3, bucket, "run") == []


def test_the_managers_full_every_saves_in_full_once_per_window(s3: Any, bucket: str) -> None:
    state, url = model(), f"s3://{bucket}/run"
    config = s3.config(**PARTS)
    saving = SavePolicy(incremental=True, full_every=3)
    with CheckpointManager(url, saving=saving, config=config) as mgr:
        for step in range(1, 6):
            mgr.save(step, trained(state, step), force=True)
        mgr.wait()
    references = [describe(f"{url}/step-{s:09d}", config)[0].references for s in range(1, 6)]
    one, two = ("step-000000001",), ("step-000000003",)
    assert references == [(), one, (), two, two]


def test_export_and_info_of_an_incremental_checkpoint(s3: Any, bucket: str, cli: Any) -> None:
    state = model()
    save(s3, bucket, state, 1)
    second = save(s3, bucket, trained(state, 2), 2)
    code, out, _ = cli("info", f"s3://{bucket}/{second}")
    assert code == 0
    assert "referenced:" in out and "step-000001" in out and "earlier checkpoints" in out
    code, out, _ = cli("--json", "info", f"s3://{bucket}/{second}")
    shown = json.loads(out)["checkpoint"]
    assert shown["referenced_bytes"] > 2 * MiB > shown["stored_bytes"]
    exported = read_state(f"s3://{bucket}/{second}", s3.config())
    assert same(exported, trained(state, 2))


def test_ls_shows_a_removed_base_as_referenced(
    s3: Any, bucket: str, cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = model()
    first = save(s3, bucket, state, 1)
    save(s3, bucket, trained(state, 2), 2)
    expire_leases(monkeypatch)
    delete(f"s3://{bucket}/{first}", s3.config())
    code, out, _ = cli("--json", "ls", f"s3://{bucket}/run")
    assert code == 0
    states = {c["prefix"]: c["state"] for c in json.loads(out)}
    assert states == {first: "referenced", "run/step-000002": "committed"}


def test_gc_of_the_bucket_keeps_what_top_level_checkpoints_reference(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = model()
    for step in (1, 2):
        prefix = f"step-{step:06d}"
        writer = S3Writer(bucket, prefix, config=s3.config(**PARTS), incremental=True)
        dcp.save(trained(state, step), storage_writer=writer)
    # A failed save at the bucket's root: the root is a checkpoint gc looks at, too.
    s3.client.put_object(Bucket=bucket, Key="data-0123456789abcdef01234567/00000-000", Body=b"x")
    expire_leases(monkeypatch)
    delete(f"s3://{bucket}/step-000001", s3.config())
    report = gc(f"s3://{bucket}", older_than=timedelta(0), config=s3.config())
    assert "data-0123456789abcdef01234567/00000-000" in report.deleted
    assert dangling(s3, bucket, "") == []
    assert same(load(s3, bucket, "step-000002", trained(state, 2)), trained(state, 2))


def test_breaking_leases_never_breaks_a_pin(s3: Any, bucket: str) -> None:
    first = save(s3, bucket, model(), 1)
    location = Location(bucket, first)
    store = get_store(s3.config())
    _, checkpoint = describe(location.url, s3.config())
    pins = Pins(store, location, checkpoint)
    bridge.run(pins.hold())
    try:
        s3.client.delete_object(Bucket=bucket, Key=f"{first}/.metadata")
        url = f"s3://{bucket}/run"
        report = gc(url, older_than=timedelta(0), config=s3.config(), break_leases=True)
        assert not [key for key in report.deleted if "/data-" in key and "lease" not in key]
        assert frozen_objects(s3, bucket, first)
    finally:
        bridge.run(pins.release())
    gc(url, older_than=timedelta(0), config=s3.config(), break_leases=True)
    assert not listing(s3.client, bucket, first + "/")

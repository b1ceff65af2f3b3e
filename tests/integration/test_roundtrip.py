"""Round trips through real S3 servers (moto and SeaweedFS) with single-process DCP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from s3ckpt import S3Config, S3Reader, S3Writer, WriteOptions
from s3ckpt.config import MiB
from s3ckpt.engine.store import get_store
from tests.helpers import listing

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract

SMALL_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "max_concurrency": 4}


def mixed_state() -> dict[str, Any]:
    base = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    shared = torch.arange(20, dtype=torch.int16)
    return {
        "f32": torch.randn(64, 33),
        "bf16": torch.randn(17, 9).to(torch.bfloat16),
        "f16": torch.randn(31).to(torch.float16),
        "f64": torch.randn(3, 3, 3, dtype=torch.float64),
        "ints": {
            str(dt): torch.randint(-100, 100, (13,), dtype=dt)
            for dt in (torch.int8, torch.int16, torch.int32, torch.int64)
        },
        "u8": torch.randint(0, 255, (29,), dtype=torch.uint8),
        "bool": torch.rand(7) > 0.5,
        "c64": torch.randn(5, 2, dtype=torch.complex64),
        "c128": torch.randn(4, dtype=torch.complex128),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "column_view": base[:, 2:5],
        "transposed": base.t(),
        "row_view": base[3],
        "shared_a": shared[2:10],
        "shared_b": shared[5:15],
        "list": [torch.ones(2, 2), {"deep": torch.full((3,), 7, dtype=torch.int32)}],
        "step": 1234,
        "name": "run7",
        "config": {"lr": 3e-4, "betas": (0.9, 0.95)},
    }


def zeros_like_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    return None


def assert_same(loaded: Any, saved: Any, path: str = "") -> None:
    if isinstance(saved, torch.Tensor):
        assert isinstance(loaded, torch.Tensor), path
        assert loaded.dtype == saved.dtype and loaded.shape == saved.shape, path
        assert torch.equal(loaded, saved), path
    elif isinstance(saved, dict):
        assert set(loaded) == set(saved), path
        for k in saved:
            assert_same(loaded[k], saved[k], f"{path}.{k}")
    elif isinstance(saved, list):
        assert len(loaded) == len(saved), path
        for i, (a, b) in enumerate(zip(loaded, saved, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert loaded == saved, path


def test_mixed_state_dict_round_trip(s3: Any, bucket: str) -> None:
    state = mixed_state()
    dcp.save(state, storage_writer=S3Writer(bucket, "ck/mixed", config=s3.config()))
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck/mixed", config=s3.config()))
    assert_same(loaded, state)


def test_views_store_only_their_own_elements(s3: Any, bucket: str) -> None:
    big = torch.randn(1024, 1024)
    state = {"slice": big[10:12], "column": big[:, 5]}
    dcp.save(state, storage_writer=S3Writer(bucket, "ck/views", config=s3.config()))
    sizes = [size for key, size in listing(s3.client, bucket).items() if "/data-" in key]
    assert sum(sizes) == (2 * 1024 + 1024) * 4
    loaded = {"slice": torch.zeros(2, 1024), "column": torch.zeros(1024)}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck/views", config=s3.config()))
    assert_same(loaded, {k: v.clone() for k, v in state.items()})


@pytest.mark.stores("moto", "seaweedfs")  # the wire
def test_tensor_spanning_many_parts(s3: Any, bucket: str) -> None:
    config = s3.config(**SMALL_PARTS)
    state = {"w": torch.randn(23 * MiB // 4 + 3), "b": torch.randn(10)}
    dcp.save(
        state,
        storage_writer=S3Writer(
            bucket, "ck/parts", config=config, options=WriteOptions(objects_per_rank=1)
        ),
    )
    data_keys = [key for key in listing(s3.client, bucket) if "/data-" in key]
    assert len(data_keys) == 1
    head = s3.client.head_object(Bucket=bucket, Key=data_keys[0], PartNumber=1)
    assert head.get("PartsCount", 0) >= 5
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck/parts", config=config))
    assert_same(loaded, state)


def test_items_are_packed_into_a_few_balanced_objects(s3: Any, bucket: str) -> None:
    config = s3.config(**SMALL_PARTS)
    state = {f"layer{i}": torch.randn(MiB // 4) for i in range(24)}  # 24 x 1 MiB
    dcp.save(
        state,
        storage_writer=S3Writer(
            bucket, "ck/pack", config=config, options=WriteOptions(objects_per_rank=4)
        ),
    )
    sizes = [size for key, size in listing(s3.client, bucket).items() if "/data-" in key]
    assert len(sizes) == 4
    assert max(sizes) == min(sizes) == 6 * MiB


def test_partial_load_reads_only_the_frames_it_needs(s3: Any, bucket: str) -> None:
    frame = 16 * 1024
    state = {"a": torch.randn(256, 256), "b": torch.randn(512), "meta": {"step": 5}}
    writer = S3Writer(
        bucket, "ck/partial", config=s3.config(), options=WriteOptions(frame_size=frame)
    )
    dcp.save(state, storage_writer=writer)
    config = s3.config()
    stats = get_store(config).stats
    metadata_size = listing(s3.client, bucket)["ck/partial/.metadata"]
    before = stats.bytes_received
    loaded = {"b": torch.zeros(512)}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck/partial", config=config))
    assert torch.equal(loaded["b"], state["b"])
    fetched = stats.bytes_received - before - metadata_size
    assert 512 * 4 <= fetched <= 2 * frame, "b's bytes and at most the frames around them"


def test_checkpoint_id_url_and_reset(s3: Any, bucket: str) -> None:
    state = {"x": torch.randn(10)}
    writer = S3Writer(bucket, "unused/prefix", config=s3.config())
    dcp.save(state, checkpoint_id=f"s3://{bucket}/run7/step-2000", storage_writer=writer)
    assert writer.checkpoint_id == f"s3://{bucket}/run7/step-2000"
    loaded = {"x": torch.zeros(10)}
    reader = S3Reader(f"s3://{bucket}/run7/step-2000", config=s3.config())
    dcp.load(loaded, storage_reader=reader)
    assert torch.equal(loaded["x"], state["x"])
    body = s3.client.get_object(Bucket=bucket, Key="run7/step-2000/.metadata")["Body"].read()
    record = json.loads(body)
    assert record["format"] == "s3ckpt" and record["version"] == 4


def test_save_and_load_from_inside_a_running_event_loop(s3: Any, bucket: str) -> None:
    state = {"x": torch.randn(100)}

    async def main() -> dict[str, torch.Tensor]:
        dcp.save(state, storage_writer=S3Writer(bucket, "ck/loop", config=s3.config()))
        loaded = {"x": torch.zeros(100)}
        dcp.load(loaded, storage_reader=S3Reader(bucket, "ck/loop", config=s3.config()))
        return loaded

    assert torch.equal(asyncio.run(main())["x"], state["x"])


def test_async_save_thread_mode_and_load(s3: Any, bucket: str) -> None:
    state = mixed_state()
    future = dcp.async_save(state, storage_writer=S3Writer(bucket, "ck/async", config=s3.config()))
    future.result(timeout=120)
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck/async", config=s3.config()))
    assert_same(loaded, state)


def test_load_converts_into_a_different_dtype_destination(s3: Any, bucket: str) -> None:
    state = {"w": torch.randn(40, 30).to(torch.bfloat16)}
    dcp.save(state, storage_writer=S3Writer(bucket, "ck/dtype", config=s3.config()))
    loaded = {"w": torch.zeros(40, 30, dtype=torch.float32)}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "ck/dtype", config=s3.config()))
    assert torch.equal(loaded["w"], state["w"].float())


@pytest.mark.parametrize("prefix", ["", "deep/er/prefix"])
def test_prefix_at_bucket_root_or_deep(s3: Any, bucket: str, prefix: str) -> None:
    state = {"x": torch.randn(8)}
    config: S3Config = s3.config()
    dcp.save(state, storage_writer=S3Writer(bucket, prefix, config=config))
    loaded = {"x": torch.zeros(8)}
    dcp.load(loaded, storage_reader=S3Reader(bucket, prefix, config=config))
    assert torch.equal(loaded["x"], state["x"])


@pytest.mark.stores("moto", "seaweedfs")  # the wire
def test_standard_aws_environment_needs_no_code(
    s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_access_key)
    monkeypatch.setenv("AWS_REGION", s3.region)
    state = {"x": torch.randn(16)}
    dcp.save(state, storage_writer=S3Writer(f"s3://{bucket}/env"))
    loaded = {"x": torch.zeros(16)}
    dcp.load(loaded, storage_reader=S3Reader(f"s3://{bucket}/env"))
    assert torch.equal(loaded["x"], state["x"])


@pytest.mark.stores("moto", "seaweedfs")  # the wire
def test_named_profile_from_aws_files(
    s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config").write_text(
        f"[profile onprem]\nregion = {s3.region}\nendpoint_url = {s3.endpoint_url}\n"
    )
    (tmp_path / "credentials").write_text(
        f"[onprem]\naws_access_key_id = {s3.access_key_id}\n"
        f"aws_secret_access_key = {s3.secret_access_key}\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "onprem")
    state = {"x": torch.randn(16)}
    dcp.save(state, storage_writer=S3Writer(bucket, "profile"))
    loaded = {"x": torch.zeros(16)}
    dcp.load(loaded, storage_reader=S3Reader(bucket, "profile"))
    assert torch.equal(loaded["x"], state["x"])


def assert_loads_each_stored_byte_once(
    s3: Any, bucket: str, prefix: str, state: dict[str, torch.Tensor], objects: int
) -> None:
    """Save with 1 MiB frames, load everything: the bytes received are the stored bytes."""
    config = s3.config(**SMALL_PARTS)
    writer = S3Writer(
        bucket,
        prefix,
        config=config,
        options=WriteOptions(objects_per_rank=objects, frame_size=MiB),
    )
    dcp.save(state, storage_writer=writer)
    stored = listing(s3.client, bucket)
    data = sum(size for key, size in stored.items() if f"{prefix}/data-" in key)
    stats = get_store(config).stats
    before = stats.bytes_received
    loaded = {name: torch.zeros_like(t) for name, t in state.items()}
    dcp.load(loaded, storage_reader=S3Reader(bucket, prefix, config=config))
    assert stats.bytes_received - before == data + stored[f"{prefix}/.metadata"]
    assert all(torch.equal(loaded[name], t) for name, t in state.items())


def test_a_full_load_fetches_every_stored_byte_exactly_once(s3: Any, bucket: str) -> None:
    generator = torch.Generator().manual_seed(2)
    state = {
        "big": torch.randn(7 * MiB // 4 + 123, generator=generator),  # spans many frames
        **{f"t{i}": torch.randn(100_000 + i, generator=generator) for i in range(6)},
    }
    assert_loads_each_stored_byte_once(s3, bucket, "ck/once", state, objects=2)


def test_groups_closing_mid_frame_do_not_fetch_that_frame_twice(s3: Any, bucket: str) -> None:
    generator = torch.Generator().manual_seed(4)
    # 1.7 MiB tensors in 1 MiB frames: 5 MiB fetch groups close between tensors, mid-frame.
    state = {f"t{i}": torch.randn(445_645, generator=generator) for i in range(12)}
    assert_loads_each_stored_byte_once(s3, bucket, "ck/mid", state, objects=1)


def test_tensors_smaller_than_a_frame_across_its_boundary_are_fetched_once(
    s3: Any, bucket: str
) -> None:
    generator = torch.Generator().manual_seed(5)
    # 0.7 MiB tensors in 1 MiB frames: many straddle a frame boundary as fetch groups close.
    state = {f"t{i}": torch.randn(183_501, generator=generator) for i in range(24)}
    assert_loads_each_stored_byte_once(s3, bucket, "ck/small", state, objects=1)

"""The `ObjectStore` contract, held against every store: the in-memory one and the engine over
moto and over SeaweedFS. What a test elsewhere checks on the memory store alone is only as
good as this suite says the memory store behaves like the wire."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Coroutine
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest

from s3ckpt.config import MiB
from s3ckpt.crc32c import Checksums, checksum
from s3ckpt.engine import bridge
from s3ckpt.engine.contract import ObjectStore
from s3ckpt.engine.store import get_store
from s3ckpt.errors import (
    BucketNotFound,
    ChecksumMismatch,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
)
from tests.conftest import S3Env

T = TypeVar("T")

pytestmark = pytest.mark.parametrize("s3", ["memory", "moto", "seaweedfs"], indirect=True)


def run(call: Coroutine[Any, Any, T]) -> T:
    return bridge.run(call)


def store_of(s3: S3Env, **overrides: Any) -> ObjectStore:
    return get_store(s3.config(**overrides))


class Bytes:
    """A `Payload` over bytes in memory."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    @property
    def size(self) -> int:
        return len(self.data)

    def views(self, start: int, end: int) -> list[memoryview] | None:
        return [memoryview(self.data)[start:end]]

    def read(self, start: int, end: int, scratch: memoryview) -> memoryview:
        scratch[: end - start] = self.data[start:end]
        return scratch[: end - start]

    def checksum(self, start: int, end: int) -> int:
        return checksum(memoryview(self.data)[start:end])


def pattern(size: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(size))


def frames_of(data: bytes, size: int) -> Checksums:
    starts = [*range(0, len(data), size), len(data)]
    crcs = [checksum(data[a:b]) for a, b in itertools.pairwise(starts)]
    return Checksums(starts, crcs)


def test_put_get_head_agree(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    run(store.put(bucket, "a/b", b"hello"))
    blob = run(store.get(bucket, "a/b"))
    head = run(store.head(bucket, "a/b"))
    assert blob.data == b"hello"
    assert head is not None and head.size == 5 and head.key == "a/b"
    assert head.etag and head.etag == blob.etag
    assert abs(head.modified - datetime.now(timezone.utc)) < timedelta(minutes=5)
    run(store.put(bucket, "a/b", b"other"))
    assert run(store.head(bucket, "a/b")).etag != blob.etag  # type: ignore[union-attr]


def test_missing_keys_and_buckets(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    assert run(store.head(bucket, "nope")) is None
    with pytest.raises(ObjectNotFound) as missing:
        run(store.get(bucket, "nope"))
    assert missing.value.bucket == bucket and missing.value.key == "nope"
    with pytest.raises(ObjectNotFound):
        run(store.check_size(bucket, "nope", 1))
    with pytest.raises(BucketNotFound) as gone:
        run(store.check_bucket(bucket + "-missing"))
    assert bucket + "-missing" in str(gone.value)
    with pytest.raises(BucketNotFound):
        run(store.list_objects(bucket + "-missing", ""))


def test_if_none_match_refuses_an_existing_key(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    run(store.put(bucket, "k", b"first", if_none_match=True))
    with pytest.raises(PreconditionFailed):
        run(store.put(bucket, "k", b"second", if_none_match=True, retry=store.retry))
    assert run(store.get(bucket, "k")).data == b"first"


def test_get_can_refuse_a_body_by_its_size(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    run(store.put(bucket, "big", b"x" * 100))

    class TooBig(Exception):
        pass

    def refuse(length: int) -> None:
        if length > 10:
            raise TooBig(length)

    with pytest.raises(TooBig):
        run(store.get(bucket, "big", check_size=refuse))
    run(store.check_size(bucket, "big", 100))
    with pytest.raises(StorageError) as wrong:
        run(store.check_size(bucket, "big", 99))
    assert wrong.value.code == "SizeMismatch"


def test_listings_in_key_order_with_child_prefixes(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    keys = ["r/a", "r/b/1", "r/b/2", "r/c/x/y", "r/d", "rx", "s/1"]
    for key in reversed(keys):
        run(store.put(bucket, key, key.encode()))
    flat = run(store.list_objects(bucket, "r/"))
    assert [o.key for o in flat.objects] == ["r/a", "r/b/1", "r/b/2", "r/c/x/y", "r/d"]
    assert [o.size for o in flat.objects] == [3, 5, 5, 7, 3]
    tree = run(store.list_objects(bucket, "r/", delimiter=True))
    assert [o.key for o in tree.objects] == ["r/a", "r/d"]
    assert tree.prefixes == ["r/b/", "r/c/"]
    assert [o.key for o in run(store.list_objects(bucket, "r/", limit=2)).objects] == [
        "r/a",
        "r/b/1",
    ]
    assert run(store.list_objects(bucket, "q/")).objects == []
    after = run(store.list_objects(bucket, "r/", start_after="r/b/1"))
    assert [o.key for o in after.objects] == ["r/b/2", "r/c/x/y", "r/d"]
    ranged = run(store.list_objects(bucket, "r/", end="r/b/2"))  # may hold more: pages
    assert [o.key for o in ranged.objects][:3] == ["r/a", "r/b/1", "r/b/2"]
    assert abs(tree.server_time - datetime.now(timezone.utc)) < timedelta(minutes=5)


def test_many_keys_list_and_delete_past_one_page(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    keys = [f"p/{i:05d}" for i in range(1003)]

    async def put_all() -> None:
        await asyncio.gather(*(store.put(bucket, key, b"") for key in keys))

    run(put_all())
    assert [o.key for o in run(store.list_objects(bucket, "p/")).objects] == keys
    counted: list[int] = []
    run(store.delete(bucket, [*keys, "p/never-there"], deleted=counted.append))
    assert sum(counted) == len(keys) + 1 and len(counted) == 2
    assert run(store.list_objects(bucket, "p/")).objects == []


@pytest.mark.parametrize("size", [1000, 11 * MiB + 3], ids=["single", "multipart"])
def test_uploads_appear_whole(s3: S3Env, bucket: str, size: int) -> None:
    store = store_of(s3, part_size=5 * MiB, multipart_threshold=5 * MiB)
    data = pattern(size)
    run(store.upload(bucket, "obj", Bytes(data)))
    assert run(store.get(bucket, "obj")).data == data
    assert run(store.list_uploads(bucket, "")) == []


def test_upload_stream_of_unknown_length(s3: S3Env, bucket: str) -> None:
    store = store_of(s3, part_size=5 * MiB, multipart_threshold=5 * MiB)
    data = pattern(12 * MiB, seed=3)

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 3 * MiB):
            yield data[start : start + 3 * MiB]

    run(store.upload_stream(bucket, "stream", chunks()))
    run(store.upload_stream(bucket, "short", _once(b"tiny")))
    assert run(store.get(bucket, "stream")).data == data
    assert run(store.get(bucket, "short")).data == b"tiny"


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def test_read_range_scatters_into_segments(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    data = pattern(4096)
    run(store.put(bucket, "r", data))
    first, second, overlap = bytearray(100), bytearray(50), bytearray(20)
    segments = [
        (1000, memoryview(first)),
        (1300, memoryview(second)),
        (1090, memoryview(overlap)),
    ]

    async def read() -> None:
        async with store.slot():
            await store.read_range(bucket, "r", 1000, 1350, segments)

    run(read())
    assert first == data[1000:1100] and second == data[1300:1350] and overlap == data[1090:1110]


def test_read_range_checks_what_it_streams(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    data = pattern(3000)
    checks = frames_of(data, 1000)
    run(store.put(bucket, "r", data))
    target = bytearray(2000)

    async def read(key: str) -> None:
        async with store.slot():
            check = checks.check(1000)
            await store.read_range(bucket, key, 1000, 3000, [(1000, memoryview(target))], check)

    run(read("r"))
    assert target == data[1000:]
    damaged = bytearray(data)
    damaged[2500] ^= 0xFF
    run(store.put(bucket, "damaged", bytes(damaged)))
    with pytest.raises(ChecksumMismatch) as mismatch:
        run(read("damaged"))
    assert (mismatch.value.start, mismatch.value.end, mismatch.value.key) == (2000, 3000, "damaged")
    run(store.put(bucket, "short", data[:2500]))
    with pytest.raises(StorageError) as short:
        run(read("short"))
    assert short.value.code == "SizeMismatch"


def test_read_frames_hands_over_each_checked_frame_in_order(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    data = pattern(5000, seed=9)
    checks = frames_of(data, 1000)
    run(store.put(bucket, "f", data))
    got: list[tuple[int, bytes]] = []

    async def read(key: str) -> None:
        async with store.slot():
            await store.read_frames(
                bucket, key, checks, range(1, 4), lambda n, b: got.append((n, b))
            )

    run(read("f"))
    assert got == [(n, data[n * 1000 : (n + 1) * 1000]) for n in (1, 2, 3)]
    damaged = bytearray(data)
    damaged[3100] ^= 1
    run(store.put(bucket, "bad", bytes(damaged)))
    got.clear()
    with pytest.raises(ChecksumMismatch):
        run(read("bad"))
    assert [n for n, _ in got] == [1, 2]  # the frames before the damaged one were handed over


def test_uploads_in_progress_can_be_listed_and_aborted(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    s3.client.create_multipart_upload(Bucket=bucket, Key="u/left")
    (upload,) = run(store.list_uploads(bucket, "u/"))
    assert upload.key == "u/left"
    s3.client.upload_part(
        Bucket=bucket, Key="u/left", UploadId=upload.upload_id, PartNumber=1, Body=b"p" * 100
    )
    assert [(p.number, p.size) for p in run(store.list_parts(bucket, upload))] == [(1, 100)]
    assert run(store.list_uploads(bucket, "v/")) == []
    assert run(store.abort(bucket, upload)) is True
    assert run(store.list_uploads(bucket, "u/")) == []
    assert run(store.list_parts(bucket, upload)) == []
    run(store.abort(bucket, upload))  # gone already: no error (SeaweedFS cannot say False)
    assert run(store.head(bucket, "u/left")) is None


def test_buckets_are_created_once(s3: S3Env, bucket: str) -> None:
    store = store_of(s3)
    run(store.create_bucket(bucket))  # already there: no error
    name = bucket + "-2"
    run(store.create_bucket(name))
    run(store.check_bucket(name))
    run(store.delete_bucket(name))
    with pytest.raises(BucketNotFound):
        run(store.check_bucket(name))


def test_received_bytes_are_counted(s3: S3Env, bucket: str) -> None:
    store = store_of(s3, max_concurrency=3)  # a config of its own: its own counters
    run(store.put(bucket, "k", b"x" * 1234))
    before = store.stats.bytes_received
    run(store.get(bucket, "k"))
    assert store.stats.bytes_received - before == 1234

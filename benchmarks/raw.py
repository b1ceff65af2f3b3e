"""The raw ceiling: the same bytes moved by the thinnest aiobotocore code that can move them.

The client is built from the same `S3Config` as s3ckpt's (its botocore options and client
arguments), objects are cut like s3ckpt cuts them (up to 4, multipart above the threshold, same
part size) and data requests share one semaphore of the same size. No s3ckpt code sits on the data
path, so s3ckpt's time over this is its own overhead; this over the wire is botocore's and the
server's. Bodies go to aiohttp as plain memoryviews, as any aiobotocore user sends them (s3ckpt's
`engine.bodies` sends them in slices, which on Python < 3.12.9 saves two copies per part: s3ckpt
can use less CPU than this client). Both sign with UNSIGNED-PAYLOAD (no SHA-256 of the body).
Also used for the benchmark's housekeeping (bucket, clean-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from contextlib import AsyncExitStack
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import ClientError

from s3ckpt.config import S3Config

__all__ = ["RawClient", "object_ranges"]

_MAX_PARTS = 10_000
_OBJECTS_PER_RANK = 4  # S3Writer's default objects_per_rank


def object_ranges(total: int, part_size: int) -> list[tuple[int, int]]:
    """Split ``total`` bytes into as many equal objects as s3ckpt's packing would use."""
    count = max(1, min(_OBJECTS_PER_RANK, total // part_size))
    bounds = [total * i // count for i in range(count + 1)]
    return list(itertools.pairwise(bounds))


class RawClient:
    """One aiobotocore S3 client, configured exactly as s3ckpt configures its own."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.resolved = config.resolve()
        self.requests = 0
        self._stack = AsyncExitStack()
        self._client: Any = None

    async def __aenter__(self) -> RawClient:
        session = get_session()
        if self.resolved.profile:
            session.set_config_variable("profile", self.resolved.profile)
        creator = session.create_client(
            "s3",
            config=AioConfig(**self.resolved.botocore_options()),
            **self.resolved.client_kwargs(),
        )
        self._client = await self._stack.enter_async_context(creator)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _call(self, operation: str, **params: Any) -> Any:
        self.requests += 1
        return await getattr(self._client, operation)(**params)

    async def ensure_bucket(self, bucket: str) -> None:
        try:
            await self._call("head_bucket", Bucket=bucket)
        except ClientError:
            await self._call("create_bucket", Bucket=bucket)

    async def upload(self, bucket: str, objects: dict[str, memoryview]) -> float:
        """Upload every object concurrently; seconds from first request to last completion."""
        slots = asyncio.Semaphore(self.config.max_concurrency)
        started = time.perf_counter()
        await asyncio.gather(*(self._upload_one(bucket, k, v, slots) for k, v in objects.items()))
        return time.perf_counter() - started

    async def _upload_one(
        self, bucket: str, key: str, view: memoryview, slots: asyncio.Semaphore
    ) -> None:
        if len(view) <= self.config.multipart_threshold:
            async with slots:
                await self._call("put_object", Bucket=bucket, Key=key, Body=view)
            return
        created = await self._call("create_multipart_upload", Bucket=bucket, Key=key)
        upload_id = created["UploadId"]
        part_size = max(self.config.part_size, math.ceil(len(view) / _MAX_PARTS))

        async def part(number: int, start: int) -> dict[str, Any]:
            async with slots:
                reply = await self._call(
                    "upload_part",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=view[start : start + part_size],
                )
            return {"PartNumber": number, "ETag": reply["ETag"]}

        try:
            parts = await asyncio.gather(
                *(part(n, s) for n, s in enumerate(range(0, len(view), part_size), 1))
            )
            await self._call(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await self._call(
                    "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id
                )
            raise

    async def download(self, bucket: str, objects: dict[str, memoryview]) -> float:
        """Ranged GETs of part_size bytes straight into the views; seconds for all of them."""
        slots = asyncio.Semaphore(self.config.max_concurrency)
        step = self.config.part_size

        async def fetch(key: str, start: int, sink: memoryview) -> None:
            async with slots:
                reply = await self._call(
                    "get_object",
                    Bucket=bucket,
                    Key=key,
                    Range=f"bytes={start}-{start + len(sink) - 1}",
                )
                filled = await _drain(reply["Body"], sink)
            if filled != len(sink):
                raise RuntimeError(f"{key} at {start}: got {filled} of {len(sink)} bytes")

        started = time.perf_counter()
        await asyncio.gather(
            *(
                fetch(key, start, view[start : start + step])
                for key, view in objects.items()
                for start in range(0, len(view), step)
            )
        )
        return time.perf_counter() - started

    async def delete_prefix(self, bucket: str, prefix: str) -> int:
        """Remove every object and unfinished upload under ``prefix``; returns objects deleted."""
        keys: list[str] = []
        token: dict[str, str] = {}
        while True:
            page = await self._call("list_objects_v2", Bucket=bucket, Prefix=prefix, **token)
            keys += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                break
            token = {"ContinuationToken": page["NextContinuationToken"]}
        uploads = await self._call("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        slots = asyncio.Semaphore(self.config.max_concurrency)

        async def bounded(operation: str, **params: Any) -> None:
            async with slots:
                await self._call(operation, Bucket=bucket, **params)

        # One DeleteObject per key: DeleteObjects needs a Content-MD5 some servers insist on.
        await asyncio.gather(
            *(bounded("delete_object", Key=k) for k in keys),
            *(
                bounded("abort_multipart_upload", Key=u["Key"], UploadId=u["UploadId"])
                for u in uploads.get("Uploads", [])
            ),
        )
        return len(keys)


async def _drain(body: Any, sink: memoryview) -> int:
    """Copy a response body into ``sink`` once, taking aiohttp's buffered chunks as they are."""
    filled = 0
    async with body:
        stream = getattr(getattr(body, "raw_stream", None), "content", None)
        while filled < len(sink):
            if stream is not None:
                chunk = await stream.readany()
            else:  # a non-aiohttp backend
                chunk = await body.read(min(1 << 20, len(sink) - filled))
            if not chunk:
                break
            sink[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
    return filled

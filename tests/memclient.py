"""A boto3-shaped backdoor into a `MemoryStore`: the calls the tests make through ``S3Env.client``
(put, get, list, multipart uploads in progress, deletes), answered from the store's own state,
so a test written against a real server runs unchanged on the memory store. Missing buckets
and keys raise botocore's ``ClientError`` with S3's codes, as boto3 does."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from botocore.exceptions import ClientError

from s3ckpt.engine.contract import Upload
from s3ckpt.engine.memory import MemoryStore
from s3ckpt.errors import BucketNotFound, ObjectNotFound, StorageError

T = TypeVar("T")


class _Exceptions:
    NoSuchKey = ClientError
    NoSuchBucket = ClientError
    ClientError = ClientError


def _client_error(error: StorageError, operation: str) -> ClientError:
    status = error.status or 500
    response: Any = {
        "Error": {"Code": error.code or "InternalError", "Message": str(error)},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, operation)


class MemoryClient:
    """The subset of boto3's S3 client the tests use, over ``store``."""

    exceptions = _Exceptions

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def _run(self, operation: str, call: Coroutine[Any, Any, T]) -> T:
        try:
            return asyncio.run(call)
        except StorageError as e:
            raise _client_error(e, operation) from None

    def create_bucket(self, Bucket: str, **_: Any) -> dict[str, Any]:
        return self._run("CreateBucket", self.store.create_bucket(Bucket)) or {}

    def delete_bucket(self, Bucket: str) -> dict[str, Any]:
        self._run("DeleteBucket", self.store.delete_bucket(Bucket))
        return {}

    def head_bucket(self, Bucket: str) -> dict[str, Any]:
        self._run("HeadBucket", self.store.check_bucket(Bucket))
        return {}

    def list_buckets(self) -> dict[str, Any]:
        return {"Buckets": [{"Name": name} for name in self.store.buckets()]}

    def put_object(
        self, Bucket: str, Key: str, Body: bytes | str = b"", **_: Any
    ) -> dict[str, Any]:
        data = Body.encode() if isinstance(Body, str) else bytes(Body)
        self._run("PutObject", self.store.put(Bucket, Key, data))
        return {"ETag": self._head(Bucket, Key)["ETag"]}

    def _head(self, Bucket: str, Key: str) -> dict[str, Any]:
        found = self._run("HeadObject", self.store.head(Bucket, Key))
        if found is None:
            missing = ObjectNotFound("no such key", bucket=Bucket, key=Key, code="404", status=404)
            raise _client_error(missing, "HeadObject")
        return {"ContentLength": found.size, "ETag": found.etag, "LastModified": found.modified}

    def head_object(self, Bucket: str, Key: str, **_: Any) -> dict[str, Any]:
        return self._head(Bucket, Key)

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        try:
            data = self.store.objects(Bucket)[Key]
        except BucketNotFound as e:
            raise _client_error(e, "GetObject") from None
        except KeyError:
            missing = ObjectNotFound("no such key", bucket=Bucket, key=Key, code="NoSuchKey")
            raise _client_error(missing, "GetObject") from None
        if Range is not None:
            first, _, last = Range.removeprefix("bytes=").partition("-")
            data = data[int(first) : int(last) + 1]
        head = self._head(Bucket, Key)
        return {**head, "ContentLength": len(data), "Body": io.BytesIO(data)}

    def delete_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        self._run("DeleteObject", self.store.delete(Bucket, [Key]))
        return {}

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:
        keys = [o["Key"] for o in Delete["Objects"]]
        self._run("DeleteObjects", self.store.delete(Bucket, keys))
        return {"Deleted": [{"Key": key} for key in keys]}

    def list_objects_v2(
        self, Bucket: str, Prefix: str = "", Delimiter: str | None = None, **_: Any
    ) -> dict[str, Any]:
        listing = self._run(
            "ListObjectsV2", self.store.list_objects(Bucket, Prefix, delimiter=bool(Delimiter))
        )
        page: dict[str, Any] = {"KeyCount": len(listing.objects) + len(listing.prefixes)}
        if listing.objects:
            page["Contents"] = [
                {"Key": o.key, "Size": o.size, "LastModified": o.modified} for o in listing.objects
            ]
        if listing.prefixes:
            page["CommonPrefixes"] = [{"Prefix": p} for p in listing.prefixes]
        return page

    def create_multipart_upload(self, Bucket: str, Key: str, **_: Any) -> dict[str, Any]:
        try:
            upload = self.store.start_upload(Bucket, Key)
        except StorageError as e:
            raise _client_error(e, "CreateMultipartUpload") from None
        return {"UploadId": upload.upload_id, "Key": Key}

    def _upload(self, Bucket: str, Key: str, UploadId: str) -> Upload:
        for upload in self._run("ListMultipartUploads", self.store.list_uploads(Bucket, Key)):
            if upload.upload_id == UploadId:
                return upload
        gone = ObjectNotFound("no such upload", bucket=Bucket, key=Key, code="NoSuchUpload")
        raise _client_error(gone, "UploadPart")

    def upload_part(
        self, Bucket: str, Key: str, UploadId: str, PartNumber: int, Body: bytes, **_: Any
    ) -> dict[str, Any]:
        self.store.upload_part(Bucket, self._upload(Bucket, Key, UploadId), PartNumber, Body)
        return {"ETag": f'"part-{PartNumber}"'}

    def list_parts(self, Bucket: str, Key: str, UploadId: str) -> dict[str, Any]:
        parts = self._run(
            "ListParts", self.store.list_parts(Bucket, self._upload(Bucket, Key, UploadId))
        )
        return {"Parts": [{"PartNumber": p.number, "Size": p.size} for p in parts]}

    def list_multipart_uploads(self, Bucket: str, Prefix: str = "", **_: Any) -> dict[str, Any]:
        uploads = self._run("ListMultipartUploads", self.store.list_uploads(Bucket, Prefix))
        found = [{"Key": u.key, "UploadId": u.upload_id, "Initiated": u.initiated} for u in uploads]
        return {"Uploads": found} if found else {}

    def abort_multipart_upload(self, Bucket: str, Key: str, UploadId: str) -> dict[str, Any]:
        self._run(
            "AbortMultipartUpload", self.store.abort(Bucket, self._upload(Bucket, Key, UploadId))
        )
        return {}

    def get_paginator(self, name: str) -> _Paginator:
        return _Paginator(getattr(self, name))


class _Paginator:
    """Everything on one page: the memory store has no page limit to honour."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def paginate(self, **params: Any) -> Iterator[dict[str, Any]]:
        yield self._call(**params)

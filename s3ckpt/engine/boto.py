"""aiobotocore clients on the private loop, and the one place botocore errors become ours."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ssl
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import botocore.exceptions
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from ..config import ResolvedConfig
from ..errors import (
    AccessDenied,
    BucketNotFound,
    EndpointUnreachable,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
)
from . import bridge, redact

__all__ = ["ClientHolder", "map_error"]

_ACCESS_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "403",
}
_TRUNCATED = (
    aiohttp.ClientPayloadError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
)
_UNREACHABLE = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectionClosedError,
    aiohttp.ClientConnectionError,
    asyncio.TimeoutError,
)


class ClientHolder:
    """One lazily created S3 client per configuration and endpoint, closed at interpreter exit."""

    def __init__(self, resolved: ResolvedConfig, endpoint_url: str | None) -> None:
        self.resolved = resolved
        self.endpoint_url = endpoint_url
        self._client: Any = None
        self._lock: asyncio.Lock | None = None
        self._stack = AsyncExitStack()

    async def get(self) -> Any:
        if self._client is not None:
            return self._client
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is None:
                session = get_session()
                if self.resolved.profile:
                    session.set_config_variable("profile", self.resolved.profile)
                config = AioConfig(**self.resolved.botocore_options())
                creator = session.create_client(
                    "s3", config=config, **self.resolved.client_kwargs(self.endpoint_url)
                )
                client = await self._stack.enter_async_context(creator)
                client.meta.events.register("before-call.s3.DeleteObjects", _add_content_md5)
                credentials = client._get_credentials()
                if credentials is not None:
                    frozen = await credentials.get_frozen_credentials()
                    redact.install([frozen.secret_key, frozen.token])
                bridge.on_shutdown(self._stack.aclose)
                self._client = client
        return self._client

    async def prepare(self) -> None:
        """Make the client and its HTTP session (connection pool, TLS contexts: loading the CA
        bundle takes ~0.1 s of CPU) now, sending nothing, so that the first request does not."""
        client = await self.get()
        endpoint = client._endpoint
        # aiobotocore makes the session on the first request, keyed by its proxy (if any).
        session: Any = getattr(endpoint, "http_session", None)
        if hasattr(session, "_get_session"):
            await session._get_session(session._proxy_config.proxy_url_for(endpoint.host))


def _add_content_md5(params: dict[str, Any], **_: Any) -> None:
    # Several S3 implementations still insist on Content-MD5 for DeleteObjects.
    body = params["body"]
    if isinstance(body, bytes | bytearray):
        digest = hashlib.md5(body, usedforsecurity=False).digest()
        params["headers"]["Content-MD5"] = base64.b64encode(digest).decode()


def map_error(
    exc: BaseException, *, endpoint: str, bucket: str, key: str | None, operation: str
) -> StorageError:
    """Translate a botocore/aiohttp failure into the most specific s3ckpt error.

    The message names operation, ``s3://bucket/key``, endpoint and cause; never credentials.
    """
    if isinstance(exc, StorageError):
        return exc
    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"

    def typed(
        kind: type[StorageError], message: str, code: str, status: int | None
    ) -> StorageError:
        return kind(
            message,
            endpoint=endpoint,
            bucket=bucket,
            key=key,
            operation=operation,
            code=code,
            status=status,
        )

    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code") or "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        detail = error.get("Message") or code or "no error message"
        message = (
            f"{operation} {where} at {endpoint} failed: {code or 'HTTP ' + str(status)} ({detail})"
        )
        if code == "NoSuchBucket" or (status == 404 and key is None):
            missing = (
                f"bucket {bucket!r} does not exist at {endpoint} ({operation} {where}); "
                f"create it with `s3ckpt mb s3://{bucket}` (or your storage's console)"
            )
            return typed(BucketNotFound, missing, code, status)
        if code in ("NoSuchKey", "NotFound") or (status == 404 and key is not None):
            return typed(ObjectNotFound, message, code, status)
        if code in _ACCESS_CODES or status == 403:
            advice = "; check the credentials and the bucket policy"
            return typed(AccessDenied, message + advice, code, status)
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
            return typed(PreconditionFailed, message, code, status)
        return typed(StorageError, message, code, status)
    name = type(exc).__name__
    if isinstance(
        exc, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError
    ):
        message = (
            f"{operation} {where} at {endpoint}: no AWS credentials found (set AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or pass them in S3Config)"
        )
        return typed(AccessDenied, message, name, None)
    if isinstance(exc, botocore.exceptions.SSLError | ssl.SSLError) or _is_tls(exc):
        message = (
            f"{operation} {where}: TLS verification with {endpoint} failed ({_cause(exc)}); "
            "set S3Config(ca_bundle=...) or AWS_CA_BUNDLE to the CA that signed its certificate"
        )
        return typed(EndpointUnreachable, message, "SSLError", None)
    if isinstance(exc, _TRUNCATED):
        message = f"{operation} {where} at {endpoint}: the response broke off ({_cause(exc)})"
        return typed(StorageError, message, "Truncated", None)
    if isinstance(exc, _UNREACHABLE):
        message = f"{operation} {where}: connection to {endpoint} failed ({_cause(exc)})"
        return typed(EndpointUnreachable, message, name, None)
    message = f"{operation} {where} at {endpoint} failed: {_cause(exc)}"
    return typed(StorageError, message, name, None)


def _is_tls(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):  # cause chains are short; never loop on a cycle
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError | aiohttp.ClientSSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _cause(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text

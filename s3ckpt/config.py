"""Settings: how to reach the object store (`S3Config`, shared by the writer, the reader and the
tools) and how a save lays out its bytes (`WriteOptions`).

`S3Config` holds what the caller chose; anything left as ``None`` comes from the standard AWS
sources when a connection is made (`S3Config.resolve`), so a config pickled into a PROCESS-mode
checkpointer resolves in the process that does the I/O. Precedence, highest first:

===============  =============================================================================
endpoint         argument (one URL, or several: requests rotate over them), ``AWS_ENDPOINT_URL_S3``,
                 ``AWS_ENDPOINT_URL``, profile ``endpoint_url``
region           argument, ``AWS_REGION``, ``AWS_DEFAULT_REGION``, profile ``region``, us-east-1
credentials      arguments, then botocore's chain (``AWS_ACCESS_KEY_ID`` …, profile, IMDS, …)
profile          argument, ``AWS_PROFILE`` / ``AWS_DEFAULT_PROFILE``
TLS              ``verify=False`` disables; else argument ``ca_bundle``, ``AWS_CA_BUNDLE``, profile
                 ``ca_bundle``, system trust store
addressing       ``path`` when an endpoint is configured (what on-premise stores expect), else
                 ``virtual``; set ``addressing_style`` to force one
===============  =============================================================================

Checksums are never left to botocore's defaults (which add a CRC32 to every request and break
several S3-compatible stores): botocore only computes what an operation strictly requires.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ConfigError

__all__ = ["MiB", "ResolvedConfig", "S3Config", "WriteOptions", "parse_s3_url"]

MiB = 1024 * 1024
_MIN_PART = 5 * MiB  # S3's minimum for every part but the last
_MAX_PART = 5 * 1024 * MiB
_ADDRESSING = ("auto", "path", "virtual")


@dataclass(frozen=True)
class S3Config:
    """How to reach the object store, and how hard to push it.

    ``part_size x max_concurrency`` bounds the bytes held by in-flight requests per process.
    A request that fails transiently is retried for ``retry_timeout`` seconds (capped backoff, see
    `s3ckpt.engine.retry`): a store restarting or shedding load for a few seconds costs time, not
    the save; ``max_attempts`` caps the attempts as well (``None``: as many as fit). Every attempt
    must be answered within ``connect_timeout + read_timeout`` of being sent, plus its request
    body at ``min_read_rate`` (an UploadPart of 16 MiB: 16 s more): aiohttp's own read timeout
    restarts with every byte, so a server dribbling its answer would hold the request for ever.
    For a GET that bounds the response head; its body must then arrive at ``min_read_rate`` or
    better, with one ``read_timeout`` to spare, or the attempt is cut and resumed where it got (a
    third cut fails it). An attempt past its deadline fails transiently (``StorageError``, code
    ``ResponseTimeout``), retried while the window lasts (with the defaults it does not: the 65 s
    deadline outlasts the 60 s window), so a store that stays down, silent or dribbling, fails a
    request after ``retry_timeout`` plus one attempt's deadline. ``first_contact_timeout``, when
    set, is the window instead until the store has answered once (any HTTP answer): the CLI sets
    5 s, so that a mistyped or dead endpoint fails a command within seconds, while a training
    job keeps the whole window (its store may be restarting as the job starts). The first retry
    of a window logs one WARNING naming the endpoint, the cause and how long retries go on.
    ``checksum`` is what uploads carry so that the server refuses damaged bytes (see
    `s3ckpt.engine.wire`; ``auto`` asks each bucket once).
    ``max_record_size`` is the largest commit record (``.metadata``) a load or a tool will read:
    a larger one is refused with MetadataError before its bytes are downloaded, and so is one
    whose compressed item table would inflate to more (refused before it is inflated).
    ``adapt_to_throttling``: once the store answers 503 ``SlowDown``, 429 or another throttling
    code, send fewer requests at once (from 0.7 x those in flight, growing back by one per round
    trip up to ``max_concurrency``) and pace them (from 0.7 x the rate sent, growing back as the
    AWS SDKs' adaptive mode does), so that a throttled save runs near the rate the store admits
    instead of drawing a storm of refusals (`s3ckpt.engine.throttle`). Both limits lift once
    they have grown back without another such answer, and a store that never throttles is
    never limited; ``False`` only retries, as before.
    """

    endpoint_url: str | tuple[str, ...] | None = None
    region: str | None = None
    profile: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    verify: bool = True
    ca_bundle: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    max_attempts: int | None = None
    retry_timeout: float = 60.0
    first_contact_timeout: float | None = None
    # 1 MiB/s, with the read_timeout of slack on top: a GET of a 16 MiB part is cut only after
    # 76 s, so only below about 220 KB/s (a 100 Mbit/s link shared by the 16 default streams
    # still gives each 780 KB/s). What it cuts is a trickle (a failing disk or proxy) that
    # aiohttp's per-read timeout never ends: 8 MB at 4 KiB/s is cut at 68 s. A cut costs a
    # request, not progress: the retry resumes at the first missing byte (frame when checked).
    # A request body goes out at this rate too: an UploadPart of 16 MiB is answered within 81 s.
    min_read_rate: float = 1 * MiB
    part_size: int = 16 * MiB
    multipart_threshold: int = 16 * MiB
    max_concurrency: int = 16
    checksum: Literal["auto", "crc32c", "md5", "off"] = "auto"
    # Measured: a record took 326 bytes per one-chunk tensor and ~135 per further chunk (100k
    # tensors: 33 MB) before format version 3, and decoding holds 3-4x its size (`record.decode`:
    # at most 10x, whatever it holds). So 256 MiB is some 800k tensors or 2M chunks, ~1 GB to
    # decode on every rank (2.5 GiB at most); a hostile or runaway record over it costs nothing
    # (refused before its download). Version 3 takes 1-8 bytes per further chunk (`bench_record`)
    # and its table inflates to 56 per chunk, which this also bounds: some 4.8M chunks.
    max_record_size: int = 256 * MiB
    adapt_to_throttling: bool = True

    def __post_init__(self) -> None:
        if self.addressing_style not in _ADDRESSING:
            raise ConfigError(
                f"addressing_style must be one of {_ADDRESSING}, got {self.addressing_style!r}"
            )
        if not _MIN_PART <= self.part_size <= _MAX_PART:
            raise ConfigError(
                f"part_size must be between 5 MiB and 5 GiB, got {self.part_size} bytes"
            )
        if self.multipart_threshold < 0:
            raise ConfigError(f"multipart_threshold must be >= 0, got {self.multipart_threshold}")
        if self.checksum not in ("auto", "crc32c", "md5", "off"):
            raise ConfigError(f"checksum must be auto, crc32c, md5 or off, got {self.checksum!r}")
        if self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be None or >= 1, got {self.max_attempts}")
        if self.retry_timeout <= 0:
            raise ConfigError(f"retry_timeout must be > 0 seconds, got {self.retry_timeout}")
        if self.first_contact_timeout is not None and self.first_contact_timeout <= 0:
            raise ConfigError(
                f"first_contact_timeout must be None or > 0 seconds, got "
                f"{self.first_contact_timeout}"
            )
        if self.min_read_rate <= 0:
            raise ConfigError(f"min_read_rate must be > 0 bytes/s, got {self.min_read_rate}")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ConfigError("connect_timeout and read_timeout must be > 0 seconds")
        if self.max_record_size < 1:
            raise ConfigError(f"max_record_size must be >= 1 byte, got {self.max_record_size}")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError("access_key_id and secret_access_key must be given together")
        if isinstance(self.endpoint_url, list | tuple):
            if not self.endpoint_url:
                raise ConfigError("endpoint_url: give at least one URL")
            object.__setattr__(self, "endpoint_url", tuple(self.endpoint_url))
        if isinstance(self.endpoint_url, str) and self.endpoint_url.startswith("memory://"):
            return  # this process's `s3ckpt.engine.memory.MemoryStore` of that name
        for url in _urls(self.endpoint_url):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"endpoint_url must start with http:// or https:// (or be memory://NAME), "
                    f"got {url!r}"
                )

    def resolve(self, environ: dict[str, str] | None = None) -> ResolvedConfig:
        """Fill the gaps from the environment and the AWS config files, as the table above says."""
        env = os.environ if environ is None else environ
        profile = self.profile or env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
        scoped = _profile_settings(profile)
        ignore_configured = env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true"
        endpoint = self.endpoint_url
        if endpoint is None and not ignore_configured:
            endpoint = (
                env.get("AWS_ENDPOINT_URL_S3")
                or env.get("AWS_ENDPOINT_URL")
                or _profile_endpoint(scoped)
            )
        region = (
            self.region
            or env.get("AWS_REGION")
            or env.get("AWS_DEFAULT_REGION")
            or scoped.get("region")
            or "us-east-1"
        )
        style = self.addressing_style
        if style == "auto":
            style = "path" if endpoint else "virtual"
        verify: bool | str = False
        if self.verify:
            verify = self.ca_bundle or env.get("AWS_CA_BUNDLE") or scoped.get("ca_bundle") or True
        if isinstance(verify, str) and not os.path.isfile(verify):
            raise ConfigError(f"CA bundle {verify!r} does not exist or is not a file")
        return ResolvedConfig(
            config=self,
            endpoint_urls=tuple(url.rstrip("/") for url in _urls(endpoint)),
            region=region,
            profile=profile,
            addressing_style=style,
            verify=verify,
        )


@dataclass(frozen=True)
class WriteOptions:
    """How `S3Writer` lays a checkpoint's bytes out in the store; any reader loads any choice.

    ``objects_per_rank``: most data objects one rank writes (more objects upload in parallel).
    ``frame_size``: bytes per checksummed frame; a partial load reads whole frames.
    ``spread_keys``: put a short hash early in data keys, spreading a save's requests over many
    key ranges (for stores that limit request rates per prefix, like AWS S3).
    ``compression``: ``"zstd"`` compresses each frame on its own (worker threads, overlapping
    the upload), so ranged loads still decode only the frames they need; ``compression_level``
    is zstd's level; ``shuffle`` groups bytes of equal significance of floating-point elements
    first, which compresses weights and optimizer states better.
    """

    objects_per_rank: int = 4
    frame_size: int = 4 * MiB
    spread_keys: bool = False
    compression: Literal["zstd"] | None = None
    compression_level: int = 1
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.objects_per_rank < 1:
            raise ConfigError(f"objects_per_rank must be >= 1, got {self.objects_per_rank}")
        if self.frame_size < 4096:
            raise ConfigError(f"frame_size must be at least 4096 bytes, got {self.frame_size}")
        if self.compression not in (None, "zstd"):
            raise ConfigError(f"compression must be None or 'zstd', got {self.compression!r}")
        if self.compression is not None and importlib.util.find_spec("zstandard") is None:
            raise ConfigError("compression='zstd' needs zstandard: pip install 's3ckpt[zstd]'")


@dataclass(frozen=True)
class ResolvedConfig:
    """An `S3Config` with every source consulted; what a client is built from."""

    config: S3Config
    endpoint_urls: tuple[str, ...]
    region: str
    profile: str | None
    addressing_style: str
    verify: bool | str

    @property
    def endpoint_url(self) -> str | None:
        """The first endpoint (``None``: AWS S3's regional endpoint)."""
        return self.endpoint_urls[0] if self.endpoint_urls else None

    @property
    def endpoint_name(self) -> str:
        """The endpoint(s) as error messages show them."""
        return ", ".join(self.endpoint_urls) or f"AWS S3 ({self.region})"

    def client_kwargs(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """Arguments for ``session.create_client("s3", ...)``, except ``config``."""
        c = self.config
        kwargs: dict[str, Any] = {
            "region_name": self.region,
            "endpoint_url": endpoint_url or self.endpoint_url,
            "verify": self.verify,
        }
        if c.access_key_id is not None:
            kwargs["aws_access_key_id"] = c.access_key_id
            kwargs["aws_secret_access_key"] = c.secret_access_key
            kwargs["aws_session_token"] = c.session_token
        return kwargs

    def botocore_options(self) -> dict[str, Any]:
        """Keyword arguments for botocore's ``Config``: explicit checksums, timeouts, pool size."""
        c = self.config
        return {
            "signature_version": "s3v4",
            "s3": {"addressing_style": self.addressing_style, "payload_signing_enabled": False},
            "connect_timeout": c.connect_timeout,
            "read_timeout": c.read_timeout,
            # s3ckpt retries (see retry.py); botocore's own retries would multiply the attempts.
            "retries": {"mode": "standard", "total_max_attempts": 1},
            "max_pool_connections": c.max_concurrency + 4,
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
            "tcp_keepalive": True,
            # Only s3ckpt calls this client; no validation lets memoryview bodies through.
            "parameter_validation": False,
            "user_agent_extra": "s3ckpt",
        }


def _urls(endpoint: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if endpoint is None:
        return ()
    return (endpoint,) if isinstance(endpoint, str) else tuple(endpoint)


def _profile_settings(profile: str | None) -> dict[str, Any]:
    import botocore.exceptions  # here: `s3ckpt --version` and `import s3ckpt` need no botocore
    import botocore.session

    session = botocore.session.Session(profile=profile)
    try:
        return dict(session.get_scoped_config())
    except botocore.exceptions.ProfileNotFound as e:
        raise ConfigError(f"AWS profile {profile!r} is not in the AWS config files") from e


def _profile_endpoint(scoped: dict[str, Any]) -> str | None:
    s3_section = scoped.get("s3")
    if isinstance(s3_section, dict) and s3_section.get("endpoint_url"):
        return str(s3_section["endpoint_url"])
    endpoint = scoped.get("endpoint_url")
    return str(endpoint) if endpoint else None


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b")``: no slashes at the prefix's ends."""
    if not url.startswith("s3://"):
        raise ConfigError(f"expected an s3://bucket/prefix URL, got {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise ConfigError(f"no bucket in {url!r}")
    return bucket, prefix.strip("/")

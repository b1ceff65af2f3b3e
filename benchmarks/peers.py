"""The systems compared by `bench_peers`, and the workloads they save and load.

An adapter gives DCP a storage writer and reader for one system and names its checkpoints; it
knows nothing about timing. Peers are configured through the environment the parent sets for
each child (``AWS_ENDPOINT_URL``, keys, ``FSSPEC_S3_ENDPOINT_URL``) because that is the only way
s3torchconnector takes an endpoint, and because ``FsspecWriter.reset(checkpoint_id)`` drops the
storage options given to its constructor.

Workloads (all seeded random, checkable bit for bit by regenerating one tensor at a time):
    large    `workload.state_specs`: ~150 transformer-like tensors of the requested size
    small    many fp32 vectors of 4 KiB to 1 MiB: 4 KiB x 256**(u**10), u equidistributed, so
             81% are under 8 KiB and ~3% over 256 KiB; 20,000 of them are 518 MiB
    reshard  the large state saved by 2 ranks (gloo) as DTensor Shard(0), loaded by 1 process
             into full tensors
    partial  one layer's tensors (model and Adam moments of ``layers.0``) loaded from the
             large checkpoint
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import (
    FileSystemReader,
    FileSystemWriter,
    StorageReader,
    StorageWriter,
)

from s3ckpt import S3Reader, S3Writer
from s3ckpt.config import MiB, S3Config

from .workload import TensorSpec, state_specs, tensor_of

__all__ = [
    "PEERS",
    "S3_SYSTEMS",
    "SYSTEMS",
    "WORKLOADS",
    "Adapter",
    "Target",
    "adapter",
    "expected",
    "peer_env",
    "small_specs",
    "workload_specs",
]

S3_SYSTEMS = ("s3ckpt", "s3ckpt-tuned", "s3torchconnector", "fsspec")
SYSTEMS = (*S3_SYSTEMS, "local", "raw")
PEERS = ("s3torchconnector", "fsspec", "local", "raw")
WORKLOADS = ("large", "small", "reshard", "partial")
_SMALL_MIN = 4096
_SMALL_SPAN = 256  # the largest is 256 x the smallest: 1 MiB
_SMALL_SKEW = 10
_GOLDEN = (math.sqrt(5) - 1) / 2
PARTIAL_PREFIX = "layers.0."


@dataclass(frozen=True)
class Target:
    """Where the systems write: one S3 endpoint (and bucket), or a local directory."""

    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    region: str
    bucket: str
    local_dir: str
    tuned_part_size: int
    tuned_concurrency: int

    def s3ckpt_config(self, tuned: bool) -> S3Config:
        """s3ckpt's defaults (plus where and who), or with the tuned part size and concurrency."""
        extra: dict[str, Any] = {}
        if tuned:
            extra = {
                "part_size": self.tuned_part_size,
                "multipart_threshold": self.tuned_part_size,
                "max_concurrency": self.tuned_concurrency,
            }
        return S3Config(
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
            **extra,
        )


def peer_env(target: Target) -> dict[str, str]:
    """Environment for a child: the peers find the endpoint and keys only here."""
    return {
        "AWS_ENDPOINT_URL": target.endpoint_url,
        "FSSPEC_S3_ENDPOINT_URL": target.endpoint_url,
        "AWS_ACCESS_KEY_ID": target.access_key_id,
        "AWS_SECRET_ACCESS_KEY": target.secret_access_key,
        "AWS_REGION": target.region,
        "AWS_DEFAULT_REGION": target.region,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class Adapter:
    """One system: its DCP writer and reader, and the checkpoint id of a prefix."""

    name = "?"

    def __init__(self, target: Target) -> None:
        self.target = target

    def checkpoint_id(self, prefix: str) -> str:
        return f"s3://{self.target.bucket}/{prefix}"

    def writer(self) -> StorageWriter:
        raise NotImplementedError

    def reader(self) -> StorageReader:
        raise NotImplementedError

    def client_requests(self) -> int | None:
        """Requests the system counted itself (s3ckpt only); a cross-check of the proxy."""
        return None

    def close(self, writer: StorageWriter) -> None:
        """Release what a writer keeps between saves."""


class S3ckptAdapter(Adapter):
    def __init__(self, target: Target, tuned: bool) -> None:
        super().__init__(target)
        self.name = "s3ckpt-tuned" if tuned else "s3ckpt"
        self.config = target.s3ckpt_config(tuned)

    def writer(self) -> StorageWriter:
        return S3Writer(self.target.bucket, config=self.config)

    def reader(self) -> StorageReader:
        return S3Reader(self.target.bucket, config=self.config)

    def client_requests(self) -> int | None:
        from s3ckpt.engine.store import get_store

        return get_store(self.config).stats.requests

    def close(self, writer: StorageWriter) -> None:
        if isinstance(writer, S3Writer):
            writer.close()


class S3TorchConnectorAdapter(Adapter):
    """AWS s3torchconnector: endpoint from ``AWS_ENDPOINT_URL``, path-style forced."""

    name = "s3torchconnector"

    def _config(self) -> Any:
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(force_path_style=True)

    def writer(self) -> StorageWriter:
        from s3torchconnector.dcp import S3StorageWriter

        writer: StorageWriter = S3StorageWriter(
            self.target.region, self.checkpoint_id("unused"), s3client_config=self._config()
        )
        return writer

    def reader(self) -> StorageReader:
        from s3torchconnector.dcp import S3StorageReader

        reader: StorageReader = S3StorageReader(
            self.target.region, self.checkpoint_id("unused"), s3client_config=self._config()
        )
        return reader


class FsspecAdapter(Adapter):
    """torch's FsspecWriter/Reader over s3fs; s3fs reads endpoint and keys from the env."""

    name = "fsspec"

    def writer(self) -> StorageWriter:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(self.checkpoint_id("unused"))

    def reader(self) -> StorageReader:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.checkpoint_id("unused"))


class LocalAdapter(Adapter):
    """torch's FileSystemWriter/Reader on local disk: the reference, not a peer."""

    name = "local"

    def checkpoint_id(self, prefix: str) -> str:
        return str(Path(self.target.local_dir) / prefix)

    def writer(self) -> StorageWriter:
        return FileSystemWriter(self.checkpoint_id("unused"))

    def reader(self) -> StorageReader:
        return FileSystemReader(self.checkpoint_id("unused"))


def adapter(system: str, target: Target) -> Adapter:
    if system in ("s3ckpt", "s3ckpt-tuned"):
        return S3ckptAdapter(target, tuned=system == "s3ckpt-tuned")
    classes: dict[str, type[Adapter]] = {
        "s3torchconnector": S3TorchConnectorAdapter,
        "fsspec": FsspecAdapter,
        "local": LocalAdapter,
    }
    if system not in classes:
        raise ValueError(f"no DCP adapter for {system!r}")
    return classes[system](target)


def small_specs(count: int) -> list[TensorSpec]:
    """``count`` fp32 vectors of 4 KiB to 1 MiB, mostly tiny (see the module docstring)."""
    specs = []
    for i in range(count):
        u = (i * _GOLDEN) % 1.0
        nbytes = int(_SMALL_MIN * _SMALL_SPAN ** (u**_SMALL_SKEW))
        specs.append(TensorSpec(f"small.{i:05d}", (nbytes // 4,), torch.float32))
    return specs


def workload_specs(workload: str, size_bytes: int, small_count: int) -> list[TensorSpec]:
    """Every tensor a workload's checkpoint holds (partial loads a subset: `load_subset`)."""
    if workload == "small":
        return small_specs(small_count)
    if workload in ("large", "reshard", "partial"):
        return state_specs(size_bytes)
    raise ValueError(f"unknown workload {workload!r}")


def load_subset(workload: str, specs: list[TensorSpec]) -> list[int]:
    """Indices of the tensors a load asks for: all of them, or one layer's for partial."""
    if workload == "partial":
        return [i for i, s in enumerate(specs) if f".{PARTIAL_PREFIX}" in s.name]
    return list(range(len(specs)))


def expected(specs: list[TensorSpec], index: int, seed: int) -> torch.Tensor:
    """The tensor a save wrote at ``index``: regenerated from the seed, as workload.py does."""
    return tensor_of(specs[index], index, seed)


def sharded_state(specs: list[TensorSpec], seed: int, mesh: Any) -> dict[str, Any]:
    """This rank's half of the state as DTensors (Shard(0)); 0-d tensors stay replicated."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    state: dict[str, Any] = {}
    for i, spec in enumerate(specs):
        full = tensor_of(spec, i, seed)
        if full.dim() == 0 or full.shape[0] < mesh.size():
            state[spec.name] = full
            continue
        # src_data_rank=None: each rank cuts its shard from its own copy, nothing is sent.
        local = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local()
        state[spec.name] = DTensor.from_local(  # a copy, so the full tensor can be freed
            local.clone(), mesh, [Shard(0)], shape=full.shape, stride=full.stride()
        )
    return state


def target_from_env(bucket: str, local_dir: str, tuned: tuple[int, int]) -> Target:
    """The child's `Target`, from the environment `peer_env` set."""
    return Target(
        endpoint_url=os.environ["AWS_ENDPOINT_URL"],
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ["AWS_REGION"],
        bucket=bucket,
        local_dir=local_dir,
        tuned_part_size=tuned[0] * MiB,
        tuned_concurrency=tuned[1],
    )

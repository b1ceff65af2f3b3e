"""`SafetensorsReader` on real servers: files the ``safetensors`` library wrote, exported sharded
directories, FSDP2 shards fetching only their byte ranges, adjacent ranges coalesced into few GETs
(and distant ones not), and the errors for what cannot load."""

from __future__ import annotations

import json
import math
import socket
import struct
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from s3ckpt import (
    CheckpointNotFound,
    MetadataError,
    S3Writer,
    SafetensorsReader,
    export_safetensors,
)
from s3ckpt.config import MiB
from s3ckpt.testing.faultproxy import FaultProxy
from tests import safetensors_workers
from tests.conftest import S3Env
from tests.helpers import spawn


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(8)
    return {
        "embed.weight": torch.randn(500, 64, generator=generator).bfloat16(),
        "layers.0.weight": torch.randn(64, 64, generator=generator),
        "layers.0.bias": torch.randn(64, generator=generator).half(),
        "position_ids": torch.arange(40, dtype=torch.int64),
        "scale": torch.tensor(1.5, dtype=torch.float64),
        "flags": torch.tensor([True, False, True]),
    }


def _empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(tensor) for name, tensor in state.items()}


def _same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name


def test_a_file_the_library_wrote_loads(s3: S3Env, bucket: str) -> None:
    state = _tensors()
    body = safetensors.torch.save(state, metadata={"format": "pt"})
    s3.client.put_object(Bucket=bucket, Key="hf/model.safetensors", Body=body)
    loaded = _empty_like(state)
    dcp.load(loaded, storage_reader=SafetensorsReader(bucket, "hf", config=s3.config()))
    _same(loaded, state)


def test_an_exported_sharded_directory_loads_partly_and_whole(s3: S3Env, bucket: str) -> None:
    state = _tensors()
    dcp.save({"model": state}, storage_writer=S3Writer(f"s3://{bucket}/ck", config=s3.config()))
    export_safetensors(
        f"s3://{bucket}/ck", f"s3://{bucket}/hf", s3.config(), select="model", max_shard_size="16KB"
    )
    index = json.loads(
        s3.client.get_object(Bucket=bucket, Key="hf/model.safetensors.index.json")["Body"].read()
    )
    assert len(set(index["weight_map"].values())) > 1
    reader = SafetensorsReader(f"s3://{bucket}/hf", config=s3.config())
    loaded = _empty_like(state)
    dcp.load(loaded, storage_reader=reader)
    _same(loaded, state)
    part = {"layers.0.weight": torch.zeros(64, 64)}
    dcp.load(part, storage_reader=reader)
    assert torch.equal(part["layers.0.weight"], state["layers.0.weight"])


def test_a_destination_of_another_dtype_is_refused_naming_the_tensor(
    s3: S3Env, bucket: str
) -> None:
    state = _tensors()
    s3.client.put_object(
        Bucket=bucket, Key="m/model.safetensors", Body=safetensors.torch.save(state)
    )
    loaded = _empty_like(state)
    loaded["embed.weight"] = torch.zeros(500, 64)  # float32, stored bfloat16
    with pytest.raises(CheckpointException) as raised:
        dcp.load(loaded, storage_reader=SafetensorsReader(bucket, "m", config=s3.config()))
    errors = [error for error, _ in raised.value.failures.values()]
    assert any(
        isinstance(e, MetadataError)
        and "embed.weight is torch.float32 in the state dict but torch.bfloat16" in str(e)
        for e in errors
    ), errors


def _header(body: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(body).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(struct.pack("<Q", 2**40) + b"{}", id="huge-length"),
        pytest.param(
            _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
            id="offsets-outside-the-file",
        ),
        pytest.param(
            _header(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                b"\0" * 12,
            ),
            id="overlapping",
        ),
    ],
)
def test_hostile_headers_are_refused_before_any_data_is_read(
    s3: S3Env, bucket: str, body: bytes
) -> None:
    s3.client.put_object(Bucket=bucket, Key="bad/model.safetensors", Body=body)
    with pytest.raises(MetadataError, match=f"s3://{bucket}/bad/model.safetensors"):
        SafetensorsReader(bucket, "bad", config=s3.config()).check()


def test_missing_files_and_a_wrong_index_are_named(s3: S3Env, bucket: str) -> None:
    with pytest.raises(CheckpointNotFound, match=r"no model\.safetensors\.index\.json"):
        SafetensorsReader(bucket, "none", config=s3.config()).check()
    state = _tensors()
    s3.client.put_object(Bucket=bucket, Key="ix/a.safetensors", Body=safetensors.torch.save(state))
    index = {"metadata": {}, "weight_map": {name: "a.safetensors" for name in state}}
    index["weight_map"]["scale"] = "b.safetensors"
    s3.client.put_object(
        Bucket=bucket, Key="ix/model.safetensors.index.json", Body=json.dumps(index).encode()
    )
    with pytest.raises(MetadataError, match="missing"):
        SafetensorsReader(bucket, "ix", config=s3.config()).check()
    s3.client.put_object(Bucket=bucket, Key="ix/b.safetensors", Body=safetensors.torch.save({}))
    with pytest.raises(MetadataError, match="'scale' is not where"):
        SafetensorsReader(bucket, "ix", config=s3.config()).check()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)
def test_each_fsdp2_rank_fetches_only_its_half(s3: S3Env, bucket: str) -> None:
    body = safetensors.torch.save(safetensors_workers.reference())
    s3.client.put_object(Bucket=bucket, Key="hf/model.safetensors", Body=body)
    with FaultProxy(s3.endpoint_url) as first, FaultProxy(s3.endpoint_url) as second:
        configs = [s3.config(endpoint_url=p.endpoint_url) for p in (first, second)]
        args = (2, _free_port(), configs, f"s3://{bucket}/hf")
        spawn(safetensors_workers.load_fsdp, args=args, nprocs=2)
        served = [first.served["GetObject"], second.served["GetObject"]]
    header = 64 * 1024  # each rank's first read of the file (the header, and data after it)
    for rank, got in enumerate(served):
        assert len(body) / 2 <= got <= len(body) / 2 + header + 8 * 1024, (rank, got, len(body))


@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)
def test_adjacent_tensors_load_with_few_gets(s3: S3Env, bucket: str) -> None:
    """Issue #26: 500 adjacent tensors of 12 KiB (5.9 MiB, over one 5 MiB part) load with the
    header's GET and one GET per part of data, each byte served once."""
    generator = torch.Generator().manual_seed(3)
    state = {f"layers.{i:03d}.weight": torch.randn(3072, generator=generator) for i in range(500)}
    body = safetensors.torch.save(state)
    data = sum(t.numel() * t.element_size() for t in state.values())
    s3.client.put_object(Bucket=bucket, Key="hf/model.safetensors", Body=body)
    loaded = _empty_like(state)
    with FaultProxy(s3.endpoint_url) as proxy:
        config = s3.config(endpoint_url=proxy.endpoint_url, part_size=5 * MiB)
        dcp.load(loaded, storage_reader=SafetensorsReader(bucket, "hf", config=config))
        gets, served = proxy.requests["GetObject"], proxy.served["GetObject"]
    _same(loaded, state)
    header = 64 * 1024  # the first read of the file: the header and the data after it
    assert gets == 1 + math.ceil(data / (5 * MiB)) == 3, gets  # against 500 tensors
    assert served == header + data, (served, data)


@pytest.mark.parametrize("s3", ["seaweedfs"], indirect=True)
def test_ranges_further_apart_than_max_gap_are_fetched_apart(s3: S3Env, bucket: str) -> None:
    """Issue #26: three tensors of 1 KiB with 2 MiB tensors between them, loaded alone: with the
    default max_gap (1 MiB) three GETs of just their bytes; with max_gap=4 MiB one GET over
    the gaps."""
    generator = torch.Generator().manual_seed(4)
    small = {name: torch.randn(256, generator=generator) for name in ("a", "c", "e")}
    fill = {name: torch.randn(512 * 1024, generator=generator) for name in ("b", "d")}
    body = safetensors.torch.save(small | fill)  # ordered by name: a, b, c, d, e
    s3.client.put_object(Bucket=bucket, Key="hf/model.safetensors", Body=body)
    header = 64 * 1024
    spanned = 3 * 1024 + 2 * 2 * MiB  # a to e, the fillers included
    for max_gap, gets, served in (
        (1 * MiB, 1 + 3, header + 3 * 1024),
        (4 * MiB, 1 + 1, header + spanned),
    ):
        loaded = _empty_like(small)
        with FaultProxy(s3.endpoint_url) as proxy:
            config = s3.config(endpoint_url=proxy.endpoint_url)
            reader = SafetensorsReader(bucket, "hf", config=config, max_gap=max_gap)
            dcp.load(loaded, storage_reader=reader)
            counted = proxy.requests["GetObject"], proxy.served["GetObject"]
        _same(loaded, small)
        assert counted == (gets, served), (max_gap, counted)

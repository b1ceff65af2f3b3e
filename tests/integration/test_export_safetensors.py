"""``s3ckpt export --format safetensors`` and `export_safetensors` on real servers, each output
read back with the ``safetensors`` library: dtypes, 0-d tensors, selection, sharding, dtype
conversion, incremental and resharded checkpoints, and exports that fail leaving nothing."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from s3ckpt import ChecksumMismatch, ConfigError, S3Reader, S3Writer, export_safetensors
from s3ckpt.config import MiB
from s3ckpt.format.record import decode
from s3ckpt.tools.hfexport import parse_size
from tests import dist_workers, safetensors_workers
from tests.conftest import Cli, S3Env
from tests.helpers import listing, spawn, uploads_in_progress

PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}


def _state() -> dict[str, Any]:
    """A training state: a model of several dtypes (a 0-d and an empty tensor among them), an
    optimizer, plain values."""
    generator = torch.Generator().manual_seed(5)
    return {
        "model": {
            "embed": torch.randn(300, 64, generator=generator).bfloat16(),
            "proj": {"weight": torch.randn(64, 64, generator=generator)},
            "ids": torch.arange(11, dtype=torch.int64),
            "count": torch.tensor(3, dtype=torch.int32),
            "scale": torch.tensor(0.5),
            "mask": torch.tensor([True, False]),
            "empty": torch.zeros(0, 4),
        },
        "optim": {"state": {"proj": {"exp_avg": torch.ones(64, 64)}}, "lr": 0.01},
        "step": 9,
    }


def _model(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    model = state["model"]
    return {
        **{k: v for k, v in model.items() if k != "proj"},
        "proj.weight": model["proj"]["weight"],
    }


def _save(s3: S3Env, url: str, state: dict[str, Any], **writer: Any) -> None:
    dcp.save(state, storage_writer=S3Writer(url, config=s3.config(**PARTS), **writer))


def _same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape and torch.equal(actual[name], tensor), name


def _read_dir(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    found: dict[str, torch.Tensor] = {}
    for name in files:
        found.update(safetensors.torch.load_file(path / name))
    return found


def test_cli_exports_the_model_to_s3_as_one_file_the_library_reads(
    cli: Cli, s3: S3Env, bucket: str
) -> None:
    state = _state()
    url = f"s3://{bucket}/run/step-9"
    _save(s3, url, state)
    code, out, err = cli(
        "export", url, f"s3://{bucket}/hf", "--format", "safetensors", "--select", "model"
    )
    assert code == 0, err
    assert "wrote 1 file(s)" in out
    assert set(listing(s3.client, bucket, "hf/")) == {"hf/model.safetensors"}
    data = s3.client.get_object(Bucket=bucket, Key="hf/model.safetensors")["Body"].read()
    _same(safetensors.torch.load(data), _model(state))
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert header["__metadata__"] == {"format": "pt"}


def test_cli_converts_to_bfloat16_in_files_of_at_most_max_shard_size(
    cli: Cli, s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    """Issue #26: ``--dtype bfloat16 --max-shard-size 20KB`` through the command line: files
    named as HF names them, each of at most 20 KB of data unless it holds one larger tensor,
    floats in BF16 and the other dtypes as saved."""
    state = _state()
    url = f"s3://{bucket}/run/step-9"
    _save(s3, url, state)
    dest = tmp_path / "hf"
    code, out, err = cli(
        "--json", "export", url, str(dest), "--format", "safetensors", "--select", "model",
        "--dtype", "bfloat16", "--max-shard-size", "20KB",
    )  # fmt: skip
    assert code == 0, err
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count >= 2
    assert files == [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    names = [*files, "model.safetensors.index.json"]
    assert sorted(p.name for p in dest.iterdir()) == names
    assert [Path(f).name for f in json.loads(out)["files"]] == names
    dtypes: dict[str, str] = {}
    for name in files:
        raw = (dest / name).read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        assert header.pop("__metadata__") == {"format": "pt"}
        data = sum(end - start for start, end in (t["data_offsets"] for t in header.values()))
        assert data <= 20_000 or len(header) == 1, (name, data)
        dtypes |= {tensor: info["dtype"] for tensor, info in header.items()}
    assert dtypes == {
        "embed": "BF16", "proj.weight": "BF16", "scale": "BF16", "empty": "BF16",
        "ids": "I64", "count": "I32", "mask": "BOOL",
    }  # fmt: skip
    expected = {k: v.bfloat16() if v.is_floating_point() else v for k, v in _model(state).items()}
    _same(_read_dir(dest), expected)


def test_a_whole_checkpoint_keeps_its_names_and_skips_what_is_not_a_tensor(
    s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    state = _state()
    url = f"s3://{bucket}/ck"
    _save(s3, url, state)
    done = export_safetensors(url, tmp_path / "all", s3.config())
    found = _read_dir(tmp_path / "all")
    assert set(found) == {f"model.{k}" for k in _model(state)} | {"optim.state.proj.exp_avg"}
    assert set(done.skipped) == {"optim.lr", "step"}
    assert [p.name for p in (tmp_path / "all").iterdir()] == ["model.safetensors"]


def test_sharded_output_has_an_index_and_converts_floats(
    s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    state = _state()
    url = f"s3://{bucket}/ck"
    _save(s3, url, state)
    dest = tmp_path / "hf"
    done = export_safetensors(
        url, dest, s3.config(), select="model", dtype="bf16", max_shard_size="20KB"
    )
    expected = {k: v.bfloat16() if v.is_floating_point() else v for k, v in _model(state).items()}
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in expected.values()
    )
    assert done.files[-1].endswith("model.safetensors.index.json")
    for name in files:
        for tensor in safetensors.torch.load_file(dest / name):
            assert index["weight_map"][tensor] == name
    _same(_read_dir(dest), expected)


def test_an_incremental_checkpoint_exports_whole(s3: S3Env, bucket: str, tmp_path: Path) -> None:
    state = _state()
    _save(s3, f"s3://{bucket}/run/step-1", state, incremental=True)
    state["model"]["proj"]["weight"] = state["model"]["proj"]["weight"] * 2
    _save(s3, f"s3://{bucket}/run/step-2", state, incremental=True)
    export_safetensors(f"s3://{bucket}/run/step-2", tmp_path / "hf", s3.config(), select="model")
    _same(_read_dir(tmp_path / "hf"), _model(state))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_a_checkpoint_sharded_over_two_ranks_exports_whole_tensors(
    s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/sharded"
    spawn(dist_workers.save_sharded, args=(2, _free_port(), s3.config(), url), nprocs=2)
    done = export_safetensors(url, tmp_path / "hf", s3.config())
    full = dist_workers.reference_state()
    _same(_read_dir(tmp_path / "hf"), {**full, "plain": full["replicated"]})
    assert done.skipped == ("step",)


def _chunks(url: str, s3: S3Env) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Each tensor's stored chunks (offsets, sizes), as the checkpoint's record holds them."""
    metadata = S3Reader(url, config=s3.config()).read_metadata()
    return {
        fqn: sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
        for fqn, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


@pytest.mark.slow
@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_uneven_and_resharded_checkpoints_export_the_same_bytes(
    s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    """Issue #26: two ranks save tensors split on a later dim and unevenly (4 rows and 3, one
    row and none); that checkpoint restored whole on one rank and saved again; that one
    restored on two ranks in other placements and saved again. All three export whole tensors,
    to the same bytes, file by file (sharded output: every file and the index)."""
    worker = safetensors_workers.save_uneven
    two, one, again = (f"s3://{bucket}/{name}" for name in ("two", "one", "again"))
    spawn(worker, args=(2, _free_port(), s3.config(), two, None), nprocs=2)
    full = safetensors_workers.uneven_reference()
    whole = {name: torch.zeros_like(tensor) for name, tensor in full.items()}
    dcp.load(whole, storage_reader=S3Reader(two, config=s3.config()))  # no process group
    _save(s3, one, whole)
    spawn(worker, args=(2, _free_port(), s3.config(), again, one), nprocs=2)

    stored = _chunks(two, s3)
    assert stored["wide"] == [((0, 0), (6, 5)), ((0, 5), (6, 5))]
    assert stored["odd"] == [((0, 0), (4, 5)), ((4, 0), (3, 5))]
    assert stored["middle"] == [((0, 0, 0), (3, 4, 4)), ((0, 4, 0), (3, 3, 4))]
    assert [c for c in stored["one_row"] if math.prod(c[1])] == [((0, 0), (1, 6))]  # and none
    assert all(len(chunks) == 1 for chunks in _chunks(one, s3).values())
    assert _chunks(again, s3)["middle"] == [((0, 0, 0), (3, 7, 2)), ((0, 0, 2), (3, 7, 2))]

    exported = []
    for name, url in (("two", two), ("one", one), ("again", again)):
        export_safetensors(url, tmp_path / name, s3.config(), max_shard_size="300B")
        _same(_read_dir(tmp_path / name), full)
        exported.append({p.name: p.read_bytes() for p in (tmp_path / name).iterdir()})
    assert len(exported[0]) > 2 and "model.safetensors.index.json" in exported[0]
    assert exported[1] == exported[0] and exported[2] == exported[0]


def _corrupt(s3: S3Env, bucket: str, prefix: str, name: str) -> None:
    """Flip a stored byte in the middle of tensor ``name``."""
    raw = s3.client.get_object(Bucket=bucket, Key=f"{prefix}/.metadata")["Body"].read()
    checkpoint = decode(raw, url=f"s3://{bucket}/{prefix}")
    (locator,) = (at for index, at in checkpoint.locators.items() if index.fqn == name)
    key = f"{prefix}/{locator.key}"
    body = bytearray(s3.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[locator.offset + locator.length // 2] ^= 0xFF
    s3.client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def test_a_failed_export_leaves_no_file(s3: S3Env, bucket: str, tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(256, 1024) for i in range(6)}  # 1 MiB each
    _save(s3, f"s3://{bucket}/ck", state)
    _corrupt(s3, bucket, "ck", "t5")  # in the last of three files: two complete before it
    with pytest.raises(ChecksumMismatch):
        export_safetensors(f"s3://{bucket}/ck", tmp_path / "hf", s3.config(), max_shard_size="2MiB")
    assert list((tmp_path / "hf").iterdir()) == []
    with pytest.raises(ChecksumMismatch):
        export_safetensors(
            f"s3://{bucket}/ck", f"s3://{bucket}/hf", s3.config(), max_shard_size="2MiB"
        )
    assert listing(s3.client, bucket, "hf/") == {}
    assert uploads_in_progress(s3.client, bucket) == []


def test_an_export_refuses_a_destination_that_holds_one(
    s3: S3Env, bucket: str, tmp_path: Path
) -> None:
    _save(s3, f"s3://{bucket}/ck", _state())
    export_safetensors(f"s3://{bucket}/ck", f"s3://{bucket}/hf", s3.config(), select="model")
    with pytest.raises(ConfigError, match="already holds safetensors files"):
        export_safetensors(f"s3://{bucket}/ck", f"s3://{bucket}/hf", s3.config())
    with pytest.raises(ConfigError, match="no tensors under 'nothing'"):
        export_safetensors(f"s3://{bucket}/ck", tmp_path, s3.config(), select="nothing")


@pytest.mark.stores("memory")
@pytest.mark.parametrize(
    ("option", "message"),
    [
        pytest.param({"dtype": torch.int8}, "expected a floating-point dtype", id="int8"),
        pytest.param({"dtype": "int32"}, "expected a floating-point dtype", id="int32-by-name"),
        pytest.param({"dtype": "complex64"}, "expected a floating-point dtype", id="complex64"),
        pytest.param({"max_shard_size": 0}, "max_shard_size must be a positive", id="zero"),
        pytest.param({"max_shard_size": "5XB"}, "expected a size such as 5GB", id="no-unit"),
    ],
)
def test_a_wrong_dtype_or_size_is_refused_before_the_checkpoint_is_read(
    s3: S3Env, bucket: str, tmp_path: Path, option: dict[str, Any], message: str
) -> None:
    """Issue #26: a dtype that is not floating-point (torch.int8 used to turn every float into
    int8) or a size that is not one is a ConfigError, raised before the checkpoint is looked
    for (at ``none`` there is none: otherwise CheckpointNotFound)."""
    _save(s3, f"s3://{bucket}/ck", _state())
    for url in (f"s3://{bucket}/none", f"s3://{bucket}/ck"):
        with pytest.raises(ConfigError, match=message):
            export_safetensors(url, tmp_path / "hf", s3.config(), **option)
    assert list(tmp_path.iterdir()) == []


def test_sizes_read_as_save_pretrained_writes_them() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20
    assert parse_size("1000") == 1000 and parse_size("1.5 kb") == 1500
    for text in ("", "0", "5 GG", "-1MB"):
        with pytest.raises(ConfigError, match="expected a size"):
            parse_size(text)


def test_a_large_file_streams_as_a_multipart_upload_of_bounded_parts(
    s3: S3Env, bucket: str
) -> None:
    generator = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(1000, 1001 + i, generator=generator) for i in range(4)}
    state["h"] = torch.randn(999, 333, generator=generator).bfloat16()
    state["big"] = torch.randn(3000, 1001, generator=generator)  # 12 MB: over two parts
    _save(s3, f"s3://{bucket}/ck", state)
    export_safetensors(f"s3://{bucket}/ck", f"s3://{bucket}/hf", s3.config(**PARTS))
    first = s3.client.head_object(Bucket=bucket, Key="hf/model.safetensors", PartNumber=1)
    assert first["PartsCount"] >= 2
    for number in range(1, first["PartsCount"]):  # whole parts, however the tensors fall
        part = s3.client.head_object(Bucket=bucket, Key="hf/model.safetensors", PartNumber=number)
        assert PARTS["part_size"] <= part["ContentLength"] < 2 * PARTS["part_size"], number
    data = s3.client.get_object(Bucket=bucket, Key="hf/model.safetensors")["Body"].read()
    _same(safetensors.torch.load(data), state)

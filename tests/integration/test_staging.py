"""async_save staging: reused buffers, the value at the call is what gets saved, one save at a
time per writer, and non-blocking staging."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from s3ckpt import S3Reader, S3Writer

pytestmark = pytest.mark.stores("memory")  # not a wire test: see test_store_contract


def load(s3: Any, url: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    loaded = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(loaded, storage_reader=S3Reader(url, config=s3.config()))
    return loaded


def test_tensor_modified_after_async_save_returns_is_saved_as_it_was(s3: Any, bucket: str) -> None:
    weights = torch.arange(1_000_000, dtype=torch.float32)
    writer = S3Writer(f"s3://{bucket}/mutate", config=s3.config())
    future = dcp.async_save({"w": weights}, storage_writer=writer)
    weights.add_(1.0)  # the next optimizer step, while the upload runs
    future.result(timeout=120)
    loaded = load(s3, f"s3://{bucket}/mutate", {"w": weights})
    assert torch.equal(loaded["w"], torch.arange(1_000_000, dtype=torch.float32))


def test_buffers_are_reused_across_saves_and_remade_when_shapes_change(
    s3: Any, bucket: str
) -> None:
    writer = S3Writer(bucket, config=s3.config())
    state = {"a": torch.randn(256, 256), "b": torch.randn(1000)}
    pointers = []
    for step in range(3):
        state["a"].add_(1.0)
        url = f"s3://{bucket}/step-{step}"
        dcp.async_save(state, checkpoint_id=url, storage_writer=writer).result(timeout=120)
        pointers.append(writer._staging._buffers["a"].data_ptr())  # type: ignore[index]
        assert torch.equal(load(s3, url, state)["a"], state["a"])
    assert pointers[1] == pointers[2], "same shapes: the staging buffers are reused"

    state["a"] = torch.randn(128, 64)
    url = f"s3://{bucket}/step-3"
    dcp.async_save(state, checkpoint_id=url, storage_writer=writer).result(timeout=120)
    assert writer._staging._buffers["a"].shape == (128, 64)  # type: ignore[index]
    assert torch.equal(load(s3, url, state)["a"], state["a"])

    writer.close()
    assert writer._staging.nbytes == 0


def test_prepared_buffers_are_the_ones_the_first_save_stages_into(s3: Any, bucket: str) -> None:
    """`prepare_staging` takes the first touch of the buffers out of the first save's stall."""
    writer = S3Writer(bucket, config=s3.config())
    model = torch.nn.Linear(64, 32)
    writer.prepare_staging({"model": model.state_dict(), "step": 0})
    prepared = writer._staging._buffers["model"]["weight"]  # type: ignore[index]
    assert writer._staging.nbytes == (64 * 32 + 32) * 4
    url = f"s3://{bucket}/step-1"
    state = {"model": model.state_dict(), "step": 1}
    dcp.async_save(state, checkpoint_id=url, storage_writer=writer).result(timeout=120)
    staged = writer._staging._buffers["model"]["weight"]  # type: ignore[index]
    assert staged.data_ptr() == prepared.data_ptr(), "the first save reused the prepared buffers"
    assert torch.equal(load(s3, url, {"model.weight": model.weight})["model.weight"], model.weight)
    writer.close()


def test_back_to_back_async_saves_on_one_writer_both_commit_their_values(
    s3: Any, bucket: str
) -> None:
    writer = S3Writer(bucket, config=s3.config())
    weights = torch.zeros(2_000_000)
    futures = []
    for step in range(3):
        weights.fill_(float(step))
        url = f"s3://{bucket}/s{step}"
        futures.append(dcp.async_save({"w": weights}, checkpoint_id=url, storage_writer=writer))
    for future in futures:
        future.result(timeout=120)
    for step in range(3):
        loaded = load(s3, f"s3://{bucket}/s{step}", {"w": weights})
        assert torch.equal(loaded["w"], torch.full((2_000_000,), float(step)))


class _SlowToPlan(S3Writer):
    """Holds its first save between DCP's ``reset`` and ``storage_meta``: the window where a
    second save's ``reset`` used to move the writer to its own checkpoint id under the first."""

    def storage_meta(self) -> Any:
        if self.checkpoint_id.endswith("/s0"):
            time.sleep(1.0)
        return super().storage_meta()


def test_a_second_save_cannot_move_the_first_to_its_checkpoint_id(s3: Any, bucket: str) -> None:
    writer = _SlowToPlan(bucket, config=s3.config())
    weights = torch.zeros(100_000)
    futures = []
    for step in range(2):
        weights.fill_(float(step))
        url = f"s3://{bucket}/s{step}"
        futures.append(dcp.async_save({"w": weights}, checkpoint_id=url, storage_writer=writer))
    for future in futures:
        future.result(timeout=120)
    for step in range(2):
        loaded = load(s3, f"s3://{bucket}/s{step}", {"w": weights})
        assert torch.equal(loaded["w"], torch.full((100_000,), float(step)))


def test_an_async_save_after_a_synchronous_one_on_the_same_writer_completes(
    s3: Any, bucket: str
) -> None:
    writer = S3Writer(bucket, config=s3.config())
    weights = torch.ones(100_000)
    dcp.save({"w": weights}, checkpoint_id=f"s3://{bucket}/sync", storage_writer=writer)
    weights.fill_(2.0)
    future = dcp.async_save(
        {"w": weights}, checkpoint_id=f"s3://{bucket}/async", storage_writer=writer
    )
    future.result(timeout=60)  # used to wait for the main thread, the sync save's, to end
    assert torch.equal(load(s3, f"s3://{bucket}/sync", {"w": weights})["w"], torch.ones(100_000))
    assert torch.equal(load(s3, f"s3://{bucket}/async", {"w": weights})["w"], weights)
    writer.close()


def test_non_blocking_staging_returns_a_staging_future(s3: Any, bucket: str) -> None:
    weights = torch.randn(500_000)
    expected = weights.clone()
    writer = S3Writer(f"s3://{bucket}/nb", config=s3.config(), async_staging=True)
    response = dcp.async_save({"w": weights}, storage_writer=writer)
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result(timeout=60)
    weights.mul_(2.0)  # allowed once staging has completed
    response.upload_completion.result(timeout=120)
    assert torch.equal(load(s3, f"s3://{bucket}/nb", {"w": weights})["w"], expected)
    writer.close()

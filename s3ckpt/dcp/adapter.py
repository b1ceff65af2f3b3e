"""What `S3Writer` and `S3Reader` share: where the checkpoint is, how DCP's ``checkpoint_id``
moves it, and the torch Future that DCP waits on."""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, TypeVar

import torch.futures

from ..config import S3Config
from ..engine.contract import ObjectStore
from ..engine.store import get_store
from ..errors import ConfigError
from ..format.layout import Location
from . import hush

__all__ = ["AtLocation", "to_torch_future"]

T = TypeVar("T")


class AtLocation:
    """A storage adapter for the checkpoint at ``location``, using ``store`` if given (it works
    in the process that made it), else the process's store for ``config``."""

    def __init__(
        self, bucket: str, prefix: str, config: S3Config | None, store: ObjectStore | None = None
    ) -> None:
        hush.install()  # torch's noise around s3ckpt's calls (`hush`)
        self.location = Location.of(bucket, prefix)
        self.config = config or (store.config if store is not None else S3Config())
        self._resolved = None if store is None else (os.getpid(), store)
        self._given = store is not None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_resolved"] = None  # a store lives in one process, on its loop
        return state

    @property
    def checkpoint_id(self) -> str:
        return self.location.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Any) -> bool:
        return isinstance(checkpoint_id, str) and checkpoint_id.startswith("s3://")

    def _move(self, checkpoint_id: str | Any) -> None:
        """DCP's ``checkpoint_id``: an ``s3://`` URL, or a prefix in the same bucket.

        A URL in another bucket is refused rather than followed: the adapter's bucket is what
        its caller chose (and may have created or granted access to), so a typo in an id must
        not silently send a save, or a load, somewhere else.
        """
        if checkpoint_id is None:
            return
        moved = self.location.moved_to(str(checkpoint_id))
        if moved.bucket != self.location.bucket:
            name = type(self).__name__
            raise ConfigError(
                f"checkpoint_id {str(checkpoint_id)!r} is in bucket {moved.bucket!r}, but this "
                f"{name} is for bucket {self.location.bucket!r}: a checkpoint_id may change the "
                f"prefix, not the bucket; use {name}({moved.bucket!r}) for that bucket"
            )
        self.location = moved

    @property
    def _store(self) -> ObjectStore:
        """The store, resolved once per adapter and process: resolving reads the environment
        and the AWS config files, too slow to repeat for every request of every save."""
        if self._resolved is None or self._resolved[0] != os.getpid():
            if self._given:
                raise ConfigError(
                    f"{type(self).__name__} for {self.location.url} was given a store, which "
                    "works only in the process that made it (not in a PROCESS-mode "
                    "checkpointer or another rank's process): give it a config instead"
                )
            self._resolved = (os.getpid(), get_store(self.config))
        return self._resolved[1]


def to_torch_future(done: concurrent.futures.Future[T]) -> torch.futures.Future[T]:
    """A torch Future (what DCP waits on) that completes as ``done`` does."""
    future: torch.futures.Future[T] = torch.futures.Future()

    def complete(cf: concurrent.futures.Future[T]) -> None:
        error = concurrent.futures.CancelledError() if cf.cancelled() else cf.exception()
        if error is None:
            future.set_result(cf.result())
        else:
            future.set_exception(error)  # type: ignore[arg-type]  # torch types it as T

    done.add_done_callback(complete)
    return future

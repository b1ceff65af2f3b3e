"""The `CheckpointManager` class: a run's saves, retention and restore (see the package)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.optim import Optimizer

from ..config import S3Config, WriteOptions
from ..dcp.planning import CachingSavePlanner
from ..dcp.writer import S3Writer
from ..engine import bridge
from ..errors import CheckpointError, ConfigError, S3CkptError
from ..format.layout import Location, step_name
from ..tools.retention import Retention
from . import restore as restoring
from .collective import groups, release
from .policy import SavePolicy
from .states import stateful, warn_stateless
from .steps import Run, committed, prune

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


@dataclass
class _Pending:
    """The save in flight: its step, and a future that completes once it has committed and
    retention has run."""

    step: int
    future: Future[None]


class CheckpointManager:
    """Checkpoints of one run at ``url/step-<step>`` (the step zero-padded to 9 digits)::

        mgr = CheckpointManager("s3://bucket/run7", every=100, keep_last=3)
        state = {"model": model, "optim": optimizer}  # the objects: their state at each save
        start = mgr.restore(state)        # the step loaded, or None: the run has no checkpoint
        for step in range((start or 0) + 1, total + 1):   # the step after the restored one
            ...                           # train step number ``step``
            mgr.save(step, state)         # in the background; a no-op unless should_save(step)
        mgr.close()                       # waits for the last save, frees the staging buffers

    Its settings are grouped by what they decide, each in one place: ``saving`` (`SavePolicy`:
    when and how saves happen: ``every``, ``continuous``, ``save_on``, ``sync``,
    ``incremental``), ``retention`` (`Retention`: which saved steps stay: ``keep_last``,
    ``keep_every``, ``keep``), ``options`` (`WriteOptions`: how the bytes are laid out,
    compression included) and ``config`` (`S3Config`: how to reach the store). ``every`` and
    ``keep_last``, the two that almost every run sets, may be given on their own instead:
    ``every=100`` is ``saving=SavePolicy(every=100)``, ``keep_last=3`` is
    ``retention=Retention(keep_last=3)``; beside the policy they belong to they are refused, so
    no setting is ever read from two places. Without a retention rule nothing is deleted.

    Saves go through one `S3Writer` (DCP's stager: its CPU buffers are reused), made here: its
    construction makes the S3 client and HTTP session (see `S3Writer`), so build the manager
    before training starts and the job's first checkpoint does not pay for them. At most one
    save is in flight, and the next ``save`` that saves waits for it. They plan with a
    `CachingSavePlanner`: a save whose state has the structure of the previous one skips DCP's
    plan exchange (not with ``incremental``, whose references are planned per save). A
    background save's error is raised by the next ``save()`` or ``wait()``
    (``raise_on_failure=False``: logged, and the run goes on).

    Retention runs on the coordinator after each commit. It never deletes the newest committed
    checkpoint, nor one being written or read (a live lease, see `s3ckpt.dcp.commit.ReadLease`),
    nor an object that a kept checkpoint references (incremental saves' included). A committed
    checkpoint at a step is never saved over, except one that ``restore`` skipped as damaged.

    With ``save_on``, the signal handler is installed when the manager is built, which must
    then be in the main thread, and removed by ``close()``.

    Distributed (``torch.distributed`` initialised): every rank builds the manager and calls
    ``save`` and ``restore`` with the same steps. Saves and loads run on a gloo group created
    here (or ``process_group``); with ``continuous`` or ``save_on``, every ``save()`` call runs
    one small ``all_reduce`` on a second gloo group, so that all ranks agree on whether to save
    and on a signal. ``restore`` loads on any world size (resharding); modules and optimizers
    (FSDP2 ones included) get their state through torch's ``set_state_dict`` helpers.
    """

    def __init__(
        self,
        url: str,
        *,
        every: int | None = None,
        keep_last: int | None = None,
        saving: SavePolicy | None = None,
        retention: Retention | None = None,
        options: WriteOptions | None = None,
        config: S3Config | None = None,
        process_group: dist.ProcessGroup | None = None,
        raise_on_failure: bool = True,
    ) -> None:
        if every is not None:
            if saving is not None:
                raise ConfigError(
                    f"every={every} beside saving=: give it there, SavePolicy(every={every}, ...)"
                )
            saving = SavePolicy(every=every)
        if keep_last is not None:
            if retention is not None:
                raise ConfigError(
                    f"keep_last={keep_last} beside retention=: give it there, "
                    f"Retention(keep_last={keep_last}, ...)"
                )
            retention = Retention(keep_last=keep_last)
        location = Location.of(url)
        self.url = location.url
        self.saving = saving or SavePolicy()
        self.retention = retention or Retention()
        self.raise_on_failure = raise_on_failure
        self.config = config or S3Config()
        self._writer = S3Writer(
            location.bucket,
            config=self.config,
            options=options,
            overwrite=self._replaces,
            incremental=self.saving.incremental,
            full_every=self.saving.full_every,
        )
        # Incremental saves plan their references from every item: a cached, empty plan has none.
        self._planner = None if self.saving.incremental else CachingSavePlanner()
        group, agreement, self._groups = groups(process_group)
        self._run = Run(location, self.config, group, agreement)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="s3ckpt-manager")
        self._pending: _Pending | None = None
        self._lock = threading.Lock()
        self._known: set[int] = set()  # committed by this manager, or restored
        self._damaged: set[int] = set()  # skipped by restore: a save of the step replaces them
        self._leftovers: dict[int, Location] = {}
        self._warned: set[str] = set()  # keys warn_stateless has warned about
        self._restored: int | None = None
        self._closed = False
        self.signal_received: int | None = None
        self._received: int | None = None
        self._previous: dict[int, _Handler] = {}
        signals = self.saving.signals
        self._vote = self.saving.continuous or bool(signals)  # then every save() call agrees
        for signum in signals:
            try:
                self._previous[signum] = signal.signal(signum, self._record)
            except ValueError as e:
                self._restore_handlers()
                raise ConfigError(
                    f"save_on={signum}: {e} (build the manager in the main thread)"
                ) from e

    # ------------------------------------------------------------------------- the run

    def steps(self) -> list[int]:
        """The run's committed steps (those holding a ``.metadata``), ascending."""
        return sorted(bridge.run(committed(self._run.store, self._run.location)))

    def latest_step(self) -> int | None:
        """The highest committed step, or None."""
        return max(self.steps(), default=None)

    def restore(
        self,
        state_dict: dict[str, Any],
        step: int | None = None,
        verify: bool = False,
        *,
        partial: bool = False,
        required: bool = False,
        planner: LoadPlanner | None = None,
    ) -> int | None:
        """Load the newest committed step into ``state_dict``'s values, or ``step``; returns
        the step loaded (resume at the step after it), None if the run holds no checkpoint.

        Values are as for `save`: modules, optimizers and ``Stateful`` objects get the loaded
        state set (an optimizer that never stepped gets its moments); plain state dicts are
        loaded in place, as ``dcp.load`` does. Only the keys given load: ``{"model": model}``
        restores the model of a training checkpoint. ``partial=True`` also lets keys that the
        checkpoint lacks (a new head) keep their values; otherwise they, and any tensor whose
        shape differs, raise `StateDictMismatch` naming each key (and both shapes) before
        anything loads.

        A run with no checkpoint logs a WARNING naming the URL and the runs beside it (a typo
        is the usual cause); ``required=True`` raises `CheckpointNotFound` instead.

        Before it returns, restore allocates and touches the staging buffers of background
        saves for this state (the memory the first save would take, taken now), so that the
        first save's stall is its copy alone: call it before training, as the loop does.

        A damaged checkpoint (checksum mismatch, missing or short object, unreadable record,
        replaced or deleted while loading) is logged with why, and the next older step is tried;
        with ``step`` given, its error is raised instead. If none loads, CheckpointError names
        each step and why. ``verify=True`` first checks every byte of a checkpoint against its
        checksums (on the coordinator), before anything is loaded. Other failures (an
        unreachable store, refused credentials) are raised as s3ckpt's errors.
        """
        self._check_open()
        self.wait()  # loads share the group with saves: none may be in flight
        if planner is not None and partial:
            raise ConfigError("restore: give partial=True or a planner, not both")
        request = restoring.Request(stateful(state_dict), verify, partial, planner)
        restored = restoring.restore(self._run, request, step)
        for key, value in request.state_dict.items():  # plain values DCP replaced
            if not isinstance(state_dict[key], (nn.Module, Optimizer)):
                state_dict[key] = value
        with self._lock:
            self._damaged.update(restored.skipped)
            if restored.step is not None:
                self._restored = restored.step
                self._known.add(restored.step)
                self._damaged.discard(restored.step)
        if restored.step is None:
            restoring.nothing(self._run, required)
        if not self.saving.sync:
            self._writer.prepare_staging(stateful(state_dict))
        return restored.step

    # ------------------------------------------------------------------------- saving

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` would save, as this rank sees it: ``step`` is a multiple of
        ``every``, a ``save_on`` signal arrived, or (continuous) no save is in flight."""
        if self._received is not None or step % self.saving.every == 0:
            return True
        return self.saving.continuous and not self._busy()

    def save(
        self, step: int, state_dict: dict[str, Any], force: bool = False, sync: bool | None = None
    ) -> bool:
        """Save ``state_dict`` as ``step`` if `should_save` (or ``force``); returns whether a
        save started. ``sync`` (default: the manager's) waits until it has committed; else it
        uploads in the background once the state is staged, and training may change it.

        Its values may be the training objects themselves: an ``nn.Module``, a
        ``torch.optim.Optimizer`` (with the module it trains in the same dict) or any
        ``Stateful``; their state is taken now, with torch's ``get_model_state_dict`` and
        ``get_optimizer_state_dict`` (FSDP2/DTensor state included). Plain state dicts work too,
        but ``opt.state_dict()`` taken before the first step holds no moments: a save of one
        after step 0 logs a WARNING naming its key.

        A step this manager already committed or restored is not saved again. The previous
        save's failure is raised here (or logged, ``raise_on_failure=False``).
        """
        self._check_open()
        step_name(step)  # refuses a negative step before any work
        wanted = force or step % self.saving.every == 0
        busy, received = self._busy(), self._received or 0
        if self._run.agreement.distributed and self._vote:
            votes = self._run.agreement.maximum(int(wanted), int(busy), received)
            wanted, busy, received = bool(votes[0]), bool(votes[1]), votes[2]
        if received:
            return self._save_on_signal(step, state_dict, received)
        if not (wanted or (self.saving.continuous and not busy)):
            self._surface(block=False)
            return False
        return self._save(step, state_dict, self.saving.sync if sync is None else sync)

    def wait(self) -> None:
        """Block until the save in flight (if any) has committed; raises its error (or logs it,
        ``raise_on_failure=False``)."""
        self._surface(block=True)

    def close(self) -> None:
        """Wait for the save in flight (raising its error as `wait` does), then free the staging
        buffers and remove the signal handlers. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.close()
            if self._planner is not None:
                self._planner.forget()
            self._worker.shutdown(wait=True)
            self._restore_handlers()
            release(self._groups)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # never hide the exception that ends the block
            self.close()
        except S3CkptError as e:
            log.error("%s: closing after %s: %s", self.url, type(exc).__name__, e)

    # ------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.url} is closed", url=self.url)

    def _busy(self) -> bool:
        return self._pending is not None and not self._pending.future.done()

    def _replaces(self, checkpoint_id: str) -> bool:
        """The writer's ``overwrite``, asked as each save begins: only a step that restore
        skipped as damaged is saved over (a committed checkpoint elsewhere is someone else's)."""
        with self._lock:
            return any(self._run.at(step).url == checkpoint_id for step in self._damaged)

    def _is_known(self, step: int) -> bool:
        pending = self._pending
        with self._lock:
            return step in self._known or (pending is not None and pending.step == step)

    def _save(self, step: int, state_dict: dict[str, Any], sync: bool) -> bool:
        self._surface(block=True)  # one save at a time
        url = self._run.at(step).url
        if self._is_known(step):
            if step == self._restored:
                log.warning(
                    "%s is the step restore() loaded: not saved again, but the loop ran it "
                    "again; resume at the step after it (range(start + 1, ...))",
                    url,
                )
            else:
                log.info("%s is already committed: not saved again", url)
            return False
        warn_stateless(url, step, state_dict, self._warned)
        state = stateful(state_dict)
        try:
            if sync:
                state_dict_saver.save(
                    state,
                    checkpoint_id=url,
                    storage_writer=self._writer,
                    planner=self._planner,
                    process_group=self._run.group,
                )
                self._committed(step)
                return True
            started = state_dict_saver.async_save(
                state,
                checkpoint_id=url,
                storage_writer=self._writer,
                planner=self._planner,
                process_group=self._run.group,
            )
        except (Exception, CheckpointException) as e:
            self._failed(step, e)
            return True
        upload = started.upload_completion if isinstance(started, AsyncSaveResponse) else started
        self._pending = _Pending(step, self._worker.submit(self._finish, step, upload))
        return True

    def _finish(self, step: int, upload: Future[Any]) -> None:
        """The worker thread's part of a background save: wait for the commit, then retention."""
        upload.result()
        self._committed(step)

    def _committed(self, step: int) -> None:
        with self._lock:
            self._known.add(step)
            self._damaged.discard(step)
            damaged = frozenset(self._damaged)
        if not (self._run.agreement.coordinator and self.retention.deletes):
            return
        try:
            prune(self._run, self.retention, self._leftovers, damaged, self.saving.schedule)
        except Exception as e:  # the checkpoint is committed: retention failing must not undo it
            log.warning("%s: retention after step %d failed: %s", self.url, step, e)

    def _surface(self, *, block: bool, raising: bool = True) -> None:
        """Collect the save in flight once it is done (``block``: wait for it) and report its
        failure: raised when ``raising`` and ``raise_on_failure``, else logged."""
        pending = self._pending
        if pending is None or (not block and not pending.future.done()):
            return
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:
            self._pending = None
            self._failed(pending.step, e, raising)
            return
        self._pending = None

    def _failed(self, step: int, error: BaseException, raising: bool = True) -> None:
        url = self._run.at(step).url
        cause = restoring.s3ckpt_error(error)
        message = f"saving step {step} to {url} failed: {cause or error!r}"
        if raising and self.raise_on_failure:
            if cause is not None:
                raise cause.reworded(message) from error
            raise CheckpointError(message, url=url) from error
        log.error("%s", message)

    # ------------------------------------------------------------------------- signals

    def _record(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: only notes the signal; the next ``save()`` acts on it."""
        self._received = signum

    def _save_on_signal(self, step: int, state_dict: dict[str, Any], signum: int) -> bool:
        name, then = signal.Signals(signum).name, self.saving.on_signal
        log.warning("%s: %s received: saving step %d now, then %s", self.url, name, step, then)
        self._received = None
        self._surface(block=True, raising=False)  # this save supersedes a failed one
        try:
            saved = self._save(step, state_dict, sync=True)
        except S3CkptError as e:
            log.error("%s", e)
            if then == "return":
                raise
            saved = False
        self.signal_received = signum
        if then == "exit":
            raise SystemExit(128 + signum)
        if then == "reraise":
            previous = self._previous.pop(signum, signal.SIG_DFL)
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            signal.raise_signal(signum)
        return saved

    def _restore_handlers(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

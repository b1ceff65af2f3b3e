"""`SavePolicy`: when and how a `CheckpointManager` saves. Its counterpart, which saved steps
stay, is `s3ckpt.tools.retention.Retention` (shared with ``s3ckpt prune``); what the bytes look
like is `WriteOptions`. Each setting has this one place, checked as the policy is built, so a
combination that cannot work fails where it is written, not hours into a run."""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

from ..errors import ConfigError

__all__ = ["OnSignal", "SavePolicy"]

OnSignal = Literal["reraise", "exit", "return"]
_ON_SIGNAL = get_args(OnSignal)
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def _signals(save_on: int | Iterable[int]) -> tuple[int, ...]:
    return (save_on,) if isinstance(save_on, int) else tuple(save_on)


@dataclass(frozen=True)
class SavePolicy:
    """When and how a `CheckpointManager` saves.

    ``every``: save the steps that are multiples of it. ``continuous``: also save whenever no
    save is in flight, so the newest checkpoint is never older than one upload (retention's
    ``keep_last`` then counts only the steps of ``every``).

    ``save_on``: a signal, or several (``signal.SIGTERM``): the handler only records it; the
    next ``save()`` saves that step synchronously, whatever the schedule, then ``on_signal``:
    ``"reraise"`` puts back the handler that was there before and raises the signal again, so
    the process does what it would have done without the manager (SIGTERM's default ends it);
    ``"exit"`` raises ``SystemExit(128 + signal)``; ``"return"`` lets ``save()`` return (the
    manager's ``signal_received`` says which).

    ``sync``: ``save()`` returns once the save has committed, instead of uploading in the
    background once the state is staged (``save(sync=...)`` decides for one call).

    ``incremental``: each save references the tensors unchanged since the previous committed
    step instead of uploading them, so a frozen base is stored once for the whole run;
    ``full_every`` bounds how far references reach: one full save per that many steps (see
    `S3Writer`).
    """

    every: int = 1
    continuous: bool = False
    save_on: int | Iterable[int] = ()
    on_signal: OnSignal = "reraise"
    sync: bool = False
    incremental: bool = False
    full_every: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "save_on", _signals(self.save_on))  # hashable, read once
        if self.every < 1:
            raise ConfigError(f"every must be >= 1, got {self.every}")
        if self.on_signal not in _ON_SIGNAL:
            raise ConfigError(
                f"on_signal must be 'reraise', 'exit' or 'return', not {self.on_signal!r}"
            )
        for signum in self.signals:
            try:
                name = signal.Signals(signum).name
            except ValueError:
                raise ConfigError(f"save_on: {signum!r} is not a signal number") from None
            if signum in _UNCATCHABLE:
                raise ConfigError(f"save_on: {name} cannot be caught, so nothing can save on it")
        if self.on_signal != "reraise" and not self.signals:
            raise ConfigError(f"on_signal={self.on_signal!r} needs save_on: no signal to act on")
        if self.continuous and self.sync:
            raise ConfigError(
                "continuous=True saves whenever no save is in flight, and with sync=True none "
                "ever is: every step would save and wait (for that, give every=1)"
            )
        full_every = self.full_every
        if full_every is not None and not self.incremental:
            raise ConfigError(f"full_every={full_every} needs incremental=True")
        if full_every is not None and full_every < 1:
            raise ConfigError(f"full_every must be >= 1, got {full_every}")
        if full_every is not None and full_every <= self.every and not self.continuous:
            raise ConfigError(
                f"full_every={full_every} <= every={self.every}: each save on the schedule "
                "would start a window of its own, so none would be incremental"
            )

    @property
    def signals(self) -> tuple[int, ...]:
        """The signals of ``save_on``, as a tuple."""
        return _signals(self.save_on)

    @property
    def schedule(self) -> int | None:
        """The steps retention's ``keep_last`` counts: with ``continuous``, only ``every``'s
        (its extra saves are kept only while one of them is the newest); else all."""
        return self.every if self.continuous else None

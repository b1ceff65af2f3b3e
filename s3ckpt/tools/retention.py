"""Which of a run's committed steps stay: a `CheckpointManager`'s retention and ``s3ckpt
prune``'s (when the manager saves is its `SavePolicy`). Pure: no I/O. What its checkpoints are
called (``run/step-<step>``) is `s3ckpt.format.layout.step_name`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["Retention"]


def _at_least_one(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{name} must be None or >= 1, got {value}")


@dataclass(frozen=True)
class Retention:
    """The committed steps a run keeps: the newest, always; the ``keep_last`` most recent; every
    step that is a multiple of ``keep_every``; every step for which ``keep(step)`` is true. With
    no rule at all, everything is kept. The policy of a `CheckpointManager` (``retention=``) and
    of ``s3ckpt prune``.

    The methods' ``schedule`` (`SavePolicy.schedule`: the manager's ``every`` under the continuous
    policy) restricts ``keep_last`` to the steps on that schedule: the extra saves of the
    continuous policy are kept only while one of them is the newest. It is the save policy's,
    not part of this one, so one `Retention` means the same to the manager and to ``prune``.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep: Callable[[int], bool] | None = None

    def __post_init__(self) -> None:
        _at_least_one("keep_last", self.keep_last)
        _at_least_one("keep_every", self.keep_every)

    @property
    def deletes(self) -> bool:
        """Whether any rule is set (without one, nothing is ever deleted)."""
        return self.keep_last is not None or self.keep_every is not None or self.keep is not None

    def kept(self, steps: Iterable[int], schedule: int | None = None) -> set[int]:
        """The steps of ``steps`` (committed ones) that stay."""
        ordered = sorted(set(steps))
        if not ordered or not self.deletes:
            return set(ordered)
        kept = {ordered[-1]}
        if self.keep_last is not None:
            scheduled = [s for s in ordered if schedule is None or s % schedule == 0]
            kept.update(scheduled[-self.keep_last :])
        if self.keep_every is not None:
            kept.update(s for s in ordered if s % self.keep_every == 0)
        if self.keep is not None:
            kept.update(s for s in ordered if self.keep(s))
        return kept

    def victims(self, steps: Iterable[int], schedule: int | None = None) -> list[int]:
        """The steps of ``steps`` to delete, oldest first."""
        listed = set(steps)
        return sorted(listed - self.kept(listed, schedule))

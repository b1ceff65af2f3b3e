"""How the ranks of a run agree: the process groups a manager creates once, and its one small
collective.

Background saves run DCP's collectives on their own gloo group, so that they never interleave with
training's; the manager's agreements (whether to save now, a signal, which checkpoint to load) run
on a second one, from the training thread, while a background save may be using the first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Agreement", "groups", "release"]


class Agreement:
    """The ranks' common view of a few integers: one ``all_reduce`` (MAX) on a gloo group of its
    own; without a process group, the values as given."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0

    @property
    def distributed(self) -> bool:
        return self.group is not None

    @property
    def coordinator(self) -> bool:
        """Rank 0 of the group: the one that commits, and so the one that applies retention."""
        return self.rank == 0

    def maximum(self, *values: int) -> list[int]:
        """Each value's maximum over the ranks (every rank must call this, in the same order)."""
        if self.group is None:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return [int(value) for value in tensor.tolist()]


def groups(
    process_group: dist.ProcessGroup | None,
) -> tuple[dist.ProcessGroup | None, Agreement, list[dist.ProcessGroup]]:
    """The group saves and loads run on (a new gloo group unless ``process_group`` is given),
    the agreement over its own gloo group of the same ranks, and the groups created here (for
    `release`). Creating groups is itself collective: every rank of the default group calls
    this, once per manager."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, Agreement(None), []
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    saving = process_group if process_group is not None else dist.new_group(backend="gloo")
    agreement = dist.new_group(ranks=ranks, backend="gloo")
    created = [agreement] if process_group is not None else [saving, agreement]
    return saving, Agreement(agreement), created


def release(created: list[dist.ProcessGroup]) -> None:
    """Destroy the groups `groups` created (each holds sockets and threads), unless the default
    group is gone already, which took them with it."""
    if dist.is_available() and dist.is_initialized():
        for group in created:
            dist.destroy_process_group(group)
    created.clear()

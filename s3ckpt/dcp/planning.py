"""`CachingSavePlanner`: DCP's save-plan caching, made safe for `S3Writer` and for a state whose
structure changes between saves.

With ``DefaultSavePlanner(enable_plan_caching=True)`` (torch 2.13) a rank whose local plan
looks unchanged sends an empty plan; the coordinator then skips DCP's gather, global planning
and validation, and scatters empty plans back, for which each rank reuses its cached final plan.
Two things go wrong with that as torch ships it:

- the cached final plan carries the storage data of the save that cached it: for `S3Writer`
  that is the earlier save's id, so a later save would write into the committed checkpoint's
  directory (the writer refuses such a plan, see `S3Writer.write_data`);
- "unchanged" is judged by names, offsets and shapes only: a tensor whose dtype (or other
  properties) changed, or a state dict nested differently under the same flattened names,
  reuses the old plan and metadata, and the record would describe the old state.

This planner compares whole items and the flattening's mappings, on the ranks and again on the
coordinator's global plans, and keeps the fresh storage data the writer attached to an empty
plan. Its cache is its own (not shared with other planners in the process); `forget` drops it.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

__all__ = ["CachingSavePlanner"]

_CACHES = (
    SavePlanner._cached_save_plan,
    SavePlanner._cached_final_save_plan,
    SavePlanner._cached_all_plans,
    SavePlanner._cached_global_plan,
    SavePlanner._cached_metadata,
)


class CachingSavePlanner(DefaultSavePlanner):
    """A `DefaultSavePlanner` with plan caching on: repeated saves of a state with the same
    structure skip DCP's plan exchange; any change of structure plans afresh."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(enable_plan_caching=True, **kwargs)
        # torch keys its class-level caches by class name: one key per planner keeps two
        # planners (two managers, or a user's own planner) from reusing each other's plans.
        self._cached_plans_key = f"{type(self).__name__}-{secrets.token_hex(8)}"

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if plan.usable:
            return plan
        cached = SavePlanner._cached_save_plan[self._cached_plans_key]
        if _same(self.plan, cached):
            return plan
        self._pending_local_plan = self.plan  # promoted to the cache by `finish_plan`
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        before = SavePlanner._cached_global_plan.get(self._cached_plans_key)
        delta, metadata = super().create_global_plan(all_plans)
        if before is None or len(before) != len(delta):
            return delta, metadata
        # A rank whose final plan changed in more than torch compares gets it in full.
        fresh = [
            sent if sent.usable or _same(old, new) else new
            for sent, old, new in zip(delta, before, self.global_plan, strict=True)
        ]
        return fresh, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        finished = super().finish_plan(new_plan)
        if not new_plan.usable:
            # The cached plan's storage data is an earlier save's; the writer's is this one's.
            finished = dataclasses.replace(finished, storage_data=new_plan.storage_data)
            self.plan = finished
        return finished

    def forget(self) -> None:
        """Drop this planner's cached plans and metadata (the next save plans afresh)."""
        for cache in _CACHES:
            cache.pop(self._cached_plans_key, None)


def _same(plan: SavePlan, other: SavePlan) -> bool:
    """Whether two plans describe the same items, properties included, and the same nesting."""
    if plan.planner_data != other.planner_data or len(plan.items) != len(other.items):
        return False
    return all(_key(a) == _key(b) for a, b in zip(plan.items, other.items, strict=True))


def _key(item: WriteItem) -> tuple[Any, ...]:
    # ``index.index`` is a lookup hint that equality ignores but DCP uses; a BYTE_IO item's
    # size is the pickled value's, which may change without the structure changing.
    return (item.index, item.index.index, item.type, item.tensor_data)

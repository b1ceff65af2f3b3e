"""What a manager saves and restores: the training objects themselves.

A module, an optimizer or any DCP ``Stateful`` goes into the state as itself. DCP asks a
``Stateful`` for its state when a save starts (so each save holds the state of that moment, and
``async_save`` stages exactly that) and hands a load's result back to it. Modules and optimizers
are wrapped in one that uses torch's ``torch.distributed.checkpoint.state_dict`` helpers, which
give FSDP2/DTensor state for resharding and, for an optimizer that has never stepped, build its
moments, so that a restore into a fresh optimizer has somewhere to load them. Plain state dicts
pass through unchanged.

A plain optimizer state dict taken before the first step (``opt.state_dict()`` built once,
before the loop) holds no moments and never will: `warn_stateless` says so, naming the key.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

from ..errors import ConfigError

__all__ = ["ModuleState", "OptimizerState", "stateful", "warn_stateless"]

log = logging.getLogger(__name__)


class ModuleState(Stateful):
    """A module's state, keyed by parameter name (sharded as the module is)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.module, state_dict)


class OptimizerState(Stateful):
    """An optimizer's state keyed by the names of its parameters in ``module`` (not by their
    position), so that it loads on another world size or sharding."""

    def __init__(self, module: nn.Module, optimizer: Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.module, self.optimizer, state_dict)


def stateful(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each module and optimizer wrapped; an optimizer is named by the module of
    ``values`` that holds all its parameters (or by all of them together)."""
    modules = {key: value for key, value in values.items() if isinstance(value, nn.Module)}
    state: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, nn.Module):
            state[key] = ModuleState(value)
        elif isinstance(value, Optimizer):
            state[key] = OptimizerState(_owner(key, value, modules), value)
        else:
            state[key] = value
    return state


def _owner(key: str, optimizer: Optimizer, modules: dict[str, nn.Module]) -> nn.Module:
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    held = {name: {id(p) for p in module.parameters()} for name, module in modules.items()}
    for name, ids in held.items():
        if wanted <= ids:
            return modules[name]
    if held and wanted <= set().union(*held.values()):
        return nn.ModuleDict(dict(sorted(modules.items())))
    raise ConfigError(
        f"the optimizer {key!r} updates parameters of no module in the state "
        f"({sorted(modules) or 'none given'}): add the model it trains, e.g. "
        f"{{'model': model, {key!r}: optimizer}}"
    )


def warn_stateless(url: str, step: int, values: dict[str, Any], warned: set[str]) -> None:
    """Warn once per key about a plain optimizer state dict with no per-parameter state saved
    after step 0: the snapshot ``opt.state_dict()`` taken before the first step."""
    if step <= 0:
        return
    for key, value in values.items():
        if key in warned or not _stateless_optimizer(value):
            continue
        warned.add(key)
        log.warning(
            "%s: %r is an optimizer state dict with no state at step %d: taken before the "
            "first step, it never holds the moments, and a restore resumes with fresh ones. "
            "Pass the optimizer itself (%r: optimizer, beside the model): its state is then "
            "taken at each save",
            url,
            key,
            step,
            key,
        )


def _stateless_optimizer(value: Any) -> bool:
    if not (isinstance(value, dict) and {"state", "param_groups"} <= value.keys()):
        return False
    groups = value["param_groups"]
    has_params = isinstance(groups, list) and any(
        isinstance(g, dict) and g.get("params") for g in groups
    )
    return not value["state"] and has_params

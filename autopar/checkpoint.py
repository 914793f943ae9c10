"""Checkpoints with torch.distributed.checkpoint (DCP).

Each rank writes its shards as DTensors (the placements its plan gives them), so a
checkpoint can be loaded by another plan or another mesh: DCP reshards on load.
Optimizer state tensors shaped like their parameter (AdamW's moments) are laid out like
it; scalar state (the step count) is replicated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from autopar.runtime import ParallelModule

# State an elementwise optimizer creates lazily at its first step; made here (zeros) so a
# fresh ParallelModule can receive a checkpoint before it has taken a step.
_LAZY_STATE = {
    "AdamW": ("exp_avg", "exp_avg_sq"), "Adam": ("exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",),
}


def _state_dict(pm: ParallelModule, create_missing: bool) -> dict[str, Any]:
    specs = pm.parameter_specs()
    model, optim = {}, {}
    for name, shard in zip(pm.shard_names, pm.shards):
        spec = specs[name]
        model[name] = DTensor.from_local(shard.data, pm.mesh, spec, run_check=False)
        if pm.optimizer is None:
            continue
        state = pm.optimizer.state[shard]
        if create_missing and not state:
            _create_state(pm.optimizer, shard, state)
        optim[name] = {
            key: DTensor.from_local(value, pm.mesh, spec, run_check=False)
            if isinstance(value, torch.Tensor) and value.shape == shard.shape and value.dim() > 0
            else value
            for key, value in state.items()
        }
    return {"model": model, "optim": optim}


def _create_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, state: dict) -> None:
    keys = _LAZY_STATE.get(type(optimizer).__name__)
    if keys is None:
        raise ValueError(
            f"autopar: cannot load optimizer state into a {type(optimizer).__name__} that has not "
            f"stepped yet (known: {sorted(_LAZY_STATE)}); take one step first or use one of those"
        )
    for key in keys:
        state[key] = torch.zeros_like(param)
    state["step"] = torch.tensor(0.0)


def save(pm: ParallelModule, path: str | Path) -> None:
    """Write parameters and optimizer state; call on every rank."""
    dcp.save(_state_dict(pm, create_missing=False), checkpoint_id=str(path))


def load(pm: ParallelModule, path: str | Path) -> None:
    """Read a checkpoint into ``pm``'s own layout (any plan or mesh wrote it); every rank."""
    state = _state_dict(pm, create_missing=True)
    dcp.load(state, checkpoint_id=str(path))
    for name, shard in zip(pm.shard_names, pm.shards):
        with torch.no_grad():
            shard.copy_(state["model"][name].to_local())
        if pm.optimizer is None:
            continue
        opt_state = pm.optimizer.state[shard]
        for key, value in state["optim"][name].items():
            if isinstance(value, DTensor):
                opt_state[key].copy_(value.to_local())
            elif isinstance(value, torch.Tensor):
                opt_state[key].copy_(value)
            else:
                opt_state[key] = value
    pm.parameters_updated()

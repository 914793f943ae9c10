"""``autopar.compile``: a model, a device mesh and example inputs -> a ParallelModule."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.runtime import ParallelModule
from passes.capture import capture
from passes.plan import Plan
from passes.strategies import build_strategy_graph


def compile(  # noqa: A001  (the public name users expect)
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: tuple,
    *,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    plan: Plan | None = None,
    hardware: Any = None,
    check_inputs: bool = True,
) -> ParallelModule:
    """Capture ``model``, plan it for ``mesh`` (or replay ``plan``) and build this rank's part.

    Call it on every rank with the same model weights (same seed, or loaded from the
    same checkpoint) and the same example inputs (the whole batch).
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"autopar: expected a torch DeviceMesh (torch.distributed.device_mesh.init_device_mesh), "
            f"found {type(mesh).__name__}; to plan without devices use autopar.plan(model, shape, ...)"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*_check_is_size.*")
        captured = capture(model, example_inputs)
    graph = build_strategy_graph(captured, tuple(mesh.shape))
    if plan is None:
        from passes.planner import plan_graph  # the planner: imported only when planning

        plan = plan_graph(graph, hardware=hardware, axis_names=mesh.mesh_dim_names)
    return ParallelModule(model, captured, graph, plan, mesh, loss_fn, optimizer, check_inputs)

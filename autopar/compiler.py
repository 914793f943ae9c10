"""``autopar.compile``: a model, a device mesh and example inputs -> a ParallelModule."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
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
    hardware: Any = None,  # a HardwareProfile or preset name for planning; None: measure this mesh
    check_inputs: bool = True,
) -> ParallelModule:
    """Capture ``model``, plan it for ``mesh`` (or replay ``plan``) and build this rank's part.

    Call it on every rank with the same model weights (same seed, or loaded from the
    same checkpoint) and the same example inputs (the whole batch).

    ``check_inputs``: every ``train_step`` and ``loss`` given the whole batch checks that
    every rank was given the same one (a checksum per input, one small all-reduce that
    runs alongside the step; a mismatch is an ``autopar:`` error raised before the
    optimizer step). Pass False to skip it when the batches are known to agree (one
    seeded loader on every rank); ``local=True`` steps are never checked.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"autopar: expected a torch DeviceMesh (torch.distributed.device_mesh.init_device_mesh), "
            f"found {type(mesh).__name__}; to plan without devices use autopar.plan(model, shape, ...)"
        )
    if plan is None:
        plan = plan_once(model, mesh, example_inputs, hardware)
    if plan.pipeline is not None:
        return _compile_pipeline(model, mesh, example_inputs, loss_fn, optimizer, plan)
    captured = capture(model, example_inputs)
    graph = build_strategy_graph(captured, tuple(mesh.shape))
    return ParallelModule(model, captured, graph, plan, mesh, loss_fn, optimizer, check_inputs)


def plan_once(model: nn.Module, mesh: DeviceMesh, example_inputs: tuple, hardware: Any = None,
              **options: Any) -> Plan:
    """Plan on rank 0 and give every rank the same plan (planning under a time limit need
    not give the same answer twice). ``hardware`` None: this machine's profile, measured
    on this mesh once and cached (``autopar profile``); ``options`` go to ``autopar.plan``
    (``time_limit_s``, ``layout``, ...)."""
    if hardware is None:
        from costmodels.profiler import profile_mesh

        hardware, _, _ = profile_mesh(tuple(mesh.shape), mesh.mesh_dim_names, progress=False)
    text = [None]
    if dist.get_rank() == 0:
        from autopar.planning import plan as make_plan

        text[0] = make_plan(model, mesh, example_inputs, hardware=hardware, **options).to_json()
    dist.broadcast_object_list(text, src=0)
    return Plan.from_json(text[0])


def _compile_pipeline(model, mesh, example_inputs, loss_fn, optimizer, plan: Plan):
    """A pipeline plan's strategies are for one micro-batch on the intra-op axes."""
    from autopar.pipeline import PipelineModule

    pp = plan.pipeline
    if plan.model == "WithLoss":  # its stages were cut from another graph than the model's own
        raise ValueError(
            "autopar: this pipeline plan was made for the model and its loss together (autopar.plan(..., "
            "loss_fn=...)), found the model alone; to train with it, plan without loss_fn (autopar.compile "
            "lays the loss out itself)"
        )
    if tuple(mesh.shape) != tuple(plan.mesh_shape):
        raise ValueError(
            f"autopar: the plan is for a mesh of shape {plan.mesh_shape}, found {tuple(mesh.shape)}; "
            "re-plan for this mesh, or run on the mesh the plan was made for"
        )
    micro = tuple(x.chunk(pp.micro_batches)[0] for x in example_inputs)
    if any(m.shape[0] * pp.micro_batches != x.shape[0] for m, x in zip(micro, example_inputs)):
        raise ValueError(
            f"autopar: the batch ({example_inputs[0].shape[0]}) must divide into {pp.micro_batches} "
            "equal micro-batches; change the batch size or the plan's micro-batch count"
        )
    captured = capture(model, micro)
    intra = tuple(s for i, s in enumerate(mesh.shape) if i != pp.axis)
    graph = build_strategy_graph(captured, intra)
    return PipelineModule(model, captured, graph, plan, mesh, loss_fn, optimizer)

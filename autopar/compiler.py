"""``autopar.compile``: a model, a device mesh and example inputs -> a ParallelModule."""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.runtime.faults import PeerFailure, failures_shared
from autopar.runtime.inference import InferenceModule
from autopar.runtime.pipeline import PipelineModule
from autopar.planning import plan as make_plan
from autopar.runtime.meshes import plan_mesh, require_usable
from autopar.runtime.module import ParallelModule
from autopar.runtime.precision import Precision, capture_cast, recorded_policy, warn_under_autocast
from autopar.costmodels.compute import dtype_name
from autopar.costmodels.profile import DTYPES, MissingRates
from autopar.costmodels.profiler import profile_mesh
from autopar.passes.capture import capture
from autopar.passes.generation import Inference
from autopar.passes.plan import Plan
from autopar.passes.planner.constraints import Constraints
from autopar.passes.strategy_graph import build_strategy_graph


@failures_shared("compile")
def compile(  # noqa: A001  (the public name users expect)
    model: nn.Module,
    mesh: DeviceMesh,
    example_inputs: tuple = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    plan: Plan | None = None,
    hardware: Any = None,  # a HardwareProfile or preset name for planning; None: measure this mesh
    check_inputs: bool = True,
    mp_policy: torch.distributed.fsdp.MixedPrecisionPolicy | None = None,
    inference: Inference | None = None,
    constraints: Constraints | None = None,
    accumulate: int = 1,
) -> ParallelModule | PipelineModule | InferenceModule:
    """Capture ``model``, plan it for ``mesh`` (or replay ``plan``) and build this rank's part.

    Call it on every rank with the same model weights (same seed, or loaded from the
    same checkpoint) and the same example inputs (the whole batch).

    ``check_inputs``: every ``train_step`` and ``loss`` given the whole batch checks that
    every rank was given the same one (a checksum per input, one small all-reduce that
    runs alongside the step; a mismatch is an ``autopar:`` error raised before the
    optimizer step). Pass False to skip it when the batches are known to agree (one
    seeded loader on every rank); ``local=True`` steps are never checked.

    ``example_kwargs``: keyword inputs (Hugging Face ``input_ids=``, ``labels=``); steps
    then take the inputs as a dict (or a pair (positional tuple, keyword dict) when both
    are used). ``loss_fn`` None: the model's own loss is trained (an output's ``.loss``,
    e.g. with ``labels=`` among the inputs; steps take target None), laid out like any
    loss. ``pm.data_parallel`` says how the plan splits the batch, for per-rank data.

    ``mp_policy``: mixed precision as FSDP2's policy says (e.g. ``param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32``): parameters and optimizer state stay in their dtype (the
    master copy, stored as the plan says), compute runs in ``param_dtype``, gradients are
    reduced in ``reduce_dtype``; pipeline stages too (what crosses a stage boundary is in
    ``param_dtype``). A plan made here is priced as the policy runs (``autopar.plan(...,
    mp_policy=)``) and records it; a given plan that records one runs under it when
    ``mp_policy`` is None. ``torch.autocast`` around planning or running is not priced: an
    ``autopar.runtime.precision.AutocastWarning`` says so and names the policy instead.

    ``constraints``: pins for the plan made here (``autopar.Constraints``, as ``autopar.plan``
    takes them); a pipeline pinned here takes the mesh's whole outermost axis.

    ``accumulate``: the plan made here is for steps accumulating gradients over this many
    micro-batches of the example batch (``autopar.plan(..., accumulate=)``); ``train_step`` runs
    that many by default (``Plan.accumulate``, which a given plan brings with it).
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"autopar: expected a torch DeviceMesh (torch.distributed.device_mesh.init_device_mesh), "
            f"found {type(mesh).__name__}; to plan without devices use autopar.plan(model, shape, ...)"
        )
    require_usable(mesh)
    _require_real_weights(model)
    if accumulate != 1 and plan is not None:
        raise ValueError(f"autopar: compile(plan=...) runs the plan as it is, with its own accumulate "
                         f"({plan.accumulate}), and accumulate={accumulate} is for a plan made here; pass one of the "
                         "two (autopar.plan(..., accumulate=) makes such a plan to pass)")
    if inference is not None or (plan is not None and plan.inference is not None):
        if plan is None:
            plan = plan_once(model, mesh, (), hardware, inference=inference, accumulate=accumulate)
        elif inference is not None and Inference.of(plan.inference) != inference:
            raise ValueError(f"autopar: compile(inference={inference}) was given a plan made for {plan.inference}; "
                             "pass one of the two")
        return InferenceModule(model, plan, mesh)
    if optimizer is not None:
        optimizer = _checked_factory(_required_factory(optimizer))
    planned_here = plan is None
    if constraints is not None and not planned_here:
        raise ValueError("autopar: compile(plan=...) runs the plan as it is, and constraints= pins a plan made here; "
                         "pass one of the two (autopar.plan(..., constraints=) makes a pinned plan to pass)")
    if not planned_here:  # (planning here warns itself)
        warn_under_autocast("compiling a plan", stacklevel=3)
    if plan is None:
        # pipelines take positional inputs and a loss_fn (the model's own loss is not cut into stages yet)
        keywords = {"example_kwargs": example_kwargs, "pipeline": False} if example_kwargs else {}
        plan = plan_once(model, mesh, example_inputs, hardware, mp_policy=mp_policy, constraints=constraints,
                         accumulate=accumulate, **keywords)
    mesh = plan_mesh(mesh, tuple(plan.mesh_shape), tuple(plan.axis_names))  # the plan's split of the user's axes
    if mp_policy is None:  # a saved plan priced under a policy replays under it
        mp_policy = recorded_policy(plan.mp_policy)
    if plan.pipeline is not None:
        if example_kwargs or loss_fn is None:
            raise ValueError(
                "autopar: a pipeline plan takes positional example inputs and a loss_fn; found "
                f"{'example_kwargs ' + str(sorted(example_kwargs)) if example_kwargs else 'loss_fn=None'}; pass "
                "the inputs positionally with a loss_fn, or use a plan without a pipeline"
            )
        pm = _compile_pipeline(model, mesh, example_inputs, loss_fn, optimizer, plan, mp_policy)
    else:
        captured = _captured(model, example_inputs, example_kwargs, mp_policy)
        if loss_fn is None and optimizer is not None:
            _require_own_loss(captured)
        graph = build_strategy_graph(captured, tuple(mesh.shape))
        pm = ParallelModule(model, captured, graph, plan, mesh, loss_fn, optimizer, check_inputs, mp_policy)
    if planned_here:
        _say_data_parallel(pm)
    return pm


def _required_factory(optimizer: Any) -> Callable:
    """``optimizer=`` is a factory of the optimizer over the parameters autopar hands it (this
    rank's shards), not an optimizer built on the model's own parameters."""
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        found = (f"an optimizer instance ({type(optimizer).__name__}; its parameters are the model's, which autopar replaces "
                 "by this rank's shards)" if isinstance(optimizer, torch.optim.Optimizer)
                 else f"{type(optimizer).__name__}, which is not callable")
        raise TypeError(
            f"autopar: expected optimizer= a factory that builds the optimizer from the parameters it is given; "
            f"found {found}; pass e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)"
        )
    return optimizer


def _require_real_weights(model: nn.Module) -> None:
    """compile runs the model: weights on the meta device have no values to shard."""
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(
            f"autopar: autopar.compile runs the model, so it expected weights with values; found {len(meta)} "
            f"parameters or buffers on the meta device (e.g. {meta[0]!r}); materialise them first "
            "(model.to_empty(device=\"cpu\"), then load or initialise the weights), or plan without devices: "
            "autopar.plan(model, mesh_shape, ...)"
        )


def _checked_factory(factory: Callable) -> Callable:
    """The optimizer factory, with the check that it made an optimizer."""
    @functools.wraps(factory)
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        made = factory(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise TypeError(
                f"autopar: expected the optimizer factory to return a torch.optim.Optimizer for the parameters it "
                f"is given; it returned {type(made).__name__}; return the optimizer, e.g. "
                "lambda params: torch.optim.AdamW(params, lr=1e-3)"
            )
        return made
    return make


def _require_own_loss(captured: Any) -> None:
    """loss_fn None trains the model's own loss: its output must carry one."""
    keys = getattr(captured.out_spec, "context", None) or []
    if "loss" not in keys:
        raise ValueError(
            f"autopar: compiled with an optimizer and loss_fn=None, so the model's own loss is trained; expected "
            f"an output with .loss (Hugging Face: pass labels= in example_kwargs); found outputs {list(keys)}; "
            "pass labels=, or loss_fn="
        )


def _say_data_parallel(pm: Any) -> None:
    """The auto plan may keep the batch whole on some axes (tensor parallel there): tell
    the user who feeds per-rank data that not every rank gets its own rows."""
    dp, ranks = pm.data_parallel, pm.mesh.size()
    if dp.num_replicas < ranks and dist.get_rank() == 0:
        names = pm.mesh.mesh_dim_names or tuple(str(a) for a in range(pm.mesh.ndim))
        warnings.warn(
            f"autopar: the plan splits the batch over {dp.num_replicas} of the {ranks} ranks ("
            f"{'mesh axes ' + str([names[a] for a in dp.axes]) if dp.axes else 'no mesh axis'}); with per-rank data (local=True) give a DistributedSampler "
            "pm.data_parallel.num_replicas and .rank, not the world size and rank", stacklevel=3)


def plan_once(model: nn.Module, mesh: DeviceMesh, example_inputs: tuple, hardware: Any = None,
              **options: Any) -> Plan:
    """Plan on rank 0 and give every rank the same plan (planning under a time limit need
    not give the same answer twice). ``hardware`` None: this machine's profile, measured
    on this mesh once and cached (``autopar profile``); ``options`` go to ``autopar.plan``
    (``time_limit_s``, ``layout``, ...). Planning that fails on rank 0 is broadcast in the
    plan's place: every rank raises it (``PeerFailure`` on the others) instead of waiting."""
    measured = hardware is None
    dtypes = compute_dtypes(model, example_inputs, options.get("mp_policy"))
    while True:
        if measured:  # a bar on rank 0
            hardware, _, _ = profile_mesh(tuple(mesh.shape), mesh.mesh_dim_names, progress=True, dtypes=dtypes)
        text: list[Any] = [None]
        if dist.get_rank() == 0:
            print(f"autopar: planning {type(model).__name__} for mesh {tuple(mesh.shape)} on rank 0 ...",
                  file=sys.stderr, flush=True)
            try:
                text[0] = make_plan(model, mesh, example_inputs, hardware=hardware, **options).to_json()
            except MissingRates as exc:
                if not measured or exc.dtype in dtypes:
                    dist.broadcast_object_list([PeerFailure(0, "planning", str(exc), here=0)], src=0)
                    raise
                text[0] = ("measure", exc.dtype)  # the model computes in a dtype not seen: measure it, plan again
            except Exception as exc:
                dist.broadcast_object_list([PeerFailure(0, "planning", f"{type(exc).__name__}: {exc}", here=0)], src=0)
                raise
        dist.broadcast_object_list(text, src=0)
        if isinstance(text[0], PeerFailure):
            raise PeerFailure(text[0].rank, text[0].what, text[0].error, here=dist.get_rank())
        if not isinstance(text[0], tuple):
            return Plan.from_json(text[0])
        dtypes = (*dtypes, text[0][1])


def compute_dtypes(model: nn.Module, example_inputs: tuple, mp_policy: Any = None) -> tuple[str, ...]:
    """The dtypes a plan of ``model`` prices compute in, as far as can be told before
    capture: fp32 (optimizers step in it), its floating parameters' and buffers', its
    floating example inputs', and ``mp_policy``'s ``param_dtype``. A dtype the model casts
    to inside is found by planning (``MissingRates``) and measured then."""
    tensors = [*model.parameters(), *model.buffers(),
               *(t for t in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor))]
    found = {t.dtype for t in tensors if t.is_floating_point()}
    if mp_policy is not None and mp_policy.param_dtype is not None:
        found.add(mp_policy.param_dtype)
    names = {dtype_name(d) for d in found if d in (torch.float32, torch.bfloat16, torch.float16)}
    return tuple(d for d in DTYPES if d == DTYPES[0] or d in names)


def _compile_pipeline(model, mesh, example_inputs, loss_fn, optimizer, plan: Plan, mp_policy=None):
    """A pipeline plan's strategies are for one micro-batch on the intra-op axes (under
    ``mp_policy``, of the model as it computes under the policy)."""
    pp = plan.pipeline
    if plan.includes_loss:  # its stages were cut from another graph than the model's own
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
    captured = _captured(model, micro, None, mp_policy)
    intra = tuple(s for i, s in enumerate(mesh.shape) if i != pp.axis)
    graph = build_strategy_graph(captured, intra)
    return PipelineModule(model, captured, graph, plan, mesh, loss_fn, optimizer, mp_policy)


def _captured(model: nn.Module, inputs: tuple, kwargs: dict[str, Any] | None, mp_policy: Any):
    """The model's program as it computes (under ``mp_policy``: ``capture_cast``)."""
    precision = Precision.of(mp_policy)
    return capture(model, inputs, kwargs) if precision is None else capture_cast(capture, model, precision)(inputs, kwargs)

"""Pipeline-parallel training: the plan's stages run by torch.distributed.pipelining.

The graph, captured at micro-batch size, is cut into the plan's stages (``stage_parts``):
each stage receives the values that later stages need (passing on those it does not use
itself) and the state it owns. On each rank, every stage it holds is lowered on the
intra-op mesh (the mesh without the pipeline axis), so a stage can itself be tensor or
data parallel. GPipe, 1F1B and interleaved 1F1B come from torch's schedules.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import Partial
from torch.utils import _pytree as pytree

from autopar.gradsync import Rider, sync_gradients
from autopar.runtime import build_loss_program, mesh_device, whole
from passes.capture import Captured
from passes.recompute import layers_to_recompute, plan_layers, recompute_layers
from passes.codegen import Part, RankProgram, lower
from passes.placements import local_slice
from passes.plan import Plan, choice_from_plan
from passes.strategies import StrategyGraph

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}


def stage_parts(captured: Captured, stage_of: dict[str, int], n_stages: int) -> list[Part]:
    """Cut the graph into stages; every value crosses each boundary between where it is
    made and where it is last used."""
    order = {n: i for i, n in enumerate(captured.nodes())}
    stage: dict[fx.Node, int] = {}
    for node in captured.nodes("call_function"):
        if node.name not in stage_of:
            raise ValueError(f"autopar: the plan's pipeline gives no stage for node {node.name}; re-plan")
        stage[node] = stage_of[node.name]
    user_inputs = [n for n in captured.nodes("placeholder") if n.name in captured.user_inputs]
    state = [n for n in captured.nodes("placeholder") if n.name not in captured.user_inputs]
    output_node = next(iter(captured.nodes("output")))
    outputs = [x for x in pytree.tree_leaves(output_node.args[0]) if isinstance(x, fx.Node)]

    made_at = {n: -1 for n in user_inputs} | stage  # user inputs arrive before stage 0
    last_use: dict[fx.Node, int] = {}
    for node, s in stage.items():
        for src in node.all_input_nodes:
            if src in made_at:
                last_use[src] = max(last_use.get(src, -1), s)
    for node in outputs:
        last_use[node] = n_stages
    for node in state:  # state lives in the one stage that uses it
        users = {stage[u] for u in node.users if u in stage}
        if len(users) > 1 and captured.params.get(node.name):
            raise ValueError(
                f"autopar: parameter {captured.params[node.name]} is used by stages {sorted(users)}; "
                "a pipeline needs each parameter in one stage (untie it, or cut elsewhere)"
            )

    def crossing(boundary: int) -> list[fx.Node]:  # made before the boundary, used after
        values = [n for n, s in made_at.items() if s <= boundary < last_use.get(n, -2)]
        return sorted(values, key=order.get)

    parts = []
    for s in range(n_stages):
        nodes = {n for n, st in stage.items() if st == s}
        own_state = sorted({src for n in nodes for src in n.all_input_nodes if src in state}, key=order.get)
        received = user_inputs if s == 0 else crossing(s - 1)
        sends = outputs if s == n_stages - 1 else crossing(s)
        parts.append(Part(nodes=nodes, inputs=own_state + received, outputs=sends))
    return parts


class _Stage(nn.Module):
    """One stage's program with the state it owns; called with what it receives."""

    def __init__(self, program: RankProgram, state: list[torch.Tensor], params: nn.ParameterList):
        super().__init__()
        self.program = program.gm
        self.saving = program.saving  # gathered weights it frees are saved as references
        self.params = params
        self.state = state

    def forward(self, *received: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # send/recv move dense buffers: views (an expand, a transpose) are packed first,
        # on the way out and for the gradients that go back.
        received = tuple(_DenseGrad.apply(t) if t.requires_grad else t for t in received)
        with self.saving():
            outs = self.program(*self.state, *received)
        return tuple(t.contiguous() for t in outs)


class _DenseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class PipelineModule(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        captured: Captured,
        graph: StrategyGraph,
        plan: Plan,
        mesh: DeviceMesh,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ):
        super().__init__()
        pp = plan.pipeline
        sharded_state = sorted({z for fqn, z in plan.zero.items() if z in (1, 2) and "S(" in plan.params.get(fqn, "")})
        if sharded_state:  # stages hold parameters as their ops use them (ZeRO-3 is a placement: it runs)
            warnings.warn(
                f"autopar: this pipeline plan stores parameters at ZeRO level(s) {sharded_state}; pipeline stages "
                "hold them as their ops use them, with the optimizer state whole, so memory per rank is above "
                "plan.predicted.memory (the training itself is the same); plan with zero levels 0 or 3 for "
                "pipelines to have memory as predicted", stacklevel=3)
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError("autopar: a pipeline plan needs a mesh with axis names (init_device_mesh(..., mesh_dim_names=...))")
        self.plan, self.mesh, self.captured, self.loss_fn = plan, mesh, captured, loss_fn
        intra_names = tuple(n for i, n in enumerate(names) if i != pp.axis)
        self.intra = mesh[intra_names] if intra_names else None
        self.pp_group = mesh.get_group(pp.axis)
        self.pp_rank = mesh.get_coordinate()[pp.axis]
        # the stages' activations travel on the mesh's device (nccl: this rank's GPU)
        self.device = mesh_device(mesh)
        n_stages = pp.stages * pp.chunks_per_rank
        choice = choice_from_plan(graph, plan)
        parts = stage_parts(captured, pp.stage_of, n_stages)
        values = captured.state_values(model)
        coord = tuple(self.intra.get_coordinate()) if self.intra is not None else ()
        intra_shape = tuple(self.intra.shape) if self.intra is not None else ()
        self.params = nn.ParameterList()
        self.shard_names: list[str] = []
        self.stages: list[PipelineStage] = []
        self.programs: list[RankProgram] = []
        self.stage_state: list[dict[str, torch.Tensor]] = []
        self.parts = parts
        layer_of = plan_layers(plan)
        for index in range(self.pp_rank, n_stages, pp.stages):
            part = parts[index]
            program = lower(graph, choice, self.intra, part=part)
            mine = layers_to_recompute(plan.recompute) & {layer_of.get(n.name) for n in part.nodes}
            program.gm = recompute_layers(program.gm, layer_of, mine)
            state, own, named = [], nn.ParameterList(), {}
            for node in part.inputs:
                if node.name not in values:
                    continue
                spec = program.input_specs.get(node.name)
                local = values[node.name].detach()
                local = (local_slice(local, spec, intra_shape, coord) if spec else local).to(self.device, copy=True)
                if node.name in captured.params:
                    local = nn.Parameter(local, requires_grad=values[node.name].requires_grad)
                    own.append(local)
                    self.params.append(local)
                    self.shard_names.append(captured.params[node.name])
                state.append(local)
                named[node.name] = local
            module = _Stage(program, state, own)
            self.stage_state.append(named)
            self.programs.append(program)
            self.stages.append(PipelineStage(module, index, n_stages, self.device, group=self.pp_group))
        self.optimizer = optimizer(list(self.params))
        self._loss = None
        self.schedule = None

    def _build_schedule(self, target_micro: torch.Tensor) -> None:
        pp = self.plan.pipeline
        last = self.programs[-1] if self.stages[-1].is_last else None
        if last is not None:
            out_specs = last.output_specs
            out_metas = [n.meta["val"] for n in self.parts[-1].outputs]
            # a data-parallel loss stays this rank's share of the sum (backward from a share is
            # backward from the sum); the shares are summed once per step, with the gradients
            self._loss = build_loss_program(self.loss_fn, self.captured.out_spec, out_metas, out_specs,
                                            target_micro, self.intra, reduce_output=False)
        schedule_cls = SCHEDULES[pp.schedule]
        stage_arg = self.stages if schedule_cls is ScheduleInterleaved1F1B else self.stages[0]
        self.schedule = schedule_cls(stage_arg, pp.micro_batches, loss_fn=self._micro_loss)

    def _micro_loss(self, outputs: Any, target: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss: this rank's share of it where the loss is a pending sum."""
        program, cap = self._loss
        outs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        values = dict(zip(cap.user_inputs, [*outs, target]))
        flat = pytree.tree_leaves(program.gm(*[values[n] for n in cap.placeholders]))
        return flat[cap.user_outputs[0]]

    def _loss_axes(self) -> tuple[int, ...]:
        """The intra-op axes over which the loss is a pending sum (its shares' axes)."""
        program, cap = self._loss
        spec = program.output_specs[cap.user_outputs[0]] or ()
        return tuple(a for a, p in enumerate(spec) if isinstance(p, Partial))

    def _micro_batched(self, x: torch.Tensor, spec) -> torch.Tensor:
        """This rank's shard of each micro-batch, stacked so the schedule's chunking finds them."""
        pieces = x.to(self.device).chunk(self.plan.pipeline.micro_batches)
        if self.intra is None or spec is None:
            return torch.cat(pieces)
        return torch.cat([local_slice(p, spec, self.intra.shape, self.intra.get_coordinate()) for p in pieces])

    def train_step(self, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch, then the optimizer step; returns the
        mean loss over micro-batches (the batch mean for equal micro-batches) on every rank."""
        pp = self.plan.pipeline
        if self.schedule is None:
            self._build_schedule(target.chunk(pp.micro_batches)[0])
        self.optimizer.zero_grad(set_to_none=True)
        first = self.programs[0]
        args = [self._micro_batched(x, first.input_specs.get(n.name))
                for x, n in zip(pytree.tree_leaves(inputs), self.parts[0].inputs[-len(pytree.tree_leaves(inputs)):])]
        kwargs: dict[str, Any] = {}
        losses: list[torch.Tensor] = []
        if self.stages[-1].is_last:
            program, cap = self._loss
            kwargs["target"] = self._micro_batched(target, program.input_specs[cap.user_inputs[-1]])
            kwargs["losses"] = losses
        if self.stages[0].is_first:
            self.schedule.step(*args, **kwargs)
        else:
            self.schedule.step(**kwargs)
        if losses:
            total = torch.stack(losses).mean().detach()
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.intra is not None:
            for program, named in zip(self.programs, self.stage_state):
                # the last stage's loss shares are summed along with its gradients
                riders = [Rider(total, self._loss_axes())] if losses and program is self.programs[-1] else []
                # stages differ in their axes: no group is made for them (flatten=False)
                sync_gradients(program.grad_sync, named, self.intra, riders, flatten=False)
        self.optimizer.step()
        total = total.to(torch.float64)
        dist.all_reduce(total, group=self.pp_group)  # only the last stage holds it
        return total

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on every rank (collectives over the whole mesh)."""
        mine = {}
        for stage_program, stage in zip(self.programs, self.stages):
            module = stage.submod
            for node, local in zip([n for n in self.parts[stage.stage_index].inputs if n.name in self.captured.params],
                                   module.params):
                spec = stage_program.input_specs.get(node.name)
                value = whole(local.detach(), spec, self.intra) if self.intra is not None and spec else local.detach()
                mine[self.captured.params[node.name]] = value
        gathered: list[dict] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        return {k: v for d in gathered for k, v in d.items()}

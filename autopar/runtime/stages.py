"""A pipeline's stages on this rank: the graph cut where the plan cuts it, each stage
lowered on the intra-op mesh (the mesh without the pipeline axis) and wrapped as a
``torch.distributed.pipelining.PipelineStage``.

``stage_parts`` cuts the captured graph: each stage receives the values that later stages
need (passing on those it does not use itself) and the state it owns. ``lower_stages``
lowers this rank's stages of one capture (``Stages``: one micro-batch shape in one mode)
by the plan's strategies; ``autopar.runtime.pipeline.PipelineModule`` drives them.

Each stage is built with what it receives and sends (``stage_io``: shapes, dtypes, which
carry a gradient), known from the capture, so that torch infers nothing: its inference runs
a stage on uninitialised tensors, where a received index (int64 positions read by
``gather``) points anywhere, and a stage that fails there leaves its peers waiting.

A split backward (zero bubble) makes a stage's weight gradients as torch does, one pass per
group of weights, unless a group starts from more than one op (a ZeRO-3 bucket's): then in one
pass (``SplitBackwardStage``, ``weight_gradients``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward_weight
from torch.utils import _pytree as pytree

from autopar.costmodels import Schedule
from autopar.passes.capture import Captured, retarget_devices
from autopar.passes.costing import carrying_gradient
from autopar.passes.lowering.codegen import Part, RankProgram, lower
from autopar.passes.lowering.recompute import layers_to_recompute, plan_layers, recompute_layers
from autopar.passes.placements import local_shape
from autopar.passes.plan import Plan
from autopar.passes.planner.relayout import relayout_stages
from autopar.passes.strategy_graph import StrategyGraph
from autopar.runtime.draws import Draws
from autopar.runtime.precision import Precision, apply_precision


def weight_gradients(weights, groups: list[dict[str, Any]] | None) -> tuple:
    """A split backward's weight-gradient part: torch's ``stage_backward_weight`` over the
    groups of weights ``stage_backward_input`` made, one ``autograd.grad`` per group, each
    freeing what it ran through; or, where a group starts from more than one op, the groups
    merged into one pass.

    A group starts from one op (a matmul, a norm) unless one value ties its weights: a ZeRO-3
    bucket, gathered in one call, ties a layer's matmuls. Such a group's pass runs from its later
    ops back to its earlier ones through the activations between them, and there through any op
    of another group (a norm kept whole): its pass freed that op's backward for the op's own
    group. Merged, each op runs once; torch's clamps on every start (each gets the gradient the
    input-gradient part recorded) count each gradient once, as within a group. Groups of one op
    each run alone: merged, every pass would run the activations' path again to reach the
    earlier weights (and keep the graph longer: one pass per group keeping it costs half again
    a stage's activations)."""
    if groups and len(groups) > 1 and any(len(g["intermediates"]) > 1 for g in groups):
        groups = [{"params": set().union(*(g["params"] for g in groups)),
                   "intermediates": [i for g in groups for i in g["intermediates"]],
                   "grads": [grad for g in groups for grad in g["grads"]]}]
    return stage_backward_weight(list(weights), groups or [])


class SplitBackwardStage(PipelineStage):
    """torch's ``PipelineStage`` whose split backward makes its weight gradients with
    ``weight_gradients``."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "weight":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # a stage's module is ours, never DDP or FSDP: torch runs it as below
        return weight_gradients(self.submod.parameters(), bwd_kwargs["param_groups"]), None


@dataclass
class Stages:
    """This rank's stages of the model captured at one micro-batch shape in one mode (train,
    or eval: dropout off), with their schedule and loss (made at first use). The variants
    of a PipelineModule run on the same state (``PipelineModule.state``)."""

    captured: Captured
    parts: list[Part]
    programs: list[RankProgram]
    stages: list[PipelineStage]
    stage_state: list[dict[str, torch.Tensor]]
    schedule: Any = None
    loss: tuple[RankProgram, Captured] | None = None
    trains: bool = False  # the schedule runs backward (made with a loss), not forward only
    micro_batches: int = 1  # the batch's micro-batches a schedule run of these stages cuts


def stage_parts(captured: Captured, stage_of: dict[str, int], n_stages: int, shared_state: bool = False) -> list[Part]:
    """Cut the graph into stages; every value crosses each boundary between where it is
    made and where it is last used. A parameter read by two stages (a tied embedding and
    head) is refused, unless ``shared_state`` (serving: no gradient to sum, each stage holds
    its own copy)."""
    order = {n: i for i, n in enumerate(captured.nodes())}
    stage: dict[fx.Node, int] = {}
    for node in captured.nodes("call_function"):
        if node.name not in stage_of:
            raise ValueError(f"autopar: the plan's pipeline gives no stage for node {node.name}; re-plan")
        stage[node] = stage_of[node.name]
        later = [src.name for src in node.all_input_nodes if stage.get(src, -1) > stage[node]]
        if later:  # a value would have to travel back to an earlier stage
            raise ValueError(
                f"autopar: the plan's pipeline runs {node.name} in stage {stage[node]} but its input {later[0]} in "
                f"stage {stage_of[later[0]]}; expected every value to flow to the same or a later stage; re-plan")
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
        if len(users) > 1 and captured.params.get(node.name) and not shared_state:
            raise ValueError(
                f"autopar: parameter {captured.params[node.name]} is used by stages {sorted(users)}; "
                "a pipeline needs each parameter in one stage (untie it, or cut elsewhere)"
            )

    def crossing(boundary: int) -> list[fx.Node]:  # made before the boundary, used after
        values = [n for n, s in made_at.items() if s <= boundary < last_use.get(n, -2)]
        return sorted(values, key=order.get)

    parts = []
    is_state = set(state)  # looked up for every input of every node: a list cost seconds per 405B stage build
    for s in range(n_stages):
        nodes = {n for n, st in stage.items() if st == s}
        own_state = sorted({src for n in nodes for src in n.all_input_nodes if src in is_state}, key=order.get)
        received = user_inputs if s == 0 else crossing(s - 1)
        sends = outputs if s == n_stages - 1 else crossing(s)
        parts.append(Part(nodes=nodes, inputs=own_state + received, outputs=sends))
    return parts


class _Stage(nn.Module):
    """One stage's program with the state it owns; called with what it receives."""

    def __init__(self, program: RankProgram, state: list[torch.Tensor], params: nn.ParameterList,
                 sends_gradient: tuple[bool, ...]):
        super().__init__()
        self.program = program.gm
        self.saving = program.saving  # gathered weights it frees are saved as references
        self.params = params
        self.state = state
        self.sends_gradient = sends_gradient  # per output: whether a gradient comes back for it
        self._draws: Draws | None = None  # the module's random stream, and the count of this run's first forward
        self._first = self._calls = 0

    def start(self, draws: Draws, first: int) -> None:
        """A schedule run begins: its j-th forward here is micro-batch j, drawing as run ``first + j``."""
        self._draws, self._first, self._calls = draws, first, 0

    def forward(self, *received: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # send/recv move dense buffers: views (an expand, a transpose) are packed first,
        # on the way out and for the gradients that go back.
        received = tuple(_DenseGrad.apply(t) if t.requires_grad else t for t in received)
        count, self._calls = self._first + self._calls, self._calls + 1
        drawing = self._draws.run(count) if self._draws is not None else contextlib.nullcontext()
        with self.saving(), drawing:
            outs = self.program(*self.state, *received)
        # an output sent without a gradient (a no-grad region's, made from a parameter) leaves
        # detached: the next stage sends none back for it, and backward needs none
        return tuple(t.contiguous() if graded else t.detach().contiguous()
                     for t, graded in zip(outs, self.sends_gradient, strict=True))


class _DenseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def stage_io(part: Part, program: RankProgram, received: list[fx.Node], graded: set[fx.Node],
             intra_shape: tuple[int, ...]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """What a stage receives (``received``, of ``part.inputs``) and sends, as meta tensors for
    ``PipelineStage``'s ``input_args`` and ``output_args``: this rank's shard of each value
    (placed as ``program`` receives and sends it on the intra-op mesh of ``intra_shape``) at
    the micro-batch size the stage was captured at, in its captured dtype, and requiring a
    gradient where one flows back (``graded``: ``carrying_gradient``, as the dry run has it)."""

    def meta(node: fx.Node, spec: Any) -> torch.Tensor:
        val = node.meta["val"]
        shape = tuple(val.shape) if spec is None else local_shape(tuple(val.shape), spec, intra_shape)
        return torch.empty(shape, dtype=val.dtype, device="meta").requires_grad_(node in graded)

    inputs = tuple(meta(n, program.input_specs.get(n.name)) for n in received)
    outputs = tuple(meta(n, spec) for n, spec in zip(part.outputs, program.output_specs, strict=True))
    return inputs, outputs


@dataclass(frozen=True)
class StagePlace:
    """Where this rank's stages run: the intra-op mesh (None: the pipeline axis is the whole
    mesh), this rank's coordinate on the pipeline axis and its process group, the device."""

    intra: DeviceMesh | None
    pp_rank: int
    pp_group: Any
    device: torch.device


def lower_stages(captured: Captured, graph: StrategyGraph, choice: dict, plan: Plan, place: StagePlace,
                 take: Callable[[Captured, str, Any], torch.Tensor], precision: Precision | None = None,
                 micro_batches: int | None = None, sync_as: dict[str, tuple[int, ...]] | None = None) -> Stages:
    """This rank's stages of ``captured`` (those the plan's schedule places here, ascending:
    ``Schedule.stages_of``), cut where the plan cuts and lowered by the
    strategies ``choice`` (of ``graph``) on the intra-op mesh; ``take(captured, placeholder,
    spec)`` gives each stage's state. Under ``precision`` (``captured`` as the model computes
    under it: ``capture_cast``) each stage computes on cast copies of the master state it
    is given (``apply_precision``), so what crosses a boundary is in ``param_dtype``.
    ``micro_batches``: how many a schedule run cuts the batch into (None: the plan's).
    ``sync_as``: the gradient sums of the compiled stages, by fqn, which these follow."""
    pp = plan.pipeline
    n_stages = pp.stages * pp.chunks_per_rank
    parts = stage_parts(captured, relayout_stages(captured, plan), n_stages)
    layer_of = plan_layers(plan)
    state_names = {*captured.params, *captured.buffers, *captured.constant_values}
    variant = Stages(captured, parts, [], [], [], micro_batches=micro_batches or pp.micro_batches)
    # ZeRO-3 parameters are gathered per use and freed, gathered again in backward: a stage
    # does not keep a gathered copy for each micro-batch in flight
    per_use = frozenset(ph for ph, fqn in captured.params.items() if plan.zero.get(fqn, 0) == 3)
    graded = carrying_gradient(captured)
    intra_shape = tuple(place.intra.shape) if place.intra is not None else ()
    for index in Schedule.parse(pp.schedule).stages_of(place.pp_rank, pp.stages, pp.chunks_per_rank):
        part = parts[index]
        program = lower(graph, choice, place.intra, per_use, part=part, sync_as=sync_as)
        named = {n.name: take(captured, n.name, program.input_specs.get(n.name))
                 for n in part.inputs if n.name in state_names}
        if precision is not None:  # before the split: it finds the gathers and readers of each parameter there
            apply_precision(program, captured, named, precision)
        mine = layers_to_recompute(plan.recompute) & {layer_of.get(n.name) for n in part.nodes}
        program.gm = retarget_devices(recompute_layers(program.gm, layer_of, mine), place.device)
        own = nn.ParameterList([t for name, t in named.items() if name in captured.params])
        variant.stage_state.append(named)
        variant.programs.append(program)
        received = [n for n in part.inputs if n.name not in state_names]
        inputs, outputs = stage_io(part, program, received, graded, intra_shape)
        module = _Stage(program, list(named.values()), own, tuple(t.requires_grad for t in outputs))
        variant.stages.append(SplitBackwardStage(module, index, n_stages, place.device, input_args=inputs,
                                                 output_args=outputs, group=place.pp_group))
    return variant

"""A dry run's pipeline step: torch's schedules exchange activations by send/recv between
stages, which one process holding one rank at a time cannot run. The schedule's own action
list for this rank (``schedule.pipeline_order``) is replayed instead: each forward runs the
stage's program on fake received activations of the shapes the stage expects, each backward
starts from fake gradients of its outputs (the last stage: from the loss), with the
micro-batches in flight exactly as the schedule keeps them. ``check_stage_boundaries`` then
compares the shapes one stage sends with those the next expects, across ranks.

Fewer micro-batches, the same peak: a rank's memory at any moment is set by how many
micro-batches each of its stages holds, which stages have made their gradients, and the
action it runs; the micro-batch's number changes nothing (every micro-batch has the same
size). ``replayed_micro_batches`` finds the fewest micro-batches M' whose schedule takes
every rank through exactly the (state, action) pairs the plan's M do -- warm-up, steady
state and cool-down -- so replaying M' micro-batches of the plan's size gives the same peak
and breakdown as replaying all M, in M'/M of the time (1F1B: P + 1; interleaved: three
rounds of P; GPipe, whose in-flight count is M: all M). A split backward's input-gradient
part (``I``) and weight-gradient part (``W``) are actions of their own (DualPipe-V runs some
backwards whole, ``B``, between them; ``costmodels.memory.numbered`` pairs each W with its I)."""

from __future__ import annotations

import torch
from torch.distributed.pipelining._backward import stage_backward_input

from autopar.costmodels.memory import numbered, schedule_actions
from autopar.costmodels.schedules import Schedule
from autopar.dryrun.results import RankResult
from autopar.passes.costing import carrying_gradient
from autopar.passes.placements import local_shape
from autopar.runtime.pipeline import PipelineModule
from autopar.runtime.stages import weight_gradients


def pipeline_step(pm: PipelineModule, inputs: tuple, target: torch.Tensor,
                   stage_io: dict[int, dict[str, list]] | None, micro_batches: int | None = None) -> None:
    """One training step of this rank's stages, in the order its schedule runs them
    (torch's ``pipeline_order``, ``costmodels.memory.schedule_actions``), then the gradients'
    sums and the optimizer step, as ``PipelineModule.train_step`` does after its schedule.
    A split backward (zero bubble) runs as torch's ``PipelineStage`` runs it: its input
    gradients by ``stage_backward_input`` (stage 0: none), its weight gradients later by
    ``stages.weight_gradients`` from what that kept (stage 0: its whole backward then).
    ``micro_batches``: how many of the plan's micro-batches to replay (the schedule made for
    that many, each of the plan's size; default all, see ``replayed_micro_batches``)."""
    pp = pm.plan.pipeline
    replayed = micro_batches or pp.micro_batches
    pm._build_loss(target.chunk(pp.micro_batches)[0])  # reads the shape alone
    pm.zero_grad()
    pm.start_draws()  # its micro-batches' random ops draw as the schedule's would
    # what the runtime moves to this rank's device for the step: the first stage's rows of the
    # inputs, the last stage's of the target (the whole batch: host memory, not tracked)
    inputs = pm._stage_inputs(inputs) if pm.stages[0].is_first else None
    target = pm._stage_target(target) if pm.stages[-1].is_last else None
    if Schedule.parse(pp.schedule).split_backward:
        pm.split_backward_stages()  # as the runtime's schedule construction makes them
    stages = {stage.stage_index: (stage, program) for stage, program in zip(pm.stages, pm.programs)}
    in_flight: dict[tuple[int, int], tuple] = {}
    awaiting_weights: dict[tuple[int, int], object] = {}  # a split backward's kept state, until its W
    order = schedule_actions(pp.schedule, pp.stages, replayed, pp.chunks_per_rank)[pm.pp_rank]
    for kind, index, mb in numbered(order):
        stage = stages[index][0]
        if kind == "F":
            program = stages[index][1]
            received = _received(pm, index, program, inputs, mb)
            outputs = stage.submod(*received)
            if stage_io is not None and mb == 0:
                stage_io.setdefault(index, {})["expects"] = [_shape(t) for t in received]
                stage_io[index]["sends"] = [_shape(t) for t in outputs]
            if stage.is_last:
                outputs = (pm._micro_loss(outputs, _micro_target(pm, target, mb)),)
            in_flight[index, mb] = (received, outputs)
            continue
        if kind == "W":
            kept = awaiting_weights.pop((index, mb))
            if index == 0:  # torch's stage 0 runs its whole backward at its W
                torch.autograd.backward(*kept)
            else:
                weight_gradients(stage.submod.parameters(), kept)
            continue
        received, outputs = in_flight.pop((index, mb))
        needs = [t for t in outputs if t.requires_grad]
        grads = None if stage.is_last else [torch.zeros_like(t) for t in needs]  # received: fake, of the outputs' shapes
        if kind == "B":
            torch.autograd.backward(needs, grads)
        elif index == 0:
            awaiting_weights[index, mb] = (needs, grads)
        else:
            awaiting_weights[index, mb] = stage_backward_input(needs, grads, received, stage.submod.parameters())[1]
    pm._sum_gradients(None)  # as train_step: summed once (ZeRO-2: reduce-scattered into the optimizer's slices)
    pm.step()  # the optimizer step, then (ZeRO-1/2) the whole parameters gathered from the slices


def replayed_micro_batches(schedule: str | Schedule, stages: int, micro_batches: int, chunks: int = 1) -> int:
    """The fewest micro-batches M' <= ``micro_batches`` that ``schedule`` can run and whose
    order takes every pipeline rank through the same set of (state, action) pairs as the
    plan's ``micro_batches`` (``_states``): the same peak memory, replayed in M'/M of the time."""
    schedule = Schedule.parse(schedule)
    whole = [_states(order) for order in schedule_actions(schedule, stages, micro_batches, chunks)]
    for m in range(1, micro_batches):
        if not schedule.micro_batch_problem(stages, m) and \
                [_states(order) for order in schedule_actions(schedule, stages, m, chunks)] == whole:
            return m
    return micro_batches


def _states(order: tuple[tuple[str, int], ...]) -> set[tuple]:
    """Every (micro-batches each stage holds, of them those awaiting their weight gradients,
    stages whose gradients exist, action) a rank's ``order`` of (kind, stage) passes through:
    what its memory at each action depends on."""
    held: dict[int, int] = {}
    awaiting: dict[int, int] = {}
    with_gradients: set[int] = set()
    seen = set()
    for kind, stage in order:
        seen.add((tuple(sorted(held.items())), tuple(sorted(awaiting.items())), frozenset(with_gradients), kind, stage))
        if kind == "F":
            held[stage] = held.get(stage, 0) + 1
        elif kind == "I":
            awaiting[stage] = awaiting.get(stage, 0) + 1
        else:  # B or W: the micro-batch's activations go, the stage's gradients exist
            held[stage] -= 1
            awaiting[stage] = awaiting.get(stage, 0) - (kind == "W")
            with_gradients.add(stage)
    return seen


def _received(pm: PipelineModule, index: int, program, inputs: tuple, mb: int) -> list[torch.Tensor]:
    """What stage ``index`` receives for micro-batch ``mb``: its piece of the first stage's
    rows of the user inputs (``inputs``, as ``PipelineModule._stage_inputs`` makes them;
    stage 0), or fake activations of the local shapes the stage's program expects."""
    if index == 0:
        return [x.chunk(pm.plan.pipeline.micro_batches)[mb] for x in inputs]  # as the schedule splits them
    cap = pm.captured
    held = {*cap.params, *cap.buffers, *cap.constant_values}  # state: the stage's own, not received
    received = [n for n in pm.parts[index].inputs if n.name not in held]
    intra = tuple(pm.intra.shape) if pm.intra is not None else ()
    # as torch's PipelineStage: a received value needs a gradient where the sender made it with
    # one (rotary cos/sin made from buffers do not; their backward would keep q and k)
    graded = carrying_gradient(cap)
    out = []
    for node in received:
        val = node.meta["val"]
        spec = program.input_specs.get(node.name)
        shape = local_shape(tuple(val.shape), spec, intra) if spec is not None else tuple(val.shape)
        out.append(torch.zeros(shape, dtype=val.dtype, device=pm.device, requires_grad=node in graded))
    return out


def _micro_target(pm: PipelineModule, target: torch.Tensor, mb: int) -> torch.Tensor:
    """Micro-batch ``mb``'s piece of the last stage's rows of the target (``_stage_target``)."""
    return target.chunk(pm.plan.pipeline.micro_batches)[mb]


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype


def check_stage_boundaries(stage_io: dict[int, dict[str, list]], results: list[RankResult]) -> None:
    """What each stage sends is what the next stage expects (shapes and dtypes, this rank's
    shard): a failure is the receiving stage's rank's."""
    holder = {s: r for r in results if r.ok for s in r.stages}
    for s, io in sorted(stage_io.items()):
        nxt = stage_io.get(s + 1)
        if nxt is None or "sends" not in io or s + 1 not in holder:
            continue
        if io["sends"] != nxt["expects"]:
            r = holder[s + 1]
            r.ok = False
            r.error = (f"autopar: stage {s + 1} expects to receive {_shapes(nxt['expects'])}, stage {s} "
                       f"(rank {holder[s].rank}) sends {_shapes(io['sends'])}")


def _shapes(items: list) -> str:
    return "[" + ", ".join(f"{list(s)} {str(d).replace('torch.', '')}" for s, d in items) + "]"

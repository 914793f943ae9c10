"""A dry run's pipeline step: torch's schedules exchange activations by send/recv between
stages, which one process holding one rank at a time cannot run. The schedule's own action
list for this rank (``schedule.pipeline_order``) is replayed instead: each forward runs the
stage's program on fake received activations of the shapes the stage expects, each backward
starts from fake gradients of its outputs (the last stage: from the loss), with the
micro-batches in flight exactly as the schedule keeps them. ``check_stage_boundaries`` then
compares the shapes one stage sends with those the next expects, across ranks."""

from __future__ import annotations

import torch
from torch.distributed.pipelining.schedules import _ComputationType
from torch.utils import _pytree as pytree

from autopar.dryrun_results import RankResult
from autopar.passes.placements import local_shape, local_slice
from autopar.runtime.pipeline import PipelineModule


def pipeline_step(pm: PipelineModule, inputs: tuple, target: torch.Tensor,
                   stage_io: dict[int, dict[str, list]] | None) -> None:
    """One training step of this rank's stages, in the order its schedule runs them
    (``schedule.pipeline_order``), then the gradients' sums and the optimizer step, as
    ``PipelineModule.train_step`` does after its schedule."""
    pp = pm.plan.pipeline
    if pm.schedule is None:
        pm._build_schedule(target.chunk(pp.micro_batches)[0])  # the loss program and torch's schedule
    pm.zero_grad()
    stages = {stage.stage_index: (stage, program) for stage, program in zip(pm.stages, pm.programs)}
    in_flight: dict[tuple[int, int], tuple] = {}
    for kind, index, mb in _actions(pm.schedule.pipeline_order[pm.pp_rank]):
        if kind == _ComputationType.FORWARD:
            stage, program = stages[index]
            received = _received(pm, index, program, inputs, mb)
            outputs = stage.submod(*received)
            if stage_io is not None and mb == 0:
                stage_io.setdefault(index, {})["expects"] = [_shape(t) for t in received]
                stage_io[index]["sends"] = [_shape(t) for t in outputs]
            if stage.is_last:
                outputs = (pm._micro_loss(outputs, _micro_target(pm, target, mb)),)
            in_flight[index, mb] = (received, outputs)
        elif kind == _ComputationType.FULL_BACKWARD:
            _, outputs = in_flight.pop((index, mb))
            needs = [t for t in outputs if t.requires_grad]
            grads = [None if stages[index][0].is_last else torch.zeros_like(t) for t in needs]
            torch.autograd.backward(needs, grads)  # received gradients: fake, of the outputs' shapes
        elif kind != _ComputationType.REDUCE_GRAD:  # summed below, for every stage at once
            raise ValueError(f"autopar: the dry run replays forward and full-backward actions; found {kind} of stage {index} "
                             f"in schedule {pp.schedule}")
    pm._sum_gradients(None)  # as train_step: summed once (ZeRO-2: reduce-scattered into the optimizer's slices)
    pm.step()  # the optimizer step, then (ZeRO-1/2) the whole parameters gathered from the slices


def _actions(order: list) -> list[tuple]:
    """(kind, stage, micro-batch) of each action of a rank's ``pipeline_order``, the
    micro-batches numbered in the order each stage runs them: every torch schedule runs a
    stage's forwards, and its backwards, in micro-batch order, and torch 2.13's 1F1B order
    numbers the last stage's from 1 (``Schedule1F1B._get_pipeline_order``: its first forward is
    micro-batch 1, its last M), which its ``_step_microbatches`` does not."""
    seen: dict[tuple, int] = {}
    out = []
    for action in order:
        if action is None:
            continue
        key = (action.computation_type, action.stage_index)
        out.append((*key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return out


def _received(pm: PipelineModule, index: int, program, inputs: tuple, mb: int) -> list[torch.Tensor]:
    """What stage ``index`` receives for micro-batch ``mb``: this rank's shard of the user
    inputs (stage 0), or fake activations of the local shapes the stage's program expects."""
    cap = pm.captured
    held = {*cap.params, *cap.buffers, *cap.constant_values}  # state: the stage's own, not received
    received = [n for n in pm.parts[index].inputs if n.name not in held]
    if index == 0:
        flat = pytree.tree_leaves(inputs)
        out = []
        for x, node in zip(flat, received[-len(flat):]):
            piece = x.chunk(pm.plan.pipeline.micro_batches)[mb]
            spec = program.input_specs.get(node.name)
            out.append(local_slice(piece, spec, pm.intra.shape, pm.intra.get_coordinate())
                       if pm.intra is not None and spec is not None else piece)
        return out
    intra = tuple(pm.intra.shape) if pm.intra is not None else ()
    out = []
    for node in received:
        val = node.meta["val"]
        spec = program.input_specs.get(node.name)
        shape = local_shape(tuple(val.shape), spec, intra) if spec is not None else tuple(val.shape)
        out.append(torch.zeros(shape, dtype=val.dtype, device=pm.device, requires_grad=val.dtype.is_floating_point))
    return out


def _micro_target(pm: PipelineModule, target: torch.Tensor, mb: int) -> torch.Tensor:
    piece = target.chunk(pm.plan.pipeline.micro_batches)[mb]
    if pm.intra is None:
        return piece
    program, cap = pm._loss
    return local_slice(piece, program.input_specs[cap.user_inputs[-1]], pm.intra.shape, pm.intra.get_coordinate())


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

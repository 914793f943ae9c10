"""Price a GIVEN layout: a manual intra-op layout, optionally inside a pipeline whose stage
count, micro-batches and schedule are fixed, with the run's own activation checkpointing
(every repeated layer, or none: ``Pinned.recompute``) or else the fewest recomputed layers
that fit; ``breakdown`` says where the predicted step goes.

The planner's searches pick those choices themselves (``planner_pipeline.pipeline_plan``
chooses stages, micro-batches and schedule; ``layout=`` costs intra-op layouts only). A
published training run fixes every one of them; ``price_pinned`` costs exactly that run
with the planner's own functions, so its prediction and the auto plan's compare like
with like (``benchmarks/published.py``):

- intra-op (``stages == 1``): the layout (``hint_of(graph)``, completed by
  ``planner.complete``) costed on the whole mesh by ``costing.build_costs``, with the
  fewest repeated layers recomputed that fit ``memory_limit`` (``planner.cost_layout``,
  as the planner costs its own manual candidates);
- pipelined: the layout completed on the intra-op mesh (the mesh without the ``stages``
  taken out of its outermost axis, as ``planner.factorisations`` splits it), its
  per-layer numbers (``layer_numbers``) cut into stages for exactly
  that micro-batch count and schedule by ``planner_pipeline.search``, which recomputes
  the fewest layers that fit, as the auto plan's pipelines do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from autopar import costmodels
from autopar.costmodels.units import gib_text
from autopar.passes.costing import Costs, build_costs
from autopar.passes.planner.intra_op import PlanningError, complete, cost_layout
from autopar.passes.planner.layout_rules import Hint
from autopar.passes.planner.microbatch import batch_size, batch_split
from autopar.passes.solve import PlanCosts, plan_costs
from autopar.passes.planner.layer_numbers import LayerNumbers, layer_numbers
from autopar.passes.planner.pipeline import pipeline_profile, search
from autopar.passes.planner.request import PlanRequest
from autopar.passes.plan import check_accumulate
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph


RECOMPUTE_POLICIES = ("fit", "full", "none")


@dataclass(frozen=True, kw_only=True)
class Pinned:
    """A layout as a published run fixed it."""

    layout: str  # a manual intra-op layout (autopar.layouts), e.g. "fsdp", "tp+dp", "fsdp+tp"
    stages: int = 1  # pipeline stages over the mesh's outermost axis (1: no pipeline)
    micro_batches: int = 1
    schedule: costmodels.Schedule = costmodels.Schedule.ONE_F_ONE_B  # or its name, e.g. "interleaved_1f1b"
    # chunks (virtual stages) per rank of an interleaved schedule; 2, the planner's own, where
    # the run does not say
    chunks: int = 2
    # activation checkpointing as the run states it (RECOMPUTE_POLICIES): "fit", the fewest
    # repeated layers that fit the memory limit (the planner's own rule, for a run that does
    # not say); "full", every repeated layer; "none", no layer. A run that fixed its
    # recomputation was made as it was: "full" and "none" are priced whatever memory the
    # model predicts, and a note says where that is over the limit.
    recompute: str = "fit"
    # micro-batches each step accumulates, their gradients synced once (``autopar.plan(...,
    # accumulate=)``); a capture to price is of one of them (``Captured.accumulate``)
    accumulate: int = 1

    def __post_init__(self) -> None:
        check_accumulate(self.accumulate)
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"autopar: no recomputation policy {self.recompute!r}; expected one of "
                             f"{RECOMPUTE_POLICIES}")
        if self.stages < 1 or self.micro_batches < 1 or self.chunks < 1:
            raise ValueError(f"autopar: a pinned layout expects positive stages, micro-batches and chunks per "
                             f"rank; found {self.stages} stages, {self.micro_batches} micro-batches, "
                             f"{self.chunks} chunks")
        try:
            object.__setattr__(self, "schedule", costmodels.Schedule.parse(self.schedule))
        except ValueError:
            raise ValueError(f"autopar: no pipeline schedule {self.schedule!r}; expected one of "
                             f"{[s.value for s in costmodels.Schedule]}") from None


@dataclass
class PinnedCost:
    """What the cost model predicts for a pinned layout (``fits`` False: nothing fits;
    ``step_time`` then inf and ``memory`` the least found)."""

    step_time: float  # seconds per training step
    memory: float  # bytes on the fullest device
    recomputed: int  # repeated layers recomputed in backward (all stages together)
    layers: int  # repeated layers in the model
    fits: bool
    notes: list[str] = field(default_factory=list)
    # seconds per step on one GPU by where they go (``breakdown``); empty when nothing fits
    parts: dict[str, float] = field(default_factory=dict)


BREAKDOWN_PARTS = ("compute", "recompute", "activation comm", "parameter comm", "optimizer", "p2p", "bubble",
                   "hidden comm")


def breakdown(num: LayerNumbers, *, stages: int = 1, recomputed: int = 0, folded: bool = True,
              pipeline_time: float | None = None, sends: float = 0.0, overlap: PlanCosts | None = None
              ) -> dict[str, float]:
    """A step's seconds on one GPU by where they go, from the per-layer numbers of the whole
    batch on the intra-op mesh (``layer_numbers``): forward + backward compute, the forwards
    that recomputed layers run again, activation collectives (tensor parallel), parameter
    collectives (gradient sync, ZeRO gathers; paid once per step) as far as they are exposed,
    the optimizer step, and for a pipeline (``pipeline_time``: the schedule's part of the step)
    the point-to-point sends of one rank and the bubble, which is what the schedule's time
    leaves over the rank's share of the work. Every part but the last sums to the step; the
    last, "hidden comm", is what ran beside compute and hid behind it (``overlap``: the plan's
    ``PlanCosts``, whose ``excess`` is exposed parameter communication the tables leave out).
    ``recomputed``: repeated layers recomputed, all stages together; ``folded``: their forward
    is in ``num.compute`` already (costs built with them recomputed, ``costing.build_costs``),
    rather than added by the stage search."""
    recompute = recomputed * float(num.forward.mean()) if len(num.forward) else 0.0
    hidden, excess = (overlap.hidden, overlap.excess) if overlap is not None else (0.0, 0.0)
    parts = {
        "compute": (float(num.compute.sum()) - (recompute if folded else 0.0)) / stages,
        "recompute": recompute / stages,
        "activation comm": float((num.act_time - num.compute).sum()) / stages,
        "parameter comm": (float((num.param_time - num.optimizer).sum()) + excess) / stages,
        "optimizer": float(num.optimizer.sum()) / stages,
        "p2p": float(sends),
        "bubble": 0.0,
        "hidden comm": hidden / stages,
    }
    if pipeline_time is not None:
        busy = parts["compute"] + parts["recompute"] + parts["activation comm"] + sends
        parts["bubble"] = float(pipeline_time - busy)
    return parts


def price_pinned(captured, shape: tuple[int, ...], hardware: str, hint_of: Callable[[StrategyGraph], Hint],
                 pinned: Pinned, *, memory_limit: float) -> PinnedCost:
    """The predicted step of ``pinned`` on mesh ``shape`` (a preset's name as ``hardware``)."""
    if captured.accumulate != pinned.accumulate:
        raise ValueError(f"autopar: a layout pinned with accumulate={pinned.accumulate} is priced on the capture of "
                         f"one micro-batch marked so; found a capture of accumulate={captured.accumulate}; capture "
                         f"1/{pinned.accumulate} of the batch and set its accumulate (autopar.plan(..., accumulate=) "
                         "does both)")
    if pinned.stages == 1:
        profile = costmodels.preset(hardware, shape)
        return _intra_op(build_strategy_graph(captured, shape), profile, hint_of, pinned, memory_limit)
    return _pipelined(captured, shape, hardware, hint_of, pinned, memory_limit)


def _completed(costs: Costs, hint_of, pinned: Pinned) -> Hint:
    hint = hint_of(costs.graph)
    if hint.choice is None:
        hint.choice = complete(costs, hint)
    if hint.choice is None:
        raise PlanningError(f"autopar: layout {pinned.layout!r} contradicts this model's structure on mesh "
                            f"{costs.graph.mesh_shape} (it breaks tied layers or followers); expected a layout "
                            "that places repeated layers alike; pick another layout")
    return hint


def _with_policy(costs: Costs, pinned: Pinned) -> Costs:
    """``costs`` (none recomputed) rebuilt with every repeated layer recomputed where the run
    used full activation checkpointing."""
    if pinned.recompute != "full":
        return costs
    return build_costs(costs.graph, costs.profile, recompute=True, pricer=costs.pricer)


def _over_limit(memory: float, memory_limit: float) -> list[str]:
    if memory <= memory_limit:
        return []
    return [f"predicted {gib_text(memory)} per GPU, over the device's {gib_text(memory_limit)}, with "
            "the run's own recomputation"]


def _intra_op(graph: StrategyGraph, profile, hint_of, pinned: Pinned, memory_limit: float) -> PinnedCost:
    costs = build_costs(graph, profile)
    hint = _completed(costs, hint_of, pinned)
    layers = len(set(costs.layer_of.values()))
    if pinned.recompute == "fit":
        laid = cost_layout(costs, hint, memory_limit)
        used, assignment, fits = laid.costs, laid.assignment, laid.fits
        notes = []
    else:
        used = _with_policy(costs, pinned)
        assignment, fits = used.assignment(hint.choice, hint.zero), True
    priced = plan_costs(used.problem, assignment)
    time, memory = priced.total_time, priced.memory
    if pinned.recompute != "fit":
        notes = _over_limit(memory, memory_limit)
    recomputed = len(used.recompute)
    parts = breakdown(layer_numbers(used, assignment), recomputed=recomputed, overlap=priced) if fits else {}
    return PinnedCost(step_time=time if fits else math.inf, memory=memory, recomputed=recomputed,
                      layers=layers, fits=fits, notes=notes, parts=parts)


def _pipelined(captured, shape, hardware: str, hint_of, pinned: Pinned, memory_limit: float) -> PinnedCost:
    p, m = pinned.stages, pinned.micro_batches
    if shape[0] % p:
        raise ValueError(f"autopar: {p} pipeline stages must divide the mesh's outermost axis, found mesh {shape}")
    intra = tuple(s for s in (shape[0] // p,) + tuple(shape[1:]) if s > 1) or (1,)
    full = pipeline_profile(PlanRequest(mesh_shape=shape, hardware=hardware), p, intra)
    graph = build_strategy_graph(captured, intra)
    costs = build_costs(graph, _intra_profile(full, intra))
    hint = _completed(costs, hint_of, pinned)
    costs = _with_policy(costs, pinned)
    num = layer_numbers(costs, costs.assignment(hint.choice, hint.zero))
    layers = len(set(costs.layer_of.values()))
    notes = _micro_batch_notes(graph, hint.choice, m)
    # a fixed policy: the stage search recomputes nothing more (no limit, so nothing to fit)
    limit = memory_limit if pinned.recompute == "fit" else math.inf
    found = search(num, full, p, [m], memory_limit=limit, schedules=(pinned.schedule,),
                   chunks_per_rank=(pinned.chunks,))
    if found is None:
        return PinnedCost(step_time=math.inf, memory=math.inf, recomputed=0, layers=layers, fits=False,
                          notes=notes + [f"no stage cut of {p} stages with {m} micro-batches fits"])
    option = found[0]
    overhead = num.step_overhead(p)
    sends = m * _rank_sends(option.cut, full, num, m, p)
    folded = len(costs.recompute)  # "full": in the per-layer numbers already
    recomputed = folded + _recomputed(option)
    parts = breakdown(num, stages=p, recomputed=recomputed, folded=bool(folded),
                      pipeline_time=option.step_time - overhead, sends=sends)
    memory = max(option.rank_memory)
    if pinned.recompute != "fit":
        notes += _over_limit(memory, memory_limit)
    return PinnedCost(step_time=option.step_time, memory=memory, recomputed=recomputed, layers=layers, fits=True,
                      notes=notes, parts=parts)


def _rank_sends(cut, profile: costmodels.HardwareProfile, num: LayerNumbers, m: int, p: int) -> float:
    """Seconds per micro-batch of the point-to-point sends of the busiest rank (its virtual
    stages' boundaries, each priced as the pipeline search prices it: ``LayerNumbers.send_times``)."""
    ends = [stage.stop - 1 for stage in map(cut.layers, range(len(cut.starts)))][:-1]
    every = num.send_times(profile, m)
    send = [every[e] for e in ends]
    return max((sum(send[r::p]) for r in range(p)), default=0.0)


def _micro_batch_notes(graph: StrategyGraph, choice, micro_batches: int) -> list[str]:
    """Where the completed layout splits the batch over more devices than a micro-batch
    holds sequences (``autopar.passes.planner.microbatch``): priced all the same, as the run was made."""
    batch = batch_size(graph)
    if not batch:
        return []
    split = batch_split(graph, choice, batch)
    if batch % (micro_batches * split) == 0:
        return []
    return [f"{micro_batches} micro-batches of {batch / micro_batches:g} sequences, but the completed layout "
            f"splits the batch over {split} devices"]


def _intra_profile(full: costmodels.HardwareProfile, intra: tuple[int, ...]) -> costmodels.HardwareProfile:
    """``full`` (the mesh ``(stages,) + intra``) without its pipeline axis, as each stage sees it."""
    return costmodels.HardwareProfile(machine=full.machine, backend=full.backend, mesh_shape=intra,
                                      device=full.device, axes=full.axes[1:], source=full.source)


def _recomputed(option) -> int:
    """Layers the pipeline search recomputes, all stages together (``StageCut.recomputed``)."""
    return int(sum(option.cut.recomputed))

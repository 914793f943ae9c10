"""Price a GIVEN layout: a manual intra-op layout, optionally inside a pipeline whose stage
count, micro-batches and schedule are fixed, with the fewest recomputed layers that fit.

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
  per-layer numbers (``planner_pipeline.layer_numbers``) cut into stages for exactly
  that micro-batch count and schedule by ``planner_pipeline.search``, which recomputes
  the fewest layers that fit, as the auto plan's pipelines do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import costmodels
from passes.costing import Costs, build_costs
from passes.planner import Hint, PlanningError, complete, cost_layout
from passes.microbatch import batch_size, batch_split
from passes.planner_pipeline import SCHEDULE_NAMES, layer_numbers, pipeline_profile, search
from passes.strategies import StrategyGraph, build_strategy_graph


@dataclass(frozen=True, kw_only=True)
class Pinned:
    """A layout as a published run fixed it."""

    layout: str  # a manual intra-op layout (autopar.layouts), e.g. "fsdp", "tp+dp", "fsdp+tp"
    stages: int = 1  # pipeline stages over the mesh's outermost axis (1: no pipeline)
    micro_batches: int = 1
    schedule: str = "1f1b"  # a key of planner_pipeline.SCHEDULE_NAMES

    def __post_init__(self) -> None:
        if self.stages < 1 or self.micro_batches < 1:
            raise ValueError(f"autopar: a pinned layout expects positive stages and micro-batches; found "
                             f"{self.stages} stages, {self.micro_batches} micro-batches")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"autopar: no pipeline schedule {self.schedule!r}; expected one of "
                             f"{sorted(SCHEDULE_NAMES)}")


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


def price_pinned(captured, shape: tuple[int, ...], hardware: str, hint_of: Callable[[StrategyGraph], Hint],
                 pinned: Pinned, *, memory_limit: float) -> PinnedCost:
    """The predicted step of ``pinned`` on mesh ``shape`` (a preset's name as ``hardware``)."""
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


def _intra_op(graph: StrategyGraph, profile, hint_of, pinned: Pinned, memory_limit: float) -> PinnedCost:
    costs = build_costs(graph, profile)
    laid = cost_layout(costs, _completed(costs, hint_of, pinned), memory_limit)
    return PinnedCost(step_time=laid.time if laid.fits else math.inf, memory=laid.memory,
                      recomputed=len(laid.costs.recompute), layers=len(set(costs.layer_of.values())),
                      fits=laid.fits)


def _pipelined(captured, shape, hardware: str, hint_of, pinned: Pinned, memory_limit: float) -> PinnedCost:
    p, m = pinned.stages, pinned.micro_batches
    if shape[0] % p:
        raise ValueError(f"autopar: {p} pipeline stages must divide the mesh's outermost axis, found mesh {shape}")
    intra = tuple(s for s in (shape[0] // p,) + tuple(shape[1:]) if s > 1) or (1,)
    full = pipeline_profile(hardware, p, intra)
    graph = build_strategy_graph(captured, intra)
    costs = build_costs(graph, _intra_profile(full, intra))
    hint = _completed(costs, hint_of, pinned)
    num = layer_numbers(costs, costs.assignment(hint.choice, hint.zero))
    layers = len(set(costs.layer_of.values()))
    notes = _micro_batch_notes(graph, hint.choice, m)
    found = search(num, full, p, [m], memory_limit=memory_limit, schedules=(pinned.schedule,))
    if found is None:
        return PinnedCost(step_time=math.inf, memory=math.inf, recomputed=0, layers=layers, fits=False,
                          notes=notes + [f"no stage cut of {p} stages with {m} micro-batches fits"])
    option = found[0]
    return PinnedCost(step_time=option.step_time, memory=max(option.rank_memory),
                      recomputed=_recomputed(option), layers=layers, fits=True, notes=notes)


def _micro_batch_notes(graph: StrategyGraph, choice, micro_batches: int) -> list[str]:
    """Where the completed layout splits the batch over more devices than a micro-batch
    holds sequences (``passes.microbatch``): priced all the same, as the run was made."""
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

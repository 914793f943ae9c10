"""Search over pipeline depth, micro-batches and schedule, from per-layer numbers.

For every (P ranks, M micro-batches, schedule, v chunks per rank) the caller's
``layer_costs(P, M)`` returns per-layer numbers for that intra-op mesh (devices / P)
and micro-batch size (batch / M); ``cut_stages`` balances the P * v (virtual) stages
under memory; ``pipeline_step_time`` plus the caller's per-step overhead gives the
predicted step time. The cheapest option wins; every option is kept, with the reason
it was rejected, so a plan can explain why it chose what it did.

Exact for GPipe and 1F1B (the DP minimises the slowest stage, and the step time is
that times M + P - 1). For interleaved 1F1B it balances chunks (min-max over P * v
virtual stages) with each chunk held to ``memory_limit / v``, which is sufficient but
conservative, then checks each rank's peak (``stages.rank_peaks``: torch's order of its chunks
replayed); a heuristic, not an optimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from autopar.costmodels import Schedule
from autopar.costmodels.memory import in_flight_with_gradients
from autopar.passes.solve.stages import RankPeak, StageCut, cut_stages, rank_peaks


@dataclass
class LayerCosts:
    """Per-layer numbers for one (pipeline depth, micro-batch count)."""

    time: Sequence[float]  # forward + backward seconds per micro-batch
    static_memory: Sequence[float]  # parameters, gradients, optimizer state: bytes per device
    activation_memory: Sequence[float]  # bytes per device per micro-batch in flight
    boundary_time: Sequence[float] | None = None  # L - 1 sends between layer l and l + 1
    step_overhead: float = 0.0  # seconds per step outside the pipeline (gradient sync, optimizer)
    # per micro-batch: bytes a recomputed layer does not keep, seconds its forward adds again
    # (None: no layer may be recomputed; ``stages.cut_stages`` picks the fewest per stage)
    recompute_saving: Sequence[float] | None = None
    recompute_time: Sequence[float] | None = None
    # the gradients' part of static_memory, which a schedule's peak may come before (``stages``)
    gradient_memory: Sequence[float] | None = None
    accumulating: Sequence[float] | None = None  # per layer: the largest gradient a backward adds (``stages``)
    temporary_memory: Sequence[float] | None = None  # the part of static_memory alive only in a backward (``stages``)


@dataclass
class PipelineOption:
    num_stages: int  # ranks along the pipeline axis (P)
    num_microbatches: int
    schedule: Schedule
    chunks_per_rank: int
    step_time: float  # math.inf when rejected
    cut: StageCut | None
    rank_memory: list[float] = field(default_factory=list)  # each rank's peak (``rank_peaks``: its total)
    rank_peaks: list[RankPeak] = field(default_factory=list)
    rejected: str = ""  # why not, empty when valid


@dataclass
class PipelineSearchResult:
    best: PipelineOption | None
    options: list[PipelineOption]  # every option tried, fastest first


def search_pipeline(
    layer_costs: Callable[[int, int], LayerCosts] | Mapping[tuple[int, int], LayerCosts],
    *,
    stage_counts: Sequence[int],
    microbatch_counts: Sequence[int],
    schedules: Sequence[str | Schedule] = (Schedule.ONE_F_ONE_B,),
    chunks_per_rank: Sequence[int] = (2,),
    memory_limit: float | None = None,
) -> PipelineSearchResult:
    """Every (P, M, schedule, v) evaluated; ``layer_costs`` is a function or a table keyed (P, M)."""
    lookup = layer_costs.__getitem__ if isinstance(layer_costs, Mapping) else None
    options = []
    for p in stage_counts:
        for m in microbatch_counts:
            costs = lookup((p, m)) if lookup else layer_costs(p, m)
            for schedule in map(Schedule.parse, schedules):
                for v in chunks_per_rank if schedule.interleaved else (1,):
                    options.append(evaluate_pipeline(costs, p, m, schedule, v, memory_limit))
    options.sort(key=lambda o: (o.step_time, o.num_stages, o.num_microbatches))
    best = options[0] if options and math.isfinite(options[0].step_time) else None
    return PipelineSearchResult(best, options)


def evaluate_pipeline(
    costs: LayerCosts, num_stages: int, num_microbatches: int, schedule: str | Schedule, chunks_per_rank: int = 1,
    memory_limit: float | None = None,
) -> PipelineOption:
    """Best cut and predicted step time of one (P, M, schedule, v)."""
    schedule = Schedule.parse(schedule)
    v = schedule.chunks(chunks_per_rank)
    option = PipelineOption(num_stages, num_microbatches, schedule, v, math.inf, None)
    num_layers = len(costs.time)
    if num_stages * v > num_layers:
        option.rejected = f"{num_stages * v} stages for {num_layers} layers"
        return option
    if problem := schedule.micro_batch_problem(num_stages, num_microbatches):
        option.rejected = problem
        return option
    in_flight = schedule.in_flight_per_stage(num_stages, num_microbatches, v)
    chunk_limit = None if memory_limit is None else memory_limit / v
    cut = cut_stages(
        costs.time, num_stages * v, static_memory=costs.static_memory, activation_memory=costs.activation_memory,
        in_flight=in_flight, memory_limit=chunk_limit, boundary_time=costs.boundary_time,
        recompute_saving=costs.recompute_saving, recompute_time=costs.recompute_time,
        gradient_memory=costs.gradient_memory, accumulating=costs.accumulating,
        temporary_memory=costs.temporary_memory,
        in_flight_with_gradients=in_flight_with_gradients(schedule, num_stages, num_microbatches, v),
    )
    if cut is None:
        option.rejected = "no cut fits in memory"
        return option
    option.cut = cut
    # each rank's peak as its schedule's order holds its chunks together (the cut held each
    # chunk to its share of the limit at the chunk's own peak: sufficient, not the peak)
    option.rank_peaks = rank_peaks(cut, schedule, num_microbatches, v)
    option.rank_memory = [peak.total for peak in option.rank_peaks]
    if memory_limit is not None and max(option.rank_memory) > memory_limit * (1 + 1e-12):
        option.rejected = f"a rank needs {max(option.rank_memory):.6g} bytes"
        return option
    option.step_time = schedule.step_time(cut.stage_time, num_microbatches, v) + costs.step_overhead
    return option

"""Search over pipeline depth, micro-batches and schedule, from per-layer numbers.

For every (P ranks, M micro-batches, schedule, v chunks per rank) the caller's
``layer_costs(P, M)`` returns per-layer numbers for that intra-op mesh (devices / P)
and micro-batch size (batch / M); ``cut_stages`` balances the P * v (virtual) stages
under memory; ``pipeline_step_time`` plus the caller's per-step overhead gives the
predicted step time. The cheapest option wins; every option is kept, with the reason
it was rejected, so a plan can explain why it chose what it did.

Exact for GPipe and 1F1B (the DP minimises the slowest stage, and the step time is
that times M + P - 1). For interleaved 1F1B it balances chunks (min-max over P * v
virtual stages) with each chunk held to ``memory_limit / v`` at an even spread of its rank's
in-flight count, then checks each rank's peak (``stages.rank_peaks``: torch's order of its chunks
replayed). torch's order does not spread them evenly, so that share can reject cuts whose ranks
fit; ``rank_fit`` re-fits the recomputation of the DP's cut and of two time-optimal cuts (with
nothing and with every layer recomputed) to the ranks' replayed peaks, and the fastest that fits
wins. A heuristic, not an optimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from autopar.costmodels import Schedule
from autopar.costmodels.memory import in_flight_with_gradients
from autopar.passes.solve.rank_fit import recompute_to_fit
from autopar.passes.solve.stages import RankPeak, StageCut, cut_stages, describe_cut, rank_peaks


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
    gather_memory: Sequence[float] | None = None  # per layer: what its ZeRO-3 gather holds while it runs (``stages``)
    scatter_memory: Sequence[float] | None = None  # ... and its gradients' reduce-scatter (``stages``)
    # per stage of layers [a, b) ([L + 1, L + 1]): bytes per micro-batch it holds of the values it
    # receives and sends beyond activation_memory, and of them what its recomputed layers free (``stages``)
    stage_io: np.ndarray | None = None
    io_credit: np.ndarray | None = None


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


def useful_depths(layers: int, stages: int) -> list[int]:
    """Interleaved depths worth trying for ``layers`` layers on ``stages`` ranks, ascending: the
    fewest chunks per rank that hold c layers a chunk at most, for each c, and the deepest. A
    depth between two of the first holds as many layers in its largest chunk as the next one
    up, so it has the same bubble (P - 1 slots of that chunk) and more sends: never faster
    where time alone decides. Where memory decides how many layers recompute, deeper holds
    fewer layers' activations in flight (rank 0 keeps about L (1 + (1 - 2/P) / v) layers of
    micro-batches under Megatron's warm-up), so the deepest is tried too (llama3-16k: 7 chunks
    per rank recompute 83 layers where 4 recompute 84, both with 2-layer chunks at most)."""
    deepest = layers // stages  # a chunk holds a layer at least
    fewest = {math.ceil(layers / (stages * c)) for c in range(1, deepest + 1)}
    return sorted(v for v in fewest | {deepest} if 2 <= v <= deepest)


def deeper_while_faster(found: PipelineSearchResult, depths: Sequence[int],
                        at_depth: Callable[[int], PipelineSearchResult]) -> PipelineSearchResult:
    """``found`` (one depth searched, the first of ``depths``) with the interleaved schedule
    searched at the next of ``depths``, one at a time, stopping at the first whose best option
    is not faster than the one before: a deeper pipeline shrinks the bubble and adds v sends
    per micro-batch and more in flight on a rank's first chunks, so past the depth where the
    two cross it only loses (``useful_depths`` leaves out the depths that only add sends)."""
    def best_at(result: PipelineSearchResult, v: int) -> float:
        return min((o.step_time for o in result.options if o.schedule.interleaved and o.chunks_per_rank == v),
                   default=math.inf)

    options, last = list(found.options), best_at(found, depths[0]) if depths else math.inf
    for v in depths[1:]:
        deeper = at_depth(v)
        options += deeper.options
        if not best_at(deeper, v) < last:
            break
        last = best_at(deeper, v)
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
    graded = in_flight_with_gradients(schedule, num_stages, num_microbatches, v)
    chunk_limit = None if memory_limit is None else memory_limit / v
    cut = _cut(costs, num_stages * v, in_flight, graded, chunk_limit)
    if cut is None:
        option.rejected = "no cut fits in memory"
    else:
        option = _judged(option, cut, costs, memory_limit)
    if schedule.interleaved and memory_limit is not None:
        # the DP held each chunk to its share of the limit at an even spread of its rank's
        # in-flight count; recomputation fitted to the ranks' replayed peaks may fit where it
        # found no cut, or recompute less (``rank_fit``)
        for start in _fitting_starts(costs, cut, num_stages * v, in_flight, graded):
            describe = _describer(costs, start.starts, in_flight, graded)
            fitted = recompute_to_fit(start, describe, schedule, num_microbatches, v, memory_limit,
                                      _per_layer_saving(costs))
            judged = None if fitted is None else _judged(option, fitted, costs, memory_limit)
            if judged is not None and _preferred(judged) < _preferred(option):
                option = judged
            if fitted is not None and not any(fitted.recomputed):
                break  # a start fits with nothing recomputed: the later ones only recompute more
    return option


def _fitting_starts(costs: LayerCosts, dp_cut: StageCut | None, stages: int, in_flight,
                    graded) -> Iterator[StageCut]:
    """The cuts ``rank_fit`` starts from, made as they are asked for: the fastest with no memory
    limit, nothing recomputed; the DP's; and the fastest where every layer recomputed, every layer
    recomputed (``rank_fit`` then gives back each one its rank does not need: the chunks stay
    balanced around the rest)."""
    yield _cut(costs, stages, in_flight, graded, None)
    if dp_cut is not None:
        yield dp_cut
    if costs.recompute_saving is not None and costs.recompute_time is not None:
        all_recomputed = replace(costs, time=np.asarray(costs.time) + np.asarray(costs.recompute_time))
        starts = _cut(all_recomputed, stages, in_flight, graded, None).starts
        yield _describer(costs, starts, in_flight, graded)(np.diff(starts + [len(costs.time)]).tolist())


def _preferred(option: PipelineOption) -> tuple[float, int]:
    """Faster first, then (at the same step time: not on the slowest rank) fewer recomputed layers."""
    return option.step_time, sum(option.cut.recomputed) if option.cut is not None else 0


def _cut(costs: LayerCosts, stages: int, in_flight, graded, limit: float | None) -> StageCut | None:
    """``cut_stages`` over ``costs`` (each stage's in-flight counts given), at most ``limit`` per stage."""
    return cut_stages(
        costs.time, stages, static_memory=costs.static_memory, activation_memory=costs.activation_memory,
        in_flight=in_flight, memory_limit=limit, boundary_time=costs.boundary_time,
        recompute_saving=costs.recompute_saving, recompute_time=costs.recompute_time,
        gradient_memory=costs.gradient_memory, accumulating=costs.accumulating,
        temporary_memory=costs.temporary_memory,
        gather_memory=costs.gather_memory, scatter_memory=costs.scatter_memory,
        in_flight_with_gradients=graded, stage_io=costs.stage_io, io_credit=costs.io_credit,
    )


def _describer(costs: LayerCosts, starts: list[int], in_flight, graded) -> Callable[[Sequence[int]], StageCut]:
    """Per-stage recomputed counts -> ``describe_cut`` of ``starts`` over ``costs``, as ``_cut`` describes its cut."""
    time = np.asarray(costs.time, dtype=np.float64)
    send = np.zeros(len(time))
    if costs.boundary_time is not None:
        send[:-1] = costs.boundary_time  # the send after each layer but the last
    arrays = [None if x is None else np.asarray(x, dtype=np.float64) for x in (
        costs.static_memory, costs.activation_memory, costs.recompute_saving, costs.recompute_time,
        costs.gradient_memory, costs.accumulating, costs.temporary_memory, costs.gather_memory, costs.scatter_memory)]
    static, activation, saving, redo, gradients, accumulating, temporary, gather, scatter = arrays

    def describe(recomputed: Sequence[int]) -> StageCut:
        return describe_cut(starts, time, static, activation, in_flight, send, saving, redo, gradients=gradients,
                            in_flight_with_gradients=graded, accumulating=accumulating, temporary=temporary,
                            gather=gather, scatter=scatter, recomputed=recomputed, stage_io=costs.stage_io,
                            io_credit=costs.io_credit)

    return describe


def _per_layer_saving(costs: LayerCosts) -> list[float]:
    return [0.0] * len(costs.time) if costs.recompute_saving is None else list(costs.recompute_saving)


def _judged(option: PipelineOption, cut: StageCut, costs: LayerCosts, memory_limit: float | None) -> PipelineOption:
    """``option``'s (P, M, schedule, v) with ``cut``: its ranks' peaks as the schedule's order holds
    their chunks together, rejected where one is over ``memory_limit``, else its step time."""
    judged = PipelineOption(option.num_stages, option.num_microbatches, option.schedule, option.chunks_per_rank,
                            math.inf, cut)
    judged.rank_peaks = rank_peaks(cut, judged.schedule, judged.num_microbatches, judged.chunks_per_rank)
    judged.rank_memory = [peak.total for peak in judged.rank_peaks]
    if memory_limit is not None and max(judged.rank_memory) > memory_limit * (1 + 1e-12):
        judged.rejected = f"a rank needs {max(judged.rank_memory):.6g} bytes"
        return judged
    judged.step_time = (judged.schedule.step_time(cut.stage_time, judged.num_microbatches, judged.chunks_per_rank)
                        + costs.step_overhead)
    return judged

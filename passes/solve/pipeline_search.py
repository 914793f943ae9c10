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
in-flight count, then checks each rank's peak (``rank_replay.rank_peaks``: torch's order of its chunks
replayed). torch's order does not spread them evenly, so that share can reject cuts whose ranks
fit; ``rank_fit`` re-fits the recomputation of the DP's cut and of two time-optimal cuts (with
nothing and with every layer recomputed) to the ranks' replayed peaks, and the fastest that fits
wins. A heuristic, not an optimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from autopar.costmodels import Schedule
from autopar.passes.solve.rank_fit import recompute_to_fit
from autopar.passes.solve.rank_replay import RankPeak, rank_peaks
from autopar.passes.solve.stages import InFlight, LayerCosts, StageCut, cut_stages, describe_cut, fastest_starts


@dataclass
class PipelineOption:
    stages: int  # ranks along the pipeline axis (P)
    micro_batches: int  # M
    schedule: Schedule
    chunks_per_rank: int  # v
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
    micro_batch_counts: Sequence[int],
    schedules: Sequence[str | Schedule] = (Schedule.ONE_F_ONE_B,),
    chunks_per_rank: Sequence[int] = (2,),
    memory_limit: float | None = None,
) -> PipelineSearchResult:
    """Every (P, M, schedule, v) evaluated; ``layer_costs`` is a function or a table keyed (P, M)."""
    lookup = layer_costs.__getitem__ if isinstance(layer_costs, Mapping) else None
    options = []
    for p in stage_counts:
        for m in micro_batch_counts:
            costs = lookup((p, m)) if lookup else layer_costs(p, m)
            unlimited: dict = {}  # the cuts without a memory limit the schedules of (p, m) share
            for schedule in map(Schedule.parse, schedules):
                for v in chunks_per_rank if schedule.interleaved else (1,):
                    options.append(evaluate_pipeline(costs, p, m, schedule, v, memory_limit, unlimited))
    return _fastest_first(options)


def _fastest_first(options: list[PipelineOption]) -> PipelineSearchResult:
    options.sort(key=lambda o: (o.step_time, o.stages, o.micro_batches))
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
    return _fastest_first(options)


def evaluate_pipeline(
    costs: LayerCosts, stages: int, micro_batches: int, schedule: str | Schedule, chunks_per_rank: int = 1,
    memory_limit: float | None = None, unlimited: dict | None = None,
) -> PipelineOption:
    """Best cut and predicted step time of one (P, M, schedule, v). ``unlimited``: where the
    cuts of ``costs`` with no memory limit (``_fitting_starts``) are kept for its other schedules."""
    schedule = Schedule.parse(schedule)
    v = schedule.chunks(chunks_per_rank)
    option = PipelineOption(stages, micro_batches, schedule, v, math.inf, None)
    if stages * v > costs.layers:
        option.rejected = f"{stages * v} stages for {costs.layers} layers"
        return option
    if problem := schedule.chunks_problem(v) or schedule.micro_batch_problem(stages, micro_batches):
        option.rejected = problem
        return option
    in_flight = InFlight.of(schedule, stages, micro_batches, v)
    chunk_limit = None if memory_limit is None else memory_limit / v
    cut = cut_stages(costs, stages * v, in_flight, chunk_limit)
    if cut is None:
        option.rejected = "no cut fits in memory"
    else:
        option = _judged(option, cut, costs, memory_limit)
    if schedule.interleaved and memory_limit is not None:
        # the DP held each chunk to its share of the limit at an even spread of its rank's
        # in-flight count; recomputation fitted to the ranks' replayed peaks may fit where it
        # found no cut, or recompute less (``rank_fit``)
        for start in _fitting_starts(costs, cut, in_flight, {} if unlimited is None else unlimited):
            describe = partial(_described, costs, start.starts, in_flight)
            fitted = recompute_to_fit(start, describe, schedule, micro_batches, v, memory_limit,
                                      costs.recompute_saving)
            judged = None if fitted is None else _judged(option, fitted, costs, memory_limit)
            if judged is not None and _preferred(judged) < _preferred(option):
                option = judged
            if fitted is not None and not any(fitted.recomputed):
                break  # a start fits with nothing recomputed: the later ones only recompute more
    return option


def _fitting_starts(costs: LayerCosts, dp_cut: StageCut | None, in_flight: InFlight,
                    unlimited: dict) -> Iterator[StageCut]:
    """The cuts ``rank_fit`` starts from, made as they are asked for: the fastest with no memory
    limit, nothing recomputed; the DP's; and the fastest where every layer recomputed, every layer
    recomputed (``rank_fit`` then gives back each one its rank does not need: the chunks stay
    balanced around the rest). The two without a limit read no in-flight count (``fastest_starts``):
    their starts are kept in ``unlimited`` for the other schedules of as many stages."""
    stages = len(in_flight.peak)
    if (stages, "as is") not in unlimited:
        unlimited[stages, "as is"] = fastest_starts(costs, stages)
    yield describe_cut(costs, unlimited[stages, "as is"], in_flight)
    if dp_cut is not None:
        yield dp_cut
    if costs.recomputable:
        if (stages, "all recomputed") not in unlimited:
            unlimited[stages, "all recomputed"] = fastest_starts(
                replace(costs, time=costs.time + costs.recompute_time), stages)
        starts = unlimited[stages, "all recomputed"]
        yield _described(costs, starts, in_flight, np.diff(starts + [costs.layers]).tolist())


def _described(costs: LayerCosts, starts: list[int], in_flight: InFlight, recomputed: Sequence[int]) -> StageCut:
    """``describe_cut`` of ``starts`` with ``recomputed[s]`` layers recomputed per stage: what
    ``rank_fit`` re-describes its trials with (bound to a cut's starts)."""
    return describe_cut(costs, starts, in_flight, recomputed=recomputed)


def _preferred(option: PipelineOption) -> tuple[float, int]:
    """Faster first, then (at the same step time: not on the slowest rank) fewer recomputed layers."""
    return option.step_time, sum(option.cut.recomputed) if option.cut is not None else 0


def _judged(option: PipelineOption, cut: StageCut, costs: LayerCosts, memory_limit: float | None) -> PipelineOption:
    """``option``'s (P, M, schedule, v) with ``cut``: its ranks' peaks as the schedule's order holds
    their chunks together, rejected where one is over ``memory_limit``, else its step time."""
    judged = PipelineOption(option.stages, option.micro_batches, option.schedule, option.chunks_per_rank,
                            math.inf, cut)
    judged.rank_peaks = rank_peaks(cut, judged.schedule, judged.micro_batches, judged.chunks_per_rank)
    judged.rank_memory = [peak.total for peak in judged.rank_peaks]
    if memory_limit is not None and max(judged.rank_memory) > memory_limit * (1 + 1e-12):
        judged.rejected = f"a rank needs {max(judged.rank_memory):.6g} bytes"
        return judged
    judged.step_time = (judged.schedule.step_time(cut.stage_time, judged.micro_batches, judged.chunks_per_rank)
                        + costs.step_overhead)
    return judged

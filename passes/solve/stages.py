"""Pipeline stages: where to cut the layers, how much each stage holds, step time.

Layers ``0..L-1`` run in order. A cut into ``S`` contiguous stages is the list of
start layers ``starts`` (``starts[0] = 0``); stage ``s`` holds ``[starts[s],
starts[s+1])``. Per micro-batch, stage ``s`` takes

    time(s)   = sum of layer_time over its layers + boundary_time[last layer]
                (the point-to-point send after it; none after the last stage)
    memory(s) = sum of static_memory - G + max(in_flight[s] * A, G + with_gradients[s] * A + T)

where ``A`` is the stage's activation_memory summed, ``G`` its gradient_memory (a part of
static_memory), ``in_flight[s]`` how many micro-batches' activations the schedule keeps
alive on that stage at its peak (``in_flight_microbatches``) and ``with_gradients[s]`` how
many once a backward has made the gradients: GPipe's peak is its first backward's start,
M in flight and no gradient made yet, and each backward frees one micro-batch as the
gradients appear (``costmodels.memory.in_flight_with_gradients``), while each later backward
makes a gradient before adding it to the accumulated one: ``T``, the largest of the stage's
``accumulating`` (per layer). Without ``with_gradients`` the gradients are held at the peak.

Recomputation (``recompute_saving`` given): a stage that does not fit recomputes the
fewest ``k`` of its layers that make it fit. A recomputed layer keeps only its inputs
(``saving[l]`` less per micro-batch in flight), runs its forward again in backward
(``recompute_time[l]`` more per micro-batch), and backward rebuilds one recomputed
layer (one micro-batch's) at a time, so the stage holds the largest saving of its
layers once more:

    memory(s, k) = memory(s) with A less k * mean saving, + (k > 0) * max saving
    time(s, k)   = time(s) + k * mean recompute_time

(the means over the stage's layers: exact for alike layers, the repeated layers of a
model; ``recomputed_layers`` picks the ``k`` with the largest saving, which save at
least the mean).

A stage also holds, per micro-batch in flight, the values it receives and sends (torch's
``PipelineStage`` keeps them until that micro-batch's backward) beyond what its layers'
activations charge: ``io[a, b]`` for a stage of layers [a, b), added to ``A``; of it,
``credit[a, b]`` is what its recomputed layers' kept inputs charge too (the received tensor is
that input), added to the stage's saving (``autopar.passes.planner.stage_io``).

A rank's peak (``rank_peaks``) replays the order torch's schedule runs its stages in with
each stage's parts apart (held always, gradients from its first backward, one micro-batch's
activations per micro-batch in flight, and what exists only during one of its backwards:
``T``, a rebuilt layer, a gradient being added). For one stage per rank that is
``memory(s)``; with interleaving it is less than the chunks' own peaks added up: the chunk
holding the loss runs each micro-batch's backward right after its forward while the
rank's other chunks fill, so its temporaries meet one micro-batch of its own in flight.

ZeRO-3 stages gather a layer's weights at its first use and free them after, in forward and
again in backward (``gather[l]`` bytes while it runs: ``costmodels.memory.gather_working_bytes``),
where its gradients are then reduce-scattered (``scatter[l]``: ``scatter_working_bytes``). A
forward gathers layer l before its and the later layers' activations exist; a backward gathers
it again while they, less those of the later layers, still exist, and reduce-scatters once its
own are freed too. So a stage's forward holds ``max_l(gather[l] - A[l:])`` beyond its micro-batch's
activations, and a backward ``max_l max(gather[l] - A[l+1:], scatter[l] - A[l:])`` with
``A[l:]`` the micro-batch's activations of layers l onward in the stage (none below 0). The
cut's DP holds the stage's largest ``gather`` or ``scatter`` throughout, as it holds ``T``.

``cut_stages`` minimises the slowest stage time subject to ``memory(s) <= limit`` for
every stage, by the exact DP

    best[s][b] = min over a < b of max(best[s-1][a], time(layers a..b-1 as stage s))

over prefix sums (``O(S * L^2)``, vectorised over ``a``).

Step time (``pipeline_step_time``), with ``M`` micro-batches and ``P`` ranks, is the
schedule's own (``costmodels.Schedule.step_time``):
    GPipe and 1F1B:       (M + P - 1) * slowest stage
    interleaved 1F1B, ``v`` chunks per rank (virtual stage c on rank c mod P):
        M * slowest rank + (P - 1) * slowest chunk,
    which for equal chunks is (M + (P - 1) / v) * rank time: a bubble of
    (P - 1) / (v * M) relative to the ideal M * rank time.
"""

from __future__ import annotations

import math
from functools import partial
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from autopar.costmodels import Schedule
from autopar.costmodels.memory import schedule_order


@dataclass
class StageCut:
    starts: list[int]  # first layer of every stage
    stage_time: list[float]  # seconds per micro-batch, boundary send included
    stage_memory: list[float]  # bytes per device
    num_layers: int
    recomputed: list[int] = field(default_factory=list)  # per stage: how many of its layers recompute
    gradients: list[float] = field(default_factory=list)  # per stage: gradient bytes held at its peak
    accumulating: list[float] = field(default_factory=list)  # per stage: a gradient being added, at its peak
    # per stage, what a replay of the schedule's order adds up (``rank_peaks``): bytes held
    # whatever runs (state less gradients and temporaries), the gradients, one micro-batch's
    # activations (recomputed layers' savings taken off), and what exists only while one of
    # its backwards runs: its temporaries, a recomputed layer rebuilt, a gradient being added
    held_always: list[float] = field(default_factory=list)
    gradient_bytes: list[float] = field(default_factory=list)
    per_micro_batch: list[float] = field(default_factory=list)
    in_backward: list[float] = field(default_factory=list)
    rebuilt: list[float] = field(default_factory=list)
    adding: list[float] = field(default_factory=list)
    in_forward: list[float] = field(default_factory=list)  # a ZeRO-3 gather beyond one micro-batch's activations

    @property
    def slowest(self) -> float:
        return max(self.stage_time)

    def layers(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else self.num_layers
        return range(self.starts[stage], end)


def in_flight_microbatches(schedule: str | Schedule, num_ranks: int, num_microbatches: int,
                           chunks_per_rank: int = 1) -> list[int]:
    """Micro-batches whose activations each (virtual) stage keeps alive at its peak
    (``Schedule.in_flight_per_stage``: ``M`` under GPipe, ``min(M, P - r)`` under 1F1B,
    Megatron's warm-up under interleaved 1F1B, each chunk holding its rank's rounded-up
    count)."""
    return Schedule.parse(schedule).in_flight_per_stage(num_ranks, num_microbatches, chunks_per_rank)


def pipeline_step_time(
    stage_time: Sequence[float], num_microbatches: int, schedule: str | Schedule, chunks_per_rank: int = 1
) -> float:
    """Predicted pipeline time of one step from per-micro-batch (virtual) stage times
    (``Schedule.step_time``)."""
    return Schedule.parse(schedule).step_time(stage_time, num_microbatches, chunks_per_rank)


def cut_stages(
    layer_time: Sequence[float],
    num_stages: int,
    *,
    static_memory: Sequence[float] | None = None,
    activation_memory: Sequence[float] | None = None,
    in_flight: Sequence[int] | None = None,
    memory_limit: float | None = None,
    boundary_time: Sequence[float] | None = None,
    recompute_saving: Sequence[float] | None = None,
    recompute_time: Sequence[float] | None = None,
    gradient_memory: Sequence[float] | None = None,
    in_flight_with_gradients: Sequence[float] | None = None,
    accumulating: Sequence[float] | None = None,
    temporary_memory: Sequence[float] | None = None,
    gather_memory: Sequence[float] | None = None,
    scatter_memory: Sequence[float] | None = None,
    stage_io: np.ndarray | None = None,
    io_credit: np.ndarray | None = None,
) -> StageCut | None:
    """Contiguous cut minimising the slowest stage; ``None`` when no cut fits in memory.
    ``recompute_saving`` / ``recompute_time``: per layer and micro-batch, the bytes a
    recomputed layer does not keep and the seconds it adds; ``gradient_memory``: per layer,
    the gradients' part of ``static_memory``; ``in_flight_with_gradients``: per stage, the
    micro-batches in flight once gradients exist; ``accumulating``: per layer, the largest
    gradient a backward makes before adding it to the accumulated one (module docstring);
    ``temporary_memory``: per layer, the part of ``static_memory`` alive only while one of
    its backwards runs (``rank_peaks`` tells them apart; the cut holds it throughout);
    ``gather_memory`` / ``scatter_memory``: per layer, what its ZeRO-3 gather and its gradients'
    reduce-scatter hold while they run (module docstring; the cut holds a stage's largest
    throughout); ``stage_io`` / ``io_credit``: per stage of layers [a, b), ``[a, b]`` of an
    ``[L + 1, L + 1]`` matrix: what it holds per micro-batch of the values it receives and sends
    beyond ``activation_memory``, and of them what recomputing its layers frees (module docstring)."""
    time = np.asarray(layer_time, dtype=np.float64)
    num_layers = len(time)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"autopar: cut_stages expected 1 <= num_stages <= number of layers ({num_layers}), "
            f"found num_stages={num_stages}; use fewer pipeline stages."
        )
    static = _per_layer(static_memory, num_layers, "static_memory")
    activation = _per_layer(activation_memory, num_layers, "activation_memory")
    send = np.zeros(num_layers)
    if boundary_time is not None:
        send[:-1] = _per_layer(boundary_time, num_layers - 1, "boundary_time")
    flights = _per_stage(in_flight, np.ones(num_stages), num_stages, "in_flight")
    graded = _per_stage(in_flight_with_gradients, flights, num_stages, "in_flight_with_gradients")
    saving = _per_layer(recompute_saving, num_layers, "recompute_saving")
    redo = _per_layer(recompute_time, num_layers, "recompute_time")
    gradients = _per_layer(gradient_memory, num_layers, "gradient_memory")
    adding = _per_layer(accumulating, num_layers, "accumulating")
    gather = _per_layer(gather_memory, num_layers, "gather_memory")
    scatter = _per_layer(scatter_memory, num_layers, "scatter_memory")
    time_prefix, static_prefix, activation_prefix, saving_prefix, redo_prefix, gradient_prefix = (
        np.concatenate([[0.0], np.cumsum(x)]) for x in (time, static, activation, saving, redo, gradients)
    )
    cap = math.inf if memory_limit is None else memory_limit * (1 + 1e-12)

    # best[s][b]: least slowest-stage time of stages 0..s covering layers [0, b); each stage
    # s is one step over every (start a, end b) at once, a on rows and b on columns.
    best = np.full((num_stages, num_layers + 1), np.inf)
    choice = np.zeros((num_stages, num_layers + 1), dtype=np.int64)
    a = np.arange(num_layers + 1)[:, None]
    b = np.arange(num_layers + 1)[None, :]
    sent = np.concatenate([[0.0], send])  # sent[b] = send[b - 1], the send after layer b - 1
    span_time = time_prefix[b] - time_prefix[a]
    span_static = static_prefix[b] - static_prefix[a]
    span_activation = activation_prefix[b] - activation_prefix[a] + _per_span(stage_io, num_layers, "stage_io")
    span_layers = np.maximum(b - a, 1)
    span_saving = saving_prefix[b] - saving_prefix[a] + _per_span(io_credit, num_layers, "io_credit")
    span_redo = redo_prefix[b] - redo_prefix[a]
    span_gradients = gradient_prefix[b] - gradient_prefix[a]
    span_peak, span_adding = _span_max(saving), _span_max(adding)
    span_static = span_static + _span_max(np.maximum(gather, scatter))  # one running, held throughout
    for s in range(num_stages):
        last = s == num_stages - 1
        ends = (b == num_layers) if last else ((b >= s + 1) & (b <= num_layers - (num_stages - 1 - s)))
        starts = (a == 0) if s == 0 else ((a >= s) & (a < b))
        k, memory, _ = stage_peak(span_static, span_gradients, span_activation, span_saving, span_peak, span_layers,
                                  flights[s], graded[s], cap, span_adding)
        stage = span_time + k * span_redo / span_layers + (0.0 if last else sent[b])
        before = best[s - 1][:, None] if s else np.zeros((num_layers + 1, 1))
        value = np.where(starts & ends & (memory <= cap), np.maximum(before, stage), np.inf)
        k = np.argmin(value, axis=0)
        best[s] = value[k, np.arange(num_layers + 1)]
        choice[s] = k
    if not np.isfinite(best[-1][num_layers]):
        return None
    starts, b = [], num_layers
    for s in range(num_stages - 1, -1, -1):
        starts.append(int(choice[s][b]))
        b = starts[-1]
    starts.reverse()
    return describe_cut(starts, time, static, activation, flights, send, saving, redo, cap, gradients, graded, adding,
                        _per_layer(temporary_memory, num_layers, "temporary_memory"), gather, scatter,
                        stage_io=stage_io, io_credit=io_credit)


def describe_cut(starts, time, static, activation, in_flight, send, saving=None, redo=None,
                 memory_limit: float = math.inf, gradients=None, in_flight_with_gradients=None,
                 accumulating=None, temporary=None, gather=None, scatter=None,
                 recomputed: Sequence[int] | None = None, stage_io=None, io_credit=None) -> StageCut:
    """Times and memories of a given cut, each stage recomputing the fewest layers that fit
    ``memory_limit`` (used by the DP and by brute-force tests), or ``recomputed[s]`` of them
    where given (whatever that holds: ``solve.rank_fit`` picks them by the ranks' replayed
    peaks), and the parts of each stage's memory that ``rank_peaks`` replays the schedule with."""
    n = len(time)
    if recomputed is not None:
        _check_recomputed(recomputed, starts, n)
    saving, redo, gradients, adding, temporary, gather, scatter = (
        np.zeros(n) if x is None else np.asarray(x, dtype=np.float64)
        for x in (saving, redo, gradients, accumulating, temporary, gather, scatter))
    time, static, activation, send = (np.asarray(x, dtype=np.float64) for x in (time, static, activation, send))
    graded = in_flight if in_flight_with_gradients is None else in_flight_with_gradients
    # every stage at once (a stage is layers [a, b)): its sums and maxima over its layers
    first = np.asarray(starts, dtype=np.intp)
    ends = np.append(first[1:], n)
    sizes = (ends - first).astype(np.float64)
    total, most = partial(np.add.reduceat, indices=first), partial(np.maximum.reduceat, indices=first)
    running = most(np.maximum(gather, scatter))  # a gather or reduce-scatter, as the DP holds it
    largest_adding = most(adding)
    # what each stage holds of the values it receives and sends, and what recomputing frees of it
    io, credit = (_per_span(x, n, name)[first, ends] for x, name in ((stage_io, "stage_io"), (io_credit, "io_credit")))
    activations, savings = total(activation) + io, total(saving) + credit
    k, memory, grads = stage_peak(total(static) + running, total(gradients), activations, savings,
                                  most(saving), sizes, np.asarray(in_flight, dtype=np.float64)[:len(first)],
                                  np.asarray(graded, dtype=np.float64)[:len(first)],
                                  memory_limit if recomputed is None else math.inf, largest_adding, recomputed)
    k = k.astype(int)
    sent = np.zeros(len(first))  # the boundary send after each stage but the last
    sent[ends < n] = send[ends[ends < n] - 1]
    stage_time = total(time) + k * total(redo) / sizes + sent
    # each stage's parts of ``stage_peak``'s memory, apart, for ``rank_peaks`` to replay: k
    # recomputed layers keep the mean saving less per micro-batch, one of them rebuilt while a
    # backward runs; a ZeRO-3 gather or reduce-scatter runs in a backward, and in a forward,
    # beyond its micro-batch's activations (module docstring)
    fewer_kept = k * savings / sizes  # per micro-batch, what its k recomputed layers do not keep
    kept = activation - saving * np.repeat(k / sizes, ends - first)  # per layer, one micro-batch's
    suffix = np.append(np.cumsum(kept[::-1])[::-1], 0.0)
    onward = suffix[:n] - np.repeat(suffix[ends], ends - first)  # its stage's layers l onward
    after = onward - kept
    return StageCut(list(starts), stage_time.tolist(), memory.tolist(), n, k.tolist(), grads.tolist(),
                    np.where(grads > 0, largest_adding, 0.0).tolist(),
                    held_always=(total(static) - total(gradients) - total(temporary)).tolist(),
                    gradient_bytes=total(gradients).tolist(),
                    per_micro_batch=(activations - fewer_kept).tolist(),
                    in_backward=(total(temporary) + np.maximum(0.0, most(np.maximum(gather - after,
                                                                                    scatter - onward)))).tolist(),
                    rebuilt=np.where(k > 0, most(saving), 0.0).tolist(),
                    adding=largest_adding.tolist(),
                    in_forward=np.maximum(0.0, most(gather - onward)).tolist())


def _check_recomputed(recomputed: Sequence[int], starts, num_layers: int) -> None:
    sizes = np.diff(list(starts) + [num_layers])
    if len(recomputed) != len(sizes) or any(not 0 <= k <= size for k, size in zip(recomputed, sizes)):
        raise ValueError(f"autopar: describe_cut expected per stage 0..(its layers) recomputed, for stages of "
                         f"{sizes.tolist()} layers; found {list(recomputed)}; give one count per stage, at most "
                         "its layers.")


class RankPeak(NamedTuple):
    """A pipeline rank's peak bytes, and of them the gradients held and the temporaries (one
    backward's: the loss's, a gradient being added) at that instant."""

    total: float
    gradients: float
    temporary: float


def rank_peaks(cut: StageCut, schedule: str | Schedule, micro_batches: int, chunks: int = 1) -> list[RankPeak]:
    """Each pipeline rank's peak, replaying the order torch's schedule runs its stages in
    (``costmodels.memory.schedule_order``) with the cut's per-stage parts: every stage's
    micro-batches in flight at each instant, together (interleaved, a rank's chunks hold
    different counts at different times: the chunk holding the loss keeps one micro-batch
    while the others fill). A backward holds its micro-batch's activations, its stage's
    temporaries and rebuilt layer; a stage's first backward frees one micro-batch as its
    gradients appear (``stage_peak``'s two instants), later ones make a gradient before adding
    it to the accumulated one (``adding``)."""
    v = Schedule.parse(schedule).chunks(chunks)
    ranks = len(cut.starts) // v
    out = []
    for rank, actions in enumerate(schedule_order(schedule, ranks, micro_batches, v)):
        base = sum(cut.held_always[s] for s in range(rank, ranks * v, ranks))
        in_flight, graded, gradients = 0.0, set(), 0.0
        best = RankPeak(base, 0.0, 0.0)

        def at(temporary: float, rebuilt: float = 0.0) -> RankPeak:
            return RankPeak(base + gradients + in_flight + temporary + rebuilt, gradients, temporary)

        for forward, s in actions:
            if forward:
                in_flight += cut.per_micro_batch[s]
                best = _higher(best, at(cut.in_forward[s] if cut.in_forward else 0.0))
                continue
            during, rebuilt = cut.in_backward[s], cut.rebuilt[s]
            if s not in graded:  # its first backward: before any gradient, then with them, one micro-batch freed
                best = _higher(best, at(during, rebuilt))
                graded.add(s)
                gradients += cut.gradient_bytes[s]
                in_flight -= cut.per_micro_batch[s]
                best = _higher(best, at(during + cut.adding[s], rebuilt))
            else:
                best = _higher(best, at(during + cut.adding[s], rebuilt))
                in_flight -= cut.per_micro_batch[s]
        out.append(best)
    return out


def _higher(best: RankPeak, candidate: RankPeak) -> RankPeak:
    return candidate if candidate.total > best.total else best


def stage_peak(static, gradients, activation, saving, peak, layers, in_flight, with_gradients, limit, adding=0.0,
               recomputed=None):
    """(k recomputed, the stage's peak bytes, the gradient bytes held at that peak) of a stage
    holding ``static`` bytes (``gradients`` of them gradients) and ``activation`` bytes per
    micro-batch: the larger of two instants, ``in_flight`` micro-batches before any gradient
    exists and ``with_gradients`` after, ``adding`` bytes more while a gradient is added to
    the accumulated ones (module docstring), with the fewest recomputed layers
    that fit ``limit`` at both (``fewest_recomputed``), or ``recomputed`` of them where given.
    Works on arrays and on numbers."""
    before = static - gradients + in_flight * activation
    after = static + with_gradients * activation + adding
    k_before, _ = fewest_recomputed(before, in_flight * saving, peak, layers, limit)
    k_after, _ = fewest_recomputed(after, with_gradients * saving, peak, layers, limit)
    k = np.maximum(k_before, k_after) if recomputed is None else np.asarray(recomputed, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(layers > 0, saving / layers, 0.0)
    rebuild = np.where(k > 0, peak, 0.0)
    at_before = before - in_flight * k * mean + rebuild
    at_after = after - with_gradients * k * mean + rebuild
    memory = np.maximum(at_before, at_after)
    memory = np.where((k <= layers) & (memory <= limit), memory, np.inf)
    return np.where(np.isfinite(memory), k, 0.0), memory, np.where(at_after >= at_before, gradients, 0.0)


def fewest_recomputed(memory, saving, peak, layers, limit):
    """(k, memory with k recomputed): the fewest of ``layers`` layers to recompute for a stage
    of ``memory`` bytes (none recomputed) to fit ``limit``, where all of them recomputed save
    ``saving`` bytes (its micro-batches in flight) and rebuilding one layer in backward holds
    ``peak`` bytes more. Works on arrays (the DP's every span at once) and on numbers; a
    stage that cannot fit has memory inf."""
    memory, saving, peak = (np.asarray(x, dtype=np.float64) for x in (memory, saving, peak))
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = saving / layers
        needed = np.ceil((memory + peak - limit) / mean * (1 - 1e-12))
    k = np.where(memory <= limit, 0.0, np.where(mean > 0, np.clip(needed, 1.0, None), np.inf))
    with np.errstate(invalid="ignore"):
        fitted = memory - k * mean + np.where(k > 0, peak, 0.0)
    fitted = np.where((k <= layers) & (fitted <= limit), fitted, np.inf)
    return np.where(np.isfinite(fitted), k, 0.0), fitted


def _span_max(values: np.ndarray) -> np.ndarray:
    """[a, b] -> max(values[a:b]) (0 for empty spans), for every start a and end b."""
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    for a in range(n):
        out[a, a + 1:] = np.maximum.accumulate(values[a:])
    return out


def _per_stage(values, default: np.ndarray, stages: int, name: str) -> np.ndarray:
    if values is None:
        return default
    array = np.asarray(values, dtype=np.float64)
    if len(array) != stages:
        raise ValueError(f"autopar: expected {name} for {stages} stages, found {len(array)}.")
    return array


def _per_span(values, layers: int, name: str) -> np.ndarray:
    if values is None:
        return np.zeros((layers + 1, layers + 1))
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (layers + 1, layers + 1):
        raise ValueError(f"autopar: expected {name} of shape {(layers + 1, layers + 1)} (a stage's first layer "
                         f"by its end), found {array.shape}.")
    return array


def _per_layer(values, length: int, name: str) -> np.ndarray:
    if values is None:
        return np.zeros(length)
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (length,):
        raise ValueError(f"autopar: expected {name} with {length} entries, found shape {array.shape}.")
    return array

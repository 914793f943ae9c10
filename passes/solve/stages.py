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
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from autopar.costmodels import Schedule


@dataclass
class StageCut:
    starts: list[int]  # first layer of every stage
    stage_time: list[float]  # seconds per micro-batch, boundary send included
    stage_memory: list[float]  # bytes per device
    num_layers: int
    recomputed: list[int] = field(default_factory=list)  # per stage: how many of its layers recompute
    gradients: list[float] = field(default_factory=list)  # per stage: gradient bytes held at its peak
    accumulating: list[float] = field(default_factory=list)  # per stage: a gradient being added, at its peak

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
) -> StageCut | None:
    """Contiguous cut minimising the slowest stage; ``None`` when no cut fits in memory.
    ``recompute_saving`` / ``recompute_time``: per layer and micro-batch, the bytes a
    recomputed layer does not keep and the seconds it adds; ``gradient_memory``: per layer,
    the gradients' part of ``static_memory``; ``in_flight_with_gradients``: per stage, the
    micro-batches in flight once gradients exist; ``accumulating``: per layer, the largest
    gradient a backward makes before adding it to the accumulated one (module docstring)."""
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
    span_activation = activation_prefix[b] - activation_prefix[a]
    span_layers = np.maximum(b - a, 1)
    span_saving, span_redo = saving_prefix[b] - saving_prefix[a], redo_prefix[b] - redo_prefix[a]
    span_gradients = gradient_prefix[b] - gradient_prefix[a]
    span_peak, span_adding = _span_max(saving), _span_max(adding)
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
    return describe_cut(starts, time, static, activation, flights, send, saving, redo, cap, gradients, graded, adding)


def describe_cut(starts, time, static, activation, in_flight, send, saving=None, redo=None,
                 memory_limit: float = math.inf, gradients=None, in_flight_with_gradients=None,
                 accumulating=None) -> StageCut:
    """Times and memories of a given cut, each stage recomputing the fewest layers that fit
    ``memory_limit`` (used by the DP and by brute-force tests)."""
    n = len(time)
    saving, redo, gradients, adding = (np.zeros(n) if x is None else np.asarray(x, dtype=np.float64)
                                       for x in (saving, redo, gradients, accumulating))
    graded = in_flight if in_flight_with_gradients is None else in_flight_with_gradients
    ends = list(starts[1:]) + [n]
    stage_time, stage_memory, recomputed, held, added = [], [], [], [], []
    for s, (a, b) in enumerate(zip(starts, ends)):
        k, memory, grads = stage_peak(float(static[a:b].sum()), float(gradients[a:b].sum()),
                                      float(activation[a:b].sum()), float(saving[a:b].sum()),
                                      float(saving[a:b].max()), b - a, in_flight[s], graded[s], memory_limit,
                                      float(adding[a:b].max()))
        k = int(k)
        stage_time.append(float(time[a:b].sum() + k * redo[a:b].sum() / (b - a) + (send[b - 1] if b < n else 0.0)))
        stage_memory.append(float(memory))
        recomputed.append(k)
        held.append(float(grads))
        added.append(float(adding[a:b].max()) if grads > 0 else 0.0)
    return StageCut(list(starts), stage_time, stage_memory, n, recomputed, held, added)


def stage_peak(static, gradients, activation, saving, peak, layers, in_flight, with_gradients, limit, adding=0.0):
    """(k recomputed, the stage's peak bytes, the gradient bytes held at that peak) of a stage
    holding ``static`` bytes (``gradients`` of them gradients) and ``activation`` bytes per
    micro-batch: the larger of two instants, ``in_flight`` micro-batches before any gradient
    exists and ``with_gradients`` after, ``adding`` bytes more while a gradient is added to
    the accumulated ones (module docstring), with the fewest recomputed layers
    that fit ``limit`` at both (``fewest_recomputed``). Works on arrays and on numbers."""
    before = static - gradients + in_flight * activation
    after = static + with_gradients * activation + adding
    k_before, _ = fewest_recomputed(before, in_flight * saving, peak, layers, limit)
    k_after, _ = fewest_recomputed(after, with_gradients * saving, peak, layers, limit)
    k = np.maximum(k_before, k_after)
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


def _per_layer(values, length: int, name: str) -> np.ndarray:
    if values is None:
        return np.zeros(length)
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (length,):
        raise ValueError(f"autopar: expected {name} with {length} entries, found shape {array.shape}.")
    return array

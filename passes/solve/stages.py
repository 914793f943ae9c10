"""The stage search: layers cut into pipeline stages, what each stage holds, the step time.

Inputs
    ``LayerCosts``, per layer ``l`` of ``0..L-1`` (per micro-batch where it scales with one):
    ``time[l]`` (forward + backward seconds), ``static_memory[l]`` (bytes held whatever is in
    flight; of them ``gradient_memory[l]`` gradients and ``temporary_memory[l]`` alive only while
    one of its backwards runs), ``activation_memory[l]`` (bytes per micro-batch in flight),
    ``boundary_time[l]`` (the send after layer ``l < L - 1``), ``recompute_saving[l]`` and
    ``recompute_time[l]`` (the bytes a recomputed layer does not keep, the seconds its forward
    adds again), ``accumulating[l]`` (the largest gradient a backward makes before adding it to
    the accumulated one), ``gather_memory[l]`` and ``scatter_memory[l]`` (what its ZeRO-3 gather,
    and its gradients' reduce-scatter, hold while they run:
    ``costmodels.memory.gather_working_bytes``, ``scatter_working_bytes``), ``weight_grad_memory[l]``
    (the gradients a split backward keeps for its weight-gradient part) and ``regathered_memory[l]``
    (its ZeRO-3 weights, gathered again for the input-gradient part and kept until the weight-
    gradient part reduces their gradients: per micro-batch awaiting, whatever its size); per stage of layers
    ``[a, b)``, ``stage_io[a, b]`` (bytes per micro-batch of the values it receives and sends,
    which torch's ``PipelineStage`` keeps until that micro-batch's backward, beyond its layers'
    activations) and ``io_credit[a, b]`` (of them, what its recomputed layers' kept inputs
    charge too: the received tensor is that input; ``autopar.passes.planner.stage_io``).
    ``InFlight``, per (virtual) stage ``s``: ``peak[s]`` micro-batches whose activations the
    schedule keeps alive at the stage's peak, ``with_gradients[s]`` once a backward has made its
    gradients (``InFlight.of``: the schedule's counts). ``memory_limit``: bytes per stage.

Variables
    ``starts``: the first layer of each of the ``S`` stages (``starts[0] = 0``, increasing);
    stage ``s`` holds layers ``[starts[s], starts[s+1])``;
    ``k[s]``: how many of stage ``s``'s ``n[s]`` layers recompute.

Objective (``cut_stages``)
    minimise  max_s time(s, k[s])
    time(s, k) = sum of time over its layers + boundary_time[its last layer] (none after the
                 last stage) + k * mean recompute_time over its layers

Constraints (``stage_peak``: every stage, on its sums over its layers ``StageSums``)
    memory(s, k[s]) <= memory_limit, the larger of two instants:
      before any gradient:  static - G + R + peak[s] * (A - k * X / n) + (k > 0) * Y + awaiting[s] * K
      with the gradients:   static + R + with_gradients[s] * (A - k * X / n) + T + (k > 0) * Y + awaiting[s] * K
    where ``static`` is static_memory summed (temporary_memory included, held throughout here;
    ``rank_replay.rank_peaks`` tells it apart), ``G`` gradient_memory summed, ``A``
    activation_memory summed + stage_io, ``X`` recompute_saving summed + io_credit, ``Y`` the
    largest recompute_saving (backward rebuilds one recomputed layer of one micro-batch at a
    time; where the costs recompute layers already, pinned, the largest rebuilt_memory instead
    of ``(k > 0) * Y``), ``T`` the largest accumulating (each backward after the first makes a gradient
    before adding it to the accumulated one) and ``R`` the largest gather_memory or
    scatter_memory (one runs at a time; held throughout, as ``T``), ``K`` weight_grad_memory and
    regathered_memory summed (a split backward's micro-batch keeps them from its input-gradient part
    to its weight-gradient part; ``awaiting[s]`` of them at most, ``InFlight.of``); ``k[s]`` is the fewest that
    fit (``fewest_recomputed``). GPipe's peak is its first backward's start, M in flight and no
    gradient made yet, and each backward frees one micro-batch as the gradients appear
    (``costmodels.memory.in_flight_with_gradients``); without ``with_gradients`` the gradients
    are held at the peak. A recomputed layer keeps only its inputs (``recompute_saving[l]`` less
    per micro-batch in flight) and runs its forward again in backward; the means over a stage's
    layers are exact for alike layers (a model's repeated layers), and
    ``autopar.passes.planner.pipeline.recomputed_layers`` picks the ``k`` with the largest saving,
    which save at least the mean.

Search (``cut_stages``): the exact DP over prefix sums, every (start a, end b) at once

    best[s][b] = min over a < b of max(best[s-1][a], time(layers a..b-1 as stage s))

(``O(S * L^2)``, vectorised over ``a``), a span whose memory is over the limit excluded.

A cut described (``describe_cut``: the DP's, or any cut with given recomputed counts) keeps
each stage's memory apart in the parts a rank's peak is replayed from
(``rank_replay.rank_peaks``): held always, gradients from its first backward, one micro-batch's
activations per micro-batch in flight, and what exists only during one of its backwards (``T``,
a rebuilt layer, a gradient being added). For one stage per rank that replay is ``memory(s)``;
with interleaving it is less than the chunks' own peaks added up: the chunk holding the loss
runs each micro-batch's backward right after its forward while the rank's other chunks fill, so
its temporaries meet one micro-batch of its own in flight. A ZeRO-3 stage gathers a layer's
weights at its first use and frees them after, in forward and again in backward, where its
gradients are then reduce-scattered: a forward gathers layer l before its and the later layers'
activations exist; a backward gathers it again while they, less those of the later layers,
still exist, and reduce-scatters once its own are freed too. So a stage's forward holds
``max_l(gather_memory[l] - A[l:])`` beyond its micro-batch's activations, and a backward
``max_l max(gather_memory[l] - A[l+1:], scatter_memory[l] - A[l:])`` with ``A[l:]`` the
micro-batch's activations of layers l onward in the stage (none below 0). A split backward
(zero bubble) frees nothing in its input-gradient part, which gathers layer l again while the
stage's copies after it are kept (of ``K``) and those up to it are not made yet; its weight-gradient
part reduce-scatters layer l's gradients once the copies from l on are freed:
``max_l max(gather_memory[l] - C[:l+1], scatter_memory[l] - A[l:] - C[l:])``, ``C`` the stage's
regathered_memory.

Step time (``pipeline_step_time``), with ``M`` micro-batches and ``P`` ranks, is the
schedule's own (``costmodels.Schedule.step_time``):
    GPipe and 1F1B:       (M + P - 1) * slowest stage
    interleaved 1F1B, ``v`` chunks per rank (virtual stage c on rank c mod P):
        M * slowest rank + (P - 1) * slowest chunk,
    which for equal chunks is (M + (P - 1) / v) * rank time: a bubble of
    (P - 1) / (v * M) relative to the ideal M * rank time; the zero-bubble schedules (ZB-V and
    DualPipe-V with their V-shaped placement, ``Schedule.rank_of``): M * slowest rank + (P - 1) *
    the slowest chunk's forward.
"""

from __future__ import annotations

import math
from functools import partial
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from autopar.costmodels import Schedule
from autopar.costmodels.memory import awaiting_weights, in_flight_with_gradients

# LayerCosts' fields with one number per layer (None: zeros), and per stage of layers [a, b)
_PER_LAYER = ("static_memory", "activation_memory", "recompute_saving", "recompute_time", "gradient_memory",
              "accumulating", "temporary_memory", "gather_memory", "scatter_memory", "weight_grad_memory",
              "regathered_memory", "rebuilt_memory")
_PER_SPAN = ("stage_io", "io_credit")


@dataclass
class LayerCosts:
    """Per-layer numbers of one (pipeline depth, micro-batch count): the stage search's input
    (module docstring). Arrays of float64 once built; a field left None is zeros."""

    time: Sequence[float]  # forward + backward seconds per micro-batch
    static_memory: Sequence[float] | None = None  # parameters, gradients, optimizer state: bytes per device
    activation_memory: Sequence[float] | None = None  # bytes per device per micro-batch in flight
    boundary_time: Sequence[float] | None = None  # L - 1 sends between layer l and l + 1
    step_overhead: float = 0.0  # seconds per step outside the pipeline (gradient sync, optimizer)
    # per micro-batch: bytes a recomputed layer does not keep, seconds its forward adds again
    # (either None: no layer may be recomputed; ``cut_stages`` picks the fewest per stage)
    recompute_saving: Sequence[float] | None = None
    recompute_time: Sequence[float] | None = None
    gradient_memory: Sequence[float] | None = None  # the gradients' part of static_memory
    accumulating: Sequence[float] | None = None  # the largest gradient a backward adds
    temporary_memory: Sequence[float] | None = None  # the part of static_memory alive only in a backward
    gather_memory: Sequence[float] | None = None  # what its ZeRO-3 gather holds while it runs
    scatter_memory: Sequence[float] | None = None  # ... and its gradients' reduce-scatter
    # per micro-batch: the gradients a split backward keeps from its input-gradient part until
    # its weight-gradient part starts from them (``saved.weight_gradient_starts``' outputs')
    weight_grad_memory: Sequence[float] | None = None
    # per micro-batch awaiting its weight-gradient part: its ZeRO-3 weights gathered again for
    # the input-gradient part, kept until the weight-gradient part reduces their gradients
    regathered_memory: Sequence[float] | None = None
    # per micro-batch: what a layer the costs recompute already (recomputation pinned: its
    # activations folded in as its inputs) rebuilds in its backward, one layer at a time
    rebuilt_memory: Sequence[float] | None = None
    # per stage of layers [a, b) ([L + 1, L + 1]): bytes per micro-batch it holds of the values it
    # receives and sends beyond activation_memory, and of them what its recomputed layers free
    stage_io: np.ndarray | None = None
    io_credit: np.ndarray | None = None
    recomputable: bool = field(init=False, default=False)  # recompute_saving and recompute_time given

    def __post_init__(self) -> None:
        self.recomputable = self.recompute_saving is not None and self.recompute_time is not None
        self.time = np.asarray(self.time, dtype=np.float64)
        if self.time.ndim != 1 or len(self.time) < 1:
            raise ValueError(f"autopar: LayerCosts expected time as one number per layer (at least one), "
                             f"found shape {self.time.shape}; give each layer's seconds per micro-batch.")
        layers = len(self.time)
        for name in _PER_LAYER:
            setattr(self, name, _per_layer(getattr(self, name), layers, name))
        self.boundary_time = _per_layer(self.boundary_time, layers - 1, "boundary_time")
        for name in _PER_SPAN:
            setattr(self, name, _per_span(getattr(self, name), layers, name))

    @property
    def layers(self) -> int:
        return len(self.time)

    @property
    def awaited(self) -> np.ndarray:
        """Per layer, what one micro-batch awaiting its weight-gradient part keeps (``K``)."""
        return self.weight_grad_memory + self.regathered_memory


@dataclass(frozen=True, eq=False)
class InFlight:
    """Micro-batches whose activations a stage keeps alive, per (virtual) stage, or one stage's
    as numbers: ``peak`` at its peak, ``with_gradients`` once a backward has made its gradients
    (None: as at the peak, the gradients held then; module docstring); ``awaiting``: the most
    whose split backward awaits its weight-gradient part (None: none)."""

    peak: np.ndarray
    with_gradients: np.ndarray | None = None
    awaiting: np.ndarray | None = None

    def __post_init__(self) -> None:
        peak = np.asarray(self.peak, dtype=np.float64)
        after = peak if self.with_gradients is None else np.asarray(self.with_gradients, dtype=np.float64)
        awaiting = np.zeros_like(peak) if self.awaiting is None else np.asarray(self.awaiting, dtype=np.float64)
        if after.shape != peak.shape or awaiting.shape != peak.shape:
            raise ValueError(f"autopar: InFlight expected with_gradients for as many stages as peak ({peak.shape}), "
                             f"and awaiting too; found {after.shape} and {awaiting.shape}; give one count per stage.")
        object.__setattr__(self, "peak", peak)
        object.__setattr__(self, "with_gradients", after)
        object.__setattr__(self, "awaiting", awaiting)

    @classmethod
    def of(cls, schedule: str | Schedule, stages: int, micro_batches: int, chunks_per_rank: int = 1) -> InFlight:
        """The schedule's counts per (virtual) stage (``Schedule.in_flight_per_stage``: ``M`` under
        GPipe, ``min(M, P - r)`` under 1F1B, Megatron's warm-up under interleaved 1F1B, each chunk
        holding its rank's rounded-up count; ``costmodels.memory.in_flight_with_gradients``)."""
        schedule = Schedule.parse(schedule)
        return cls(schedule.in_flight_per_stage(stages, micro_batches, chunks_per_rank),
                   in_flight_with_gradients(schedule, stages, micro_batches, chunks_per_rank),
                   awaiting_weights(schedule, stages, micro_batches, chunks_per_rank))

    def stage(self, s: int) -> InFlight:
        return InFlight(self.peak[s], self.with_gradients[s], self.awaiting[s])


class StageSums(NamedTuple):
    """What ``stage_peak`` reads of a stage, over its layers: numbers for one stage, arrays for
    many (the DP's every span ``[a, b)`` at once). Module docstring: ``static`` + ``R``, ``G``,
    ``A``, ``X``, ``Y``, ``n``, ``T``."""

    static: np.ndarray  # bytes held whatever is in flight (gradients, a running ZeRO-3 gather included)
    gradients: np.ndarray  # the gradients' part of static
    activation: np.ndarray  # bytes per micro-batch in flight (what it receives and sends included)
    saving: np.ndarray  # of activation, what recomputing every layer frees
    largest_saving: np.ndarray  # a recomputed layer rebuilt in backward
    layers: np.ndarray
    adding: np.ndarray | float = 0.0  # a gradient being added to the accumulated ones
    awaiting: np.ndarray | float = 0.0  # per micro-batch awaiting its weight gradients: what it keeps
    rebuilt: np.ndarray | float = 0.0  # a layer the costs recompute, rebuilt in backward (pinned)


@dataclass
class StageCut:
    starts: list[int]  # first layer of every stage
    stage_time: list[float]  # seconds per micro-batch, boundary send included
    stage_memory: list[float]  # bytes per device
    num_layers: int
    recomputed: list[int] = field(default_factory=list)  # per stage: how many of its layers recompute
    gradients: list[float] = field(default_factory=list)  # per stage: gradient bytes held at its peak
    accumulating: list[float] = field(default_factory=list)  # per stage: a gradient being added, at its peak
    # per stage, what a replay of the schedule's order adds up (``rank_replay.rank_peaks``): bytes held
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
    awaiting: list[float] = field(default_factory=list)  # a micro-batch awaiting its weight gradients keeps

    @property
    def slowest(self) -> float:
        return max(self.stage_time)

    def layers(self, stage: int) -> range:
        end = self.starts[stage + 1] if stage + 1 < len(self.starts) else self.num_layers
        return range(self.starts[stage], end)


def pipeline_step_time(stage_time: Sequence[float], micro_batches: int, schedule: str | Schedule,
                       chunks_per_rank: int = 1) -> float:
    """Predicted pipeline time of one step from per-micro-batch (virtual) stage times
    (``Schedule.step_time``)."""
    return Schedule.parse(schedule).step_time(stage_time, micro_batches, chunks_per_rank)


def cut_stages(costs: LayerCosts, stages: int, in_flight: InFlight | None = None,
               memory_limit: float | None = None) -> StageCut | None:
    """The contiguous cut of ``costs``' layers into ``stages`` stages minimising the slowest,
    each stage recomputing the fewest layers that fit ``memory_limit`` with ``in_flight``
    micro-batches (None: one per stage); ``None`` when no cut fits (module docstring)."""
    _check_stages(costs, stages, "cut_stages")
    in_flight = _for_stages(in_flight, stages, "cut_stages")
    cap = math.inf if memory_limit is None else memory_limit * (1 + 1e-12)
    starts = _cut_starts(costs, stages, in_flight, cap)
    return None if starts is None else describe_cut(costs, starts, in_flight, memory_limit=cap)


def fastest_starts(costs: LayerCosts, stages: int) -> list[int]:
    """The starts of ``cut_stages``' cut with no memory limit: nothing recomputes and every span
    fits, so the DP reads no in-flight count and one cut serves every schedule of ``stages``."""
    _check_stages(costs, stages, "fastest_starts")
    return _cut_starts(costs, stages, InFlight(np.ones(stages)), math.inf)


def _check_stages(costs: LayerCosts, stages: int, caller: str) -> None:
    if not 1 <= stages <= costs.layers:
        raise ValueError(f"autopar: {caller} expected 1 <= stages <= number of layers ({costs.layers}), "
                         f"found stages={stages}; use fewer pipeline stages.")


def _cut_starts(costs: LayerCosts, stages: int, in_flight: InFlight, cap: float) -> list[int] | None:
    """``cut_stages``' DP: the first layer of each stage of the best cut (None: none fits ``cap``)."""
    num_layers = costs.layers
    time_prefix, static_prefix, activation_prefix, saving_prefix, recompute_prefix, gradient_prefix, weight_prefix = (
        np.concatenate([[0.0], np.cumsum(x)]) for x in (
            costs.time, costs.static_memory, costs.activation_memory, costs.recompute_saving, costs.recompute_time,
            costs.gradient_memory, costs.awaited))

    # best[s][b]: least slowest-stage time of stages 0..s covering layers [0, b); each stage
    # s is one step over every (start a, end b) at once, a on rows and b on columns.
    best = np.full((stages, num_layers + 1), np.inf)
    choice = np.zeros((stages, num_layers + 1), dtype=np.int64)
    a = np.arange(num_layers + 1)[:, None]
    b = np.arange(num_layers + 1)[None, :]
    sent = np.concatenate([[0.0], costs.boundary_time, [0.0]])  # sent[b]: the send after layer b - 1
    span_time = time_prefix[b] - time_prefix[a]
    span_recompute_time = recompute_prefix[b] - recompute_prefix[a]
    # the spans [a, b) a stage may be (a < b), flat: what one recomputes and whether it fits
    # depend on the stage by its in-flight counts alone, so stages that share them (a rank's
    # chunks, GPipe's stages) share one pricing
    ia, ib = np.triu_indices(num_layers + 1, k=1)
    spans = StageSums(
        # a ZeRO-3 gather or reduce-scatter running, held throughout
        static=(static_prefix[ib] - static_prefix[ia]
                + _span_max(np.maximum(costs.gather_memory, costs.scatter_memory))[ia, ib]),
        gradients=gradient_prefix[ib] - gradient_prefix[ia],
        activation=activation_prefix[ib] - activation_prefix[ia] + costs.stage_io[ia, ib],
        saving=saving_prefix[ib] - saving_prefix[ia] + costs.io_credit[ia, ib],
        largest_saving=_span_max(costs.recompute_saving)[ia, ib],
        layers=ib - ia,
        adding=_span_max(costs.accumulating)[ia, ib],
        awaiting=weight_prefix[ib] - weight_prefix[ia],
        rebuilt=_span_max(costs.rebuilt_memory)[ia, ib],
    )
    fitted: dict[tuple[float, float, float], tuple[np.ndarray, np.ndarray]] = {}
    for s in range(stages):
        last = s == stages - 1
        ends = (b == num_layers) if last else ((b >= s + 1) & (b <= num_layers - (stages - 1 - s)))
        starts = (a == 0) if s == 0 else ((a >= s) & (a < b))
        counts = in_flight.stage(s)
        if (key := (float(counts.peak), float(counts.with_gradients), float(counts.awaiting))) not in fitted:
            # without a limit stage_peak recomputes nothing, and every memory is at most inf
            k, memory, _ = stage_peak(spans, counts, cap) if cap < math.inf else (np.zeros(len(ia)), None, None)
            recompute, fits = np.zeros_like(span_time), np.zeros(span_time.shape, dtype=bool)
            recompute[ia, ib] = k * span_recompute_time[ia, ib] / spans.layers
            fits[ia, ib] = True if memory is None else memory <= cap
            fitted[key] = recompute, fits
        recompute, fits = fitted[key]
        stage = span_time + recompute + (0.0 if last else sent[b])
        before = best[s - 1][:, None] if s else np.zeros((num_layers + 1, 1))
        value = np.where(starts & ends & fits, np.maximum(before, stage), np.inf)
        k = np.argmin(value, axis=0)
        best[s] = value[k, np.arange(num_layers + 1)]
        choice[s] = k
    if not np.isfinite(best[-1][num_layers]):
        return None
    starts, b = [], num_layers
    for s in range(stages - 1, -1, -1):
        starts.append(int(choice[s][b]))
        b = starts[-1]
    starts.reverse()
    return starts


def describe_cut(costs: LayerCosts, starts: Sequence[int], in_flight: InFlight | None = None, *,
                 memory_limit: float = math.inf, recomputed: Sequence[int] | None = None) -> StageCut:
    """Times and memories of the cut of ``costs``' layers at ``starts``, each stage recomputing
    the fewest layers that fit ``memory_limit`` with ``in_flight`` micro-batches (None: one per
    stage; used by the DP and by brute-force tests), or ``recomputed[s]`` of them where given
    (whatever that holds: ``solve.rank_fit`` picks them by the ranks' replayed peaks), and the
    parts of each stage's memory that ``rank_replay.rank_peaks`` replays the schedule with."""
    n = costs.layers
    if recomputed is not None:
        _check_recomputed(recomputed, starts, n)
    in_flight = _for_stages(in_flight, len(starts), "describe_cut")
    # every stage at once (a stage is layers [a, b)): its sums and maxima over its layers
    first = np.asarray(starts, dtype=np.intp)
    ends = np.append(first[1:], n)
    sizes = (ends - first).astype(np.float64)
    total, most = partial(np.add.reduceat, indices=first), partial(np.maximum.reduceat, indices=first)
    gather, scatter, saving = costs.gather_memory, costs.scatter_memory, costs.recompute_saving
    largest_adding = most(costs.accumulating)
    stage = StageSums(
        static=total(costs.static_memory) + most(np.maximum(gather, scatter)),  # as the DP holds a running one
        gradients=total(costs.gradient_memory),
        # with what each stage holds of the values it receives and sends, and what recomputing frees of it
        activation=total(costs.activation_memory) + costs.stage_io[first, ends],
        saving=total(saving) + costs.io_credit[first, ends],
        largest_saving=most(saving),
        layers=sizes,
        adding=largest_adding,
        awaiting=total(costs.awaited),
        rebuilt=most(costs.rebuilt_memory),
    )
    k, memory, grads = stage_peak(stage, in_flight, memory_limit if recomputed is None else math.inf, recomputed)
    k = k.astype(int)
    sent = np.zeros(len(first))  # the boundary send after each stage but the last
    sent[ends < n] = costs.boundary_time[ends[ends < n] - 1]
    stage_time = total(costs.time) + k * total(costs.recompute_time) / sizes + sent
    # each stage's parts of ``stage_peak``'s memory, apart, for ``rank_replay.rank_peaks`` to replay: k
    # recomputed layers keep the mean saving less per micro-batch, one of them rebuilt while a
    # backward runs; a ZeRO-3 gather or reduce-scatter runs in a backward, and in a forward,
    # beyond its micro-batch's activations (module docstring)
    fewer_kept = k * stage.saving / sizes  # per micro-batch, what its k recomputed layers do not keep
    kept = costs.activation_memory - saving * np.repeat(k / sizes, ends - first)  # per layer, one micro-batch's
    suffix = np.append(np.cumsum(kept[::-1])[::-1], 0.0)
    onward = suffix[:n] - np.repeat(suffix[ends], ends - first)  # its stage's layers l onward
    after = onward - kept
    in_backward = np.maximum(gather - after, scatter - onward)
    # A split backward (not stage 0's: it runs whole at its W) keeps the weights its input-
    # gradient part gathers again until its W (``awaiting``): that part gathers layer l while
    # every activation is kept and the copies of the stage's layers from l back do not exist
    # yet; its W reduce-scatters layer l's gradients once the copies from l on are freed.
    copies, repeat = costs.regathered_memory, partial(np.repeat, repeats=ends - first)
    through = np.cumsum(copies) - repeat(np.cumsum(copies)[first] - copies[first])  # the stage's layers up to l
    split = np.maximum(gather - through, scatter - onward - (repeat(total(copies)) - through + copies))
    in_backward = np.where(repeat(in_flight.awaiting > 0), split, in_backward)
    temporary = total(costs.temporary_memory)
    return StageCut(list(starts), stage_time.tolist(), memory.tolist(), n, k.tolist(), grads.tolist(),
                    np.where(grads > 0, largest_adding, 0.0).tolist(),
                    held_always=(total(costs.static_memory) - stage.gradients - temporary).tolist(),
                    gradient_bytes=stage.gradients.tolist(),
                    per_micro_batch=(stage.activation - fewer_kept).tolist(),
                    in_backward=(temporary + np.maximum(0.0, most(in_backward))).tolist(),
                    rebuilt=rebuilt(stage, k).tolist(),
                    adding=largest_adding.tolist(),
                    in_forward=np.maximum(0.0, most(gather - onward)).tolist(),
                    awaiting=stage.awaiting.tolist())


def _check_recomputed(recomputed: Sequence[int], starts, num_layers: int) -> None:
    sizes = np.diff(list(starts) + [num_layers])
    if len(recomputed) != len(sizes) or any(not 0 <= k <= size for k, size in zip(recomputed, sizes)):
        raise ValueError(f"autopar: describe_cut expected per stage 0..(its layers) recomputed, for stages of "
                         f"{sizes.tolist()} layers; found {list(recomputed)}; give one count per stage, at most "
                         "its layers.")


def _for_stages(in_flight: InFlight | None, stages: int, caller: str) -> InFlight:
    """``in_flight`` checked to count ``stages`` stages (None: one micro-batch each)."""
    if in_flight is None:
        return InFlight(np.ones(stages))
    if in_flight.peak.shape != (stages,):
        raise ValueError(f"autopar: {caller} expected in-flight counts for {stages} stages, found shape "
                         f"{in_flight.peak.shape}; give one count per (virtual) stage (InFlight.of).")
    return in_flight


def stage_peak(stage: StageSums, in_flight: InFlight, limit: float, recomputed=None):
    """(k recomputed, the stage's peak bytes, the gradient bytes held at that peak) of ``stage``:
    the larger of two instants, ``in_flight.peak`` micro-batches before any gradient exists and
    ``in_flight.with_gradients`` after, ``stage.adding`` bytes more while a gradient is added to
    the accumulated ones (module docstring), with the fewest recomputed layers that fit
    ``limit`` at both (``fewest_recomputed``), or ``recomputed`` of them where given. Works on
    arrays (every span, or every stage, at once) and on numbers."""
    static, gradients, activation, saving, largest_saving, layers, adding, kept, _ = stage
    peak, with_gradients = in_flight.peak, in_flight.with_gradients
    # what micro-batches awaiting their weight gradients keep, at either instant: they wait
    # from a first input-gradient part, before the stage's gradients exist, until its last W
    awaiting = in_flight.awaiting * kept
    before = static - gradients + peak * activation + awaiting
    after = static + with_gradients * activation + adding + awaiting
    k_before, _ = fewest_recomputed(before, peak * saving, largest_saving, layers, limit)
    k_after, _ = fewest_recomputed(after, with_gradients * saving, largest_saving, layers, limit)
    k = np.maximum(k_before, k_after) if recomputed is None else np.asarray(recomputed, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(layers > 0, saving / layers, 0.0)
    rebuild = rebuilt(stage, k)
    at_before = before - peak * k * mean + rebuild
    at_after = after - with_gradients * k * mean + rebuild
    memory = np.maximum(at_before, at_after)
    memory = np.where((k <= layers) & (memory <= limit), memory, np.inf)
    return np.where(np.isfinite(memory), k, 0.0), memory, np.where(at_after >= at_before, gradients, 0.0)


def rebuilt(stage: StageSums, k) -> np.ndarray:
    """What a backward of ``stage`` rebuilds with ``k`` of its layers recomputed: its largest
    recomputed layer (``Y``), or where the costs recompute layers already (pinned), the largest
    of those."""
    return np.maximum(np.where(k > 0, stage.largest_saving, 0.0), stage.rebuilt)


def fewest_recomputed(memory, saving, largest_saving, layers, limit):
    """(k, memory with k recomputed): the fewest of ``layers`` layers to recompute for a stage
    of ``memory`` bytes (none recomputed) to fit ``limit``, where all of them recomputed save
    ``saving`` bytes (its micro-batches in flight) and rebuilding one layer in backward holds
    ``largest_saving`` bytes more. Works on arrays (the DP's every span at once) and on numbers;
    a stage that cannot fit has memory inf."""
    memory, saving, largest_saving = (np.asarray(x, dtype=np.float64) for x in (memory, saving, largest_saving))
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = saving / layers
        needed = np.ceil((memory + largest_saving - limit) / mean * (1 - 1e-12))
    k = np.where(memory <= limit, 0.0, np.where(mean > 0, np.clip(needed, 1.0, None), np.inf))
    with np.errstate(invalid="ignore"):
        fitted = memory - k * mean + np.where(k > 0, largest_saving, 0.0)
    fitted = np.where((k <= layers) & (fitted <= limit), fitted, np.inf)
    return np.where(np.isfinite(fitted), k, 0.0), fitted


def _span_max(values: np.ndarray) -> np.ndarray:
    """[a, b] -> max(values[a:b]) (0 for empty spans), for every start a and end b."""
    n = len(values)
    out = np.zeros((n + 1, n + 1))
    for a in range(n):
        out[a, a + 1:] = np.maximum.accumulate(values[a:])
    return out


def _per_span(values, layers: int, name: str) -> np.ndarray:
    if values is None:
        return np.zeros((layers + 1, layers + 1))
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (layers + 1, layers + 1):
        raise ValueError(f"autopar: LayerCosts expected {name} of shape {(layers + 1, layers + 1)} (a stage's "
                         f"first layer by its end, for {layers} layers), found {array.shape}; give one number "
                         "per stage [a, b).")
    return array


def _per_layer(values, length: int, name: str) -> np.ndarray:
    if values is None:
        return np.zeros(length)
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (length,):
        raise ValueError(f"autopar: LayerCosts expected {name} with {length} entries, found shape {array.shape}; "
                         f"give one number per {'boundary between layers' if name == 'boundary_time' else 'layer'}.")
    return array

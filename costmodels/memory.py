"""Memory per device and pipeline-schedule quantities.

Parameters, gradients and AdamW state under ZeRO 0-3 (``formulas.ZERO_MEMORY``), and by
schedule name (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zero_bubble"``,
``"zbv_zero_bubble"``, ``"dualpipe_v"`` or a ``Schedule``) the activations alive under it, its bubble and its step time: the
``Schedule`` methods (``autopar.costmodels.schedules``), which hold that mathematics; the
order torch's schedules run their actions in (``schedule_actions``, ``schedule_order``).
What a ZeRO-3 bucket's gather and reduce-scatter hold while they run
(``gather_working_bytes``, ``scatter_working_bytes``), and while they run beside compute
(``gather_ahead_bytes``, ``scatter_in_flight_bytes``).
"""

from __future__ import annotations

from functools import lru_cache
from unittest.mock import patch

import torch
from torch.distributed.pipelining.schedules import _ComputationType

from autopar.costmodels.formulas import BYTES_PER_PARAM, compiled
from autopar.costmodels.schedules import Schedule


@lru_cache(maxsize=None)
def _fn(name: str):
    return compiled(name)


def _precision(precision: str) -> tuple[int, int, int]:
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"autopar: precision must be one of {list(BYTES_PER_PARAM)}; found {precision!r}.")
    return BYTES_PER_PARAM[precision]


def model_state_bytes(n_params: float, zero: int, n_shards: int, precision: str = "mixed") -> float:
    """Bytes per device of parameters + gradients + AdamW state for ``n_params``
    parameters at ZeRO stage ``zero`` sharded over ``n_shards`` ranks.

    ``precision="mixed"`` is the ZeRO paper's 2+2+12 bytes per parameter (16Psi,
    4Psi+12Psi/N, 2Psi+14Psi/N, 16Psi/N); ``"fp32"`` is 4+4+8.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"autopar: ZeRO stage must be 0, 1, 2 or 3; found {zero!r}.")
    if n_shards < 1:
        raise ValueError(f"autopar: n_shards must be >= 1; found {n_shards}.")
    p, g, o = _precision(precision)
    return _fn(f"zero{zero}")(n_params, p, g, o, n_shards)


def micro_batches_in_flight(schedule: str | Schedule, stages: int, micro_batches: int, chunks: int = 1,
                            rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak
    (``Schedule.in_flight``)."""
    return Schedule.parse(schedule).in_flight(stages, micro_batches, chunks, rank)


def in_flight_with_gradients(schedule: str | Schedule, stages: int, micro_batches: int,
                             chunks: int = 1) -> list[float]:
    """Per (virtual) stage, the most micro-batches whose activations it holds once a backward
    has made its gradients, as torch's schedules run: GPipe runs every forward first, so its
    peak (``Schedule.in_flight_per_stage``: M) comes before any gradient, and the first
    backward frees one micro-batch as it makes them (M - 1); 1F1B's rank r runs min(M, P - r)
    forwards, then a backward before each further forward, so that count is held again with
    gradients when M > P - r (else, as GPipe, one less); interleaved 1F1B reaches its peak
    count again after its first backwards (checked against torch's orders by the tests). Zero
    bubble makes gradients at its weight-gradient actions: the count is read from torch's order
    (``schedule_order``), a rank's spread evenly over its chunks as ``in_flight_per_stage`` does."""
    schedule = Schedule.parse(schedule)
    peak = schedule.in_flight_per_stage(stages, micro_batches, chunks)
    if schedule.split_backward:
        v = schedule.chunks(chunks)
        per_rank = [_held_with_gradients(order) / v for order in schedule_order(schedule, stages, micro_batches, v)]
        return [per_rank[schedule.rank_of(c, stages)] for c in range(stages * v)]
    if schedule is Schedule.INTERLEAVED_1F1B:
        return peak
    if schedule is Schedule.GPIPE:
        return [n - 1 for n in peak]
    return [n if micro_batches > n else n - 1 for n in peak]


def awaiting_weights(schedule: str | Schedule, stages: int, micro_batches: int, chunks: int = 1) -> list[float]:
    """Per (virtual) stage, the most micro-batches whose split backward has run its
    input-gradient part and not yet its weight-gradient part (``schedule_actions``' I and W):
    each keeps the gradients its weight gradients start from. None without a split backward,
    and none on stage 0, whose input-gradient part torch skips (it runs the whole backward at
    its W)."""
    schedule = Schedule.parse(schedule)
    v = schedule.chunks(chunks)
    if not schedule.split_backward:
        return [0.0] * (stages * v)
    most = [0] * (stages * v)
    for order in schedule_actions(schedule, stages, micro_batches, v):
        waiting: dict[int, int] = {}
        for kind, stage in order:
            if stage == 0 or kind not in ("I", "W"):
                continue
            waiting[stage] = waiting.get(stage, 0) + (1 if kind == "I" else -1)
            most[stage] = max(most[stage], waiting[stage])
    return [float(n) for n in most]


def _held_with_gradients(order: tuple[tuple[bool, int], ...]) -> int:
    """The most chunk micro-batches a rank's ``order`` holds after its first backward."""
    held, most, backward = 0, 0, False
    for forward, _ in order:
        held += 1 if forward else -1
        backward = backward or not forward
        most = max(most, held) if backward else most
    return most


class _StageShape:
    """What torch's schedules read of a stage to list their action order (``pipeline_order``)."""

    submod = None  # no module: nothing for the zero-bubble schedules' torch.compile check to find

    def __init__(self, index: int, stages: int, ranks: int):
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, stages, 0, ranks
        self.is_first, self.is_last = index == 0, index == stages - 1


# torch's compute actions: a forward, a whole backward, and a split backward's two parts
_KINDS = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B",
          _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}


@lru_cache(maxsize=256)
def schedule_actions(schedule: str | Schedule, stages: int, micro_batches: int,
                     chunks: int = 1) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per pipeline rank, the (kind, virtual stage) of each compute action it runs, in the order
    torch's schedule runs them (its ``pipeline_order``: what the runtime and the dry run
    execute); kind ``"F"`` a forward, ``"B"`` a whole backward, ``"I"`` and ``"W"`` a split
    backward's input-gradient and weight-gradient parts (``Schedule.split_backward``; torch
    runs stage 0's whole backward at its ``W``, its ``I`` computes nothing). Virtual stage ``c``
    runs on rank ``Schedule.rank_of(c, stages)``. A forward paired with a backward (DualPipe-V's
    overlapped ``F`` and ``B``) counts as its two actions, forward first, as torch runs them."""
    schedule = Schedule.parse(schedule)
    v = schedule.chunks(chunks)
    schedule.check(stages, micro_batches, v)
    torch_class = schedule.torch_class
    if schedule.interleaved:
        # the compute order alone: the runtime's communication lowering, which the schedule's
        # constructor also runs, is quadratic in the actions (minutes at M = 64)
        with patch.object(torch_class, "_prepare_schedule_with_comms", lambda *_: None):
            torch_schedule = torch_class([_StageShape(c, stages * v, stages) for c in schedule.stages_of(0, stages, v)],
                                         micro_batches)
    else:
        torch_schedule = torch_class(_StageShape(0, stages, stages), micro_batches)
    return tuple(tuple((_KINDS[a.computation_type], a.stage_index)
                       for a in _computations(torch_schedule.pipeline_order[rank])) for rank in range(stages))


def _computations(actions) -> list:
    """torch's compute actions of one rank's order, a paired one (``OVERLAP_F_B``) as its parts."""
    out = []
    for action in actions:
        if action is not None and action.computation_type is _ComputationType.OVERLAP_F_B:
            out += [a for a in action.sub_actions if a.computation_type in _KINDS]
        elif action is not None and action.computation_type in _KINDS:
            out.append(action)
    return out


@lru_cache(maxsize=256)
def schedule_order(schedule: str | Schedule, stages: int, micro_batches: int,
                   chunks: int = 1) -> tuple[tuple[tuple[bool, int], ...], ...]:
    """Per pipeline rank, the (forward?, virtual stage) of each forward and backward it runs, in
    the order torch's schedule runs them (``schedule_actions``). A split backward counts at its
    weight-gradient part: a micro-batch's activations are held until then (its input-gradient
    part frees only what the weight gradients do not read, and keeps the gradients they start
    from), and only then do the stage's parameters hold gradients."""
    return tuple(tuple((kind == "F", s) for kind, s in actions if kind != "I")
                 for actions in schedule_actions(schedule, stages, micro_batches, chunks))


def numbered(order: tuple[tuple[str, int], ...]) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) of each action of a rank's ``schedule_actions`` order: every
    torch schedule runs a stage's forwards, and its backwards (whole or input-gradient parts
    alike), in micro-batch order, and a stage's weight-gradient parts in the order of its
    input-gradient parts (DualPipe-V runs some backwards whole between them). torch 2.13's 1F1B
    ``pipeline_order`` numbers the last stage's from 1, which its ``_step_microbatches`` does not."""
    counts: dict[tuple[str, int], int] = {}
    awaiting: dict[int, list[int]] = {}  # stage -> micro-batches whose input-gradient part ran, W not yet
    out = []
    for kind, stage in order:
        if kind == "W":
            mb = awaiting[stage].pop(0)
        else:
            key = ("F" if kind == "F" else "B", stage)
            mb = counts.get(key, 0)
            counts[key] = mb + 1
            if kind == "I":
                awaiting.setdefault(stage, []).append(mb)
        out.append((kind, stage, mb))
    return out


def activation_bytes(
    per_micro_batch: float, schedule: str | Schedule, stages: int, micro_batches: int, chunks: int = 1
) -> float:
    """Peak activation bytes of a stage that keeps ``per_micro_batch`` bytes per micro-batch."""
    return per_micro_batch * micro_batches_in_flight(schedule, stages, micro_batches, chunks)


def layer_activation_bytes(
    seq: int, batch: int, hidden: int, heads: int, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """Bytes one transformer layer keeps for backward per micro-batch (16-bit
    activations, no recomputation; Korthikanti et al. 2022): 34sbh + 5as^2b without
    tensor parallelism, fewer with it. For graphs, sum the saved tensors instead."""
    kind = "none" if tp == 1 else "tensor_sequence_parallel" if sequence_parallel else "tensor_parallel"
    return _fn(f"layer_activations.{kind}")(seq, batch, hidden, heads, tp)


def gather_working_bytes(shard: float, whole: float, largest: float, master: torch.dtype,
                         compute: torch.dtype) -> float:
    """Bytes alive while a ZeRO-3 bucket of parameters is gathered, as
    ``autopar.passes.lowering.buckets`` (and FSDP2's copy-in, all-gather, copy-out) runs it:
    this rank's shards cast to the compute dtype (no copy where the master is in it), their
    flat copy, the gathered flat buffer, each parameter copied out of it, and the last one's
    reordered copy on its way out. ``shard``, ``whole``, ``largest``: elements of this rank's
    shards, of the gathered bucket and of its largest parameter gathered."""
    cast = shard if compute != master else 0.0
    return (cast + shard + 2 * whole + largest) * compute.itemsize


def scatter_working_bytes(shard: float, whole: float, compute: torch.dtype, reduce: torch.dtype) -> float:
    """Bytes alive while a ZeRO-3 bucket's gradients are reduce-scattered: the whole gradients in
    the compute dtype, their copy in the reduce dtype (none where it is the same), the flat
    buffer sent, and this rank's reduced shard (elements as ``gather_working_bytes``)."""
    cast = whole * reduce.itemsize if reduce != compute else 0.0
    return whole * compute.itemsize + cast + (whole + shard) * reduce.itemsize


def gather_ahead_bytes(shard: float, whole: float, master: torch.dtype, compute: torch.dtype) -> float:
    """Bytes a ZeRO-3 bucket's all-gather holds while it runs ahead of its use (prefetched, as
    FSDP2 does): this rank's shards cast to the compute dtype, their flat copy, and the
    gathered flat buffer (elements as ``gather_working_bytes``; the wholes copied out of it
    come only when it is waited for)."""
    cast = shard if compute != master else 0.0
    return (cast + shard + whole) * compute.itemsize


def scatter_in_flight_bytes(shard: float, whole: float, reduce: torch.dtype) -> float:
    """Bytes a ZeRO-3 bucket's gradient reduce-scatter holds while it runs beside backward: the
    flat buffer sent and this rank's reduced shard (the whole gradients are freed once packed)."""
    return (whole + shard) * reduce.itemsize


def bubble_fraction(schedule: str | Schedule, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Fraction of the step a stage sits idle (``Schedule.bubble_fraction``)."""
    return Schedule.parse(schedule).bubble_fraction(stages, micro_batches, chunks)


def pipeline_time(
    schedule: str | Schedule, stages: int, micro_batches: int, t_forward: float, t_backward: float, chunks: int = 1
) -> float:
    """Step time of a pipeline whose slowest stage takes ``t_forward + t_backward`` per
    micro-batch (``Schedule.pipeline_time``)."""
    return Schedule.parse(schedule).pipeline_time(stages, micro_batches, t_forward, t_backward, chunks)

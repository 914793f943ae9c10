"""Pipeline schedules: one type naming each, with its mathematics.

Glossary (the words the planner, the Plan and the runtime use):

- **stage**: a contiguous run of layers on one pipeline rank; with interleaving, a rank
  holds ``v`` of them (**chunks**, or virtual stages), placed by the schedule
  (``Schedule.rank_of``): looped, virtual stage ``c`` on rank ``c mod P``, or V-shaped, down
  the ranks and back up (rank ``r`` holds stages ``r`` and ``2P - 1 - r``).
- **P**: pipeline ranks (the size of the pipeline's mesh axis); **M**: micro-batches per
  step; **v**: chunks per rank (1 unless interleaved); **r**: a pipeline rank, 0 the first.
- **in flight**: micro-batches whose activations a rank holds at its peak, in units of one
  micro-batch through its whole stage (all its chunks together).
- **bubble**: the part of a step a rank sits idle, waiting for the pipeline to fill and
  drain.

A ``Schedule`` is a ``str`` whose value is the name the planner's APIs take (``"1f1b"``)
and whose ``display`` is what ``Plan.pipeline.schedule`` stores (``"1F1B"``: torch's
class names, ``Schedule1F1B``); ``Schedule.parse`` reads either. The formulas are sympy
expressions in ``autopar.costmodels.formulas`` (``IN_FLIGHT``, ``BUBBLE_FRACTION``,
``PIPELINE_TIME``), keyed by the value; the methods here evaluate them, so what a plan's
explanation prints is what the solver computes.
"""

from __future__ import annotations

from enum import Enum
from typing import Sequence

from torch.distributed.pipelining import schedules as torch_schedules

from autopar.costmodels.formulas import BACKWARD_FACTOR, compiled

# The forward's share of a chunk's time (forward and whole backward), which is also the
# zero-bubble schedule's bubble slot: Qi et al. 2024 (arXiv 2401.10241, sec. 3.1) give ZB-H1 a
# bubble of (P - 1)(T_F + T_B - T_W), T_B the input-gradient part of backward and T_W the
# weight-gradient part; a matmul's two are one matmul each (T_B = T_W, half of backward), so
# the slot is T_F, which is 1 / (1 + BACKWARD_FACTOR) of the chunk's forward and backward.
FORWARD_SHARE = 1 / (1 + BACKWARD_FACTOR)


class Schedule(str, Enum):
    """A pipeline schedule (module docstring: the glossary).

    - ``GPIPE``: every micro-batch's forward, then every backward (Huang et al. 2019); all
      M micro-batches in flight.
    - ``ONE_F_ONE_B``: PipeDream-flush (Narayanan et al. 2021): P - r warm-up forwards,
      then one forward, one backward; at most P - r in flight.
    - ``INTERLEAVED_1F1B``: Megatron-LM's interleaved 1F1B, v chunks per rank: a bubble
      v times smaller, a little more in flight.
    - ``INTERLEAVED_ZERO_BUBBLE``: zero bubble (Qi et al. 2024, ZB-H1; torch's
      ``ScheduleInterleavedZeroBubble``), v >= 1 chunks per rank placed as interleaved 1F1B
      places them: each backward split into its input-gradient part, sent back at once, and
      its weight-gradient part, which rank r runs r backwards later to fill the bubble. The
      bubble shrinks to P - 1 forwards of a chunk; every rank holds P micro-batches (1F1B's
      rank 0 count), each from its forward until its weight gradient.
    - ``ZBV_ZERO_BUBBLE``: ZB-V (Qi et al. 2024, sec. 6; torch's ``ScheduleZBVZeroBubble``):
      exactly 2 chunks per rank placed V-shaped, so the first and the last stage share rank 0;
      backward split as zero bubble's. With forward, input and weight gradients alike its
      bubble is P - 1 chunk forwards less the warm-up's weight gradients (formulas: torch's
      order replayed).
    - ``DUALPIPE_V``: DeepSeek's DualPipe folded to a V (torch's ``ScheduleDualPipeV``):
      2 chunks per rank placed V-shaped, at least 2P micro-batches; a forward of one chunk
      paired with a backward of the other in the steady state, split backwards at the ends.
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    INTERLEAVED_ZERO_BUBBLE = "interleaved_zero_bubble"
    ZBV_ZERO_BUBBLE = "zbv_zero_bubble"
    DUALPIPE_V = "dualpipe_v"

    def __str__(self) -> str:  # printed as the name it is given by, as a plain str would be
        return self.value

    __format__ = str.__format__

    @property
    def display(self) -> str:
        """The name a Plan stores and prints (torch's schedule class, less ``Schedule``)."""
        return _DISPLAY[self]

    @property
    def interleaved(self) -> bool:
        """Whether a rank may run several chunks (virtual stages), placed by ``rank_of``."""
        return self in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZERO_BUBBLE) or self.v_shaped

    @property
    def v_shaped(self) -> bool:
        """Whether stages are placed down the ranks and back up (``rank_of``), 2 chunks per rank."""
        return self in (Schedule.ZBV_ZERO_BUBBLE, Schedule.DUALPIPE_V)

    @property
    def split_backward(self) -> bool:
        """Whether a backward may run as two actions, input gradients (torch's ``I``) then, later,
        weight gradients (``W``); a stage's parameters hold gradients only after its ``W``
        (DualPipe-V runs some backwards whole, ``B``, and splits the rest)."""
        return self in (Schedule.INTERLEAVED_ZERO_BUBBLE, Schedule.ZBV_ZERO_BUBBLE, Schedule.DUALPIPE_V)

    def rank_of(self, stage: int, ranks: int) -> int:
        """The pipeline rank that runs (virtual) ``stage`` of ``ranks`` ranks: looped, ``stage mod
        P``; V-shaped, down the ranks for even rounds of P stages and back up for odd ones (torch's
        ``generate_stage_to_rank_mapping``, style ``"v"``)."""
        if ranks < 1 or stage < 0:
            raise ValueError(f"autopar: expected a stage >= 0 on ranks >= 1, found stage {stage} on {ranks} ranks.")
        position = stage % ranks
        return ranks - 1 - position if self.v_shaped and (stage // ranks) % 2 else position

    def stages_of(self, rank: int, ranks: int, chunks: int = 1) -> list[int]:
        """The (virtual) stages pipeline ``rank`` runs, ascending (``rank_of``): its chunks in order,
        chunk ``c`` in the ``c``-th round of ``ranks`` stages (none for a rank not in ``0..ranks-1``)."""
        if not 0 <= rank < ranks:
            return []
        back = ranks - 1 - rank  # a V's odd rounds run back up the ranks
        return [c * ranks + (back if self.v_shaped and c % 2 else rank) for c in range(self.chunks(chunks))]

    @property
    def torch_class(self) -> type:
        """torch's class that runs this schedule (``Schedule`` + ``display``)."""
        return getattr(torch_schedules, "Schedule" + self.display)

    @classmethod
    def parse(cls, name: "str | Schedule") -> "Schedule":
        """The schedule named ``name``: its value (``"1f1b"``) or its display name (``"1F1B"``)."""
        for schedule in cls:
            if name == schedule.value or name == schedule.display:
                return schedule
        raise ValueError(
            f"autopar: expected a schedule in {tuple(s.value for s in cls)} (or as a Plan names them, "
            f"{tuple(s.display for s in cls)}), found {name!r}; use one of those names.")

    def chunks(self, requested: int) -> int:
        """Chunks per rank this schedule runs when ``requested``: 1 unless interleaved."""
        return requested if self.interleaved else 1

    def check(self, stages: int, micro_batches: int, chunks: int = 1) -> None:
        """Raise unless P, M and v are positive and v is a count this schedule runs (``chunks_problem``)."""
        if stages < 1 or micro_batches < 1 or chunks < 1:
            raise ValueError(
                f"autopar: expected positive stages, micro-batches and chunks per rank, found {stages}, "
                f"{micro_batches}, {chunks}.")
        if chunks != 1 and not self.interleaved:
            several = ", ".join(s.value for s in Schedule if s.interleaved)
            raise ValueError(f"autopar: only {several} run several chunks per rank; {self.value} got chunks={chunks}; "
                             "pass chunks=1 or one of those schedules.")
        if self.v_shaped and chunks != 2:
            raise ValueError(f"autopar: {self.value} places exactly 2 chunks per rank (torch's Schedule{self.display} "
                             f"runs stages r and 2P - 1 - r on rank r); found chunks={chunks}; pass chunks=2 or another "
                             "schedule.")

    def chunks_problem(self, chunks: int) -> str:
        """Why this schedule cannot run ``chunks`` chunks per rank ("" when it can; ``check``
        says it as an error): only the interleaved ones run several, the V-shaped ones exactly 2."""
        if chunks != 1 and not self.interleaved:
            return f"{self.value} runs one chunk per rank"
        if self.v_shaped and chunks != 2:
            return f"{self.value} places exactly 2 chunks per rank"
        return ""

    def micro_batch_problem(self, stages: int, micro_batches: int) -> str:
        """Why this schedule cannot run ``micro_batches`` on ``stages`` ranks ("" when it can):
        torch runs interleaving in rounds of P micro-batches (and refuses some other counts);
        the step-time formula is exact only for whole rounds; torch's ``Schedule1F1B`` refuses
        fewer micro-batches than stages, ``ScheduleDualPipeV`` fewer than its 2P stages, and
        ``ScheduleZBVZeroBubble`` runs fewer than 2P - 1 with its own warm-up cut short (what
        the step-time formula does not price)."""
        if self is Schedule.DUALPIPE_V and micro_batches < 2 * stages:
            return f"DualPipe-V needs at least as many micro-batches as its {2 * stages} stages (2 per rank)"
        if self is Schedule.ZBV_ZERO_BUBBLE and micro_batches < 2 * stages - 1:
            return f"ZB-V needs at least 2P - 1 = {2 * stages - 1} micro-batches on {stages} ranks"
        if self.interleaved and not self.v_shaped and micro_batches % stages:
            words = "interleaved 1F1B" if self is Schedule.INTERLEAVED_1F1B else "interleaved zero bubble"
            return f"{words} needs micro-batches in multiples of {stages} stages"
        if self is Schedule.ONE_F_ONE_B and micro_batches < stages:
            return f"1F1B needs at least as many micro-batches as its {stages} stages"
        return ""

    def in_flight(self, stages: int, micro_batches: int, chunks: int = 1, rank: int = 0) -> float:
        """Micro-batches in flight on pipeline rank ``rank`` at its peak (``formulas.IN_FLIGHT``);
        rank 0, the first, is the fullest."""
        self.check(stages, micro_batches, chunks)
        if not 0 <= rank < stages:
            raise ValueError(f"autopar: rank must be in 0..{stages - 1} for {stages} stages; found {rank}.")
        return compiled(f"in_flight.{self.value}")(micro_batches, stages, chunks, rank)

    def in_flight_per_stage(self, stages: int, micro_batches: int, chunks: int = 1) -> list[float]:
        """Micro-batches each (virtual) stage keeps alive at its peak: rank ``r``'s count
        (``in_flight``); interleaved, a rank's ``v * in_flight`` chunk micro-batches (the count
        torch's ``ScheduleInterleaved1F1B`` order reaches) spread evenly over its chunks, which
        is exact for alike chunks, so stage ``c`` takes its rank's (``rank_of``)."""
        v = self.chunks(chunks)
        per_rank = [float(self.in_flight(stages, micro_batches, v, rank=r)) for r in range(stages)]
        return [per_rank[self.rank_of(c, stages)] for c in range(stages * v)]

    def bubble_fraction(self, stages: int, micro_batches: int, chunks: int = 1) -> float:
        """Fraction of the step a stage sits idle (``formulas.BUBBLE_FRACTION``)."""
        self.check(stages, micro_batches, chunks)
        return compiled(f"bubble.{self.value}")(micro_batches, stages, chunks)

    def pipeline_time(self, stages: int, micro_batches: int, t_forward: float, t_backward: float,
                      chunks: int = 1) -> float:
        """Step time of equal stages taking ``t_forward + t_backward`` per micro-batch (a rank's
        whole stage; with chunks, all v together): ``formulas.PIPELINE_TIME``."""
        self.check(stages, micro_batches, chunks)
        return compiled(f"pipeline.{self.value}")(micro_batches, stages, chunks, t_forward, t_backward)

    def bubble_time(self, stage_time: Sequence[float], chunks: int = 1) -> float:
        """Seconds of a step a rank sits idle, from per-micro-batch (virtual) stage times:
        P - 1 slots of the slowest (virtual) stage while the pipeline fills and drains (zero
        bubble: of its forward, ``FORWARD_SHARE`` of it)."""
        slot = max(stage_time) * (FORWARD_SHARE if self.split_backward else 1.0)
        return (self._ranks(stage_time, chunks) - 1) * slot

    def step_time(self, stage_time: Sequence[float], micro_batches: int, chunks: int = 1) -> float:
        """Step time from per-micro-batch (virtual) stage times, for unequal stages:

            GPipe and 1F1B:    (M + P - 1) * slowest stage
            interleaved 1F1B:  M * slowest rank (its v chunks) + (P - 1) * slowest chunk
            zero bubble:       M * slowest rank + (P - 1) * slowest chunk's forward,

        which for equal chunks is ``pipeline_time``'s (M + (P - 1) / v) * rank time (zero bubble:
        the slowest chunk's forward is ``FORWARD_SHARE`` of it, checked against torch's action
        lists replayed, ``costmodels.schedule_replay``)."""
        v = self.chunks(chunks)
        p = self._ranks(stage_time, v)
        self.check(p, micro_batches, v)
        slowest = max(stage_time)
        if not self.interleaved:
            return (micro_batches + p - 1) * slowest
        rank_time = [sum(stage_time[c] for c in self.stages_of(r, p, v)) for r in range(p)]
        return micro_batches * max(rank_time) + self.bubble_time(stage_time, v)

    def _ranks(self, stage_time: Sequence[float], chunks: int) -> int:
        v = self.chunks(chunks)
        if not stage_time or len(stage_time) % v:
            raise ValueError(
                f"autopar: expected a positive multiple of chunks_per_rank={v} virtual stages, found "
                f"{len(stage_time)}.")
        return len(stage_time) // v


_DISPLAY = {Schedule.GPIPE: "GPipe", Schedule.ONE_F_ONE_B: "1F1B", Schedule.INTERLEAVED_1F1B: "Interleaved1F1B",
            Schedule.INTERLEAVED_ZERO_BUBBLE: "InterleavedZeroBubble", Schedule.ZBV_ZERO_BUBBLE: "ZBVZeroBubble",
            Schedule.DUALPIPE_V: "DualPipeV"}

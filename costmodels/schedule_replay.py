"""A pipeline step's time replayed from the order torch's schedule runs its actions in.

Each rank runs its actions (``memory.schedule_actions``) one after another, each as soon as
the rank is free and what it needs exists: a stage's forward after the previous stage's
forward of the micro-batch; its backward (whole, or a split backward's input-gradient part)
after its own forward and the next stage's backward; a weight-gradient part after its stage's
input-gradient part. Sends take no time. What the step takes is when the last rank finishes.

The ``Schedule`` methods price steps by closed forms (``costmodels.formulas``); this replay
is what they are checked against, on torch's own action lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.costmodels.memory import numbered, schedule_actions
from autopar.costmodels.schedules import Schedule


@dataclass(frozen=True)
class Replayed:
    """One action of the replay: ``kind`` ``F``, ``B``, ``I`` or ``W`` (``memory.schedule_actions``)
    of virtual ``stage`` for ``micro_batch`` on pipeline ``rank``, from ``start`` to ``end`` seconds."""

    rank: int
    kind: str
    stage: int
    micro_batch: int
    start: float
    end: float


def replayed_step_time(schedule: str | Schedule, micro_batches: int, forward: Sequence[float],
                       input_backward: Sequence[float], weight_backward: Sequence[float], chunks: int = 1) -> float:
    """Seconds from the first forward to the last action of any rank (``replay``)."""
    return max(a.end for a in replay(schedule, micro_batches, forward, input_backward, weight_backward, chunks))


def replay(schedule: str | Schedule, micro_batches: int, forward: Sequence[float], input_backward: Sequence[float],
           weight_backward: Sequence[float], chunks: int = 1) -> list[Replayed]:
    """Every action of the step, timed, with per (virtual) stage times of a forward, a
    backward's input-gradient part and its weight-gradient part (a whole backward takes both;
    torch runs stage 0's whole backward at its ``W``, its ``I`` computes nothing: stage 0 has
    no input gradient to send)."""
    schedule = Schedule.parse(schedule)
    v = schedule.chunks(chunks)
    if not len(forward) == len(input_backward) == len(weight_backward) or len(forward) % v:
        raise ValueError(f"autopar: expected one forward, input-gradient and weight-gradient time per (virtual) stage, "
                         f"a multiple of chunks={v} stages; found {len(forward)}, {len(input_backward)}, "
                         f"{len(weight_backward)}.")
    ranks, last = len(forward) // v, len(forward) - 1
    orders = schedule_actions(schedule, ranks, micro_batches, v)

    def duration(kind: str, s: int) -> float:
        if kind == "F":
            return forward[s]
        if kind == "I":
            return 0.0 if s == 0 else input_backward[s]
        if kind == "W" and s != 0:
            return weight_backward[s]
        return input_backward[s] + weight_backward[s]  # a whole backward, or stage 0's W

    def needs(kind: str, s: int, mb: int) -> list[tuple]:
        if kind == "F":
            return [("F", s - 1, mb)] if s > 0 else []
        if kind == "W":
            return [("I", s, mb)]
        return [("F", s, mb)] + ([("I", s + 1, mb)] if s < last else [])

    done: dict[tuple, float] = {}  # (F, I or W, stage, micro-batch) -> when it finished; a whole B counts as I
    timeline: list[Replayed] = []
    orders = [numbered(order) for order in orders]
    free, position = [0.0] * ranks, [0] * ranks
    while any(position[r] < len(orders[r]) for r in range(ranks)):
        moved = False
        for r in range(ranks):
            while position[r] < len(orders[r]):
                kind, s, mb = orders[r][position[r]]
                waits = [done.get(need) for need in needs(kind, s, mb)]
                if None in waits:
                    break
                start = max([free[r], *waits])
                free[r] = start + duration(kind, s)
                done["I" if kind == "B" else kind, s, mb] = free[r]
                timeline.append(Replayed(r, kind, s, mb, start, free[r]))
                position[r] += 1
                moved = True
        if not moved:
            raise ValueError(f"autopar: torch's {schedule.display} order for {ranks} ranks and {micro_batches} "
                             "micro-batches waits on an action no rank runs; expected every dependency to be met.")
    return timeline

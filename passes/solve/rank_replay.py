"""Each pipeline rank's peak memory: torch's order of its stages replayed with a stage cut's parts.

``rank_peaks`` is what the stage search accepts a cut by (``pipeline_search``, ``rank_fit``).
torch's order is read once per (schedule, ranks, micro-batches, chunks) and kept as indices
(``_replay``); each cut is then a few numpy operations, adding the same floats in the same
order as a replay of one action at a time (``tests/test_rank_replay.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from autopar.costmodels import Schedule
from autopar.costmodels.memory import schedule_actions
from autopar.passes.solve.stages import StageCut


class RankPeak(NamedTuple):
    """A pipeline rank's peak bytes, and of them the gradients held and the temporaries (one
    backward's: the loss's, a gradient being added) at that instant."""

    total: float
    gradients: float
    temporary: float


def rank_peaks(cut: StageCut, schedule: str | Schedule, micro_batches: int, chunks: int = 1) -> list[RankPeak]:
    """Each pipeline rank's peak, replaying the order torch's schedule runs its stages in
    (``costmodels.memory.schedule_actions``) with the cut's per-stage parts: every stage's
    micro-batches in flight at each instant, together (interleaved, a rank's chunks hold
    different counts at different times: the chunk holding the loss keeps one micro-batch
    while the others fill). A backward holds its micro-batch's activations, its stage's
    temporaries and rebuilt layer; a stage's first backward frees one micro-batch as its
    gradients appear (``stage_peak``'s two instants), later ones make a gradient before adding
    it to the accumulated one (``adding``). A split backward's micro-batch keeps what its
    weight gradients start from (``awaiting``) from its input-gradient part (I) to its W.
    The first instant of a rank's highest peak is its peak (``_Replay``)."""
    schedule = Schedule.parse(schedule)
    return _replay(schedule, len(cut.starts) // schedule.chunks(chunks), micro_batches,
                   schedule.chunks(chunks)).peaks(cut)


@dataclass(frozen=True)
class _Replay:
    """One schedule's replay, worked out once and applied to any cut with numpy. Every instant
    a rank is checked at (``_replay``) reads three running sums (micro-batches in flight,
    gradients, what split backwards await), one stage's temporaries and its rebuilt layer or
    none. Each sum is kept as its own sequence of updates, added up in order (``np.cumsum`` is
    sequential), so every instant's bytes are the same floats an action-by-action replay adds up.

    ``peaks`` lays a cut's parts out as the rows of one table (``_PARTS``, a zero past the last
    stage), and every index here points into it flattened: ``updates`` (with ``signs``) the
    sums' updates (in flight, gradients, awaited), a row per rank (pads read the zero); per
    rank and instant, ``flight_at``, ``grads_at`` and ``waits_at`` where it reads each sum's
    flattened running totals (after the updates before it), ``temporary_at`` and
    ``rebuilt_at`` its parts; ``floor`` is 0, or -inf at pads; ``stages``: each rank's stages
    (what it always holds)."""

    updates: tuple[np.ndarray, np.ndarray, np.ndarray]
    signs: tuple[np.ndarray, np.ndarray, np.ndarray]
    flight_at: np.ndarray
    grads_at: np.ndarray
    waits_at: np.ndarray
    temporary_at: np.ndarray
    rebuilt_at: np.ndarray
    floor: np.ndarray
    stages: tuple[tuple[int, ...], ...]

    def peaks(self, cut: StageCut) -> list[RankPeak]:
        width = len(cut.starts) + 1
        empty = [0.0] * (width - 1)
        parts = np.zeros((len(_PARTS), width))
        parts[:-1, :-1] = [cut.per_micro_batch, cut.gradient_bytes, cut.awaiting or empty, cut.in_forward or empty,
                           cut.in_backward, cut.rebuilt, cut.adding]
        parts[_PARTS.index("awaiting"), 0] = 0.0  # torch's stage 0 runs its whole backward at W: nothing awaits
        parts[-1] = parts[_PARTS.index("in_backward")] + parts[_PARTS.index("adding")]
        table = parts.ravel()
        flight, grads, waits = (_running(table[updates] * signs, at) for updates, signs, at in zip(
            self.updates, self.signs, (self.flight_at, self.grads_at, self.waits_at)))
        temporary = table[self.temporary_at]
        base = np.array([sum(cut.held_always[s] for s in stages) for stages in self.stages])
        total = base[:, None] + grads + flight + waits + temporary + table[self.rebuilt_at] + self.floor
        rows, at = np.arange(len(base)), np.argmax(total, axis=1)
        above = total[rows, at] > base  # else the rank's peak is what it always holds
        return [RankPeak(*peak) for peak in zip(np.where(above, total[rows, at], base).tolist(),
                                                np.where(above, grads[rows, at], 0.0).tolist(),
                                                np.where(above, temporary[rows, at] + waits[rows, at], 0.0).tolist())]


def _running(updates: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Per rank and instant, the sum of the rank's ``updates`` before it, added in order: ``at``
    indexes the flattened rows of running sums that start at 0."""
    sums = np.zeros((updates.shape[0], updates.shape[1] + 1))
    np.cumsum(updates, axis=1, out=sums[:, 1:])
    return sums.ravel()[at]


# the rows of ``_Replay.peaks``' table: the cut's parts per stage, then a backward's temporaries
# while it adds a gradient (in_backward + adding)
_PARTS = ("per_micro_batch", "gradient_bytes", "awaiting", "in_forward", "in_backward", "rebuilt", "adding",
          "adding_in_backward")
_FORWARD, _INPUT, _BACKWARD, _WEIGHT = range(4)  # the kinds of torch's compute actions, as numbered here
_CODES = {"F": _FORWARD, "I": _INPUT, "B": _BACKWARD, "W": _WEIGHT}


@lru_cache(maxsize=256)
def _replay(schedule: Schedule, ranks: int, micro_batches: int, v: int) -> _Replay:
    """``rank_peaks``' instants per rank: a forward once its micro-batch is in flight; an input-
    gradient part (I) once it awaits its W; a stage's first backward before its gradients appear
    and again after, one micro-batch freed; a later backward as it adds its gradient, before its
    micro-batch is freed; a W's micro-batch stops awaiting after it."""
    width = ranks * v + 1  # a row of ``_Replay.peaks``' table
    row = {name: i * width for i, name in enumerate(_PARTS)}
    zero = width - 1  # each row's last column
    updates, signs, instants = ([], [], []), ([], [], []), []  # updates and signs: per sum, a row per rank
    for actions in schedule_actions(schedule, ranks, micro_batches, v):
        kind = np.array([_CODES[k] for k, _ in actions], dtype=np.int64)
        stage = np.array([s for _, s in actions], dtype=np.int64)
        backward = np.flatnonzero(kind >= _BACKWARD)  # a whole backward or a W: gradients made
        first = np.zeros(len(kind), dtype=bool)  # a stage's first such: before and after its gradients
        first[backward[np.unique(stage[backward], return_index=True)[1]]] = True
        moves = kind != _INPUT  # every action but I frees or adds a micro-batch in flight
        waits = (kind == _INPUT) | (kind == _WEIGHT)
        made = ((row["per_micro_batch"] + stage[moves], np.where(kind[moves] == _FORWARD, 1.0, -1.0)),
                (row["gradient_bytes"] + stage[first], np.ones(int(first.sum()))),
                (row["awaiting"] + stage[waits], np.where(kind[waits] == _INPUT, 1.0, -1.0)))
        for i, (index, sign) in enumerate(made):  # in flight, gradients, awaited
            updates[i].append(index)
            signs[i].append(sign)
        # each action's instants: a first backward's two, one for any other, in order
        action = np.repeat(np.arange(len(kind)), 1 + first)
        second = np.zeros(len(action), dtype=bool)
        second[1:] = action[1:] == action[:-1]
        k, s = kind[action], stage[action]
        before = lambda flags: (np.cumsum(flags) - flags)[action]  # noqa: E731  (updates before the action)
        temporary = np.where(k == _FORWARD, row["in_forward"],
                             np.where((k == _INPUT) | (first[action] & ~second), row["in_backward"],
                                      row["adding_in_backward"])) + s
        instants.append((before(moves) + (k == _FORWARD) + second, before(first) + second,
                         before(waits) + (k == _INPUT), temporary,
                         np.where(k == _FORWARD, zero, row["rebuilt"] + s)))
    updates, signs = tuple(_padded(rows, zero) for rows in updates), tuple(_padded(rows, 0.0) for rows in signs)
    # a rank's row of running sums starts at 0: one column more than its updates
    sums_at = lambda i: (_padded([inst[i] for inst in instants], 0)  # noqa: E731
                         + np.arange(ranks)[:, None] * (updates[i].shape[1] + 1))
    return _Replay(updates=updates, signs=signs, flight_at=sums_at(0), grads_at=sums_at(1),
                   waits_at=sums_at(2), temporary_at=_padded([inst[3] for inst in instants], zero),
                   rebuilt_at=_padded([inst[4] for inst in instants], zero),
                   floor=_padded([np.zeros(len(inst[0])) for inst in instants], -np.inf),
                   stages=tuple(tuple(schedule.stages_of(rank, ranks, v)) for rank in range(ranks)))


def _padded(rows: list, fill) -> np.ndarray:
    """Rows of numbers as one array, each padded with ``fill`` to the longest (one column at least)."""
    out = np.full((len(rows), max(1, max(map(len, rows)))), fill)
    for r, row in enumerate(rows):
        out[r, :len(row)] = row
    return out

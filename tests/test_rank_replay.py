"""``rank_peaks`` replays a schedule once per (schedule, ranks, micro-batches, chunks) and applies
it to any cut with numpy. Here it is checked against the replay written action by action, on
random cuts of every schedule: the same peaks, bit for bit, and the same instant chosen."""

import random

import pytest

from autopar.costmodels import Schedule
from autopar.costmodels.memory import schedule_actions
from autopar.passes.solve.rank_replay import RankPeak, rank_peaks
from autopar.passes.solve.stages import StageCut


def _replayed_action_by_action(cut: StageCut, schedule: Schedule, micro_batches: int, v: int) -> list[RankPeak]:
    """Each rank's peak, one action at a time, as ``rank_peaks``' docstring describes it."""
    ranks = len(cut.starts) // v
    out = []
    for rank, actions in enumerate(schedule_actions(schedule, ranks, micro_batches, v)):
        base = sum(cut.held_always[s] for s in schedule.stages_of(rank, ranks, v))
        in_flight, gradients, awaiting, first_done = 0.0, 0.0, 0.0, set()
        best = RankPeak(base, 0.0, 0.0)

        def see(temporary: float, rebuilt: float = 0.0) -> None:
            nonlocal best
            total = base + gradients + in_flight + awaiting + temporary + rebuilt
            if total > best.total:  # the first instant of the highest
                best = RankPeak(total, gradients, temporary + awaiting)

        for kind, s in actions:
            if kind == "F":
                in_flight += cut.per_micro_batch[s]
                see(cut.in_forward[s] if cut.in_forward else 0.0)
                continue
            during, rebuilt = cut.in_backward[s], cut.rebuilt[s]
            keeps = cut.awaiting[s] if cut.awaiting and s else 0.0
            if kind == "I":
                awaiting += keeps
                see(during, rebuilt)
                continue
            if s not in first_done:
                see(during, rebuilt)
                first_done.add(s)
                gradients += cut.gradient_bytes[s]
                in_flight -= cut.per_micro_batch[s]
                see(during + cut.adding[s], rebuilt)
            else:
                see(during + cut.adding[s], rebuilt)
                in_flight -= cut.per_micro_batch[s]
            if kind == "W":
                awaiting -= keeps
        out.append(best)
    return out


def _random_cut(rng: random.Random, stages: int, forward: bool, awaiting: bool) -> StageCut:
    bytes_ = lambda: [rng.choice([0.0, rng.uniform(0, 1e9), rng.uniform(0, 1e3)]) for _ in range(stages)]  # noqa: E731
    zeros = [0.0] * stages
    return StageCut(list(range(stages)), zeros, zeros, stages, [0] * stages, zeros, zeros,
                    held_always=bytes_(), gradient_bytes=bytes_(), per_micro_batch=bytes_(), in_backward=bytes_(),
                    rebuilt=bytes_(), adding=bytes_(), in_forward=bytes_() if forward else [],
                    awaiting=bytes_() if awaiting else [])


CASES = [(schedule, ranks, micro_batches, v)
         for schedule in Schedule for ranks in (1, 2, 4) for micro_batches in (1, 2, 4, 8, 12) for v in (1, 2, 3)
         if not schedule.chunks_problem(v) and not schedule.micro_batch_problem(ranks, micro_batches)]


@pytest.mark.parametrize("schedule,ranks,micro_batches,v", CASES, ids=lambda x: str(x))
def test_the_replay_gives_the_peaks_of_an_action_by_action_replay(schedule, ranks, micro_batches, v):
    rng = random.Random(f"{schedule.value}-{ranks}-{micro_batches}-{v}")
    for trial in range(20):
        cut = _random_cut(rng, ranks * v, forward=trial % 2 == 0, awaiting=trial % 3 != 0)
        assert rank_peaks(cut, schedule, micro_batches, v) == _replayed_action_by_action(cut, schedule, micro_batches, v)

"""Recomputation that makes an interleaved pipeline's ranks fit, judged by their replayed peaks.

The stage DP (``stages.cut_stages``) holds every chunk of an interleaved schedule to
``limit / v`` at its rank's in-flight count spread evenly over the rank's chunks. torch's
order does not spread them: a rank's first chunks keep up to M micro-batches alive while the
chunk holding the loss keeps about one. A chunk whose own activations are large and cannot be
recomputed (the loss's logits) then fails its share although its rank fits, and the DP finds
no cut or recomputes far more than the rank needs.

``recompute_to_fit`` starts from a cut and its recomputed counts (``pipeline_search`` gives it
the DP's, the time-optimal one with nothing recomputed, and the one balanced with every layer
recomputed) and works on each rank's replayed peak (``rank_replay.rank_peaks``), the number the
search accepts a cut by:

1. while a rank is over the limit, recompute one more layer in the rank's chunk that takes the
   most bytes off that rank's peak per second it adds (each trial re-described and replayed);
2. then, while any recomputed layer can go back with its rank still fitting, un-recompute
   the one that adds the most time, so that no single recomputed layer is spare.

Every cut it looks at is ``describe(recomputed)``: ``stages.describe_cut`` of the same starts
with ``recomputed[s]`` layers per stage, so each stage's time and replay parts (ZeRO-3 gathers
included) come from the one function that describes a stage. Ranks are independent (a rank
replays only its own chunks), so one trial per chunk position serves every rank at once.
A heuristic (greedy, then pruned), not an optimum over every per-chunk count.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from autopar.costmodels import Schedule
from autopar.passes.solve.rank_replay import rank_peaks
from autopar.passes.solve.stages import StageCut

Describe = Callable[[Sequence[int]], StageCut]  # per-stage recomputed counts -> the cut described


def recompute_to_fit(cut: StageCut, describe: Describe, schedule: str | Schedule, micro_batches: int,
                     chunks: int, memory_limit: float, saving: Sequence[float]) -> StageCut | None:
    """``cut`` with per-stage recomputed counts (from ``cut.recomputed`` up) such that every
    rank's replayed peak fits ``memory_limit``, none of them spare (module docstring); None
    where a rank cannot fit with every layer of its chunks that saves bytes recomputed.
    ``saving``: per layer, the bytes it keeps less per micro-batch when recomputed."""
    v = Schedule.parse(schedule).chunks(chunks)
    fit = _Fitting(cut, describe, schedule, micro_batches, v, memory_limit * (1 + 1e-12), saving)
    if not fit.grow():
        return None
    fit.prune()
    return fit.cut


class _Fitting:
    """The counts being changed, the cut they describe and its ranks' peaks."""

    def __init__(self, cut: StageCut, describe: Describe, schedule, micro_batches: int, v: int, cap: float,
                 saving: Sequence[float]):
        self.describe, self.micro_batches, self.v, self.cap = describe, micro_batches, v, cap
        self.schedule = Schedule.parse(schedule)
        self.ranks = len(cut.starts) // v
        # a chunk is worth recomputing in only if its layers save bytes
        self.useful = [sum(saving[layer] for layer in cut.layers(s)) > 0 for s in range(len(cut.starts))]
        self._set(cut)

    def _set(self, cut: StageCut) -> None:
        self.cut = cut
        self.peaks = [p.total for p in rank_peaks(cut, self.schedule, self.micro_batches, self.v)]

    def _trial(self, changes: dict[int, int]) -> tuple[StageCut, list[float]]:
        """The cut with ``changes`` (stage -> +1 or -1 recomputed) and its ranks' peaks."""
        counts = [k + changes.get(s, 0) for s, k in enumerate(self.cut.recomputed)]
        cut = self.describe(counts)
        return cut, [p.total for p in rank_peaks(cut, self.schedule, self.micro_batches, self.v)]

    def _stage(self, rank: int, chunk: int) -> int:
        return self.schedule.stages_of(rank, self.ranks, self.v)[chunk]  # the schedule's placement

    def _can_grow(self, s: int) -> bool:
        return self.useful[s] and self.cut.recomputed[s] < len(self.cut.layers(s))

    def grow(self) -> bool:
        """Step 1 of the module docstring; False when an over-limit rank has nothing left to recompute."""
        while over := [r for r in range(self.ranks) if self.peaks[r] > self.cap]:
            best: dict[int, tuple[float, int]] = {}  # rank -> (bytes off its peak per second added, chunk)
            for chunk in range(self.v):
                grown = {self._stage(r, chunk): 1 for r in over if self._can_grow(self._stage(r, chunk))}
                if not grown:
                    continue
                cut, peaks = self._trial(grown)
                for r in over:
                    s = self._stage(r, chunk)
                    if s in grown:
                        worth = _per_second(self.peaks[r] - peaks[r], cut.stage_time[s] - self.cut.stage_time[s])
                        if r not in best or worth > best[r][0]:
                            best[r] = (worth, chunk)
            if any(r not in best for r in over):
                return False
            self._set(self._trial({self._stage(r, best[r][1]): 1 for r in over})[0])
        return True

    def prune(self) -> None:
        """Step 2 of the module docstring. A pass tries each recomputed stage once, a rank's
        stages by the time their recomputation adds, most first (each trial one stage per rank),
        and passes repeat until none gives a layer back."""
        changed = any(self.cut.recomputed)
        while changed:
            changed = False
            added = self._added_times()
            order = {r: sorted((s for s in self._rank_stages(r) if self.cut.recomputed[s] > 0),
                               key=lambda s: (-added[s], s)) for r in range(self.ranks)}
            for i in range(self.v):
                tried = {order[r][i]: -1 for r in range(self.ranks) if i < len(order[r])}
                if not tried:
                    break
                cut, peaks = self._trial(tried)
                kept = {s: -1 for s in tried if peaks[self.schedule.rank_of(s, self.ranks)] <= self.cap}
                if kept:
                    self._set(cut if kept == tried else self._trial(kept)[0])
                    changed = True

    def _rank_stages(self, rank: int) -> list[int]:
        return [self._stage(rank, chunk) for chunk in range(self.v)]

    def _added_times(self) -> list[float]:
        """Per stage, the seconds its last recomputed layer adds (0 where none)."""
        fewer = self._trial({s: -1 for s, k in enumerate(self.cut.recomputed) if k > 0})[0]
        return [now - less for now, less in zip(self.cut.stage_time, fewer.stage_time)]


def _per_second(saved: float, added: float) -> float:
    """Bytes off a peak per second of recomputation added (a free recomputation that saves ranks first)."""
    if added > 0:
        return saved / added
    return math.copysign(math.inf, saved) if saved else 0.0

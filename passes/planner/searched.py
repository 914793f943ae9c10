"""What the planner's search covered, as plain JSON data: ``Plan.solver["searched"]``.

    {"pipeline_depths": {"tried": [1, 2], "ruled_out": {"2": why}, "skipped": {"4": why}},
     "schedules": {"tried": ["1F1B", ...], "ruled_out": {"DualPipeV": why}, "skipped": {...}},
     "chunks_per_rank": {"Interleaved1F1B": [2, 4], ...}, "micro_batches": [1, 2, 4],
     "clock_cut": ["what the wall clock or the CPU safety net cut", ...]}

Each option of a search is ``tried`` (handed to the search), and of those ``ruled_out``
where nothing the search found with it fits or runs (one reason), or ``skipped``: never
searched (why). Dict keys are strings, so the record round-trips through the plan's JSON
unchanged. ``autopar.passes.explain`` says it in words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from autopar.costmodels import Schedule


@dataclass
class Coverage:
    """One dimension of the search (pipeline depths, schedules): what was tried, ruled out, skipped."""

    tried: list = field(default_factory=list)
    ruled_out: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict:
        return {"tried": list(self.tried), "ruled_out": dict(self.ruled_out), "skipped": dict(self.skipped)}


def stage_search_record(options: Iterable, offered: Sequence[Schedule], skipped: dict[str, str]) -> dict:
    """What one depth's stage search covered: ``options`` (``PipelineSearchResult.options`` of
    each layout searched: every (M, schedule, v) it evaluated, with why it was rejected),
    ``offered`` (the schedules handed to it), ``skipped`` (schedule name -> why it was not)."""
    options = list(options)
    schedules = Coverage(tried=[s.display for s in offered], skipped=dict(skipped))
    for name in schedules.tried:
        mine = [o for o in options if o.schedule.display == name]
        if not any(math.isfinite(o.step_time) for o in mine):
            # the most micro-batches: the smallest ones, those likeliest to fit and to meet the schedule's counts
            schedules.ruled_out[name] = (max(mine, key=lambda o: o.micro_batches).rejected if mine
                                         else "no option evaluated")
    chunks: dict[str, list[int]] = {}
    for o in options:
        if o.schedule.interleaved:
            chunks.setdefault(o.schedule.display, [])
            chunks[o.schedule.display] = sorted(set(chunks[o.schedule.display]) | {o.chunks_per_rank})
    return {"schedules": schedules.record(), "chunks_per_rank": chunks,
            "micro_batches": sorted({o.micro_batches for o in options})}


def merged(records: Sequence[dict]) -> dict:
    """The stage-search records of several depths as one: a schedule tried at any depth is
    tried, ruled out only where every depth that tried it ruled it out (the first depth's
    reason), skipped where no depth tried it; chunks and micro-batch counts as their union."""
    tried: dict[str, None] = {}
    ruled_out: dict[str, str] = {}
    skipped: dict[str, str] = {}
    chunks: dict[str, set[int]] = {}
    micro_batches: set[int] = set()
    for record in records:
        schedules = record["schedules"]
        tried.update(dict.fromkeys(schedules["tried"]))
        for name, why in schedules["skipped"].items():
            skipped.setdefault(name, why)
        for name, why in schedules["ruled_out"].items():
            ruled_out.setdefault(name, why)
        for name, depths in record["chunks_per_rank"].items():
            chunks.setdefault(name, set()).update(depths)
        micro_batches.update(record["micro_batches"])
    fitted = {name for record in records for name in record["schedules"]["tried"]
              if name not in record["schedules"]["ruled_out"]}
    schedules = Coverage(tried=list(tried), skipped={k: v for k, v in skipped.items() if k not in tried},
                         ruled_out={k: v for k, v in ruled_out.items() if k not in fitted})
    return {"schedules": schedules.record(), "chunks_per_rank": {k: sorted(v) for k, v in chunks.items()},
            "micro_batches": sorted(micro_batches)}

"""What a dry run found (``autopar.dry_run``): each distinct rank's pass or failure and its
peak memory by kind, and the table that sets the largest peak beside the plan's prediction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autopar.costmodels.units import gib_text
from autopar.dryrun.tracker import KINDS


@dataclass
class RankResult:
    """One rank's dry run: its mesh coordinate, the pipeline stages it runs, pass/fail with
    the error, and its peak memory in bytes, by kind as at the peak."""

    rank: int
    coordinate: tuple[int, ...]
    stages: tuple[int, ...] = ()
    ok: bool = False
    error: str | None = None
    peak: int = 0
    memory: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    traceback: str = field(default="", repr=False)  # of the failure, for a planner bug report
    # the plan's prediction for this rank by kind: its pipeline rank's (``Prediction.memory_by_rank``),
    # else the plan's one per device
    predicted: dict[str, float] = field(default_factory=dict)
    # autopar's own warnings while the rank was built and stepped (each once), e.g. a
    # parameter whose optimizer state the runtime keeps whole: they say why memory differs
    warnings: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """This rank's predicted memory / its dry-run peak (nan: not measured or nothing predicted)."""
        return sum(self.predicted.values()) / self.peak if self.peak and self.predicted else math.nan

    def where(self) -> str:
        plural = "s" if len(self.stages) > 1 else ""
        stages = f", stage{plural} {', '.join(map(str, self.stages))}" if self.stages else ""
        return f"rank {self.rank} (coordinate {self.coordinate}{stages})"


@dataclass
class DryRunResult:
    """Every distinct rank's result, and the plan's predicted memory per device to compare."""

    plan_kind: str
    mesh_shape: tuple[int, ...]
    ranks: list[RankResult]
    predicted: dict[str, float]
    seconds: float = 0.0
    # a pipeline's (micro-batches replayed, the plan's): the fewest with the same peak (``autopar.dryrun.pipeline``)
    micro_batches: tuple[int, int] | None = None

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    @property
    def failures(self) -> list[RankResult]:
        return [r for r in self.ranks if not r.ok]

    @property
    def peak(self) -> int:
        """The largest peak over the ranks run (bytes)."""
        return max((r.peak for r in self.ranks if r.ok), default=0)

    @property
    def rank_ratios(self) -> list[float]:
        """Every rank's own predicted / dry-run peak (``RankResult.ratio``), those measured."""
        return [r.ratio for r in self.ranks if r.ok and not math.isnan(r.ratio)]

    @property
    def predicted_total(self) -> float:
        """The largest prediction among the ranks run (each rank's own where the plan predicts
        per pipeline rank), so that a dry run of some ranks compares like with like."""
        own = [sum(r.predicted.values()) for r in self.ranks if r.ok and r.predicted]
        return float(max(own)) if own else float(sum(self.predicted.values()))

    @property
    def ratio(self) -> float:
        """Predicted memory per device / the dry run's largest peak (1.0: exact; nan: nothing measured)."""
        return self.predicted_total / self.peak if self.peak else math.nan

    def replayed(self) -> str:
        """", M' of M micro-batches replayed" for a pipeline plan, else ""."""
        return f", {self.micro_batches[0]} of {self.micro_batches[1]} micro-batches replayed" \
            if self.micro_batches else ""

    def raise_if_failed(self) -> None:
        if self.ok:
            return
        first = self.failures[0]
        others = f" (and {len(self.failures) - 1} more rank(s))" if len(self.failures) > 1 else ""
        raise DryRunError(
            f"autopar: the {self.plan_kind} plan for mesh {self.mesh_shape} fails its dry run on "
            f"{first.where()}{others}: {first.error.removeprefix('autopar: ')}. The plan was expected to "
            "build and train on every rank; a plan that fails its dry run is a planner bug: report it with the "
            "plan's JSON"
        )

    def table(self) -> str:
        """One line per rank: peak and its kinds, then the prediction beside the largest peak."""
        lines = [f"dry run of the {self.plan_kind} plan on mesh {self.mesh_shape} ({self.world_size} ranks, "
                 f"{len(self.ranks)} distinct run{self.replayed()}) in {self.seconds:.1f} s"]
        for r in self.ranks:
            if r.ok:
                kinds = ", ".join(f"{k} {gib_text(v, 4)}" for k, v in _kinds(r.memory).items())
                lines.append(f"  {r.where()}: ok, peak {gib_text(r.peak, 4)} ({kinds}), {r.seconds:.1f} s")
                if r.predicted:
                    predicted = ", ".join(f"{k} {gib_text(v, 4)}" for k, v in _kinds(r.predicted).items())
                    lines.append(f"    predicted {gib_text(sum(r.predicted.values()), 4)} ({predicted}); "
                                 f"predicted / dry run {r.ratio:.2f}")
                lines.extend(f"    warning: {w}" for w in r.warnings)
            else:
                lines.append(f"  {r.where()}: FAILED: {r.error}")
        if self.peak:
            lines.append(f"predicted {gib_text(self.predicted_total, 4)} per device; "
                         f"dry-run peak {gib_text(self.peak, 4)}; predicted / dry run = {self.ratio:.2f}")
        return "\n".join(lines)


class DryRunError(ValueError):
    """A plan failed its dry run (``DryRunResult.raise_if_failed``)."""


def _kinds(memory: dict) -> dict:
    """``memory`` by kind, a training plan's kinds (``KINDS``) first, a serving plan's (its cache) after."""
    return {k: memory.get(k, 0) for k in KINDS if k in memory or k in ("parameters", "activations")} | {
        k: v for k, v in memory.items() if k not in KINDS}


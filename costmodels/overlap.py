"""Communication hidden behind compute: which collectives run beside it, and how much of
their time that hides.

A training step has two streams: compute, and the collectives the runtime issues
asynchronously beside it. Each such collective is of a kind (``KINDS``), runs beside the
compute of a window (``WINDOW``: forward or backward) and, where the window's compute is
long enough, hides ``overlap[kind]`` of its time (the profile's ``HardwareProfile.overlap``,
measured as a collective timed alone and beside compute, or a preset's published
figure). The rest is exposed: contention (the collective's kernels take compute units, or
on a CPU cores) slows the compute it runs beside by that much. The last unit of each kind
(the last gradient bucket, the first layer's gather) has no compute left to hide behind:
``Shares`` in ``autopar.passes.edge_costs`` gives each parameter's share of it.

The critical path of a step is then compute + exposed communication:

    step = compute + on_path + sum_k (C_k - hidden_k)
    hidden_k = overlap[k] * (1 - tail_k) * C_k * min(1, W_w / B_w)    (k's window w; formulas.HIDDEN)

where ``on_path`` is every collective that waits on the spot (tensor-parallel ones, and
any the runtime does not overlap), ``C_k`` a kind's seconds, ``B_w = sum_k (1 - tail_k) C_k``
what the second stream runs beside window w and ``W_w`` the window's compute: a stream
busier than its window hides only the window's share (``excess``).

What the runtime overlaps (``RUNTIME_OVERLAPS``) is a fact about the runtime, not the
hardware: a kind not in it is on the critical path whatever the profile says.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping

from autopar.costmodels.formulas import compiled

# collective kind -> the compute it runs beside
WINDOW = {
    "gradient_all_reduce": "backward",  # data-parallel gradient buckets (DDP)
    "gradient_reduce_scatter": "backward",  # ZeRO-2/3 gradient buckets (FSDP)
    "parameter_gather": "forward",  # ZeRO-3's gather of the next layer in forward (FSDP's prefetch)
    "parameter_regather": "backward",  # ZeRO-3's gather again in backward
}
KINDS = tuple(WINDOW)
# the collective each kind runs (what the profiler times beside compute)
COLLECTIVE = {"gradient_all_reduce": "all_reduce", "gradient_reduce_scatter": "reduce_scatter",
              "parameter_gather": "all_gather", "parameter_regather": "all_gather"}

# What ``autopar.runtime`` issues asynchronously beside compute, outside pipelines:
# data-parallel gradient buckets (``autopar.runtime.gradsync``: DDP-style, launched by
# post-accumulate-grad hooks) and ZeRO-3 buckets (``autopar.passes.lowering.buckets.Overlap``,
# as FSDP2: the next bucket's gather prefetched in forward and again in backward, gradient
# reduce-scatters one in flight; a gradient also summed over a data-parallel axis, HSDP, is
# reduce-scattered on the spot: ``kind_of``'s ``summed``). A pipeline's stages sum their
# gradients after the schedule (``autopar.runtime.pipeline``): nothing of theirs is priced as
# overlapping (``passes.planner.pipeline``'s profile has no overlap).
RUNTIME_OVERLAPS = frozenset(KINDS)


def kind_of(collective: str, backward: bool, regather: bool = False, summed: bool = False) -> str | None:
    """The overlap kind of one of a parameter's bucketed collectives: a gather in forward,
    again in backward (``regather``), or its gradient's sum in backward; None for others and
    for a reduce-scatter whose gradient is ``summed`` by an all-reduce too (HSDP)."""
    if regather:
        return "parameter_regather" if collective == "all_gather" else None
    if not backward:
        return "parameter_gather" if collective == "all_gather" else None
    if collective == "reduce_scatter":
        return None if summed else "gradient_reduce_scatter"
    return "gradient_all_reduce" if collective == "all_reduce" else None


def hidden_share(overlap: Mapping[str, float], kind: str | None) -> float:
    """The part of a ``kind`` collective's time hidden where its window is long enough:
    the profile's figure where the runtime overlaps the kind, else nothing."""
    if kind is None or kind not in RUNTIME_OVERLAPS:
        return 0.0
    return float(overlap.get(kind, 0.0))


def excess(hidden: float, busy: float, window: float) -> float:
    """Seconds of ``hidden`` that come back onto the critical path because the second stream
    is ``busy`` longer than the ``window`` of compute beside it (``formulas.HIDDEN``)."""
    if busy <= window:
        return 0.0
    return hidden - _hidden_fn()(hidden, busy, window)


@lru_cache(maxsize=1)
def _hidden_fn():
    return compiled("hidden")


def overlap_from_times(alone_comm: float, alone_compute: float, together: float) -> float:
    """A kind's overlap from three timings: the collective alone, the compute alone, and both
    issued together. The part of the shorter one hidden: 1 where together = the longer, 0
    where together = their sum (clamped to [0, 1])."""
    shorter = min(alone_comm, alone_compute)
    if shorter <= 0.0:
        return 0.0
    return min(1.0, max(0.0, (alone_comm + alone_compute - together) / shorter))

"""Least-squares fits of ``t = a + b x`` (and ``t = a + n g(s)``) to measured times.

Sweeps span several orders of magnitude in x, so the fit minimises *relative*
residuals (each row weighted by 1/t): a 4 KB message and a 4 MB one count alike.
A negative intercept (latency) is not physical; the fit then refits with a = 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, kw_only=True)
class LinearFit:
    intercept: float  # a, seconds
    slope: float  # b, seconds per unit of x
    median_rel_error: float  # median |t_fit - t| / t over the fitted points
    points: int
    data: tuple[tuple[float, float], ...] = ()  # the (x, t) pairs fitted

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_linear(x: Sequence[float], t: Sequence[float]) -> LinearFit:
    """Weighted least squares of ``t = a + b x`` with a >= 0 and b > 0."""
    xs, ts = np.asarray(x, dtype=float), np.asarray(t, dtype=float)
    if xs.shape != ts.shape or xs.size < 2:
        raise ValueError(
            f"autopar: a fit needs at least 2 (size, time) points of equal count; found "
            f"{xs.size} sizes and {ts.size} times."
        )
    if not np.all(ts > 0) or not np.all(np.isfinite(ts)):
        raise ValueError(f"autopar: measured times must be positive and finite; found {ts.tolist()}.")
    w = 1.0 / ts
    design = np.stack([np.ones_like(xs), xs], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, ts * w, rcond=None)
    if a < 0:
        a = 0.0
        b = float(np.sum(xs * w * w * ts) / np.sum((xs * w) ** 2))
    if not b > 0:
        raise ValueError(
            f"autopar: the measured times do not grow with size (slope {b:.3g} s per unit), so "
            f"no rate can be fitted; sizes {xs.tolist()}, times {ts.tolist()}. Widen the sweep "
            f"to larger sizes or re-run on a quieter machine."
        )
    rel = np.abs(a + b * xs - ts) / ts
    return LinearFit(
        intercept=float(a),
        slope=float(b),
        median_rel_error=float(np.median(rel)),
        points=int(xs.size),
        data=tuple(zip(xs.tolist(), ts.tolist())),
    )



@dataclass(frozen=True, kw_only=True)
class PerItemFit:
    """``t = a + n g(s)``: an op of n independent items of size s (attention: batch x heads
    heads of s FLOPs each) costs a fixed a plus n times one item's time, g measured at each
    size ``points`` holds as (s, g(s))."""

    intercept: float  # a, seconds
    points: tuple[tuple[float, float], ...]  # (item size, seconds per item), by size
    median_rel_error: float


def fit_per_item(counts: Sequence[float], sizes: Sequence[float], t: Sequence[float]) -> PerItemFit:
    """Weighted least squares of ``t = a + n g(s)``, one unknown g per distinct size s and a
    shared a >= 0 (a = 0 where the points cannot tell it apart: no size timed at two counts)."""
    ns, ss, ts = (np.asarray(v, dtype=float) for v in (counts, sizes, t))
    if not (ns.shape == ss.shape == ts.shape) or ns.size < 1:
        raise ValueError(f"autopar: a fit needs (count, size, time) triples; found {ns.size}, {ss.size}, {ts.size}.")
    if not np.all(ts > 0) or not np.all(np.isfinite(ts)):
        raise ValueError(f"autopar: measured times must be positive and finite; found {ts.tolist()}.")
    distinct = sorted(set(ss.tolist()))
    w = 1.0 / ts
    cols = [np.where(ss == s, ns, 0.0) for s in distinct]
    a = 0.0
    if len(distinct) + 1 <= ns.size:
        design = np.stack([np.ones_like(ns)] + cols, axis=1) * w[:, None]
        coef, *_ = np.linalg.lstsq(design, ts * w, rcond=None)
        a, g = float(coef[0]), coef[1:]
    if len(distinct) + 1 > ns.size or a < 0:
        a, g = 0.0, np.linalg.lstsq(np.stack(cols, axis=1) * w[:, None], ts * w, rcond=None)[0]
    if not np.all(g > 0):
        raise ValueError(
            f"autopar: the measured times do not give every item size a positive time (sizes {distinct}, "
            f"seconds per item {g.tolist()}); re-run on a quieter machine."
        )
    fitted = a + ns * np.array([g[distinct.index(s)] for s in ss])
    return PerItemFit(intercept=a, points=tuple(zip(distinct, (float(x) for x in g))),
                      median_rel_error=float(np.median(np.abs(fitted - ts) / ts)))

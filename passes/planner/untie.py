"""A manual layout's restrictions on the solver's problem, splitting the ties they contradict.

A layout restricts the problem (``intra_op.complete``): ``hard`` restrictions are its
placements (a placeholder may take only the placement the layout gives it); ``soft`` ones
say how it computes (an op reading a weight uses it where it lies), and each is kept only
where the node's decision class keeps a finite choice.

Tied layers share one decision class, an optimisation that assumes the layout places them
alike. Where it does not (Megatron's row and column roles alternate across an MoE layer's
router; a layer whose input arrives split), the tie is split for this layout: its members
are grouped by the strategies the layout leaves them, layers left the same choices stay
tied, and the others are solved apart. The layout is never refused for a tie. A soft
restriction that contradicts a follower (an op that reads its operand in place: ``expand``
of a class token) is dropped instead: the follower is exact, the restriction a preference.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from autopar.passes.solve import SolveProblem
from autopar.passes.solve.shrink import ShrunkProblem, shrink_problem


@dataclass
class Restrictions:
    """Seconds added to problem nodes' strategies (inf forbids one), in graph order."""

    hard: list[tuple[int, np.ndarray]] = field(default_factory=list)  # the layout's placements
    soft: list[tuple[int, np.ndarray]] = field(default_factory=list)  # how it computes: kept where possible


@dataclass
class Restricted:
    """The restricted problem to complete on, and the tie groups split to make it."""

    shrunk: ShrunkProblem
    splits: list[list[list[int]]]  # per split tie group: its parts (problem nodes), in order


def restrict(problem: SolveProblem, shrunk: ShrunkProblem, restrictions: Restrictions) -> Restricted | None:
    """``shrunk`` (``shrink_problem(problem)``) with ``restrictions`` added; tie groups the
    restrictions contradict are split (module docstring). None when a hard restriction
    contradicts the problem itself (not a tie: a follower or a single-strategy node)."""
    added, contradicted = _fold(problem, shrunk, restrictions, _tied_classes(problem, shrunk))
    if not contradicted:
        return Restricted(shrunk.with_added_time(added), []) if added is not None else None
    trees = shrink_problem(replace(problem, ties=[], hints=[]))  # followers only: no class spans layers
    added, _ = _fold(problem, trees, restrictions, set())
    if added is None:
        return None
    allowed = _allowed(trees, added)
    ties, splits = [], []
    for group in problem.ties:
        parts = _parts(group, [allowed[int(trees.node_class[v])] for v in group])
        ties += [part for part in parts if len(part) > 1]
        if len(parts) > 1:
            splits.append(parts)
    untied = shrink_problem(replace(problem, ties=ties, hints=[]))
    try:
        return Restricted(untied.with_added_time(added), splits)
    except ValueError:  # parts joined by an edge no strategy they share can cross
        return None


def _tied_classes(problem: SolveProblem, shrunk: ShrunkProblem) -> set[int]:
    """Decision classes that hold tied nodes (a contradiction there may be the tie's)."""
    return {int(shrunk.node_class[v]) for group in problem.ties for v in group}


def _fold(problem: SolveProblem, shrunk: ShrunkProblem, restrictions: Restrictions,
          tied: set[int]) -> tuple[dict | None, bool]:
    """(restrictions kept, by problem node; None when a hard one leaves an untied class no
    choice), and whether one contradicts a tied class (then the ties must be split first).
    A soft one that leaves its own node no choice is dropped, as one its class forbids."""
    time = {}  # decision class -> its time with the kept restrictions (-1: the fixed classes)

    def folded(v: int, extra: np.ndarray) -> tuple[int, np.ndarray]:
        d = int(shrunk.node_class[v])
        base = time.get(d, shrunk.node_time[d] if d >= 0 else np.zeros(1))
        return d, base + np.asarray(extra, dtype=np.float64)[shrunk.index_maps[v]]

    kept: dict[int, np.ndarray] = {}
    contradicted = False
    for hard, items in ((True, restrictions.hard), (False, restrictions.soft)):
        for v, extra in items:
            if not hard and not np.isfinite(problem.node_time[v] + kept.get(v, 0.0) + extra).any():
                continue
            d, total = folded(v, extra)
            if np.isfinite(total).any():
                time[d] = total
                kept[v] = kept.get(v, 0.0) + extra
            elif d in tied:
                contradicted = True
                if hard:  # kept: splitting the tie makes room for it
                    kept[v] = kept.get(v, 0.0) + extra
            elif hard:
                return None, False
    return kept, contradicted


def _allowed(trees: ShrunkProblem, added: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Per decision class of ``trees``: which of its strategies the restrictions leave finite."""
    time = {d: t for d, t in enumerate(trees.node_time)}
    time[-1] = np.zeros(1)
    for v, extra in added.items():
        d = int(trees.node_class[v])
        time[d] = time[d] + np.asarray(extra, dtype=np.float64)[trees.index_maps[v]]
    return {d: np.isfinite(t) for d, t in time.items()}


def _parts(group: list[int], allowed: list[np.ndarray]) -> list[list[int]]:
    """``group`` whole where its members share an allowed strategy; else grouped by the
    strategies each is allowed (first-seen order)."""
    if len({len(a) for a in allowed}) == 1 and np.logical_and.reduce(allowed).any():
        return [list(group)]
    parts: dict[bytes, list[int]] = {}
    for v, a in zip(group, allowed):
        parts.setdefault(a.tobytes(), []).append(v)
    return list(parts.values())

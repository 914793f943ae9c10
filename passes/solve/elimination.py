"""Exact min-sum variable elimination for shrunk problems of small width; memory by a Lagrangian price.

The shrunk objective is a sum of per-node tables and per-edge tables. Eliminating a
decision node ``v`` replaces every table that mentions ``v`` by one table over its
neighbours ``N(v)``: ``new[n] = min_i (sum of the tables at (i, n))``, with the argmin kept
for the way back (bucket elimination; Dechter, "Bucket elimination", 1999). When every
node is gone the tables left are numbers, their sum the optimum, and the kept argmins,
read in the reverse order, give a plan that reaches it. Chains are the case where every
``N(v)`` holds one node (``chain_dp``'s Viterbi); a graph with residual edges keeps ``N(v)``
small too when the order is good.

The work is the size of the tables built, the product of the strategy counts of ``v`` and
``N(v)``. ``elimination_order`` picks greedily the node whose elimination adds the fewest
new table entries (min-fill, weighted by strategy counts; ties by the table's size, then
the node's index: the same problem, the same order), and gives up (None) when a table
would pass ``max_entries`` or all of them ``MAX_WORK``: then the ILP solves the problem. Measured on a two-layer Qwen3
on 2 x 2 (81 decisions, 1,951 strategies, 99 edges): the largest table holds 14.3 M
entries, 33 M in all.

``eliminate`` leaves the memory limit out: strategies whose memory alone cannot fit are
removed first (``allowed``), so its optimum is a lower bound on every plan that fits; when
the plan that reaches it fits as well, it is the optimum with the limit.

``lagrangian`` keeps the limit ``B`` by Lagrangian relaxation (as ``chain_dp`` does on
chains): eliminating on ``time + lam * memory`` gives, for any ``lam >= 0``, a plan and the
lower bound ``min(time + lam * memory) - lam * B`` on every plan that fits. It starts from
the plan of least time (``lam = 0``) and the plan of least memory, and moves ``lam`` to
where the best plan that does not fit and the best that fits cost the same
(``lam = (t_fit - t_over) / (m_over - m_fit)``); a plan found there replaces one of the
two, and when none is better the bound is the best this relaxation gives. ``intra_op.solve``
takes its plan where it is within the gap limit of the bound, and else keeps the bound only.
On Llama-70B's three pipelined problems on 8 x 8 (80 decisions) the
ILP, at its budget, ended 4-14% above the plans this finds in 0.6-1.4 s; its bound was better
on one of them (4.231 s against 4.194 s), within 0.05% on the other two.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from autopar.passes.solve.problem import ROUNDING, fits_memory
from autopar.passes.solve.shrink import ShrunkProblem

# The largest table one elimination may build: 33.5 M float64 entries, 268 MB (its argmin,
# one int32 per entry of the table left, is smaller by the eliminated node's strategy count).
# A two-layer OLMo2 on 2 x 2 builds one of 20 M (its q and k norms join the attention's
# choices): CP-SAT took 4.8 s to solve it, elimination 1.7 s, the same plan, and less memory.
MAX_ENTRIES = 1 << 25
# The entries of all its tables together: one elimination at most about 0.3 s here (Qwen3's
# above: 33 M entries, 0.2 s), as each Lagrangian round runs one.
MAX_WORK = 1 << 26


@dataclass
class Eliminated:
    decisions: list[int]  # per shrunk node, indices into its strategies
    objective: float  # node and edge times of the plan, without the shrunk problem's constants


@dataclass
class Relaxed:
    decisions: list[int] | None  # the fastest plan found that fits, per shrunk node; None: none fits
    objective: float  # its node and edge times, without the shrunk constants (inf: none)
    bound: float  # no plan that fits is faster (same terms)
    rounds: int  # eliminations run


@dataclass
class _Table:
    scope: tuple[int, ...]  # decision nodes, one axis each
    values: np.ndarray


def elimination_order(shrunk: ShrunkProblem, sizes: list[int], max_entries: int = MAX_ENTRIES,
                      max_work: int = MAX_WORK) -> list[int] | None:
    """Nodes in the order to eliminate them (greedy weighted min-fill), or None when some
    elimination would build a table of more than ``max_entries`` entries, or all of them
    more than ``max_work``."""
    neighbours = [set() for _ in range(shrunk.num_nodes)]
    for a, b in shrunk.edges:
        neighbours[a].add(b)
        neighbours[b].add(a)

    def score(v: int) -> tuple[int, int, int]:
        fill = sum(sizes[x] * sizes[y] for x, y in itertools.combinations(sorted(neighbours[v]), 2)
                   if y not in neighbours[x])
        return fill, sizes[v] * math.prod(sizes[u] for u in neighbours[v]), v

    current = {v: score(v) for v in range(shrunk.num_nodes)}
    heap = list(current.values())
    heapq.heapify(heap)
    order: list[int] = []
    work = 0
    while heap:
        entry = heapq.heappop(heap)
        v = entry[2]
        if current.get(v) != entry:
            continue  # scored again since
        work += entry[1]
        if entry[1] > max_entries or work > max_work:
            return None
        order.append(v)
        del current[v]
        around = neighbours[v]
        for u in around:
            neighbours[u] |= around - {u}
            neighbours[u].discard(v)
        neighbours[v] = set()
        # a fill changes only for the neighbours and their neighbours
        for u in set().union(around, *(neighbours[n] for n in around)):
            current[u] = score(u)
            heapq.heappush(heap, current[u])
    return order


def eliminate(shrunk: ShrunkProblem, allowed: list[np.ndarray], max_entries: int = MAX_ENTRIES) -> Eliminated | None:
    """The plan of least shrunk time among the ``allowed`` strategies (a bool mask per node),
    memory aside; None when the graph is too wide for ``max_entries`` or nothing is allowed."""
    kept = [np.flatnonzero(mask) for mask in allowed]
    if any(k.size == 0 for k in kept):
        return None
    order = elimination_order(shrunk, [k.size for k in kept], max_entries)
    if order is None:
        return None
    tables = [_Table((v,), t[k]) for v, (t, k) in enumerate(zip(shrunk.node_time, kept))]
    tables += [_Table((a, b), cost[np.ix_(kept[a], kept[b])]) for (a, b), cost in shrunk.edges.items()]
    by_node: list[list[_Table]] = [[] for _ in kept]
    for table in tables:
        for v in table.scope:
            by_node[v].append(table)
    constant = 0.0
    way_back: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    for v in order:
        mentioning = by_node[v]
        rest = tuple(sorted({u for t in mentioning for u in t.scope} - {v}))
        axes = (*rest, v)  # v last: its minimum runs over contiguous memory
        joint = np.zeros([kept[u].size for u in axes])
        for table in mentioning:
            joint += _aligned(table, axes)
        argmin = joint.argmin(axis=-1)
        best = np.take_along_axis(joint, argmin[..., None], axis=-1)[..., 0]
        way_back.append((v, rest, argmin.astype(np.int32)))
        for table in mentioning:
            for u in table.scope:
                if u != v:
                    by_node[u] = [t for t in by_node[u] if t is not table]
        if rest:
            new = _Table(rest, best)
            for u in rest:
                by_node[u].append(new)
        else:
            constant += float(best)
    if not np.isfinite(constant):
        return None  # every plan takes a forbidden strategy or pair
    chosen: dict[int, int] = {}
    for v, rest, argmin in reversed(way_back):
        chosen[v] = int(argmin[tuple(chosen[u] for u in rest)])
    decisions = [int(kept[v][chosen[v]]) for v in range(len(kept))]
    return Eliminated(decisions, constant)


def _aligned(table: _Table, axes: tuple[int, ...]) -> np.ndarray:
    """``table.values`` with its axes in the order of ``axes`` and size 1 on the axes it lacks."""
    order = sorted(range(len(table.scope)), key=lambda i: axes.index(table.scope[i]))
    shape = [1] * len(axes)
    for i in order:
        shape[axes.index(table.scope[i])] = table.values.shape[i]
    return np.transpose(table.values, order).reshape(shape)


def lagrangian(shrunk: ShrunkProblem, allowed: list[np.ndarray], *, max_rounds: int = 16,
               relative_gap: float = 0.0, max_entries: int = MAX_ENTRIES) -> Relaxed | None:
    """The fastest plan that fits ``shrunk.memory_limit`` this relaxation finds, and its bound
    (module docstring); None when the graph is too wide. Stops once the plan is within
    ``relative_gap`` of the bound, or after ``max_rounds`` eliminations."""
    limit = shrunk.memory_limit

    def plan_at(time_weight: float, memory_weight: float) -> tuple[list[int], float, float] | None:
        weighted = _weighted(shrunk, time_weight, memory_weight)
        found = eliminate(weighted, allowed, max_entries)
        if found is None:
            return None
        decisions = fewer_bytes_alike(weighted, shrunk, found.decisions, allowed)
        time, memory = shrunk.evaluate(decisions)
        return decisions, time - shrunk.constant_time, memory

    fastest = plan_at(1.0, 0.0)
    if fastest is None:
        return None
    if limit is None or fits_memory(fastest[2], limit):
        return Relaxed(fastest[0], fastest[1], fastest[1], 1)
    least = plan_at(0.0, 1.0)
    if least is None or not fits_memory(least[2], limit):
        return Relaxed(None, math.inf, fastest[1], 2)  # no plan fits
    over, fit = fastest, least  # the two ends: the best plan that does not fit, and one that does
    best, bound, rounds = least, fastest[1], 2
    while rounds < max_rounds and best[1] - bound > relative_gap * abs(best[1]):
        lam = (fit[1] - over[1]) / (over[2] - fit[2])  # where the two ends cost the same
        found = plan_at(1.0, lam)
        rounds += 1
        if found is None:
            break
        value = found[1] + lam * found[2]
        bound = max(bound, value - lam * limit)
        if value >= fit[1] + lam * fit[2] - ROUNDING * (abs(fit[1]) + lam * fit[2]):
            break  # nothing cheaper at lam than the two ends: the relaxation's best bound
        if fits_memory(found[2], limit):
            fit = found
            best = min(best, found, key=lambda plan: plan[1])
        else:
            over = found
    return Relaxed(best[0], best[1], min(bound, best[1]), rounds)


def fewer_bytes_alike(costed: ShrunkProblem, shrunk: ShrunkProblem, decisions: list[int],
                      allowed: list[np.ndarray]) -> list[int]:
    """``decisions`` with each node in turn moved to the strategy of least memory (``shrunk``'s)
    among the allowed ones that cost what its own does beside its neighbours' (``costed``'s
    tables): the objective is unchanged, and where strategies tie (an input held whole or split
    where its reader splits it anyway) the one holding fewer bytes is taken, not the first."""
    decisions = list(decisions)
    around: list[list[tuple[int, np.ndarray, np.ndarray | None, bool]]] = [[] for _ in decisions]
    for (a, b), cost in costed.edges.items():
        held = shrunk.edge_memory.get((a, b))
        around[a].append((b, cost, held, True))
        around[b].append((a, cost, held, False))
    for v, mine in enumerate(decisions):
        time = costed.node_time[v].copy()
        memory = shrunk.node_memory[v].copy()
        for u, cost, held, rows in around[v]:
            time += cost[:, decisions[u]] if rows else cost[decisions[u], :]
            if held is not None:
                memory += held[:, decisions[u]] if rows else held[decisions[u], :]
        alike = allowed[v] & (np.abs(time - time[mine]) <= ROUNDING * abs(time[mine]))
        best = int(np.flatnonzero(alike)[np.argmin(memory[alike])])
        if memory[best] < memory[mine]:
            decisions[v] = best
    return decisions


def _weighted(shrunk: ShrunkProblem, time_weight: float, memory_weight: float) -> ShrunkProblem:
    """``shrunk`` with every time replaced by ``time_weight * time + memory_weight * memory``;
    a forbidden (inf) strategy or pair stays forbidden."""
    def mix(time: np.ndarray, memory: np.ndarray | float) -> np.ndarray:
        allowed = np.isfinite(time)
        return np.where(allowed, np.where(allowed, time, 0.0) * time_weight, np.inf) + memory_weight * memory

    edges = {e: mix(cost, shrunk.edge_memory.get(e, 0.0)) for e, cost in shrunk.edges.items()}
    return replace(shrunk, node_time=[mix(t, m) for t, m in zip(shrunk.node_time, shrunk.node_memory)], edges=edges)

"""Exact dynamic programs for chains (series graphs) of decision nodes.

A shrunk problem is a chain when every connected component is a path; the paths are
laid end to end (``chain_order``) with no cost between them. Position ``p`` holds node
``order[p]`` with ``k_p`` strategies; ``links[p]`` is the resharding table between
positions ``p - 1`` and ``p`` (``None`` when they are not connected).

Without a memory budget the optimum is a Viterbi recursion (``viterbi``):
``best[p][j] = time_p[j] + min_i (best[p-1][i] + link_p[i, j])``.

With a budget ``B`` (``constrained_chain_dp``) every state ``(p, j)`` keeps the Pareto
front of (time, memory) labels of the partial chains ending there; the memory is kept
exactly in floats, not discretised. A label (t, m) is dropped when it is dominated,
when m plus the least memory still to come exceeds ``B``, or when its Lagrangian
completion bound ``t + G[p][j] - lambda * (B - m)`` exceeds the incumbent, where
``G[p][j]`` is the least ``time + lambda * memory`` of the positions after ``p``
(a backward Viterbi, ``_time_to_go``): any completion that fits uses at most
``B - m`` memory. ``lambda`` and the first incumbent come from Lagrangian relaxation
(``lagrangian_chain``): Viterbi on ``time + lambda * memory`` over grids of lambda;
its best dual value ``min(time + lambda * memory) - lambda * B`` is a lower bound.
When a front would grow beyond ``max_labels``, or the work done (labels extended times
strategies, ``work_budget``) passes half its budget, only the labels with the least
completion bound are kept; the answer is then not proven and the dual bound is
reported. Both limits count work, not seconds, so the same problem gives the same plan;
a wall-clock ``deadline`` is a safety net, reported as ``clock_cut`` when it thins. ``solve_chain`` runs such a thin pass (256 labels) first: its plan is a
cutoff that prunes most of the exact pass.

Measured here (2 shared cores): a 2000 x 8 chain with a memory limit is proven
optimal in about 1.2 s, an 8000 x 8 one in about 6.5 s (``benchmarks/solve_scale.py``).
"""

from __future__ import annotations

from time import perf_counter
from dataclasses import dataclass

import numpy as np

from autopar.passes.solve.problem import MEMORY_RELATIVE_TOLERANCE
from autopar.passes.solve.shrink import ShrunkProblem

ROUGH_LABELS = 256  # per state in the first, heuristic pass
THIN_LABELS = 64  # per state once out of time or label budget
LABEL_BUDGET = 50_000_000  # labels kept in all, 6 bytes each for backtracking (300 MB)
# Label extensions (labels times strategies) granted per second of the search budget. The
# exact pass over benchmarks/solve_scale.py's 2000 x 8 chain extends fewer than 1.5e7 (it
# is proven optimal with a 3e7 budget), so this thins only fronts far larger than those.
WORK_PER_SECOND = 1e8


@dataclass
class ChainSolution:
    decisions: list[int]  # per shrunk node (not per position)
    objective: float  # node + link times, without the shrunk problem's constants
    bound: float  # lower bound on that objective
    proven_optimal: bool
    clock_cut: bool = False  # the wall-clock safety net thinned the fronts


def chain_order(shrunk: ShrunkProblem) -> list[int] | None:
    """Nodes in an order where every edge joins neighbours, or ``None`` if not a chain, or if
    an edge holds memory (``ShrunkProblem.edge_memory``: the DP's fronts order labels by their
    nodes' memory alone; the ILP counts it)."""
    if shrunk.edge_memory:
        return None
    neighbours = shrunk.adjacency()
    if any(len(n) > 2 for n in neighbours):
        return None
    order: list[int] = []
    visited = [False] * shrunk.num_nodes
    for start in range(shrunk.num_nodes):
        if visited[start] or len(neighbours[start]) == 2:
            continue  # start paths at their ends
        previous, v = -1, start
        while v >= 0:
            visited[v] = True
            order.append(v)
            following = [w for w in neighbours[v] if w != previous]
            previous, v = v, (following[0] if following else -1)
    if len(order) != shrunk.num_nodes:
        return None  # a cycle: every node on it has two neighbours
    return order


def chain_tables(shrunk: ShrunkProblem, order: list[int]):
    """Per-position times, memories and links (oriented previous -> current)."""
    times = [shrunk.node_time[v] for v in order]
    memories = [shrunk.node_memory[v] for v in order]
    links: list[np.ndarray | None] = [None]
    for previous, v in zip(order, order[1:]):
        if (previous, v) in shrunk.edges:
            links.append(shrunk.edges[(previous, v)])
        elif (v, previous) in shrunk.edges:
            links.append(shrunk.edges[(v, previous)].T)
        else:
            links.append(None)
    return times, memories, links


def viterbi(times, links, weights: list[np.ndarray] | None = None, lambdas: np.ndarray | None = None):
    """Minimise ``time + lambda * weight`` for every lambda at once.

    Returns ``(choices [L, n], values [L])`` where ``L = len(lambdas)`` (1 when omitted).
    """
    lambdas = np.zeros(1) if lambdas is None else np.asarray(lambdas, dtype=np.float64)

    def local(p: int) -> np.ndarray:
        cost = np.broadcast_to(times[p], (len(lambdas), len(times[p])))
        return cost if weights is None else cost + lambdas[:, None] * weights[p][None, :]

    best = local(0)
    back = []
    for p in range(1, len(times)):
        if links[p] is None:
            arg = np.broadcast_to(best.argmin(axis=1)[:, None], (len(lambdas), len(times[p])))
        else:
            arg = (best[:, :, None] + links[p][None]).argmin(axis=1)
        previous = np.take_along_axis(best, arg, axis=1)
        if links[p] is not None:
            previous = previous + links[p][arg, np.arange(len(times[p]))[None, :]]
        best = previous + local(p)
        back.append(arg)
    choices = np.empty((len(lambdas), len(times)), dtype=np.int64)
    choices[:, -1] = best.argmin(axis=1)
    values = best.min(axis=1)
    rows = np.arange(len(lambdas))
    for p in range(len(times) - 1, 0, -1):
        choices[:, p - 1] = back[p - 1][rows, choices[:, p]]
    return choices, values


def chain_cost(times, memories, links, choice) -> tuple[float, float]:
    time = sum(float(times[p][s]) for p, s in enumerate(choice))
    time += sum(float(links[p][choice[p - 1], choice[p]]) for p in range(1, len(choice)) if links[p] is not None)
    return time, sum(float(memories[p][s]) for p, s in enumerate(choice))


def _impossible(times) -> bool:
    """Whether some position has no strategy of finite time (a pin or a mask ruled all out):
    no plan, and a bound of infinity."""
    return any(not np.isfinite(t).any() for t in times)


def lagrangian_chain(times, memories, links, budget: float, num_lambdas: int = 24, rounds: int = 5):
    """Best feasible Viterbi solution over lambda grids, and the best dual lower bound.

    The first grid is geometric; each later round is a linear grid between the
    largest lambda whose plan does not fit and the smallest whose plan does, where
    the dual optimum lies. Returns ``(choice or None, its time, dual bound, its lambda)``.
    """
    if _impossible(times):
        return None, np.inf, np.inf, 0.0
    finite_times = [t[np.isfinite(t)] for t in times]
    time_span = sum(float(t.max() - t.min()) for t in finite_times) + sum(
        float(np.ptp(r[np.isfinite(r)])) for r in links if r is not None and np.isfinite(r).any()
    )
    memory_span = sum(float(np.ptp(m)) for m in memories) or 1.0
    base = max(time_span, 1e-30) / memory_span
    best_choice, best_time, bound, best_lambda = None, np.inf, -np.inf, 0.0
    lambdas = np.concatenate([[0.0], base * np.logspace(-16, 8, 2 * num_lambdas - 1, base=2.0)])
    for _ in range(rounds):
        choices, values = viterbi(times, links, memories, lambdas)
        fits = np.zeros(len(lambdas), dtype=bool)
        for row, choice in enumerate(choices):
            time, memory = chain_cost(times, memories, links, choice)
            dual = float(values[row]) - lambdas[row] * budget
            if dual > bound:
                bound, best_lambda = dual, float(lambdas[row])
            fits[row] = memory <= budget + MEMORY_RELATIVE_TOLERANCE * abs(budget)
            if fits[row] and time < best_time:
                best_choice, best_time = choice, time
        if not fits.any() or fits[0] and lambdas[0] == 0.0:
            break  # nothing fits at any lambda, or lambda = 0 already fits (optimal)
        first_fit = int(np.argmax(fits))
        if first_fit == 0:
            break
        lambdas = np.linspace(lambdas[first_fit - 1], lambdas[first_fit], num_lambdas)
    return best_choice, best_time, bound, best_lambda


def constrained_chain_dp(times, memories, links, budget: float, incumbent: float = np.inf, max_labels: int = 2000,
                         multiplier: float = 0.0, deadline: float | None = None, label_budget: int = LABEL_BUDGET,
                         work_budget: float = np.inf):
    """Exact (time, memory) Pareto DP; returns ``(choice or None, time, proven, clock_cut)``.

    Fronts are thinned (and the result no longer proven) beyond ``max_labels`` per
    state, when the labels kept so far approach ``label_budget`` or the label extensions
    done approach ``work_budget`` (deterministic limits), or, a safety net reported as
    ``clock_cut``, after ``deadline`` (a ``perf_counter()`` value), so the DP always finishes.

    A label (t, m) at state (p, j) is pruned when even the Lagrangian bound of its best
    completion, ``t + G[p][j] - multiplier * (budget - m)`` with ``G`` the least
    ``time + multiplier * memory`` still to come, exceeds the incumbent: any completion
    that fits has memory at most ``budget - m``.
    """
    if _impossible(times):
        return None, np.inf, True, False
    n = len(times)
    time_to_go = _time_to_go(times, links, memories, multiplier)
    least_memory = [float(m[np.isfinite(t)].min()) for t, m in zip(times, memories)]
    memory_to_go = np.concatenate([np.cumsum(least_memory[::-1])[::-1][1:], [0.0]])
    memory_cap = budget + MEMORY_RELATIVE_TOLERANCE * abs(budget)
    time_cap = incumbent + 1e-9 * abs(incumbent) if np.isfinite(incumbent) else np.inf
    proven = True
    states_from = np.cumsum([len(t) for t in times][::-1])[::-1]  # states at positions >= p
    stored = 0
    work, clock_cut = 0.0, False
    # Labels of the states (p - 1, j): arrays of time and memory. Every position keeps
    # only its labels' parents (strategy, label index): 6 bytes a label for backtracking.
    parents: list[list[tuple[np.ndarray, np.ndarray]]] = []
    first = []
    for j in range(len(times[0])):
        slack = budget - memories[0][j]
        keep = (memories[0][j] + memory_to_go[0] <= memory_cap)
        keep = keep and (times[0][j] + time_to_go[0][j] - multiplier * slack <= time_cap)
        keep = keep and np.isfinite(times[0][j])
        size = 1 if keep else 0
        first.append((np.full(size, times[0][j]), np.full(size, memories[0][j])))
    previous = first
    parents.append([(np.zeros(len(f[0]), np.int16), np.zeros(len(f[0]), np.int32)) for f in first])
    for p in range(1, n):
        label_time = np.concatenate([f[0] for f in previous])
        label_memory = np.concatenate([f[1] for f in previous])
        parent_strategy = np.concatenate([np.full(len(f[0]), i, np.int64) for i, f in enumerate(previous)])
        parent_label = np.concatenate([np.arange(len(f[0])) for f in previous])
        if len(label_time) == 0:
            return None, np.inf, proven, clock_cut  # every partial plan is pruned: none beats the cutoff
        order = np.lexsort((label_time, label_memory))
        label_time, label_memory = label_time[order], label_memory[order]
        parent_strategy, parent_label = parent_strategy[order], parent_label[order]
        candidate = label_time[:, None] + times[p][None, :]
        if links[p] is not None:
            candidate = candidate + links[p][parent_strategy, :]
        running = np.minimum.accumulate(candidate, axis=0)
        better = np.empty_like(candidate, dtype=bool)
        better[0] = np.isfinite(candidate[0])
        better[1:] = candidate[1:] < running[:-1]
        cap = max_labels
        if stored > label_budget // 2:  # spread what is left over the states still to come
            cap = min(cap, max(THIN_LABELS, (label_budget - stored) // int(states_from[p])))
        if work > work_budget / 2:  # spread what is left of the work over the positions to come
            cap = min(cap, max(THIN_LABELS, int((work_budget - work) / (int(states_from[p]) * len(times[p])))))
        if deadline is not None and perf_counter() > deadline:
            clock_cut = clock_cut or cap > THIN_LABELS
            cap = min(cap, THIN_LABELS)
        work += float(candidate.size)
        current, links_back = [], []
        for j in range(len(times[p])):
            memory_j = label_memory + memories[p][j]
            mask = better[:, j] & (memory_j + memory_to_go[p] <= memory_cap)
            lower_bound = candidate[:, j] + time_to_go[p][j] - multiplier * (budget - memory_j)
            mask &= lower_bound <= time_cap
            rows = np.flatnonzero(mask)
            if len(rows) > cap:  # keep the most promising labels; no longer exact
                rows = np.sort(rows[np.argpartition(lower_bound[rows], cap)[:cap]])
                proven = False
            stored += len(rows)
            current.append((candidate[rows, j], memory_j[rows]))
            links_back.append((parent_strategy[rows].astype(np.int16), parent_label[rows].astype(np.int32)))
        previous = current
        parents.append(links_back)
    ends = [(float(f[0].min()), j, int(f[0].argmin())) for j, f in enumerate(previous) if len(f[0])]
    if not ends:
        return None, np.inf, proven, clock_cut
    best_time, strategy, label = min(ends)
    choice = [0] * n
    for p in range(n - 1, -1, -1):
        choice[p] = strategy
        strategy_back, label_back = parents[p][strategy]
        strategy, label = int(strategy_back[label]), int(label_back[label])
    return choice, best_time, proven, clock_cut


def solve_chain(shrunk: ShrunkProblem, order: list[int], incumbent: float = np.inf, max_labels: int = 2000,
                deadline: float | None = None, work_budget: float = np.inf) -> ChainSolution:
    """Optimal decisions for a chain-shaped shrunk problem.

    ``incumbent`` (without the shrunk constants) is the time of a known plan, e.g. a
    hint; labels that cannot beat it are pruned. ``decisions`` is empty when no plan
    of the shrunk problem beats it (its ``bound`` then says how far off they are).
    """
    times, memories, links = chain_tables(shrunk, order)
    budget = shrunk.memory_budget
    if budget is None:
        choices, values = viterbi(times, links)
        return _in_node_order(order, choices[0], float(values[0]), float(values[0]), True)
    choice, time, dual_bound, multiplier = lagrangian_chain(times, memories, links, budget)
    if choice is not None and time <= dual_bound + 1e-12 * abs(dual_bound):
        return _in_node_order(order, choice, time, time, True)  # the lambda = 0 optimum fits
    # A cheap pass with thin fronts finds a near-optimal plan; its time as the cutoff
    # lets the exact pass prune far more labels.
    rough, rough_time, _, _ = constrained_chain_dp(times, memories, links, budget, min(incumbent, time),
                                                   ROUGH_LABELS, multiplier)
    if rough is not None and rough_time < time:
        choice, time = rough, rough_time
    cutoff = min(incumbent, time)
    exact, exact_time, proven, clock_cut = constrained_chain_dp(times, memories, links, budget, cutoff, max_labels,
                                                                multiplier, deadline, work_budget=work_budget)
    if exact is not None and exact_time <= time:
        choice, time = exact, exact_time
    if not proven:
        bound = dual_bound
    elif exact is not None:
        bound = exact_time  # the DP saw every plan that could beat the cutoff
    else:
        bound = cutoff  # nothing beats the cutoff
    if choice is None:
        return ChainSolution([], np.inf, bound, proven, clock_cut)
    solution = _in_node_order(order, choice, time, min(bound, time), proven and time <= bound + 1e-9 * abs(bound))
    solution.clock_cut = clock_cut
    return solution


def _time_to_go(times, links, memories, multiplier: float) -> list[np.ndarray]:
    """``to_go[p][j]``: least ``time + multiplier * memory`` of positions after ``p``, given ``j`` at ``p``."""
    n = len(times)
    to_go = [np.zeros(len(t)) for t in times]
    for p in range(n - 2, -1, -1):
        ahead = times[p + 1] + multiplier * memories[p + 1] + to_go[p + 1]
        if links[p + 1] is None:
            to_go[p] = np.full(len(times[p]), ahead.min())
        else:
            to_go[p] = (links[p + 1] + ahead[None, :]).min(axis=1)
    return to_go


def _in_node_order(order, choice, time, bound, proven) -> ChainSolution:
    decisions = [0] * len(order)
    for p, v in enumerate(order):
        decisions[v] = int(choice[p])
    return ChainSolution(decisions, float(time), float(bound), bool(proven))

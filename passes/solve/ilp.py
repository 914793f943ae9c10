"""The intra-op ILP (Alpa's formulation) on a shrunk problem, solved with CP-SAT.

Variables
    ``x[v][i]`` (bool): decision node ``v`` takes strategy ``i``;
    ``y[e][i, j]`` (bool): edge ``e = (a, b)`` sees ``a`` in ``i`` and ``b`` in ``j``.
    A strategy with infinite time, or whose memory alone exceeds the budget left after
    every other node takes its least memory (``allowed_by_memory``), gets no variable;
    neither does a pair with infinite resharding time.

Objective (``_add_objective``), in integer time units:
    minimise  sum_v sum_i T'[v][i] x[v][i] + sum_e sum_ij R'[e][i, j] y[e][i, j]
    where ``T' = T - min T`` and ``R' = R - min R`` (the minima are a constant) and
    every coefficient is rounded to ``unit = U / TIME_UNITS`` seconds, U being the
    shifted time of the incumbent (the best of the hints that fit, the least-memory
    plan and the chain-relaxation warm start) or, without one, the sum of the largest
    shifted terms. A coefficient above U is capped just above U: a plan using it
    cannot beat the incumbent, so the optimum is kept.
    Each rounded term is off by at most unit / 2, so with N terms the true optimum is
    within ``N * unit`` seconds of what CP-SAT proves optimal; the reported lower
    bound subtracts ``N * unit / 2`` to stay a bound in seconds.

Constraints
    one strategy per node (``_add_node_choices``):    sum_i x[v][i] = 1
    edge marginals (``_add_edge_products``):          sum_j y[e][i, j] = x[a][i],
                                                      sum_i y[e][i, j] = x[b][j]
        (the tight linearisation of y = x[a][i] * x[b][j]; its LP relaxation is the
        local marginal polytope, much stronger than y >= x_a + x_b - 1)
    memory knapsack (``_add_memory_limit``):         sum_v sum_i M'[v][i] x[v][i]
                                                      + sum_e sum_ij H'[e][i, j] y[e][i, j] <= B'
        with ``M' = M - min M``, ``H' = H - min H`` (the memory edges hold, where they
        hold any), ``B' = budget - sum_v min M - sum_e min H``, coefficients rounded
        up and the capacity down to ``B' / MEMORY_UNITS`` bytes, so every plan the ILP
        accepts fits in floats; a plan within ``N * B' / MEMORY_UNITS`` bytes of the
        limit may be rejected.

Search: 2 workers plus the ``max_lp`` subsolver (measured with ``python -m benchmarks.solve_scale``: it proves
chain optima that the default portfolio does not), presolve without probing (``PROBING_LEVEL``), and the
incumbent as a CP-SAT solution hint (``_add_hint``). The search is deterministic: the
same problem gives the same answer, whatever the machine's load: a fixed seed,
interleaved search (CP-SAT runs its subsolvers in fixed batches, the same result for any
number of workers) and a budget in CP-SAT's deterministic time (``budget_s``: work
counted, not seconds). The wall clock is only a safety net (``wall_limit_s``); when it
cuts the search, ``IlpSolution.clock_cut`` says so. ``solve_ilp`` is the one entry point;
it calls each builder above once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from autopar.passes.solve.problem import MEMORY_RELATIVE_TOLERANCE
from autopar.passes.solve.shrink import ShrunkProblem

TIME_UNITS = 10**9  # integer units for the incumbent's shifted time
# CP-SAT's presolve probing (default level 2) fixes little here (712 of 50k booleans on
# Llama-70B) and took more than half of the solve: Llama-70B on 8x8 (74 decisions),
# 3 intra-op problems, proven optimal in 3-6 s instead of 11-16 s; benchmarks/solve_scale.py at 20 s: chain 500 ILP 1.7 s
# instead of 10.3 s, dag 500 proven optimal instead of a 0.08% gap, dag 2000 gap 11.7%
# instead of 21.4%, transformer tied 0.17 s instead of 0.87 s (2 cores, loaded, load 4-6).
PROBING_LEVEL = 0
MEMORY_UNITS = 10**9  # integer units for the shifted memory budget
SEED = 0  # CP-SAT's random seed: the same problem, the same search


@dataclass
class IlpSolution:
    decisions: list[int] | None  # per shrunk node; None when CP-SAT found no plan
    bound: float  # lower bound (seconds) on the shrunk objective without constants
    status: str  # CP-SAT status name: OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN
    time_resolution: float  # seconds per objective unit
    num_rounded_terms: int
    clock_cut: bool = False  # the wall-clock safety net stopped the search before its budget


@dataclass
class _Model:
    cp: cp_model.CpModel
    choice: list[dict[int, cp_model.IntVar]]  # node -> {strategy: x}
    pairs: dict[tuple[int, int], dict[tuple[int, int], cp_model.IntVar]]  # edge -> {(i, j): y}


def solve_ilp(
    shrunk: ShrunkProblem,
    *,
    budget_s: float,
    wall_limit_s: float = math.inf,
    num_workers: int = 2,
    relative_gap_limit: float = 0.0,
    hint: list[int] | None = None,
    incumbent: float = math.inf,
) -> IlpSolution:
    """Best decisions CP-SAT finds within ``budget_s`` deterministic seconds, or (safety net)
    ``wall_limit_s`` wall seconds, building included; ``incumbent`` excludes constants."""
    started = time.perf_counter()
    node_offset = [float(t[np.isfinite(t)].min()) for t in shrunk.node_time]
    edge_offset = {e: _finite_min(r) for e, r in shrunk.edges.items()}
    constant = sum(node_offset) + sum(edge_offset.values())
    model = _Model(cp_model.CpModel(), [], {})
    _add_node_choices(model, shrunk, allowed_by_memory(shrunk))
    _add_edge_products(model, shrunk)
    _add_memory_limit(model, shrunk)
    unit, num_terms = _add_objective(model, shrunk, node_offset, edge_offset, incumbent - constant)
    if hint is not None:
        _add_hint(model, hint)

    solver = cp_model.CpSolver()
    wall_left = max(0.01, wall_limit_s - (time.perf_counter() - started))
    solver.parameters.max_time_in_seconds = wall_left
    solver.parameters.max_deterministic_time = float(budget_s)
    solver.parameters.random_seed = SEED
    solver.parameters.interleave_search = True
    solver.parameters.num_workers = int(num_workers)
    solver.parameters.extra_subsolvers.append("max_lp")
    solver.parameters.cp_model_probing_level = PROBING_LEVEL
    solver.parameters.relative_gap_limit = float(relative_gap_limit)
    status = solver.solve(model.cp)
    name = solver.status_name(status)
    slack = 0.5 * num_terms * unit
    # stopped short of its deterministic budget without finishing: the wall clock stopped it
    cut = status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE) and solver.deterministic_time < 0.99 * budget_s
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        decisions = [next(i for i, x in xs.items() if solver.boolean_value(x)) for xs in model.choice]
        bound = constant + unit * solver.best_objective_bound - slack
        return IlpSolution(decisions, bound, name, unit, num_terms, cut)
    if status == cp_model.INFEASIBLE:
        return IlpSolution(None, math.inf, name, unit, num_terms)
    return IlpSolution(None, -math.inf, name, unit, num_terms, cut)


def count_variables(shrunk: ShrunkProblem) -> int:
    """Booleans the ILP would create (before the memory filter): a size check before building."""
    nodes = sum(int(np.isfinite(t).sum()) for t in shrunk.node_time)
    return nodes + sum(int(np.isfinite(r).sum()) for r in shrunk.edges.values())


def _add_node_choices(model: _Model, shrunk: ShrunkProblem, allowed_memory: list[np.ndarray]) -> None:
    for v, times in enumerate(shrunk.node_time):
        allowed = np.isfinite(times) & allowed_memory[v]
        xs = {int(i): model.cp.new_bool_var("") for i in np.flatnonzero(allowed)}
        model.cp.add_exactly_one(xs.values())
        model.choice.append(xs)


def _add_edge_products(model: _Model, shrunk: ShrunkProblem) -> None:
    for (a, b), cost in shrunk.edges.items():
        xa, xb = model.choice[a], model.choice[b]
        rows, cols = list(xa), list(xb)
        allowed = np.isfinite(cost[np.ix_(rows, cols)])
        ys = {(rows[r], cols[c]): model.cp.new_bool_var("") for r, c in zip(*np.nonzero(allowed))}
        by_row: dict[int, list] = {i: [] for i in rows}
        by_col: dict[int, list] = {j: [] for j in cols}
        for (i, j), y in ys.items():
            by_row[i].append(y)
            by_col[j].append(y)
        for i, x in xa.items():
            model.cp.add(cp_model.LinearExpr.sum(by_row[i]) == x)
        for j, x in xb.items():
            model.cp.add(cp_model.LinearExpr.sum(by_col[j]) == x)
        model.pairs[(a, b)] = ys


def _add_memory_limit(model: _Model, shrunk: ShrunkProblem) -> None:
    budget, shifted = _shifted_memory(shrunk)
    held = {e: m - m.min() for e, m in shrunk.edge_memory.items()}
    if budget is None or (budget <= 0 and not held):
        return  # no limit, or only zero-cost (least-memory) strategies are allowed
    if sum(float(m.max()) for m in shifted) + sum(float(m.max()) for m in held.values()) <= budget:
        return  # every plan fits
    terms = [(x, float(memory[i])) for xs, memory in zip(model.choice, shifted) for i, x in xs.items()]
    terms += [(y, float(memory[ij])) for e, memory in held.items() for ij, y in model.pairs[e].items()]
    if budget <= 0:  # only the least-memory pairs of the edges that hold memory
        model.cp.add(cp_model.LinearExpr.sum([x for x, m in terms if m > 0]) == 0)
        return
    unit = budget / MEMORY_UNITS
    variables, coefficients = [], []
    for x, memory in terms:
        coefficient = math.ceil(memory / unit - 1e-6)  # round up: never admit a misfit
        if coefficient > 0:
            variables.append(x)
            coefficients.append(coefficient)
    model.cp.add(cp_model.LinearExpr.weighted_sum(variables, coefficients) <= MEMORY_UNITS)


def allowed_by_memory(shrunk: ShrunkProblem) -> list[np.ndarray]:
    """Strategies whose memory alone (over the least of every other node and edge) fits."""
    budget, shifted = _shifted_memory(shrunk)
    if budget is None:
        return [np.ones(len(m), dtype=bool) for m in shifted]
    cap = budget + MEMORY_RELATIVE_TOLERANCE * abs(shrunk.memory_budget or 0.0)
    return [m <= cap for m in shifted]


def _shifted_memory(shrunk: ShrunkProblem) -> tuple[float | None, list[np.ndarray]]:
    shifted = [m - m.min() for m in shrunk.node_memory]
    if shrunk.memory_budget is None:
        return None, shifted
    least = sum(float(m.min()) for m in shrunk.node_memory) + sum(float(m.min()) for m in shrunk.edge_memory.values())
    return shrunk.memory_budget - least, shifted


def _add_objective(model: _Model, shrunk: ShrunkProblem, node_offset, edge_offset, incumbent_shifted: float):
    """Sets the objective; returns (seconds per unit, number of rounded terms)."""
    shifted_nodes = [t - o for t, o in zip(shrunk.node_time, node_offset)]
    shifted_edges = {e: r - edge_offset[e] for e, r in shrunk.edges.items()}
    largest = sum(_finite_max(t) for t in shifted_nodes) + sum(_finite_max(r) for r in shifted_edges.values())
    reference = incumbent_shifted if 0 < incumbent_shifted < largest else largest
    num_terms = len(shifted_nodes) + len(shifted_edges)
    if reference <= 0:
        return 0.0, num_terms  # every plan costs the constant: nothing to minimise
    unit = reference / TIME_UNITS
    cap = TIME_UNITS + num_terms + 1  # above any plan that could beat the incumbent

    def units(seconds: np.ndarray) -> np.ndarray:
        finite = np.where(np.isfinite(seconds), seconds, 0.0)  # inf entries have no variable
        return np.minimum(np.rint(finite / unit), cap).astype(np.int64)

    variables, coefficients = [], []
    for xs, times in zip(model.choice, shifted_nodes):
        table = units(times)
        for i, x in xs.items():
            variables.append(x)
            coefficients.append(int(table[i]))
    for e, ys in model.pairs.items():
        table = units(shifted_edges[e])
        for (i, j), y in ys.items():
            variables.append(y)
            coefficients.append(int(table[i, j]))
    model.cp.minimize(cp_model.LinearExpr.weighted_sum(variables, coefficients))
    return unit, num_terms


def _add_hint(model: _Model, hint: list[int]) -> None:
    for xs, chosen in zip(model.choice, hint):
        for i, x in xs.items():
            model.cp.add_hint(x, i == chosen)
    for (a, b), ys in model.pairs.items():
        for (i, j), y in ys.items():
            model.cp.add_hint(y, i == hint[a] and j == hint[b])


def _finite_min(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.min()) if finite.size else 0.0


def _finite_max(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.max()) if finite.size else 0.0

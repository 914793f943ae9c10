"""``solve``: the intra-op planner's entry point, numbers in and a plan out.

Steps: shrink the problem (``shrink.py``); evaluate the hints and the two
least-memory plans on the full problem; stop early when nothing fits; run the exact
chain DP when the shrunk graph is a chain (``chain_dp.py``); otherwise eliminate the
nodes one by one, the memory limit by a price on memory (``elimination.py``), which is exact when the graph is
narrow enough and its plan fits within the gap limit; and otherwise the CP-SAT ILP
(``ilp.py``), warm-started from the best of the hints and a chain-relaxation plan
(``heuristics.py``), bounded below by the elimination's bound where it ran; expand the decisions back to every original node; and return
whichever of the solver's plan and the candidates is fastest among those that fit, so
the result is never worse than the best hint that fits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from autopar.passes.solve.chain_dp import WORK_PER_SECOND, chain_order, solve_chain
from autopar.passes.solve.elimination import lagrangian
from autopar.passes.solve.heuristics import least_edge_memory, chain_relaxation_plan
from autopar.passes.solve.ilp import allowed_by_memory, count_variables, solve_ilp
from autopar.passes.solve.problem import (ROUNDING, SolveProblem, SolveResult, evaluate_memory, evaluate_time,
                                           fits_memory)
from autopar.passes.solve.shrink import ShrunkProblem, shrink_problem

METHODS = ("auto", "ilp", "chain_dp")
BROKEN_RESTRICTIONS = "ties and followers leave no plan within memory_limit; a plan that breaks them fits"


# The wall clock is a safety net only: it stops a search at this many times its budget in
# seconds. A loaded machine runs the deterministic budget more slowly than planned: at load
# 13-25 on 2 cores (measured) a process gets a sixth to a tenth of a core, so its budget takes
# up to ten times the wall clock it takes idle; at 1 x the clock, not the budget, ended most
# solves there and the same call gave other plans. The planner's own net
# (``planner.search.SafetyNet``, on CPU seconds) bounds the whole search.
WALL_CLOCK_FACTOR = 30.0
# CP-SAT deterministic seconds granted per second of budget. Measured here: 0.15
# deterministic s in 3.8 s of wall clock and 1.3 in 21 s on 2 loaded cores (a WideMLP on
# 2 x 8, 23 decisions), and 0.64 in 5.0 s on idle ones (Llama-70B's intra-op problem of a
# PP2 x 4 x 8 plan, 74 decisions), about 0.13 per second. At 0.05 the budget ends, on an
# idle machine, well before the wall clock (which gets the whole second, less the warm
# start's share): there the plan is the same from call to call. At 0.1 the clock stopped
# that Llama solve first and the same call gave three different plans in three calls.
DETERMINISTIC_PER_SECOND = 0.05


@dataclass(kw_only=True)
class SolveOptions:
    # The search budget, deterministic: CP-SAT's deterministic seconds
    # (``DETERMINISTIC_PER_SECOND`` per second), and the chain DP's work
    # (``chain_dp.WORK_PER_SECOND`` per second). The same problem and budget give the
    # same plan; a wall clock of ``WALL_CLOCK_FACTOR`` times it stops a search that overruns
    # (then ``SolveResult.notes`` and ``clock_cut`` say so).
    time_limit_s: float = 60.0
    num_workers: int = 2
    relative_gap_limit: float = 1e-4  # CP-SAT stops once proven this close
    method: str = "auto"  # "auto": chain DP on chains, else elimination where narrow and it fits, else ILP
    max_labels: int = 20000  # Pareto labels per DP state before thinning (then not proven)
    # Above this many booleans CP-SAT finds nothing useful in a minute (8000 x 8 DAG:
    # 746k booleans, 20 s to build, no solution): return the warm-start plan instead.
    max_ilp_variables: int = 300_000

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"autopar: SolveOptions.method expected one of {METHODS}, found {self.method!r}.")
        if self.time_limit_s <= 0 or self.num_workers < 1:
            raise ValueError(
                f"autopar: SolveOptions expected time_limit_s > 0 and num_workers >= 1, "
                f"found {self.time_limit_s} and {self.num_workers}."
            )


@dataclass
class _Candidate:
    label: str
    assignment: list[int]
    time: float
    memory: float


def solve(problem: SolveProblem, options: SolveOptions | None = None, *,
          shrunk: ShrunkProblem | None = None) -> SolveResult:
    """Fastest plan that fits in ``problem.memory_limit``; see ``SolveResult`` for the verdict.
    ``shrunk``: ``shrink_problem(problem)`` when the caller has it (hints may differ)."""
    options = options or SolveOptions()
    started = time.perf_counter()
    shrunk = shrunk if shrunk is not None else shrink_problem(problem)
    restricted_least, smallest = _least_memory_plans(problem, shrunk)
    restricted_fits = fits_memory(restricted_least.memory, problem.memory_limit)
    # where edges hold memory the least-memory plan is not exact: a bound that fits leaves it to the search
    may_fit = restricted_fits or fits_memory(_least_memory_bound(shrunk), problem.memory_limit)
    # The unrestricted least-memory plan breaks ties or followers: a candidate only
    # when nothing that keeps them fits.
    candidates = [_candidate(problem, f"hint {h}", list(hint)) for h, hint in enumerate(problem.hints)]
    if restricted_fits or not may_fit:  # else the search decides whether a plan that keeps them fits
        candidates.append(restricted_least if restricted_fits else smallest)
    # a plan of infinite time takes a forbidden (inf) strategy or edge: never a plan
    fitting = [c for c in candidates if fits_memory(c.memory, problem.memory_limit) and math.isfinite(c.time)]
    best = min(fitting, key=lambda c: c.time, default=None)

    def finish(status, plan, bound, method, resolution=0.0, notes=(), clock_cut=False) -> SolveResult:
        objective = plan.time if plan else math.inf
        gap = _gap(objective, bound)
        return SolveResult(
            status=status, assignment=plan.assignment if plan else None, objective=objective,
            memory=plan.memory if plan else math.nan, bound=bound, gap=gap, method=method,
            solve_seconds=time.perf_counter() - started, num_decision_nodes=shrunk.num_nodes,
            min_memory=smallest.memory, min_memory_assignment=smallest.assignment,
            time_resolution=resolution, notes=list(notes), clock_cut=clock_cut,
        )

    if not may_fit:
        if best is None:
            return finish("infeasible", None, math.inf, "min_memory")
        note = BROKEN_RESTRICTIONS
        return finish("feasible", best, math.inf, best.label, notes=[note])
    if shrunk.num_nodes == 0:
        return finish("optimal", _candidate(problem, "trivial", shrunk.expand([])), shrunk.constant_time, "trivial")

    incumbent = best.time - shrunk.constant_time if best else math.inf
    order = chain_order(shrunk) if options.method in ("auto", "chain_dp") else None
    if options.method == "chain_dp" and order is None:
        raise ValueError(
            "autopar: SolveOptions.method='chain_dp' expected a chain (every decision node with at most "
            "two neighbours and no cycle, no edge that holds memory), found a general graph; use "
            "method='auto' or 'ilp'."
        )
    deadline = started + WALL_CLOCK_FACTOR * options.time_limit_s
    eliminated = _run_elimination(problem, shrunk, options) if order is None and options.method == "auto" else None
    if order is not None:
        outcome = _run_chain_dp(shrunk, order, incumbent, options, deadline=deadline)
    elif eliminated is not None and eliminated.proven:
        outcome = eliminated
    else:
        outcome = _run_ilp(problem, shrunk, best, options, deadline=deadline)
        warm = outcome.warm_start
        best = warm if warm is not None and math.isfinite(warm.time) else best
        if eliminated is not None:  # the relaxation's bound holds for every plan that fits
            outcome.bound = max(outcome.bound, eliminated.bound)
            outcome.notes.extend(eliminated.notes)
    bound = outcome.bound + shrunk.constant_time
    notes = outcome.notes
    if outcome.clock_cut:
        notes.append(f"the wall clock ({WALL_CLOCK_FACTOR:g} x the {options.time_limit_s:g} s budget) cut the "
                     f"{outcome.method} search: this plan may differ from call to call; give a larger time limit")
    status = "optimal" if outcome.proven else "feasible"

    found = _candidate(problem, outcome.method, shrunk.expand(outcome.decisions)) if outcome.decisions else None
    if found is not None and not fits_memory(found.memory, problem.memory_limit):
        notes.append(f"{outcome.method} returned a plan of {found.memory:.6g} bytes over the limit; discarded")
        found = None
    if found is not None and not math.isfinite(found.time):
        found = None  # every plan the search saw takes a forbidden strategy or edge
    if found is None and best is None:  # the least-memory bound fitted, no plan that keeps ties and followers does
        if fits_memory(smallest.memory, problem.memory_limit) and math.isfinite(smallest.time):
            return finish("feasible", smallest, math.inf, smallest.label, notes=[*notes, BROKEN_RESTRICTIONS])
        return finish("infeasible", None, math.inf, outcome.method, outcome.resolution, notes, outcome.clock_cut)
    if found is None or (best is not None and best.time < found.time):
        if found is None and outcome.ran:
            notes.append(f"{outcome.method} found no plan better than the best candidate ({best.label}) in time")
        # A proven optimum of the shrunk problem that a candidate beats leaves the candidate optimal.
        return finish(status, best, bound, best.label, outcome.resolution, notes, outcome.clock_cut)
    return finish(status, found, bound, outcome.method, outcome.resolution, notes, outcome.clock_cut)


@dataclass
class _Outcome:
    method: str
    decisions: list[int] | None  # per shrunk node
    proven: bool
    bound: float  # without the shrunk constant
    resolution: float = 0.0
    ran: bool = True
    warm_start: _Candidate | None = None  # a better candidate found on the way
    notes: list[str] = field(default_factory=list)
    clock_cut: bool = False  # the wall-clock safety net stopped it


def _run_chain_dp(shrunk: ShrunkProblem, order, incumbent: float, options: SolveOptions, deadline: float) -> _Outcome:
    chain = solve_chain(shrunk, order, incumbent, options.max_labels, deadline=deadline,
                        work_budget=options.time_limit_s * WORK_PER_SECOND)
    return _Outcome("chain_dp", chain.decisions or None, chain.proven_optimal, chain.bound, clock_cut=chain.clock_cut)


def _run_elimination(problem: SolveProblem, shrunk: ShrunkProblem, options: SolveOptions) -> _Outcome | None:
    """Variable elimination, the memory limit kept by Lagrangian relaxation, over the strategies
    that may fit: proven when its plan fits within the gap limit of its bound; else only its
    bound is kept beside the ILP's, and the ILP searches from the candidates as before (its
    plans, faster by the model where memory binds, would change plans whose memory the
    dry-run checks were set against); None when the graph is too wide."""
    allowed = [np.isfinite(t) & fits for t, fits in zip(shrunk.node_time, allowed_by_memory(shrunk))]
    relaxed = lagrangian(shrunk, allowed, relative_gap=options.relative_gap_limit)
    if relaxed is None:
        return None
    found = None if relaxed.decisions is None else _candidate(problem, "elimination", shrunk.expand(relaxed.decisions))
    if found is not None and not (fits_memory(found.memory, problem.memory_limit) and math.isfinite(found.time)):
        found = None
    proven = found is not None and relaxed.objective - relaxed.bound <= options.relative_gap_limit * abs(relaxed.objective)
    if proven:
        return _Outcome("elimination", relaxed.decisions, True, relaxed.bound)
    where = f"its best plan {found.time:.6g} s" if found else "no plan that fits"
    note = (f"elimination with a Lagrangian memory price ({relaxed.rounds} rounds): {where}, "
            f"bound {relaxed.bound + shrunk.constant_time:.6g} s")
    return _Outcome("elimination", None, False, relaxed.bound, notes=[note])


def _run_ilp(problem: SolveProblem, shrunk: ShrunkProblem, best: _Candidate | None, options: SolveOptions,
             deadline: float) -> _Outcome:
    """CP-SAT warm-started from the better of ``best`` and the chain-relaxation plan."""
    notes = []
    warm, relaxation_bound = chain_relaxation_plan(shrunk)
    better = None
    if warm is not None:
        heuristic = _candidate(problem, "heuristic", shrunk.expand(warm))
        notes.append(f"warm start: chain-relaxation plan of {heuristic.time:.6g} s")
        if fits_memory(heuristic.memory, problem.memory_limit) and (best is None or heuristic.time < best.time):
            best = better = heuristic
    size = count_variables(shrunk)
    remaining = deadline - time.perf_counter()
    if size > options.max_ilp_variables or remaining <= 0:
        notes.append(f"ILP skipped: {size} booleans (max_ilp_variables={options.max_ilp_variables}), "
                     f"{max(remaining, 0):.1f} s left; coarsen the graph (ties, followers) to solve it")
        return _Outcome("ilp", None, False, relaxation_bound, ran=False, warm_start=better, notes=notes,
                        clock_cut=size <= options.max_ilp_variables)
    ilp = solve_ilp(
        shrunk, budget_s=options.time_limit_s * DETERMINISTIC_PER_SECOND, wall_limit_s=remaining, num_workers=options.num_workers,
        relative_gap_limit=options.relative_gap_limit, hint=None if best is None else shrunk.project(best.assignment),
        incumbent=math.inf if best is None else best.time - shrunk.constant_time,
    )
    return _Outcome("ilp", ilp.decisions, ilp.status == "OPTIMAL", max(ilp.bound, relaxation_bound),
                    ilp.time_resolution, warm_start=better, notes=notes, clock_cut=ilp.clock_cut)


def _least_memory_plans(problem: SolveProblem, shrunk: ShrunkProblem) -> list[_Candidate]:
    """Least-memory plan keeping ties and followers, then the one ignoring them.

    Memory is additive, so each is a per-node argmin (ties broken by time, forbidden
    strategies skipped); the second is the true minimum over all plans. Where edges hold
    memory, each node counts the least its edges hold given it (``least_edge_memory``):
    then neither is exact (``_least_memory_bound`` is the bound).
    """
    def argmin_memory(times: np.ndarray, memories: np.ndarray) -> int:
        penalised = np.where(np.isfinite(times), memories, np.inf)
        lowest = np.flatnonzero(penalised == penalised.min())
        return int(lowest[np.argmin(times[lowest])])

    restricted = shrunk.expand([argmin_memory(t, m) for t, m in zip(shrunk.node_time, least_edge_memory(shrunk))])
    free_memory = list(problem.node_memory)
    for e, held in problem.edge_memory.items():
        free_memory[problem.edges[e][0]] = free_memory[problem.edges[e][0]] + held.min(axis=1)
    free = [argmin_memory(t, m) for t, m in zip(problem.node_time, free_memory)]
    return [_candidate(problem, "min_memory", restricted), _candidate(problem, "min_memory_unrestricted", free)]


def _least_memory_bound(shrunk: ShrunkProblem) -> float:
    """No plan that keeps ties and followers needs fewer bytes: each decision's least with the
    least its edges hold given it."""
    return shrunk.constant_memory + sum(float(m[np.isfinite(t)].min())
                                        for t, m in zip(shrunk.node_time, least_edge_memory(shrunk)))


def _candidate(problem: SolveProblem, label: str, assignment: list[int]) -> _Candidate:
    return _Candidate(label, assignment, evaluate_time(problem, assignment), evaluate_memory(problem, assignment))


def _gap(objective: float, bound: float) -> float:
    if not math.isfinite(objective):
        return math.inf
    if not math.isfinite(bound):
        return math.inf  # no bound known (or the restricted problem has no plan)
    gap = (objective - bound) / max(abs(objective), 1e-300)
    return 0.0 if gap < ROUNDING else gap  # an exact bound summed in another order differs in its last bits

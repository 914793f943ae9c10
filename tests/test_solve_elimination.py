"""Variable elimination: exact against brute force, used by ``solve`` where its plan fits,
a lower bound where it does not, and refused on graphs too wide for its tables."""

import itertools

import numpy as np
import pytest

from autopar.passes.solve import SolveOptions, SolveProblem, evaluate_memory, evaluate_time, fits_memory, solve
from autopar.passes.solve.elimination import eliminate, elimination_order, lagrangian
from autopar.passes.solve.ilp import allowed_by_memory
from autopar.passes.solve.shrink import shrink_problem

EXACT = dict(relative_gap_limit=0.0, time_limit_s=20.0)


def _graph(rng, n: int, k: int, density: float, limit: float | None = None, inf: bool = False,
           reach: int | None = None) -> SolveProblem:
    """A path with random extra edges up to ``reach`` nodes ahead (cycles: not a chain), as
    residual connections make them; ``k`` strategies per node."""
    times = [rng.uniform(0, 1, size=k) for _ in range(n)]
    memories = [rng.uniform(0, 1, size=k) for _ in range(n)]
    if inf:
        for t in times[::3]:
            t[rng.integers(k)] = np.inf
    pairs = [(v, v + 1) for v in range(n - 1)]
    pairs += [(u, v) for u in range(n) for v in range(u + 2, min(n, u + (reach or n))) if rng.random() < density]
    edges = []
    for u, v in pairs:
        cost = rng.uniform(0, 1, size=(k, k))
        if inf:
            cost[rng.integers(k), rng.integers(k)] = np.inf
        edges.append((u, v, cost))
    return SolveProblem(times, memories, edges, memory_limit=limit)


def _brute_force(problem: SolveProblem) -> float:
    """The least time of the plans that fit the problem's limit (inf: none)."""
    best = np.inf
    for choice in itertools.product(*[range(k) for k in problem.num_strategies]):
        if fits_memory(evaluate_memory(problem, choice), problem.memory_limit):
            best = min(best, evaluate_time(problem, choice))
    return best


def _limited(problem: SolveProblem, fraction: float, edge_memory: bool = False, seed: int = 0) -> SolveProblem:
    """``problem`` with a limit ``fraction`` of the way from its least to its most memory, and
    (``edge_memory``) memory on every other edge."""
    rng = np.random.default_rng(seed)
    held = {e: rng.uniform(0, 0.5, size=cost.shape) for e, (_, _, cost) in enumerate(problem.edges) if e % 2 == 0
            } if edge_memory else {}
    least = sum(m.min() for m in problem.node_memory) + sum(h.min() for h in held.values())
    most = sum(m.max() for m in problem.node_memory) + sum(h.max() for h in held.values())
    return SolveProblem(problem.node_time, problem.node_memory, problem.edges,
                        memory_limit=float(least + fraction * (most - least)), edge_memory=held)


@pytest.mark.parametrize("seed", range(8))
def test_elimination_reaches_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    problem = _graph(rng, n=7, k=3, density=0.4, inf=seed % 2 == 1)
    shrunk = shrink_problem(problem)
    found = eliminate(shrunk, [np.ones(len(t), dtype=bool) for t in shrunk.node_time])
    assert found is not None
    plan = shrunk.expand(found.decisions)
    assert found.objective + shrunk.constant_time == pytest.approx(_brute_force(problem), rel=1e-12)
    assert evaluate_time(problem, plan) == pytest.approx(found.objective + shrunk.constant_time, rel=1e-12)


def test_elimination_takes_only_allowed_strategies():
    rng = np.random.default_rng(3)
    problem = _graph(rng, n=6, k=4, density=0.5)
    shrunk = shrink_problem(problem)
    free = eliminate(shrunk, [np.ones(len(t), dtype=bool) for t in shrunk.node_time])
    allowed = [np.ones(len(t), dtype=bool) for t in shrunk.node_time]
    allowed[0][free.decisions[0]] = False  # forbid the free optimum's choice at node 0
    found = eliminate(shrunk, allowed)
    assert found.decisions[0] != free.decisions[0] and found.objective >= free.objective
    times = [t.copy() for t in problem.node_time]
    times[0][free.decisions[0]] = np.inf
    narrowed = SolveProblem(times, problem.node_memory, problem.edges)
    assert found.objective + shrunk.constant_time == pytest.approx(_brute_force(narrowed), rel=1e-12)


def test_a_graph_too_wide_for_the_tables_is_refused():
    problem = _graph(np.random.default_rng(0), n=12, k=6, density=1.0)  # a clique: one table of 6^12
    shrunk = shrink_problem(problem)
    sizes = [len(t) for t in shrunk.node_time]
    assert elimination_order(shrunk, sizes, max_entries=10**6) is None
    assert eliminate(shrunk, [np.ones(k, dtype=bool) for k in sizes], max_entries=10**6) is None
    assert elimination_order(shrunk, sizes, max_entries=6**12, max_work=7**12) is not None
    assert elimination_order(shrunk, sizes, max_entries=6**12, max_work=6**12 - 1) is None  # all the tables together


def test_solve_proves_the_optimum_by_elimination_where_no_limit_binds():
    problem = _graph(np.random.default_rng(5), n=40, k=6, density=0.3, reach=4)
    auto = solve(problem, SolveOptions(time_limit_s=20))
    ilp = solve(problem, SolveOptions(method="ilp", relative_gap_limit=0.0, time_limit_s=20))
    assert auto.method == "elimination" and auto.status == "optimal" and auto.gap == 0.0
    assert auto.objective <= ilp.objective * (1 + 1e-9) and auto.objective == pytest.approx(ilp.objective, rel=1e-6)
    assert auto.bound == pytest.approx(auto.objective, rel=1e-12)


def test_a_binding_limit_leaves_the_plan_to_the_ilp_and_the_elimination_bounds_it():
    rng = np.random.default_rng(9)
    free = _graph(rng, n=30, k=5, density=0.3, reach=4)
    unlimited = solve(free, SolveOptions(time_limit_s=20))
    # the limit just below what the free optimum needs: it no longer fits, others do
    limit = 0.97 * unlimited.memory
    problem = SolveProblem(free.node_time, free.node_memory, free.edges, memory_limit=limit)
    limited = solve(problem, SolveOptions(time_limit_s=20))
    assert limited.method != "elimination" and limited.memory <= limit * (1 + 1e-9)
    assert any(n.startswith("elimination with a Lagrangian memory price") for n in limited.notes), limited.notes
    assert limited.bound >= unlimited.objective - 1e-9  # the optimum without the limit bounds every plan with it
    assert limited.objective >= unlimited.objective


@pytest.mark.parametrize("seed", range(8))
def test_the_lagrangian_plan_fits_and_its_bound_holds(seed):
    rng = np.random.default_rng(100 + seed)
    problem = _limited(_graph(rng, n=7, k=3, density=0.4, inf=seed % 2 == 1), fraction=0.2 + 0.05 * seed,
                       edge_memory=seed % 3 == 0, seed=seed)
    shrunk = shrink_problem(problem)
    allowed = [np.isfinite(t) & fits for t, fits in zip(shrunk.node_time, allowed_by_memory(shrunk))]
    relaxed = lagrangian(shrunk, allowed)
    optimum = _brute_force(problem)
    assert relaxed.bound + shrunk.constant_time <= optimum + 1e-9
    if not np.isfinite(optimum):
        assert relaxed.decisions is None
        return
    plan = shrunk.expand(relaxed.decisions)
    assert fits_memory(evaluate_memory(problem, plan), problem.memory_limit)
    assert evaluate_time(problem, plan) == pytest.approx(relaxed.objective + shrunk.constant_time, rel=1e-12)
    assert evaluate_time(problem, plan) >= optimum - 1e-9
    result = solve(problem, SolveOptions(**EXACT))  # exact however the relaxation ended
    assert result.objective == pytest.approx(optimum, rel=1e-9)


def test_a_closed_relaxation_proves_the_optimum_without_the_ilp():
    # three nodes in a triangle, each fast (1 s, 2 bytes) or slow (2 s, 1 byte), the edges a
    # little dearer where the ends agree: the plans' (memory, time) lie on a convex curve, so
    # a price on memory reaches the best plan with at most one fast node (4 bytes)
    agree = np.array([[0.01, 0.0], [0.0, 0.01]])
    problem = SolveProblem([np.array([1.0, 2.0])] * 3, [np.array([2.0, 1.0])] * 3,
                           [(0, 1, agree), (1, 2, agree), (0, 2, agree)], memory_limit=4.0)
    result = solve(problem, SolveOptions(**EXACT))
    assert result.method == "elimination" and result.status == "optimal" and result.gap == 0.0
    assert result.objective == pytest.approx(_brute_force(problem)) == pytest.approx(5.01)
    assert solve(problem, SolveOptions(method="ilp", **EXACT)).objective == pytest.approx(result.objective)


def test_of_plans_alike_in_time_the_one_holding_fewer_bytes_is_taken():
    # node 0 holds a value whole (strategy 0, 8 bytes) or split (1 byte); beside its readers'
    # best choices (strategy 0 each) both cost nothing, elsewhere they differ: elimination's
    # first index would hold it whole
    problem = SolveProblem([np.array([0.0, 0.0]), np.array([1.0, 1.0]), np.array([1.0, 2.0])],
                           [np.array([8.0, 1.0]), np.array([1.0, 1.0]), np.array([1.0, 1.0])],
                           [(0, 1, np.array([[0.0, 2.0], [0.0, 0.0]])), (1, 2, np.array([[0.0, 1.0], [1.0, 0.0]])),
                            (0, 2, np.array([[0.0, 3.0], [0.0, 0.0]]))])
    result = solve(problem, SolveOptions(**EXACT))
    assert result.method == "elimination" and result.objective == pytest.approx(_brute_force(problem)) == 2.0
    assert result.assignment == [1, 0, 0] and result.memory == pytest.approx(3.0)

"""The intra-op solver against brute-force enumeration on small random graphs.

Costs are made up (DESIGN.md, invariant 3). Brute force enumerates every assignment
(at most 4^8) and keeps those that respect ties and followers and fit in memory.
"""

import itertools

import numpy as np
import pytest

from autopar.passes.solve import (
    Follower, SolveOptions, SolveProblem, evaluate_time, plan_costs, respects_restrictions, solve,
)
from autopar.passes.solve.problem import MEMORY_RELATIVE_TOLERANCE
from autopar.passes.solve.shrink import shrink_problem

EXACT = dict(relative_gap_limit=0.0, time_limit_s=20.0)


def brute_force(problem: SolveProblem, restricted: bool = True) -> tuple[float, list[int] | None]:
    """Least time over all assignments that fit (and keep ties/followers if ``restricted``)."""
    grid = np.array(list(itertools.product(*[range(k) for k in problem.num_strategies])), dtype=np.int64)
    time = sum(problem.node_time[v][grid[:, v]] for v in range(problem.num_nodes))
    memory = sum(problem.node_memory[v][grid[:, v]] for v in range(problem.num_nodes))
    for u, v, cost in problem.edges:
        time = time + cost[grid[:, u], grid[:, v]]
    ok = np.isfinite(time)
    if problem.memory_limit is not None:
        ok &= memory <= problem.memory_limit + MEMORY_RELATIVE_TOLERANCE * abs(problem.memory_limit)
    if restricted:
        for group in problem.ties:
            ok &= (grid[:, group] == grid[:, group[:1]]).all(axis=1)
        for f in problem.followers:
            ok &= grid[:, f.node] == np.asarray(f.index_map)[grid[:, f.leader]]
    if not ok.any():
        return np.inf, None
    best = int(np.flatnonzero(ok)[np.argmin(time[ok])])
    return float(time[best]), grid[best].tolist()


def random_problem(rng, *, shape: str, with_memory: bool, with_restrictions: bool, with_inf: bool = False):
    n = int(rng.integers(2, 9))
    k = [int(rng.integers(1, 5)) for _ in range(n)]
    times = [rng.uniform(0, 1, size=kv) for kv in k]
    memories = [rng.uniform(0, 1, size=kv) for kv in k]
    if with_inf:
        for t in times:
            if len(t) > 1 and rng.random() < 0.3:
                t[rng.integers(len(t))] = np.inf
    if shape == "chain":
        pairs = [(v, v + 1) for v in range(n - 1)]
    else:
        pairs = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.45]
    edges = [(u, v, rng.uniform(0, 1, size=(k[u], k[v]))) for u, v in pairs]
    followers, ties = [], []
    if with_restrictions:
        for f in range(1, n):
            if rng.random() < 0.25:
                leader = int(rng.integers(0, f))
                followers.append(Follower(f, leader, tuple(int(i) for i in rng.integers(0, k[f], size=k[leader]))))
        free = [v for v in range(n) if v not in {f.node for f in followers}]
        by_size: dict[int, list[int]] = {}
        for v in free:
            by_size.setdefault(k[v], []).append(v)
        for group in by_size.values():
            if len(group) >= 2 and rng.random() < 0.6:
                size = int(rng.integers(2, len(group) + 1))
                ties.append([int(v) for v in rng.choice(group, size=size, replace=False)])
    limit = None
    if with_memory:
        least = sum(m.min() for m in memories)
        most = sum(m.max() for m in memories)
        limit = float(least + rng.uniform(0.05, 0.7) * (most - least))
    return SolveProblem(times, memories, edges, memory_limit=limit, ties=ties, followers=followers)


CASES = [
    (shape, memory, restrictions, seed)
    for shape in ("chain", "dag")
    for memory in (False, True)
    for restrictions in (False, True)
    for seed in range(6)
]


@pytest.mark.parametrize("shape,with_memory,with_restrictions,seed", CASES)
def test_solvers_match_brute_force(shape, with_memory, with_restrictions, seed):
    rng = np.random.default_rng(1000 * seed + 17)
    problem = random_problem(rng, shape=shape, with_memory=with_memory, with_restrictions=with_restrictions,
                             with_inf=seed % 2 == 1)
    expected, _ = brute_force(problem)
    methods = ["ilp", "auto"] + (["chain_dp"] if shape == "chain" and not with_restrictions else [])
    for method in methods:
        result = solve(problem, SolveOptions(method=method, **EXACT))
        if not np.isfinite(expected):  # nothing keeps the restrictions and fits
            if np.isfinite(brute_force(problem, restricted=False)[0]):
                assert result.status == "feasible" and result.memory <= problem.memory_limit * (1 + 1e-9)
            else:
                assert result.status == "infeasible" and result.assignment is None
            continue
        assert result.status == "optimal", (method, result)
        assert result.objective == pytest.approx(expected, rel=1e-6, abs=1e-9), method
        assert result.objective == pytest.approx(evaluate_time(problem, result.assignment), rel=1e-12)
        assert respects_restrictions(problem, result.assignment)
        assert result.bound <= result.objective + 1e-9
        if problem.memory_limit is not None:
            assert result.memory <= problem.memory_limit * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(10))
def test_shrunk_objective_equals_full_objective(seed):
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, shape="dag", with_memory=True, with_restrictions=True)
    shrunk = shrink_problem(problem)
    for _ in range(20):
        decisions = [int(rng.integers(len(t))) for t in shrunk.node_time]
        full = shrunk.expand(decisions)
        assert respects_restrictions(problem, full)
        time, memory = shrunk.evaluate(decisions)
        assert time == pytest.approx(evaluate_time(problem, full), rel=1e-12)
        assert shrunk.project(full) == decisions


@pytest.mark.parametrize("seed", range(5))
def test_added_time_folds_like_shrinking_again(seed):
    """Costs added to some nodes (inf forbidding strategies, as the planner's layouts do)
    give the shrunk problem that shrinking the changed problem gives."""
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, shape="dag", with_memory=True, with_restrictions=True)
    added = {}
    for v in rng.choice(problem.num_nodes, size=problem.num_nodes // 2, replace=False):
        extra = rng.uniform(0.0, 1.0, len(problem.node_time[v]))
        extra[rng.random(len(extra)) < 0.3] = np.inf
        extra[int(np.argmin(problem.node_time[v]))] = 0.0  # keep a choice open
        added[int(v)] = extra
    changed = SolveProblem([t + added.get(v, 0.0) for v, t in enumerate(problem.node_time)], problem.node_memory,
                           problem.edges, memory_limit=problem.memory_limit, ties=problem.ties,
                           followers=problem.followers)
    try:
        again = shrink_problem(changed)
    except ValueError:  # a tie or follower left with only forbidden choices: the same verdict
        with pytest.raises(ValueError, match="autopar:"):
            shrink_problem(problem).with_added_time(added)
        return
    folded = shrink_problem(problem).with_added_time(added)
    assert folded.constant_time == pytest.approx(again.constant_time, rel=1e-12)
    for a, b in zip(folded.node_time, again.node_time):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    assert np.array_equal(folded.node_class, again.node_class) and folded.edges.keys() == again.edges.keys()


def test_ties_and_followers_shrink_the_decisions():
    k = 3
    times = [np.arange(k, dtype=float) + v for v in range(6)]
    problem = SolveProblem(
        times, [np.ones(k)] * 6, [(v, v + 1, np.ones((k, k)) - np.eye(k)) for v in range(5)],
        ties=[[0, 2, 4]], followers=[Follower(1, 0, (0, 1, 2)), Follower(3, 2, (0, 1, 2)), Follower(5, 4, (2, 1, 0))],
    )
    assert shrink_problem(problem).num_nodes == 1
    result = solve(problem, SolveOptions(**EXACT))
    assert result.objective == pytest.approx(brute_force(problem)[0])


def test_tie_of_followers_is_accepted_when_implied_and_rejected_otherwise():
    k = 2
    times = [np.array([1.0, 2.0])] * 4
    memories = [np.zeros(k)] * 4
    implied = SolveProblem(times, memories, ties=[[0, 2], [1, 3]],
                           followers=[Follower(1, 0, (1, 0)), Follower(3, 2, (1, 0))])
    assert shrink_problem(implied).num_nodes == 1
    not_implied = SolveProblem(times, memories, ties=[[1, 3]],
                               followers=[Follower(1, 0, (1, 0)), Follower(3, 2, (1, 0))])
    with pytest.raises(ValueError, match="autopar: tie group"):
        shrink_problem(not_implied)


def test_follower_cycle_is_an_error():
    problem = SolveProblem([np.ones(2)] * 2, [np.ones(2)] * 2,
                           followers=[Follower(0, 1, (0, 1)), Follower(1, 0, (0, 1))])
    with pytest.raises(ValueError, match="autopar: followers form a cycle"):
        solve(problem)


def test_infeasible_memory_reports_the_least_memory_plan():
    rng = np.random.default_rng(3)
    memories = [rng.uniform(1, 2, size=3) for _ in range(5)]
    least = sum(float(m.min()) for m in memories)
    problem = SolveProblem([rng.random(3) for _ in range(5)], memories,
                           [(v, v + 1, rng.random((3, 3))) for v in range(4)] + [(0, 4, rng.random((3, 3)))],
                           memory_limit=least * 0.99)
    result = solve(problem)
    assert result.status == "infeasible" and not result.feasible and result.assignment is None
    assert result.min_memory == pytest.approx(least)
    assert result.min_memory_assignment == [int(np.argmin(m)) for m in memories]


def test_feasible_plan_that_breaks_ties_is_returned_when_tied_plans_do_not_fit():
    memories = [np.array([1.0, 3.0]), np.array([3.0, 1.0])]
    problem = SolveProblem([np.zeros(2), np.zeros(2)], memories, memory_limit=2.5, ties=[[0, 1]])
    result = solve(problem)
    assert result.status == "feasible" and result.assignment == [0, 1]
    assert result.notes and "ties" in result.notes[0]


@pytest.mark.parametrize("seed", range(6))
def test_result_is_never_worse_than_the_best_fitting_hint(seed):
    rng = np.random.default_rng(50 + seed)
    problem = random_problem(rng, shape="dag", with_memory=True, with_restrictions=True)
    hints = [[int(rng.integers(k)) for k in problem.num_strategies] for _ in range(4)]
    problem.hints = hints
    restricted, _ = brute_force(problem)
    fitting = [evaluate_time(problem, h) for h in hints
               if sum(problem.node_memory[v][s] for v, s in enumerate(h)) <= problem.memory_limit]
    expected = min([restricted] + fitting)
    result = solve(problem, SolveOptions(**EXACT))
    if np.isfinite(expected):
        assert result.objective == pytest.approx(expected, rel=1e-6)
    # A tiny time limit: the guard must hold however little the solver did.
    hurried = solve(problem, SolveOptions(time_limit_s=0.001))
    if fitting:
        assert result.objective <= min(fitting) + 1e-12
        assert hurried.objective <= min(fitting) + 1e-12


def test_hint_that_breaks_a_tie_wins_when_it_is_faster():
    times = [np.array([0.0, 5.0]), np.array([5.0, 0.0])]
    problem = SolveProblem(times, [np.zeros(2)] * 2, ties=[[0, 1]], hints=[[0, 1]])
    result = solve(problem)
    assert result.assignment == [0, 1] and result.objective == 0.0 and result.method == "hint 0"


def test_forbidden_pairs_and_strategies_are_never_chosen():
    inf = np.inf
    problem = SolveProblem(
        [np.array([0.0, inf, 1.0]), np.array([0.0, 0.0])], [np.zeros(3), np.zeros(2)],
        [(0, 1, np.array([[inf, inf], [0.0, 0.0], [0.5, 0.0]]))], followers=[],
    )
    for method in ("ilp", "chain_dp"):
        result = solve(problem, SolveOptions(method=method, **EXACT))
        assert result.assignment == [2, 1] and result.objective == pytest.approx(1.0)


def test_bad_input_gets_an_autopar_error():
    with pytest.raises(ValueError, match="autopar: edge"):
        SolveProblem([np.ones(2), np.ones(3)], [np.ones(2), np.ones(3)], [(0, 1, np.ones((2, 2)))])
    with pytest.raises(ValueError, match="autopar: hint 0"):
        SolveProblem([np.ones(2)], [np.ones(2)], hints=[[5]])
    with pytest.raises(ValueError, match="autopar: tie group"):
        SolveProblem([np.ones(2), np.ones(3)], [np.ones(2), np.ones(3)], ties=[[0, 1]])
    with pytest.raises(ValueError, match="autopar: SolveOptions.method"):
        SolveOptions(method="magic")
    dag = SolveProblem([np.ones(2)] * 3, [np.ones(2)] * 3, [(0, 1, np.eye(2)), (1, 2, np.eye(2)), (0, 2, np.eye(2))])
    with pytest.raises(ValueError, match="autopar: SolveOptions.method='chain_dp'"):
        solve(dag, SolveOptions(method="chain_dp"))


def test_tied_layers_solve_as_one_layer():
    """12 identical 5-node layers, tied: 5 decisions, and the optimum over tied plans."""
    rng = np.random.default_rng(11)
    k, width, depth = 3, 5, 12
    layer_times = [rng.uniform(0, 1, k) for _ in range(width)]
    layer_edges = [rng.uniform(0, 1, (k, k)) for _ in range(width)]
    times, edges = [], []
    for layer in range(depth):
        for j in range(width):
            v = len(times)
            times.append(layer_times[j])
            if v:
                edges.append((v - 1, v, layer_edges[j]))
    ties = [[layer * width + j for layer in range(depth)] for j in range(width)]
    problem = SolveProblem(times, [np.zeros(k)] * len(times), edges, ties=ties)
    result = solve(problem, SolveOptions(**EXACT))
    assert result.num_decision_nodes == width and respects_restrictions(problem, result.assignment)
    best_tied = min(
        evaluate_time(problem, [choice[v % width] for v in range(len(times))])
        for choice in itertools.product(range(k), repeat=width)
    )
    assert result.objective == pytest.approx(best_tied, rel=1e-6)


def test_plan_costs_add_up_and_summary_reads():
    problem = random_problem(np.random.default_rng(5), shape="dag", with_memory=True, with_restrictions=False)
    result = solve(problem)
    costs = plan_costs(problem, result.assignment)
    assert costs.total_time == pytest.approx(result.objective)
    assert costs.node_memory.sum() == pytest.approx(result.memory)
    assert result.summary().startswith(f"{result.status} by {result.method}")


def _dag(rng, n: int = 60, k: int = 6) -> SolveProblem:
    """A chain with skip edges (no chain: the ILP runs) and a memory limit that binds."""
    times = [rng.uniform(0, 1, size=k) for _ in range(n)]
    memories = [rng.uniform(0, 1, size=k) for _ in range(n)]
    pairs = [(v, v + 1) for v in range(n - 1)] + [(v - 3, v) for v in range(3, n, 3)]
    edges = [(u, v, rng.uniform(0, 1, size=(k, k))) for u, v in pairs]
    limit = sum(float(m.min()) for m in memories) + 0.3 * sum(float(np.ptp(m)) for m in memories)
    return SolveProblem(times, memories, edges, memory_limit=limit)


def test_the_ilp_search_is_deterministic_and_the_clock_only_a_reported_safety_net():
    problem = _dag(np.random.default_rng(7))
    first, second = (solve(problem, SolveOptions(time_limit_s=20)) for _ in range(2))
    assert first.method == "ilp" and first.status == "optimal", first.summary()  # the ILP beat the warm start
    assert not first.clock_cut and first.assignment == second.assignment and first.objective == second.objective
    hurried = solve(problem, SolveOptions(time_limit_s=1e-4))  # the wall clock stops it before its budget
    assert hurried.clock_cut and any("wall clock" in n for n in hurried.notes), hurried.notes

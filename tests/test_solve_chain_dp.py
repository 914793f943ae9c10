"""The chain DP against the ILP on chains too long to enumerate, and its pieces."""

import numpy as np
import pytest

from autopar.passes.solve import SolveOptions, SolveProblem, evaluate_memory, evaluate_time, solve
from autopar.passes.solve.chain_dp import chain_order, chain_tables, constrained_chain_dp, lagrangian_chain, viterbi
from autopar.passes.solve.heuristics import chain_relaxation_plan, improve_locally
from autopar.passes.solve.shrink import shrink_problem


def random_chain(rng, n: int, k: int, memory_fraction: float | None, skip_every: int = 0) -> SolveProblem:
    times = [rng.uniform(0, 1, k) for _ in range(n)]
    memories = [rng.uniform(0, 1, k) for _ in range(n)]
    edges = [(v, v + 1, rng.uniform(0, 1, (k, k))) for v in range(n - 1)]
    if skip_every:
        edges += [(v - 2, v, rng.uniform(0, 1, (k, k))) for v in range(2, n, skip_every)]
    limit = None
    if memory_fraction is not None:
        least, most = sum(m.min() for m in memories), sum(m.max() for m in memories)
        limit = float(least + memory_fraction * (most - least))
    return SolveProblem(times, memories, edges, memory_limit=limit)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("memory_fraction", [None, 0.15, 0.4])
def test_chain_dp_equals_ilp_on_long_chains(seed, memory_fraction):
    problem = random_chain(np.random.default_rng(seed), n=40, k=4, memory_fraction=memory_fraction)
    dp = solve(problem, SolveOptions(method="chain_dp"))
    ilp = solve(problem, SolveOptions(method="ilp", relative_gap_limit=0.0, time_limit_s=30))
    assert dp.method == "chain_dp" and dp.status == "optimal"
    assert ilp.status == "optimal"
    assert dp.objective == pytest.approx(ilp.objective, rel=1e-6)
    assert dp.objective <= ilp.objective + 1e-9  # the DP is exact in floats
    assert dp.objective == pytest.approx(evaluate_time(problem, dp.assignment), rel=1e-12)


def test_chain_order_lays_paths_end_to_end_and_rejects_other_graphs():
    k = 2
    path_pieces = SolveProblem([np.array([0.0, 1.0])] * 5, [np.zeros(k)] * 5,
                               [(3, 1, np.ones((k, k)) - np.eye(k)), (1, 4, np.ones((k, k)) - np.eye(k))])
    order = chain_order(shrink_problem(path_pieces))
    assert sorted(order) == list(range(5))
    position = {v: p for p, v in enumerate(order)}
    assert abs(position[3] - position[1]) == 1 and abs(position[1] - position[4]) == 1
    triangle = SolveProblem([np.array([0.0, 1.0])] * 3, [np.zeros(k)] * 3,
                            [(0, 1, np.eye(k)), (1, 2, np.eye(k)), (2, 0, np.eye(k))])
    assert chain_order(shrink_problem(triangle)) is None


def test_viterbi_and_lagrangian_bound_bracket_the_optimum():
    problem = random_chain(np.random.default_rng(7), n=30, k=4, memory_fraction=0.2)
    shrunk = shrink_problem(problem)
    order = chain_order(shrunk)
    times, memories, links = chain_tables(shrunk, order)
    choices, values = viterbi(times, links)
    unconstrained = float(values[0])
    optimum = solve(problem).objective - shrunk.constant_time
    choice, time, bound, _ = lagrangian_chain(times, memories, links, shrunk.memory_budget)
    assert unconstrained <= bound + 1e-9 <= optimum + 2e-9
    assert choice is None or time >= optimum - 1e-9


@pytest.mark.parametrize("seed", range(3))
def test_warm_start_plan_fits_and_local_search_never_hurts(seed):
    problem = random_chain(np.random.default_rng(seed), n=60, k=4, memory_fraction=0.3, skip_every=3)
    shrunk = shrink_problem(problem)
    plan, bound = chain_relaxation_plan(shrunk)
    assert plan is not None
    full = shrunk.expand(plan)
    assert evaluate_memory(problem, full) <= problem.memory_limit * (1 + 1e-9)
    improved = improve_locally(shrunk, plan)
    assert evaluate_time(problem, shrunk.expand(improved)) <= evaluate_time(problem, full) + 1e-9
    result = solve(problem, SolveOptions(time_limit_s=2))
    assert result.objective <= evaluate_time(problem, full) + 1e-9
    assert bound + shrunk.constant_time <= result.objective + 1e-9
    skipped = solve(problem, SolveOptions(max_ilp_variables=10, method="ilp"))
    assert skipped.method == "heuristic" and any("ILP skipped" in n for n in skipped.notes)
    assert skipped.bound == pytest.approx(bound + shrunk.constant_time) and skipped.bound <= result.objective + 1e-9
    # "auto" bounds it by the elimination's optimum without the limit too: no lower, still a bound
    bounded = solve(problem, SolveOptions(max_ilp_variables=10))
    assert skipped.bound - 1e-9 <= bounded.bound <= result.objective + 1e-9


def test_a_pair_no_strategies_can_join_leaves_no_plan_not_a_crash_or_a_plan_of_infinite_time():
    """An edge forbidding every pair of its ends' strategies (inf, as a pin that no layout can
    honour leaves it) makes the problem infeasible: the chain passes of the heuristics see a
    position with no finite strategy, and no plan of infinite time is returned as a plan."""
    chain = random_chain(np.random.default_rng(3), n=12, k=3, memory_fraction=0.4, skip_every=3)
    edges = list(chain.edges)
    a, b, cost = edges[-1]
    edges[-1] = (a, b, np.full_like(cost, np.inf))
    for limit in (chain.memory_limit, None):
        result = solve(SolveProblem(chain.node_time, chain.node_memory, edges, memory_limit=limit))
        assert result.status == "infeasible" and result.assignment is None, result
    times = [t.copy() for t in chain.node_time]
    times[4][:] = np.inf
    memories = list(chain.node_memory)
    links = [None] + [np.zeros((3, 3))] * 11
    assert lagrangian_chain(times, memories, links, chain.memory_limit)[0] is None
    assert constrained_chain_dp(times, memories, links, chain.memory_limit)[0] is None

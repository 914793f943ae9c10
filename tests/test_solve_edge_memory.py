"""Edges that hold memory (``SolveProblem.edge_memory``: a parameter's working copy, kept
only where its consumer reads it where it lies) against brute-force enumeration on small
random graphs with made-up costs (DESIGN.md, invariant 3): every solver counts it in the
memory limit, shrinking keeps it, and plan costs report it. Cost: about 3 CPU-seconds.
"""

import itertools

import numpy as np
import pytest

from autopar.passes.solve import SolveOptions, SolveProblem, evaluate_memory, plan_costs, solve
from autopar.passes.solve.problem import MEMORY_RELATIVE_TOLERANCE
from autopar.passes.solve.shrink import shrink_problem
from tests.test_solve_intra_op import EXACT, random_problem


def with_edge_memory(problem: SolveProblem, rng) -> SolveProblem:
    """``problem`` with memory on about half of its edges (zero on a diagonal-like pattern, as a
    working copy is zero where the consumer moves the value) and the limit moved so that
    it binds."""
    held = {}
    for e, (u, v, cost) in enumerate(problem.edges):
        if rng.random() < 0.5:
            table = rng.uniform(0, 1, size=cost.shape)
            table[rng.random(cost.shape) < 0.4] = 0.0
            held[e] = table
    limit = problem.memory_limit
    if limit is not None:
        limit += 0.3 * sum(float(m.mean()) for m in held.values())
    return SolveProblem(problem.node_time, problem.node_memory, problem.edges, memory_limit=limit,
                        ties=problem.ties, followers=problem.followers, edge_memory=held)


def brute_force(problem: SolveProblem) -> float:
    """Least time over the assignments that keep ties and followers and fit, edges' memory counted."""
    grid = np.array(list(itertools.product(*[range(k) for k in problem.num_strategies])), dtype=np.int64)
    time = sum(problem.node_time[v][grid[:, v]] for v in range(problem.num_nodes))
    memory = sum(problem.node_memory[v][grid[:, v]] for v in range(problem.num_nodes))
    for e, (u, v, cost) in enumerate(problem.edges):
        time = time + cost[grid[:, u], grid[:, v]]
        if e in problem.edge_memory:
            memory = memory + problem.edge_memory[e][grid[:, u], grid[:, v]]
    ok = np.isfinite(time)
    if problem.memory_limit is not None:
        ok &= memory <= problem.memory_limit + MEMORY_RELATIVE_TOLERANCE * abs(problem.memory_limit)
    for group in problem.ties:
        ok &= (grid[:, group] == grid[:, group[:1]]).all(axis=1)
    for f in problem.followers:
        ok &= grid[:, f.node] == np.asarray(f.index_map)[grid[:, f.leader]]
    return float(time[ok].min()) if ok.any() else np.inf


CASES = [(shape, restrictions, seed) for shape in ("chain", "dag") for restrictions in (False, True)
         for seed in range(5)]


@pytest.mark.parametrize("shape,with_restrictions,seed", CASES)
def test_solvers_count_edge_memory(shape, with_restrictions, seed):
    rng = np.random.default_rng(500 + seed)
    problem = with_edge_memory(random_problem(rng, shape=shape, with_memory=True,
                                              with_restrictions=with_restrictions), rng)
    expected = brute_force(problem)
    for method in ("ilp", "auto"):
        result = solve(problem, SolveOptions(method=method, **EXACT))
        if not np.isfinite(expected):
            assert result.assignment is None or result.status == "feasible", (method, result)
            continue
        assert result.status == "optimal", (method, result)
        assert result.objective == pytest.approx(expected, rel=1e-6, abs=1e-9), method
        assert result.memory == pytest.approx(evaluate_memory(problem, result.assignment), rel=1e-12)
        assert result.memory <= problem.memory_limit * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_shrinking_and_plan_costs_keep_edge_memory(seed):
    rng = np.random.default_rng(seed)
    problem = with_edge_memory(random_problem(rng, shape="dag", with_memory=True, with_restrictions=True), rng)
    shrunk = shrink_problem(problem)
    for _ in range(20):
        decisions = [int(rng.integers(len(t))) for t in shrunk.node_time]
        full = shrunk.expand(decisions)
        held = sum(float(m[full[problem.edges[e][0]], full[problem.edges[e][1]]])
                   for e, m in problem.edge_memory.items())
        nodes = sum(float(problem.node_memory[v][s]) for v, s in enumerate(full))
        assert shrunk.evaluate(decisions)[1] == pytest.approx(nodes + held, rel=1e-12)
        assert plan_costs(problem, full).memory == pytest.approx(nodes + held, rel=1e-12)


def test_a_chain_whose_edge_holds_memory_goes_to_the_ilp():
    """Two nodes, two strategies each: the fast pair (0, 0) holds 5 bytes on its edge, over
    the limit; nodes alone would fit it. Asking for the chain DP says why it cannot."""
    problem = SolveProblem([np.array([0.0, 1.0]), np.array([0.0, 1.0])], [np.zeros(2), np.zeros(2)],
                           [(0, 1, np.zeros((2, 2)))], memory_limit=4.0,
                           edge_memory={0: np.array([[5.0, 0.0], [0.0, 0.0]])})
    result = solve(problem, SolveOptions(**EXACT))
    assert result.status == "optimal" and result.objective == 1.0 and result.memory == 0.0
    with pytest.raises(ValueError, match="no edge that holds memory"):
        solve(problem, SolveOptions(method="chain_dp", **EXACT))


def test_edge_memory_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="autopar: edge .* expected a finite memory table of shape"):
        SolveProblem([np.zeros(2), np.zeros(3)], [np.zeros(2), np.zeros(3)], [(0, 1, np.zeros((2, 3)))],
                     edge_memory={0: np.zeros((3, 2))})

"""A fast good plan for general graphs, to warm-start the ILP and to fall back on.

``chain_relaxation_plan`` keeps only the edges between consecutive decision nodes (in
node order, which follows the traced graph's topological order), solves that chain
exactly with the memory budget (``chain_dp.solve_chain``), then ``improve_locally``
re-chooses one node at a time given its neighbours (iterated conditional modes)
while the plan keeps fitting. CP-SAT on a DAG with skip edges finds poor plans by
itself at a few thousand nodes (``python -m benchmarks.solve_scale``: 58% gap at 2000 x 8); started from this
plan it only has to improve on it.
"""

from __future__ import annotations

import numpy as np

from autopar.passes.solve.chain_dp import ChainSolution, chain_tables, constrained_chain_dp, lagrangian_chain, solve_chain
from autopar.passes.solve.problem import MEMORY_RELATIVE_TOLERANCE
from autopar.passes.solve.shrink import ShrunkProblem


def chain_relaxation_plan(
    shrunk: ShrunkProblem, max_labels: int = 128, rounds: int = 4
) -> tuple[list[int] | None, float]:
    """Decisions of the chain relaxation, refined, and a lower bound.

    The bound (on the shrunk objective without its constant) is the relaxed chain's
    bound plus the least entry of every dropped edge: every plan pays at least that.
    Refinement rounds put each dropped edge back as node costs given the current
    plan, half on each end (``R[:, s_b] / 2`` on ``a``, ``R[s_a, :] / 2`` on ``b``:
    exactly the edge's cost while neither end moves), solve that chain again and keep
    the plan while the true time improves. The decisions are ``None`` if nothing fits.
    """
    consecutive = {(a, b): r for (a, b), r in shrunk.edges.items() if b == a + 1}
    dropped = {e: r for e, r in shrunk.edges.items() if e not in consecutive}
    chain = _solve_relaxed(shrunk, consecutive, shrunk.node_time, max_labels)
    bound = chain.bound + sum(float(r[np.isfinite(r)].min()) for r in dropped.values() if np.isfinite(r).any())
    if not chain.decisions:
        return None, bound
    best = improve_locally(shrunk, chain.decisions)
    best_time = shrunk.evaluate(best)[0]
    for _ in range(rounds if dropped else 0):
        folded = [t.copy() for t in shrunk.node_time]
        for (a, b), r in dropped.items():
            folded[a] += 0.5 * r[:, best[b]]
            folded[b] += 0.5 * r[best[a], :]
        chain = _solve_relaxed(shrunk, consecutive, folded, max_labels)
        if not chain.decisions:
            break
        candidate = improve_locally(shrunk, chain.decisions)
        candidate_time = shrunk.evaluate(candidate)[0]
        if candidate_time >= best_time - 1e-12 * abs(best_time):
            break
        best, best_time = candidate, candidate_time
    return best, bound


def _solve_relaxed(shrunk: ShrunkProblem, edges, node_time, max_labels: int) -> ChainSolution:
    """The chain with only ``edges``: Lagrangian plan, then one thin label pass. The memory an
    edge holds is relaxed to its least given one end (``least_edge_memory``), so the chain's
    bound stays a bound (its plan may then not fit; the caller checks)."""
    relaxed = ShrunkProblem(
        node_time=node_time, node_memory=least_edge_memory(shrunk), edges=edges,
        constant_time=0.0, constant_memory=shrunk.constant_memory, memory_limit=shrunk.memory_limit,
        node_class=shrunk.node_class, index_maps=shrunk.index_maps, representative=shrunk.representative,
    )
    order = list(range(shrunk.num_nodes))
    budget = relaxed.memory_budget
    if budget is None:
        return solve_chain(relaxed, order)
    times, memories, links = chain_tables(relaxed, order)
    choice, time, bound, multiplier = lagrangian_chain(times, memories, links, budget, num_lambdas=16, rounds=3)
    thin, thin_time, _, _ = constrained_chain_dp(times, memories, links, budget, time, max_labels, multiplier)
    if thin is not None and thin_time < time:
        choice, time = thin, thin_time
    if choice is None:
        return ChainSolution([], np.inf, bound, False)
    return ChainSolution([int(s) for s in choice], float(time), min(bound, time), False)


def least_edge_memory(shrunk: ShrunkProblem) -> list[np.ndarray]:
    """Node memory plus, for each edge that holds memory, the least it holds given its first end."""
    memory = list(shrunk.node_memory)
    for (a, _), held in shrunk.edge_memory.items():
        memory[a] = memory[a] + held.min(axis=1)
    return memory


def improve_locally(shrunk: ShrunkProblem, decisions: list[int], max_sweeps: int = 20) -> list[int]:
    """Best response of one node at a time, as long as a sweep improves the time."""
    decisions = list(decisions)
    incident: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(shrunk.num_nodes)]
    for (a, b), cost in shrunk.edges.items():
        incident[a].append((b, cost))  # rows are a's strategies
        incident[b].append((a, cost.T))
    holding: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(shrunk.num_nodes)]
    for (a, b), held in shrunk.edge_memory.items():
        holding[a].append((b, held))
        holding[b].append((a, held.T))
    budget = shrunk.memory_budget
    memory = sum(float(m[s]) for m, s in zip(shrunk.node_memory, decisions))
    memory += sum(float(held[decisions[a], decisions[b]]) for (a, b), held in shrunk.edge_memory.items())
    cap = None if budget is None else budget + MEMORY_RELATIVE_TOLERANCE * abs(budget)
    for _ in range(max_sweeps):
        improved = False
        for v in range(shrunk.num_nodes):
            cost = shrunk.node_time[v].copy()
            for u, table in incident[v]:
                cost += table[:, decisions[u]]
            current = decisions[v]
            held_change = sum((held[:, decisions[u]] - held[current, decisions[u]] for u, held in holding[v]),
                              np.zeros(len(cost)))
            if cap is not None:
                new_memory = memory - shrunk.node_memory[v][current] + shrunk.node_memory[v] + held_change
                cost = np.where(new_memory <= cap, cost, np.inf)
            best = int(np.argmin(cost))
            if not np.isfinite(cost[best]):
                continue  # nothing fits from here (a relaxed plan over the limit): the caller checks it
            if not np.isfinite(cost[current]) or cost[best] < cost[current] - 1e-12 * max(1.0, abs(cost[current])):
                memory += float(shrunk.node_memory[v][best] - shrunk.node_memory[v][current]) + float(held_change[best])
                decisions[v] = best
                improved = True
        if not improved:
            break
    return decisions

"""Several programs as one problem: their decision nodes side by side, each program's times
weighted by how often it runs, and the values they share one decision.

Serving runs a prefill once and a decode step once per generated token over the same
weights and cache; the fastest layout of the two together is not the fastest of either
alone. ``join`` puts the programs' problems next to each other (node ``v`` of part ``k`` is
node ``offsets[k] + v``), multiplies part ``k``'s node and edge times by its weight, and
makes each shared pair one decision: the second node follows the first (same strategy
index; both must list the same strategies) and holds no memory of its own (the same tensor).
Ties inside each part are kept; the joint objective is the weighted sum of the parts'.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from autopar.passes.solve.problem import Follower, SolveProblem


def join(parts: Sequence[tuple[SolveProblem, float]],
         shared: Sequence[tuple[tuple[int, int], tuple[int, int]]],
         memory_limit: float | None = None) -> tuple[SolveProblem, list[int]]:
    """The joint problem and each part's offset (the module docstring). ``shared``: pairs
    ((part a, node u), (part b, node v)) that are one value; v follows u."""
    offsets, total = [], 0
    for problem, _ in parts:
        offsets.append(total)
        total += problem.num_nodes
    time, memory, edges, ties, followers, names = [], [], [], [], [], []
    edge_memory: dict[int, np.ndarray] = {}
    for k, (problem, weight) in enumerate(parts):
        base = offsets[k]
        time += [_weighted(t, weight) for t in problem.node_time]
        memory += [m.copy() for m in problem.node_memory]
        for e, (u, v, r) in enumerate(problem.edges):
            if e in problem.edge_memory:
                edge_memory[len(edges)] = problem.edge_memory[e]
            edges.append((base + u, base + v, _weighted(r, weight)))
        ties += [[base + v for v in group] for group in problem.ties]
        followers += [Follower(base + f.node, base + f.leader, f.index_map) for f in problem.followers]
        names += [f"{k}:{problem.name(v)}" for v in range(problem.num_nodes)]
    led = {f.node for f in followers}
    for (a, u), (b, v) in shared:
        leader, node = offsets[a] + u, offsets[b] + v
        if len(time[leader]) != len(time[node]):
            raise ValueError(f"autopar: shared nodes {names[leader]} and {names[node]} list {len(time[leader])} and "
                             f"{len(time[node])} strategies; expected the same value's strategies in both programs")
        if node in led:
            raise ValueError(f"autopar: shared node {names[node]} already follows another node; share its leader")
        followers.append(Follower(node, leader, tuple(range(len(time[leader])))))
        memory[node] = np.zeros_like(memory[node])  # the leader holds the one tensor
        led.add(node)
    ties = [group for group in ([v for v in g if v not in led] for g in ties) if len(group) > 1]
    joint = SolveProblem(node_time=time, node_memory=memory, edges=edges, memory_limit=memory_limit, ties=ties,
                         followers=followers, node_names=names, edge_memory=edge_memory)
    return joint, offsets


def _weighted(costs: np.ndarray, weight: float) -> np.ndarray:
    """``costs`` times ``weight``, a forbidden (inf) choice staying forbidden at weight 0 (a
    program that runs no time still may not take it)."""
    return np.where(np.isinf(costs), costs, costs * weight)

"""Shrink a ``SolveProblem`` to the decisions that are actually free.

Four eliminations, applied by ``shrink_problem`` in this order:

1. Followers: ``strategy[f] = index_map[strategy[leader]]``, so ``f`` is no decision;
   chains of followers compose their maps (``_resolve_followers``).
2. Ties: nodes of one tie group share one decision (a "class") and their costs add
   up (``_union_ties``). A tie among followers is accepted when it is already implied
   (their leaders are tied and the maps agree).
3. Folding (``_fold_costs``): every original cost lands on a class. An edge whose two
   ends are in the same class becomes the diagonal ``R[m_u[a], m_v[a]]`` of that
   class's node cost; parallel edges between two classes add up. An edge's memory
   (``SolveProblem.edge_memory``) folds the same way into memory.
4. Fixed and separable (``_drop_fixed_and_separable``): a class with one strategy is a
   constant, and its edges become node costs of its neighbours; an edge table with
   ``R[i, j] = a[i] + b[j]`` is moved onto its two ends (an edge that holds memory only
   when its memory table is separable too).

The shrunk objective of a decision assignment equals the full objective of its
expansion (up to float summation order); tests check this identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np

from autopar.passes.solve.problem import SolveProblem


@dataclass
class ShrunkProblem:
    """Decision nodes ("classes") with folded costs, and the way back to original nodes."""

    node_time: list[np.ndarray]
    node_memory: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]  # (a, b) with a < b -> R[k_a, k_b]
    constant_time: float
    constant_memory: float
    memory_limit: float | None
    # Original node v takes index_maps[v][strategy of class node_class[v]]; a class of
    # node_class[v] == -1 is fixed and v takes index_maps[v][0].
    node_class: np.ndarray
    index_maps: list[np.ndarray]
    representative: list[int]  # per decision class: an original node with an identity map
    # (a, b) of ``edges`` -> bytes of each pair, for the kept edges that hold memory
    edge_memory: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return len(self.node_time)

    @property
    def memory_budget(self) -> float | None:
        """Bytes left for the decision nodes once the fixed ones are paid."""
        return None if self.memory_limit is None else self.memory_limit - self.constant_memory

    def expand(self, decisions) -> list[int]:
        """Full assignment (one strategy per original node) from one per class."""
        chosen = [int(decisions[c]) if c >= 0 else 0 for c in self.node_class]
        return [int(m[s]) for m, s in zip(self.index_maps, chosen)]

    def project(self, full_assignment) -> list[int]:
        """Decisions read off the representatives; exact when the assignment keeps the restrictions."""
        return [int(full_assignment[r]) for r in self.representative]

    def evaluate(self, decisions) -> tuple[float, float]:
        """(time, memory) of a decision assignment, constants included."""
        time = self.constant_time + sum(float(t[s]) for t, s in zip(self.node_time, decisions))
        memory = self.constant_memory + sum(float(m[s]) for m, s in zip(self.node_memory, decisions))
        for (a, b), cost in self.edges.items():
            time += float(cost[decisions[a], decisions[b]])
        for (a, b), held in self.edge_memory.items():
            memory += float(held[decisions[a], decisions[b]])
        return time, memory

    def with_added_time(self, added: Mapping[int, np.ndarray]) -> ShrunkProblem:
        """This problem with ``added[v]`` seconds on original node ``v``'s strategies (inf
        forbids one), folded as ``shrink_problem`` folds every node cost: the same as
        shrinking the changed problem, without doing it again. Raises ``ValueError`` when
        that leaves a decision (or a fixed node) with no finite choice."""
        node_time = list(self.node_time)
        constant = self.constant_time
        for v, extra in added.items():
            folded = np.asarray(extra, dtype=np.float64)[self.index_maps[v]]
            d = int(self.node_class[v])
            if d < 0:
                constant += float(folded[0])
            else:
                node_time[d] = node_time[d] + folded
        if not np.isfinite(constant) or any(not np.isfinite(t).any() for t in node_time):
            raise ValueError("autopar: the added costs forbid every strategy of a decision (or fix a node to a "
                             "forbidden one); expected at least one finite choice each.")
        return replace(self, node_time=node_time, constant_time=constant)

    def adjacency(self) -> list[set[int]]:
        neighbours: list[set[int]] = [set() for _ in range(self.num_nodes)]
        for a, b in self.edges:
            neighbours[a].add(b)
            neighbours[b].add(a)
        return neighbours


def shrink_problem(problem: SolveProblem) -> ShrunkProblem:
    roots, maps = _resolve_followers(problem)
    node_class, num_classes = _union_ties(problem, roots, maps)
    class_time, class_memory, class_edges, class_edge_memory = _fold_costs(problem, node_class, num_classes, maps)
    return _drop_fixed_and_separable(problem, node_class, maps, class_time, class_memory, class_edges,
                                     class_edge_memory)


def _resolve_followers(problem: SolveProblem) -> tuple[list[int], list[np.ndarray]]:
    """Root leader of every node and the map from the root's strategies to the node's."""
    n = problem.num_nodes
    leader_of = {f.node: (f.leader, np.asarray(f.index_map, dtype=np.int64)) for f in problem.followers}
    roots: list[int] = [-1] * n
    maps: list[np.ndarray | None] = [None] * n
    for start in range(n):
        path, v = [], start
        while roots[v] < 0 and v in leader_of:
            if v in path:
                cycle = " -> ".join(problem.name(u) for u in path[path.index(v):] + [v])
                raise ValueError(
                    f"autopar: followers form a cycle ({cycle}); expected every follower chain to end "
                    "at a node that leads; drop one Follower of the cycle."
                )
            path.append(v)
            v = leader_of[v][0]
        if roots[v] < 0:  # v leads nobody's way: it is its own root
            roots[v], maps[v] = v, np.arange(len(problem.node_time[v]))
        for u in reversed(path):  # compose: s_u = m_u[s_leader] = m_u[map_leader[s_root]]
            leader, index_map = leader_of[u]
            roots[u], maps[u] = roots[leader], index_map[maps[leader]]
    return roots, maps  # type: ignore[return-value]


def _union_ties(problem: SolveProblem, roots: list[int], maps: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """Class of every node: roots tied with identity maps share a class."""
    parent = list(range(problem.num_nodes))

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def is_identity(v: int) -> bool:
        return len(maps[v]) == len(problem.node_time[v]) and bool((maps[v] == np.arange(len(maps[v]))).all())

    deferred = []
    for group in problem.ties:
        if all(is_identity(v) for v in group):
            for v in group[1:]:
                parent[find(roots[v])] = find(roots[group[0]])
        else:
            deferred.append(group)
    for group in deferred:  # ties among followers must already be implied by their leaders
        first = group[0]
        for v in group[1:]:
            if find(roots[v]) != find(roots[first]) or not np.array_equal(maps[v], maps[first]):
                raise ValueError(
                    f"autopar: tie group {group} contains followers ({problem.name(v)} follows "
                    f"{problem.name(roots[v])}, {problem.name(first)} follows {problem.name(roots[first])}) "
                    "whose leaders are not tied with the same index map; expected ties on leaders, "
                    "so tie the leaders instead of the followers."
                )
    class_of_root: dict[int, int] = {}
    node_class = np.empty(problem.num_nodes, dtype=np.int64)
    for v in range(problem.num_nodes):
        node_class[v] = class_of_root.setdefault(find(roots[v]), len(class_of_root))
    return node_class, len(class_of_root)


def _fold_costs(problem: SolveProblem, node_class: np.ndarray, num_classes: int, maps: list[np.ndarray]):
    sizes = [0] * num_classes
    for v in range(problem.num_nodes):
        sizes[node_class[v]] = len(maps[v])
    class_time = [np.zeros(k) for k in sizes]
    class_memory = [np.zeros(k) for k in sizes]
    for v in range(problem.num_nodes):
        c = node_class[v]
        class_time[c] += problem.node_time[v][maps[v]]
        class_memory[c] += problem.node_memory[v][maps[v]]
    class_edges: dict[tuple[int, int], np.ndarray] = {}
    class_edge_memory: dict[tuple[int, int], np.ndarray] = {}
    for e, (u, v, cost) in enumerate(problem.edges):
        cu, cv = int(node_class[u]), int(node_class[v])
        for tables, on_class, table in ((class_edges, class_time, cost), (class_edge_memory, class_memory,
                                                                          problem.edge_memory.get(e))):
            if table is None:
                continue
            folded = table[np.ix_(maps[u], maps[v])]
            if cu == cv:
                on_class[cu] += np.diagonal(folded)
                continue
            key, table = ((cu, cv), folded) if cu < cv else ((cv, cu), folded.T)
            tables[key] = tables[key] + table if key in tables else table.copy()
    for c, t in enumerate(class_time):
        if not np.isfinite(t).any():
            raise ValueError(
                f"autopar: ties and followers leave decision class {c} with only forbidden (inf) "
                "strategies; expected at least one finite choice; check the follower index maps."
            )
    return class_time, class_memory, class_edges, class_edge_memory


def _drop_fixed_and_separable(problem, node_class, maps, class_time, class_memory, class_edges,
                              class_edge_memory) -> ShrunkProblem:
    num_classes = len(class_time)
    fixed = [len(t) == 1 for t in class_time]
    constant = {"time": sum(float(class_time[c][0]) for c in range(num_classes) if fixed[c]),
                "memory": sum(float(class_memory[c][0]) for c in range(num_classes) if fixed[c])}
    kept_edges: dict[tuple[int, int], np.ndarray] = {}
    kept_memory: dict[tuple[int, int], np.ndarray] = {}
    for key, cost in class_edges.items():  # an edge that holds memory has a time table too
        a, b = key
        held = class_edge_memory.get(key)
        if not (fixed[a] or fixed[b]) and not (_is_separable(cost) and _is_separable(held)):
            kept_edges[key] = cost
            if held is not None:
                kept_memory[key] = held
            continue
        for kind, table, on_class in (("time", cost, class_time), ("memory", held, class_memory)):
            if table is None:
                continue
            if fixed[a] and fixed[b]:
                constant[kind] += float(table[0, 0])
            elif fixed[a]:
                on_class[b] = on_class[b] + table[0, :]
            elif fixed[b]:
                on_class[a] = on_class[a] + table[:, 0]
            else:  # separable: R[i, j] = R[i, 0] + R[0, j] - R[0, 0]
                on_class[a] = on_class[a] + table[:, 0]
                on_class[b] = on_class[b] + (table[0, :] - table[0, 0])
    constant_time, constant_memory = constant["time"], constant["memory"]
    decision_id = np.full(num_classes, -1, dtype=np.int64)
    free = [c for c in range(num_classes) if not fixed[c]]
    decision_id[free] = np.arange(len(free))
    representative = [-1] * len(free)
    for v in range(problem.num_nodes):
        d = decision_id[node_class[v]]
        if d >= 0 and representative[d] < 0 and np.array_equal(maps[v], np.arange(len(maps[v]))):
            representative[d] = v
    for c in free:
        if not np.isfinite(class_time[c]).any():
            raise ValueError(
                f"autopar: the fixed (single-strategy) neighbours of decision class {c} forbid all of "
                "its strategies (inf resharding); expected at least one finite choice."
            )
    return ShrunkProblem(
        node_time=[class_time[c] for c in free],
        node_memory=[class_memory[c] for c in free],
        edges={(int(decision_id[a]), int(decision_id[b])): r for (a, b), r in kept_edges.items()},
        edge_memory={(int(decision_id[a]), int(decision_id[b])): m for (a, b), m in kept_memory.items()},
        constant_time=constant_time,
        constant_memory=constant_memory,
        memory_limit=problem.memory_limit,
        node_class=decision_id[node_class],
        index_maps=list(maps),
        representative=representative,
    )


def _is_separable(cost: np.ndarray | None) -> bool:
    if cost is None:
        return True
    if not np.isfinite(cost).all():
        return False
    residual = cost - cost[:, :1] - cost[:1, :] + cost[0, 0]
    return bool(np.abs(residual).max() <= 1e-12 * max(1.0, float(np.abs(cost).max())))

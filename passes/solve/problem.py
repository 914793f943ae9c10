"""The solver's input and output: plain numbers in plain dataclasses.

A ``SolveProblem`` is a graph of decision nodes. Node ``v`` has ``k_v`` strategies;
choosing strategy ``i`` costs ``node_time[v][i]`` seconds and ``node_memory[v][i]``
bytes per device. An edge ``(u, v, R)`` costs ``R[i, j]`` seconds of resharding when
``u`` takes ``i`` and ``v`` takes ``j``; ``edge_memory[e]``, where given, is what edge
``e`` holds in bytes per device for each pair (a value kept as the consumer reads it:
what stays depends on both ends). A non-finite cost (``inf``) forbids that choice.
Memory is additive over nodes and edges and bounded by ``memory_limit``.

Two restrictions shrink the search (``shrink.py`` eliminates them):

- ``ties``: groups of nodes that take the same strategy index (repeated layers).
- ``followers``: ``Follower(node, leader, index_map)`` fixes
  ``strategy[node] = index_map[strategy[leader]]`` (pointwise and view ops).

``hints`` are full candidate assignments (manual layouts). They are judged on the
unrestricted problem, so a hint that breaks a tie is still a valid plan and the
result is never worse than the best hint that fits in memory.

Nothing here knows about tensors or placements (DESIGN.md, invariant 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from autopar.costmodels.overlap import excess as stream_excess

# Feasibility allows this relative slack so that summing the same floats in another
# order (DP versus node order) never flips a verdict.
MEMORY_RELATIVE_TOLERANCE = 1e-9
# A relative difference below this between two sums of the same terms is float rounding
# (summed in other orders): a bound that close is reached.
ROUNDING = 1e-12


@dataclass(frozen=True)
class Follower:
    """``strategy[node] = index_map[strategy[leader]]``; ``index_map`` has ``k_leader`` entries."""

    node: int
    leader: int
    index_map: tuple[int, ...]


@dataclass
class Overlap:
    """Communication run beside compute on a second stream (``autopar.costmodels.overlap``):
    the edge tables leave ``hidden`` out, which holds while the stream's ``busy`` seconds fit
    in the ``window`` of compute beside them; past it, hiding shrinks by window / busy
    (``overlap_excess``). The solver's objective leaves that correction out: a lower bound."""

    window: list[np.ndarray]  # per node: compute seconds of each strategy the stream runs beside
    busy: dict[int, np.ndarray]  # edge index -> seconds run beside that compute, per pair of strategies
    hidden: dict[int, np.ndarray]  # edge index -> seconds of them the edge's table leaves out


@dataclass
class SolveProblem:
    """Per-strategy costs of every decision node and per-pair costs of every edge."""

    node_time: list[np.ndarray]
    node_memory: list[np.ndarray]
    edges: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    memory_limit: float | None = None
    ties: list[list[int]] = field(default_factory=list)
    followers: list[Follower] = field(default_factory=list)
    hints: list[list[int]] = field(default_factory=list)
    node_names: list[str] | None = None
    # edge index (in ``edges``) -> bytes per device of each pair of its ends' strategies
    edge_memory: dict[int, np.ndarray] = field(default_factory=dict)
    # communication hidden behind compute, one per window (forward, backward)
    overlaps: list[Overlap] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.node_time = [np.asarray(t, dtype=np.float64).reshape(-1) for t in self.node_time]
        self.node_memory = [np.asarray(m, dtype=np.float64).reshape(-1) for m in self.node_memory]
        self.edges = [(int(u), int(v), np.asarray(r, dtype=np.float64)) for u, v, r in self.edges]
        self.edge_memory = {int(e): np.asarray(m, dtype=np.float64) for e, m in self.edge_memory.items()}
        self.followers = [
            f if isinstance(f, Follower) else Follower(int(f[0]), int(f[1]), tuple(int(i) for i in f[2]))
            for f in self.followers
        ]
        _validate(self)

    @property
    def num_nodes(self) -> int:
        return len(self.node_time)

    @property
    def num_strategies(self) -> list[int]:
        return [len(t) for t in self.node_time]

    def name(self, node: int) -> str:
        return self.node_names[node] if self.node_names else f"node {node}"


@dataclass
class SolveResult:
    """What the solver found, with enough numbers to judge it.

    ``status`` is one of:
      - ``"optimal"``: proven optimal for the shrunk problem (ties and followers
        enforced): exactly by the chain DP; by CP-SAT within
        ``SolveOptions.relative_gap_limit`` and the rounding of its integer costs
        (``time_resolution`` seconds per term, see ``ilp.py``); ``gap`` shows the rest;
      - ``"feasible"``: a plan that fits, not proven optimal (see ``gap``);
      - ``"infeasible"``: nothing fits in ``memory_limit``; ``assignment`` is
        ``None`` and ``min_memory_assignment`` is the plan that needs least memory.
    """

    status: str
    assignment: list[int] | None
    objective: float  # seconds, evaluated in floats on the full problem
    memory: float  # bytes per device of ``assignment``
    bound: float  # lower bound on the objective of the shrunk problem, seconds
    gap: float  # (objective - bound) / objective, 0 when proven optimal
    method: str  # who found it: "chain_dp", "ilp", "heuristic", "hint 3", "min_memory", "trivial"
    solve_seconds: float
    num_decision_nodes: int  # after shrinking
    min_memory: float
    min_memory_assignment: list[int]
    time_resolution: float = 0.0  # seconds per ILP objective unit; 0 for the DP
    notes: list[str] = field(default_factory=list)
    clock_cut: bool = False  # the wall-clock safety net stopped the search before its budget

    @property
    def feasible(self) -> bool:
        return self.assignment is not None

    def summary(self) -> str:
        """One line for logs and ``explain()``."""
        if not self.feasible:
            return (f"infeasible: the least memory any plan needs is {self.min_memory:.6g} bytes "
                    f"({self.num_decision_nodes} decisions, {self.solve_seconds:.2f} s)")
        return (f"{self.status} by {self.method}: {self.objective:.6g} s (bound {self.bound:.6g}, "
                f"gap {self.gap:.2%}), {self.memory:.6g} bytes, {self.num_decision_nodes} decisions, "
                f"{self.solve_seconds:.2f} s")


@dataclass
class PlanCosts:
    """Where a plan's time and memory go: per node and per edge (for ``explain()``)."""

    node_time: np.ndarray  # [num_nodes] seconds of each node's chosen strategy
    node_memory: np.ndarray  # [num_nodes] bytes
    edge_time: np.ndarray  # [num_edges] resharding seconds, in ``problem.edges`` order
    edge_memory: np.ndarray  # [num_edges] bytes (0 where the edge holds none)
    hidden: float = 0.0  # seconds of communication hidden behind compute (``Overlap``)
    excess: float = 0.0  # seconds the edges leave out that no compute was left to hide

    @property
    def total_time(self) -> float:
        return float(self.node_time.sum() + self.edge_time.sum()) + self.excess

    @property
    def memory(self) -> float:
        """Bytes per device: the nodes' and the edges' (``memory_of``)."""
        return memory_of(self.node_memory, self.edge_memory)


def memory_of(node_memory: np.ndarray, edge_memory: Sequence[float]) -> float:
    """A plan's bytes from its nodes' and its edges' (one sum, wherever a plan's memory is totalled)."""
    return float(node_memory.sum()) + sum(float(m) for m in edge_memory if m)


def plan_costs(problem: SolveProblem, assignment: Sequence[int]) -> PlanCosts:
    hidden, excess = overlap_excess(problem, assignment)
    return PlanCosts(
        node_time=np.array([problem.node_time[v][s] for v, s in enumerate(assignment)]),
        node_memory=np.array([problem.node_memory[v][s] for v, s in enumerate(assignment)]),
        edge_time=np.array([cost[assignment[u], assignment[v]] for u, v, cost in problem.edges]),
        edge_memory=edge_bytes(problem, assignment),
        hidden=hidden - excess,
        excess=excess,
    )


def overlap_excess(problem: SolveProblem, assignment: Sequence[int]) -> tuple[float, float]:
    """(seconds the edge tables leave out as hidden, seconds of them that come back because a
    stream is busier than its window of compute: ``costmodels.overlap.excess``)."""
    hidden = extra = 0.0
    for o in problem.overlaps:
        window = sum(float(o.window[v][s]) for v, s in enumerate(assignment) if v < len(o.window))
        picked = [(problem.edges[e][0], problem.edges[e][1], e) for e in o.hidden]
        busy = sum(float(o.busy[e][assignment[u], assignment[v]]) for u, v, e in picked)
        h = sum(float(o.hidden[e][assignment[u], assignment[v]]) for u, v, e in picked)
        hidden += h
        extra += stream_excess(h, busy, window)
    return hidden, extra


def edge_bytes(problem: SolveProblem, assignment: Sequence[int]) -> np.ndarray:
    """[num_edges] bytes each edge holds under ``assignment`` (0 for edges without memory)."""
    out = np.zeros(len(problem.edges))
    for e, table in problem.edge_memory.items():
        u, v, _ = problem.edges[e]
        out[e] = table[assignment[u], assignment[v]]
    return out


def evaluate_time(problem: SolveProblem, assignment: Sequence[int]) -> float:
    """Objective of a full assignment: node times plus edge resharding times."""
    total = sum(float(problem.node_time[v][s]) for v, s in enumerate(assignment))
    for u, v, cost in problem.edges:
        total += float(cost[assignment[u], assignment[v]])
    return total + overlap_excess(problem, assignment)[1]


def evaluate_memory(problem: SolveProblem, assignment: Sequence[int]) -> float:
    """Bytes per device of a full assignment: its nodes' and its edges' (``memory_of``)."""
    nodes = np.array([problem.node_memory[v][s] for v, s in enumerate(assignment)])
    return memory_of(nodes, edge_bytes(problem, assignment))


def fits_memory(memory: float, memory_limit: float | None) -> bool:
    if memory_limit is None:
        return True
    return memory <= memory_limit + MEMORY_RELATIVE_TOLERANCE * abs(memory_limit)


def respects_restrictions(problem: SolveProblem, assignment: Sequence[int]) -> bool:
    """True when ``assignment`` keeps every tie and follower."""
    for group in problem.ties:
        if len({assignment[v] for v in group}) > 1:
            return False
    return all(assignment[f.node] == f.index_map[assignment[f.leader]] for f in problem.followers)


def _validate(problem: SolveProblem) -> None:
    n = problem.num_nodes
    if len(problem.node_memory) != n:
        raise ValueError(
            f"autopar: SolveProblem expected one memory array per node ({n}), "
            f"found {len(problem.node_memory)}; pass node_memory with the same length as node_time."
        )
    if problem.node_names is not None and len(problem.node_names) != n:
        raise ValueError(
            f"autopar: SolveProblem expected {n} node_names, found {len(problem.node_names)}."
        )
    _validate_edge_memory(problem)
    if _costs_look_valid(problem):  # the common case, checked at once; else find the culprit
        _validate_restrictions(problem)
        return
    for v, (t, m) in enumerate(zip(problem.node_time, problem.node_memory)):
        if len(t) == 0 or len(t) != len(m):
            raise ValueError(
                f"autopar: {problem.name(v)} expected node_time and node_memory of the same "
                f"non-zero length, found {len(t)} and {len(m)}."
            )
        if np.isnan(t).any() or np.isneginf(t).any() or not np.isfinite(m).all():
            raise ValueError(
                f"autopar: {problem.name(v)} expected finite costs (inf time to forbid a strategy), "
                f"found time {t.tolist()} and memory {m.tolist()}."
            )
        if not np.isfinite(t).any():
            raise ValueError(f"autopar: every strategy of {problem.name(v)} is forbidden (all times inf).")
    for u, v, cost in problem.edges:
        if not (0 <= u < n and 0 <= v < n) or u == v:
            raise ValueError(
                f"autopar: edge ({u}, {v}) expected two different nodes in [0, {n}); fix the edge list."
            )
        expected = (len(problem.node_time[u]), len(problem.node_time[v]))
        if cost.shape != expected or np.isnan(cost).any() or np.isneginf(cost).any():
            raise ValueError(
                f"autopar: edge ({problem.name(u)}, {problem.name(v)}) expected a resharding table "
                f"of shape {expected} without NaN or -inf, found shape {cost.shape}."
            )
    _validate_restrictions(problem)


def _costs_look_valid(problem: SolveProblem) -> bool:
    """Every node and edge cost well formed, checked in a few array operations (a large graph
    has tens of thousands of nodes and edges; repeated layers share their edge tables, each
    distinct table checked once); False sends ``_validate`` through them one by one to name
    the first bad one."""
    n, times, memories = problem.num_nodes, problem.node_time, problem.node_memory
    if any(len(t) == 0 or len(t) != len(m) for t, m in zip(times, memories)):
        return False
    if n:
        t, m = np.concatenate(times), np.concatenate(memories)
        if np.isnan(t).any() or np.isneginf(t).any() or not np.isfinite(m).all():
            return False
        if not all(np.isfinite(t).any() for t in times):
            return False
    tables = {}
    for u, v, cost in problem.edges:
        if not (0 <= u < n and 0 <= v < n) or u == v or cost.shape != (len(times[u]), len(times[v])):
            return False
        tables[id(cost)] = cost
    return not any(np.isnan(c).any() or np.isneginf(c).any() for c in tables.values())


def _validate_edge_memory(problem: SolveProblem) -> None:
    for e, table in problem.edge_memory.items():
        if not 0 <= e < len(problem.edges):
            raise ValueError(f"autopar: edge_memory names edge {e}, expected an index in [0, {len(problem.edges)}) "
                             "of SolveProblem.edges; key it by the edge's position.")
        u, v, cost = problem.edges[e]
        if table.shape != cost.shape or not np.isfinite(table).all():
            raise ValueError(
                f"autopar: edge ({problem.name(u)}, {problem.name(v)}) expected a finite memory table of shape "
                f"{cost.shape} (its resharding table's), found shape {table.shape}; forbid pairs by inf time.")


def _validate_restrictions(problem: SolveProblem) -> None:
    """The memory limit, ties, followers and hints (after the costs)."""
    n = problem.num_nodes
    if problem.memory_limit is not None and not np.isfinite(problem.memory_limit):
        raise ValueError(f"autopar: memory_limit must be finite or None, found {problem.memory_limit}.")
    for group in problem.ties:
        sizes = {len(problem.node_time[v]) for v in group}
        if len(sizes) > 1:
            raise ValueError(
                f"autopar: tie group {group} expected nodes with the same number of strategies, "
                f"found {sorted(sizes)}; tie only repeated copies of the same op."
            )
    seen = set()
    for f in problem.followers:
        if f.node in seen:
            raise ValueError(f"autopar: {problem.name(f.node)} has two leaders; give it one Follower.")
        seen.add(f.node)
        k_leader, k_node = len(problem.node_time[f.leader]), len(problem.node_time[f.node])
        if len(f.index_map) != k_leader or not all(0 <= i < k_node for i in f.index_map):
            raise ValueError(
                f"autopar: Follower {problem.name(f.node)} of {problem.name(f.leader)} expected an "
                f"index_map of {k_leader} entries in [0, {k_node}), found {list(f.index_map)}."
            )
    for h, hint in enumerate(problem.hints):
        if len(hint) != n or any(not 0 <= s < len(problem.node_time[v]) for v, s in enumerate(hint)):
            raise ValueError(
                f"autopar: hint {h} expected one strategy index per node ({n} nodes, each in range), "
                f"found {list(hint)[:8]}{'...' if len(hint) > 8 else ''}."
            )

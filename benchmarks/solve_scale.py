"""Solve times of the intra-op solver on synthetic problems (made-up costs).

    python -m benchmarks.solve_scale                      # everything, 60 s CP-SAT limit
    python -m benchmarks.solve_scale --sizes 500 --time-limit 20 --only chain dag

Problems (8 strategies per node unless said otherwise):
  chain N      a series graph, resharding 0 on the diagonal and random elsewhere,
               memory limit at 30% of the way from the least to the most memory;
  chain N ILP  the same chain forced through the CP-SAT ILP (N <= 2000);
  dag N        the same chain plus residual skip edges (v - 3 -> v on every 3rd node),
               solved by the CP-SAT ILP from a chain-relaxation warm start (skipped
               above SolveOptions.max_ilp_variables: then the warm start is returned);
  transformer  embedding, 80 layers of 20 decision nodes (a chain with two residual
               skips per layer, 6 pointwise followers), head; every layer tied to layer 0.
               Solved tied (what the planner does) and untied (same costs, ILP on
               ~1,100 nodes): the untied optimum is what tying may give up.
Each row: nodes before and after shrinking, method, wall seconds, status, gap. The rows also go
to ``benchmarks/results/solve_scale_cpu_<yyyymmdd>.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from autopar.passes.solve import Follower, SolveOptions, SolveProblem, solve
from benchmarks.results_file import add_out_argument, write_results

STRATEGIES = 8


def resharding(rng, k_from: int, k_to: int) -> np.ndarray:
    table = rng.uniform(0.2, 1.0, size=(k_from, k_to))
    table[np.arange(min(k_from, k_to)), np.arange(min(k_from, k_to))] = 0.0
    return table


def memory_limit_at(memories, fraction: float) -> float:
    least = sum(float(m.min()) for m in memories)
    most = sum(float(m.max()) for m in memories)
    return least + fraction * (most - least)


def chain_problem(n: int, seed: int, skip_edges: bool) -> SolveProblem:
    rng = np.random.default_rng(seed)
    times = [rng.uniform(0.0, 1.0, STRATEGIES) for _ in range(n)]
    memories = [rng.uniform(0.0, 1.0, STRATEGIES) for _ in range(n)]
    edges = [(v, v + 1, resharding(rng, STRATEGIES, STRATEGIES)) for v in range(n - 1)]
    if skip_edges:
        edges += [(v - 3, v, resharding(rng, STRATEGIES, STRATEGIES)) for v in range(3, n, 3)]
    return SolveProblem(times, memories, edges, memory_limit=memory_limit_at(memories, 0.3))


def transformer_problem(num_layers: int = 80, nodes_per_layer: int = 20, tied: bool = True, seed: int = 0):
    rng = np.random.default_rng(seed)
    layer_times = [rng.uniform(0.0, 1.0, STRATEGIES) for _ in range(nodes_per_layer)]
    layer_memories = [rng.uniform(0.0, 1.0, STRATEGIES) for _ in range(nodes_per_layer)]
    # Repeated layers repeat their resharding tables too: edge into node j, two residuals.
    layer_edges = [resharding(rng, STRATEGIES, STRATEGIES) for _ in range(nodes_per_layer + 2)]
    pointwise = {3, 5, 8, 11, 14, 17}  # follow the node before them, same strategy index
    times = [rng.uniform(0.0, 1.0, STRATEGIES)]  # embedding
    memories = [rng.uniform(0.0, 1.0, STRATEGIES)]
    edges, followers, ties = [], [], [[] for _ in range(nodes_per_layer)]
    identity = tuple(range(STRATEGIES))
    for layer in range(num_layers):
        first = len(times)
        for j in range(nodes_per_layer):
            v = first + j
            times.append(layer_times[j])
            memories.append(layer_memories[j])
            edges.append((v - 1, v, layer_edges[j]))
            if j in pointwise:
                followers.append(Follower(v, v - 1, identity))
            else:
                ties[j].append(v)
        edges.append((first - 1, first + 9, layer_edges[-2]))  # residual
        edges.append((first + 9, first + nodes_per_layer - 1, layer_edges[-1]))
    head = len(times)
    times.append(rng.uniform(0.0, 1.0, STRATEGIES))
    memories.append(rng.uniform(0.0, 1.0, STRATEGIES))
    edges.append((head - 1, head, resharding(rng, STRATEGIES, STRATEGIES)))
    return SolveProblem(
        times, memories, edges, memory_limit=memory_limit_at(memories, 0.3),
        ties=[group for group in ties if len(group) > 1] if tied else [], followers=followers,
    )


TABLE = ["| problem | nodes | free | method | wall s | status | gap | objective |", "|---|---|---|---|---|---|---|---|"]


def run(name: str, problem: SolveProblem, options: SolveOptions) -> str:
    """Solve, print the fixed-width line, and return the markdown row."""
    started = time.perf_counter()
    result = solve(problem, options)
    wall = time.perf_counter() - started
    print(
        f"{name:<28} {problem.num_nodes:>6} -> {result.num_decision_nodes:>5}  {result.method:<10} "
        f"{wall:8.2f} s  {result.status:<10} gap {_gap(result.gap)}  objective {result.objective:.4f}",
        flush=True,
    )
    return (f"| {name} | {problem.num_nodes} | {result.num_decision_nodes} | {result.method} | {wall:.2f} | "
            f"{result.status} | {_gap(result.gap)} | {result.objective:.4f} |")


def _gap(gap: float) -> str:
    """The solver's gap, or "no bound" where it proved none (never "inf%")."""
    return f"{gap:.2%}" if math.isfinite(gap) else "no bound"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 2000, 8000])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--only", nargs="+", default=["chain", "chain_ilp", "dag", "transformer"],
                        choices=["chain", "chain_ilp", "dag", "transformer"])
    add_out_argument(parser)
    args = parser.parse_args()
    options = SolveOptions(time_limit_s=args.time_limit)
    print(f"{'problem':<28} {'nodes':>6} -> {'free':>5}  {'method':<10} {'wall':>10}  status")
    rows = list(TABLE)
    for n in args.sizes:
        if "chain" in args.only:
            rows.append(run(f"chain {n}x{STRATEGIES} + memory", chain_problem(n, seed=n, skip_edges=False), options))
        if "chain_ilp" in args.only and n <= 2000:
            rows.append(run(f"chain {n}x{STRATEGIES} ILP", chain_problem(n, seed=n, skip_edges=False),
                            SolveOptions(time_limit_s=args.time_limit, method="ilp")))
        if "dag" in args.only:
            rows.append(run(f"dag {n}x{STRATEGIES} + memory", chain_problem(n, seed=n, skip_edges=True), options))
    if "transformer" in args.only:
        rows.append(run("transformer 80x20 tied", transformer_problem(tied=True), options))
        rows.append(run("transformer 80x20 untied", transformer_problem(tied=False), options))
    write_results("solve_scale", "cpu", "Solve times of the intra-op solver on synthetic problems", rows, args.out)


if __name__ == "__main__":
    main()

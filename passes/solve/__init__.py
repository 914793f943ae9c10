"""The planner's numeric core: intra-op strategy choice and pipeline stage cuts.

Everything here consumes plain numbers (DESIGN.md, invariant 3). Modules:

- ``problem``: ``SolveProblem`` / ``SolveResult`` dataclasses and evaluation;
- ``shrink``: followers, ties, fixed nodes and separable edges eliminated;
- ``chain_dp``: exact DP for chain-shaped problems, with and without memory;
- ``elimination``: exact variable elimination for narrow graphs, memory by a Lagrangian price;
- ``ilp``: Alpa's intra-op ILP in CP-SAT (the mathematics is in its docstring);
- ``intra_op``: ``solve``, which picks the DP, elimination or the ILP and guards with hints;
- ``stages``: pipeline stage cuts (min-max DP), in-flight micro-batches, step time;
- ``pipeline_search``: search over (stages, micro-batches, schedule).

Example (two nodes with two strategies each, 1 GB per device)::

    problem = SolveProblem(
        node_time=[np.array([1e-3, 4e-4]), np.array([2e-3, 6e-4])],
        node_memory=[np.array([4e8, 1e8]), np.array([8e8, 2e8])],
        edges=[(0, 1, np.array([[0.0, 5e-4], [5e-4, 0.0]]))],
        memory_limit=1e9,
    )
    result = solve(problem, SolveOptions(time_limit_s=10))
    result.status, result.assignment, result.objective, result.gap  # "optimal", [1, 1], 0.001, 0.0
    print(result.summary())
"""

from autopar.passes.solve.intra_op import SolveOptions, solve
from autopar.passes.solve.problem import (
    Follower,
    Overlap,
    PlanCosts,
    SolveProblem,
    SolveResult,
    edge_bytes,
    evaluate_memory,
    evaluate_time,
    fits_memory,
    plan_costs,
    respects_restrictions,
)

__all__ = [
    "Follower",
    "Overlap",
    "PlanCosts",
    "SolveOptions",
    "SolveProblem",
    "SolveResult",
    "edge_bytes",
    "evaluate_memory",
    "evaluate_time",
    "fits_memory",
    "plan_costs",
    "respects_restrictions",
    "solve",
]

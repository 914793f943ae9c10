"""A capture the plan was not made from, laid out by the plan.

One plan lays out every program of its model: the training step it was made from, eval
mode, ``no_grad``, other batch sizes, prefill and decode. Each node of another capture
takes the plan's strategy for the node of the same identity (``autopar.passes.plan.
planned_names``) where that strategy is valid here. The rest (ops the plan's capture did not
have, or whose planned strategy these shapes do not allow: a batch of one cannot be split)
are re-solved on the cost model with the weights fixed: parameters and buffers stay where
the plan keeps them (hard), every matched node keeps its strategy where the others allow
it (soft), and the solver's heuristic completes the choice, as it completes a manual layout
(``autopar.passes.planner.intra_op.completion``). Any choice runs exactly (codegen moves
each value to where its consumer needs it); the re-solve makes it a good one. A pipeline's
stages are found the same way (``relayout_stages``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from torch import fx

from autopar import costmodels
from autopar.passes.capture import Captured
from autopar.passes.costing import ZERO_LEVELS, build_costs
from autopar.passes.inference_costs import build_serving_costs
from autopar.passes.plan import Plan, check_mesh, planned_names
from autopar.passes.planner.untie import Restrictions, restrict
from autopar.passes.solve.heuristics import chain_relaxation_plan
from autopar.passes.solve.shrink import shrink_problem
from autopar.passes.strategy_graph import StrategyGraph


@dataclass
class Relayout:
    """A strategy per node of a capture, and which nodes the plan did not lay out as they are."""

    choice: dict[fx.Node, int]
    derived: list[str] = field(default_factory=list)  # node names re-solved (not the plan's strategy)


def planned_choice(graph: StrategyGraph, plan: Plan, program: str | None = None) -> dict[fx.Node, int]:
    """The plan's strategy index for each node of ``graph`` that the plan (or its ``program``)
    names with a strategy valid here (by identity: ``planned_names``)."""
    names = planned_names(graph.captured, plan, program)
    strategies = plan.strategies if program is None else plan.programs[program].strategies
    out = {}
    for node, ns in graph.nodes.items():
        wanted = strategies.get(names[node.name] or "")
        if wanted is None:
            continue
        index = next((i for i, s in enumerate(ns.strategies) if str(s) == wanted), None)
        if index is not None:
            out[node] = index
    return out


# The preset that prices a re-solve when the plan was priced on a measured profile (or none
# is recorded): the re-solve only ranks layouts of the ops the plan does not lay out, the
# weights being fixed, so a preset of the mesh's shape serves.
FALLBACK_PRESET = "h100"


def relayout(graph: StrategyGraph, plan: Plan, profile: costmodels.HardwareProfile | None = None,
             program: str | None = None) -> Relayout:
    """``graph``'s nodes laid out by ``plan`` (see the module docstring), as its ``program`` where
    named (a serving plan's "decode"); ``profile`` prices the re-solve of what the plan does not
    lay out (None: the plan's preset on this mesh's shape, else ``FALLBACK_PRESET``)."""
    check_mesh(graph, plan)
    matched = planned_choice(graph, plan, program)
    captured = graph.captured
    state = {n for n in graph.nodes if n.name in captured.params or n.name in captured.buffers}
    lost = sorted(n.name for n in state if n not in matched)
    if lost:
        raise ValueError(
            f"autopar: the plan places no {', '.join(lost[:4])}{' ...' if len(lost) > 4 else ''} as this capture "
            f"holds {'them' if len(lost) > 1 else 'it'}; expected the plan of this model (same parameters and "
            "buffers, same shapes). Re-plan for this model")
    if len(matched) == len(graph.nodes):
        return Relayout(matched)
    if profile is None:
        name = plan.hardware if plan.hardware in costmodels.PRESETS else FALLBACK_PRESET
        profile = costmodels.preset(name, graph.mesh_shape)
    # a serving plan's programs are priced as serving runs them: forward only, no ZeRO nodes
    serving = plan.inference is not None
    costs = build_serving_costs(graph, profile) if serving else build_costs(graph, profile)
    zero_node = {} if serving else costs.zero_node
    hard, soft = [], []
    for node, index in matched.items():
        if node in zero_node:  # a parameter: its placement at the plan's ZeRO level (3 is a placement)
            zi, per = zero_node[node], len(ZERO_LEVELS)
            level = plan.zero.get(captured.params[node.name], 0)
            level = level if level in ZERO_LEVELS else 0
            keep = np.full(len(costs.problem.node_time[zi]), np.inf)
            keep[index * per + ZERO_LEVELS.index(level)] = 0.0
            hard.append((zi, keep))
            continue
        keep = np.full(len(graph.nodes[node].strategies), np.inf)
        keep[index] = 0.0
        (hard if node in state else soft).append((costs.index[node], keep))
    shrunk = shrink_problem(costs.problem)
    restricted = restrict(costs.problem, shrunk, Restrictions(hard=hard, soft=soft))
    decisions = None
    if restricted is not None:
        decisions, _ = chain_relaxation_plan(replace(restricted.shrunk, memory_limit=None))
    if decisions is None:
        raise ValueError(
            "autopar: the plan's placements of the weights leave some op of this capture no valid strategy; "
            "expected a capture of the model the plan was made for. Re-plan for these inputs")
    expanded = restricted.shrunk.expand(decisions)
    choice = costs.choice(expanded) if serving else costs.choice(expanded)[0]  # training's: (choice, ZeRO levels)
    derived = [n.name for n in graph.nodes if matched.get(n) != choice[n]]
    return Relayout(choice, derived)


def relayout_stages(captured: Captured, plan: Plan) -> dict[str, int]:
    """Each op of ``captured`` (by name) -> its pipeline stage: the plan's for the op of the same
    identity, the rest by ``flow_stages``."""
    names = planned_names(captured, plan)
    planned = plan.pipeline.stage_of
    return flow_stages(captured, {n: planned[p] for n, p in names.items() if p in planned})


def flow_stages(captured: Captured, fixed: dict[str, int]) -> dict[str, int]:
    """Each op of ``captured`` (by name) -> its stage: ``fixed``'s where it names one; another
    runs in the latest stage of the values it reads, or, reading none (a factory op), in the
    earliest stage of its users: values flow forward only."""
    ops = list(captured.nodes("call_function"))
    out = {n.name: fixed[n.name] for n in ops if n.name in fixed}
    unplaced = []
    for node in ops:
        if node.name not in out:
            staged = [out[src.name] for src in node.all_input_nodes if src.name in out]
            if staged:
                out[node.name] = max(staged)
            else:
                unplaced.append(node)
    for node in reversed(unplaced):  # users first: a chain of factory ops goes where its end is read
        out[node.name] = min((out[u.name] for u in node.users if u.name in out), default=0)
    return out

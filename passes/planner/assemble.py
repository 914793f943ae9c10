"""Assignment -> Plan: one solver assignment becomes the Plan the runtime runs and
``explain()`` reads (placements, ZeRO levels, where parameters are stored, the prediction
and its per-node breakdown), the strategy choice worked out once per plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from torch import fx

from torch.distributed.tensor import Replicate, Shard

from autopar.passes.costing import Costs
from autopar.passes.state_costs import state_breakdown, zero_split_dim
from autopar.passes.placements import local_shape, spec_str
from autopar.passes.plan import Plan, Prediction, plan_from_choice
from autopar.passes.planner.reasons import planning_reasons
from autopar.passes.solve import SolveResult, edge_bytes, plan_costs
from autopar.passes.strategy_graph import tensor_inputs
from autopar.passes.zero3_memory import in_flight_bytes, plan_buckets


@dataclass
class Solved:
    """One intra-op solve: the costs, the solver's verdict and every hint's evaluation."""

    costs: Costs
    result: SolveResult | None  # None when a layout was only costed
    hint_times: dict[str, tuple[float, float]]  # layout -> (step seconds, bytes per device)
    hints: list = field(default_factory=list)  # completed Hints (layout_rules.Hint)



class Chosen(NamedTuple):
    """One solver assignment and what it chooses: each node's strategy and each parameter's
    ZeRO level (``Costs.choice``), worked out once and read by every step of assembling."""

    assignment: Sequence[int]
    choice: dict[fx.Node, int]
    zero: dict[fx.Node, int]


def chosen(costs: Costs, assignment: Sequence[int]) -> Chosen:
    choice, zero = costs.choice(assignment)
    return Chosen(list(assignment), choice, zero)


def memory_breakdown(costs: Costs, picked: Chosen) -> dict[str, float]:
    """Bytes per device by kind: parameters, gradients, optimizer, activations (buffers as
    parameters; the working copies of parameters that edges hold under a policy,
    ``SolveProblem.edge_memory``, and a saved value's copies in more placements than one,
    ``Costs.read_copy_bytes``, as activations), temporary (alive only while backward runs, and
    the ZeRO-3 collectives in flight beside compute, ``zero3_in_flight``);
    each kind at its most, as the solver's memory constraint adds them (``state_costs.at_peak``:
    at the step's peak)."""
    mesh = costs.graph.mesh_shape
    out = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0, "temporary": 0.0}
    choice, zero = picked.choice, picked.zero
    for ph, zi in costs.zero_node.items():
        spec = costs.graph.nodes[ph].strategies[choice[ph]].output
        val = ph.meta["val"]
        numel = math.prod(local_shape(tuple(val.shape), spec, mesh))
        shards = math.prod(mesh[a] for a, p in enumerate(spec) if isinstance(p, Replicate))
        for kind, b in state_breakdown(numel, zero[ph], shards, costs.precision).items():
            out[kind] += b
    for v, s in enumerate(picked.assignment):
        out["activations"] += float(costs.activation_memory[v][s])
        out["temporary"] += float(costs.temporary_memory[v][s])
        if v < len(costs.index):
            out["parameters"] += float(costs.state_memory[v][s])  # buffers; parameters sit on ZeRO nodes
    out["activations"] += float(edge_bytes(costs.problem, picked.assignment).sum())
    out["activations"] += sum(costs.read_copy_bytes(choice).values())  # a value saved in two placements
    out["temporary"] += zero3_in_flight(costs, picked, out["temporary"])
    return out


def zero3_in_flight(costs: Costs, picked: Chosen, temporary: float) -> float:
    """Bytes per device that a one-stage plan's ZeRO-3 collectives running beside backward (a
    bucket gathered ahead, one reduce-scattering: ``zero3_memory.in_flight_bytes``) add to its
    ``temporary`` bytes (the loss's): they run while the layers' backward does, the loss's
    temporaries before it, so the larger of the two is held."""
    return max(0.0, in_flight_bytes(plan_buckets(costs, picked.choice), costs.precision) - temporary)


def zero_levels(costs: Costs, picked: Chosen) -> dict[str, int]:
    """Qualified name -> ZeRO level: 3 where the placement splits the parameter over an axis on
    which a consumer needs it whole (gathered in forward), else the chosen level 0..2."""
    choice, zero = picked.choice, picked.zero
    graph = costs.graph
    out = {}
    for ph, level in zero.items():
        spec = graph.nodes[ph].strategies[choice[ph]].output
        gathered = False
        for user in ph.users:
            if user not in graph.nodes or graph.nodes[user].follows is not None:
                continue
            strategy = graph.nodes[user].strategies[choice[user]]
            for src, need in zip(tensor_inputs(user), strategy.inputs):
                if src is ph and need is not None:
                    gathered |= any(isinstance(p, Shard) and isinstance(q, Replicate) for p, q in zip(spec, need))
        out[graph.captured.params[ph.name]] = 3 if gathered else level
    return out


def predict(costs: Costs, picked: Chosen) -> Prediction:
    pc = plan_costs(costs.problem, picked.assignment)
    compute = sum(float(costs.compute[v][s]) for v, s in enumerate(picked.assignment))
    # (the difference of two float sums: clamp the rounding residue of a plan with no communication)
    communication = max(0.0, pc.total_time - compute)
    return Prediction(step_time=pc.total_time, compute=compute, communication=communication,
                      hidden_communication=pc.hidden, bubble=0.0, memory=memory_breakdown(costs, picked))


def node_breakdown(costs: Costs, assignment: Sequence[int]) -> dict[str, dict[str, float]]:
    """Per graph node: compute and incoming communication seconds, saved bytes, layer index."""
    pc = plan_costs(costs.problem, assignment)
    out: dict[str, dict[str, float]] = {}
    for v, node in enumerate(costs.nodes):
        row = out.setdefault(node.name, {"compute": 0.0, "comm": 0.0, "memory": 0.0})
        row["compute"] += float(costs.compute[v][assignment[v]])
        row["comm"] += float(pc.node_time[v] - costs.compute[v][assignment[v]])
        row["memory"] += float(pc.node_memory[v])
        if node in costs.layer_of:
            row["layer"] = costs.layer_of[node]
    for (src, dst, _), t, held in zip(costs.edge_inputs, pc.edge_time, pc.edge_memory):
        out[dst.name]["comm"] += float(t)
        out[dst.name]["memory"] += float(held)
    return out


def storage_specs(costs: Costs, picked: Chosen) -> dict[str, str]:
    """Qualified name -> where the parameter is STORED (``Plan.params``, passes/plan.py): its
    placement, except that at ZeRO 1-2 the axes it is replicated on split it too
    (``state_costs.zero_split_dim``), the runtime gathering it once per step."""
    graph, mesh = costs.graph, costs.graph.mesh_shape
    choice, zero = picked.choice, picked.zero
    out = {}
    for ph, level in zero.items():
        spec = list(graph.nodes[ph].strategies[choice[ph]].output)
        dim = zero_split_dim(tuple(ph.meta["val"].shape), tuple(spec), mesh) if level in (1, 2) else None
        if dim is not None:
            spec = [Shard(dim) if isinstance(p, Replicate) and mesh[a] > 1 else p for a, p in enumerate(spec)]
        out[graph.captured.params[ph.name]] = spec_str(tuple(spec))
    return out


def param_layers(costs: Costs) -> dict[str, int]:
    params = costs.graph.captured.params
    return {params[n.name]: layer for n, layer in costs.layer_of.items() if n.name in params}


def build_plan(solved: Solved, assignment: Sequence[int], *, kind: str, axis_names: Sequence[str]) -> Plan:
    """The Plan of one assignment of ``solved``'s problem, with its prediction and breakdown."""
    costs = solved.costs
    picked = chosen(costs, assignment)
    plan = plan_from_choice(costs.graph, picked.choice, kind=kind, axis_names=tuple(axis_names))
    plan.zero = zero_levels(costs, picked)
    plan.params = storage_specs(costs, picked)
    plan.predicted = predict(costs, picked)
    plan.breakdown = node_breakdown(costs, assignment)
    plan.param_layers = param_layers(costs)
    plan.candidates = {name: t for name, (t, m) in solved.hint_times.items()
                       if m <= (costs.problem.memory_limit or math.inf) * (1 + 1e-9)}
    if solved.result is not None and kind == "auto":
        fitting = {n: a for n, a in zip(solved.hint_times, costs.problem.hints) if n in plan.candidates}
        plan.reasons = planning_reasons(costs, assignment, fitting) + plan.reasons
        r = solved.result
        plan.solver = {"status": r.status, "method": r.method, "gap": r.gap, "seconds": r.solve_seconds,
                       "decisions": r.num_decision_nodes}
        if r.clock_cut:  # the wall clock, a safety net, stopped the deterministic search
            plan.solver["clock_cut"] = True
            plan.notes.extend(n for n in r.notes if "wall clock" in n)
    return plan



def record_recompute(plan: Plan, costs: Costs) -> None:
    if costs.recompute:
        layers = sorted(set(costs.layer_of.values()))
        plan.recompute = [f"layer {k}" for k in sorted(costs.recompute)]
        plan.reasons.append(f"activations do not fit: {len(plan.recompute)} of {len(layers)} repeated layers "
                            "are recomputed in backward (the fewest that fit)")

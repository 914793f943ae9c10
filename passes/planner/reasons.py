"""Why a plan: the comparisons the planner writes into ``Plan.reasons`` for ``explain()``.

For the costliest repeated layer, the collectives the chosen plan runs there (forward
resharding and the backward duals, gradient syncs included: the items of the prices
``autopar.passes.costing`` charges the solver) against those of the fastest manual layout that lays the layer out
differently: e.g. ``all_reduce on axis1 (tp) 0.8 ms/layer here; the best other layout, dp, runs
all_reduce on axis0 (dp) 3.1 ms/layer`` (an axis with a default name shows its role). And what each
mesh axis does in the plan.
"""

from __future__ import annotations

from typing import Sequence

from torch.distributed.tensor import Replicate, Shard

from autopar.passes.solve import evaluate_time
from autopar.passes.strategy_graph import tensor_inputs
from autopar.passes.costing import Costs
from autopar.passes.explain import duration
from autopar.passes.roles import AxisRole, label_axes


def layer_collectives(costs: Costs, assignment: Sequence[int], layer: int) -> dict[str, float]:
    """'<collective> on <axis>' (and 'bucket copies on <axis>', a parameter's packing into its
    bucket) -> seconds per step the step waits for (what hides behind compute left out), over
    the edges into ``layer``'s nodes: the items of the very prices the solver's edge tables
    hold (``Costs.edge_price``)."""
    names = costs.profile.axis_names
    return {f"{what} on {names[axis]}": t for (what, axis), t in _layer_charges(costs, assignment, layer).items()}


def _layer_charges(costs: Costs, assignment: Sequence[int], layer: int) -> dict[tuple[str, int], float]:
    """``layer_collectives`` by (collective or 'bucket copies', mesh axis)."""
    out: dict[tuple[str, int], float] = {}
    for edge, (_, dst, _) in enumerate(costs.edge_inputs):
        if costs.layer_of.get(dst) != layer:
            continue
        for charge in costs.edge_price(edge, assignment).charges:
            key = ("bucket copies" if charge.copies else charge.collective, charge.axis)
            out[key] = out.get(key, 0.0) + charge.seconds - charge.hidden  # what the step waits for
    return out


def axis_roles(costs: Costs, assignment: Sequence[int]) -> list[str]:
    """Per mesh axis, its roles (``AxisRole``) joined by '+': ``dp`` (the batch is split),
    ``tp`` (weights split and used split), ``fsdp`` (weights split and gathered before
    use), with how many weights; ``replica`` for none."""
    return ["+".join(f"{role} ({weights})" if weights else role for role, weights in axis.items())
            or f"{AxisRole.REPLICA}" for axis in _roles(costs, assignment)]


def _roles(costs: Costs, assignment: Sequence[int]) -> list[dict[str, str]]:
    """Per mesh axis, its roles -> how many weights they concern ('' for dp); none: a replica."""
    graph = costs.graph
    choice, _ = costs.choice(assignment)
    inputs = [n for n in graph.nodes if n.name in graph.captured.user_inputs]
    readers = [u for n in inputs for u in n.users if u in graph.nodes]
    params = [n for n in graph.nodes if n.name in graph.captured.params]
    roles = []
    for axis in range(len(graph.mesh_shape)):
        batch = any(isinstance(graph.nodes[n].strategies[choice[n]].output[axis], Shard) for n in inputs + readers)
        split = [n for n in params if isinstance(graph.nodes[n].strategies[choice[n]].output[axis], Shard)]
        gathered = [n for n in split if any(
            u in graph.nodes and graph.nodes[u].follows is None and any(
                src is n and need is not None and isinstance(need[axis], Replicate)
                for src, need in zip(tensor_inputs(u), graph.nodes[u].strategies[choice[u]].inputs))
            for u in n.users)]
        found = {f"{AxisRole.DP}": ""} if batch else {}
        if len(split) > len(gathered):
            found[f"{AxisRole.TP}"] = f"{len(split) - len(gathered)} weights split"
        if gathered:
            found[f"{AxisRole.FSDP}"] = f"{len(gathered)} weights gathered"
        roles.append(found)
    return roles


def planning_reasons(costs: Costs, assignment: Sequence[int], hints: dict[str, Sequence[int]]) -> list[str]:
    """Sentences for ``Plan.reasons``: axis roles, and the costliest layer against the best other layout."""
    names = costs.profile.axis_names
    links = [costs.profile.axis(a).link for a in range(len(names))]
    roles = axis_roles(costs, assignment)
    out = ["axes: " + ", ".join(f"{n} ({links[a].replace('_', '-')}, size {costs.graph.mesh_shape[a]}) as {roles[a]}"
                                for a, n in enumerate(names))]
    layers = sorted(set(costs.layer_of.values()))
    if not layers:
        return out
    per_layer = {}
    for layer in layers[:1] + layers[len(layers) // 2:len(layers) // 2 + 1]:
        per_layer[layer] = _layer_charges(costs, assignment, layer)
    layer = max(per_layer, key=lambda k: sum(per_layer[k].values()))
    mine = per_layer[layer]
    for name, other in sorted(hints.items(), key=lambda kv: _time(costs, kv[1])):
        theirs = _layer_charges(costs, other, layer)
        if theirs == mine:
            continue
        out.append(f"layer {layer}: {_describe(mine, _labels(costs, assignment))} = {duration(sum(mine.values()))}"
                   f"/layer here; the best other layout, {name}, runs {_describe(theirs, _labels(costs, other))} = "
                   f"{duration(sum(theirs.values()))}/layer")
        break
    return out


def _time(costs: Costs, assignment) -> float:
    return evaluate_time(costs.problem, assignment)


def _labels(costs: Costs, assignment: Sequence[int]) -> list[str]:
    """The mesh axes as ``explain()`` names them: a default name with its role under ``assignment``."""
    return label_axes(costs.profile.axis_names, ["+".join(roles) for roles in _roles(costs, assignment)])


def _describe(charges: dict[tuple[str, int], float], axes: Sequence[str], top: int = 3) -> str:
    if not charges:
        return "no collectives"
    parts = sorted(charges.items(), key=lambda kv: -kv[1])[:top]
    return " + ".join(f"{what} on {axes[axis]} {duration(t)}" for (what, axis), t in parts)

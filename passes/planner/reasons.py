"""Why a plan: the comparisons the planner writes into ``Plan.reasons`` for ``explain()``.

For the costliest repeated layer, the collectives the chosen plan runs there (forward
resharding and the backward duals, gradient syncs included: the items of the prices
``autopar.passes.costing`` charges the solver) against those of the fastest manual layout that lays the layer out
differently: e.g. ``tp on axis1: all_reduce on axis1 0.8 ms/layer beats dp's
all_reduce on axis0 3.1 ms/layer``. And what each mesh axis does in the plan.
"""

from __future__ import annotations

from typing import Sequence

from torch.distributed.tensor import Replicate, Shard

from autopar.passes.solve import evaluate_time
from autopar.passes.strategy_graph import tensor_inputs
from autopar.passes.costing import Costs
from autopar.passes.explain import duration
from autopar.passes.roles import AxisRole


def layer_collectives(costs: Costs, assignment: Sequence[int], layer: int) -> dict[str, float]:
    """'<collective> on <axis>' (and 'bucket copies on <axis>', a parameter's packing into its
    bucket) -> seconds per step, over the edges into ``layer``'s nodes: the items of the very
    prices the solver's edge tables hold (``Costs.edge_price``)."""
    names = costs.profile.axis_names
    out: dict[str, float] = {}
    for edge, (_, dst, _) in enumerate(costs.edge_inputs):
        if costs.layer_of.get(dst) != layer:
            continue
        for charge in costs.edge_price(edge, assignment).charges:
            key = f"{'bucket copies' if charge.copies else charge.collective} on {names[charge.axis]}"
            out[key] = out.get(key, 0.0) + charge.seconds
    return out


def axis_roles(costs: Costs, assignment: Sequence[int]) -> list[str]:
    """Per mesh axis, its roles (``AxisRole``) joined by '+': ``dp`` (the batch is split),
    ``tp`` (weights split and used split), ``fsdp`` (weights split and gathered before
    use), with how many weights; ``replica`` for none."""
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
        parts = [f"{AxisRole.DP}"] if batch else []
        if len(split) > len(gathered):
            parts.append(f"{AxisRole.TP} ({len(split) - len(gathered)} weights split)")
        if gathered:
            parts.append(f"{AxisRole.FSDP} ({len(gathered)} weights gathered)")
        roles.append("+".join(parts) or f"{AxisRole.REPLICA}")
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
        per_layer[layer] = layer_collectives(costs, assignment, layer)
    layer = max(per_layer, key=lambda k: sum(per_layer[k].values()))
    mine = per_layer[layer]
    for name, other in sorted(hints.items(), key=lambda kv: _time(costs, kv[1])):
        theirs = layer_collectives(costs, other, layer)
        if theirs == mine:
            continue
        out.append(f"layer {layer}: {_describe(mine)} = {duration(sum(mine.values()))}/layer here; the best "
                   f"other layout, {name}, runs {_describe(theirs)} = {duration(sum(theirs.values()))}/layer")
        break
    return out


def _time(costs: Costs, assignment) -> float:
    return evaluate_time(costs.problem, assignment)


def _describe(collectives: dict[str, float], top: int = 3) -> str:
    if not collectives:
        return "no collectives"
    parts = sorted(collectives.items(), key=lambda kv: -kv[1])[:top]
    return " + ".join(f"{k} {duration(v)}" for k, v in parts)

"""Why a plan: the comparisons the planner writes into ``Plan.reasons`` for ``explain()``.

For the costliest repeated layer, the collectives the chosen plan runs there (forward
resharding and the backward duals, gradient syncs included, as ``autopar.passes.costing``
prices them) against those of the fastest manual layout that lays the layer out
differently: e.g. ``tp on axis1: all_reduce on axis1 0.8 ms/layer beats dp's
all_reduce on axis0 3.1 ms/layer``. And what each mesh axis does in the plan.
"""

from __future__ import annotations

from typing import Sequence

from torch.distributed.tensor import Replicate, Shard

from autopar import costmodels
from autopar.passes.solve import evaluate_time
from autopar.passes.strategy_graph import tensor_inputs
from autopar.passes.placements import gradient_spec
from autopar.passes.costing import Costs, requires_grad
from autopar.passes.op_strategies import TensorMeta
from autopar.passes.explain import duration


def layer_collectives(costs: Costs, assignment: Sequence[int], layer: int, grad_nodes=None) -> dict[str, float]:
    """'<collective> on <axis>' -> seconds per step, over the edges into ``layer``'s nodes."""
    graph, profile = costs.graph, costs.profile
    names = profile.axis_names
    choice, _ = costs.choice(assignment)
    grad_nodes = requires_grad(graph) if grad_nodes is None else grad_nodes
    out: dict[str, float] = {}
    for src, dst, position in costs.edge_inputs:
        if costs.layer_of.get(dst) != layer:
            continue
        src_ns = graph.nodes[src]
        index = src_ns.follows[1] if src_ns.follows is not None else 0
        have = src_ns.strategies[choice[src]].outputs[index]
        strategy = graph.nodes[dst].strategies[choice[dst]]
        need = strategy.inputs[position]
        if need is None:
            continue
        meta = TensorMeta.of(src.meta["val"])
        shape, size, mesh = meta.shape, meta.dtype.itemsize, graph.mesh_shape
        steps = list(costmodels.reshard_plan(shape, size, have, need, mesh)) if have != need else []
        if src.name in graph.captured.params and have != need:
            steps *= 2  # gathered again in backward (FSDP)
        if src in grad_nodes:
            steps += costmodels.backward_reshard_plan(shape, size, have, need, mesh, gradient_spec(need, strategy.outputs))
        for s in steps:
            key = f"{s.collective} on {names[s.axis]}"
            t = costmodels.collective_time(s.collective, s.bytes, s.axis, profile,
                                           in_step=src.name not in graph.captured.params)
            out[key] = out.get(key, 0.0) + t
    return out


def axis_roles(costs: Costs, assignment: Sequence[int]) -> list[str]:
    """Per mesh axis, joined by '+': 'dp' (the batch is split), 'tp' (weights split and used
    split), 'fsdp' (weights split and gathered before use); 'replica' for none."""
    graph = costs.graph
    choice, _ = costs.choice(assignment)
    roles = []
    for axis in range(len(graph.mesh_shape)):
        readers = [u for n in graph.nodes if n.name in graph.captured.user_inputs for u in n.users
                   if u in graph.nodes]
        batch = any(isinstance(graph.nodes[n].strategies[choice[n]].output[axis], Shard)
                    for n in [n for n in graph.nodes if n.name in graph.captured.user_inputs]
                    + readers)
        split = [n for n in graph.nodes if n.name in graph.captured.params
                 and isinstance(graph.nodes[n].strategies[choice[n]].output[axis], Shard)]
        gathered = [n for n in split if any(
            u in graph.nodes and graph.nodes[u].follows is None and any(
                src is n and need is not None and isinstance(need[axis], Replicate)
                for src, need in zip(_inputs(u), graph.nodes[u].strategies[choice[u]].inputs))
            for u in n.users)]
        parts = ["dp"] if batch else []
        if len(split) > len(gathered):
            parts.append(f"tp ({len(split) - len(gathered)} weights split)")
        if gathered:
            parts.append(f"fsdp ({len(gathered)} weights gathered)")
        role = "+".join(parts) or "replica"
        roles.append(role)
    return roles


def _inputs(node):

    return tensor_inputs(node)


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
    grad_nodes = requires_grad(costs.graph)
    per_layer = {}
    for layer in layers[:1] + layers[len(layers) // 2:len(layers) // 2 + 1]:
        per_layer[layer] = layer_collectives(costs, assignment, layer, grad_nodes)
    layer = max(per_layer, key=lambda k: sum(per_layer[k].values()))
    mine = per_layer[layer]
    for name, other in sorted(hints.items(), key=lambda kv: _time(costs, kv[1])):
        theirs = layer_collectives(costs, other, layer, grad_nodes)
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

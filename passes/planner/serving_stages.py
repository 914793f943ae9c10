"""A serving plan with the mesh's outermost axis as a pipeline: the model's layers cut into
stages, each stage's ops laid out on the intra-op mesh.

Serving pipelines when the weights and cache do not fit otherwise: each stage holds its
layers' weights and its layers' key-value cache (the cache lives with the layers that write
it). With one micro-batch, the batch runs through the stages in turn, so a step's time is
the whole program's on the intra-op mesh plus the sends of what crosses each boundary
(``costmodels.collective_time`` of ``send_recv`` on the pipeline axis): a pipeline adds
latency to every token. With ``m`` micro-batches (the throughput objective: one per stage,
``m = p``) every stage works on a different micro-batch at once: a tick is the slowest
stage's time on one micro-batch (its ops, the moves into them and its send on), a decode
step of every sequence takes ``max(m, p)`` ticks, and the prefill ``m + p - 1`` (until the last
micro-batch's first token); each stage holds the cache of all ``m``. The intra-op layout is
the one-mesh plan of the whole model with the stages' memory together
(``autopar.passes.planner.serving_layout``); the repeated layers are cut into stages of
equal counts, the ops outside them where their values flow
(``autopar.passes.planner.relayout.flow_stages``); every stage must fit in a device.
"""

from __future__ import annotations

import math
from dataclasses import replace

from torch import fx

from autopar import costmodels
from autopar.passes.edge_costs import local_bytes
from autopar.passes.generation import Inference, Programs, is_cache
from autopar.passes.layers import find_layers
from autopar.passes.op_strategies import TensorMeta
from autopar.passes.plan import Pipeline, Plan
from autopar.passes.planner.pipeline import pipeline_profile
from autopar.passes.planner.relayout import flow_stages
from autopar.passes.planner.request import PlanningError, PlanRequest
from autopar.passes.explain import duration
from autopar.passes.planner.serving_layout import Joint, joint_problem, layout_candidates, plan_on_mesh, summary
from autopar.passes.strategy_graph import StrategyGraph


def pipelined(programs: Programs, inference: Inference, request: PlanRequest, p: int,
              intra: tuple[int, ...], layout: str | None = None, micro_batches: int = 1) -> Plan | None:
    """The serving plan of ``p`` stages over ``(p,) + intra`` (the module docstring), its
    intra-op part ``layout`` where named (else searched), or None where it does not fit or
    the model has fewer repeated layers than stages. ``micro_batches``: how many are in
    flight, ``programs`` captured at one of them."""
    m = micro_batches
    full = pipeline_profile(request, p, tuple(intra))
    names = ("pp",) + tuple(full.axis_names[1:])
    intra_profile = costmodels.HardwareProfile(machine=full.machine, backend=full.backend, mesh_shape=tuple(intra),
                                               device=full.device, axes=full.axes[1:], source=full.source)
    stage_request = replace(request.on_mesh(intra_profile, memory_limit=request.memory_bytes, axis_names=names[1:]),
                            layout=layout)
    joint = joint_problem(programs, inference, stage_request, cache_copies=m)
    stages = [layer_stages(graph, p) for graph in joint.graphs]
    if stages[0] is None:
        return None
    try:  # every stage's state together: p devices' memory, each stage checked after the cut
        plan = plan_on_mesh(joint, programs, inference, stage_request, memory_limit=request.memory_bytes * p)
    except PlanningError:
        return None
    assignment = _assignment(joint, plan)
    choice = joint.costs[0].choice(joint.parts(assignment)[0])
    held = _stage_memory(joint, plan, choice, stages[0], p)
    if max(held) > request.memory_bytes * (1 + 1e-9):
        return None
    ttft, tpot = _step_times(joint, assignment, stages, full, p, m)
    total = ttft + joint.steps * tpot
    batch = programs.batch * m
    plan.mesh_shape, plan.axis_names = (p,) + tuple(intra), names
    plan.pipeline = Pipeline(axis=0, stages=p, micro_batches=m, schedule="GPipe", stage_of=stages[0])
    plan.inference["batch"] = batch
    p_ = plan.predicted
    p_.communication += sum(w * sum(s) for w, s in zip((1, joint.steps), _sends(joint, assignment, stages, full, p)))
    p_.step_time, p_.time_to_first_token, p_.time_per_output_token = total, ttft, tpot
    p_.compute = total - p_.communication
    p_.tokens_per_second_per_device = batch * inference.new_tokens / total / (p * math.prod(intra))
    p_.memory_by_rank = [{**p_.memory, **_stage_kinds(joint, choice, stages[0], s)} for s in range(p)]
    p_.memory = p_.memory_by_rank[max(range(p), key=held.__getitem__)]
    tag = f"pp{p}" if m == 1 else f"pp{p}x{m}"
    candidates = layout_candidates(joint, stage_request)  # each priced with the sends of its own layout
    plan.candidates = {f"{name}[{tag}]": _generation(joint, a, stages, full, p, m)
                       for name, a in candidates.items() if name in plan.candidates}
    plan.reasons[0] = summary(plan)
    if m == 1:
        sends = [sum(s) for s in _sends(joint, assignment, stages, full, p)]
        plan.reasons.insert(1, f"pipeline of {p} stages on the outer axis, one batch through them in turn: the sends "
                               f"add {duration(sends[0])} to the first token and {duration(sends[1])} to each later one")
    else:
        plan.reasons.insert(1, f"pipeline of {p} stages on the outer axis, {m} micro-batches of {programs.batch} "
                               f"sequence(s) in flight: a decode step of every sequence takes {max(m, p)} ticks of the "
                               f"slowest stage ({duration(tpot / max(m, p))}), the prefill {m + p - 1}")
    return plan


def _step_times(joint: Joint, assignment: list[int], stages: list[dict[str, int]], profile, p: int,
                m: int) -> tuple[float, float]:
    """(time to first token, time per output token) of a pipeline of ``p`` stages with ``m``
    micro-batches in flight (the module docstring)."""
    sends = _sends(joint, assignment, stages, profile, p)
    if m == 1:
        return tuple(t + sum(s) for t, s in zip(joint.times(assignment), sends))
    ticks = []
    for costs, part, stage_of, out in zip(joint.costs, joint.parts(assignment), stages, sends):
        ticks.append(max(t + d for t, d in zip(_stage_times(costs, part, stage_of, p), out + [0.0])))
    return (m + p - 1) * ticks[0], max(m, p) * ticks[1]  # a token crosses the p stages before its next step


def _generation(joint: Joint, assignment: list[int], stages: list[dict[str, int]], profile, p: int, m: int) -> float:
    ttft, tpot = _step_times(joint, assignment, stages, profile, p, m)
    return ttft + joint.steps * tpot


def _stage_times(costs, part: list[int], stage_of: dict[str, int], p: int) -> list[float]:
    """Seconds of each stage's share of one program: its ops and the moves into them."""
    problem = costs.problem
    stage = [stage_of.get(node.name) for node in costs.nodes]
    out = [0.0] * p
    for v, s in enumerate(part):
        if stage[v] is not None:
            out[stage[v]] += float(problem.node_time[v][s])
    for u, v, r in problem.edges:
        if stage[v] is not None:
            out[stage[v]] += float(r[part[u], part[v]])
    return out


def _sends(joint: Joint, assignment: list[int], stages: list[dict[str, int]], profile, p: int) -> list[list[float]]:
    """Each program's seconds per step of the sends over each boundary between stages."""
    out = []
    for graph, costs, part, stage_of in zip(joint.graphs, joint.costs, joint.parts(assignment), stages):
        crossing = _crossing(graph, costs.choice(part), stage_of, p)
        out.append([costmodels.collective_time("send_recv", b, 0, profile, in_step=True) for b in crossing])
    return out


def layer_stages(graph: StrategyGraph, p: int) -> dict[str, int] | None:
    """Op name -> stage: repeated layer k of L in stage k * p // L, the other ops where their
    values flow; None with fewer than ``p`` layers."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    layer_of, _ = find_layers(graph, index, {})
    count = len(set(layer_of.values()))
    if count < p:
        return None
    fixed = {n.name: layer * p // count for n, layer in layer_of.items() if n.op == "call_function"}
    return flow_stages(graph.captured, fixed)


def _assignment(joint: Joint, plan: Plan) -> list[int]:
    """The joint assignment of ``plan``'s two programs (read back from their strategies)."""
    out = []
    for graph, laid in zip(joint.graphs, (plan.strategies, plan.programs["decode"].strategies)):
        for node, ns in graph.nodes.items():
            out.append(next(i for i, s in enumerate(ns.strategies) if str(s) == laid[node.name]))
    return out


def _state_stages(graph: StrategyGraph, stage_of: dict[str, int]) -> dict[fx.Node, set[int]]:
    """Each weight and cache placeholder -> the stages that read it (each holds a copy: a tied
    embedding and head are read by the first and the last; one no op reads, none)."""
    captured = graph.captured
    return {node: {stage_of[u.name] for u in node.users if u.name in stage_of} for node in graph.nodes
            if node.name in captured.params or node.name in captured.buffers}


def _stage_kinds(joint: Joint, choice: dict[fx.Node, int], stage_of: dict[str, int], stage: int) -> dict[str, float]:
    """A stage's weights (the model's parameters and buffers) and cache bytes per device."""
    graph, costs = joint.graphs[0], joint.costs[0]
    captured = graph.captured
    kinds = {"parameters": 0.0, "kv_cache": 0.0}
    for node, stages in _state_stages(graph, stage_of).items():
        if stage in stages:
            kind = "kv_cache" if is_cache(captured.buffers.get(node.name, "")) else "parameters"
            kinds[kind] += float(costs.held[costs.index[node]][choice[node]])
    return kinds


def _stage_memory(joint: Joint, plan: Plan, choice: dict[fx.Node, int], stage_of: dict[str, int],
                  p: int) -> list[float]:
    """Bytes per device of each stage: its weights and cache, and the prefill's activations
    (the whole program's: an upper bound on one stage's)."""
    activations = plan.predicted.memory["activations"]
    return [sum(_stage_kinds(joint, choice, stage_of, s).values()) + activations for s in range(p)]


def _crossing(graph: StrategyGraph, choice: dict[fx.Node, int], stage_of: dict[str, int], p: int) -> list[float]:
    """Bytes per device that cross each boundary: the values made before it and read after
    (the step's inputs from before the first stage), as their producers lay them out."""
    made = {n.name: -1 for n in graph.captured.nodes("placeholder") if n.name in graph.captured.user_inputs}
    made.update(stage_of)
    out = [0.0] * (p - 1)
    for node, ns in graph.nodes.items():
        if node.name not in made:
            continue
        last = max((stage_of.get(u.name, p) for u in node.users), default=made[node.name])
        spec = ns.strategies[choice[node]].outputs[0] if ns.strategies[choice[node]].outputs else None
        val = node.meta.get("val")
        if spec is None or not hasattr(val, "shape"):
            continue
        size = local_bytes(TensorMeta.of(val), spec, graph.mesh_shape)
        for b in range(max(made[node.name], 0), min(last, p - 1)):
            out[b] += size
    return out

"""The serving planner: a causal LM's prefill and decode on a mesh -> the Plan that serves a
workload (``autopar.passes.generation.Inference``) best.

The two programs (``autopar.passes.generation.capture_programs``) are costed as serving
runs them (``autopar.passes.inference_costs``: forward only, weights and cache held, nothing
kept for a backward) and solved as one problem (``autopar.passes.solve.joint``): the
prefill's times once, each decode step's ``new_tokens - 1`` times, the weights and the cache
one decision for both (a decode step reads the tensors the prefill wrote). So the objective
is one whole generation of the batch: the time to first token plus a decode step per token
after it. At a given batch that is also what the throughput objective maximises
(generated tokens per second per device); the throughput objective then takes the largest
batch that fits (``largest_batch``). Manual layouts (``replicated``, ``dp``, ``tp``,
``tp+dp``: weights and inputs placed as the layout says, the rest completed) are priced
alike and given to the solver as candidates: the plan is never predicted slower than the
best that fits. Memory is the weights and the cache per device plus the prefill's largest
set of values alive at once (``step_activation_bytes``): the solve's limit leaves room for
it, lowered and solved again while it does not fit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from autopar.passes.explain import duration
from autopar.passes.generation import Inference, Programs, capture_programs, is_cache
from autopar.passes.inference_costs import ServingCosts, build_serving_costs, step_activation_bytes
from autopar.passes.node_keys import node_keys
from autopar.passes.plan import Plan, Prediction, Program, plan_from_choice
from autopar.passes.planner.layouts import layout_placements
from autopar.passes.planner.request import PlanningError, PlanRequest
from autopar.passes.planner.untie import Restrictions, restrict
from autopar.passes.solve import SolveOptions, solve
from autopar.passes.solve.heuristics import chain_relaxation_plan
from autopar.passes.solve.joint import join, part_time
from autopar.passes.solve.shrink import shrink_problem
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph

GIB = 2.0 ** 30
# The manual layouts a serving plan is compared with: ZeRO and FSDP would gather the
# weights for every token, which no serving system does.
SERVING_LAYOUTS = ("replicated", "dp", "tp", "tp+dp")
# Solves of the joint problem while the prefill's activations do not fit beside the state.
MEMORY_ROUNDS = 3


def plan_serving(model, inference: Inference, request: PlanRequest) -> Plan:
    """The serving Plan of ``model`` for ``inference`` on ``request``'s mesh and hardware."""
    if inference.batch is None:
        return largest_batch(model, inference, request)
    programs = capture_programs(model, inference.batch, inference.prompt_len, inference.max_len)
    return plan_programs(programs, inference, request)


def largest_batch(model, inference: Inference, request: PlanRequest) -> Plan:
    """The throughput objective without a batch: the plan at one sequence prices a
    sequence's cache per device; the batch whose caches fill the memory the weights and
    activations leave is planned, halved while nothing fits."""
    one = plan_serving(model, replace(inference, batch=1), request)
    memory = one.predicted.memory
    per_sequence = memory.get("kv_cache", 0.0) + memory.get("activations", 0.0)
    room = request.memory_bytes - memory.get("parameters", 0.0)
    batch = max(1, int(room // per_sequence)) if per_sequence > 0 else 1
    while batch > 1:
        try:
            plan = plan_serving(model, replace(inference, batch=batch), request)
        except PlanningError:
            batch //= 2
            continue
        plan.reasons.insert(0, f"batch {batch}: the largest the memory holds (one sequence's cache and activations "
                               f"{per_sequence / GIB:.3g} GiB per device beside {memory.get('parameters', 0.0) / GIB:.3g} "
                               "GiB of weights)")
        return plan
    return one


def plan_programs(programs: Programs, inference: Inference, request: PlanRequest) -> Plan:
    """The serving Plan of captured ``programs`` (the module docstring); ``request.layout``:
    that manual layout, priced alike, no search."""
    calls: dict = {}
    graphs = [build_strategy_graph(captured, request.mesh_shape, calls) for captured in programs]
    costs = [build_serving_costs(graph, request.profile) for graph in graphs]
    steps = inference.new_tokens - 1  # decode steps after the prefill's token
    joint, offsets = join([(costs[0].problem, 1.0), (costs[1].problem, float(steps))], _shared_state(costs))
    limit = request.memory_bytes

    def activations(assignment: list[int]) -> float:  # the prefill's, the larger step
        return step_activation_bytes(graphs[0], costs[0].choice(assignment[:offsets[1]]))

    def fits(assignment: list[int]) -> bool:
        return _memory(joint, assignment) + activations(assignment) <= limit * (1 + 1e-9)

    candidates = {}
    for name in SERVING_LAYOUTS:
        if name == "tp+dp" and len(request.mesh_shape) < 2:
            continue
        assignment = _layout_assignment(name, costs, joint, offsets)
        if assignment is not None and assignment not in candidates.values():
            candidates[name] = assignment
    result = None
    if request.layout is not None:
        if request.layout not in candidates:
            raise PlanningError(f"autopar: the serving layout {request.layout!r} does not apply to this model on mesh "
                                f"{request.mesh_shape} (serving layouts: {', '.join(SERVING_LAYOUTS)}; a split must "
                                "divide the batch, heads and weights); pick another, or leave layout out")
        kind, assignment = request.layout, candidates[request.layout]
        if not fits(assignment):
            raise PlanningError(_too_big(programs, request, _memory(joint, assignment) + activations(assignment)))
    else:
        result = _solve(joint, list(candidates.values()), limit, activations, request)
        if result is None:
            least = min(_memory(joint, a) + activations(a) for a in candidates.values()) if candidates else math.inf
            raise PlanningError(_too_big(programs, request, least))
        assignment = result.assignment
        kind = next((name for name, a in candidates.items() if a == assignment), "auto")
    plan = _assemble(graphs, costs, assignment, offsets, inference, programs, request, kind, activations(assignment))
    plan.candidates = {name: _generation_time(costs, a, offsets, steps) for name, a in candidates.items() if fits(a)}
    if result is not None:
        plan.solver = {"status": result.status, "method": result.method, "gap": result.gap,
                       "seconds": result.solve_seconds, "decisions": result.num_decision_nodes}
    plan.reasons.extend(_reasons(plan, candidates, kind))
    return plan


def _solve(joint, hints: list[list[int]], limit: float, activations, request: PlanRequest):
    """The joint problem's best assignment that fits beside its prefill's activations: the
    solve's limit leaves room for them, lowered and solved again while it does not (None:
    nothing fits)."""
    reserve = 0.0
    for _ in range(MEMORY_ROUNDS):
        problem = replace(joint, memory_limit=limit - reserve, hints=hints)
        result = solve(problem, SolveOptions(time_limit_s=0.5 * request.time_limit_s))
        if not result.feasible:
            return None
        needed = activations(result.assignment)
        if result.memory + needed <= limit * (1 + 1e-9):
            return result
        reserve = max(2 * reserve, needed)
    return None


def _too_big(programs: Programs, request: PlanRequest, least: float) -> str:
    return (f"autopar: no serving layout of {programs.prefill.model_name} fits in {request.memory_bytes / GIB:.3g} GiB "
            f"per device on mesh {request.mesh_shape} at batch {programs.batch} and {programs.max_len} positions (the "
            f"least found needs {least / GIB:.3g} GiB with its activations); use more devices, a smaller batch or a "
            "shorter max_len")


def _shared_state(costs: list[ServingCosts]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The weights and cache of the decode program, each paired with the prefill's same tensor."""
    prefill, decode = costs
    keys = node_keys(prefill.graph.captured)
    by_key = {keys[n.name]: n for n in prefill.nodes if n.op == "placeholder"}
    state = {**decode.graph.captured.params, **decode.graph.captured.buffers}
    decode_keys = node_keys(decode.graph.captured)
    pairs = []
    for node in decode.nodes:
        if node.name in state:
            pairs.append(((0, prefill.index[by_key[decode_keys[node.name]]]), (1, decode.index[node])))
    return pairs


def _layout_assignment(name: str, costs: list[ServingCosts], joint, offsets: list[int]) -> list[int] | None:
    """Layout ``name``'s weights and inputs (``layout_placements``) on both programs, the rest
    completed by the solver's heuristic; None where the layout leaves an op no strategy."""
    hard = []
    for c, offset in zip(costs, offsets):
        fixed, _ = layout_placements(name, c.graph)
        for node, spec in fixed.items():
            ns = c.graph.nodes[node]
            keep = [0.0 if s.output == spec else math.inf for s in ns.strategies]
            if all(math.isinf(k) for k in keep):
                return None
            hard.append((offset + c.index[node], keep))
    restricted = restrict(joint, shrink_problem(joint), Restrictions(hard=[(v, np.array(k)) for v, k in hard]))
    if restricted is None:
        return None
    decisions, _ = chain_relaxation_plan(replace(restricted.shrunk, memory_limit=None))
    return None if decisions is None else [int(i) for i in restricted.shrunk.expand(decisions)]


def _memory(problem, assignment: list[int]) -> float:
    return float(sum(m[assignment[v]] for v, m in enumerate(problem.node_memory)))


def _generation_time(costs: list[ServingCosts], assignment: list[int], offsets: list[int], steps: int) -> float:
    prefill = part_time(costs[0].problem, assignment, offsets[0])
    decode = part_time(costs[1].problem, assignment, offsets[1])
    return prefill + steps * decode


def _assemble(graphs: list[StrategyGraph], costs: list[ServingCosts], assignment: list[int], offsets: list[int],
              inference: Inference, programs: Programs, request: PlanRequest, kind: str,
              activations: float) -> Plan:
    """The Plan of a joint ``assignment``: the prefill's strategies, the decode's as a
    ``Program``, and the prediction (one generation, its two parts, memory by kind)."""
    parts = [assignment[o:o + c.problem.num_nodes] for c, o in zip(costs, offsets)]
    prefill, decode = costs
    plan = plan_from_choice(graphs[0], prefill.choice(parts[0]), kind=kind, axis_names=request.names)
    plan.programs = {"decode": Program(strategies={n.name: str(graphs[1].nodes[n].strategies[i])
                                                   for n, i in decode.choice(parts[1]).items()},
                                       node_keys=node_keys(graphs[1].captured))}
    plan.inference = {**inference.to_dict(), "batch": programs.batch}
    plan.hardware = request.preset or request.profile.machine
    steps = inference.new_tokens - 1
    ttft, tpot = part_time(prefill.problem, parts[0]), part_time(decode.problem, parts[1])
    total = ttft + steps * tpot
    moves = prefill.communication(parts[0]) + steps * decode.communication(parts[1])
    captured = graphs[0].captured
    cache = {ph for ph, fqn in captured.buffers.items() if is_cache(fqn)}
    plan.predicted = Prediction(
        step_time=total, compute=total - moves, communication=moves,
        memory={"parameters": prefill.state_bytes(parts[0], set(captured.params)),
                "kv_cache": prefill.state_bytes(parts[0], cache), "activations": activations},
        time_to_first_token=ttft, time_per_output_token=tpot,
        tokens_per_second_per_device=programs.batch * inference.new_tokens / total / math.prod(request.mesh_shape))
    return plan


def _reasons(plan: Plan, candidates: dict[str, list[int]], kind: str) -> list[str]:
    p = plan.predicted
    lines = [f"serving {plan.inference['batch']} sequence(s) of {plan.inference['prompt_len']} prompt tokens up to "
             f"{plan.inference['max_len']}: time to first token {duration(p.time_to_first_token)}, "
             f"{duration(p.time_per_output_token)} per output token, "
             f"{p.tokens_per_second_per_device:.4g} tokens/s per device"]
    others = {name: t for name, t in plan.candidates.items() if name != kind}
    if others:
        best = min(others, key=others.get)
        lines.append(f"the best manual layout, {best}, generates in {duration(others[best])} against "
                     f"{duration(p.step_time)} ({others[best] / p.step_time:.3g}x)")
    missing = [name for name in SERVING_LAYOUTS if name not in candidates]
    if missing:
        lines.append(f"layouts that do not apply here: {', '.join(missing)}")
    return lines


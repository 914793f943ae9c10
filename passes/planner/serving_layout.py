"""A serving plan on one mesh: prefill and decode solved as one problem.

The two programs (``autopar.passes.generation.capture_programs``) are costed as serving
runs them (``autopar.passes.inference_costs``: forward only, weights and cache held, nothing
kept for a backward) and solved as one problem (``autopar.passes.solve.joint``): the
prefill's times once, each decode step's ``new_tokens - 1`` times, the weights and the cache
one decision for both (a decode step reads the tensors the prefill wrote). So the objective
is one whole generation of the batch: the time to first token plus a decode step per token
after it. Manual layouts (``replicated``, ``dp``, ``tp``, ``tp+dp``: weights and inputs placed
as the layout says, the rest completed) are priced alike and given to the solver as
candidates: the plan is never predicted slower than the best that fits. Memory is the
weights and the cache per device plus the prefill's largest set of values alive at once
(``step_activation_bytes``): the solve's limit leaves room for it, lowered and solved again
while it does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from torch.distributed.tensor import Replicate, Shard

from autopar.costmodels.units import gib_text
from autopar.passes.explain import duration
from autopar.passes.generation import Inference, Programs, is_cache
from autopar.passes.inference_costs import ServingCosts, build_serving_costs, step_activation_bytes
from autopar.passes.node_keys import node_keys
from autopar.passes.plan import Plan, Prediction, Program, plan_from_choice
from autopar.passes.placements import fits
from autopar.passes.planner.layout_rules import computing_rules
from autopar.passes.planner.layouts import axis_roles, hint
from autopar.passes.roles import AxisRole
from autopar.passes.planner.request import PlanningError, PlanRequest
from autopar.passes.planner.untie import Restrictions, restrict
from autopar.passes.solve import SolveOptions, SolveProblem, evaluate_time, solve
from autopar.passes.solve.heuristics import chain_relaxation_plan
from autopar.passes.solve.joint import join
from autopar.passes.solve.shrink import shrink_problem
from autopar.passes.strategy_graph import StrategyGraph, build_strategy_graph

# The manual layouts a serving plan is compared with: ZeRO and FSDP would gather the
# weights for every token, which no serving system does.
SERVING_LAYOUTS = ("replicated", "dp", "tp", "tp+dp")
# Pipelined serving layouts: the outermost axis a pipeline, the others laid out as named
PIPELINED_LAYOUTS = {"pp": "replicated", "pp+tp": "tp", "pp+dp": "dp"}
# Solves of the joint problem while the prefill's activations do not fit beside the state.
MEMORY_ROUNDS = 3


@dataclass
class Joint:
    """Prefill and decode on one mesh as one problem (``join``), with what reads it."""

    graphs: list[StrategyGraph]
    costs: list[ServingCosts]
    problem: SolveProblem
    offsets: list[int]
    steps: int  # decode steps after the prefill's token

    def parts(self, assignment: list[int]) -> list[list[int]]:
        """Each program's own assignment."""
        return [assignment[o:o + c.problem.num_nodes] for c, o in zip(self.costs, self.offsets)]

    def times(self, assignment: list[int]) -> tuple[float, float]:
        """(prefill, one decode step) seconds, unweighted."""
        return tuple(evaluate_time(c.problem, part) for c, part in zip(self.costs, self.parts(assignment)))

    def activations(self, assignment: list[int]) -> float:
        """The prefill's live activations (the larger step's) on ``assignment``."""
        return step_activation_bytes(self.graphs[0], self.costs[0].choice(self.parts(assignment)[0]))

    def memory(self, assignment: list[int]) -> float:
        """Weights and cache (held once) and the prefill's activations, per device."""
        state = sum(float(m[assignment[v]]) for v, m in enumerate(self.problem.node_memory))
        return state + self.activations(assignment)


def joint_problem(programs: Programs, inference: Inference, request: PlanRequest, cache_copies: int = 1) -> Joint:
    """The two programs as one problem. ``cache_copies``: how many batches' caches a device
    holds (a pipeline's micro-batches in flight each have their own; the programs are
    captured at one micro-batch)."""
    calls: dict = {}
    graphs = [build_strategy_graph(captured, request.mesh_shape, calls) for captured in programs]
    costs = [build_serving_costs(graph, request.profile) for graph in graphs]
    for c in costs:
        caches = {ph for ph, fqn in c.graph.captured.buffers.items() if is_cache(fqn)}
        for node, i in c.index.items():
            if node.name in caches:
                c.held[i] *= cache_copies  # in place: the problem's node_memory is the same array
    steps = inference.new_tokens - 1
    problem, offsets = join([(costs[0].problem, 1.0), (costs[1].problem, float(steps))], _shared_state(costs))
    return Joint(graphs, costs, problem, offsets, steps)


def plan_on_mesh(joint: Joint, programs: Programs, inference: Inference, request: PlanRequest,
                 memory_limit: float | None = None) -> Plan:
    """The serving Plan on ``request``'s mesh (no pipeline): the solver's and the manual
    layouts', the fastest that fits ``memory_limit`` (default the device's)."""
    limit = request.memory_bytes if memory_limit is None else memory_limit
    candidates = layout_candidates(joint, request)
    result = None
    if request.layout is not None:
        if request.layout not in candidates:
            raise PlanningError(f"autopar: the serving layout {request.layout!r} does not apply to this model on mesh "
                                f"{request.mesh_shape} (serving layouts: {', '.join(SERVING_LAYOUTS)}; a split must "
                                "divide the batch, heads and weights); pick another, or leave layout out")
        kind, assignment = request.layout, candidates[request.layout]
        if joint.memory(assignment) > limit * (1 + 1e-9):
            raise PlanningError(_too_big(programs, request, joint.memory(assignment), limit))
    else:
        result = _solve(joint, list(candidates.values()), limit, request)
        # the solver's layout, or a manual one where that fits and is faster (the solver's rounds
        # of room for activations can end with nothing, or with a slower layout, under its limits)
        options = ([result.assignment] if result is not None else []) + [
            a for a in candidates.values() if joint.memory(a) <= limit * (1 + 1e-9)]
        if not options:
            least = min((joint.memory(a) for a in candidates.values()), default=math.inf)
            raise PlanningError(_too_big(programs, request, least, limit))
        assignment = min(options, key=lambda a: _generation(joint, a))
        kind = next((name for name, a in candidates.items() if a == assignment), "auto")
    ttft, tpot = joint.times(assignment)
    plan = _assemble(joint, assignment, inference, programs, request, kind, ttft, tpot)
    plan.candidates = {name: _generation(joint, a) for name, a in candidates.items()
                       if joint.memory(a) <= limit * (1 + 1e-9)}
    if result is not None:
        plan.solver = {"status": result.status, "method": result.method, "gap": result.gap,
                       "seconds": result.solve_seconds, "decisions": result.num_decision_nodes}
        if result.clock_cut:  # the wall clock, a safety net, stopped the deterministic search
            plan.solver["clock_cut"] = True
    plan.reasons.append(summary(plan))
    missing = [name for name in SERVING_LAYOUTS if name not in candidates]
    if missing and request.layout is None:
        plan.reasons.append(f"layouts that do not apply here: {', '.join(missing)}")
    return plan


def layout_candidates(joint: Joint, request: PlanRequest) -> dict[str, list[int]]:
    """The serving layouts that apply on this mesh, completed (``_layout_assignment``), by name."""
    candidates = {}
    for name in SERVING_LAYOUTS:
        if request.layout is not None and name != request.layout:
            continue  # a pinned layout: only it is built
        if name == "tp+dp" and len(request.mesh_shape) < 2:
            continue
        assignment = _layout_assignment(name, joint)
        if assignment is not None and assignment not in candidates.values():
            candidates[name] = assignment
    return candidates


def _generation(joint: Joint, assignment: list[int]) -> float:
    ttft, tpot = joint.times(assignment)
    return ttft + joint.steps * tpot


def _solve(joint: Joint, hints: list[list[int]], limit: float, request: PlanRequest):
    """The joint problem's best assignment that fits beside its prefill's activations: the
    solve's limit leaves room for them, lowered and solved again while it does not (None:
    nothing fits)."""
    reserve = 0.0
    for _ in range(MEMORY_ROUNDS):
        problem = replace(joint.problem, memory_limit=limit - reserve, hints=hints)
        result = solve(problem, SolveOptions(time_limit_s=0.5 * request.time_limit_s))
        if not result.feasible:
            return None
        needed = joint.activations(result.assignment)
        if result.memory + needed <= limit * (1 + 1e-9):
            return result
        reserve = max(2 * reserve, needed)
    return None


def _too_big(programs: Programs, request: PlanRequest, least: float, limit: float) -> str:
    return (f"autopar: no serving layout of {programs.prefill.model_name} fits in {gib_text(limit)} "
            f"per device on mesh {request.mesh_shape} at batch {programs.batch} and {programs.max_len} positions (the "
            f"least found needs {gib_text(least)} with its activations); use more devices, a smaller batch or a "
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


def _layout_assignment(name: str, joint: Joint) -> list[int] | None:
    """Layout ``name``'s weights and inputs (``layout_placements``) on both programs, the rest
    completed by the solver's heuristic; None where the layout leaves an op no strategy.
    Each op computes as the layout's name promises (``layout_rules.computing_rules``, as in
    training: dp splits values by their batch alone, tp reads weights where they lie,
    ``replicated`` runs every op on whole values, so the layout moves nothing)."""
    hard, soft = [], []
    for c, offset in zip(joint.costs, joint.offsets):
        laid = hint(name, c.graph)
        fixed = laid.fixed
        soft += [(offset + v, keep) for v, keep in computing_rules(c, laid)]
        caches = {ph for ph, fqn in c.graph.captured.buffers.items() if is_cache(fqn)}
        for node, spec in fixed.items():
            if node.name in caches:
                spec = cache_placement(name, tuple(node.meta["val"].shape), c.graph.mesh_shape)
            ns = c.graph.nodes[node]
            keep = [0.0 if s.output == spec else math.inf for s in ns.strategies]
            if all(math.isinf(k) for k in keep):
                return None
            hard.append((offset + c.index[node], keep))
    restricted = restrict(joint.problem, shrink_problem(joint.problem),
                          Restrictions(hard=[(v, np.array(k)) for v, k in hard], soft=soft))
    if restricted is None:
        return None
    decisions, _ = chain_relaxation_plan(replace(restricted.shrunk, memory_limit=None))
    return None if decisions is None else [int(i) for i in restricted.shrunk.expand(decisions)]


def cache_placement(name: str, shape: tuple[int, ...], mesh: tuple[int, ...]) -> tuple:
    """Where layout ``name`` keeps a key-value cache (batch, heads, positions, head dim): split
    by sequence on its data-parallel axes, by heads on its tensor-parallel ones (replicated
    where the heads do not divide: more tensor-parallel ranks than key-value heads, as vLLM
    and Megatron keep it)."""
    wanted = [Shard(0) if role is AxisRole.DP else Shard(1) if role is AxisRole.TP else Replicate()
              for role in axis_roles(name, len(mesh))]
    spec: list = []
    for a, p in enumerate(wanted):  # each axis's split where it divides, given the axes before it
        trial = (*spec, p, *(Replicate(),) * (len(mesh) - a - 1))
        spec.append(p if fits(shape, trial, mesh) else Replicate())
    return tuple(spec)


def _assemble(joint: Joint, assignment: list[int], inference: Inference, programs: Programs,
              request: PlanRequest, kind: str, ttft: float, tpot: float) -> Plan:
    """The Plan of a joint ``assignment``: the prefill's strategies, the decode's as a
    ``Program``, and the prediction (one generation, its two parts, memory by kind)."""
    parts = joint.parts(assignment)
    (prefill, decode), graphs = joint.costs, joint.graphs
    plan = plan_from_choice(graphs[0], prefill.choice(parts[0]), kind=kind, axis_names=request.names)
    plan.programs = {"decode": Program(strategies={n.name: str(graphs[1].nodes[n].strategies[i])
                                                   for n, i in decode.choice(parts[1]).items()},
                                       node_keys=node_keys(graphs[1].captured))}
    plan.inference = {**inference.to_dict(), "batch": programs.batch}
    plan.hardware = request.preset or request.profile.machine
    total = ttft + joint.steps * tpot
    moves = prefill.communication(parts[0]) + joint.steps * decode.communication(parts[1])
    captured = graphs[0].captured
    cache = {ph for ph, fqn in captured.buffers.items() if is_cache(fqn)}
    weights = set(captured.params) | set(captured.buffers) - cache  # the model's own state (its buffers too)
    held = {"parameters": prefill.state_bytes(parts[0], weights), "kv_cache": prefill.state_bytes(parts[0], cache)}
    plan.predicted = Prediction(
        step_time=total, compute=total - moves, communication=moves,
        # activations: the step's and its inputs' (ids, positions, masks), so the kinds sum to the fit's bytes
        memory={**held, "activations": joint.memory(assignment) - sum(held.values())},
        time_to_first_token=ttft, time_per_output_token=tpot,
        tokens_per_second_per_device=programs.batch * inference.new_tokens / total / math.prod(request.mesh_shape))
    return plan


def summary(plan: Plan) -> str:
    """One line: the workload and what the plan predicts for it."""
    p = plan.predicted
    return (f"serving {plan.inference['batch']} sequence(s) of {plan.inference['prompt_len']} prompt tokens up to "
             f"{plan.inference['max_len']}: time to first token {duration(p.time_to_first_token)}, "
             f"{duration(p.time_per_output_token)} per output token, "
             f"{p.tokens_per_second_per_device:.4g} tokens/s per device")

"""The planner: a captured model on a mesh -> the fastest Plan that fits, with its Prediction.

Steps (``plan_intra_op`` for one intra-op mesh, ``plan_captured`` for the whole search):

1. strategies (``passes.strategies``) and costs (``passes.costing``) on the mesh;
2. manual layouts (the caller's hints: fixed placeholder placements and ZeRO levels,
   completed by ``complete`` with the solver's heuristic) evaluated on the same costs and handed to ``passes.solve.solve`` as candidate solutions, so the result
   is never predicted slower than the best layout that fits;
3. the intra-op solve (followers, tied layers, chain DP or CP-SAT, a deterministic search
   budget: the same call gives the same plan; the wall clock only a reported safety net);
   manual layouts that fit only with layers recomputed are costed so (``cost_layout``), and
   one predicted faster than the solver's plan is the plan (``fastest_of``);
4. the pipeline search (``passes.planner_pipeline``) over device factorisations into a
   pipeline axis times intra-op axes (``pipeline_factorisations``: with a preset every
   split of the outermost axis, with a measured profile the whole outermost axis, the
   only one it prices), stage cuts, micro-batches and schedules;
5. the Plan: placements, ZeRO levels, pipeline, and the predicted step time and memory
   broken down; per-node costs and the rejected alternatives feed ``Plan.explain()``.

A memory limit nothing meets raises an ``autopar:`` error with the least memory any
plan needs, its breakdown, and what would make it fit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from torch import fx
from torch.distributed.tensor import Partial, Replicate, Shard

import costmodels
from passes.costing import Costs, build_costs, state_breakdown
from passes.layers import layer_path
from passes.placements import fits, local_shape, spec_str
from passes.plan import Plan, Prediction, plan_from_choice
from passes.solve import SolveOptions, SolveResult, plan_costs, solve
from passes.solve.heuristics import chain_relaxation_plan
from passes.solve.shrink import ShrunkProblem, shrink_problem
from passes.strategies import StrategyGraph, tensor_inputs
from passes.explain import duration

GB = 1e9


class PlanningError(ValueError):
    """No plan fits, or the request cannot be planned."""


@dataclass
class Hint:
    """A manual layout: fixed placeholder placements (``fixed``) and ZeRO levels 0..2 per
    parameter; ``choice`` (a strategy per node) is filled in by ``complete`` unless given."""

    name: str
    choice: dict[fx.Node, int] | None = None
    zero: dict[fx.Node, int] = field(default_factory=dict)
    fixed: dict[fx.Node, tuple] = field(default_factory=dict)
    keep_axes: tuple[int, ...] = ()  # mesh axes on which parameters are used where they lie (Megatron)
    # mesh axes that split the data: ops reading a parameter use it whole there (gathered,
    # under FSDP) and split their work (else a tiny model "wins" by replicating everything)
    data_axes: tuple[int, ...] = ()
    everything_whole: bool = False  # every op computes on whole values (the no-parallelism baseline)


def complete(costs: Costs, hint: Hint, shrunk: ShrunkProblem | None = None) -> dict[fx.Node, int] | None:
    """A full choice from the hint's fixed placeholder placements and ZeRO levels, completed by
    the solver's own heuristic (chain relaxation plus local improvement, ``passes.solve.
    heuristics``) on the problem with every other placement of those placeholders forbidden:
    the best completion of the layout the heuristic finds, not a greedy pass that lets
    pending sums travel and pays for them later.

    ``shrunk``: ``shrink_problem(costs.problem)``, when the caller completes several hints.
    The restrictions are inf added to node times, which fold into the shrunk problem like
    any node cost (``ShrunkProblem.with_added_time``), so it is not shrunk again per hint;
    they are listed once per strategy table (tied layers share theirs)."""
    graph, problem = costs.graph, costs.problem
    replicated = tuple(Replicate() for _ in graph.mesh_shape)
    added: dict[int, np.ndarray] = {}  # problem node -> seconds added to each strategy (inf forbids it)
    tables: dict[tuple, object] = {}  # per strategy table: the allowed placements, the forbidden strategies

    def allowed_outputs(ns, want) -> list[int]:
        key = ("output", id(ns.strategies), want)
        if key not in tables:
            tables[key] = [i for i, s in enumerate(ns.strategies) if s.output == want] or [0]
        return tables[key]

    def restrict(v: int, forbid: np.ndarray) -> None:
        """Forbid where the node keeps some finite choice (else it is left as it was)."""
        combined = problem.node_time[v] + added.get(v, 0.0) + forbid
        if np.isfinite(combined).any():
            added[v] = added.get(v, 0.0) + forbid

    for node, ns in graph.nodes.items():
        if node.op != "placeholder":
            continue
        allowed = allowed_outputs(ns, hint.fixed.get(node, replicated))
        if node in costs.zero_node:
            zi, k = costs.zero_node[node], len(ns.strategies)
            times = problem.node_time[zi]
            per = len(times) // k
            keep = np.full(len(times), np.inf)
            level = min(hint.zero.get(node, 0), per - 1)
            for i in allowed:  # the layout's level where it means something, else level 0
                keep[i * per + (level if np.isfinite(times[i * per + level]) else 0)] = 0.0
            added[zi] = keep
        else:
            keep = np.full(len(ns.strategies), np.inf)
            keep[allowed] = 0.0
            added[costs.index[node]] = keep
    if hint.keep_axes or hint.data_axes:  # how the layout computes with its weights
        for src, dst, position in costs.edge_inputs:
            if src.name not in graph.captured.params:
                continue
            want = hint.fixed.get(src, replicated)
            strategies = graph.nodes[dst].strategies
            key = ("uses", id(strategies), position, want)
            if key not in tables:
                tables[key] = np.array([0.0 if s.inputs[position] is None or (
                    all(_used_where_it_lies(s.inputs[position][a], want[a]) for a in hint.keep_axes)
                    and all(isinstance(s.inputs[position][a], Replicate)
                            and not isinstance(s.outputs[0][a], Replicate) for a in hint.data_axes)) else np.inf
                    for s in strategies])
            restrict(costs.index[dst], tables[key])  # an op with no such strategy moves the weight after all
    if hint.everything_whole:
        for node, ns in graph.nodes.items():
            if node.op == "placeholder" or ns.follows is not None or node not in costs.index:
                continue
            key = ("whole", id(ns.strategies))
            if key not in tables:
                tables[key] = np.array([0.0 if all(p is None or all(isinstance(q, Replicate) for q in p)
                                                   for p in (*s.inputs, *s.outputs)) else np.inf
                                        for s in ns.strategies])
            restrict(costs.index[node], tables[key])
    try:
        base = shrunk if shrunk is not None else shrink_problem(problem)
        restricted = replace(base.with_added_time(added), memory_limit=None)
    except ValueError:  # the layout contradicts a tie or follower (e.g. tied layers placed apart)
        return None
    decisions, _ = chain_relaxation_plan(restricted)
    if decisions is None:
        return None
    choice, _ = costs.choice(restricted.expand(decisions))
    return choice


def _used_where_it_lies(need, have) -> bool:
    """A parameter placed ``have`` on an axis is read there as it lies: as placed, or, when
    whole, as a pending sum (a row-parallel layer's bias is added once, after the reduction:
    Replicate -> Partial moves nothing)."""
    return need == have or (isinstance(have, Replicate) and isinstance(need, Partial))


@dataclass
class Solved:
    """One intra-op solve: the costs, the solver's verdict and every hint's evaluation."""

    costs: Costs
    result: SolveResult | None  # None when a layout was only costed
    hint_times: dict[str, tuple[float, float]]  # layout -> (step seconds, bytes per device)
    hints: list[Hint] = field(default_factory=list)  # completed


def solve_graph(graph: StrategyGraph, profile: costmodels.HardwareProfile, hints: Sequence[Hint] = (), *,
                memory_limit: float | None, time_limit_s: float = 60.0, tie_layers: bool = True,
                recompute: bool = False, pricer=None) -> Solved:
    costs = build_costs(graph, profile, memory_limit=memory_limit, tie_layers=tie_layers, recompute=recompute,
                        pricer=pricer)
    shrunk = shrink_problem(costs.problem)  # once, for the completions and the solve
    for h in hints:
        if h.choice is None:
            h.choice = complete(costs, h, shrunk)
    hints = [h for h in hints if h.choice is not None]  # a layout that does not apply here is left out
    assignments = [costs.assignment(h.choice, h.zero) for h in hints]
    costs.problem.hints = assignments
    hint_times = {}
    for h, a in zip(hints, assignments):
        pc = plan_costs(costs.problem, a)
        hint_times[h.name] = (pc.total_time, float(pc.node_memory.sum()))
    options = SolveOptions(time_limit_s=max(time_limit_s, 0.5), relative_gap_limit=1e-3)
    return Solved(costs, solve(costs.problem, options, shrunk=shrunk), hint_times, list(hints))


def memory_breakdown(costs: Costs, assignment: Sequence[int]) -> dict[str, float]:
    """Bytes per device by kind: parameters, gradients, optimizer, activations (buffers as
    parameters), temporary (alive only while backward runs); each kind at its most, as the
    solver's memory constraint adds them (``costing.at_peak``: at the step's peak)."""
    mesh = costs.graph.mesh_shape
    out = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0, "temporary": 0.0}
    choice, zero = costs.choice(assignment)
    for ph, zi in costs.zero_node.items():
        spec = costs.graph.nodes[ph].strategies[choice[ph]].output
        val = ph.meta["val"]
        numel = math.prod(local_shape(tuple(val.shape), spec, mesh))
        shards = math.prod(mesh[a] for a, p in enumerate(spec) if isinstance(p, Replicate))
        for kind, b in state_breakdown(numel, zero[ph], shards, costs.precision).items():
            out[kind] += b
    for v, s in enumerate(assignment):
        out["activations"] += float(costs.activation_memory[v][s])
        out["temporary"] += float(costs.temporary_memory[v][s])
        if v < len(costs.index):
            out["parameters"] += float(costs.state_memory[v][s])  # buffers; parameters sit on ZeRO nodes
    return out


def zero_levels(costs: Costs, assignment: Sequence[int]) -> dict[str, int]:
    """Qualified name -> ZeRO level: 3 where the placement splits the parameter over an axis on
    which a consumer needs it whole (gathered in forward), else the chosen level 0..2."""
    choice, zero = costs.choice(assignment)
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


def predict(costs: Costs, assignment: Sequence[int]) -> Prediction:
    pc = plan_costs(costs.problem, assignment)
    compute = sum(float(costs.compute[v][s]) for v, s in enumerate(assignment))
    # (the difference of two float sums: clamp the rounding residue of a plan with no communication)
    communication = max(0.0, pc.total_time - compute)
    return Prediction(step_time=pc.total_time, compute=compute, communication=communication,
                      bubble=0.0, memory=memory_breakdown(costs, assignment))


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
    for (src, dst, _), t in zip(costs.edge_inputs, pc.edge_time):
        out[dst.name]["comm"] += float(t)
    return out


def storage_specs(costs: Costs, assignment: Sequence[int]) -> dict[str, str]:
    """Qualified name -> where the parameter is STORED (``Plan.params``, passes/plan.py): its
    placement, except that at ZeRO 1-2 the axes it is replicated on split it too (along the
    largest dim that divides), the runtime gathering it once per step."""
    graph, mesh = costs.graph, costs.graph.mesh_shape
    choice, zero = costs.choice(assignment)
    out = {}
    for ph, level in zero.items():
        spec = list(graph.nodes[ph].strategies[choice[ph]].output)
        if level in (1, 2):
            shape = tuple(ph.meta["val"].shape)
            axes = [a for a, p in enumerate(spec) if isinstance(p, Replicate) and mesh[a] > 1]
            for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
                trial = [Shard(d) if a in axes else p for a, p in enumerate(spec)]
                if fits(shape, tuple(trial), mesh):
                    spec = trial
                    break
        out[graph.captured.params[ph.name]] = spec_str(tuple(spec))
    return out


def param_layers(costs: Costs) -> dict[str, int]:
    params = costs.graph.captured.params
    return {params[n.name]: layer for n, layer in costs.layer_of.items() if n.name in params}


def build_plan(solved: Solved, assignment: Sequence[int], *, kind: str, axis_names: Sequence[str]) -> Plan:
    """The Plan of one assignment of ``solved``'s problem, with its prediction and breakdown."""
    costs = solved.costs
    choice, _ = costs.choice(assignment)
    plan = plan_from_choice(costs.graph, choice, kind=kind, axis_names=tuple(axis_names))
    plan.zero = zero_levels(costs, assignment)
    plan.params = storage_specs(costs, assignment)
    plan.predicted = predict(costs, assignment)
    plan.breakdown = node_breakdown(costs, assignment)
    plan.param_layers = param_layers(costs)
    plan.candidates = {name: t for name, (t, m) in solved.hint_times.items()
                       if m <= (costs.problem.memory_limit or math.inf) * (1 + 1e-9)}
    if solved.result is not None and kind == "auto":
        from passes.reasons import planning_reasons

        fitting = {n: a for n, a in zip(solved.hint_times, costs.problem.hints) if n in plan.candidates}
        plan.reasons = planning_reasons(costs, assignment, fitting) + plan.reasons
        r = solved.result
        plan.solver = {"status": r.status, "method": r.method, "gap": r.gap, "seconds": r.solve_seconds,
                       "decisions": r.num_decision_nodes}
        if r.clock_cut:  # the wall clock, a safety net, stopped the deterministic search
            plan.solver["clock_cut"] = True
            plan.notes.extend(n for n in r.notes if "wall clock" in n)
    return plan


def plan_intra_op(graph: StrategyGraph, profile: costmodels.HardwareProfile, hint_fn=None, *,
                  memory_limit: float | None, time_limit_s: float = 60.0, layout: str | None = None,
                  axis_names: Sequence[str] | None = None) -> tuple[Plan, Solved]:
    """Solve (or, with ``layout``, only cost that layout) on one mesh; raise if nothing fits."""
    hints = list(hint_fn(graph)) if hint_fn else []
    names = tuple(axis_names or profile.axis_names)
    if layout is not None:
        chosen = [h for h in hints if h.name == layout]
        if not chosen:
            raise PlanningError(f"autopar: layout {layout!r} does not apply here; expected one of "
                                f"{[h.name for h in hints]}")
        costs = build_costs(graph, profile, memory_limit=memory_limit)
        if chosen[0].choice is None:
            chosen[0].choice = complete(costs, chosen[0])
        if chosen[0].choice is None:
            raise PlanningError(f"autopar: layout {layout!r} contradicts this model's structure on mesh "
                                f"{graph.mesh_shape} (its placements break tied layers or followers); "
                                "expected a layout that places repeated layers alike; pick another layout")
        return layout_plan(costs, chosen[0], memory_limit, names)
    # Each solve gets a fixed search budget (deterministic: the same call, the same plan),
    # never what the wall clock left over.
    solved = solve_graph(graph, profile, hints, memory_limit=memory_limit, time_limit_s=time_limit_s)
    built: dict[int, Costs] = {}  # costs by number of recomputed layers, shared by the layouts
    manual = [cost_layout(solved.costs, h, memory_limit, built) for h in solved.hints]
    if not solved.result.feasible:  # activation checkpointing of every repeated layer, if that fits
        retry = solve_graph(graph, profile, hints, memory_limit=memory_limit, time_limit_s=time_limit_s,
                            recompute=True, pricer=solved.costs.pricer)
        if not retry.result.feasible:
            raise infeasible_error(retry, math.prod(graph.mesh_shape), " even recomputing every layer")
        solved = fewest_recomputed(retry, memory_limit, time_limit_s=max(time_limit_s / 2, 0.5))
    solved = fastest_of(solved, manual)
    plan = build_plan(solved, solved.result.assignment, kind="auto", axis_names=names)
    _record_recompute(plan, solved.costs)
    if solved.result.method.startswith("layout "):
        plan.reasons.append(f"the manual {solved.result.method} costed with its fewest recomputed layers was the "
                            "fastest plan that fits; the solver found none faster")
    return plan, solved


def layout_plan(costs: Costs, hint: Hint, memory_limit: float | None,
                axis_names: Sequence[str]) -> tuple[Plan, Solved]:
    """A completed manual layout's Plan, costed with the fewest recomputed layers that fit."""
    laid = cost_layout(costs, hint, memory_limit)
    solved = Solved(laid.costs, None, {hint.name: (laid.time, laid.memory)})
    plan = build_plan(solved, laid.assignment, kind=hint.name, axis_names=tuple(axis_names))
    _record_recompute(plan, laid.costs)
    return plan, solved


def _record_recompute(plan: Plan, costs: Costs) -> None:
    if costs.recompute:
        layers = sorted(set(costs.layer_of.values()))
        plan.recompute = [f"layer {k}" for k in sorted(costs.recompute)]
        plan.reasons.append(f"activations do not fit: {len(plan.recompute)} of {len(layers)} repeated layers "
                            "are recomputed in backward (the fewest that fit)")


@dataclass
class Laid:
    """A manual layout costed as it would run: with the fewest recomputed layers that fit."""

    name: str
    costs: Costs  # with its recomputed layers (``costs.recompute``)
    assignment: list[int]
    time: float
    memory: float
    fits: bool


def cost_layout(costs: Costs, hint: Hint, memory_limit: float | None, built: dict[int, Costs] | None = None) -> Laid:
    """``hint`` (completed) on ``costs``; where it does not fit, re-costed with the fewest
    repeated layers recomputed that make it fit (its placements kept), as auto plans are.
    ``built``: as ``recompute_to_fit``'s."""
    assignment = costs.assignment(hint.choice, hint.zero)
    fitted = recompute_to_fit(costs, assignment, memory_limit, built)
    used = fitted if fitted is not None else costs
    pc = plan_costs(used.problem, assignment)
    return Laid(hint.name, used, assignment, pc.total_time, float(pc.node_memory.sum()), fitted is not None)


def fastest_of(solved: Solved, manual: Sequence[Laid]) -> Solved:
    """``solved``, or the fastest manual layout that fits where it is predicted faster (a
    layout that fits only with layers recomputed is a different problem from the solver's,
    so the solver cannot see it as a candidate); ``hint_times`` from each layout's own costing."""
    hint_times = {laid.name: (laid.time, laid.memory) for laid in manual}
    mine = plan_costs(solved.costs.problem, solved.result.assignment).total_time if solved.result.feasible \
        else math.inf
    best = min((laid for laid in manual if laid.fits), key=lambda laid: laid.time, default=None)
    if best is None or best.time >= mine:
        return replace(solved, hint_times=hint_times)
    best.costs.problem.hints = [laid.assignment for laid in manual]
    result = replace(solved.result, status="feasible", assignment=list(best.assignment), objective=best.time,
                     memory=best.memory, method=f"layout {best.name}", gap=math.inf)  # no bound on its problem
    return Solved(best.costs, result, hint_times, solved.hints)


def recompute_to_fit(costs: Costs, assignment: Sequence[int], memory_limit: float | None,
                     built: dict[int, Costs] | None = None) -> Costs | None:
    """Costs under which ``assignment`` fits ``memory_limit`` with the fewest repeated layers
    recomputed (``costs`` itself when it fits as it is; the first k layers, which are alike);
    None when it does not fit even with every layer recomputed. Memory falls as layers are
    added (each one's activations leave, one layer's worth stays for backward to rebuild in),
    so k is estimated from none and every layer recomputed and then walked to the fewest.
    ``built``: costs by k already built for this graph and profile (shared among layouts)."""
    limit = (memory_limit or math.inf) * (1 + 1e-9)
    layers = sorted(set(costs.layer_of.values()))
    built = {} if built is None else built
    if set(costs.recompute) == set(layers[:len(costs.recompute)]):
        built.setdefault(len(costs.recompute), costs)
    memory: dict[int, float] = {}

    def at(k: int) -> float:
        """The assignment's bytes with the first k layers recomputed."""
        if k not in built:
            built[k] = build_costs(costs.graph, costs.profile, memory_limit=memory_limit, recompute=layers[:k],
                                   pricer=costs.pricer)
        if k not in memory:
            memory[k] = float(plan_costs(built[k].problem, assignment).node_memory.sum())
        return memory[k]

    if at(0) <= limit:
        return built[0]
    if not layers or at(len(layers)) > limit:
        return None
    per_layer = (at(0) - at(len(layers))) / max(len(layers) - 1, 1)
    k = max(1, min(len(layers), math.ceil((at(0) - limit) / per_layer) + 1)) if per_layer > 0 else len(layers)
    while k < len(layers) and at(k) > limit:
        k += 1
    while k > 1 and at(k - 1) <= limit:
        k -= 1
    return built[k]


def fewest_recomputed(solved: Solved, memory_limit: float | None, time_limit_s: float = 0.0) -> Solved:
    """The fewest layers recomputed that fit in memory, and the placements solved for them.

    ``solved`` recomputes every repeated layer. The layers are alike (tied), so each one
    recomputed saves the same bytes and costs the same time: the number ``k`` needed by
    ``solved``'s placements follows from their memory with none and with all recomputed,
    checked by re-costing. Those placements were chosen for all layers recomputed, though:
    recomputation makes compute (1 + 1 / (1 + BACKWARD_FACTOR)) times dearer and saved
    activations nearly free, which favours placements that compute less and keep more
    activations (e.g. activations replicated rather than split). With only ``k`` layers
    recomputed the trade differs, so re-solving can choose other placements. With
    ``time_limit_s`` > 0 the problem with ``k`` layers recomputed is solved once, given the
    kept placements as a candidate (so it is never worse), and the better one is kept.
    """
    costs, assignment = solved.costs, solved.result.assignment
    if not costs.layer_of or memory_limit is None:
        return solved
    fewer = recompute_to_fit(costs, assignment, memory_limit)
    if fewer is None or fewer is costs:
        return solved
    hints = costs.problem.hints
    fewer.problem.hints = hints + [list(assignment)]
    result = solved.result
    if time_limit_s > 0:
        again = solve(fewer.problem, SolveOptions(time_limit_s=time_limit_s, relative_gap_limit=1e-3))
        if again.feasible and again.objective < plan_costs(fewer.problem, assignment).total_time:
            result = again
    fewer.problem.hints = hints
    hint_times = {}
    for h, a in zip(solved.hints, hints):
        pc = plan_costs(fewer.problem, a)
        hint_times[h.name] = (pc.total_time, float(pc.node_memory.sum()))
    return Solved(fewer, result, hint_times, solved.hints)


def infeasible_error(solved: Solved, devices: int, what: str = "") -> PlanningError:
    costs, result = solved.costs, solved.result
    need = memory_breakdown(costs, result.min_memory_assignment)
    parts = ", ".join(f"{k} {v / GB:.3g} GB" for k, v in need.items())
    limit = costs.problem.memory_limit or 0.0
    total = sum(need.values())
    more = math.ceil(devices * total / max(limit, 1.0))
    return PlanningError(
        f"autopar: no plan fits in {limit / GB:.3g} GB per device{what}; expected a plan within the limit, "
        f"found the smallest predicted memory {total / GB:.3g} GB per device ({parts}). To fit: give devices "
        f"with at least {total / GB:.3g} GB, or about {more}+ devices instead of {devices}, or a smaller "
        f"batch or sequence (activations), or allow pipeline stages."
    )


def _profile(hardware, shape: tuple[int, ...], names) -> costmodels.HardwareProfile:
    if isinstance(hardware, str):
        return costmodels.preset(hardware, shape, names)
    if tuple(hardware.mesh_shape) != tuple(shape):
        raise PlanningError(f"autopar: the hardware profile is for mesh {hardware.mesh_shape}, found mesh {shape}; "
                            "measure or build a profile for this mesh shape")
    return hardware


def factorisations(shape: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """(P, intra-op shape) with P > 1 taken out of the outermost (slowest) axis."""
    out = []
    for p in range(2, shape[0] + 1):
        if shape[0] % p == 0:
            intra = tuple(s for s in (shape[0] // p,) + shape[1:] if s > 1) or (1,)
            out.append((p, intra))
    return out


def pipeline_factorisations(shape: tuple[int, ...], hardware) -> list[tuple[int, tuple[int, ...]]]:
    """The factorisations ``hardware`` can price: any (``factorisations``) for a preset, which
    is built for each; for a measured profile only the pipeline over the whole outermost axis,
    the intra-op mesh being the other measured axes (``planner_pipeline.pipeline_profile``)."""
    if isinstance(hardware, str):
        return factorisations(shape)
    return [(shape[0], tuple(shape[1:]) or (1,))] if shape[0] > 1 else []


def repeated_layer_count(captured) -> int:
    """How many repeated layers the model has (``passes.layers``): a pipeline of more stages
    than that has a stage without a layer, so it is not tried."""
    params = captured.params
    return len({where for node in captured.nodes() if (where := layer_path(node, params)) is not None})


# Seconds one pipeline depth takes to plan besides its solve (strategies and costs on its
# mesh, layout completion, recomputation fits, the stage search), per node of the captured
# graph. From the idle-machine run of benchmarks/plan_llama.py --size 70b --mesh 8 8 before
# this budget existed (about 5,900 nodes; search 52.5 s for 4 plans, up to 30 s of it the
# solvers' budget): 1 to 2 ms per node. At 1.5 ms that 70B call keeps all three depths at a
# 60 s limit; Megatron's 96-layer GPT (3,700 nodes) on 288 x 8 plans five of its 15 at 60 s,
# all at 300 s.
PLANNING_SECONDS_PER_NODE = 1.5e-3


def factorisation_budget(captured, time_limit_s: float) -> int:
    """How many pipeline depths the search plans: the half of ``time_limit_s`` the solvers do
    not get, over what one depth costs besides its solve (``PLANNING_SECONDS_PER_NODE`` per
    node of the captured graph); at least one. A count, not a clock: the same call plans the
    same depths."""
    per_depth = PLANNING_SECONDS_PER_NODE * len(captured.graph.nodes)
    return max(1, int(0.5 * time_limit_s / per_depth))


def next_factorisation(options: Sequence[tuple[int, tuple[int, ...]]], results: dict[int, float]) -> int | None:
    """Index into ``options`` (pipeline depths in increasing order) of the next one to try,
    given the predicted step times found so far (index -> seconds, inf where none fits); None
    when all are tried.

    Step time falls with depth while data-parallel traffic and memory shrink, and rises once
    the bubble and the per-stage imbalance dominate: about one valley. So first a spread (the
    middle, then the quarter points: a search cut short has seen shallow and deep pipelines
    alike), then a bisection of the untried depths between the best found and its tried
    neighbours (the larger side first, the shallower on a tie), then the rest nearest the best;
    while nothing fits, the deepest untried (a deeper pipeline holds less per device)."""
    n = len(options)
    untried = [i for i in range(n) if i not in results]
    if not untried:
        return None
    for seed in dict.fromkeys((n // 2, n // 4, (3 * n) // 4)):
        if seed not in results:
            return seed
    finite = {i: t for i, t in results.items() if math.isfinite(t)}
    if not finite:
        return max(untried)
    best = min(finite, key=lambda i: (finite[i], i))
    below = max((i for i in results if i < best), default=-1)
    above = min((i for i in results if i > best), default=n)
    if below < best - 1 or above > best + 1:
        if best - below >= above - best:
            return (below + best) // 2 if below >= 0 else (below + best + 1) // 2
        return (best + above + 1) // 2
    return min(untried, key=lambda i: (abs(i - best), -i))


def _no_slower_than_layouts(best: Plan, candidates: dict[str, float], graph, profile, hint_fn, limit: float,
                            axis_names) -> Plan:
    """``best``, or the manual layout (without a pipeline) predicted faster, costed the same way
    (the pipelines' own layouts already compete inside ``pipeline_plan``)."""
    flat = {name: t for name, t in candidates.items() if "[" not in name}
    if not flat or min(flat.values()) >= best.predicted.step_time * (1 - 1e-9):
        return best
    name = min(flat, key=flat.get)
    try:
        manual, _ = plan_intra_op(graph, profile, hint_fn, memory_limit=limit, layout=name, axis_names=axis_names)
    except PlanningError:
        return best
    if manual.predicted.step_time >= best.predicted.step_time or sum(manual.predicted.memory.values()) > limit:
        return best
    manual.reasons.append(f"the {name} layout ({duration(manual.predicted.step_time)}) beat the search's best "
                          f"({duration(best.predicted.step_time)}) under the same costing, so it is the plan")
    return manual


def plan_captured(captured, shape: tuple[int, ...], hardware, *, hint_fn=None, memory_limit: float | None = None,
                  time_limit_s: float = 60.0, pipeline: bool = True, layout: str | None = None,
                  axis_names: Sequence[str] | None = None, progress=None, outer_axis_only: bool = False) -> Plan:
    """Intra-op plan on ``shape``, and (``pipeline``) pipelined plans over factorisations; the fastest wins.
    ``progress(phase, done, total)``, if given, is called as each of the ``total`` search steps starts.
    ``outer_axis_only``: pipelines only over the whole outermost axis (a plan for a given device
    mesh keeps its shape); none on a 1-D mesh."""
    from passes.planner_pipeline import pipeline_plan
    from passes.strategies import build_strategy_graph

    started = time.perf_counter()
    report = progress or (lambda phase, done, total: None)
    profile = _profile(hardware, shape, axis_names)
    limit = memory_limit if memory_limit is not None else float(profile.device.memory_bytes)
    options = pipeline_factorisations(shape, hardware) if pipeline and layout is None else []
    if outer_axis_only:
        options = [(p, intra) for p, intra in options if p == shape[0] and tuple(intra) == tuple(shape[1:])]
    layers = repeated_layer_count(captured)
    too_deep = [(p, intra) for p, intra in options if p > max(layers, 1)]
    options = [(p, intra) for p, intra in options if p <= max(layers, 1)]
    budget = min(len(options), factorisation_budget(captured, time_limit_s))
    report("strategies", 0, 1 + budget)
    calls: dict = {}  # each op call's OpInfo, the same on every mesh: worked out once
    graph = build_strategy_graph(captured, shape, calls)
    # a fixed share, not what the clock left: the same call gets the same search (the rest of
    # the time: costs, completion, stage search)
    solver_time = 0.5 * time_limit_s / (1 + budget)
    best, error, candidates = None, None, {}
    where_of = lambda p, intra: f"pp{p}x{'x'.join(map(str, intra))}"  # noqa: E731
    tried = {"no pipeline": ""}
    report("no pipeline", 0, 1 + budget)
    try:
        best, _ = plan_intra_op(graph, profile, hint_fn, memory_limit=limit, time_limit_s=solver_time,
                                layout=layout, axis_names=axis_names)
        tried["no pipeline"] = duration(best.predicted.step_time)
        candidates.update(best.candidates)
    except PlanningError as exc:
        error, tried["no pipeline"] = exc, str(exc)
    results: dict[int, float] = {}  # option index -> predicted step seconds (inf: none fits)
    outcome: dict[int, str] = {}
    clock_cut = False
    while len(results) < budget and (i := next_factorisation(options, results)) is not None:
        p, intra = options[i]
        report(where_of(p, intra), len(results) + 1, 1 + budget)
        if time_limit_s - (time.perf_counter() - started) <= 0.02 * time_limit_s:
            clock_cut = True  # the wall clock, a safety net: the deterministic budget did not run out
            break
        candidate, outcome[i] = pipeline_plan(captured, p, intra, hardware, hint_fn, memory_limit=limit,
                                              time_limit_s=solver_time, shape=shape,
                                              graph=build_strategy_graph(captured, intra, calls))
        results[i] = candidate.predicted.step_time if candidate is not None else math.inf
        if candidate is None:
            continue
        candidates.update({f"{k_}[{where_of(p, intra)}]": t for k_, t in candidate.candidates.items()})
        if best is None or candidate.predicted.step_time < best.predicted.step_time:
            best = candidate
    for i, (p, intra) in enumerate(options):
        tried[where_of(p, intra)] = outcome.get(i) or (
            "not tried: out of time" if clock_cut else
            f"not tried: beyond the search budget of {budget} pipeline depths (next_factorisation's order)")
    for p, intra in too_deep:
        tried[where_of(p, intra)] = f"not tried: {p} stages for {layers} repeated layers"
    if best is None:
        raise error or PlanningError(f"autopar: no plan fits in {limit / GB:.3g} GB per device on mesh {shape}")
    best = _no_slower_than_layouts(best, candidates, graph, profile, hint_fn, limit, axis_names)
    best.notes.extend(f"{k}: {v}" for k, v in tried.items())
    if clock_cut:
        best.solver["clock_cut"] = True  # the wall clock, a safety net, left options out
    best.candidates = candidates
    best.solver["planning_seconds"] = time.perf_counter() - started
    best.solver["memory_limit"] = limit
    report("done", 1 + budget, 1 + budget)
    return best

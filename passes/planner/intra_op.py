"""The intra-op planner: one mesh, no pipeline -> the fastest Plan that fits.

Manual layouts (the caller's hints: fixed placeholder placements and ZeRO levels,
completed by ``complete`` with the solver's heuristic) are evaluated on the same costs and
handed to ``autopar.passes.solve.solve`` as candidate solutions, so the result is never
predicted slower than the best layout that fits. The solve has a deterministic search
budget (the same call gives the same plan; the wall clock is only a reported safety net).
Manual layouts that fit only with layers recomputed are costed so (``cost_layout``), and one
predicted faster than the solver's plan is the plan (``fastest_of``). A memory limit
nothing meets raises an ``autopar:`` error with the least memory any plan needs, its
breakdown, and what would make it fit. Pins (``request.constraints``, their ``roles`` on this
mesh) restrict the one problem the solve, the layouts' completion and their evaluation see
(``pin_restrictions``); a pinned recomputation is the only one costed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
from torch import fx
from torch.distributed.tensor import Replicate

from autopar import costmodels
from autopar.costmodels.units import GIB
from autopar.passes.costing import Costs, build_costs
from autopar.passes.explain import ranges
from autopar.passes.plan import Plan
from autopar.passes.planner.assemble import Solved, build_plan, chosen, memory_breakdown, record_recompute, zero3_in_flight
from autopar.passes.planner.constraints import check_recompute
from autopar.passes.planner.layout_rules import Hint, computing_rules
from autopar.passes.planner.pin_restrictions import PinMasks, broken, pin_masks, restricted
from autopar.passes.planner.request import DoesNotFit, PlanningError, PlanRequest
from autopar.passes.planner.untie import Restrictions, restrict
from autopar.passes.placements import spec_str
from autopar.passes.solve import SolveOptions, evaluate_memory, plan_costs, solve
from autopar.passes.solve.heuristics import chain_relaxation_plan
from autopar.passes.solve.shrink import ShrunkProblem, shrink_problem
from autopar.passes.strategy_graph import StrategyGraph


def complete(costs: Costs, hint: Hint, shrunk: ShrunkProblem | None = None) -> dict[fx.Node, int] | None:
    """A full choice from the hint's fixed placeholder placements and ZeRO levels, completed by
    the solver's own heuristic (chain relaxation plus local improvement, ``autopar.passes.solve.
    heuristics``) on the problem with every other placement of those placeholders forbidden:
    the best completion of the layout the heuristic finds, not a greedy pass that lets
    pending sums travel and pays for them later.

    ``shrunk``: ``shrink_problem(costs.problem)``, when the caller completes several hints.
    The restrictions are inf added to node times, which fold into the shrunk problem like
    any node cost (``ShrunkProblem.with_added_time``), so it is not shrunk again per hint;
    they are listed once per strategy table (tied layers share theirs). Tied layers the
    layout places differently are untied for it, never refused (``completion``). None only
    where its placements leave an op no strategy at all."""
    return completion(costs, hint, shrunk)[0]


def completion(costs: Costs, hint: Hint, shrunk: ShrunkProblem | None = None) -> tuple[dict[fx.Node, int] | None,
                                                                                       list[str]]:
    """``complete``'s choice, and what it had to give up for it: tied layers the layout places
    differently are split for it (``autopar.passes.planner.untie``), one reason per layout."""
    base = shrunk if shrunk is not None else shrink_problem(costs.problem)
    restricted = restrict(costs.problem, base, layout_restrictions(costs, hint))
    if restricted is None:
        return None, []
    decisions, _ = chain_relaxation_plan(replace(restricted.shrunk, memory_limit=None))
    if decisions is None:
        return None, []
    choice, _ = costs.choice(restricted.shrunk.expand(decisions))
    return choice, split_reasons(costs, hint, restricted.splits)


def layout_restrictions(costs: Costs, hint: Hint) -> Restrictions:
    """The hint as restrictions on ``costs.problem``: its placeholders' placements and ZeRO
    levels (hard), and how it computes (soft, ``computing_rules``: kept where possible)."""
    graph, problem = costs.graph, costs.problem
    replicated = tuple(Replicate() for _ in graph.mesh_shape)
    out = Restrictions(soft=computing_rules(costs, hint))
    tables: dict[tuple, object] = {}  # per strategy table: the allowed placements

    def allowed_outputs(ns, want) -> list[int]:
        key = ("output", id(ns.strategies), want)
        if key not in tables:
            tables[key] = [i for i, s in enumerate(ns.strategies) if s.output == want] or [0]
        return tables[key]

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
            out.hard.append((zi, keep))
        else:
            keep = np.full(len(ns.strategies), np.inf)
            keep[allowed] = 0.0
            out.hard.append((costs.index[node], keep))
    return out


def split_reasons(costs: Costs, hint: Hint, splits: list[list[list[int]]]) -> list[str]:
    """One line for ``explain()`` on the tied layers ``hint`` placed differently (none if none):
    how the layers were split, and one parameter (or op) placed differently, for example."""
    if not splits:
        return []
    layers = {" | ".join(_layer_ranges(costs, part) for part in parts) for parts in splits}
    example = next((parts for parts in splits if costs.nodes[parts[0][0]].name in costs.graph.captured.params),
                   splits[0])
    named = [costs.nodes[part[0]] for part in example[:2]]
    params = costs.graph.captured.params
    if all(n.name in params for n in named):
        shown = ", ".join(f"{params[n.name]} {spec_str(hint.fixed.get(n))}" for n in named)
    else:
        shown = ", ".join(n.name for n in named)
    return [f"layout {hint.name}: tied layers placed differently ({shown}) are solved apart: layers "
            f"{'; '.join(sorted(layers))} ({len(splits)} of {len(costs.problem.ties)} tied positions split)"]


def _layer_ranges(costs: Costs, part: list[int]) -> str:
    """The layers of a tie group's part, as ranges: ``0``, ``1-31``, ``0,2-3``."""
    return ranges(sorted({costs.layer_of[costs.nodes[v]] for v in part if costs.nodes[v] in costs.layer_of}), ",")


def solve_graph(graph: StrategyGraph, profile: costmodels.HardwareProfile, hints: Sequence[Hint] = (), *,
                memory_limit: float | None, time_limit_s: float = 60.0, tie_layers: bool = True,
                recompute: bool | Sequence[int] = False, pricer=None, masks: PinMasks | None = None) -> Solved:
    """The solve on ``graph``'s costs (``recompute``: the layers recomputed; ``masks``: the
    pins, restricting the problem the solve, the completions and their evaluation all see)."""
    costs = build_costs(graph, profile, memory_limit=memory_limit, tie_layers=tie_layers, recompute=recompute,
                        pricer=pricer)
    costs = pinned(costs, masks)
    shrunk = _shrunk(costs, masks)  # once, for the completions and the solve
    # one that does not apply, or (pinned) breaks a pin: left out
    hints = [h for h in completed(costs, hints, shrunk) if h.choice is not None
             and not pins_broken(costs, costs.assignment(h.choice, h.zero), masks)]
    assignments = [costs.assignment(h.choice, h.zero) for h in hints]
    costs.problem.hints = assignments
    hint_times = {}
    for h, a in zip(hints, assignments):
        pc = plan_costs(costs.problem, a)
        hint_times[h.name] = (pc.total_time, pc.memory)
    options = SolveOptions(time_limit_s=max(time_limit_s, 0.5), relative_gap_limit=1e-3)
    return Solved(costs, solve(costs.problem, options, shrunk=shrunk), hint_times, list(hints))



def pinned(costs: Costs, masks: PinMasks | None) -> Costs:
    """``costs`` restricted by the pins' ``masks`` (``pin_restrictions.restricted``), or as they are."""
    return costs if masks is None else restricted(costs, masks)


def _shrunk(costs: Costs, masks: PinMasks | None) -> ShrunkProblem:
    """``shrink_problem(costs.problem)``; where the pins leave a decision no strategy through
    followers or tied layers, an ``autopar:`` error naming them."""
    try:
        shrunk = shrink_problem(costs.problem)
        if masks is not None and any(not np.isfinite(t).any() for t in shrunk.node_time):
            raise ValueError("a decision of tied layers or followers has no strategy left")
        return shrunk
    except ValueError as exc:
        if masks is None:
            raise
        raise PlanningError(f"autopar: pins {', '.join(masks.pins())} cannot hold together on mesh {costs.graph.mesh_shape}: "
                            f"expected a strategy for every op that honours them, found none ({exc}); pin fewer "
                            "or other roles") from None


def pins_broken(costs: Costs, assignment: Sequence[int], masks: PinMasks | None) -> list[str]:
    """The pins ``assignment`` breaks (``pin_restrictions.broken``); [] without pins."""
    if masks is None:
        return []
    choice, zero = costs.choice(assignment)
    params = costs.graph.captured.params
    return broken(costs.graph, choice, {params[ph.name]: level for ph, level in zero.items()}, masks)


def completed(costs: Costs, hints: Sequence[Hint], shrunk: ShrunkProblem | None = None) -> list[Hint]:
    """Copies of ``hints`` with ``choice`` filled in by ``complete`` where it was not given
    (None where the layout does not apply on ``costs``); the caller's Hints are left as they were."""
    out = []
    for h in hints:
        if h.choice is None:
            choice, untied = completion(costs, h, shrunk)
            h = replace(h, choice=choice, untied=untied)
        out.append(h)
    return out


def plan_intra_op(graph: StrategyGraph, request: PlanRequest, *, solver_time_s: float = 60.0,
                  copies_fit: bool = True) -> tuple[Plan, Solved]:
    """Solve on one mesh (``request.mesh_shape``, priced by ``request.profile``) within
    ``solver_time_s`` per solve, or, with ``request.layout``, only cost that layout; raise if
    nothing fits. ``copies_fit``: solve again where the copies the solve cannot see put the plan
    over the limit (a pipeline's intra-op part: False)."""
    if tuple(graph.mesh_shape) != request.mesh_shape:
        raise PlanningError(f"autopar: the strategy graph is for mesh {graph.mesh_shape}, the request for mesh "
                            f"{request.mesh_shape}; build the graph on the request's mesh (a pipeline's intra-op "
                            "part: PlanRequest.on_mesh)")
    hints, limit, names = request.hints(graph), request.memory_bytes, request.names
    masks = request_masks(graph, request)
    if request.layout is not None:
        by_name = {h.name: h for h in hints}
        if request.layout not in by_name:
            raise unknown_layout(request.layout, by_name)
        costs = pinned(layout_costs(graph, request.profile, by_name[request.layout], limit), masks)
        return plan_layout(costs, by_name, request.layout, limit, names)
    # A saved value read in two placements keeps two copies, and ZeRO-3 runs a gather and a
    # reduce-scatter beside compute, which the solve cannot see (``Costs.read_copy_bytes``,
    # ``assemble.zero3_in_flight``): a plan they put over the limit is solved again with the limit
    # below what that plan's solve saw, less twice as much each round (the new plan may read in
    # other placements, gather other buckets). A pipeline's
    # intra-op part is not held to its loose limit: the stage search fits every rank with them.
    budget, pricer = limit, None
    for attempt in range(4 if copies_fit else 1):
        solved = _solve_within(graph, request, hints, budget, solver_time_s, masks, layouts_within=limit,
                               one_stage=copies_fit, pricer=pricer)
        pricer = solved.costs.pricer  # the prices do not depend on the limit: a new solve reuses them
        seen = _assignment_memory(solved.costs.problem, solved.result.assignment)
        over = seen + _unseen(solved.costs, solved.result.assignment, copies_fit) - (limit or math.inf)
        if over <= 0 or budget is None or not copies_fit:
            break
        budget = min(budget, seen) - over * 2 ** attempt  # below what this plan's solve saw
    else:
        raise PlanningError(
            f"autopar: the fastest plan found keeps {over / GIB:.3g} GiB over the {limit / GIB:.3g} GiB limit per device "
            "in copies of saved values read in two placements and ZeRO-3 collectives in flight after four solves "
            "with a lower limit; expected a "
            "plan within the limit. Give more memory per device or more devices, or plan with a layout (layout=).")
    if bad := pins_broken(solved.costs, solved.result.assignment, masks):
        raise PlanningError(f"autopar: pin {' and '.join(bad)} cannot hold on mesh {graph.mesh_shape}"
                            + (f" within {limit / GIB:.3g} GiB per device" if limit else "")
                            + ": expected a plan that honours it, the search found none; pin fewer or other roles, "
                            "or give more memory per device")
    plan = build_plan(solved, solved.result.assignment, kind="auto", axis_names=names)
    record_recompute(plan, solved.costs)
    if budget != limit:
        plan.reasons.append(f"solved within {budget / GIB:.3g} GiB of the {limit / GIB:.3g} GiB limit: the chosen placements "
                            "keep a second copy of a value saved in two placements, or a ZeRO-3 gather and reduce-scatter "
                            "in flight beside compute, which the solve cannot price")
    if solved.result.method.startswith("layout "):
        plan.reasons.append(f"the manual {solved.result.method} costed with its fewest recomputed layers was the "
                            "fastest plan that fits; the solver found none faster")
        chosen = next(h for h in solved.hints if f"layout {h.name}" == solved.result.method)
        plan.reasons.extend(chosen.untied)
        plan.notes.extend(chosen.notes)
    return plan, solved


def request_masks(graph: StrategyGraph, request: PlanRequest) -> PinMasks | None:
    """The request's pins on ``graph`` (its roles on this mesh, its ZeRO levels), or None."""
    if not request.pinned and request.roles is None:
        return None
    masks = pin_masks(graph, request.roles, request.constraints)
    return None if masks.empty else masks


def pinned_recompute(request: PlanRequest) -> str | tuple[int, ...] | None:
    """The recomputation the request pins ("none", "all", layer numbers), or None: searched."""
    return request.constraints.recompute if request.constraints is not None else None


def recompute_arg(policy: str | tuple[int, ...] | None) -> bool | list[int]:
    """``build_costs``' ``recompute`` for a pinned policy (None, "none": no layer)."""
    return True if policy == "all" else list(policy) if isinstance(policy, tuple) else False


def _solve_within(graph: StrategyGraph, request: PlanRequest, hints, limit: float | None,
                  solver_time_s: float, masks: PinMasks | None = None,
                  layouts_within: float | None = None, one_stage: bool = True, pricer=None) -> Solved:
    """The fastest of the solve within ``limit`` (every repeated layer recomputed, then the
    fewest, where nothing fits without) and the manual layouts that fit ``layouts_within``
    (default ``limit``) with what the solve cannot see of each (``_unseen``; a pipeline
    stage's, ``one_stage`` False: its copies alone, the stage search prices its gathers);
    with recomputation pinned, that recomputation only. ``pricer``: an earlier solve's on this
    graph and profile (``costing.Pricer``), whose prices this one reuses."""
    # Each solve gets a fixed search budget (deterministic: the same call, the same plan),
    # never what the wall clock left over.
    policy = pinned_recompute(request)
    layouts_within = limit if layouts_within is None else layouts_within

    def room(hint: Hint) -> float | None:  # the limit a manual layout's visible bytes must meet
        if layouts_within is None:
            return None
        return layouts_within - _unseen(solved.costs, solved.costs.assignment(hint.choice, hint.zero), one_stage)

    solved = solve_graph(graph, request.profile, hints, memory_limit=limit, time_limit_s=solver_time_s,
                         recompute=recompute_arg(policy), masks=masks, pricer=pricer)
    if policy is not None:
        check_recompute(request.constraints, len(set(solved.costs.layer_of.values())))
        if not solved.result.feasible:
            raise infeasible_error(solved, math.prod(graph.mesh_shape),
                                   f" with the pin {request.constraints.pin('recompute')}")
        return fastest_of(solved, [as_laid(solved.costs, h, room(h)) for h in solved.hints])
    built: dict[int, Costs] = {}  # costs by number of recomputed layers, shared by the layouts
    manual = [cost_layout(solved.costs, h, room(h), built) for h in solved.hints]
    if not solved.result.feasible:  # activation checkpointing of every repeated layer, if that fits
        # the layouts completed for the first solve keep their choices; the others are tried again
        done = {h.name: h for h in solved.hints}
        retry = solve_graph(graph, request.profile, [done.get(h.name, h) for h in hints], memory_limit=limit,
                            time_limit_s=solver_time_s, recompute=True, pricer=solved.costs.pricer, masks=masks)
        if not retry.result.feasible:
            raise infeasible_error(retry, math.prod(graph.mesh_shape), " even recomputing every layer",
                                   pipelines_off=not request.pipeline and graph.mesh_shape[0] > 1)
        solved = fewest_recomputed(retry, limit, time_limit_s=max(solver_time_s / 2, 0.5), masks=masks)
    return fastest_of(solved, manual)


def _unseen(costs: Costs, assignment: Sequence[int], one_stage: bool = True) -> float:
    """Bytes per device of ``assignment`` that the solve cannot see: the copies of values saved
    in two placements and, in a one-stage plan, the ZeRO-3 collectives in flight beside
    backward (a pipeline stage's are the stage search's: ``zero3_memory.forward_gather_memory``)."""
    picked = chosen(costs, assignment)
    copies = sum(costs.read_copy_bytes(picked.choice).values())
    if not one_stage:
        return copies
    temporary = sum(float(costs.temporary_memory[v][s]) for v, s in enumerate(assignment))
    return copies + zero3_in_flight(costs, picked, temporary)


def plan_layout(costs: Costs, hints: dict[str, Hint], name: str, memory_limit: float | None,
                axis_names: Sequence[str]) -> tuple[Plan, Solved]:
    """The manual layout ``name`` (one of ``hints``, by name) completed on ``costs`` and costed
    (``layout_plan``); a PlanningError when it does not apply on this mesh or contradicts the
    model's structure. ``autopar.plan(..., layout=name)`` and the benchmarks' layout rows."""
    if name not in hints:
        raise unknown_layout(name, hints)
    hint = completed(costs, [hints[name]])[0]
    if hint.choice is None:
        raise PlanningError(f"autopar: layout {name!r} has no completion on mesh {costs.graph.mesh_shape}: "
                            "expected every op to keep a strategy under its placements, found one left none "
                            "(an op that reads a placeholder in place, or one of a single strategy); "
                            "pick another layout")
    return layout_plan(costs, hint, memory_limit, axis_names)


def unknown_layout(name: str, hints: dict[str, Hint]) -> PlanningError:
    return PlanningError(f"autopar: layout {name!r} does not apply here; expected one of {list(hints)}")


def layout_costs(graph: StrategyGraph, profile: costmodels.HardwareProfile, hint: Hint,
                 memory_limit: float | None) -> Costs:
    """``build_costs`` for planning ``hint`` alone: its edge tables priced only between the
    strategies the layout leaves each node (``layout_allowed``), the only ones its completion
    can take, so its plan is the one full costs give, for a fraction of the pricing (most
    of it: resharding between strategies the layout forbids)."""
    bare = build_costs(graph, profile, memory_limit=memory_limit,
                       allowed={node: np.zeros(len(ns.strategies), dtype=bool) for node, ns in graph.nodes.items()})
    return build_costs(graph, profile, memory_limit=memory_limit, pricer=bare.pricer,
                       allowed=layout_allowed(bare, hint))


def layout_allowed(costs: Costs, hint: Hint) -> dict[fx.Node, np.ndarray]:
    """Per graph node, a mask of the strategies ``complete`` may give it under ``hint``: what
    ``restrict`` leaves finite. Its decisions (which soft restrictions it keeps, which ties it
    splits) read only which costs are finite, so they are made here on ``costs.problem`` with
    every edge table replaced by its finite pattern (0, inf where an in-place write forbids a
    move: the only inf a priced table holds), needing no edge priced. All False where the
    layout has no completion (as ``complete`` finds too)."""
    graph, problem = costs.graph, costs.problem
    pattern = []
    for (u, v, _), (src, dst, position) in zip(problem.edges, costs.edge_inputs):
        in_place = position == 0 and (src, dst) in graph.in_place
        pattern.append((u, v, np.where(np.isfinite(graph.in_place_mask(src, dst)), 0.0, np.inf) if in_place
                        else np.zeros((len(problem.node_time[u]), len(problem.node_time[v])))))
    finite = replace(problem, edges=pattern, hints=[])
    restricted = restrict(finite, shrink_problem(finite), layout_restrictions(costs, hint))
    out = {node: np.zeros(len(ns.strategies), dtype=bool) for node, ns in graph.nodes.items()}
    if restricted is None:
        return out
    shrunk = restricted.shrunk
    for node, v in costs.index.items():
        d = int(shrunk.node_class[v])
        taken = shrunk.index_maps[v][np.isfinite(shrunk.node_time[d])] if d >= 0 else shrunk.index_maps[v][:1]
        out[node][taken] = True
    return out


def layout_plan(costs: Costs, hint: Hint, memory_limit: float | None,
                axis_names: Sequence[str]) -> tuple[Plan, Solved]:
    """A completed manual layout's Plan, costed with the fewest recomputed layers that fit."""
    laid = cost_layout(costs, hint, memory_limit)
    solved = Solved(laid.costs, None, {hint.name: (laid.time, laid.memory)})
    plan = build_plan(solved, laid.assignment, kind=hint.name, axis_names=tuple(axis_names))
    record_recompute(plan, laid.costs)
    plan.reasons.extend(hint.untied)
    plan.notes.extend(hint.notes)
    return plan, solved



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
    return Laid(hint.name, used, assignment, pc.total_time, pc.memory, fitted is not None)


def as_laid(costs: Costs, hint: Hint, memory_limit: float | None) -> Laid:
    """``hint`` (completed) costed on ``costs`` as they are: its recomputation pinned."""
    assignment = costs.assignment(hint.choice, hint.zero)
    pc = plan_costs(costs.problem, assignment)
    return Laid(hint.name, costs, assignment, pc.total_time, pc.memory,
                pc.memory <= (memory_limit or math.inf) * (1 + 1e-9))


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
                                   pricer=costs.pricer, allowed=costs.allowed)
        if k not in memory:
            memory[k] = _assignment_memory(built[k].problem, assignment)
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


def _assignment_memory(problem, assignment: Sequence[int]) -> float:
    """``plan_costs(problem, assignment).memory``, the same float, without pricing its edges' times."""
    return evaluate_memory(problem, assignment)


def fewest_recomputed(solved: Solved, memory_limit: float | None, time_limit_s: float = 0.0,
                      masks: PinMasks | None = None) -> Solved:
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
    ``masks``: the pins, which the re-solve keeps to.
    """
    costs, assignment = solved.costs, solved.result.assignment
    if not costs.layer_of or memory_limit is None:
        return solved
    fewer = recompute_to_fit(costs, assignment, memory_limit)
    if fewer is None or fewer is costs:
        return solved
    fewer = pinned(fewer, masks)
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
        hint_times[h.name] = (pc.total_time, pc.memory)
    return Solved(fewer, result, hint_times, solved.hints)


def infeasible_error(solved: Solved, devices: int, what: str = "", pipelines_off: bool = False) -> DoesNotFit:
    """``pipelines_off``: pipeline stages were not searched but could be (an outermost axis
    over 1): then allowing them is a remedy; on a mesh whose outer axis is 1 it is none."""
    costs, result = solved.costs, solved.result
    need = memory_breakdown(costs, chosen(costs, result.min_memory_assignment))
    parts = ", ".join(f"{k} {v / GIB:.3g} GiB" for k, v in need.items())
    limit = costs.problem.memory_limit or 0.0
    total = sum(need.values())
    more = math.ceil(devices * total / max(limit, 1.0))
    return DoesNotFit(
        f"autopar: no plan fits in {limit / GIB:.3g} GiB per device{what}; expected a plan within the limit, "
        f"found the smallest predicted memory {total / GIB:.3g} GiB per device ({parts}). To fit: give devices "
        f"with at least {total / GIB:.3g} GiB, or about {more}+ devices instead of {devices}, or a smaller "
        f"batch or sequence, or the batch as accumulated micro-batches (accumulate=k: 1/k of the "
        f"activations)" + (", or allow pipeline stages (pipeline=True)." if pipelines_off else ".")
    )

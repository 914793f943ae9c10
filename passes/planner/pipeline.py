"""Pipeline plans: an intra-op solution cut into stages along a new outermost mesh axis.

For a device factorisation ``(P,) + intra`` (the pipeline axis outermost, on the slow
links; ``intra`` keeps the fast inner axes for the ops that talk most; priced by
``pipeline_profile``: a preset built for it, or a measured profile whose whole outermost
axis is the pipeline's), the intra-op assignment solved on ``intra`` for the whole batch
is turned into per-layer numbers (``autopar.passes.planner.layer_numbers``); the parameter-side
time paid once per step is spread ``1 / P`` per rank (balanced stages), as ``step_overhead``.

The Plan's strategies and parameter placements are on the intra-op mesh (each stage
runs its nodes there; ``autopar.passes.plan.choice_from_plan`` drops the pipeline axis).

``autopar.passes.solve.pipeline_search`` then cuts stages (before the pinned layers only,
where ``stage_starts`` is pinned: ``search``'s ``starts``), picks micro-batches and the
schedule (every ``Schedule``; zero bubble at 1 and 2 chunks per rank, ZB-V and DualPipe-V at
the 2 torch runs, none that splits backward with a layer recomputed: ``_without_split_recompute``). Recomputation is decided per stage by the stage
search: the fewest layers that make the stage fit for its micro-batches in flight, each keeping its inputs and
running its forward again (``autopar.passes.solve.stages``). Micro-batch counts are those whose
micro-batches divide over every axis that splits the batch (``autopar.passes.planner.microbatch``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from autopar import costmodels
from autopar.costmodels.profile import default_axis_names
from autopar.passes.costing import Costs, build_costs
from autopar.passes.layers import layer_path
from autopar.passes.node_keys import node_keys
from autopar.passes.plan import Pipeline, Plan, Prediction
from autopar.passes.planner.assemble import chosen, node_breakdown, param_layers, storage_specs, zero_levels
from autopar.passes.planner.constraints import MeshRoles, micro_batch_roles, pinned_schedules
from autopar.passes.planner.intra_op import PlanningError, pinned_recompute, plan_intra_op
from autopar.passes.planner.layer_numbers import LayerNumbers, layer_numbers, node_layers
from autopar.passes.planner.microbatch import batch_dims, batch_size, batch_split, valid_counts
from autopar.passes.planner.reasons import planning_reasons
from autopar.passes.planner.request import DoesNotFit, PlanRequest
from autopar.passes.planner.searched import stage_search_record
from autopar.passes.planner.stage_starts import layer_modules, layer_names, start_layers
from autopar.passes.solve.pipeline_search import (PipelineSearchResult, _fastest_first, deeper_while_faster,
                                                  search_pipeline, useful_depths)
from autopar.passes.solve.stages import LayerCosts
from autopar.passes.explain import duration
from autopar.passes.strategy_graph import build_strategy_graph


def search(num: LayerNumbers, pp_profile: costmodels.HardwareProfile, stages: int, micro_batch_counts, *,
           memory_limit: float, schedules=tuple(costmodels.Schedule), chunks_per_rank: Sequence[int] | None = None,
           recompute: bool = True, starts: Sequence[int] | None = None):
    """(Best pipeline option, the search's result) for ``stages`` ranks on axis 0, or None.
    ``chunks_per_rank``: the interleaved schedule's depths to try (a pinned layout fixes one);
    None: 2, then deeper ones (``useful_depths``) while each is faster than the last
    (``deeper_while_faster``). ``recompute`` False: no stage recomputes a layer (recomputation
    pinned: what the costs hold already). ``starts``: the only layers a (virtual) stage may
    start at besides the first (pinned stage boundaries): a send after any other layer takes
    an infinite time, so the stage search's exact cut is the pinned one.

    A stage that does not fit recomputes the fewest of its layers that make it fit
    (``stages.cut_stages``): such a layer keeps its inputs for every micro-batch in flight
    and runs its forward again, and backward rebuilds one layer of one micro-batch at a time."""
    count = len(num.act_time)
    barred = np.zeros(max(count - 1, 0))  # per layer: 0 where a stage may end after it, inf where not
    if starts is not None:
        allowed = set(starts)
        barred[[layer for layer in range(count - 1) if layer + 1 not in allowed]] = np.inf

    def layer_costs(p: int, m: int) -> LayerCosts:
        kept, saved = num.per_micro_batch(m)
        return LayerCosts(
            time=num.act_time / m, static_memory=num.held_once(m), activation_memory=kept,
            boundary_time=np.asarray(num.send_times(pp_profile, m)) + barred if count > 1 else None,
            step_overhead=num.step_overhead(p),
            recompute_saving=saved if recompute else None, recompute_time=num.forward / m if recompute else None,
            gradient_memory=num.gradients,
            accumulating=num.largest_gradient, temporary_memory=num.temporary / m,
            gather_memory=num.gather, scatter_memory=num.scatter, stage_io=num.stage_held(m),
            io_credit=num.io.credit / m, weight_grad_memory=num.weight_grads / m,
            regathered_memory=num.regathered, rebuilt_memory=num.rebuilt_per_micro_batch(m),
        )

    def run(schedules, depths) -> PipelineSearchResult:
        return search_pipeline(layer_costs, stage_counts=[stages], micro_batch_counts=list(micro_batch_counts),
                               schedules=schedules, chunks_per_rank=tuple(depths), memory_limit=memory_limit)

    schedules = tuple(map(costmodels.Schedule.parse, schedules))
    found = run(schedules, (2,) if chunks_per_rank is None else chunks_per_rank)
    if chunks_per_rank is None and costmodels.Schedule.INTERLEAVED_1F1B in schedules:
        found = deeper_while_faster(found, useful_depths(count, stages),
                                    lambda v: run((costmodels.Schedule.INTERLEAVED_1F1B,), (v,)))
    zero_bubble = costmodels.Schedule.INTERLEAVED_ZERO_BUBBLE
    if chunks_per_rank is None and zero_bubble in schedules:  # also one chunk per rank: ZB-H1, no extra sends
        found = _merged(found, run((zero_bubble,), (1,)))
    found = _without_split_recompute(found)
    return None if found.best is None else (found.best, found)


def _without_split_recompute(found: PipelineSearchResult) -> PipelineSearchResult:
    """``found`` with the options that recompute layers under a split backward rejected: a
    checkpointed layer is rebuilt for the input and again for the weight gradients, a second
    forward the stage costs do not price (the runtime runs such a plan, exactly)."""
    for option in found.options:
        if option.schedule.split_backward and option.cut is not None and any(option.cut.recomputed):
            option.step_time, option.rejected = math.inf, "recomputation under a split backward"
    return _merged(found)


def _merged(*results: PipelineSearchResult) -> PipelineSearchResult:
    """The options of ``results`` together, fastest first (``search_pipeline``'s order)."""
    return _fastest_first([option for result in results for option in result.options])


def rank_memory(num: LayerNumbers, option) -> list[dict[str, float]]:
    """Bytes by kind each pipeline rank holds at its peak, from the stage search's own numbers
    (``option.rank_peaks``, which its memory limit checked): the state of its stages' layers,
    the gradients and temporaries (a backward's: the loss's, a gradient being added) held at
    that instant, and the rest activations (micro-batches in flight, recomputed layers'
    inputs and one layer's rebuild)."""
    p, v = option.stages, option.chunks_per_rank
    out = []
    for rank, peak in enumerate(option.rank_peaks):
        layers = [layer for s in range(rank, p * v, p) for layer in option.cut.layers(s)]
        kinds = num.kinds[layers].sum(axis=0)
        held = {"parameters": float(kinds[0]), "gradients": peak.gradients, "optimizer": float(kinds[2]),
                "temporary": peak.temporary}
        out.append({**held, "activations": peak.total - sum(held.values())})
    return out


def recomputed_layers(num: LayerNumbers, cut, micro_batches: int) -> list[int]:
    """The layers each stage recomputes: its ``cut.recomputed[s]`` with the largest saving per
    micro-batch in flight."""
    saving = num.per_micro_batch(micro_batches)[1]
    out = []
    for s, k in enumerate(cut.recomputed):
        ranked = sorted(cut.layers(s), key=lambda layer: (-saving[layer], layer))
        out += ranked[:k]
    return sorted(out)


def pipeline_profile(request: PlanRequest, p: int, intra: tuple[int, ...]) -> costmodels.HardwareProfile:
    """The profile of the mesh ``(p,) + intra``, the pipeline axis first.

    A preset (``request.preset``) is built for that mesh. A measured profile prices only what was
    measured: the pipeline takes its whole outermost axis (whose send/recv fit prices the
    stage boundaries) and the intra-op mesh is the remaining axes; a 1-D profile gains an
    intra-op axis of size 1, where every collective is free (as the profiler records one).
    """
    names = ("pp",) + default_axis_names(len(intra) + 1)[1:]
    if request.preset is not None:
        return costmodels.preset(request.preset, (p,) + tuple(intra), names)
    hardware = request.profile
    shape = tuple(hardware.mesh_shape)
    if shape[0] != p or (shape[1:] or (1,)) != tuple(intra):
        raise ValueError(
            f"autopar: a measured profile of mesh {shape} prices a pipeline over its whole outermost axis "
            f"({shape[0]} stages over {shape[1:] or (1,)}), found {p} stages over {tuple(intra)}; "
            "measure a profile of the mesh you mean, or plan with a preset")
    if len(shape) > 1:
        return hardware
    free = {c: costmodels.CollectiveFit(alpha_s=0.0, beta_bytes_per_s=math.inf, source="axis of size 1")
            for c in costmodels.COLLECTIVES}
    one = costmodels.AxisProfile(name=names[1], size=1, link="intra_node", collectives=free)
    return costmodels.HardwareProfile(
        machine=hardware.machine, backend=hardware.backend, mesh_shape=(p, 1), device=hardware.device,
        axes=[hardware.axes[0], one], source=f"{hardware.source}; an intra-op axis of size 1 added for a pipeline")


def pipeline_plan(captured, p: int, intra: tuple[int, ...], request: PlanRequest, *, solver_time_s: float,
                  graph=None, schedules=tuple(costmodels.Schedule), roles: MeshRoles | None = None):
    """(Plan or None, one line saying what happened) for ``p`` stages over ``(p,) + intra``.

    ``request``: the whole mesh's (its hardware priced for this split by ``pipeline_profile``,
    its memory limit per device, its manual layouts, its pins); ``solver_time_s``: the intra-op
    solve's budget; ``graph``: the strategy graph on ``intra`` when the caller has it;
    ``schedules``: those the search may choose from; ``roles``: the pinned roles of ``intra``'s
    axes. Pins restrict the search itself: the intra-op problem (roles, ZeRO, and the batch kept
    whole where a pinned micro-batch count needs it: ``constraints.micro_batch_roles``), the
    micro-batch counts, schedules and depths the stage search tries, and its recomputation. The
    plan's ``solver["searched"]``: the schedules, chunks and micro-batch counts the stage search
    covered, and why it left any out (``autopar.passes.planner.searched``)."""

    full = pipeline_profile(request, p, tuple(intra))
    memory_limit = request.memory_bytes
    names = ("pp",) + full.axis_names[1:]
    # no overlap: a pipeline's stages sum their gradients after the schedule (``costmodels.overlap``)
    intra_profile = costmodels.HardwareProfile(
        machine=full.machine, backend=full.backend, mesh_shape=intra, device=full.device, axes=full.axes[1:],
        source=full.source)
    graph = graph if graph is not None else build_strategy_graph(captured, intra)
    pins = request.constraints
    batch = batch_size(graph)
    if why := _pins_unmet(pins, p, repeated_layer_count(captured), pinned_schedules(pins, schedules)[0]):
        return None, why
    if pins is not None and pins.micro_batches is not None:
        roles = micro_batch_roles(roles, intra, batch, pins.micro_batches)
        if isinstance(roles, str):
            return None, roles
    # the whole model's state over P stages: P times the budget before the cut checks it. Pins
    # may leave no placements that hold the whole batch's activations so (tensor parallel keeps
    # them whole): then the budget is that of the smallest micro-batch, and the stage search,
    # which holds micro-batches, decides what fits.
    budgets = [memory_limit * p] + ([memory_limit * p * _most_micro_batches(pins, batch)] if request.pinned else [])
    for budget in budgets:
        try:
            stage_request = request.on_mesh(intra_profile, memory_limit=budget, axis_names=names[1:], roles=roles)
            plan, solved = plan_intra_op(graph, stage_request, solver_time_s=solver_time_s, copies_fit=False)
            break
        except DoesNotFit as exc:
            if budget == budgets[-1]:
                return None, f"intra-op part does not fit ({str(exc) if request.pinned else str(exc)[:80] + '...'})"
        except PlanningError as exc:
            return None, f"intra-op part does not fit ({str(exc) if request.pinned else str(exc)[:80] + '...'})"
    costs = solved.costs
    policy = pinned_recompute(request)  # pinned: in the costs already, the stage search adds none
    if costs.recompute and policy in (None, "none"):  # else what a stage recomputes is the stage search's
        costs = build_costs(graph, intra_profile, memory_limit=memory_limit * p, pricer=costs.pricer)
    offered = tuple(map(costmodels.Schedule.parse, schedules))
    schedules, depths = pinned_schedules(pins, offered)
    left_out = {s.display: "the pins leave it out" for s in offered if s not in schedules}  # for Plan.solver
    if policy not in (None, "none"):  # recomputation pinned: no split backward runs it (``_without_split_recompute``)
        left_out.update({s.display: "recomputation is pinned, which no split backward runs"
                         for s in schedules if s.split_backward})
        schedules = tuple(s for s in schedules if not s.split_backward)
    candidates = [("auto", solved.result.assignment)]
    hints = solved.hints
    candidates += [({"dp": "pp+dp", "tp+dp": "3d"}.get(h.name, "pp+" + h.name), costs.assignment(h.choice, h.zero))
                   for h in hints]
    found = {}
    layers = node_layers(costs)
    if shared := parameter_across_layers(graph.captured, layers[0]):  # tied weights: no cut may part them
        return None, shared
    dims = batch_dims(graph, batch) if batch else {}
    starts = _pinned_starts(pins, captured, layers[0]) if pins is not None and pins.stage_starts else None
    searched: dict[tuple, tuple] = {}  # layouts that complete alike (tp+dp, tp+sp) are searched once
    splits: dict = {}  # batch_split's per (node, strategy), shared by the candidates
    for label, assignment in candidates:
        if (key := tuple(assignment)) not in searched:
            num = layer_numbers(costs, assignment, layers, dims)
            if len(num.act_time) < p:
                return None, f"{len(num.act_time)} layers for {p} stages"
            split = batch_split(graph, costs.choice(assignment)[0], batch, dims, splits) if batch else 1
            counts = valid_counts(batch, split) if batch else [1]
            if pins is not None and pins.micro_batches is not None:
                counts = [pins.micro_batches] if pins.micro_batches in (
                    valid_counts(batch, split, limit=batch) if batch else [1]) else []
            r = search(num, full, p, counts, memory_limit=memory_limit, schedules=schedules, chunks_per_rank=depths,
                       recompute=policy is None, starts=starts) if counts and schedules else None
            searched[key] = (r, num, split)
        r, num, split = searched[key]
        if r is not None:
            found[label] = (r, num, assignment, (batch or 0, split))
    if not found:
        return None, "no stage cut fits in memory with micro-batches that divide over the batch split" + (
            f" under the pins {pins}" if request.pinned else "")
    label, (r, num, assignment, batching) = min(found.items(), key=lambda kv: kv[1][0][0].step_time)
    out = _to_plan(costs, assignment, num, r, p, intra, names, batching)
    out.candidates = {k: v[0][0].step_time for k, v in found.items() if k != "auto"}
    out.solver = dict(plan.solver)
    out.solver["searched"] = stage_search_record((o for result, *_ in found.values() for o in result[1].options),
                                                 schedules, left_out)
    # the axes and costliest layer of the layout the stages run: a manual one that won says its own
    laid = plan.reasons if label == "auto" else planning_reasons(
        costs, assignment, {"the solver's intra-op choice": solved.result.assignment,
                            **{h.name: costs.assignment(h.choice, h.zero) for h in hints}})
    out.reasons = [r for r in laid if r.startswith(("axes: ", "layer "))] + out.reasons
    if label != "auto":
        out.reasons.append(f"the {label} layout's pipeline beat the solver's intra-op choice inside the pipeline")
    return out, f"{duration(out.predicted.step_time)} ({out.pipeline.schedule}, M={out.pipeline.micro_batches})"


def _pinned_starts(pins, captured, where: dict) -> list[int]:
    """The layer numbers (as ``where``, graph node -> layer, numbers them) of the pinned stage
    starts (``stage_starts.start_layers``)."""
    named = layer_modules(captured)
    number = layer_names(where, captured.params)
    return [number[named[k]] for k in start_layers(pins, captured)]


def _most_micro_batches(pins, batch: int | None) -> int:
    """The pinned micro-batch count, else the most the batch allows (``valid_counts``)."""
    if pins is not None and pins.micro_batches is not None:
        return pins.micro_batches
    return max(valid_counts(batch, 1, limit=batch)) if batch else 1


def _pins_unmet(pins, p: int, layers: int, schedules) -> str:
    """Why the pinned depth, micro-batch count and schedule cannot run ``p`` stages of
    ``layers`` repeated layers ("" when they can)."""
    if pins is None:
        return ""
    if pins.chunks is not None and p * pins.chunks > max(layers, 1):
        return f"chunks={pins.chunks} needs {p * pins.chunks} stages, and the model has {layers} repeated layers"
    if pins.micro_batches is not None:
        problems = [s.micro_batch_problem(p, pins.micro_batches) for s in schedules]
        if problems and all(problems):
            return f"micro_batches={pins.micro_batches}: {problems[0]}"
    return ""


def repeated_layer_count(captured) -> int:
    """How many repeated layers the model has (``autopar.passes.layers``): a pipeline of more stages
    than that has a stage without a layer, so it is not tried."""
    params = captured.params
    return len({where for node in captured.nodes() if (where := layer_path(node, params)) is not None})


def parameter_across_layers(captured, where: dict) -> str | None:
    """Why no stage cut is safe, or None: a parameter read in two layers (tied weights, such as
    an embedding that is also the output head) would be used by two stages, and a pipeline
    keeps each parameter in one stage (``autopar.runtime.stages.stage_parts`` refuses it).
    ``where``: graph node -> layer (``node_layers``)."""
    for node in captured.nodes("placeholder"):
        used = sorted({where[u] for u in node.users if u in where})
        if node.name in captured.params and len(used) > 1:
            return (f"parameter {captured.params[node.name]} is read in layers {used[0]} and {used[-1]} (tied): "
                    "a pipeline keeps each parameter in one stage")
    return None


def _to_plan(costs: Costs, assignment, num: LayerNumbers, found, p: int, intra, names, batching: tuple[int, int]):
    option, _ = found
    graph = costs.graph
    picked = chosen(costs, assignment)
    stage_of_layer = {}
    for s in range(len(option.cut.starts)):
        for layer in option.cut.layers(s):
            stage_of_layer[layer] = s
    m, v = option.micro_batches, option.chunks_per_rank
    bubble = option.schedule.bubble_time(option.cut.stage_time, v)
    overhead = num.step_overhead(p)
    by_rank = rank_memory(num, option)
    recomputed = sorted(set(recomputed_layers(num, option.cut, m)) | set(costs.recompute))  # a pinned policy's too
    busy = option.step_time - bubble - overhead
    frac = float(num.compute.sum() / max(num.act_time.sum(), 1e-300))
    optimizer = float(num.optimizer.sum()) / p
    predicted = Prediction(
        step_time=option.step_time, compute=busy * frac + optimizer,
        communication=busy * (1 - frac) + overhead - optimizer, bubble=bubble,
        memory=by_rank[int(np.argmax(option.rank_memory))], memory_by_rank=by_rank,
    )
    plan = Plan(
        model=graph.captured.model_name, mesh_shape=(p,) + tuple(intra), axis_names=names,
        strategies={n.name: str(ns.strategies[picked.choice[n]]) for n, ns in graph.nodes.items()},  # intra-op mesh
        node_keys=node_keys(graph.captured),
        params=storage_specs(costs, picked),
        zero=zero_levels(costs, picked),
        pipeline=Pipeline(axis=0, stages=p, micro_batches=m, schedule=option.schedule.display,
                          stage_of={n.name: stage_of_layer[num.layer_of_node[n]] for n in graph.nodes},
                          chunks_per_rank=v, batch_size=batching[0], batch_split=batching[1]),
        recompute=[f"layer {k}" for k in recomputed],
        predicted=predicted, kind="auto",
    )
    plan.breakdown = node_breakdown(costs, assignment)
    plan.param_layers = param_layers(costs)
    plan.reasons.append(
        f"pipeline of {p} stages on the slow outer axis, {m} micro-batches, {option.schedule.display}"
        f"{f' ({v} chunks per rank)' if v > 1 else ''}: bubble {duration(bubble)} of {duration(option.step_time)}"
        + (f"; {len(recomputed)} of {len(num.act_time)} layers recomputed in backward ("
           + ("as pinned" if costs.recompute else "few enough that each rank fits its peak in the schedule's order"
              if v > 1 else "per stage the fewest that fit its micro-batches in flight") + ")" if recomputed else ""))
    return plan

"""What pins cost: whether a plan honours them, and the record ``explain()`` prices them from.

``broken_pins`` checks a finished Plan against ``Constraints``: its pipeline (stages,
micro-batches, schedule, chunks, the layers its stages start at), its recomputed layers, and
its strategies against the same masks the pinned search restricts its problems with
(``pin_restrictions.pin_masks``, for any way the roles can be laid on its mesh:
``constraints.mesh_roles``). ``price_record`` is
``Plan.pins``: the pins, and the unpinned plan's step time, memory, layout and placements
(``placement_record``) with the pins it breaks, so a saved plan explains what its pins cost and
where the two differ.
"""

from __future__ import annotations

from typing import Any, Callable

from autopar.costmodels.schedules import Schedule
from autopar.passes.explain import stage_starts
from autopar.passes.plan import Plan, choice_from_plan
from autopar.passes.planner.constraints import Constraints, mesh_roles
from autopar.passes.planner.pin_restrictions import broken, pin_masks
from autopar.passes.planner.request import PlanningError
from autopar.passes.planner.stage_starts import plan_stage_starts, start_layers
from autopar.passes.strategy_graph import StrategyGraph


def broken_pins(plan: Plan, pins: Constraints, shape: tuple[int, ...], graph_on: Callable[[tuple[int, ...]],
                StrategyGraph], layers: int) -> list[str]:
    """The pins ``plan`` (made on mesh ``shape`` from this capture) breaks; [] when it honours
    all. ``graph_on(mesh)``: the capture's strategy graph on a mesh; ``layers``: how many
    repeated layers the model has."""
    out = _pipeline_broken(plan, pins) + _recompute_broken(plan, pins, layers)
    stages = plan.pipeline.stages if plan.pipeline is not None else 1
    mesh = (tuple(plan.mesh_shape[1:]) or (1,)) if plan.pipeline is not None else tuple(plan.mesh_shape)
    graph = graph_on(mesh)
    if pins.stage_starts and plan_stage_starts(plan, graph.captured) != list(start_layers(pins, graph.captured)):
        out.append(pins.pin("stage_starts"))
    laid = mesh_roles(pins, shape, stages)
    mesh_pins = [p for p in pins.pins() if p.split("=")[0] in ("tp", "dp", "axes", "layout")]
    if isinstance(laid, str):
        return list(dict.fromkeys(out + (mesh_pins or [laid])))
    choice = choice_from_plan(graph, plan)
    fewest = None
    for roles in laid:
        try:
            found = broken(graph, choice, plan.zero, pin_masks(graph, roles, pins))
        except PlanningError:  # a pin that cannot hold on this mesh: the pinned search says which
            found = pins.pins()
        if fewest is None or len(found) < len(fewest):
            fewest = found
    return list(dict.fromkeys(out + (fewest or [])))


def _pipeline_broken(plan: Plan, pins: Constraints) -> list[str]:
    pipeline = plan.pipeline
    found = {
        "pp": pipeline.stages if pipeline else 1,
        "micro_batches": pipeline.micro_batches if pipeline else None,
        "schedule": Schedule.parse(pipeline.schedule) if pipeline else None,
        "chunks": pipeline.chunks_per_rank if pipeline else None,
    }
    out = [f"{name}={getattr(pins, name)}" for name, value in found.items()
           if getattr(pins, name) is not None and getattr(pins, name) != value]
    if pins.layout is not None and ((pins.stages or 2) > 1) != (pipeline is not None):
        out.append(f"layout={pins.layout}")
    if pins.axes is not None and pins.axes[0] == "pp" and (pipeline is None or pipeline.stages != plan.mesh_shape[0]):
        out.append("axes=" + ",".join(a or "*" for a in pins.axes))
    return out


def _recompute_broken(plan: Plan, pins: Constraints, layers: int) -> list[str]:
    policy = pins.recompute
    if policy is None:
        return []
    wanted = set() if policy == "none" else set(range(layers)) if policy == "all" else set(policy)
    found = {int(text.split()[-1]) for text in plan.recompute}
    return [] if found == wanted else [p for p in pins.pins() if p.startswith("recompute=")]


def price_record(pins: Constraints, pinned: Plan, unpinned: Plan | None, breaks: list[str] | None,
                 priced: bool = True) -> dict[str, Any]:
    """``Plan.pins`` of ``pinned``: the pins (as written and as ``Constraints.to_dict``), its
    layout in words, the unpinned plan's step time, memory and layout (None: no plan fits
    without them either, or ``priced`` False: not searched), and the pins it breaks ([]: it
    honours them all, so it is the plan)."""
    record: dict[str, Any] = {"pins": pins.pins(), "constraints": pins.to_dict(), "layout": layout_words(pinned),
                              "unpinned": None, "broken": list(breaks or []), "priced": priced}
    if unpinned is not None:
        record["unpinned"] = {"step_time": unpinned.predicted.step_time,
                              "memory": sum(unpinned.predicted.memory.values()), "layout": layout_words(unpinned),
                              "placement": placement_record(unpinned)}
    return record


def placement_record(plan: Plan) -> dict[str, Any]:
    """What ``explain()`` compares a pinned plan with, layer by layer (``explain.pin_diff``): the
    parameters' placements and ZeRO levels, the layer each parameter is in, the recomputed
    layers, the layers its stages start at."""
    return {"params": dict(plan.params), "zero": dict(plan.zero), "param_layers": dict(plan.param_layers),
            "recompute": list(plan.recompute), "stage_starts": stage_starts(plan)}


def layout_words(plan: Plan) -> str:
    """A plan's layout in a line: its pipeline, its axes' roles, its recomputation."""
    parts = []
    if plan.pipeline is not None:
        p = plan.pipeline
        parts.append(f"{p.stages} pipeline stages, {p.micro_batches} micro-batches, {p.schedule}"
                     + (f" ({p.chunks_per_rank} chunks per rank)" if p.chunks_per_rank > 1 else ""))
    else:
        parts.append("no pipeline")
    parts += [r for r in plan.reasons if r.startswith("axes: ")][:1]
    levels = sorted(set(plan.zero.values()))
    if levels:
        parts.append("ZeRO " + "/".join(map(str, levels)))
    parts.append(f"{len(plan.recompute)} layers recomputed" if plan.recompute else "no layer recomputed")
    return "; ".join(parts)

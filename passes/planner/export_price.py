"""The export's pricer: a written module's layout (its pins, ``autopar.passes.export.price``)
planned on the plan's mesh and hardware by the planner's own search, with no memory limit.

Loading this module hands it to the export (``use_pricer``); ``autopar`` loads it."""

from __future__ import annotations

from autopar.passes.export.price import use_pricer
from autopar.passes.planner import layouts
from autopar.passes.planner.constraints import Constraints
from autopar.passes.planner.request import PlanRequest
from autopar.passes.planner.search import plan_captured

PRICING_SECONDS = 10.0  # the pinned search's budget: the rest of the layout is small to search
NO_LIMIT = float(2**70)  # bytes per device: the written module runs whatever it needs (the planner takes finite limits)


def price_written(plan, captured, pins: dict) -> tuple[float, float]:
    """(step seconds, bytes on the fullest device) of the fastest plan honouring ``pins`` on
    ``plan``'s mesh and hardware; a ValueError (``autopar:``) where none does."""
    request = PlanRequest(mesh_shape=tuple(plan.mesh_shape), hardware=plan.hardware, memory_limit=NO_LIMIT,
                          time_limit_s=PRICING_SECONDS, layouts=layouts.LAYOUTS, hint_fn=layouts.hints,
                          pipeline=plan.pipeline is not None, constraints=Constraints.from_dict(pins))
    priced = plan_captured(captured, request)
    return priced.predicted.step_time, sum(priced.predicted.memory.values())


use_pricer(price_written)

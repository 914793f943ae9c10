"""Manual layouts, the ones people write by hand (``dp``, ``fsdp``, ``tp``, ``tp+dp``, ``ep``, ...).

They live beside the planner they feed (``autopar.passes.planner.layouts``, which
describes each); this is their public name, with ``build``: a layout's Plan for a model,
costed like the automatic plan.
"""

from __future__ import annotations

from autopar.passes.planner import export_price  # noqa: F401 (hands the export its pricer: Exported.cost)
from autopar.passes.planner.layouts import (LAYOUTS, axis_roles, expert_axes, hint, hints, layout_placements,
                                            megatron_dims)
from autopar.planning import plan

__all__ = ["LAYOUTS", "axis_roles", "build", "expert_axes", "hint", "hints", "layout_placements", "megatron_dims"]


def build(name: str, model, mesh_or_shape, example_inputs: tuple, *, hardware="h100", loss_fn=None, **kwargs):
    """The Plan of layout ``name`` for this model and mesh, costed like the automatic plan."""
    return plan(model, mesh_or_shape, example_inputs, hardware=hardware, loss_fn=loss_fn, layout=name, **kwargs)

"""Axis roles are one str Enum: layouts name them, plans print them as plain strings."""

import json

from autopar.passes.planner.layouts import LAYOUTS, axis_roles
from autopar.passes.roles import AxisRole


def test_layout_roles_are_axis_roles_that_print_as_before():
    for name in LAYOUTS:
        roles = axis_roles(name, 3)
        assert all(isinstance(r, AxisRole) for r in roles)
        assert json.loads(json.dumps(roles)) == [r.value for r in roles]
    assert axis_roles("tp+dp", 2) == ("dp", "tp") and f"{AxisRole.TP}" == "tp"
    assert axis_roles("fsdp", 2) == (AxisRole.DP, AxisRole.DP)  # FSDP's axes split the batch
    assert axis_roles("replicated", 1) == ("replica",)

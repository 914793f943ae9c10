"""Axis roles are one str Enum: layouts name them, plans print them as plain strings."""

import json

from autopar.passes.planner.layouts import LAYOUTS, axis_roles
from autopar.passes.roles import AxisRole, label_axes


def test_layout_roles_are_axis_roles_that_print_as_before():
    for name in LAYOUTS:
        roles = axis_roles(name, 3)
        assert all(isinstance(r, AxisRole) for r in roles)
        assert json.loads(json.dumps(roles)) == [r.value for r in roles]
    assert axis_roles("tp+dp", 2) == ("dp", "tp") and f"{AxisRole.TP}" == "tp"
    assert axis_roles("fsdp", 2) == (AxisRole.DP, AxisRole.DP)  # FSDP's axes split the batch
    assert axis_roles("replicated", 1) == ("replica",)


def test_default_axis_names_show_their_role_and_given_names_stay():
    assert label_axes(("pp", "axis1", "axis2"), ("", "dp", "tp")) == ["pp", "axis1 (dp)", "axis2 (tp)"]
    assert label_axes(("dp", "tp"), ("dp", "tp")) == ["dp", "tp"]
    assert label_axes(("axis1", "axis2"), ("dp", "tp")) == ["axis1 (dp)", "axis2 (tp)"]  # a pipeline's stage mesh
    assert label_axes(("axis1b",), ("dp",)) == ["axis1b"]
    assert label_axes(("axis0",), ("",)) == ["axis0"]  # no role found: the name alone

"""A layout as a pin (``Constraints(layout=)``, and ``layout=`` for a pipelined layout): a manual
layout's placements and ZeRO levels pinned, recomputation, micro-batches, schedule and pipeline
depth searched to fit; pipelined layouts named (``pp+LAYOUT``, ``pp4+LAYOUT``, ``3d``).

A GPT of two layers on the meta device (batch 8) on a 2 x 2 mesh, as tests/test_pins.py."""

import math
import warnings

import pytest

import autopar
from autopar import Constraints
from autopar.passes.capture import capture
from autopar.passes.placements import spec_str
from autopar.passes.planner import layouts
from autopar.passes.planner.constraints import mesh_roles
from autopar.passes.planner.intra_op import plan_intra_op
from autopar.passes.planner.layout_placements import layout_parts
from autopar.passes.planner.request import PlanRequest
from autopar.passes.strategy_graph import build_strategy_graph
from tests.test_pins import LIMIT, MESH, model  # noqa: F401 (model: the same GPT, a fixture)



@pytest.fixture(scope="module")
def captured(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(*model)


def plan(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model[0], MESH, model[1], time_limit_s=LIMIT, **options)


def placed_as_laid(captured, result, name: str) -> None:
    """Every parameter of ``result`` stored as layout ``name`` stores it on the plan's intra-op mesh."""
    mesh = tuple(result.mesh_shape[1:]) if result.pipeline else tuple(result.mesh_shape)
    fixed, _ = layouts.layout_placements(name, build_strategy_graph(captured, mesh))
    params = captured.params
    for node, spec in fixed.items():
        if node.name in params:
            assert result.params[params[node.name]] == spec_str(spec), params[node.name]


def test_layout_names_pipelined_and_with_their_depth():
    assert layout_parts("fsdp+tp") == (False, None, "fsdp+tp")
    assert layout_parts("pp+fsdp+tp") == (True, None, "fsdp+tp")
    assert layout_parts("pp4+tp+sp") == (True, 4, "tp+sp") and layout_parts("3d") == (True, None, "tp+dp")
    pins = Constraints(layout="pp4+tp+sp")
    assert pins.pp == 4 and pins.stages == 4 and pins.intra_layout == "tp+sp"
    assert Constraints(layout="fsdp+tp").stages == 1 and Constraints(layout="3d").stages is None
    assert Constraints.from_pins(pins.pins()) == pins == Constraints.from_dict(pins.to_dict())
    assert "pp=4 pinned" in mesh_roles(pins, (8, 8), 2)
    assert "no pipeline" in mesh_roles(Constraints(layout="dp"), (8, 8), 2)
    assert "a pipeline" in mesh_roles(Constraints(layout="pp+dp"), (8, 8), 1)


@pytest.mark.parametrize("pins, match", [
    (dict(layout="zigzag"), "no layout named 'zigzag'"),
    (dict(layout="pp1+dp"), "no layout named 'pp1\\+dp'"),
    (dict(layout="fsdp+tp", micro_batches=4), "layout=fsdp\\+tp has no pipeline, and micro_batches=4"),
    (dict(layout="fsdp+tp", pp=2), "layout=fsdp\\+tp has no pipeline, and pp=2"),
    (dict(layout="pp+dp", pp=1), "is pipelined, and pp=1"),
    (dict(layout="pp4+dp", pp=2), "names 4 pipeline stages, and pp=2"),
])
def test_bad_layout_pins_are_refused(pins, match):
    with pytest.raises(ValueError, match=match) as raised:
        Constraints(**pins)
    assert str(raised.value).startswith("autopar:")


@pytest.mark.parametrize("name", ["dp", "zero1", "fsdp", "tp", "tp+sp", "fsdp+tp"])
def test_a_layout_pins_its_placements_and_is_never_slower_than_the_layout_fixed(model, captured, name):
    """The pinned layout stores every parameter as the layout does, with its ZeRO levels, and
    the search under those placements is never predicted slower than the layout completed op by
    op (the path ``layout=`` alone takes, ``PlanRequest.layout``)."""
    result = plan(model, constraints=Constraints(layout=name))
    assert result.kind == name and result.pipeline is None
    request = PlanRequest(mesh_shape=MESH, hardware="h100", layouts=layouts.LAYOUTS, hint_fn=layouts.hints,
                          layout=name)
    fixed, _ = plan_intra_op(build_strategy_graph(captured, MESH), request)
    assert result.params == fixed.params and result.zero == fixed.zero
    zero = {"zero1": {1}, "fsdp": {3}, "fsdp+tp": {3}}.get(name, {0})
    assert set(result.zero.values()) == zero
    assert result.predicted.step_time <= fixed.predicted.step_time * (1 + 1e-9)
    assert result.pins["pins"] == [f"layout={name}"]


def test_a_layouts_recomputation_and_memory_are_searched_not_fixed(model):
    """Under a layout's pins recomputation is searched: it can be pinned with the layout, and a
    memory limit under what the layout's fastest plan needs gets another plan of the same
    placements within it, or one error."""
    pinned = Constraints(layout="fsdp+tp")
    roomy = plan(model, constraints=pinned, pipeline=False)
    assert not roomy.recompute
    full = plan(model, layout="fsdp+tp", pipeline=False, constraints=Constraints(recompute="all"))
    assert full.recompute == ["layer 0", "layer 1"] and full.params == roomy.params
    assert full.predicted.step_time > roomy.predicted.step_time
    limit = 0.999 * sum(roomy.predicted.memory.values())
    tight = plan(model, constraints=pinned, pipeline=False, memory_limit=limit)
    assert sum(tight.predicted.memory.values()) <= limit and tight.params == roomy.params
    with pytest.raises(ValueError, match="no plan honours the pins layout=fsdp\\+tp") as raised:
        plan(model, constraints=pinned, pipeline=False, memory_limit=1.0)
    assert str(raised.value).startswith("autopar:")


@pytest.mark.parametrize("name, intra", [("pp+tp+dp", "tp+dp"), ("3d", "tp+dp"), ("pp2+fsdp", "fsdp")])
def test_a_pipelined_layout_searches_its_micro_batches_and_schedule(model, captured, name, intra):
    result = plan(model, layout=name)
    assert result.kind == name and result.pipeline is not None and result.pipeline.stages == 2
    assert result.pipeline.micro_batches > 1 and result.pins["broken"] in ([], [f"layout={name}"])
    placed_as_laid(captured, result, intra)


def test_a_layout_and_constraints_pin_together(model):
    result = plan(model, layout="pp+dp", constraints=Constraints(micro_batches=2, schedule="gpipe"))
    assert (result.pipeline.stages, result.pipeline.micro_batches, result.pipeline.schedule) == (2, 2, "GPipe")
    assert result.pins["pins"] == ["layout=pp+dp", "micro_batches=2", "schedule=gpipe"]
    assert math.isfinite(result.pins["unpinned"]["step_time"])
    assert result.pins["unpinned"]["step_time"] <= result.predicted.step_time * (1 + 1e-9)
    with pytest.raises(ValueError, match="name two layouts"):
        plan(model, layout="dp", constraints=Constraints(layout="fsdp"))

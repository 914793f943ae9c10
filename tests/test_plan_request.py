"""The planning request (``PlanRequest``: built and checked once, passed down whole), the
caller's manual-layout Hints left as they were, and ``Plan.includes_loss``."""

import dataclasses
import json
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar import layouts
from autopar.models import WideMLP
from autopar.passes.capture import capture
from autopar.passes.plan import Pipeline, Plan, choice_from_plan
from autopar.passes.planner.intra_op import PlanningError, plan_intra_op
from autopar.passes.planner.request import PlanRequest
from autopar.passes.strategy_graph import build_strategy_graph
from tests.profiles import measured_style


def test_a_preset_is_built_once_for_the_mesh_and_a_measured_profile_kept():
    request = PlanRequest(mesh_shape=[2, 4], hardware="h100", axis_names=["dp", "tp"])
    assert request.mesh_shape == (2, 4) and request.axis_names == ("dp", "tp") and request.preset == "h100"
    assert tuple(request.profile.mesh_shape) == (2, 4) and request.names == ("dp", "tp")
    assert request.memory_bytes == request.profile.device.memory_bytes  # no limit given: the device's memory
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.memory_limit = 1e9
    measured = measured_style((2, 4))
    own = PlanRequest(mesh_shape=(2, 4), hardware=measured, memory_limit=1e9)
    assert own.preset is None and own.profile is measured and own.memory_bytes == 1e9
    assert own.names == tuple(measured.axis_names)


@pytest.mark.parametrize("changes, message", [
    (dict(memory_limit=-1.0), "expected a positive memory limit"),
    (dict(time_limit_s=0.0), "expected a positive planning time limit"),
    (dict(axis_names=("dp",)), r"expected one axis name per mesh axis \(2 for mesh \(2, 4\)\)"),
    (dict(layout="bogus", layouts=layouts.LAYOUTS, hint_fn=layouts.hints), "no layout named 'bogus'"),
    (dict(layout="dp"), r"no layout named 'dp'; expected one of \(\)"),  # no manual layouts to pick from
    (dict(layouts=("dp",)), "need a hint function"),
    (dict(hardware=measured_style((4, 2))), r"the hardware profile is for mesh \(4, 2\), found mesh \(2, 4\)"),
    (dict(mesh_shape=(0, 4)), "expected a mesh shape of positive sizes"),
])
def test_a_bad_request_is_refused_when_built(changes, message):
    with pytest.raises(PlanningError, match=f"^autopar: .*{message}"):
        PlanRequest(**{"mesh_shape": (2, 4), "hardware": "h100", **changes})


def test_autopar_plan_checks_its_request_before_capturing():
    class Uncapturable(torch.nn.Module):
        def forward(self, x):
            raise AssertionError("captured before the request was checked")

    with pytest.raises(PlanningError, match="^autopar: expected a positive memory limit"):
        autopar.plan(Uncapturable(), (2,), (torch.zeros(4),), memory_limit=0)
    with pytest.raises(PlanningError, match="^autopar: no layout named 'megatron'"):
        autopar.plan(Uncapturable(), (2,), (torch.zeros(4),), layout="megatron")


def test_the_callers_hints_are_completed_as_copies():
    """The solve and the layout branch fill in each layout's strategy choice on copies: the
    Hints the hint function gave are left as they were (planning twice gives the same plan)."""
    with torch.device("meta"):
        model = WideMLP(dim=64, hidden=256, n_layers=2)
    x = torch.zeros(8, 16, 64, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, (x,)), (4,))
    given = layouts.hints(graph)
    assert given and all(h.choice is None for h in given)
    request = PlanRequest(mesh_shape=(4,), hardware="h100", layouts=layouts.LAYOUTS,
                          hint_fn=lambda graph, names: given)
    plan, solved = plan_intra_op(graph, request, solver_time_s=0.5)
    assert solved.hints and all(h.choice is not None for h in solved.hints)
    assert all(h.choice is None for h in given)
    assert not {id(h) for h in solved.hints} & {id(h) for h in given}
    fsdp, _ = plan_intra_op(graph, dataclasses.replace(request, layout="fsdp"))
    assert fsdp.kind == "fsdp" and all(h.choice is None for h in given)
    with pytest.raises(PlanningError, match=r"^autopar: the strategy graph is for mesh \(4,\), the request for"):
        plan_intra_op(graph, dataclasses.replace(request, mesh_shape=(2, 2)))


@pytest.fixture(scope="module")
def planned():
    """A small MLP planned with its loss and alone, on 2 devices."""
    torch.manual_seed(0)
    model = WideMLP(dim=16, hidden=64, n_layers=1)
    x, target = torch.randn(8, 16), torch.randint(0, 16, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with_loss = autopar.plan(model, (2,), (x,), loss_fn=F.cross_entropy, target=target, time_limit_s=2,
                                 pipeline=False)
        alone = autopar.plan(model, (2,), (x,), time_limit_s=2, pipeline=False)
    return model, x, target, with_loss, alone


def _as_saved_before_includes_loss(plan: Plan) -> Plan:
    data = json.loads(plan.to_json())
    del data["includes_loss"]
    return Plan.from_dict(data)


def test_includes_loss_round_trips_and_is_inferred_for_plans_saved_before_it(planned):
    _, _, _, with_loss, alone = planned
    assert with_loss.includes_loss and not alone.includes_loss
    assert with_loss.model == "WithLoss"  # what plans saved before the field said
    for plan in (with_loss, alone):
        assert Plan.from_json(plan.to_json()) == plan
        assert _as_saved_before_includes_loss(plan) == plan
    stated = json.loads(with_loss.to_json())
    stated["includes_loss"] = False  # a saved field wins over the model's name
    assert not Plan.from_dict(stated).includes_loss


def test_a_plan_made_with_its_loss_is_refused_for_the_model_alone(planned):
    model, x, _, with_loss, alone = planned
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, (x,)), (2,))
    assert len(choice_from_plan(graph, alone)) == len(graph.nodes)
    for plan in (with_loss, _as_saved_before_includes_loss(with_loss)):
        with pytest.raises(ValueError, match="^autopar: this plan was made for the model and its loss together"):
            choice_from_plan(graph, plan)


def test_dry_run_of_a_plan_made_with_its_loss_needs_that_loss(planned):
    model, x, target, with_loss, _ = planned
    ran = autopar.dry_run(with_loss, model, (x,), loss_fn=F.cross_entropy, target=target, workers=1)
    assert ran.ok, ran.table()
    for plan in (with_loss, _as_saved_before_includes_loss(with_loss)):
        refused = autopar.dry_run(plan, model, (x,), workers=1)
        assert not refused.ok and all("this plan was made with the loss" in r.error for r in refused.ranks)


def test_compile_refuses_a_pipeline_plan_made_with_its_loss(planned):
    model, x, _, with_loss, _ = planned
    staged = dataclasses.replace(with_loss, pipeline=Pipeline(axis=0, stages=2, micro_batches=2, schedule="GPipe"))
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        for plan in (staged, _as_saved_before_includes_loss(staged)):
            with pytest.raises(ValueError, match="^autopar: this pipeline plan was made for the model and its loss"):
                autopar.compile(model, mesh, (x,), loss_fn=F.cross_entropy, plan=plan)
    finally:
        dist.destroy_process_group()


def test_a_written_layout_that_does_not_fit_says_so():
    """``layout=`` alone prices the layout as written, fitting or not; one that does not fit is a
    ``DoesNotFitWarning`` naming both sizes and a line of ``explain()``; one that fits is neither."""
    from autopar.planning import DoesNotFitWarning

    torch.manual_seed(0)
    model, x = WideMLP(), torch.randn(8, 64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fits = autopar.plan(model, (2,), (x,), hardware="h100", layout="dp", time_limit_s=5)
    assert not [w for w in seen if issubclass(w.category, DoesNotFitWarning)]
    assert fits.memory_over_limit() == 0 and "DOES NOT FIT" not in fits.explain()
    limit = sum(fits.predicted.memory.values()) / 2
    with pytest.warns(DoesNotFitWarning, match=r"^autopar: layout 'dp' as written is predicted to need .* more than"):
        over = autopar.plan(model, (2,), (x,), hardware="h100", layout="dp", time_limit_s=5, memory_limit=limit)
    assert over.memory_over_limit() == pytest.approx(sum(over.predicted.memory.values()) - limit)
    assert "DOES NOT FIT in the" in over.explain()

"""A layout request prices only the layout's choices (``intra_op.layout_costs``): edge tables
between the strategies the layout leaves each node, inf between the others, and the plan is
the one the full costs give, byte for byte (every layout on the small GPT, a layout that
splits a tie, and a model whose in-place writes forbid moves)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from autopar import costmodels
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.planner import layouts
from autopar.passes.planner.intra_op import layout_costs, plan_layout
from autopar.passes.planner.request import PlanningError
from autopar.passes.strategy_graph import build_strategy_graph
from tests import models
from tests.layout_models import LAYOUT_MODELS
from tests.test_layouts_apply import Alternating

MESH = (2, 2)
AXES = ("dp", "tp")


def graph_of(model, args, kwargs=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_strategy_graph(capture(model, args, kwargs), MESH)


def planned(costs, hint):
    """The layout's plan as JSON, or its planning error."""
    try:
        return plan_layout(costs, {hint.name: hint}, hint.name, 80e9, AXES)[0].to_json()
    except PlanningError as exc:
        return f"error: {exc}"


def priced(costs) -> int:
    return sum(int(np.isfinite(table).sum()) for _, _, table in costs.problem.edges)


def check_same_plans(graph, names):
    profile = costmodels.preset("h100", MESH)
    full = build_costs(graph, profile, memory_limit=80e9)
    for name in names:
        hint = layouts.hint(name, graph)
        mine = layout_costs(graph, profile, hint, 80e9)
        assert planned(mine, hint) == planned(full, hint), name
        assert priced(mine) < priced(full), name


def test_layouts_on_the_small_gpt_plan_as_with_full_costs():
    # every kind of restriction: weights used where they lie on tp, the data axes splitting
    # the work, the batch kept whole on tp, everything whole; a layout that does not apply
    check_same_plans(graph_of(*models.small_gpt()), ("tp+sp", "fsdp", "replicated", "ep"))


def test_a_layout_that_splits_a_tie_plans_as_with_full_costs():
    torch.manual_seed(0)
    check_same_plans(graph_of(Alternating(), (torch.randn(8, 16),)), ("tp+dp", "tp"))


def test_in_place_writes_keep_their_forbidden_moves():  # Whisper's labels, shifted in place: inf in priced tables
    model, args, kwargs = LAYOUT_MODELS["whisper"]()
    check_same_plans(graph_of(model, args, kwargs), ("tp+dp",))

"""Ties never refuse a layout (issue #18, item 1): where a manual layout places tied layers
differently, the tie is split for it and the plan says so; every layout of ``LAYOUTS``
gives a Plan on Mixtral, a ViT, CLIP, Whisper and BART (``tests.layout_models``: two of
every repeated layer) on a (2, 2) mesh."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest

from autopar import costmodels
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.planner import layouts
from autopar.passes.planner.intra_op import plan_layout
from autopar.passes.planner.untie import Restrictions, restrict
from autopar.passes.solve import Follower, SolveProblem
from autopar.passes.solve.shrink import shrink_problem
from autopar.passes.strategy_graph import build_strategy_graph
from tests.layout_models import LAYOUT_MODELS

MESH = (2, 2)
INF = np.inf


@functools.cache
def costs_of(name: str):
    model, args, kwargs = LAYOUT_MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, args, kwargs), MESH)
    return build_costs(graph, costmodels.preset("h100", MESH))


# The models (ResNet and ConvNeXt plan every layout in tests/test_layout_matrix.py too)
APPLY_MODELS = ("bart", "clip_as_given", "mixtral", "vit", "whisper")


@pytest.mark.parametrize("name", APPLY_MODELS)
def test_every_layout_gives_a_plan(name):
    costs = costs_of(name)
    for layout in layouts.LAYOUTS:
        hint = layouts.hint(layout, costs.graph)
        plan, _ = plan_layout(costs, {layout: hint}, layout, None, ("dp", "tp"))
        assert plan.kind == layout and plan.params, (name, layout)
        assert plan.predicted.step_time > 0, (name, layout)


def test_a_layout_that_places_tied_layers_apart_splits_the_tie_and_says_so():
    # Megatron's walk marks Mixtral's router column-parallel, so the second layer's
    # attention reads a split activation: row-parallel where the first is column-parallel.
    costs = costs_of("mixtral")
    hint = layouts.hint("tp+dp", costs.graph)
    plan, _ = plan_layout(costs, {"tp+dp": hint}, "tp+dp", None, ("dp", "tp"))
    q = {fqn: spec for fqn, spec in plan.params.items() if fqn.endswith("self_attn.q_proj.weight")}
    assert sorted(q.values()) == ["RS(0)", "RS(1)"], q  # the layout's placements, kept in both layers
    assert any("tied layers placed differently" in r and "layers 0 | 1" in r for r in plan.reasons), plan.reasons
    assert "tied layers placed differently" in plan.explain()


def _two_tied(follower_map=None) -> SolveProblem:
    """Nodes 0 and 1 tied (two strategies each); node 2 follows node 0 when a map is given."""
    times = [np.array([1.0, 2.0]), np.array([1.0, 2.0]), np.array([0.0, 0.0])]
    followers = [Follower(2, 0, follower_map)] if follower_map else []
    return SolveProblem(node_time=times, node_memory=[np.zeros(2)] * 3, edges=[], memory_limit=None,
                        ties=[[0, 1]], followers=followers)


def _cheapest(restricted) -> list[int]:
    """Each class's cheapest strategy (these problems have no edges), expanded to every node."""
    return restricted.shrunk.expand([int(np.argmin(t)) for t in restricted.shrunk.node_time])


def test_restrict_splits_only_the_tie_the_restrictions_contradict():
    problem = _two_tied()
    shrunk = shrink_problem(problem)
    alike = restrict(problem, shrunk, Restrictions(hard=[(0, np.array([INF, 0.0])), (1, np.array([INF, 0.0]))]))
    assert alike.splits == [] and _cheapest(alike)[:2] == [1, 1]  # still one decision for both
    assert alike.shrunk.node_class[0] == alike.shrunk.node_class[1]
    apart = restrict(problem, shrunk, Restrictions(hard=[(0, np.array([0.0, INF])), (1, np.array([INF, 0.0]))]))
    assert apart.splits == [[[0], [1]]]
    assert _cheapest(apart)[:2] == [0, 1]


def test_a_soft_restriction_against_a_follower_is_dropped_not_the_follower():
    problem = _two_tied(follower_map=(1, 0))  # node 2 takes strategy 1 when node 0 takes 0
    shrunk = shrink_problem(problem)
    restricted = restrict(problem, shrunk, Restrictions(hard=[(0, np.array([0.0, INF]))],
                                                        soft=[(2, np.array([0.0, INF]))]))
    assert restricted.splits == []
    assert _cheapest(restricted) == [0, 0, 1]  # the follower kept, the soft wish dropped
    both_hard = Restrictions(hard=[(0, np.array([0.0, INF])), (2, np.array([0.0, INF]))])
    assert restrict(problem, shrunk, both_hard) is None  # placements against a follower: no completion

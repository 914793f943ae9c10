"""What the planner works out once and reuses (issue #13, planning stays fast) gives exactly
what working it out again gives: a cost rebuild with layers recomputed reuses the first
build's priced edges, and a manual layout's restrictions are listed once per graph. About
2 s (one small GPT captured, a few cost builds on a 2 x 2 mesh)."""

import numpy as np
import pytest

from autopar import costmodels
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.planner import layouts
from autopar.passes.planner.intra_op import layout_restrictions
from autopar.passes.strategy_graph import build_strategy_graph
from tests.models import small_gpt


@pytest.fixture(scope="module")
def graph():
    model, inputs = small_gpt()
    return build_strategy_graph(capture(model, inputs), (2, 2))


def _same_problem(a, b) -> None:
    assert len(a.node_time) == len(b.node_time) and len(a.edges) == len(b.edges)
    for x, y in zip(a.node_time, b.node_time):
        assert np.array_equal(x, y)
    for x, y in zip(a.node_memory, b.node_memory):
        assert np.array_equal(x, y)
    for (u, v, t), (u2, v2, t2) in zip(a.edges, b.edges):
        assert (u, v) == (u2, v2) and np.array_equal(t, t2)
    assert a.ties == b.ties and a.followers == b.followers


def test_a_rebuild_with_layers_recomputed_equals_a_fresh_build(graph):
    profile = costmodels.preset("h100", (2, 2))
    first = build_costs(graph, profile)
    layers = sorted(set(first.layer_of.values()))
    assert len(layers) == 2
    rebuilt = build_costs(graph, profile, recompute=layers[:1], pricer=first.pricer)
    fresh = build_costs(graph, profile, recompute=layers[:1])
    _same_problem(rebuilt.problem, fresh.problem)
    assert rebuilt.edge_inputs == fresh.edge_inputs and rebuilt.recompute == fresh.recompute == {layers[0]}
    # the rebuild priced no edge again: its tables are the first build's, in lists of its own
    assert all(t is t0 for (_, _, t), (_, _, t0) in zip(rebuilt.problem.edges, first.problem.edges))
    assert rebuilt.problem.edges is not first.problem.edges
    # and recomputation changed what it should: compute of the recomputed layer, not the edges
    assert any(not np.array_equal(x, y) for x, y in zip(rebuilt.problem.node_time, first.problem.node_time))


def test_a_layouts_restrictions_listed_once_equal_a_fresh_listing(graph):
    profile = costmodels.preset("h100", (2, 2))
    costs = build_costs(graph, profile)
    hint = layouts.hint("tp+zero1", graph)
    assert hint.batch_whole_axes  # the case worked out once per graph
    once, again = layout_restrictions(costs, hint), layout_restrictions(costs, hint)
    fresh = layout_restrictions(build_costs(graph, profile), hint)
    for restrictions in (again, fresh):
        for kind in ("hard", "soft"):
            mine, theirs = getattr(once, kind), getattr(restrictions, kind)
            assert [v for v, _ in mine] == [v for v, _ in theirs]
            assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(mine, theirs))

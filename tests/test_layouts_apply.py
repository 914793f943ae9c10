"""Ties never refuse a layout (issue #18, item 1): where a manual layout places tied layers
differently, the tie is split for it and the plan says so; every layout of ``LAYOUTS``
gives a Plan on Mixtral, a ViT, CLIP, Whisper and BART (``tests.layout_models``: two of
every repeated layer) on a (2, 2) mesh. Mixtral's layouts (item 2): Megatron keeps the
router whole and splits each expert's MLP; ``ep`` and ``tp+ep`` split experts by expert, ``ep``
sending tokens to them all-to-all, ``tp+ep`` (whole tokens on its tp axis) by allgather."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from autopar import costmodels, pictures
from autopar.passes.explain import expert_axes
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.planner import layouts
from autopar.passes.planner.intra_op import plan_layout
from autopar.passes.planner.untie import Restrictions, restrict
from autopar.passes.placements import spec_str
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
APPLY_MODELS = ("bart", "clip", "mixtral", "vit", "whisper")


@pytest.mark.parametrize("name", APPLY_MODELS)
def test_every_layout_gives_a_plan(name):
    costs = costs_of(name)
    for layout in layouts.LAYOUTS:
        hint = layouts.hint(layout, costs.graph)
        plan, _ = plan_layout(costs, {layout: hint}, layout, None, ("dp", "tp"))
        assert plan.kind == layout and plan.params, (name, layout)
        assert plan.predicted.step_time > 0, (name, layout)


class Alternating(nn.Module):
    """Two repeated layers of one linear each after a first linear: Megatron's walk makes
    that one column-parallel, layer 0 (reading its split output) row-parallel and layer 1
    column-parallel again: the tied layers placed apart."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))

    def forward(self, x):
        x = self.first(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_a_layout_that_places_tied_layers_apart_splits_the_tie_and_says_so():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(Alternating(), (torch.randn(8, 16),)), MESH)
    costs = build_costs(graph, costmodels.preset("h100", MESH))
    plan, _ = plan_layout(costs, {"tp+dp": layouts.hint("tp+dp", graph)}, "tp+dp", None, ("dp", "tp"))
    weights = {fqn: spec for fqn, spec in plan.params.items() if fqn.startswith("layers.") and fqn.endswith("0.weight")}
    assert sorted(weights.values()) == ["RS(0)", "RS(1)"], weights  # the layout's placements, kept in both layers
    assert any("tied layers placed differently" in r and "layers 0 | 1" in r for r in plan.reasons), plan.reasons
    assert "tied layers placed differently" in plan.explain()


def _mixtral_params(layout: str) -> dict[str, str]:
    """Layer 0's parameter placements under ``layout`` on Mixtral (names from ``mlp.`` on)."""
    graph = costs_of("mixtral").graph
    fixed = layouts.hint(layout, graph).fixed
    names = {graph.captured.params[n.name]: spec_str(spec) for n, spec in fixed.items() if n.name in graph.captured.params}
    return {fqn.split("layers.0.")[1]: spec for fqn, spec in names.items() if "layers.0.mlp" in fqn}


def test_megatron_keeps_the_router_whole_and_splits_each_expert_like_an_mlp():
    # gate_up_proj [E, 2I, H] by output features, down_proj [E, H, I] by input features
    assert _mixtral_params("tp+dp") == {"mlp.gate.weight": "RR", "mlp.experts.gate_up_proj": "RS(1)",
                                        "mlp.experts.down_proj": "RS(2)"}
    costs = costs_of("mixtral")
    plan, _ = plan_layout(costs, {"tp+dp": layouts.hint("tp+dp", costs.graph)}, "tp+dp", None, ("dp", "tp"))
    assert not any("tied layers placed differently" in r for r in plan.reasons), plan.reasons  # layers alike
    # each layer's experts op: tokens split by the data axis, each expert's MLP by the tp axis
    # (gate and up columns gathered inside the op): not expert parallel
    experts = [s for n, s in plan.strategies.items() if n.startswith("moe_experts")]
    assert experts == ["(S(0)R, S(0)R, S(0)R, RS(2), RS(1)) -> S(0)P [moe_experts]"] * 2, experts
    assert expert_axes(plan) == ([], []) and "expert parallel" not in plan.explain()


# ep's last axis splits the batch too: tokens go to their experts all-to-all; tp+ep's keeps the
# batch whole for Megatron's attention: every rank has every token, and runs its experts' rows
DISPATCH = {"ep": ("(S(0)S(0), S(0)S(0), S(0)S(0), RS(0), RS(0)) -> S(0)S(0) [moe_experts]", "all-to-all"),
            "tp+ep": ("(S(0)R, S(0)R, S(0)R, RS(0), RS(0)) -> S(0)P [moe_experts]", "allgather")}


@pytest.mark.parametrize("layout, attention", [("ep", "RR"), ("tp+ep", "RS(0)")])
def test_expert_parallel_layouts_split_experts_by_expert_and_run_them_locally(layout, attention, tmp_path):
    assert _mixtral_params(layout) == {"mlp.gate.weight": "RR", "mlp.experts.gate_up_proj": "RS(0)",
                                       "mlp.experts.down_proj": "RS(0)"}
    costs = costs_of("mixtral")
    hint = layouts.hint(layout, costs.graph)
    q = next(spec for n, spec in hint.fixed.items() if costs.graph.captured.params.get(n.name, "").endswith(
        "layers.0.self_attn.q_proj.weight"))
    assert spec_str(q) == attention
    plan, _ = plan_layout(costs, {layout: hint}, layout, None, ("dp", "tp"))
    # each layer's experts op runs this rank's experts with the weights as they lie, though
    # transformers hands them over transposed (views): no expert weight is gathered
    experts = [s for n, s in plan.strategies.items() if n.startswith("moe_experts")]
    strategy, dispatch = DISPATCH[layout]
    assert experts == [strategy] * 2, experts
    assert "expert parallel: experts split by expert over tp (size 2)" in plan.explain()
    assert f"2 expert layers: {dispatch} dispatch" in plan.explain()
    assert expert_axes(plan)[1] == [1]  # what the weight picture marks "by expert"
    assert pictures.weight_placement(plan, tmp_path / "weights.png").stat().st_size > 0
    tokens = next(n for n in hint.fixed if n.name in costs.graph.captured.user_inputs)
    assert spec_str(hint.fixed[tokens][-1:]) == ("S(0)" if layout == "ep" else "R")  # ep's axis splits the batch


def test_expert_layouts_on_a_model_without_experts_are_its_dense_layouts():
    names = [h.name for h in layouts.hints(costs_of("vit").graph)]
    assert "ep" not in names and "tp+ep" not in names and {"dp", "tp+dp"} <= set(names)


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

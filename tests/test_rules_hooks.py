"""What a rule says of its op beside its strategies (``autopar.passes.rules.registry``): its
work, a restriction under a layout's axis roles, its weights per expert, and how explain()
reads its kernel. The passes ask the registry, so only the rules and capture (which fuses
the experts region into its op) name the experts op."""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from autopar import costmodels
from autopar.passes import capture as capture_module
from autopar.passes.capture import capture
from autopar.passes.costing import Pricer, build_costs
from autopar.passes.planner import layouts
from autopar.passes.planner.intra_op import plan_layout
from autopar.passes.roles import AxisRole
from autopar.passes.rules import registry, strategies_for
from autopar.passes.op_strategies import OpInfo
from autopar.passes.rules.moe_experts import MOE_EXPERTS, OP_NAME, axis_kinds
from autopar.passes.strategy_graph import build_strategy_graph
from tests.layout_models import mixtral

REPO = Path(__file__).resolve().parents[1]
MESH = (2, 2)
# the experts op's names: its op, its module's constants, the module itself
EXPERTS_OP = re.compile(r"moe_experts|MOE_EXPERTS|GROUPED_MM_OPS|rules\.moe\b|rules import .*\bmoe\b")


def _naming_the_experts_op() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for root in ("passes", "autopar", "costmodels")
                  for p in (REPO / root).rglob("*.py") if EXPERTS_OP.search(p.read_text()))


def test_only_the_rules_and_capture_name_the_experts_op():
    named = _naming_the_experts_op()
    assert "passes/rules/moe_experts.py" in named and "passes/capture.py" in named  # the pattern finds names
    # passes/capture_moe.py fuses the region into the op at capture (``passes.capture`` calls it)
    outside = [p for p in named if not p.startswith(("passes/rules/", "passes/capture"))]
    assert outside == [], f"expected the passes to ask the rule registry; these name the experts op: {outside}"


def _experts_call() -> OpInfo:
    """One experts op: 16 tokens of 32 features, top-2 of 4 experts, each an MLP of 16."""
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(16)])
    inputs = (torch.randn(16, 32, generator=g), ids, torch.rand(16, 2, generator=g),
              torch.randn(4, 32, 32, generator=g), torch.randn(4, 16, 32, generator=g))
    return OpInfo.from_call(MOE_EXPERTS, (*inputs, "aten._grouped_mm.default"))


def test_ep_axes_keep_the_experts_op_to_all_to_all_dispatch():
    strategies = strategies_for(_experts_call(), MESH)
    restrict = registry.restriction_of(OP_NAME)
    keep = restrict(strategies, (AxisRole.DP, AxisRole.EP))
    allowed = [s for s, k in zip(strategies, keep) if k == 0]
    assert set(keep) == {0.0, np.inf}
    assert allowed == [s for s in strategies if 1 in axis_kinds(s)["all_to_all"]]
    assert restrict(strategies, (AxisRole.DP, AxisRole.TP)) is None  # tp+ep: the cost model picks the dispatch
    assert registry.restriction_of("aten.mm.default") is None


def test_expert_weights_say_how_megatron_splits_them():
    assert registry.expert_weights_of(OP_NAME) == (registry.ExpertWeight(3, "column"), registry.ExpertWeight(4, "row"))
    assert registry.expert_weights_of("aten._grouped_mm.default") == (registry.ExpertWeight(1),)  # as a linear
    assert registry.expert_weights_of("aten.mm.default") == ()


@functools.cache
def _costs(fused: bool):
    model, args, kwargs = mixtral()
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("ignore")
        if not fused:  # transformers' region as it is: grouped matmuls
            patch.setattr(capture_module, "fuse_moe_experts", lambda gm: 0)
        graph = build_strategy_graph(capture(model, args, kwargs), MESH)
    return build_costs(graph, costmodels.preset("h100", MESH))


def test_costing_prices_the_work_and_collectives_a_rule_gives():
    costs = _costs(True)
    pricer = Pricer(costs.graph, costs.profile)
    experts = [ns for node, ns in costs.graph.nodes.items() if str(node.target) == OP_NAME]
    assert len(experts) == 2
    for ns in experts:
        text = [str(s) for s in ns.strategies]
        total, _, _ = pricer.op(ns, True)
        comm = pricer.op_comm(ns, True)
        whole = text.index("(RR, RR, RR, RR, RR) -> RR")
        data = text.index("(S(0)S(0), S(0)S(0), S(0)S(0), RR, RR) -> S(0)S(0)")
        a2a = text.index("(S(0)S(0), S(0)S(0), S(0)S(0), S(0)S(0), S(0)S(0)) -> S(0)S(0) [moe_experts]")
        assert total[a2a] < total[whole] and total[data] < total[whole]  # the rows split over the mesh
        assert comm[whole] == comm[data] == 0 < comm[a2a]  # the dispatch's exchanges, only where it trades rows
        assert pricer.op_comm(ns, False)[a2a] < comm[a2a]  # backward runs the exchanges' duals
    plain = next(ns for node, ns in costs.graph.nodes.items() if node.op == "call_function"
                 and registry.work_of(node.target) is None and len(ns.strategies) > 1)
    assert not pricer.op_comm(plain, True).any()


def test_grouped_matmuls_say_from_their_kernel_how_tokens_reach_the_experts():
    costs = _costs(False)
    hint = layouts.hint("ep", costs.graph)
    plan, _ = plan_layout(costs, {"ep": hint}, "ep", None, ("dp", "ep"))
    assert "expert parallel: experts split by expert over ep (size 2)" in plan.explain()
    assert "4 grouped matmuls run only the tokens routed to this rank's experts" in plan.explain()

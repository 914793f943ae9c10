"""A value two readers save in two placements keeps two copies (``autopar.passes.read_copies``),
checked against the dry run's measured activations: the solver's shares price one."""

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar import costmodels
from autopar.passes.costing import Costs
from autopar.passes.capture import capture
from autopar.passes.planner.assemble import Solved, build_plan, chosen
from autopar.passes.planner import intra_op
from autopar.passes.planner.intra_op import solve_graph
from autopar.passes.strategy_graph import build_strategy_graph

MESH = (4,)


class TwoReaders(nn.Module):
    """``h`` read by two linears, both saving it for their weight's gradient; they are narrow so
    that ``h`` holds most of the activations."""

    def __init__(self, dim: int = 32, wide: int = 512, out: int = 8):
        super().__init__()
        self.up = nn.Linear(dim, wide, bias=False)
        self.q = nn.Linear(wide, out, bias=False)
        self.k = nn.Linear(wide, out, bias=False)

    def forward(self, x):
        h = self.up(x)
        return self.q(h) + self.k(h)


def _reading(graph, node, placement):
    """The first strategy of ``node`` that reads its input in ``placement`` and its weight whole."""
    strategies = graph.nodes[node].strategies
    return next(i for i, s in enumerate(strategies) if s.inputs[0] == placement and s.inputs[1] == (Replicate(),))


@pytest.fixture(scope="module")
def planned():
    model, inputs = TwoReaders(), (torch.randn(4, 64, 32),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, inputs), MESH)
        solved = solve_graph(graph, costmodels.preset("h100", MESH), memory_limit=None, time_limit_s=2)
    costs = solved.costs
    linears = [n for n in graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    up, q, k = linears
    choice, zero = costs.choice(solved.result.assignment)
    choice[up] = next(i for i, s in enumerate(graph.nodes[up].strategies) if s.output == (Shard(0),))
    choice[q] = _reading(graph, q, (Shard(1),))  # h moved to a sequence split for q
    choice[k] = _reading(graph, k, (Shard(0),))  # and read where it lies by k
    assignment = costs.assignment(choice, zero)
    plan = build_plan(Solved(costs, None, {}), assignment, kind="auto", axis_names=("dp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    return costs, assignment, plan, result


def test_both_placements_are_priced(planned):
    costs, assignment, _, _ = planned
    extra = sum(costs.read_copy_bytes(chosen(costs, assignment).choice).values())
    shard = 4 * 64 * 512 * 4 / 4  # one placement of h on a device: a quarter of it, fp32
    assert extra == pytest.approx(shard)  # two copies, where the shares charged one


def test_the_prediction_matches_the_dry_run_with_both_copies(planned):
    costs, assignment, plan, result = planned
    measured = max(r.memory["activations"] for r in result.ranks)
    extra = sum(costs.read_copy_bytes(chosen(costs, assignment).choice).values())
    predicted = plan.predicted.memory["activations"]
    assert predicted == pytest.approx(measured, rel=0.10), result.table()
    assert predicted - extra < 0.85 * measured  # without the second copy it would miss it


def test_a_plan_its_copies_put_over_the_limit_is_solved_again_within_it(monkeypatch):
    """The solve cannot see the second copies; a plan they put over the limit is solved again
    with the limit less them. Copies of a fixed size stand in for the chosen placements' here,
    so that the plan made without a limit (the fastest) is over it by them."""
    model, inputs = TwoReaders(dim=1024, wide=4096, out=1024), (torch.randn(8, 64, 1024),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fastest = autopar.plan(model, MESH, inputs, hardware="h100", pipeline=False, time_limit_s=2)
        smallest = autopar.plan(model, MESH, inputs, hardware="h100", pipeline=False, time_limit_s=2, layout="fsdp")
        limit = sum(fastest.predicted.memory.values())
        copies = (limit - sum(smallest.predicted.memory.values())) / 2
        monkeypatch.setattr(Costs, "read_copy_bytes", lambda self, choice: {0: copies})
        solves, solve_graph = [], intra_op.solve_graph

        def recorded(*args, **kwargs):  # (the prices it was given, the prices it used)
            solved = solve_graph(*args, **kwargs)
            solves.append((kwargs.get("pricer"), solved.costs.pricer))
            return solved

        monkeypatch.setattr(intra_op, "solve_graph", recorded)
        planned = autopar.plan(model, MESH, inputs, hardware="h100", pipeline=False, time_limit_s=2,
                               memory_limit=limit)
    assert sum(planned.predicted.memory.values()) <= limit  # the copies included
    assert planned.predicted.step_time > fastest.predicted.step_time  # a slower plan, that fits
    assert any("solved within" in r for r in planned.reasons)
    # the solves again price nothing anew: the limit changes no price
    assert len(solves) >= 2 and solves[0][0] is None
    assert all(given is solves[0][1] and used is solves[0][1] for given, used in solves[1:]), solves

"""What planning works out once per capture gives exactly what working it out again gives:
strategy graphs of one capture on several meshes share what the capture alone decides
(``StrategyGraph.once``: batch dims, linears, the gradient path, what backward keeps), and a
cost rebuild reuses the first build's node prices; ``tensor_inputs`` walks nested arguments
as pytree does. About 10 s (one small GPT captured, a few cost builds on 2 x 2 and 2)."""

import numpy as np
import pytest
import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar import costmodels
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.planner import layouts
from autopar.passes.planner.linears import linears
from autopar.passes.planner.microbatch import batch_dims, batch_size
from autopar.passes.strategy_graph import build_strategy_graph, tensor_inputs
from tests.models import small_gpt


@pytest.fixture(scope="module")
def captured():
    model, inputs = small_gpt()
    return capture(model, inputs)


def _same_problem(a, b) -> None:
    assert len(a.node_time) == len(b.node_time) and len(a.edges) == len(b.edges)
    assert all(np.array_equal(x, y) for x, y in zip(a.node_time, b.node_time))
    assert all(np.array_equal(x, y) for x, y in zip(a.node_memory, b.node_memory))
    for (u, v, t), (u2, v2, t2) in zip(a.edges, b.edges):
        assert (u, v) == (u2, v2) and np.array_equal(t, t2)
    assert a.ties == b.ties and a.followers == b.followers


def test_tensor_inputs_are_pytrees_leaves_in_order(captured):
    def by_pytree(node: fx.Node) -> list[fx.Node]:
        leaves = pytree.tree_leaves((node.args, dict(node.kwargs)))
        return [x for x in leaves if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]

    nested = [n for n in captured.nodes("call_function") if any(isinstance(a, (list, tuple)) for a in n.args)]
    assert nested  # views and cats: the arguments the walk flattens itself
    assert all(tensor_inputs(n) == by_pytree(n) for n in captured.nodes())


def test_graphs_sharing_a_capture_get_what_fresh_graphs_get(captured):
    shared, calls = {}, {}
    first = build_strategy_graph(captured, (2,), calls, shared)
    profile = costmodels.preset("h100", (2,))
    build_costs(first, profile)  # fills what the capture alone decides
    batch = batch_size(first)
    assert batch and batch_dims(first, batch) and linears(first)
    graph = build_strategy_graph(captured, (2, 2), calls, shared)
    fresh = build_strategy_graph(captured, (2, 2))
    assert batch_dims(graph, batch) is batch_dims(first, batch)  # worked out once
    assert batch_dims(graph, batch) == batch_dims(fresh, batch)
    assert linears(graph) == linears(fresh)
    profile = costmodels.preset("h100", (2, 2))
    _same_problem(build_costs(graph, profile).problem, build_costs(fresh, profile).problem)
    for name in ("tp+dp", "fsdp+tp", "ep"):
        mine, theirs = layouts.hint(name, graph), layouts.hint(name, fresh)
        assert mine.fixed == theirs.fixed and mine.zero == theirs.zero


def test_a_rebuild_reuses_node_prices_and_equals_a_fresh_build(captured):
    graph = build_strategy_graph(captured, (2, 2))
    profile = costmodels.preset("h100", (2, 2))
    first = build_costs(graph, profile)
    layers = sorted(set(first.layer_of.values()))
    rebuilt = build_costs(graph, profile, recompute=layers[:1], pricer=first.pricer)
    fresh = build_costs(graph, profile, recompute=layers[:1])
    _same_problem(rebuilt.problem, fresh.problem)
    for part in ("compute", "state_memory", "activation_memory", "forward"):
        assert all(np.array_equal(x, y) for x, y in zip(getattr(rebuilt, part), getattr(fresh, part)))
    # recomputation changed the activations it should: the rebuild's own, not the first build's
    assert any(not np.array_equal(x, y) for x, y in zip(rebuilt.activation_memory, first.activation_memory))
    assert rebuilt.activation_memory is not first.activation_memory

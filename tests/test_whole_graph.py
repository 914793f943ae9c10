"""A whole real model, one random strategy per node, resharding between them, on a
virtual 2x2 mesh: the output equals the model's."""

import random

import pytest
import torch
from torch.utils import _pytree as pytree

from autopar.passes.simulate import simulate_graph
from autopar.passes.strategy_graph import build_strategy_graph


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "bert", "torch_transformer"])
def test_random_strategy_per_node_matches_the_model(name, seed, captured_models):
    model, inputs, cap = captured_models[name]
    graph = build_strategy_graph(cap, (2, 2))
    rng = random.Random(seed)
    choice = {node: rng.randrange(len(ns.strategies)) for node, ns in graph.nodes.items()}
    sharded = sum(1 for n, i in choice.items() if i > 0)
    assert sharded > len(choice) // 2  # most nodes really are split somehow
    outputs = simulate_graph(graph, choice, cap.placeholder_values(model, inputs), rng)
    with torch.no_grad():
        expected = [x for x in pytree.tree_leaves(model(*inputs)) if isinstance(x, torch.Tensor)]
    got = [outputs[i] for i in cap.user_outputs]
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)

"""Invariant 1: every strategy a rule emits is correct, by SPMD simulation.

Two sources of calls: random shapes for every op family (``op_samples``), and every
node of the five captured models, run on the values the model really produces there.
Meshes: 1-D (2,) and (4,), 2-D (2, 2), 3-D (2, 2, 2).
"""

import random

import pytest
import torch
from torch.utils import _pytree as pytree

from autopar.passes import rules
from autopar.passes.simulate import check_strategy
from autopar.passes.strategy_graph import build_strategy_graph, tensor_inputs
from autopar.passes.op_strategies import OpInfo
from tests.coverage_models import COVERAGE_MODELS, captured
from autopar.op_samples import SAMPLERS

MESHES = [(2,), (4,), (2, 2), (2, 2, 2)]
checked: list[int] = []


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("family", sorted(SAMPLERS))
def test_random_calls(family, mesh):
    rng = random.Random(f"{family}{mesh}")
    n = 0
    for _ in range(2):
        op, args, kwargs = SAMPLERS[family](rng)
        info = OpInfo.from_call(op, args, kwargs)
        inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        strategies = rules.strategies_for(info, mesh)
        assert rules.rule_for(op) is not None, f"no rule for {op}"
        for strategy in strategies:
            check_strategy(info, strategy, inputs, mesh, rng)
        n += len(strategies)
    checked.append(n)


def node_values(model, inputs, cap, kwargs=None):
    """node -> (its tensor inputs as it read them, its outputs as it made them)."""
    values = {}

    def copy(tree):
        return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            # Copies, taken when the node runs: an in-place op, on the value itself
            # (Mixtral's div_) or on a view of it (BART's shift_tokens_right writes into
            # a slice of new_zeros), changes what later readers see.
            read = [copy(self.env[src]) for src in tensor_inputs(node)] if node.op == "call_function" else []
            out = super().run_node(node)
            values[node] = (read, copy(out))
            return out

    Recorder(cap.gm).run(*cap.placeholder_values(model, inputs, kwargs))
    return values


# On the 3-D mesh a linear has hundreds of strategies; a random sample per node keeps
# the run short while every node and every kind of combination still gets exercised
# (and on the 2-D mesh for the models of tests/coverage_models, on this shared machine).
SAMPLE_3D = 12


@pytest.mark.parametrize("mesh", [(2, 2), (2, 2, 2), (4,)], ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "bert", "torch_transformer"])
def test_every_node_of_real_models(name, mesh, captured_models):
    model, inputs, cap = captured_models[name]
    sample = SAMPLE_3D if len(mesh) == 3 else None
    check_every_node(name, model, inputs, {}, cap, mesh, sample)


@pytest.mark.parametrize("name", sorted(COVERAGE_MODELS))
def test_every_node_of_vision_and_encoder_decoder_models(name):
    """ResNet's convolutions and training batch norms, Whisper's conv1d front, ... on a 2x2 mesh."""
    model, args, kwargs, cap = captured(name)
    check_every_node(name, model, args, kwargs, cap, (2, 2), SAMPLE_3D)


def check_every_node(name, model, args, kwargs, cap, mesh, sample=None):
    """Every node's strategies (at most ``sample`` of them, drawn at random) simulated."""
    values = node_values(model, args, cap, kwargs)
    graph = build_strategy_graph(cap, mesh)
    rng = random.Random(name)
    n = 0
    for node, ns in graph.nodes.items():
        if ns.info is None:
            continue
        node_inputs, outputs = values[node]
        expected = [x for x in pytree.tree_leaves(outputs) if isinstance(x, torch.Tensor)]
        strategies = ns.strategies
        if sample is not None and len(strategies) > sample:
            strategies = [strategies[0], *rng.sample(strategies[1:], sample - 1)]
        for strategy in strategies:
            check_strategy(ns.info, strategy, node_inputs, mesh, rng, expected=expected)
        n += len(strategies)
    checked.append(n)


def test_at_least_1000_strategies_were_checked():
    """Runs last in this file (pytest keeps file order)."""
    total = sum(checked)
    print(f"SPMD property test: {total} strategies checked")
    assert total >= 1000, f"only {total} strategies were checked"


@pytest.mark.parametrize("source, target, passes", [
    (torch.float64, torch.float32, False), (torch.float32, torch.bfloat16, False),
    (torch.bfloat16, torch.float16, False), (torch.float32, torch.int64, False),
    (torch.float32, torch.float32, True), (torch.bfloat16, torch.float32, True),
    (torch.float32, torch.float64, True)])
def test_a_pending_sum_passes_only_through_casts_that_keep_its_digits(source, target, passes):
    """Summing after a narrowing cast rounds each rank's part instead of the sum. After a widening
    one the sum is more exact than one process's, which summed in ``source``: up to its rounding."""
    x = torch.randn(4, 6, dtype=torch.float64).to(source)
    rounding = 2 * torch.finfo(source).eps if source.is_floating_point else 1e-4
    info = OpInfo.from_call(torch.ops.aten._to_copy.default, (x,), {"dtype": target})
    strategies = rules.strategies_for(info, (2,))
    partial_in = [s for s in strategies if s.inputs[0][0].is_partial()]
    assert bool(partial_in) == passes
    rng = random.Random(0)
    for strategy in strategies:
        check_strategy(info, strategy, [x], (2,), rng, rtol=rounding, atol=rounding)

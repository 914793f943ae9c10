"""The strategy graph offers the layouts people write by hand."""

import warnings

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.capture import capture
from autopar.passes.placements import parse_spec
from autopar.passes.strategy_graph import NoRuleWarning, build_strategy_graph

R = Replicate()


def strategy_texts(graph, node):
    return {str(s) for s in graph[node].strategies}


def nodes_of(graph, target: str):
    return [n for n in graph.nodes if n.op == "call_function" and str(n.target) == target]


@pytest.fixture(scope="module")
def llama_graph(captured_models):
    _, _, cap = captured_models["llama"]
    return build_strategy_graph(cap, (2, 2))


def test_megatron_column_then_row_parallel_mlp(llama_graph):
    """gate/up: weight split on out-features -> output split on the hidden dim;
    down: input and weight split on the contraction -> Partial output."""
    linears = nodes_of(llama_graph, "aten.linear.default")
    texts = set().union(*(strategy_texts(llama_graph, n) for n in linears))
    assert "(RR, S(0)R) -> S(2)R" in texts  # column parallel on mesh axis 0
    assert "(RS(2), RS(1)) -> RP" in texts  # row parallel on mesh axis 1
    assert "(S(0)S(2), RS(1)) -> S(0)P" in texts  # row parallel inside data parallel


def test_sequence_parallel_norm_and_data_parallel(llama_graph, captured_models):
    means = nodes_of(llama_graph, "aten.mean.dim")  # RMSNorm's variance
    assert any("(RS(1)) -> RS(1)" in strategy_texts(llama_graph, n) for n in means)
    emb = nodes_of(llama_graph, "aten.embedding.default")[0]
    texts = strategy_texts(llama_graph, emb)
    assert "(RR, S(0)R) -> S(0)R" in texts  # batch split: data parallel
    assert "(S(0)R, RR) -> PR [vocab_parallel_embedding]" in texts  # Megatron vocab parallel


def test_sequence_parallel_transitions_exist(llama_graph):
    """All-gather before the expanding matmul: its input S(seq) -> needs R; reduce-scatter
    after the contracting one: Partial output -> consumer wants S(seq). Both ends exist."""
    linears = nodes_of(llama_graph, "aten.linear.default")
    texts = set().union(*(strategy_texts(llama_graph, n) for n in linears))
    assert "(RS(1), RR) -> RS(1)" in texts  # a linear may also run sequence-split
    adds = nodes_of(llama_graph, "aten.add.Tensor")
    add_texts = set().union(*(strategy_texts(llama_graph, n) for n in adds))
    assert "(RS(1), RS(1)) -> RS(1)" in add_texts  # residual adds stay sequence-split


def test_parameters_can_be_fully_sharded(llama_graph, captured_models):
    _, _, cap = captured_models["llama"]
    weight = next(n for n in llama_graph.nodes if cap.params.get(n.name) == "model.layers.0.mlp.up_proj.weight")
    specs = {s.output for s in llama_graph[weight].strategies}
    assert parse_spec("S(0)S(0)") in specs  # ZeRO-3 / FSDP over both axes
    assert parse_spec("S(0)R") in specs and parse_spec("RR") in specs
    assert not any(isinstance(p, Partial) for s in specs for p in s)


def test_indivisible_dims_are_excluded():
    model = torch.nn.Linear(6, 3)  # 3 output features: cannot split by 2
    cap = capture(model, (torch.randn(5, 6),))
    graph = build_strategy_graph(cap, (2,))
    node = nodes_of(graph, "aten.linear.default")[0]
    for s in graph[node].strategies:
        assert s.outputs[0] != (Shard(1),) and s.inputs[0] != (Shard(0),), str(s)


class Odd(torch.nn.Module):
    def forward(self, x):
        return torch.ops.aten.prod.default(x) + 1


def test_op_without_rule_is_replicated_with_one_warning():
    cap = capture(Odd(), (torch.randn(4, 4),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = build_strategy_graph(cap, (2,))
    named = [w for w in caught if issubclass(w.category, NoRuleWarning)]
    assert len(named) == 1 and "aten.prod.default" in str(named[0].message)
    node = nodes_of(graph, "aten.prod.default")[0]
    assert [str(s) for s in graph[node].strategies] == ["(R) -> R"]
    assert graph.missing_rules == {"aten.prod.default": 1}


def test_getitem_follows_its_producer(captured_models):
    _, _, cap = captured_models["mixtral"]
    graph = build_strategy_graph(cap, (2,))
    topk = nodes_of(graph, "aten.topk.default")[0]
    users = list(topk.users)
    assert users and all(graph[u].follows == (topk, u.args[1]) for u in users)
    assert all(graph[u].strategies is graph[topk].strategies for u in users)


def test_bad_mesh_shape():
    cap = capture(torch.nn.Linear(2, 2), (torch.randn(2, 2),))
    with pytest.raises(ValueError, match="autopar: expected a mesh shape"):
        build_strategy_graph(cap, (0, 2))

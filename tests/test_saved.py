"""The values the cost model says backward keeps are the ones autograd keeps."""

import warnings

import torch

from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.costing import requires_grad
from autopar.passes.saved import VIEWS, kept_for_backward, saved_roles
from autopar.passes.strategy_graph import build_strategy_graph


def test_kept_bytes_match_what_autograd_saves():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, max_seq_len=64, dim=128, n_heads=4, n_layers=2))
    tokens = torch.randint(0, 512, (4, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (tokens,))
    graph = build_strategy_graph(cap, ())
    kept = kept_for_backward(cap.graph.nodes, requires_grad(graph))
    predicted = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in kept
                    if n.op == "call_function" and str(n.target) not in VIEWS)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    measured = sum(seen.values())
    # eager keeps the attention output's reshape copy, which the graph has as a view
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


def test_roles_of_common_ops():
    graph = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()))
    # roles are read from node metadata: give the traced nodes their values
    x = torch.randn(4, 8)
    torch.fx.passes.shape_prop.ShapeProp(graph).propagate(x)
    for node in graph.graph.nodes:
        if "tensor_meta" in node.meta:
            tm = node.meta["tensor_meta"]
            node.meta["val"] = torch.empty(tm.shape, dtype=tm.dtype, device="meta")
    cache = {}
    nodes = {str(n.target): n for n in graph.graph.nodes}
    linear = nodes["0"]  # a module call; the ops below read its value
    add = graph.graph.create_node("call_function", torch.ops.aten.add.Tensor, (linear, linear))
    add.meta["val"] = linear.meta["val"]
    mul = graph.graph.create_node("call_function", torch.ops.aten.mul.Tensor, (linear, linear))
    mul.meta["val"] = linear.meta["val"]
    assert saved_roles(add, cache) == (set(), False)
    assert saved_roles(mul, cache) == ({0, 1}, False)

"""The values the cost model says backward keeps are the ones autograd keeps."""

import math
import warnings

import torch

from autopar.costmodels.presets import h100
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs, requires_grad
from autopar.passes.placements import local_shape
from autopar.passes.saved import VIEWS, is_view, keep_bases, saved_roles, saved_values
from autopar.passes.strategy_graph import build_strategy_graph


def test_kept_bytes_match_what_autograd_saves():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, max_seq_len=64, dim=128, n_heads=4, n_layers=2))
    tokens = torch.randint(0, 512, (4, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (tokens,))
    graph = build_strategy_graph(cap, ())
    nodes = list(cap.graph.nodes)
    saved = saved_values(nodes, requires_grad(graph))
    # wherever it is charged: held where made, or read by a saving consumer (with its base)
    kept = keep_bases(nodes, set(saved.held) | {src for r in saved.reads.values() for _, src, _ in r})
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
    assert saved_roles(add, cache) == ({}, False)
    assert saved_roles(mul, cache) == ({0: 1.0, 1: 1.0}, False)
    # no gradient flows to the second operand: its backward keeps the first one only
    assert saved_roles(mul, cache, grad=(True, False)) == ({1: 1.0}, False)


def test_a_reshape_of_an_expanded_value_is_a_copy_and_of_a_contiguous_one_a_view():
    """The copy a reshape of an expanded value makes is a ``clone`` of its own after capture
    (priced and charged as a copy), the reshape of it a view; a contiguous value's reshape a view."""
    class Repeat(torch.nn.Module):
        def forward(self, x):  # the grouped-query attention's repeat_kv pattern
            return x.unsqueeze(1).expand(4, 3, 8).reshape(12, 8), x.reshape(32)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(Repeat(), (torch.zeros(4, 8),))
    views = {n.name: is_view(n) for n in cap.nodes("call_function")}
    assert views == {"unsqueeze": True, "expand": True, "clone_default": False, "reshape": True, "reshape_1": True}


def test_a_cast_to_the_dtype_it_has_is_the_value_itself():
    """``x.to(torch.float32)`` of a float32 ``x`` returns ``x`` (an RMSNorm in a float32 model):
    readers that save the cast share ``x``'s bytes; a cast to another dtype is a copy."""

    class Casts(torch.nn.Module):
        def forward(self, x):
            same, other = x.to(torch.float32), x.to(torch.bfloat16)
            return (same * same).sum() + (other * other).sum().float() + (x * x).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(Casts(), (torch.zeros(4, 8, requires_grad=True),))
    casts = [n for n in cap.nodes("call_function") if n.target is torch.ops.aten.to.dtype]
    assert [is_view(n) for n in casts[:2]] == [True, False]
    saved = saved_values(list(cap.graph.nodes), set(cap.nodes()))
    same_reads = [r for reads in saved.reads.values() for r in reads if r[1] is casts[0]]
    x_reads = [r for reads in saved.reads.values() for r in reads if r[1] is casts[0].args[0]]
    # x is read by two saving products, itself and through its same-dtype cast: one copy shared
    assert sum(share for _, _, share in same_reads + x_reads) == 1.0


def test_a_saved_input_is_charged_to_its_reader_in_the_placement_it_reads():
    """A matmul that reads its input gathered (strategy input Replicate) keeps the gathered
    copy for backward, four times the shard its producer holds on a 4-way axis."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(64))
            self.proj = torch.nn.Linear(64, 64, bias=False)

        def forward(self, x):
            return self.proj(x * self.w).sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(Scaled(), (torch.zeros(32, 64),))
    graph = build_strategy_graph(cap, (4,))
    costs = build_costs(graph, h100((4,)))
    linear = next(n for n in graph.nodes if str(n.target) == "aten.linear.default")
    scaled = linear.args[0]
    val = scaled.meta["val"]
    read = [math.prod(local_shape(tuple(val.shape), s.inputs[0], (4,))) * val.element_size()
            for s in graph[linear].strategies]
    assert max(read) == 4 * min(read)
    assert list(costs.activation_memory[costs.index[linear]]) == read
    assert not costs.activation_memory[costs.index[scaled]].any()  # only its reader keeps it

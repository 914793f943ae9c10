"""Costing: orderings of the cost tables, the backward collectives on edges, ZeRO memory, ties."""

import copy
import dataclasses
import math
from types import SimpleNamespace
import warnings

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.nn.parallel import distributed as ddp

from autopar import costmodels
from autopar.costmodels import comm
from autopar.passes.capture import capture
from autopar.passes.costing import ZERO_LEVELS, Pricer, build_costs, checkpoint_inputs
from autopar.passes.edge_costs import EdgeInput, parameter_shares
from autopar.passes.op_strategies import TensorMeta
from autopar.passes.planner import layouts
from autopar.passes.planner.reasons import axis_roles, layer_collectives
from autopar.passes.solve.problem import plan_costs
from autopar.passes.solve.shrink import shrink_problem
from autopar.passes.state_costs import zero_costs
from autopar.passes.strategy_graph import build_strategy_graph
from autopar.runtime import gradsync
from tests.models import llama, small_gpt


@pytest.fixture(scope="module")
def gpt_costs():
    model, inputs = small_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, inputs), (2, 2))
    return build_costs(graph, costmodels.preset("h100", (2, 2)), memory_limit=80e9)


def _node(costs, name):
    return next(n for n in costs.graph.nodes if n.name == name)


def _index(strategies, text):
    return [str(s) for s in strategies].index(text)


def test_splitting_the_batch_cuts_compute(gpt_costs):
    node = _node(gpt_costs, "linear")  # first q projection
    strategies = gpt_costs.graph.nodes[node].strategies
    t = gpt_costs.compute[gpt_costs.index[node]]
    whole = t[_index(strategies, "(RR, RR, RR) -> RR")]
    split = t[_index(strategies, "(S(0)S(0), RR, RR) -> S(0)S(0)")]
    assert 0 < split < whole


def test_replicated_weight_of_batch_split_op_pays_gradient_all_reduce(gpt_costs):
    """placements.gradient_spec: the weight's gradient comes back Partial over both axes -> all-reduced."""
    costs, profile = gpt_costs, gpt_costs.profile
    node = _node(costs, "linear")
    weight = node.args[1]
    (u, v, table), = [(u, v, r) for (src, dst, _), (u, v, r) in zip(costs.edge_inputs, costs.problem.edges)
                      if src is weight and dst is node]
    i = _index(costs.graph.nodes[weight].strategies, "() -> RR")
    j = _index(costs.graph.nodes[node].strategies, "(S(0)S(0), RR, RR) -> S(0)S(0)")
    nbytes = math.prod(weight.meta["val"].shape) * 4
    # the gradient travels in DDP-style buckets: it pays its bytes' part of their latency
    params = [n for n in costs.graph.nodes if n.name in costs.graph.captured.params]
    total = sum(math.prod(p.meta["val"].shape) * 4 for p in params)
    share = costmodels.gradient_buckets(total) * nbytes / total
    assert share < 1
    expected = sum(costmodels.collective_time("all_reduce", nbytes, a, profile, share) for a in (0, 1))
    assert table[i, j] == pytest.approx(expected)
    alone = sum(costmodels.collective_time("all_reduce", nbytes, a, profile) for a in (0, 1))
    assert table[i, j] < alone
    k = _index(costs.graph.nodes[node].strategies, "(RR, RR, RR) -> RR")
    assert table[i, k] == 0.0  # replicated compute: no gradient sync


def test_bucketed_parameters_pay_each_call_latency_once(gpt_costs):
    """Over all parameters the latency shares add up to one alpha per bucket: per
    gradient bucket for all-reduces, per layer (or stretch between layers) for gathers."""

    shares = parameter_shares(gpt_costs.graph)
    params = [n for n in gpt_costs.graph.nodes if n.name in gpt_costs.graph.captured.params]
    total = sum(math.prod(p.meta["val"].shape) * 4 for p in params)
    assert sum(s.all_reduce for s in shares.values()) == pytest.approx(costmodels.gradient_buckets(total))
    layers = {gpt_costs.layer_of[p] for p in params if p in gpt_costs.layer_of}
    assert len(layers) >= 2
    # one gather per layer, one for the embeddings before them, one for what comes after
    assert sum(s.gather for s in shares.values()) == pytest.approx(len(layers) + 2)


def test_sharded_weight_gathered_forward_reduce_scattered_backward(gpt_costs):
    costs = gpt_costs
    node = _node(costs, "linear")
    weight = node.args[1]
    (table,) = [r for (src, dst, _), (u, v, r) in zip(costs.edge_inputs, costs.problem.edges)
                if src is weight and dst is node]
    i = _index(costs.graph.nodes[weight].strategies, "() -> RS(0)")
    j = _index(costs.graph.nodes[node].strategies, "(S(0)S(0), RR, RR) -> S(0)S(0)")
    k = _index(costs.graph.nodes[node].strategies, "(RR, RR, RR) -> RR")
    assert table[i, k] > 0  # gathered before use even by replicated compute
    assert table[i, j] > table[i, k]  # a batch-split consumer adds the gradient's reduction


def test_zero_levels_order_memory_and_forbid_useless_levels():
    profile = costmodels.preset("h100", (8,))
    meta = TensorMeta((4096, 4096), torch.float32)
    replicated = [zero_costs(meta, (Replicate(),), z, "fp32", profile) for z in ZERO_LEVELS]
    psi = 4096 * 4096
    # fp32 bytes per parameter: 4 + 4 + 8 whole; ZeRO-1 splits the 8 of AdamW; ZeRO-2 the gradient's 4
    # and the stored parameter's 4 too, and holds a whole copy gathered for the step
    assert [r[2] for r in replicated] == [16 * psi, 8 * psi + 8 * psi / 8, 4 * psi + 16 * psi / 8]
    # level 1 gathers the updated parameters after the step; the gradient's all-reduce is the edges'
    assert replicated[1][1] == pytest.approx(costmodels.collective_time("all_gather", 4 * psi, 0, profile))
    assert replicated[0][1] == 0.0 and 0.0 <= replicated[2][1] < replicated[1][1]
    assert replicated[0][0] > replicated[1][0]  # the optimizer steps 1/8 of the state
    sharded = [zero_costs(meta, (Shard(0),), z, "fp32", profile) for z in ZERO_LEVELS]
    assert sharded[0][2] == pytest.approx(replicated[0][2] / 8)
    assert all(math.isinf(s[0]) for s in sharded[1:])  # nothing left to shard over


def test_getitems_follow_and_identical_layers_are_tied(gpt_costs):
    costs = gpt_costs
    followers = {f.node for f in costs.problem.followers}
    for node, ns in costs.graph.nodes.items():
        if ns.follows is not None:
            assert costs.index[node] in followers
    names = costs.problem.node_names
    tied = {tuple(names[v] for v in group) for group in costs.problem.ties}
    assert ("linear", "linear_6") in tied  # q projection of block 0 and block 1
    assert ("zero[p_blocks_0_mlp_up_weight]", "zero[p_blocks_1_mlp_up_weight]") in tied
    assert {costs.layer_of[_node(costs, "linear")], costs.layer_of[_node(costs, "linear_6")]} == {0, 1}


def test_layers_that_differ_are_not_tied():
    class Uneven(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)])

        def forward(self, x):
            return self.layers[1](self.layers[0](x))

    graph = build_strategy_graph(capture(Uneven(), (torch.randn(4, 16),)), (2,))
    costs = build_costs(graph, costmodels.preset("h100", (2,)))
    assert costs.problem.ties == []
    assert sorted(set(costs.layer_of.values())) == [0, 1]


def test_ties_bind_leaders_only_so_the_problem_shrinks():
    """A follower's leader may sit outside its layer (Llama's first cast follows the embedding):
    ties hold leaders only, so ``shrink_problem`` never sees a tie it must reject (seen on the
    126-layer 405B graph; this small model checks the invariant)."""

    model, inputs = llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, inputs), (2, 2))
    costs = build_costs(graph, costmodels.preset("h100", (2, 2)))
    followers = {f.node for f in costs.problem.followers}
    assert costs.problem.ties and not any(v in followers for g in costs.problem.ties for v in g)
    shrunk = shrink_problem(costs.problem)
    assert shrunk.num_nodes < costs.problem.num_nodes


def _whole(strategies):
    """The strategy that computes on whole values (every placement Replicate)."""
    return next(i for i, s in enumerate(strategies)
                if all(p is None or all(isinstance(q, Replicate) for q in p) for p in (*s.inputs, *s.outputs)))


def test_backward_is_priced_by_the_ops_autograd_runs(gpt_costs):
    """costmodels.backward_ops: nothing for an add, a gelu_backward for a gelu, two matmuls
    and the bias gradient's sum for a linear with a bias; ``forward`` keeps the forward."""
    costs, profile = gpt_costs, gpt_costs.profile
    first = {}
    for node in costs.graph.nodes:
        first.setdefault(str(node.target), node)
    add, gelu, linear = first["aten.add.Tensor"], first["aten.gelu.default"], first["aten.linear.default"]
    v = costs.index[add]
    assert np.array_equal(costs.compute[v], costs.forward[v]) and costs.forward[v].max() > 0
    v = costs.index[gelu]
    i = _whole(costs.graph.nodes[gelu].strategies)
    nbytes = 2 * math.prod(gelu.meta["val"].shape) * 4
    assert costs.forward[v][i] == pytest.approx(costmodels.compute_time(0, nbytes, "fp32", profile, "gelu"))
    assert costs.compute[v][i] - costs.forward[v][i] == pytest.approx(
        costmodels.compute_time(0, 1.5 * nbytes, "fp32", profile, "gelu_backward"))
    v = costs.index[linear]
    i = _whole(costs.graph.nodes[linear].strategies)
    out_bytes = math.prod(linear.meta["val"].shape) * 4
    assert costs.compute[v][i] - costs.forward[v][i] == pytest.approx(
        2 * costs.forward[v][i] + costmodels.compute_time(0, out_bytes, "fp32", profile, "memory"))


def test_recomputed_layers_pay_their_forward_again(gpt_costs):
    costs = gpt_costs
    again = build_costs(costs.graph, costs.profile, memory_limit=80e9, recompute=True)
    linear = _node(costs, "linear")
    v = costs.index[linear]
    assert np.allclose(again.compute[v], costs.compute[v] + costs.forward[v])
    assert np.array_equal(again.forward[v], costs.forward[v])


def _activations(costs, assignment, nodes):
    return sum(float(costs.activation_memory[costs.index[n]][assignment[costs.index[n]]]) for n in nodes)


def test_recomputed_layers_keep_their_inputs_and_one_layers_activations(gpt_costs):
    """Checkpointed layers hold what enters them (whether or not an op's backward would) and,
    while backward rebuilds them one at a time, one layer's activations: every layer
    recomputed keeps one layer's inside activations in all, not none."""

    costs = gpt_costs
    again = build_costs(costs.graph, costs.profile, memory_limit=80e9, recompute=True)
    whole = costs.assignment({n: _whole(ns.strategies) for n, ns in costs.graph.nodes.items()})
    layers = sorted(set(costs.layer_of.values()))
    assert len(layers) >= 2
    inside = {k: [n for n, layer in costs.layer_of.items() if layer == k and n.op != "placeholder"
                  and all(costs.layer_of.get(u) == k for u in n.users)] for k in layers}
    per_layer = [_activations(costs, whole, inside[k]) for k in layers]
    assert min(per_layer) > 0
    assert _activations(again, whole, [n for k in layers for n in inside[k]]) == pytest.approx(
        sum(per_layer) / len(layers))
    held = checkpoint_inputs(list(costs.graph.nodes), costs.layer_of, set(layers))
    assert held and all(again.activation_memory[costs.index[n]][whole[costs.index[n]]] > 0
                        for n in held if n in costs.index and costs.graph.nodes[n].follows is None)
    # fewer layers recomputed: those keep one layer's worth between them, the others all of theirs
    first = build_costs(costs.graph, costs.profile, memory_limit=80e9, recompute=[layers[0]])
    assert _activations(first, whole, inside[layers[0]]) == pytest.approx(per_layer[0])


def test_activation_moves_are_priced_after_compute_and_parameter_moves_back_to_back(gpt_costs):
    """With in-step fits 10x slower than back to back, every edge carrying an activation
    costs more (or nothing, where nothing moves) and every parameter's edge (bucketed
    gathers and gradient reductions) costs what it did."""

    costs = gpt_costs
    slow = copy.deepcopy(costs.profile)
    for axis in slow.axes:
        axis.in_step = {c: costmodels.CollectiveFit(alpha_s=10 * f.alpha_s, beta_bytes_per_s=f.beta_bytes_per_s / 10)
                        for c, f in axis.collectives.items()}
    again = build_costs(costs.graph, slow, memory_limit=80e9)
    params = costs.graph.captured.params
    slower = 0
    for (src, _, _), (_, _, before), (_, _, after) in zip(costs.edge_inputs, costs.problem.edges, again.problem.edges):
        if src.name in params:
            assert np.array_equal(before, after), src.name
        else:
            moving = before > 0
            assert np.allclose(after[~moving], 0) and np.all(after[moving] > before[moving]), src.name
            slower += int(moving.any())
    assert slower > 10


def test_alike_consumers_share_one_move(gpt_costs):
    """q, k and v read one normed activation: codegen moves it once for the three (and
    reduces its gradient once), so each edge pays a third of the move."""
    costs = gpt_costs
    norm = next(n for n in costs.graph.nodes if str(n.target) == "aten.layer_norm.default")
    readers = [(dst, table) for (src, dst, _), (_, _, table) in zip(costs.edge_inputs, costs.problem.edges)
               if src is norm]
    assert [str(dst.target) for dst, _ in readers] == ["aten.linear.default"] * 3
    dst = readers[0][0]
    alone = costs.pricer.edge(EdgeInput(TensorMeta.of(norm.meta["val"]), costs.graph.nodes[norm], 0,
                                        costs.graph.nodes[dst], 0, True))
    assert alone.max() > 0
    for _, table in readers:
        assert np.allclose(table, alone / 3)


def test_bucketed_parameter_moves_pay_their_packing_copies():
    """A ZeRO-3 parameter's gather packs its shard into the bucket's flat buffer (X/n bytes
    read and written) and copies it out whole (X and X); its gradient's reduce-scatter packs
    the gradient (X and X). Hand-computed for a (256, 64) fp32 weight on 4 ranks."""


    assert costmodels.bucket_copy_bytes("all_gather", 65536, 4) == 2 * 16384 + 2 * 65536
    assert costmodels.bucket_copy_bytes("reduce_scatter", 65536, 4) == 2 * 65536
    assert costmodels.bucket_copy_bytes("all_reduce", 65536, 4) == 0.0
    assert costmodels.bucket_copy_bytes("all_gather", 65536, 1) == 0.0
    profile = dataclasses.replace(costmodels.preset("h100", (4,)), overlap={})  # nothing hidden: whole seconds
    pricer = Pricer(SimpleNamespace(mesh_shape=(4,)), profile)
    meta = TensorMeta.of(torch.empty(256, 64))
    src, dst, grad = (Shard(0),), (Replicate(),), (costmodels.comm.Partial(),)
    plain = pricer.move(meta, src, dst, grad).seconds
    packed = pricer.move(meta, src, dst, grad, bucketed=True)

    def copy(nbytes: float) -> float:
        return costmodels.compute_time(0.0, nbytes, "fp32", profile, "aten.copy_.default")

    assert plain == pytest.approx(costmodels.collective_time("all_gather", 65536, 0, profile)
                                  + costmodels.collective_time("reduce_scatter", 65536, 0, profile))
    assert packed.seconds - plain == pytest.approx(copy(163840) + copy(131072))
    assert [c.seconds for c in packed.charges if c.copies] == pytest.approx([copy(163840), copy(131072)])
    assert pricer.move(meta, dst, dst, None, bucketed=True).seconds == 0.0  # nothing moved, nothing copied


def test_gradient_buckets_are_ddp_s_and_the_runtime_s():
    """One definition of the bucket sizes: DDP's defaults, which the runtime packs by."""
    assert comm.FIRST_GRADIENT_BUCKET_BYTES == torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
    assert comm.GRADIENT_BUCKET_BYTES == ddp._DEFAULT_BUCKET_CAP_MB * 2**20
    sizes = {name: comm.FIRST_GRADIENT_BUCKET_BYTES // 2 + 1 for name in "abcd"}
    opened = gradsync.buckets_of(list(sizes), lambda name: (), sizes.__getitem__)
    assert [names for _, names in opened] == [["a"], ["b", "c", "d"]]  # the first at 1 MiB, then 25 MiB
    assert costmodels.gradient_buckets(sum(sizes.values())) == len(opened)


# One price per resharding edge: the solver's edge tables and explain()'s per-layer
# collectives (reasons.layer_collectives) read the same itemised EdgePrice.

EDGE_LAYOUTS = ("dp", "fsdp", "tp+dp", "zero1")


def _layout(costs, name):
    h = layouts.hint(name, costs.graph, complete=True)
    return costs.assignment(h.choice, h.zero)


def _assignments(costs):
    """Manual layouts, and random strategies per node (the tables price any pair)."""
    rng = np.random.default_rng(0)
    randoms = [[int(rng.integers(len(t))) for t in costs.problem.node_time] for _ in range(3)]
    return [_layout(costs, name) for name in EDGE_LAYOUTS] + randoms


def test_every_edge_price_is_its_table_entry(gpt_costs):
    costs = gpt_costs
    for assignment in _assignments(gpt_costs):
        charged = plan_costs(costs.problem, assignment).edge_time
        for e in range(len(costs.problem.edges)):
            price = costs.edge_price(e, assignment)
            assert price.seconds == charged[e]
            # what the step waits for: each charge less what of it hides behind compute
            assert sum(c.seconds - c.hidden for c in price.charges) == pytest.approx(price.seconds, rel=1e-12, abs=1e-18)


def test_edge_tables_hold_each_pairs_price_whole_and_under_masks(gpt_costs):
    """``EdgePricer.edge`` prices each distinct pair of placements once and spreads it: every
    entry is ``price(edge, i, j)``, inf where a mask forbids a strategy (a one-sided table is
    priced whole, masks aside)."""
    pricer = Pricer(gpt_costs.graph, gpt_costs.profile)
    rng = np.random.default_rng(0)
    masked = 0
    for edge in gpt_costs.edge_prices:
        rows = rng.random(len(edge.producer.strategies)) < 0.7
        cols = rng.random(len(edge.consumer.strategies)) < 0.7
        for r, c in ((None, None), (rows, cols)):
            table = pricer.edge(edge, r, c)
            one_sided = r is not None and not np.isinf(table).any()
            for i, j in np.ndindex(table.shape):
                if r is not None and not one_sided and not (r[i] and c[j]):
                    assert table[i, j] == math.inf
                    masked += 1
                else:
                    assert table[i, j] == pricer.price(edge, i, j).seconds
    assert masked  # the masks were seen


def test_per_layer_collectives_sum_to_the_solver_s_edge_times(gpt_costs):
    costs = gpt_costs
    layers = sorted(set(costs.layer_of.values()))
    assert layers
    for assignment in _assignments(gpt_costs):
        charged = plan_costs(costs.problem, assignment).edge_time
        for layer in layers:
            solver = sum(t for (_, dst, _), t in zip(costs.edge_inputs, charged) if costs.layer_of.get(dst) == layer)
            explained = sum(layer_collectives(costs, assignment, layer).values())
            assert explained == pytest.approx(solver, rel=1e-9, abs=1e-15)


def test_fsdp_layer_shows_its_bucket_copies_and_both_gathers(gpt_costs):
    """What the explanation once left out: a ZeRO-3 parameter's packing copies and its
    gather again in backward."""
    costs = gpt_costs
    assignment = _layout(costs, "fsdp")
    shown = layer_collectives(costs, assignment, 0)
    assert any(k.startswith("bucket copies on ") and v > 0 for k, v in shown.items())
    gathered = [costs.edge_price(e, assignment).charges for e, (src, dst, _) in enumerate(costs.edge_inputs)
                if src.name in costs.graph.captured.params and costs.layer_of.get(dst) == 0]
    assert any(sum(c.collective == "all_gather" and c.axis == 0 and not c.copies for c in charges) == 2
               for charges in gathered)  # gathered in forward, and again in backward


def test_axis_roles_of_manual_layouts(gpt_costs):
    costs = gpt_costs
    roles = {name: axis_roles(costs, _layout(costs, name)) for name in ("dp", "tp+dp", "fsdp")}
    assert roles["dp"] == ["dp", "dp"]
    assert roles["tp+dp"][0] == "dp" and roles["tp+dp"][1].startswith("tp (")
    assert all(role.startswith("dp+") and "fsdp (" in role for role in roles["fsdp"])

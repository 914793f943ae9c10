"""Where codegen sums gradient shares and how it buckets gathered parameters (no devices:
``Flow``, ``gradient_shares`` and ``plan_buckets`` are functions of the graph and choice)."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree

from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.lowering.codegen import Flow, GradientShare, gradient_shares, lower, plan_buckets
from autopar.passes.propagate import choose_by_propagation
from autopar.passes.strategy_graph import build_strategy_graph


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (torch.randint(0, 64, (8, 8)),))
    return cap, build_strategy_graph(cap, (2,))


def by_name(graph, name):
    return next(n for n in graph.nodes if n.name == name)


def test_data_parallel_shares_travel_to_every_parameter(gpt):
    cap, graph = gpt
    choice = choose_by_propagation(graph, {by_name(graph, "tokens"): (Shard(0),)})
    shared = gradient_shares(Flow(graph, choice, None, {}))
    params = {n for n in graph.nodes if n.name in cap.params}
    assert {(p, 0) for p in params} <= shared  # all summed once per step, none on the way
    # the position embedding is replicated (its indices are): its share passes through it
    assert (by_name(graph, "embedding_1"), 0) in shared


def test_a_capture_that_makes_gradients_whole_hands_on_shares_where_the_step_sums_them(gpt):
    """A batch of one row under data parallelism over 2 ranks: nothing splits, every gradient
    comes back whole. Lowered with the sums the compiled step makes (every parameter over
    axis 0: ``sync_as``), it reports those sums and hands back half of each gradient, so the
    step's sum over the 2 ranks is the whole gradient, as one process computes it."""
    cap8, graph8 = gpt
    compiled = choose_by_propagation(graph8, {by_name(graph8, "tokens"): (Shard(0),)})
    sync_as = {cap8.params[n.name]: (0,) for n in graph8.nodes if n.name in cap8.params}
    assert all((by_name(graph8, ph), 0) in gradient_shares(Flow(graph8, compiled, None, {})) for ph in cap8.params)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=2, dropout=0.0))
    tokens = torch.randint(0, 64, (1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (tokens,))
    graph = build_strategy_graph(cap, (2,))
    choice = choose_by_propagation(graph, {by_name(graph, "tokens"): (Replicate(),)})
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        program = lower(graph, choice, init_device_mesh("cpu", (2,)), sync_as=sync_as)
    finally:
        dist.destroy_process_group()
    assert {cap.params[ph]: axes for ph, axes in program.grad_sync.items()} == sync_as
    shares = [m for m in program.gm.modules() if isinstance(m, GradientShare)]
    assert len(shares) == len(cap.params) and all(m.factor == 0.5 for m in shares)
    values = cap.state_values(model)
    state = {ph: values[ph].detach().clone().requires_grad_(True) for ph in cap.params}
    logits = pytree.tree_leaves(program.gm(*[state.get(ph, values.get(ph, tokens)) for ph in cap.placeholders]))[0]
    halves = torch.autograd.grad(logits.sum(), list(state.values()))
    whole = torch.autograd.grad(model(tokens).sum(), [dict(model.named_parameters())[cap.params[ph]] for ph in state])
    for ph, half, full in zip(state, halves, whole):
        torch.testing.assert_close(2 * half, full, msg=ph)


def test_megatron_all_reduces_where_column_parallel_layers_read(gpt):
    cap, graph = gpt
    fixed = {}
    for node in graph.nodes:
        fqn = cap.params.get(node.name, "")
        if any(k in fqn for k in (".q.", ".k.", ".v.", ".up.")):
            fixed[node] = (Shard(0),)
        elif fqn.endswith((".o.weight", ".down.weight")):
            fixed[node] = (Shard(1),)
    choice = choose_by_propagation(graph, fixed)
    shared = gradient_shares(Flow(graph, choice, None, {}))
    # the layer norm's output feeds column-parallel linears and the residual stream does
    # not: its share is summed right there (Megatron's "f"), not passed up
    ln = by_name(graph, "layer_norm")
    assert all(isinstance(p, Replicate) for p in graph[ln].strategies[choice[ln]].output)
    assert (ln, 0) not in shared
    assert (by_name(graph, "p_blocks_0_ln1_weight"), 0) not in shared


def test_zero3_gathers_a_bucket_per_layer_and_stretch(gpt):
    cap, graph = gpt
    choice = choose_by_propagation(graph, {by_name(graph, "tokens"): (Shard(0),)})
    for node, ns in graph.nodes.items():
        if node.name in cap.params and node.meta["val"].shape[0] % 2 == 0:
            choice[node] = [s.output for s in ns.strategies].index((Shard(0),))
    flow = Flow(graph, choice, None, {})
    per_use = frozenset(n.name for n in graph.nodes if n.name in cap.params)
    buckets = {id(b): b for b in plan_buckets(flow, gradient_shares(flow), per_use, {}).values()}
    names = sorted(sorted(p.name for p in b.params) for b in buckets.values())
    assert len(names) == 4  # embeddings, block 0, block 1, final norm and head
    assert ["p_head_weight", "p_ln_f_bias", "p_ln_f_weight"] in names
    assert all(b.reduce == (True,) and not b.keep for b in buckets.values())
    block0 = next(x for x in names if "p_blocks_0_attn_q_weight" in x)
    assert len(block0) == 16 and all(x.startswith("p_blocks_0_") for x in block0)

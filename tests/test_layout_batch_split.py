"""Megatron's and torchtitan's tensor parallelism keep activations whole across the TP ranks:
the batch is split over the data-parallel axes only, so a micro-batch of one sequence per
data-parallel replica is valid (issue #13: the published runs' micro-batch counts, e.g.
Megatron's 177B with M=24). Without that rule the completion of ``tp+zero1`` / ``fsdp+tp``
split the residual stream's batch over the tp axis too (layer norms on a batch slice,
reduce-scatter and all-gather around them). Costs ~10 s (a meta-device GPT of width 1024)."""

import dataclasses
import warnings

import pytest
import torch

from autopar import costmodels, layouts
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.planner.intra_op import complete
from autopar.passes.planner.microbatch import batch_split
from autopar.passes.strategy_graph import build_strategy_graph

MESH = (4, 8)  # (dp, tp)
BATCH = 64  # 16 sequences per data-parallel replica: enough to split over tp too


@pytest.fixture(scope="module")
def costs():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=4096, max_seq_len=1024, dim=1024, n_heads=8, n_layers=2)).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, (torch.zeros(BATCH, 1024, dtype=torch.long, device="meta"),)), MESH)
    return build_costs(graph, costmodels.preset("h100", MESH))


@pytest.mark.parametrize("name", ["tp+dp", "tp+zero1", "fsdp+tp"])
def test_tensor_parallel_layouts_split_the_batch_over_data_parallel_axes_only(costs, name):
    hint = layouts.hint(name, costs.graph)
    assert hint.batch_whole_axes == (1,)
    assert batch_split(costs.graph, complete(costs, hint), BATCH) == MESH[0]


def test_without_the_rule_the_completion_would_split_the_batch_over_tp(costs):
    """The rule is what keeps it: the same layout left free splits the batch over both axes."""
    free = dataclasses.replace(layouts.hint("tp+zero1", costs.graph), batch_whole_axes=())
    assert batch_split(costs.graph, complete(costs, free), BATCH) == MESH[0] * MESH[1]


def test_data_parallel_axes_split_values_by_their_batch_only():
    """``dp`` is DDP: each rank computes its own sequences, and what has no batch dim whole.
    Hugging Face Llama's rotary table (made from positions, no batch dim) once led the dp
    completion to split q_proj and the rotary ops along the sequence, with all-to-alls around
    them (on 4 gloo ranks, 2.5x the step of the same model under DDP)."""
    from autopar.models import MODELS
    from autopar.passes.planner.microbatch import batch_dims

    config = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
    with torch.device("meta"):
        model = MODELS["llama"].build(config, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_strategy_graph(capture(model, (torch.zeros(16, 64, dtype=torch.long, device="meta"),)), (2, 2))
    costs = build_costs(graph, costmodels.preset("h100", (2, 2)))
    choice = complete(costs, layouts.hint("dp", graph))
    dims = batch_dims(graph, 16)
    params = graph.captured.params
    off_batch = [node.name for node, i in choice.items() if node.name not in params and graph.nodes[node].follows is None
                 for k, spec in enumerate(graph.nodes[node].strategies[i].outputs)
                 if spec is not None and any(getattr(p, "dim", None) is not None
                                             and p.dim not in (dims.get(node) or [frozenset()] * (k + 1))[k]
                                             for p in spec)]
    assert not off_batch, f"dp split these values off their batch dims: {off_batch[:8]}"
    assert any(n.name.startswith("linear") for n in choice)  # the check saw the layers' ops


def test_a_batch_as_large_as_the_heads_is_told_apart_from_them():
    """With as many sequences as attention heads (4 and 4) the heads dim is not the batch: a
    [batch, heads, seq, head_dim] value's batch is its dim 0 alone (the ops' own rules carry
    the batch, not sizes), so tp splits attention by heads as it does at a batch of 12."""
    from autopar.passes.planner.microbatch import batch_dims, batch_size
    from tests.models import llama

    model, _ = llama()
    heads = model.config.num_attention_heads
    for batch in (heads, 3 * heads):  # the sequence (8) another length: a mask made of shapes alone has no other clue
        tokens = torch.randint(0, model.config.vocab_size, (batch, 8))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = layouts.build("tp", model, (2,), (tokens,), hardware="h100")
            graph = build_strategy_graph(capture(model, (tokens,)), (2,))
        attention = [s for n, s in plan.strategies.items() if n.startswith("scaled_dot_product_attention")]
        assert attention and all(s.startswith("(S(1), S(1), S(1)") for s in attention), (batch, attention)
        dims = batch_dims(graph, batch_size(graph))
        sdpa = next(n for n in graph.nodes if n.name == "scaled_dot_product_attention")
        assert dims[sdpa][0] == frozenset({0}), (batch, dims[sdpa])

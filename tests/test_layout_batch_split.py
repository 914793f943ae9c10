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

"""A pipeline stage holds, per micro-batch in flight, the values it receives and sends
(``autopar.passes.planner.stage_io``): a Llama's attention mask and rotary tables reach every
stage and are kept there until each micro-batch's backward, as its hidden state going out is.
Checked against the full-scale dry run, which replays torch's schedule holding each
micro-batch's received inputs and outputs as torch's ``PipelineStage`` does."""

import warnings

import pytest
import torch

import autopar
from autopar import layouts
from autopar.costmodels import preset
from autopar.models import GPT, MODELS, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.costing import build_costs
from autopar.passes.planner.layer_numbers import layer_numbers, node_layers
from autopar.passes.planner.pipeline import pipeline_plan
from autopar.passes.planner.request import PlanRequest
from autopar.passes.strategy_graph import build_strategy_graph


def _llama(seq: int):
    # a narrow model over long sequences: the boolean mask (seq x seq per sequence) is 16 times
    # the hidden state, so what crosses the stages is a large part of each stage's memory
    with torch.device("meta"):
        model = MODELS["llama"].build(dict(hidden_size=128, intermediate_size=512, num_hidden_layers=8,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                           use_cache=False), seq)
    return model, (torch.zeros(16, seq, dtype=torch.long, device="meta"),)


def _plan(model, inputs, schedule: str):
    request = PlanRequest(mesh_shape=(4, 2), hardware="h100", memory_limit=80e9, layouts=("tp+sp",),
                          hint_fn=layouts.hints)
    plan, why = pipeline_plan(capture(model, inputs), 4, (2,), request, solver_time_s=2, schedules=(schedule,))
    assert plan is not None, why
    return plan


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_every_rank_is_charged_what_its_stages_receive_and_send(schedule):
    """Without the stages' received and sent values the prediction is 0.88-0.96 of the dry
    run on these ranks; with them 0.97-1.01."""
    model, inputs = _llama(2048)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = _plan(model, inputs, schedule)
        result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    assert len(result.ranks) == 4
    for rank in result.ranks:
        predicted = sum(plan.predicted.memory_by_rank[rank.coordinate[0]].values())
        assert predicted / rank.peak == pytest.approx(1.0, abs=0.05), (rank.where(), result.table())


def test_values_without_a_batch_dim_are_whole_in_every_micro_batch():
    """The rotary tables (1 x seq x head_dim: no batch dim) cross every boundary whole for each
    micro-batch, where the hidden state and the mask are a micro-batch's share of the batch."""
    model, inputs = _llama(256)
    graph = build_strategy_graph(capture(model, inputs), (2,))
    costs = build_costs(graph, preset("h100", (2,)))
    num = layer_numbers(costs, [0] * costs.problem.num_nodes, node_layers(costs))
    # cos and sin: 1 x 256 x 32 float32 each, whole (strategy 0 keeps every value whole)
    assert num.io.crossing_fixed[3] == 2 * 256 * 32 * 4
    # the hidden state (16 x 256 x 128) and the boolean mask (16 x 1 x 256 x 256), whole batch
    assert num.boundary[3] == 16 * 256 * 128 * 4 + 16 * 256 * 256
    # a stage of layers 2-4 holds per micro-batch the tables whole and, of the whole batch, the
    # mask it receives and the hidden state it sends; the hidden state it receives its first
    # norm saves as it lies (through a cast to the dtype it has: the same tensor), charged there
    assert num.io.held_fixed[2, 5] == 2 * 256 * 32 * 4
    assert num.io.held[2, 5] == 16 * 256 * 256 + 16 * 256 * 128 * 4


def test_a_received_value_its_first_norm_saves_is_not_held_twice():
    """A GPT stage receives the hidden state and its first LayerNorm saves it as it lies (with
    its mean and rstd: 1.004 bytes per byte): held once, by the norm; what the stage holds
    beyond its layers is the hidden state it sends."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=32, dim=64, n_heads=4, n_layers=4))
    graph = build_strategy_graph(capture(model, (torch.zeros(16, 32, dtype=torch.long, device="meta"),)), (2,))
    costs = build_costs(graph, preset("h100", (2,)))
    num = layer_numbers(costs, [0] * costs.problem.num_nodes, node_layers(costs))
    hidden = 16 * 32 * 64 * 4  # float32, whole (strategy 0 keeps every value whole)
    assert num.boundary[1] == hidden
    assert num.io.held[1, 3] == hidden

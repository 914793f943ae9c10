"""A pipeline plan's predicted memory per pipeline rank against the full-scale dry run's
(``autopar.dry_run``: torch's schedule order replayed, torch's MemTracker on fake tensors),
one plan per schedule: micro-batches in flight as torch's schedules keep them, gradients
where the schedule's peak holds them (not yet at GPipe's), one gradient being added to
the accumulated ones, and the default loss's temporaries on the last stage."""

import warnings

import pytest
import torch

import autopar
from autopar import layouts
from autopar.models import GPT, MODELS, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.planner.pipeline import pipeline_plan
from autopar.passes.planner.request import PlanRequest


@pytest.fixture(scope="module")
def model_and_inputs():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=4))  # 4 layers: 2 chunks on each of 2 ranks when interleaved
    return model, (torch.zeros(16, 64, dtype=torch.long, device="meta"),)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_every_pipeline_rank_is_predicted_within_ten_percent(model_and_inputs, schedule):
    model, inputs = model_and_inputs
    request = PlanRequest(mesh_shape=(2, 4), hardware="h100", memory_limit=80e9, layouts=layouts.LAYOUTS,
                          hint_fn=layouts.hints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, why = pipeline_plan(capture(model, inputs), 2, (4,), request, solver_time_s=2, schedules=(schedule,))
        assert plan is not None, why
        assert plan.pipeline.micro_batches > 1
        result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    by_rank = plan.predicted.memory_by_rank
    assert len(by_rank) == 2 and plan.predicted.memory in by_rank
    for rank in result.ranks:
        predicted = sum(by_rank[rank.coordinate[0]].values())
        assert predicted / rank.peak == pytest.approx(1.0, abs=0.10), (rank.where(), by_rank, result.table())


@pytest.mark.xfail(strict=True, reason=(
    "the last rank's peak falls inside a 1F1B backward since the dry run gives received values "
    "without a gradient (cos/sin) none, as torch's PipelineStage does: there the prediction holds "
    "the whole micro-batch (36.70 MiB activations) and 9.00 MiB of backward temporaries against "
    "32.46 + 17.00 MiB measured (total 0.98): a backward's temporaries and the activations it "
    "has freed are not modelled at that instant (#13's closing note, new issue)"))
def test_a_tensor_parallel_stage_is_charged_the_copies_its_matmuls_save():
    """A Llama stage split over a tensor-parallel axis (a wide model: the search splits its
    weights) keeps, per micro-batch in flight, what its matmuls save as they read it: a
    value gathered for a column-parallel matmul is saved gathered, attention keeps its
    boolean mask's converted copy and the grouped-query heads' repeated copies, and
    ``mul(x, cos)`` keeps ``cos`` only. Every pipeline rank's activations within 5%."""
    with torch.device("meta"):
        model = MODELS["llama"].build(dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                                           num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                                           use_cache=False), 256).to(torch.bfloat16)
    inputs = (torch.zeros(8, 256, dtype=torch.long, device="meta"),)
    request = PlanRequest(mesh_shape=(2, 4), hardware="h100", memory_limit=80e9, layouts=("tp+sp",),
                          hint_fn=layouts.hints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, why = pipeline_plan(capture(model, inputs), 2, (4,), request, solver_time_s=2, schedules=("1f1b",))
        assert plan is not None, why
        # a column-parallel matmul: its input whole, its weight split
        assert any(s.startswith("(R, S(") for s in plan.strategies.values()), plan.strategies
        result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    for rank in result.ranks:
        predicted = plan.predicted.memory_by_rank[rank.coordinate[0]]["activations"]
        assert predicted / rank.memory["activations"] == pytest.approx(1.0, abs=0.05), (rank.where(), result.table())

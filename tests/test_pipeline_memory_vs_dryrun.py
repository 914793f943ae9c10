"""A pipeline plan's predicted memory per pipeline rank against the full-scale dry run's
(``autopar.dry_run``: torch's schedule order replayed, torch's MemTracker on fake tensors),
one plan per schedule: micro-batches in flight as torch's schedules keep them, gradients
where the schedule's peak holds them (not yet at GPipe's), one gradient being added to
the accumulated ones, and the default loss's temporaries on the last stage."""

import warnings

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autopar
from autopar import layouts
from autopar.models import GPT, MODELS, GPTConfig, WideMLP
from autopar.passes.capture import capture
from autopar.passes.planner.pipeline import pipeline_plan
from autopar.passes.planner.request import PlanRequest


@pytest.fixture(scope="module")
def model_and_inputs():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=4))  # 4 layers: 2 chunks on each of 2 ranks when interleaved
    return model, (torch.zeros(16, 64, dtype=torch.long, device="meta"),)


def _planned_and_dry_run(model, inputs, mesh: tuple[int, ...], layout_names, schedule: str):
    """The planner's pipeline over ``mesh`` (its first axis the stages) and its dry run, which passed."""
    request = PlanRequest(mesh_shape=mesh, hardware="h100", memory_limit=80e9, layouts=layout_names,
                          hint_fn=layouts.hints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, why = pipeline_plan(capture(model, inputs), mesh[0], mesh[1:], request, solver_time_s=2,
                                  schedules=(schedule,))
        assert plan is not None, why
        result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    return plan, result


def _pinned_and_dry_run(model, inputs, mesh: tuple[int, ...], layout: str, pins, **options):
    """``layout`` planned on ``mesh`` under ``pins`` (``autopar.plan``), and its dry run, which passed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, mesh, inputs, hardware="h100", layout=layout, constraints=pins,
                            memory_limit=80e9, **options)
        result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    return plan, result


def _every_rank_within_ten_percent(plan, result) -> None:
    by_rank = plan.predicted.memory_by_rank
    for rank in result.ranks:
        predicted = sum(by_rank[rank.coordinate[0]].values())
        assert predicted / rank.peak == pytest.approx(1.0, abs=0.10), (rank.where(), by_rank, result.table())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_every_pipeline_rank_is_predicted_within_ten_percent(model_and_inputs, schedule):
    model, inputs = model_and_inputs
    plan, result = _planned_and_dry_run(model, inputs, (2, 4), layouts.LAYOUTS, schedule)
    assert plan.pipeline.micro_batches > 1
    by_rank = plan.predicted.memory_by_rank
    assert len(by_rank) == 2 and plan.predicted.memory in by_rank
    _every_rank_within_ten_percent(plan, result)


@pytest.mark.xfail(strict=True, reason=(
    "the last rank's peak falls inside a 1F1B backward since the dry run gives received values "
    "without a gradient (cos/sin) none, as torch's PipelineStage does: there the prediction holds "
    "the whole micro-batch (38.01 MiB activations, what the stage receives and sends included) and "
    "9.00 MiB of backward temporaries against 32.46 + 17.00 MiB measured (total 0.99): a backward's "
    "temporaries and the activations it "
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
    plan, result = _planned_and_dry_run(model, inputs, (2, 4), ("tp+sp",), "1f1b")
    # a column-parallel matmul: its input whole, its weight split
    assert any(s.startswith("(R, S(") for s in plan.strategies.values()), plan.strategies
    for rank in result.ranks:
        predicted = plan.predicted.memory_by_rank[rank.coordinate[0]]["activations"]
        assert predicted / rank.memory["activations"] == pytest.approx(1.0, abs=0.05), (rank.where(), result.table())


def test_a_pipeline_rank_is_charged_its_rows_of_the_batch_not_the_whole_batch():
    """A wide input split over 8 data-parallel ranks: the first stage holds its 1/8 of the
    inputs' rows, a middle stage none of the batch (the runtime moves each rank only what
    its stages read; the whole batch stays in host memory). Charged the whole input and
    target (32 MiB each), as the dry run did, the first two ranks' activations were 7.7 and
    4.6 times their prediction."""
    with torch.device("meta"):
        model = WideMLP(dim=512, hidden=64, n_layers=3)
    inputs = (torch.zeros(16384, 512, device="meta"),)
    plan, result = _planned_and_dry_run(model, inputs, (3, 8), ("dp",), "gpipe")
    assert plan.strategies["x"].endswith("S(0)"), plan.strategies["x"]  # each rank reads 1/8 of the rows
    by_rank = plan.predicted.memory_by_rank
    for rank in result.ranks[:-1]:
        predicted = by_rank[rank.coordinate[0]]["activations"]
        assert predicted / rank.memory["activations"] == pytest.approx(1.0, abs=0.10), (rank.where(), result.table())


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_under_a_policy_each_micro_batch_in_flight_keeps_its_own_working_copies(schedule):
    """Under a mixed-precision policy a stage casts its float32 weights once per call, and each
    micro-batch in flight keeps the bf16 copies its matmuls save, until its backward. Weights
    large against the activations, so the copies are most of a rank's activations: every
    pipeline rank within 10%. (A recomputed layer keeps none: it casts again when it reruns;
    here the optimizer step's temporaries would set such a plan's peak.)"""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=8, dim=512, n_heads=4, n_layers=4))
    inputs = (torch.zeros(16, 8, dtype=torch.long, device="meta"),)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    pins = autopar.Constraints(pp=2, micro_batches=8, schedule=schedule, recompute="none",
                               chunks=2 if schedule == "interleaved_1f1b" else None)
    plan, result = _pinned_and_dry_run(model, inputs, (2, 2), "pp+dp", pins, mp_policy=policy)
    copies = 2 * 12 * 512 * 512 * 2  # bf16 copies of one rank's two layers' linear weights: 12.6 MB
    # more than one set in flight (the activations themselves are about 1.3 MB a micro-batch)
    assert result.ranks[0].memory["activations"] > 2 * copies, result.table()
    _every_rank_within_ten_percent(plan, result)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v"])
def test_a_split_backward_keeps_its_zero3_weights_gathered_again_until_its_weight_gradients(schedule):
    """A ZeRO-3 stage gathers its weights again for a split backward's input-gradient part, and
    each micro-batch awaiting its weight-gradient part keeps that copy: a bucket's copy is freed
    by its gather's own backward, which runs with the weight gradients. Weights large against
    the activations, so the copies set each rank's peak: every pipeline rank within 10% (charged
    one stage's weights while gathering, whatever awaited, a rank was at 0.59-0.72)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=8, dim=512, n_heads=4, n_layers=8))
    inputs = (torch.zeros(64, 8, dtype=torch.long, device="meta"),)
    pins = autopar.Constraints(pp=2, micro_batches=8, schedule=schedule, chunks=2, recompute="none")
    plan, result = _pinned_and_dry_run(model, inputs, (2, 4), "pp+fsdp", pins)
    assert set(plan.zero.values()) == {3}, plan.zero
    stage_weights = 2 * 12 * 512 * 512 * 4  # one stage's two layers' linear weights, float32, whole: 25 MB
    assert max(rank.memory["temporary"] for rank in result.ranks) > 2 * stage_weights, result.table()
    _every_rank_within_ten_percent(plan, result)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pinned_recomputation_rebuilds_one_whole_layer_in_each_backward(schedule):
    """Recomputation pinned (``recompute="all"``) is in the costs already: each recomputed
    layer is charged its inputs, and 1/R of its activations so that the R of them hold one
    layer's (the one backward rebuilds). A pipeline stage rebuilds a layer in every backward, of
    one micro-batch: charged that share per micro-batch in flight instead, GPipe's ranks (8 in
    flight) were predicted at 1.31-1.35 of their dry run and 1F1B's last rank at 0.885. Every
    rank within 10%."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=1024, dim=256, n_heads=4, n_layers=8))
    inputs = (torch.zeros(16, 1024, dtype=torch.long, device="meta"),)
    pins = autopar.Constraints(pp=2, micro_batches=8, schedule=schedule, recompute="all")
    plan, result = _pinned_and_dry_run(model, inputs, (2, 2), "pp+dp", pins)
    assert len(plan.recompute) == 8, plan.recompute
    _every_rank_within_ten_percent(plan, result)

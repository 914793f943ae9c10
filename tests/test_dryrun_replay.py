"""The pipeline dry run replays the fewest micro-batches with the same peak
(``autopar.dryrun.pipeline.replayed_micro_batches``): every rank's peak and every kind at it
equal those of replaying all of the plan's micro-batches, while GPipe, which holds all M at
its peak, replays all M."""

import dataclasses
import warnings

import pytest
import torch

import autopar
from autopar import costmodels, layouts
from autopar.bench.report import _dry_run_line
from autopar.dryrun.pipeline import replayed_micro_batches
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.planner.pipeline import pipeline_plan
from autopar.passes.planner.request import PlanRequest

BATCH = 16  # sequences: 8 micro-batches of 2, each split over the 2 intra-op ranks


@pytest.mark.parametrize("schedule, stages, micro_batches, chunks, expected", [
    ("1f1b", 16, 64, 1, 17),  # tt-405b's 1F1B: P warm-up forwards, then one forward after a backward
    ("interleaved_1f1b", 16, 64, 2, 48),  # interleaved: a warm-up, a steady and a cool-down round of P
    ("interleaved_1f1b", 8, 16, 2, 16),  # two rounds: every round is needed
    ("gpipe", 4, 8, 1, 8),  # GPipe holds all M at its peak
])
def test_the_fewest_micro_batches_with_the_same_states(schedule, stages, micro_batches, chunks, expected):
    assert replayed_micro_batches(schedule, stages, micro_batches, chunks) == expected


@pytest.fixture(scope="module")
def gpt():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=4))
    return model, (torch.zeros(BATCH, 64, dtype=torch.long, device="meta"),)


def _pipelined(model, inputs, schedule):
    """The planner's 2-stage pipeline of ``model`` over (2, 2) under ``schedule``, re-timed to
    8 micro-batches (its micro-batch size is what the capture takes; the prediction is not compared)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        request = PlanRequest(mesh_shape=(2, 2), hardware="h100", memory_limit=80e9, layouts=layouts.LAYOUTS,
                              hint_fn=layouts.hints)
        plan, why = pipeline_plan(capture(model, inputs), 2, (2,), request, solver_time_s=2, schedules=(schedule,))
    assert plan is not None, why
    return dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, micro_batches=8))


@pytest.mark.parametrize("schedule, replayed", [
    (costmodels.Schedule.ONE_F_ONE_B, 3),
    (costmodels.Schedule.INTERLEAVED_1F1B, 6),
])
def test_replaying_fewer_micro_batches_gives_every_ranks_peak_and_kinds(gpt, schedule, replayed):
    model, inputs = gpt
    plan = _pipelined(model, inputs, schedule)
    fewest = autopar.dry_run(plan, model, inputs)
    every = autopar.dry_run(plan, model, inputs, micro_batches=8)
    assert fewest.ok and every.ok, fewest.table() + "\n" + every.table()
    assert fewest.micro_batches == (replayed, 8) and every.micro_batches == (8, 8)
    assert f"{replayed} of 8 micro-batches replayed" in fewest.table()
    assert [(r.rank, r.peak, r.memory) for r in fewest.ranks] == [(r.rank, r.peak, r.memory) for r in every.ranks]
    # each rank is still set beside its own pipeline rank's prediction
    assert [r.predicted for r in fewest.ranks] == plan.predicted.memory_by_rank
    # fewer micro-batches miss the state at the peak (1F1B: P in flight with gradients; interleaved:
    # the steady round): the comparison above can fail
    fewer = autopar.dry_run(plan, model, inputs, micro_batches=replayed - plan.pipeline.stages, ranks=[0])
    assert fewer.ranks[0].peak < every.ranks[0].peak, (fewer.table(), every.table())


def test_a_dry_run_of_some_ranks_compares_them_with_their_own_predictions(gpt):
    """A pipeline's ranks differ: the overall ratio of a dry run of the last pipeline rank alone
    is that rank's own, not the plan's largest prediction (rank 0's) over its peak."""
    model, inputs = gpt
    plan = _pipelined(model, inputs, costmodels.Schedule.ONE_F_ONE_B)
    by_rank = [sum(kinds.values()) for kinds in plan.predicted.memory_by_rank]
    assert by_rank[0] != by_rank[1]
    last = autopar.dry_run(plan, model, inputs, ranks=[3])
    assert last.ok, last.table()
    assert last.ranks[0].coordinate[0] == 1
    assert last.predicted_total == pytest.approx(by_rank[1])
    assert last.ratio == pytest.approx(last.ranks[0].ratio)


def test_a_replay_count_outside_the_plans_is_refused(gpt):
    model, inputs = gpt
    plan = _pipelined(model, inputs, costmodels.Schedule.ONE_F_ONE_B)
    with pytest.raises(ValueError, match=r"^autopar: dry_run\(micro_batches=...\) expected 1 to the plan's 8"):
        autopar.dry_run(plan, model, inputs, micro_batches=9)


def test_the_bench_table_says_how_many_micro_batches_were_replayed():
    dry = {"status": "ok", "peak": 2**30, "ratio": 1.0, "seconds": 12.0, "plan": "PP2", "micro_batches": [3, 8]}
    line = _dry_run_line({"mesh": "h100-8", "model": "gpt", "dry_run": dry})
    assert line[-1] == "12 (3 of 8 micro-batches)"
    assert _dry_run_line({"mesh": "h100-8", "model": "gpt", "dry_run": {**dry, "micro_batches": None}})[-1] == "12"

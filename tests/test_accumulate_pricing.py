"""A step that accumulates gradients over micro-batches, planned and priced as it runs
(``autopar.plan(..., accumulate=k)``, ``autopar.passes.costing``): each micro-batch runs its
program (compute, activation moves, ZeRO-3's gathers and reduce-scatters), the gradient sync
and the optimizer step run once; ``train_step`` runs the plan's accumulation; the dry run replays it."""

import copy
import dataclasses
import json
import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate

import autopar
from autopar import Constraints, costmodels
from autopar.costmodels.step import adamw_ops, ops_time
from autopar.models import GPT, GPTConfig
from autopar.costmodels.precision import plain_zero_bytes
from autopar.passes.edge_costs import UNPACKED
from autopar.passes.plan import Plan
from autopar.passes.state_costs import zero_costs
from autopar.passes.op_strategies import TensorMeta

MESH = (4,)


def _mlp() -> nn.Sequential:
    """Linear layers only: every collective of a data-parallel step is a parameter's (nothing
    batch-independent, such as a position embedding, sends an activation's gradient)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)]
    return nn.Sequential(*layers)


def _predicted(model, batch: int, layout: str, accumulate: int) -> autopar.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, MESH, (torch.zeros(batch, 512),), layout=layout, accumulate=accumulate, workers=1,
                            pipeline=False)


# layout -> (what a rank's optimizer steps, per parameter: its elements over; whether its
# collectives run once per step: the gradient all-reduce after the last backward, ZeRO-1's
# gather after the step; or in every micro-batch: ZeRO-3's gathers and reduce-scatters)
ONCE_PER_STEP = {"dp": (1, True), "zero1": (4, True), "fsdp": (4, False)}


@pytest.mark.parametrize("layout", list(ONCE_PER_STEP))
def test_an_accumulated_step_runs_every_micro_batch_and_its_gradient_sync_once(layout):
    model, k = _mlp(), 3
    one = _predicted(model, 64, layout, 1).predicted  # one micro-batch as a whole step
    step = _predicted(model, 64 * k, layout, k).predicted
    shards, once = ONCE_PER_STEP[layout]
    profile = costmodels.preset("h100", MESH)
    optimizer = ops_time(adamw_ops([math.ceil(p.numel() / shards) for p in model.parameters()]), profile)
    assert optimizer > 0
    # by hand: k forwards and backwards, one optimizer step
    assert step.compute == pytest.approx(k * one.compute - (k - 1) * optimizer, rel=1e-9)
    # the collectives: once, or k times; what hides behind compute alike (the gradient sync
    # behind the last micro-batch's backward alone)
    times = 1 if once else k
    # the gradient sync hides part of itself behind backward: the same part at k = 3
    assert one.communication > 0 and (one.hidden_communication > 0 or not once)
    assert step.communication == pytest.approx(times * one.communication, rel=1e-9)
    assert step.hidden_communication == pytest.approx(times * one.hidden_communication, rel=1e-9)
    assert step.step_time == pytest.approx(step.compute + step.communication, rel=1e-9)
    assert step.memory == pytest.approx(one.memory, rel=1e-9)  # activations of one micro-batch at a time


def test_zero2_gathers_and_reduce_scatters_in_every_micro_batch():
    """A ZeRO-2 parameter is gathered from storage by each micro-batch's program and its gradient
    reduce-scattered by that gather's backward: k gathers and k reduce-scatters a step, in place
    of the one all-reduce its reader's edge prices."""
    profile = costmodels.preset("h100", MESH)
    meta = TensorMeta.of(torch.empty(2048, 512))
    spec = (Replicate(),)
    size = plain_zero_bytes(2048 * 512, 4)
    ring = sum(costmodels.collective_time(c, size[c], 0, profile, UNPACKED.of(c)) for c in ("all_gather", "reduce_scatter"))
    once = zero_costs(meta, spec, 2, "fp32", profile, UNPACKED)
    thrice = zero_costs(meta, spec, 2, "fp32", profile, UNPACKED, runs=3)
    assert thrice[1] - once[1] == pytest.approx(2 * ring, rel=1e-9) and ring > 0
    assert (thrice[0], thrice[2]) == (once[0], once[2])  # one optimizer step, the same state
    level1 = [zero_costs(meta, spec, 1, "fp32", profile, UNPACKED, runs=r) for r in (1, 3)]
    assert level1[0] == level1[1]  # ZeRO-1: its gather after the step, once


def test_a_pipeline_accumulating_runs_its_schedule_once_per_micro_batch():
    """Each accumulated micro-batch runs the whole schedule, its bubble and sends included;
    the memory is one schedule run's, and the dry run (one schedule run of the step's) measures
    the same peaks."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, dim=64, n_heads=4, n_layers=4))
    pins = Constraints(pp=2, micro_batches=4, schedule="1f1b")
    plans, peaks = {}, {}
    for batch, k in ((8, 1), (16, 2)):
        inputs = (torch.zeros(batch, 64, dtype=torch.long, device="meta"),)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plans[k] = autopar.plan(model, (2, 2), inputs, layout="pp+dp", constraints=pins, accumulate=k, workers=1)
        result = autopar.dry_run(plans[k], model, inputs, workers=1)
        assert result.ok and all(r.ratio == pytest.approx(1.0, abs=0.10) for r in result.ranks), result.table()
        peaks[k] = [r.peak for r in result.ranks]
    assert peaks[2] == peaks[1]
    one, two = plans[1].predicted, plans[2].predicted
    assert one.bubble > 0 and two.bubble == pytest.approx(2 * one.bubble, rel=1e-9)
    for a, b in zip(one.memory_by_rank, two.memory_by_rank):
        assert a == pytest.approx(b, rel=1e-9)
    assert one.step_time < two.step_time < 2 * one.step_time  # the gradient sync and optimizer step once
    assert plans[2].pipeline.micro_batches == 4 and plans[2].accumulate == 2


def test_a_plan_records_its_accumulation_and_train_step_runs_it(one_rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    inputs, target = torch.randn(8, 16), torch.randn(8, 4)
    reference = copy.deepcopy(model)
    loss_fn = nn.functional.mse_loss
    plan = autopar.plan(model, (1,), (inputs,), layout="dp", accumulate=2, workers=1, pipeline=False)
    assert plan.accumulate == 2
    assert Plan.from_json(plan.to_json()).accumulate == 2
    assert json.loads(plan.to_json())["accumulate"] == 2
    assert "gradient accumulation: each step runs 2 micro-batches of 1/2 of the batch" in plan.explain()
    pm = autopar.compile(model, one_rank, (inputs,), loss_fn=loss_fn, plan=plan, hardware="h100",
                         optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    seen = []
    run = pm.forward_backward

    def recorded(*args, **kwargs):
        seen.append(args[3])
        return run(*args, **kwargs)

    pm.forward_backward = recorded
    loss = pm.train_step((inputs,), target)
    assert seen == [2]  # the plan's accumulation, unasked
    expected = loss_fn(reference(inputs), target)  # the mean of two equal halves' means
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    pm.train_step((inputs,), target, accumulate=1)
    assert seen == [2, 1]  # asked otherwise, as asked
    # planned by compile itself, on rank 0, for the same accumulation
    planned_here = autopar.compile(copy.deepcopy(reference), one_rank, (inputs,), loss_fn=loss_fn, hardware="h100",
                                   optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2), accumulate=2)
    assert planned_here.plan.accumulate == 2


def test_accumulation_errors_say_what_was_expected(one_rank):
    model = nn.Sequential(nn.Linear(16, 4))
    inputs = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"^autopar: expected accumulate to be a positive int"):
        autopar.plan(model, (1,), (inputs,), accumulate=0, workers=1)
    with pytest.raises(ValueError, match=r"^autopar: accumulate=3 cuts dim 0 .* found shapes \[\(8, 16\)\]"):
        autopar.plan(model, (1,), (inputs,), accumulate=3, workers=1)
    plan = autopar.plan(model, (1,), (inputs,), layout="dp", accumulate=2, workers=1, pipeline=False)
    with pytest.raises(ValueError, match=r"^autopar: compile\(plan=...\) runs the plan as it is, with its own "
                                         r"accumulate \(2\), and accumulate=4"):
        autopar.compile(model, one_rank, (inputs,), plan=plan, accumulate=4)
    with pytest.raises(ValueError, match=r"^autopar: plan\(inference=...\) takes no accumulate="):
        autopar.plan(model, (1,), inference=autopar.Inference(batch=1, prompt_len=4, max_len=8), accumulate=2)
    with pytest.raises(ValueError, match=r"^autopar: expected accumulate to be a positive int"):
        dataclasses.replace(plan, accumulate=True)


def test_an_accumulated_plan_dry_runs_its_micro_batches_within_its_predicted_memory():
    """The dry run steps as ``train_step`` does: the plan's micro-batches, one after another,
    on every distinct rank; the peak is one micro-batch's activations with the gradients kept."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, max_seq_len=256, dim=256, n_heads=4, n_layers=4))
    inputs = (torch.zeros(32, 256, dtype=torch.long, device="meta"),)
    plans = {}
    for k in (1, 4):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plans[k] = autopar.plan(model, (8,), inputs, layout="fsdp", accumulate=k, workers=1, pipeline=False)
    result = autopar.dry_run(plans[4], model, inputs, workers=1)
    assert result.ok, result.table()
    for rank in result.ranks:
        assert rank.ratio == pytest.approx(1.0, abs=0.10), (rank.where(), result.table())
    # a quarter of the batch at a time: less memory, measured and predicted (the whole batch's
    # step, dry-run alike, is checked in tests/test_zero3_memory.py)
    whole = sum(plans[1].predicted.memory.values())
    assert sum(plans[4].predicted.memory.values()) < 0.8 * whole
    assert max(r.peak for r in result.ranks) < 0.8 * whole


def test_a_plan_made_with_its_loss_dry_runs_its_accumulated_micro_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    inputs, target = torch.randn(16, 16), torch.randn(16, 4)
    loss_fn = nn.functional.mse_loss
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, MESH, (inputs,), loss_fn=loss_fn, target=target, layout="dp", accumulate=2,
                            workers=1)
    assert plan.includes_loss and plan.accumulate == 2
    result = autopar.dry_run(plan, model, (inputs,), loss_fn=loss_fn, target=target, workers=1)
    assert result.ok, result.table()

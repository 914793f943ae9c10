"""Zero-bubble pipelines (``Schedule.INTERLEAVED_ZERO_BUBBLE``, torch's
``ScheduleInterleavedZeroBubble``): its bubble and in-flight counts against torch's own action
lists, the planner choosing it, its dry run, and (``tests/distributed/zero_bubble_check.py``
under torchrun, gloo) training exactly like one process on 2, 4 and 8 ranks: one and two
chunks per rank, up to 8 stages, stages data or tensor parallel, at ZeRO-1, 2 and 3, with
accumulation and a hand-written loop with clipping (train_check's ``accum:`` and ``clip-loop:``
cases), and with every layer recomputed; likewise ZB-V and DualPipe-V (``zbv:``, ``dpv:``) on 2, 4
and 8 ranks, at ZeRO-2 and 3, tensor parallel, recomputed, and their forward in eval mode. Launches
take about 35, 95 and 105 s wall."""

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

import autopar
from autopar import layouts
from autopar.costmodels import Schedule
from autopar.costmodels.memory import awaiting_weights, in_flight_with_gradients, schedule_actions, schedule_order
from autopar.costmodels.schedule_replay import replayed_step_time
from autopar.dryrun.pipeline import replayed_micro_batches
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.planner.pipeline import _without_split_recompute, pipeline_plan
from autopar.passes.planner.request import PlanRequest
from autopar.passes.solve.pipeline_search import PipelineOption, PipelineSearchResult
from autopar.passes.solve.stages import InFlight, LayerCosts, describe_cut
from tests.test_pipeline_memory_vs_dryrun import _planned_and_dry_run
from tests.test_train_distributed import launch

ZB = Schedule.INTERLEAVED_ZERO_BUBBLE
SHAPES = [(p, v, m) for p in (2, 4, 8) for v in (1, 2, 3) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p, v, m", SHAPES)
def test_step_time_is_torchs_order_replayed(p, v, m):
    """Equal chunks, forward 1, input and weight gradients 1 each: torch's order replayed takes
    the printed formula's time, M (t_f + t_b) + (P - 1) t_f / v, for every schedule."""
    for schedule in Schedule:
        if schedule.chunks_problem(v) or schedule.micro_batch_problem(p, m):
            continue
        n = p * v
        replayed = replayed_step_time(schedule, m, [1 / v] * n, [1 / v] * n, [1 / v] * n, v)
        assert replayed == pytest.approx(schedule.pipeline_time(p, m, 1.0, 2.0, v), rel=1e-9), schedule
        assert replayed == pytest.approx(schedule.step_time([3 / v] * n, m, v), rel=1e-9), schedule


@pytest.mark.parametrize("p, v, m", SHAPES)
def test_in_flight_is_torchs_order(p, v, m):
    """Each rank holds a chunk micro-batch from its forward to its weight gradient: v P of
    them, P whole-stage micro-batches, on every rank (``formulas.IN_FLIGHT``)."""
    with_gradients = in_flight_with_gradients(ZB, p, m, v)
    for rank, actions in enumerate(schedule_actions(ZB, p, m, v)):
        held, most, after, weights = 0, 0, 0, False  # after: the most once the stage's gradients exist
        for kind, _ in actions:
            held += {"F": 1, "W": -1}.get(kind, 0)
            weights = weights or kind == "W"
            most, after = max(most, held), max(after, held) if weights else after
        assert most / v == ZB.in_flight(p, m, v, rank) == p
        assert with_gradients[rank] == after / v and (m == p or after == most), (rank, after, most)


def test_backward_runs_in_two_parts_weights_later():
    """Every stage's input-gradient part comes before its weight-gradient part, rank r running
    r backwards before its first weight gradient; the memory order counts a backward at its W."""
    p, m, v = 4, 8, 2
    for rank, actions in enumerate(schedule_actions(ZB, p, m, v)):
        kinds = [kind for kind, _ in actions]
        assert kinds.count("F") == kinds.count("I") == kinds.count("W") == m * v and "B" not in kinds
        assert kinds[:kinds.index("W")].count("I") == rank + 1
        order = schedule_order(ZB, p, m, v)[rank]
        assert [f for f, _ in order] == [kind == "F" for kind in kinds if kind != "I"]


def test_zero_bubble_has_the_smallest_bubble():
    """P - 1 forwards of a chunk against interleaved 1F1B's P - 1 chunks and 1F1B's P - 1 stages."""
    p, m = 4, 8
    assert ZB.bubble_fraction(p, m, 1) < Schedule.ONE_F_ONE_B.bubble_fraction(p, m)
    assert ZB.bubble_fraction(p, m, 2) < Schedule.INTERLEAVED_1F1B.bubble_fraction(p, m, 2)
    assert ZB.bubble_time([3.0] * 4, 1) == pytest.approx(3 * 1.0)  # (P - 1) forwards of 1 s
    # unequal stages: M slowest ranks plus P - 1 forwards of the slowest chunk
    assert ZB.step_time([1.5, 3.0, 1.5, 1.5], 4, 2) == pytest.approx(4 * 4.5 + 1 * 1.0)
    assert ZB.micro_batch_problem(4, 6) and not ZB.micro_batch_problem(4, 8)


def test_the_search_rejects_recomputation_under_a_split_backward():
    """A recomputed layer under zero bubble is rebuilt for each part of the backward, a cost
    the stage search does not price: such options lose to the next fastest."""
    layers = 4
    costs = LayerCosts(np.ones(layers), static_memory=np.ones(layers), activation_memory=np.full(layers, 0.5),
                       recompute_saving=np.full(layers, 0.4), recompute_time=np.full(layers, 0.3),
                       gradient_memory=np.full(layers, 0.1))
    in_flight = InFlight.of(ZB, 2, 4)
    recomputing, plain = describe_cut(costs, [0, 2], in_flight, recomputed=[1, 0]), describe_cut(costs, [0, 2], in_flight)
    options = [PipelineOption(2, 4, ZB, 1, 5.0, recomputing), PipelineOption(2, 4, Schedule.ONE_F_ONE_B, 1, 6.0, recomputing),
               PipelineOption(2, 4, ZB, 1, 7.0, plain)]
    found = _without_split_recompute(PipelineSearchResult(options[0], options))
    assert (found.best.schedule, found.best.step_time) == (Schedule.ONE_F_ONE_B, 6.0)
    assert [(o.step_time, o.rejected) for o in found.options][1:] == [(7.0, ""), (math.inf, "recomputation under a split backward")]


@pytest.fixture(scope="module")
def gpt():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=4))
    return model, (torch.zeros(16, 64, dtype=torch.long, device="meta"),)


def _planned(model, inputs, schedules, memory_limit=80e9):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        request = PlanRequest(mesh_shape=(2, 2), hardware="h100", memory_limit=memory_limit, layouts=layouts.LAYOUTS,
                              hint_fn=layouts.hints)
        plan, why = pipeline_plan(capture(model, inputs), 2, (2,), request, solver_time_s=2, schedules=schedules)
    assert plan is not None, why
    return plan


def test_the_search_chooses_zero_bubble_where_it_is_fastest(gpt):
    model, inputs = gpt
    plan = _planned(model, inputs, tuple(Schedule))
    assert plan.pipeline.schedule == ZB.display, plan.pipeline
    one_f_one_b = _planned(model, inputs, (Schedule.ONE_F_ONE_B,))
    assert plan.predicted.step_time < one_f_one_b.predicted.step_time


def test_the_dry_run_replays_the_split_backward(gpt):
    """The dry run replays torch's F, I and W actions: the fewest micro-batches with the same
    states give every rank's peak, and more in flight than 1F1B's last rank holds."""
    model, inputs = gpt
    plan = _planned(model, inputs, (ZB,))
    plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, micro_batches=8))
    v = plan.pipeline.chunks_per_rank
    replayed = replayed_micro_batches(ZB, 2, 8, v)
    assert replayed < 8
    fewest = autopar.dry_run(plan, model, inputs)
    every = autopar.dry_run(plan, model, inputs, micro_batches=8)
    assert fewest.ok and every.ok, fewest.table() + "\n" + every.table()
    assert fewest.micro_batches == (replayed, 8)
    assert [(r.rank, r.peak, r.memory) for r in fewest.ranks] == [(r.rank, r.peak, r.memory) for r in every.ranks]


class _Counted(torch.autograd.Function):
    """relu counting its backwards: which part of a split backward runs the activations' path."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.relu()

    @staticmethod
    def backward(ctx, grad):
        _Counted.calls += 1
        (x,) = ctx.saved_tensors
        return grad * (x > 0)


@pytest.mark.parametrize("tied", [False, True])
def test_weight_gradients_run_no_input_gradient_path_again(tied):
    """Each weight-gradient pass starts where its weights meet the activations: the
    activations' backward (the relus between the layers) ran in the input-gradient part and
    does not run again. ``tied``: two layers' weights made in one op (as a ZeRO-3 bucket's
    gather makes them), a third layer apart between them: the tied group's pass runs through
    the third layer's backward, which its own pass still finds (exact against one backward)."""
    from torch.distributed.pipelining._backward import stage_backward_input

    from autopar.runtime.stages import weight_gradients

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    x = torch.randn(4, 8, requires_grad=True)

    def forward():
        weights = [layer.weight for layer in layers]
        if tied:  # layers 0 and 2 read their weights through one op
            both = torch.stack([weights[0], weights[2]]) * 1.0
            weights[0], weights[2] = both[0], both[1]
        h = x
        for layer, w in zip(layers, weights):
            h = _Counted.apply(torch.nn.functional.linear(h, w, layer.bias))
        return h.sum()

    forward().backward()
    reference = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    _Counted.calls = 0
    _, groups = stage_backward_input([forward()], None, [x], layers.parameters())
    assert _Counted.calls == 3 and len(groups) == (2 if tied else 3)
    weight_gradients(layers.parameters(), groups)
    assert _Counted.calls == (3 + 2 if tied else 3)  # tied: the pass from layer 2 to layer 0 crosses two relus
    for p, want in zip(layers.parameters(), reference):
        torch.testing.assert_close(p.grad, want)


def test_the_dry_run_makes_weight_gradients_past_a_norm_kept_whole():
    """A layer's matmul weights gathered in one ZeRO-3 bucket, its norms kept whole (ZeRO 0,
    as an auto plan may keep them): torch's weight groups then share the norm's backward, and
    the bucket's pass freed it for the norm's (``autopar.runtime.stages.weight_gradients``)."""
    from tests.distributed.plans import pipeline_plan as plan_by_hand

    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, dim=32, n_heads=4, n_layers=4))
    tokens = torch.randint(0, 64, (16, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_by_hand(model, tokens, (2, 2), "ZBVZeroBubble", 4, 2, "fsdp")
        for name in plan.params:
            if ".ln" in name or name.startswith("ln"):
                plan.params[name], plan.zero[name] = "R", 0
        result = autopar.dry_run(autopar.Plan.from_json(plan.to_json()), model, (tokens,), workers=1)
    assert sorted(set(plan.zero.values())) == [0, 3]
    assert result.ok, result.table()


def test_every_rank_is_predicted_within_ten_percent_of_its_dry_run():
    """The planner's zero-bubble plan over (2, 4): each pipeline rank's predicted peak (P micro-
    batches held from forward to weight gradient on every rank) against the dry run's replay of
    torch's F, I and W actions."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=4))
    inputs = (torch.zeros(16, 64, dtype=torch.long, device="meta"),)
    plan, result = _planned_and_dry_run(model, inputs, (2, 4), layouts.LAYOUTS, ZB.value)
    assert plan.pipeline.schedule == ZB.display and plan.pipeline.micro_batches > 1
    by_rank = plan.predicted.memory_by_rank
    for rank in result.ranks:
        predicted = sum(by_rank[rank.coordinate[0]].values())
        assert predicted / rank.peak == pytest.approx(1.0, abs=0.10), (rank.where(), by_rank, result.table())


def test_awaiting_weights_counts_input_parts_run_ahead_of_their_weight_parts():
    """ZB-V on 2 ranks, 4 micro-batches: rank 0 runs each of stage 3's W right after its I
    (``schedule_actions``), rank 1 runs two of stage 1's I ahead; stage 0's I computes nothing
    (its W runs the whole backward); schedules without a split backward await none."""
    rank0 = schedule_actions(Schedule.ZBV_ZERO_BUBBLE, 2, 4, 2)[0]
    assert [k for k, s in rank0 if s == 3 and k != "F"] == ["I", "W"] * 4
    assert awaiting_weights(Schedule.ZBV_ZERO_BUBBLE, 2, 4, 2) == [0.0, 2.0, 1.0, 1.0]
    assert awaiting_weights(Schedule.ONE_F_ONE_B, 2, 4) == [0.0, 0.0]


def test_weight_gradients_start_where_a_weight_meets_the_activations():
    """The ops reading a weight beside an activation: every linear (the head too), every
    layer norm, and the two embeddings (their ids are inputs, not weights)."""
    from autopar.passes.costing import carrying_gradient
    from autopar.passes.saved import weight_gradient_starts

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=16, dim=32, n_heads=2, n_layers=2))
    captured = capture(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    placeholders = set(captured.nodes("placeholder"))
    trainable = carrying_gradient(captured) & placeholders
    state = [n for n in placeholders if n.name not in captured.user_inputs and n not in trainable]
    starts = weight_gradient_starts(captured.gm.graph.nodes, trainable, state)
    ops = sorted(str(n.target) for n in starts)
    assert ops.count("aten.linear.default") == 2 * 6 + 1
    assert ops.count("aten.layer_norm.default") == 2 * 2 + 1
    assert ops.count("aten.embedding.default") == 2 and len(ops) == 13 + 5 + 2


def test_zb_v_prices_the_gradients_kept_for_the_weight_gradients():
    """ZB-V runs many input-gradient parts ahead of their weight-gradient parts; each keeps the
    gradients at the outputs of the ops that read a weight until its W. With long sequences
    those are a large part of a rank's peak (without them: 0.87 of the dry run on rank 3)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=4096, max_seq_len=256, dim=256, n_heads=4, n_layers=4))
    inputs = (torch.zeros(16, 256, dtype=torch.long, device="meta"),)
    plan = _planned(model, inputs, (Schedule.ZBV_ZERO_BUBBLE,))
    assert plan.pipeline.schedule == Schedule.ZBV_ZERO_BUBBLE.display and plan.pipeline.micro_batches >= 4
    result = autopar.dry_run(plan, model, inputs)
    assert result.ok, result.table()
    by_rank = plan.predicted.memory_by_rank
    for rank in result.ranks:
        predicted = sum(by_rank[rank.coordinate[0]].values())
        assert predicted / rank.peak == pytest.approx(1.0, abs=0.10), (rank.where(), by_rank, result.table())


# zbv: and dpv: are torch's V-shaped ZB-V and DualPipe-V (``tests/test_v_schedules.py``); a few
# seconds a case
LAUNCHES = {
    2: ["zb:2:gpt:2:1", "zb:2:gpt:4:2", "zb:2:mlp:4:2", "zb:2:indices:4:2", "zbv:2:gpt:4:2", "dpv:2:mlp:4:2"],
    4: ["zb:2x2:gpt:2:1:fsdp", "zb:2x2:gpt:4:2:zero2", "zb:2x2:mlp:4:2:zero1", "zb:2x2:gpt:2:1:tp", "zb:4:gpt:8:2",
        "zb:2x2:gpt:2:1:tp:recompute", "zb:2x2:gpt:4:2:fsdp:recompute", "accum:2x2:gpt:pp:InterleavedZeroBubble:2:1:zero2",
        "clip-loop:pp:2x2:mlp:InterleavedZeroBubble:2:1", "zbv:4:gpt:8:2", "zbv:2x2:gpt:4:2:fsdp:recompute",
        "dpv:4:gpt:8:2", "dpv:2x2:gpt:4:2:zero2", "dpv:2x2:gpt:4:2:tp:recompute", "zbv:2x2:gpt:4:2:fsdp:norms-whole"],
    8: ["zb:8:gpt:8:1", "zb:2x4:gpt:2:1:fsdp", "zbv:4x2:gpt:8:2:tp", "dpv:2x4:gpt:4:2:tp"],
}
TORCH_CLASS = {"zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble", "dpv": "ScheduleDualPipeV"}


@pytest.mark.parametrize("nproc", sorted(LAUNCHES))
def test_zero_bubble_trains_like_one_process(nproc):
    results = launch(nproc, LAUNCHES[nproc], module="tests.distributed.zero_bubble_check")
    for case, r in results.items():
        assert "error" not in r, f"{case}: {r['error']}"
        if case.startswith("accum:"):  # train_step(accumulate=2) and DDP's no_sync() loop (train_check's)
            for way in ("accumulate", "manual"):
                assert r[way]["loss_err"] <= 1e-9 and r[way]["param_err"] <= 1e-9, f"{case} {way}: {r[way]}"
            assert r["mixed"].startswith("autopar:"), r["mixed"]
            continue
        if case.startswith("clip-loop:"):  # a hand-written loop: loss().backward(), clip_grad_norm_, step()
            assert r["norm_err"] <= 1e-9 and r["loss_err"] <= 1e-9 and r["param_err"] <= 1e-9, r
            continue
        prefix, mesh = case.split(":")[:2]
        assert r["schedule"] == TORCH_CLASS[prefix], r
        micro_batches, chunks = (int(x) for x in case.split(":")[3:5])
        stages = micro_batches * chunks
        assert r["forward_actions"] == stages == micro_batches * r["stages"], r
        if prefix == "dpv":  # DualPipe-V: backwards whole in its steady state, split at its ends
            assert r["input_actions"] == r["weight_actions"] and r["input_actions"] + r["whole_backward_actions"] == stages
            assert 0 < r["input_actions"] < stages, r
        else:  # every backward of this rank's chunks ran split: its input gradients, then its weights'
            assert r["input_actions"] == r["weight_actions"] == stages, r
        if prefix != "zb":  # rank 0 holds the V's first and last stage; its forward alone, in eval mode
            assert r["pp_rank"] == 0 and r["stage_indices"] == [0, 2 * int(mesh.split("x")[0]) - 1], r
            assert r["output_err"] <= 1e-9, r
            assert r["train_forward_err"] <= 1e-9, r  # a forward in train mode between steps, then training on
        if case.endswith(":recompute"):  # every layer rebuilt inside its stage, for each part of the backward
            assert r["recompute"] and r["recomputed_here"], r
            case = case.removesuffix(":recompute")
        if case.endswith(":norms-whole"):  # the norms kept whole beside the layout's ZeRO-3 buckets
            assert r["zero_levels"] == [0, 3], r
            case = case.removesuffix(":norms-whole")
        elif case.endswith(("fsdp", "zero1", "zero2")):
            assert r["zero_levels"] == [{"fsdp": 3, "zero1": 1, "zero2": 2}[case.split(":")[-1]]], r
        assert r["loss_err"] <= 1e-9 and r["param_err"] <= 1e-9, f"{case}: {r}"

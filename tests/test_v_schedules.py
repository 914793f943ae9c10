"""The V-shaped zero-bubble schedules (``Schedule.ZBV_ZERO_BUBBLE``, ``Schedule.DUALPIPE_V``:
torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, 2 chunks per rank, rank r holding
stages r and 2P - 1 - r): their bubble and in-flight counts against torch's own action lists
replayed, their placement, the planner pricing and choosing them, their dry run and export,
and what they refuse. Training against one process: ``tests/test_zero_bubble.py``'s launches
(``zbv:`` and ``dpv:`` cases). About 40 s."""

import dataclasses
import warnings

import pytest
import torch

import autopar
from autopar import layouts
from autopar.costmodels import Schedule
from autopar.costmodels.memory import in_flight_with_gradients, numbered, schedule_actions
from autopar.costmodels.schedule_replay import replayed_step_time
from autopar.dryrun.pipeline import replayed_micro_batches
from autopar.models import GPT, GPTConfig
from autopar.passes.plan import Pipeline
from autopar.passes.solve.pipeline_search import evaluate_pipeline
from autopar.passes.solve.stages import LayerCosts
from tests.test_zero_bubble import _planned

V_SCHEDULES = [Schedule.ZBV_ZERO_BUBBLE, Schedule.DUALPIPE_V]
FEWEST = {Schedule.ZBV_ZERO_BUBBLE: lambda p: 2 * p - 1, Schedule.DUALPIPE_V: lambda p: 2 * p}  # micro-batches
SHAPES = [(s, p, m) for s in V_SCHEDULES for p in (1, 2, 3, 4, 8)
          for m in sorted({FEWEST[s](p), FEWEST[s](p) + 1, 3 * p, 4 * p})]


@pytest.mark.parametrize("schedule, p, m", SHAPES)
def test_bubble_is_torchs_order_replayed(schedule, p, m):
    """Forward, input and weight gradients alike (1/2 s each per chunk): torch's order replayed
    takes M (t_f + t_b) + (P - 1) t_f / 2, the printed formula, at every count admitted."""
    n = 2 * p
    replayed = replayed_step_time(schedule, m, [0.5] * n, [0.5] * n, [0.5] * n, 2)
    assert replayed == pytest.approx(schedule.pipeline_time(p, m, 1.0, 2.0, 2), rel=1e-12)
    assert replayed == pytest.approx(schedule.step_time([1.5] * n, m, 2), rel=1e-12)
    assert 1 - 3 * m / replayed == pytest.approx(schedule.bubble_fraction(p, m, 2), abs=1e-12)


@pytest.mark.parametrize("schedule, p, m", SHAPES)
def test_in_flight_is_torchs_order(schedule, p, m):
    """A chunk micro-batch is held from its forward to its weight gradient (or its whole
    backward): ZB-V holds P whole-stage micro-batches on every rank, DualPipe-V P + 1/2."""
    with_gradients = in_flight_with_gradients(schedule, p, m, 2)
    for rank, actions in enumerate(schedule_actions(schedule, p, m, 2)):
        held, most, after, made = 0, 0, 0, set()  # after: the most once the stage's gradients exist
        for kind, stage in actions:
            held += {"F": 1, "W": -1, "B": -1}.get(kind, 0)
            made |= {stage} if kind in "WB" else set()
            most, after = max(most, held), max(after, held) if made else after
        assert most / 2 == schedule.in_flight(p, m, 2, rank), (rank, most)
        assert with_gradients[schedule.stages_of(rank, p, 2)[0]] == after / 2


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_each_rank_runs_its_two_stages_of_the_v(schedule):
    """torch's order for rank r acts on stages r and 2P - 1 - r only, each micro-batch once per
    kind; DualPipe-V's backwards are whole (B) or split (I, later W), numbered as torch does."""
    p, m = 4, 8
    for rank, actions in enumerate(schedule_actions(schedule, p, m, 2)):
        assert {s for _, s in actions} == {rank, 2 * p - 1 - rank} == set(schedule.stages_of(rank, p, 2))
        for stage in (rank, 2 * p - 1 - rank):
            runs = [(kind, mb) for kind, s, mb in numbered(actions) if s == stage]
            assert sorted(mb for kind, mb in runs if kind == "F") == list(range(m))
            assert sorted(mb for kind, mb in runs if kind in "IB") == list(range(m))
            assert [mb for kind, mb in runs if kind == "W"] == [mb for kind, mb in runs if kind == "I"]
    kinds = {kind for actions in schedule_actions(Schedule.DUALPIPE_V, p, m, 2) for kind, _ in actions}
    assert kinds == {"F", "B", "I", "W"}


def test_what_they_refuse():
    """2 chunks per rank only; DualPipe-V at least 2P micro-batches (torch's own check), ZB-V at
    least 2P - 1 (fewer cut its warm-up short, which the formula does not price)."""
    costs = LayerCosts([1.0] * 8)
    for schedule in V_SCHEDULES:
        option = evaluate_pipeline(costs, 2, 4, schedule, 3)
        assert option.step_time == float("inf") and "places exactly 2 chunks per rank" in option.rejected
        assert evaluate_pipeline(costs, 2, 4, schedule, 2).rejected == ""
    with pytest.raises(ValueError, match="autopar: DualPipe-V needs at least as many micro-batches as its 8 stages"):
        Pipeline(axis=0, stages=4, micro_batches=6, schedule="DualPipeV", stage_of={}, chunks_per_rank=2)
    with pytest.raises(ValueError, match="autopar: ZB-V needs at least 2P - 1 = 7 micro-batches on 4 ranks"):
        Pipeline(axis=0, stages=4, micro_batches=6, schedule="ZBVZeroBubble", stage_of={}, chunks_per_rank=2)


@pytest.fixture(scope="module")
def gpt():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=4))
    return model, (torch.zeros(16, 64, dtype=torch.long, device="meta"),)


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_planned_priced_and_explained(gpt, schedule):
    """The pipeline search prices a V schedule at its 2 chunks per rank, no slower than the
    interleaved zero bubble it ties with (the same bubble; ZB-V also at counts that are no
    multiple of P); explain() names it with its bubble."""
    model, inputs = gpt
    plan = _planned(model, inputs, (schedule,))
    assert plan.pipeline.schedule == schedule.display and plan.pipeline.chunks_per_rank == 2, plan.pipeline
    assert not schedule.micro_batch_problem(2, plan.pipeline.micro_batches)
    text = plan.explain()
    assert f"{schedule.display} (2 chunks per rank): bubble" in text, text
    every = _planned(model, inputs, tuple(Schedule))
    assert every.predicted.step_time <= plan.predicted.step_time * (1 + 1e-12)
    assert every.pipeline.schedule in {s.display for s in Schedule}


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_the_dry_run_replays_the_v(gpt, schedule):
    """The dry run replays torch's F, I, W (and DualPipe-V's whole B) actions of each rank's two
    stages of the V: the fewest micro-batches with the same states give every rank's peak
    (checked against all of them for DualPipe-V, whose order mixes whole and split backwards)."""
    model, inputs = gpt
    plan = _planned(model, inputs, (schedule,))
    plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, micro_batches=8))
    replayed = replayed_micro_batches(schedule, 2, 8, 2)
    assert replayed < 8
    fewest = autopar.dry_run(plan, model, inputs)
    assert fewest.ok and fewest.micro_batches == (replayed, 8), fewest.table()
    if schedule is Schedule.DUALPIPE_V:
        every = autopar.dry_run(plan, model, inputs, micro_batches=8)
        assert every.ok, every.table()
        assert [(r.rank, r.peak, r.memory) for r in fewest.ranks] == [(r.rank, r.peak, r.memory) for r in every.ranks]


def test_export_places_the_v(gpt, tmp_path):
    """The exported module builds rank r's stages where torch's V schedule expects them."""
    model, inputs = gpt
    plan = _planned(model, inputs, (Schedule.ZBV_ZERO_BUBBLE,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = plan.export(model, tmp_path / "zbv.py", example_inputs=inputs).source
    assert "STAGE_RANKS = (0, 1, 1, 0)" in source and "ScheduleZBVZeroBubble(stages," in source, source


def test_pins_and_loaded_plans_keep_v_schedules_to_two_chunks():
    """One chunk per rank pinned: no V schedule searched; several: the V ones only at 2; a
    plan written with a V schedule at another count is refused when loaded."""
    from autopar.passes.planner.constraints import pinned_schedules

    every = tuple(Schedule)
    one, _ = pinned_schedules(autopar.Constraints(chunks=1), every)
    assert not any(s.v_shaped for s in one) and Schedule.ONE_F_ONE_B in one
    two, depths = pinned_schedules(autopar.Constraints(chunks=2), every)
    assert {Schedule.ZBV_ZERO_BUBBLE, Schedule.DUALPIPE_V} <= set(two) and depths == (2,)
    three, _ = pinned_schedules(autopar.Constraints(chunks=3), every)
    assert not any(s.v_shaped for s in three) and Schedule.INTERLEAVED_1F1B in three
    with pytest.raises(ValueError, match="^autopar: zbv_zero_bubble places exactly 2 chunks per rank"):
        Pipeline(axis=0, stages=2, micro_batches=4, schedule="ZBVZeroBubble", chunks_per_rank=1)

"""The ``Schedule`` type: its two names, and its step, bubble and in-flight maths against
the formulas a plan's explanation prints."""

import json

import pytest

from autopar.costmodels import Schedule, formulas

EQUAL_STAGES = [(s, p, m, v) for s in Schedule for p in (1, 2, 4) for m in (1, 4, 8) for v in (1, 2, 3)
                if not s.chunks_problem(v)]


def test_two_names_one_schedule():
    for s in Schedule:
        assert Schedule.parse(s.value) is s and Schedule.parse(s.display) is s and Schedule.parse(s) is s
        assert s.torch_class.__name__ == "Schedule" + s.display  # a Plan names torch's class, the runtime runs it
        assert json.dumps(s) == f'"{s.value}"' and f"{s}" == s.value
    assert [s.display for s in Schedule] == ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
                                             "ZBVZeroBubble", "DualPipeV"]  # the Plan JSON's names
    with pytest.raises(ValueError, match="autopar: expected a schedule in .* found 'zigzag'"):
        Schedule.parse("zigzag")


def test_every_schedule_has_its_formulas():
    for table in (formulas.IN_FLIGHT, formulas.BUBBLE_FRACTION, formulas.PIPELINE_TIME):
        assert set(table) == {s.value for s in Schedule}


@pytest.mark.parametrize("schedule, p, m, v", EQUAL_STAGES)
def test_step_time_of_equal_stages_is_the_printed_formula(schedule, p, m, v):
    t_f, t_b = 1.0, 2.0
    chunk = (t_f + t_b) / v
    step = schedule.step_time([chunk] * (p * v), m, v)
    assert step == pytest.approx(schedule.pipeline_time(p, m, t_f, t_b, v), rel=1e-12)
    # the bubble is what the step leaves over the rank's own work, in the fraction printed
    assert schedule.bubble_time([chunk] * (p * v), v) == pytest.approx(step - m * (t_f + t_b), abs=1e-12)
    assert 1 - m * (t_f + t_b) / step == pytest.approx(schedule.bubble_fraction(p, m, v), abs=1e-12)


def test_unequal_stages_wait_for_the_slowest():
    assert Schedule.ONE_F_ONE_B.step_time([1.0, 2.0, 1.5], 8) == pytest.approx(10 * 2.0)
    # interleaved: M rounds of the slowest rank (its chunks together) plus P - 1 slowest chunks
    step = Schedule.INTERLEAVED_1F1B.step_time([1.0, 3.0, 2.0, 1.0], 4, 2)  # rank 0: 1 + 2, rank 1: 3 + 1
    assert step == pytest.approx(4 * 4.0 + 1 * 3.0)


def test_in_flight_per_stage_follows_the_rank():
    assert Schedule.ONE_F_ONE_B.in_flight_per_stage(4, 8) == [4, 3, 2, 1]
    per_stage = Schedule.INTERLEAVED_1F1B.in_flight_per_stage(4, 8, 2)
    assert per_stage[:4] == per_stage[4:] == [5.5, 4.5, 3.5, 2.5]  # P + (P - 1 - 2r) / v
    with pytest.raises(ValueError, match="autopar: only interleaved_1f1b, interleaved_zero_bubble, zbv_zero_bubble, "
                                         "dualpipe_v run several chunks"):
        Schedule.GPIPE.in_flight(4, 8, chunks=2)
    assert Schedule.INTERLEAVED_1F1B.micro_batch_problem(4, 6) and not Schedule.INTERLEAVED_1F1B.micro_batch_problem(4, 8)


def test_placement_is_the_schedules():
    """Looped schedules put virtual stage c on rank c mod P; the V-shaped ones go down the ranks
    and back up, as torch's ``generate_stage_to_rank_mapping`` does for each style."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for schedule in Schedule:
        for p in (1, 2, 4, 8):
            v = 2 if schedule.interleaved else 1
            style = "v" if schedule.v_shaped else "loop"
            assert [schedule.rank_of(s, p) for s in range(p * v)] == \
                [generate_stage_to_rank_mapping(p, p * v, style)[s] for s in range(p * v)], (schedule, p)
    assert Schedule.ZBV_ZERO_BUBBLE.stages_of(1, 4, 2) == [1, 6]
    assert Schedule.INTERLEAVED_1F1B.stages_of(1, 4, 2) == [1, 5]


@pytest.mark.parametrize("schedule", [Schedule.ZBV_ZERO_BUBBLE, Schedule.DUALPIPE_V])
def test_v_schedules_run_two_chunks_and_enough_micro_batches(schedule):
    for chunks in (1, 3):
        with pytest.raises(ValueError, match=f"autopar: {schedule.value} places exactly 2 chunks per rank.*pass chunks=2"):
            schedule.check(4, 8, chunks)
    schedule.check(4, 8, 2)
    fewest = {Schedule.ZBV_ZERO_BUBBLE: 7, Schedule.DUALPIPE_V: 8}[schedule]
    assert schedule.micro_batch_problem(4, fewest - 1) and not schedule.micro_batch_problem(4, fewest)
    assert not schedule.micro_batch_problem(4, fewest + 1)  # no rounds of P

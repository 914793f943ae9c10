"""The ``Schedule`` type: its two names, and its step, bubble and in-flight maths against
the formulas a plan's explanation prints."""

import json

import pytest

from autopar.costmodels import Schedule, formulas

EQUAL_STAGES = [(s, p, m, v) for s in Schedule for p in (1, 2, 4) for m in (1, 4, 8) for v in (1, 2, 3)
                if s.interleaved or v == 1]


def test_two_names_one_schedule():
    for s in Schedule:
        assert Schedule.parse(s.value) is s and Schedule.parse(s.display) is s and Schedule.parse(s) is s
        assert s.torch_class.__name__ == "Schedule" + s.display  # a Plan names torch's class, the runtime runs it
        assert json.dumps(s) == f'"{s.value}"' and f"{s}" == s.value
    assert [s.display for s in Schedule] == ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"]  # the Plan JSON's names
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
    with pytest.raises(ValueError, match="autopar: only interleaved_1f1b and interleaved_zero_bubble run several chunks"):
        Schedule.GPIPE.in_flight(4, 8, chunks=2)
    assert Schedule.INTERLEAVED_1F1B.micro_batch_problem(4, 6) and not Schedule.INTERLEAVED_1F1B.micro_batch_problem(4, 8)

"""Pipeline stage cuts against brute force over every cut, and the step-time formulas."""

import itertools
import math

import numpy as np
import pytest

from autopar import costmodels
from autopar.passes.solve.pipeline_search import evaluate_pipeline, search_pipeline
from autopar.passes.solve.stages import (InFlight, LayerCosts, StageSums, cut_stages, describe_cut, fastest_starts,
                                         pipeline_step_time, stage_peak)


def brute_force_cut(costs, in_flight, limit, num_stages):
    best = np.inf
    for cuts in itertools.combinations(range(1, costs.layers), num_stages - 1):
        cut = describe_cut(costs, [0, *cuts], in_flight)
        if limit is None or max(cut.stage_memory) <= limit:
            best = min(best, cut.slowest)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_stage_cut_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(1, 10))
    num_stages = int(rng.integers(1, num_layers + 1))
    time = rng.uniform(0.1, 1.0, num_layers)
    static = rng.uniform(0, 1, num_layers)
    activation = rng.uniform(0, 0.5, num_layers)
    send = rng.uniform(0, 0.2, num_layers - 1)
    in_flight = InFlight.of("1f1b" if seed % 2 else "gpipe", num_stages, int(rng.integers(1, 6)))
    total = static.sum() + max(in_flight.peak) * activation.sum()
    limit = None if seed % 3 == 0 else float(rng.uniform(0.2, 1.0) * total)
    costs = LayerCosts(time, static_memory=static, activation_memory=activation, boundary_time=send)
    expected = brute_force_cut(costs, in_flight, limit, num_stages)
    cut = cut_stages(costs, num_stages, in_flight, limit)
    if not np.isfinite(expected):
        assert cut is None
        return
    assert cut.slowest == pytest.approx(expected, rel=1e-12)
    assert cut.starts[0] == 0 and len(cut.starts) == num_stages
    assert all(a < b for a, b in zip(cut.starts, cut.starts[1:]))
    assert limit is None or max(cut.stage_memory) <= limit * (1 + 1e-12)


def test_even_layers_cut_evenly():
    cut = cut_stages(LayerCosts(time=[1.0] * 8), 4)
    assert cut.starts == [0, 2, 4, 6] and cut.stage_time == [2.0] * 4


def test_step_time_formulas():
    assert pipeline_step_time([1.0, 2.0, 1.5], 8, "1f1b") == pytest.approx((8 + 3 - 1) * 2.0)
    assert pipeline_step_time([1.0, 2.0, 1.5], 8, "gpipe") == pytest.approx(20.0)
    # Interleaved, equal chunks: (M + (P - 1) / v) * rank time, i.e. bubble (P - 1) / (v M).
    p, v, m, chunk = 4, 2, 8, 0.5
    step = pipeline_step_time([chunk] * (p * v), m, "interleaved_1f1b", v)
    assert step == pytest.approx(m * v * chunk * (1 + (p - 1) / (v * m)))
    assert step < pipeline_step_time([v * chunk] * p, m, "1f1b")


def test_in_flight_micro_batches_per_schedule():
    assert InFlight.of("gpipe", 4, 8).peak.tolist() == [8, 8, 8, 8]
    assert InFlight.of("1f1b", 4, 8).peak.tolist() == [4, 3, 2, 1]
    assert InFlight.of("1f1b", 4, 2).peak.tolist() == [2, 2, 2, 1]
    interleaved = InFlight.of("interleaved_1f1b", 4, 8, 2).peak.tolist()
    assert len(interleaved) == 8 and interleaved[:4] == interleaved[4:]
    assert interleaved[0] >= interleaved[3]


def test_in_flight_is_the_cost_models_formula_rank_by_rank():
    """Stage cuts use costmodels' in-flight counts (formulas.IN_FLIGHT); interleaved, each
    chunk holds its rank's count (Megatron's warm-up: 2 (P - r - 1) + (v - 1) P + 1 chunk
    forwards, spread over v chunks)."""
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)):
        for p, m in ((4, 8), (4, 2), (3, 9)):
            per_stage = InFlight.of(schedule, p, m, v).peak
            for r in range(p):
                want = costmodels.micro_batches_in_flight(schedule, p, m, v, rank=r)
                assert per_stage[r] == pytest.approx(want), (schedule, p, m, v, r)
    assert InFlight.of("interleaved_1f1b", 4, 8, 2).peak[:4].tolist() == [5.5, 4.5, 3.5, 2.5]
    assert costmodels.micro_batches_in_flight("1f1b", 4, 8, rank=3) == 1


def test_search_prefers_more_microbatches_and_respects_memory():
    num_layers, devices, batch = 16, 8, 64

    def layer_costs(p, m):  # intra-op over devices / p, micro-batch size batch / m
        intra = devices // p
        return LayerCosts(
            time=np.full(num_layers, 1.0 / intra / m + 1e-4),
            static_memory=np.full(num_layers, 10.0 / intra),
            activation_memory=np.full(num_layers, batch / m / intra),
            step_overhead=0.01 * intra,
        )

    result = search_pipeline(layer_costs, stage_counts=[1, 2, 4, 8], micro_batch_counts=[1, 4, 16],
                             schedules=("gpipe", "1f1b", "interleaved_1f1b"), chunks_per_rank=(2,),
                             memory_limit=60.0)
    best = result.best
    assert best is not None and np.isfinite(best.step_time)
    assert max(best.rank_memory) <= 60.0
    assert [o.step_time for o in result.options] == sorted(o.step_time for o in result.options)
    assert any(o.rejected for o in result.options)
    # Re-evaluating the winner by hand gives the same number.
    again = evaluate_pipeline(layer_costs(best.stages, best.micro_batches), best.stages,
                              best.micro_batches, best.schedule, best.chunks_per_rank, 60.0)
    assert again.step_time == pytest.approx(best.step_time)


def test_bad_stage_input_gets_an_autopar_error():
    with pytest.raises(ValueError, match="autopar: cut_stages expected 1 <= stages"):
        cut_stages(LayerCosts(time=[1.0, 2.0]), 3)
    with pytest.raises(ValueError, match="autopar: expected a schedule"):
        InFlight.of("zigzag", 2, 4)
    with pytest.raises(ValueError, match="autopar: LayerCosts expected static_memory with 2 entries"):
        LayerCosts(time=[1.0, 2.0], static_memory=[1.0])
    with pytest.raises(ValueError, match="autopar: LayerCosts expected boundary_time with 1 entries"):
        LayerCosts(time=[1.0, 2.0], boundary_time=[1.0, 1.0])
    with pytest.raises(ValueError, match="autopar: cut_stages expected in-flight counts for 2 stages"):
        cut_stages(LayerCosts(time=[1.0, 2.0]), 2, InFlight([1.0]))
    with pytest.raises(ValueError, match="autopar: InFlight expected with_gradients for as many stages"):
        InFlight([1.0, 2.0], [1.0])


def test_search_accepts_a_table_of_layer_costs():
    table = {
        (p, m): LayerCosts(time=[1.0 / m] * 6, static_memory=[1.0] * 6, activation_memory=[0.1] * 6)
        for p in (1, 2, 3) for m in (1, 2)
    }
    # GPipe: it runs any micro-batch count (torch's 1F1B refuses fewer micro-batches than stages)
    result = search_pipeline(table, stage_counts=[1, 2, 3], micro_batch_counts=[1, 2], schedules=("gpipe",))
    # (M + P - 1) * slowest: P=3, M=2 -> 4 * (2 layers * 0.5) = 4.0; P=1, M=2 -> 2 * 3 = 6.0.
    assert (result.best.stages, result.best.micro_batches) == (3, 2)
    assert result.best.step_time == pytest.approx(4.0)
    one_f_one_b = search_pipeline(table, stage_counts=[1, 2, 3], micro_batch_counts=[1, 2], schedules=("1f1b",))
    assert (one_f_one_b.best.stages, one_f_one_b.best.micro_batches) == (2, 2)  # (3, 2) is not offered


def test_interleaved_needs_whole_rounds_of_micro_batches():
    """torch interleaves in rounds of P micro-batches; other counts are not offered."""

    costs = LayerCosts(time=[1.0] * 8, static_memory=[1.0] * 8, activation_memory=[0.1] * 8)
    odd = evaluate_pipeline(costs, 4, 6, "interleaved_1f1b", 2)
    assert odd.step_time == math.inf and "multiples of 4" in odd.rejected
    assert math.isfinite(evaluate_pipeline(costs, 4, 8, "interleaved_1f1b", 2).step_time)
    assert math.isfinite(evaluate_pipeline(costs, 4, 6, "1f1b").step_time)


class _Stage:
    """What torch's schedules read of a stage to list its order (``pipeline_order``)."""

    def __init__(self, index: int, stages: int, rank: int, ranks: int):
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, stages, rank, ranks
        self.is_first, self.is_last = index == 0, index == stages - 1


def _torch_in_flight(schedule: str, p: int, m: int, v: int) -> list[tuple[float, float]]:
    """Per rank, from torch's own action order: the most chunk micro-batches in flight before
    its first backward and after it, in micro-batches of its whole stage (/ v)."""
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining.schedules import _ComputationType

    if schedule == "interleaved_1f1b":
        order = torch_schedules.ScheduleInterleaved1F1B([_Stage(c * p, p * v, 0, p) for c in range(v)], m)
    else:
        cls = torch_schedules.ScheduleGPipe if schedule == "gpipe" else torch_schedules.Schedule1F1B
        order = cls(_Stage(0, p, 0, p), m)
    out = []
    for rank in range(p):
        held, before, after, backward = 0, 0, 0, False
        for action in filter(None, order.pipeline_order[rank]):
            if action.computation_type == _ComputationType.FORWARD:
                held += 1
            elif action.computation_type == _ComputationType.FULL_BACKWARD:
                held, backward = held - 1, True
            before, after = (before, max(after, held)) if backward else (max(before, held), after)
        out.append((before / v, after / v))
    return out


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)])
def test_in_flight_counts_are_torchs_schedule_orders(schedule, v):
    """The micro-batches a stage holds at its peak, and once its gradients exist, as torch's
    schedules order them (interleaved: the count with gradients may be less than predicted
    when M = P, never more)."""
    for p, m in ((2, 4), (3, 6), (4, 8), (4, 12), (2, 2)):
        if schedule == "1f1b" and m <= p:
            continue  # torch 2.13's 1F1B order lists a forward past the last micro-batch there
        in_flight = InFlight.of(schedule, p, m, v)
        peak, with_gradients = in_flight.peak, in_flight.with_gradients
        for r, (before, after) in enumerate(_torch_in_flight(schedule, p, m, v)):
            assert max(before, after) == pytest.approx(peak[r]), (p, m, r)
            if schedule == "interleaved_1f1b":
                assert after <= with_gradients[r] + 1e-9 and (m == p or after == pytest.approx(with_gradients[r])), \
                    (p, m, r)
            else:
                assert after == pytest.approx(with_gradients[r]), (p, m, r)


def test_gpipe_stage_holds_gradients_only_past_one_micro_batch():
    """GPipe's peak is its first backward's start (M in flight, no gradient yet) unless the
    gradients outgrow one micro-batch's activations (then M - 1 in flight and the gradients)."""
    static, grads, act, m = 10.0, 4.0, 1.0, 8  # static: gradients included
    in_flight = InFlight.of("gpipe", 1, m).stage(0)
    assert (float(in_flight.peak), float(in_flight.with_gradients)) == (m, m - 1)
    _, memory, held = stage_peak(StageSums(static, grads, act, 0.0, 0.0, 1), in_flight, math.inf)
    assert (float(memory), float(held)) == (static + (m - 1) * act, grads)
    _, memory, held = stage_peak(StageSums(static, 0.5, act, 0.0, 0.0, 1), in_flight, math.inf)
    assert (float(memory), float(held)) == (static - 0.5 + m * act, 0.0)


@pytest.mark.parametrize("seed", range(20))
def test_stage_cut_with_gradients_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    layers = int(rng.integers(1, 8))
    stages = int(rng.integers(1, layers + 1))
    time, static, activation = rng.uniform(0.1, 1, layers), rng.uniform(0.5, 1, layers), rng.uniform(0, 0.5, layers)
    gradients, saving = static * rng.uniform(0, 0.5), activation * rng.uniform(0.3, 0.9)
    m = int(rng.integers(1, 6))
    in_flight = InFlight.of("gpipe", stages, m)
    limit = float(rng.uniform(0.3, 1.0) * (static.sum() + m * activation.sum()))
    costs = LayerCosts(time, static_memory=static, activation_memory=activation, recompute_saving=saving,
                       recompute_time=np.zeros(layers), gradient_memory=gradients)
    best = np.inf
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        cut = describe_cut(costs, [0, *cuts], in_flight, memory_limit=limit)
        if max(cut.stage_memory) <= limit * (1 + 1e-12):
            best = min(best, cut.slowest)
    cut = cut_stages(costs, stages, in_flight, limit)
    if not np.isfinite(best):
        assert cut is None
        return
    assert cut.slowest == pytest.approx(best, rel=1e-12)
    assert all(0 <= g <= gradients.sum() for g in cut.gradients)


def test_without_a_limit_no_span_recomputes_and_every_span_fits():
    """``cut_stages`` without a memory limit does not price spans with ``stage_peak``: it holds
    that stage_peak would recompute nothing and find every memory within an infinite limit,
    here on spans of zeros, negatives, infinities and NaNs."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        pick = lambda: rng.choice([0.0, 1.0, 1e9, np.inf, -np.inf, np.nan, -5.0], size=40) * rng.random(40)  # noqa: E731
        spans = StageSums(static=pick(), gradients=pick(), activation=pick(), saving=pick(), largest_saving=pick(),
                          layers=rng.integers(1, 10, size=40), adding=pick(), awaiting=pick())
        counts = InFlight(np.array(rng.choice([0.0, 1.0, 7.5])), np.array(rng.choice([0.0, 2.0])),
                          np.array(rng.choice([0.0, 1.0])))
        with np.errstate(all="ignore"):
            k, memory, _ = stage_peak(spans, counts, math.inf)
        assert (k == 0).all() and (memory <= math.inf).all()


def test_schedules_sharing_the_cuts_without_a_limit_get_what_each_gets_alone():
    """``search_pipeline`` keeps the cuts with no memory limit (``fastest_starts``) for every
    schedule of as many stages; each option is the one ``evaluate_pipeline`` finds on its own,
    here with layers of uneven time and memory whose limit makes ``rank_fit`` recompute."""
    rng = np.random.default_rng(1)
    layers = 24
    costs = LayerCosts(time=rng.uniform(0.5, 2.0, layers), static_memory=rng.uniform(1.0, 3.0, layers),
                       activation_memory=rng.uniform(1.0, 4.0, layers), recompute_saving=rng.uniform(0.5, 3.0, layers),
                       recompute_time=rng.uniform(0.1, 0.5, layers), gradient_memory=rng.uniform(0.1, 0.5, layers))
    schedules = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v")
    limit = 60.0
    result = search_pipeline({(4, 8): costs}, stage_counts=[4], micro_batch_counts=[8], schedules=schedules,
                             chunks_per_rank=(2, 3), memory_limit=limit)
    assert any(o.cut is not None and any(o.cut.recomputed) for o in result.options)
    for option in result.options:
        alone = evaluate_pipeline(costs, 4, 8, option.schedule, option.chunks_per_rank, limit)
        assert (alone.step_time, alone.rejected, alone.rank_memory) == (
            option.step_time, option.rejected, option.rank_memory)
        assert (alone.cut is None) == (option.cut is None)
        if alone.cut is not None:
            assert (alone.cut.starts, alone.cut.recomputed) == (option.cut.starts, option.cut.recomputed)
    for schedule, v in (("interleaved_1f1b", 2), ("zbv_zero_bubble", 2), ("interleaved_zero_bubble", 3)):
        # without a limit the DP reads no in-flight count
        assert cut_stages(costs, 4 * v, InFlight.of(schedule, 4, 8, v)).starts == fastest_starts(costs, 4 * v)

"""Interleaved pipelines' recomputation fitted to the ranks' replayed peaks (``solve.rank_fit``).

The stage DP holds each chunk to ``limit / v`` at an even spread of its rank's in-flight count;
torch's interleaved order keeps up to M micro-batches on a rank's first chunk and one on the
chunk holding the loss, so a large, unrecomputable loss chunk fails its share while its rank fits.
"""

import itertools
import math

import numpy as np
import pytest

from autopar.costmodels import Schedule
from autopar.passes.solve.pipeline_search import evaluate_pipeline
from autopar.passes.solve.rank_replay import rank_peaks
from autopar.passes.solve.stages import InFlight, LayerCosts, cut_stages, describe_cut

INTERLEAVED = Schedule.parse("interleaved_1f1b")
RANKS, MICRO_BATCHES, CHUNKS = 2, 4, 2


def counts(schedule=INTERLEAVED, ranks=RANKS, micro_batches=MICRO_BATCHES, chunks=CHUNKS) -> InFlight:
    """In flight per virtual stage, at the peak and with gradients: what the stage DP holds each chunk to."""
    return InFlight.of(schedule, ranks, micro_batches, chunks)


def describe(costs: LayerCosts, starts, recomputed):
    return describe_cut(costs, starts, counts(), recomputed=recomputed)


def worst_rank(cut) -> float:
    return max(p.total for p in rank_peaks(cut, INTERLEAVED, MICRO_BATCHES, CHUNKS))


def chunk_share_cut(costs: LayerCosts, limit: float):
    """What the search had before ``rank_fit``: the DP's cut, each chunk held to ``limit / v``."""
    return cut_stages(costs, RANKS * CHUNKS, counts(), memory_limit=limit / CHUNKS)


def test_a_loss_chunk_over_its_share_still_gets_the_cheapest_fitting_recomputation():
    # 4 layers, 4 chunks of one layer: the cut is forced, so brute force over each chunk's
    # recomputed count is brute force over every option. The last layer (the loss's logits)
    # keeps 5 bytes per micro-batch that recomputing cannot save.
    costs = LayerCosts(time=[1.0] * 4, static_memory=[1.0] * 4, activation_memory=[2.0, 2.0, 2.0, 5.0],
                       recompute_saving=[1.5, 1.5, 1.5, 0.0], recompute_time=[0.3] * 4)
    limit = 10.0
    assert chunk_share_cut(costs, limit) is None  # 1.5 "in flight" x 5 bytes > 10 / 2
    option = evaluate_pipeline(costs, RANKS, MICRO_BATCHES, INTERLEAVED, CHUNKS, limit)
    assert not option.rejected and worst_rank(option.cut) <= limit
    fitting = {}
    for ks in itertools.product(range(2), repeat=4):
        cut = describe(costs, [0, 1, 2, 3], list(ks))
        if worst_rank(cut) <= limit:
            fitting[ks] = INTERLEAVED.step_time(cut.stage_time, MICRO_BATCHES, CHUNKS)
    assert option.step_time == pytest.approx(min(fitting.values()), rel=1e-12)
    assert tuple(option.cut.recomputed) == min(fitting, key=fitting.get) == (1, 1, 0, 0)
    assert option.rank_memory == [p.total for p in rank_peaks(option.cut, INTERLEAVED, MICRO_BATCHES, CHUNKS)]


def test_no_recomputation_left_to_fit_keeps_the_rejection():
    costs = LayerCosts(time=[1.0] * 4, static_memory=[1.0] * 4, activation_memory=[2.0, 2.0, 2.0, 6.0],
                       recompute_saving=[1.5, 1.5, 1.5, 0.0], recompute_time=[0.3] * 4)
    option = evaluate_pipeline(costs, RANKS, MICRO_BATCHES, INTERLEAVED, CHUNKS, 8.0)
    assert option.rejected == "no cut fits in memory" and option.cut is None and math.isinf(option.step_time)


def random_costs(seed: int, layers: int = 8) -> tuple[LayerCosts, float]:
    rng = np.random.default_rng(seed)
    activation = rng.uniform(0.5, 2.0, layers)
    activation[-1] *= rng.uniform(1, 4)  # the loss's logits, larger and not recomputable
    saving = activation * rng.uniform(0.3, 0.9, layers)
    saving[-1] = 0.0
    static = rng.uniform(0.5, 1.5, layers)
    costs = LayerCosts(
        time=rng.uniform(0.5, 1.5, layers), static_memory=static, activation_memory=activation,
        boundary_time=rng.uniform(0, 0.1, layers - 1), recompute_saving=saving,
        recompute_time=rng.uniform(0.1, 0.5, layers), gradient_memory=static * 0.3,
        accumulating=static * 0.1, temporary_memory=static * 0.05,
        gather_memory=rng.uniform(0, 0.5, layers), scatter_memory=rng.uniform(0, 0.3, layers))
    # between the least a rank can hold (everything recomputed, spread evenly) and the most
    whole = static.sum() + 4 * activation.sum()
    return costs, float(rng.uniform(0.15, 0.4) * whole)


@pytest.mark.parametrize("seed", range(12))
def test_the_fitted_cut_fits_every_rank_has_no_spare_recomputation_and_never_loses_to_the_dp(seed):
    costs, limit = random_costs(seed)
    option = evaluate_pipeline(costs, RANKS, MICRO_BATCHES, INTERLEAVED, CHUNKS, limit)
    dp = chunk_share_cut(costs, limit)
    dp_step = math.inf
    if dp is not None and worst_rank(dp) <= limit * (1 + 1e-12):
        dp_step = INTERLEAVED.step_time(dp.stage_time, MICRO_BATCHES, CHUNKS) + costs.step_overhead
    assert option.step_time <= dp_step
    if option.rejected:
        assert math.isinf(dp_step)
        return
    cut = option.cut
    assert worst_rank(cut) <= limit * (1 + 1e-12)
    assert describe(costs, cut.starts, cut.recomputed) == cut  # nothing in the cut is stale
    for s, k in enumerate(cut.recomputed):
        if k:  # one recomputed layer fewer, and its rank no longer fits
            fewer = describe(costs, cut.starts, [k - (t == s) for t, k in enumerate(cut.recomputed)])
            assert rank_peaks(fewer, INTERLEAVED, MICRO_BATCHES, CHUNKS)[s % RANKS].total > limit


@pytest.mark.parametrize("seed", range(6))
def test_a_cut_described_at_its_own_recomputed_counts_is_the_same_cut(seed):
    costs, limit = random_costs(seed)
    cut = chunk_share_cut(costs, 2 * limit)
    assert cut is not None
    assert describe(costs, cut.starts, cut.recomputed) == cut


def test_a_forced_count_outside_a_stage_gets_an_autopar_error():
    costs = LayerCosts(time=[1.0] * 3, static_memory=[1.0] * 3, activation_memory=[1.0] * 3)
    with pytest.raises(ValueError, match=r"autopar: describe_cut expected per stage 0\.\.\(its layers\)"):
        describe_cut(costs, [0, 2], InFlight([1, 1]), recomputed=[3, 0])
    with pytest.raises(ValueError, match="autopar: describe_cut expected"):
        describe_cut(costs, [0, 2], InFlight([1, 1]), recomputed=[1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_without_chunks_keep_the_dp_cut(schedule):
    costs, limit = random_costs(3)
    option = evaluate_pipeline(costs, RANKS, MICRO_BATCHES, schedule, 1, limit)
    dp = cut_stages(costs, RANKS, counts(Schedule.parse(schedule), chunks=1), memory_limit=limit)
    assert option.cut == dp

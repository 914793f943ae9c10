"""The interleaved schedule's depth (chunks per rank) searched past 2 while deeper is faster
(``pipeline_search.deeper_while_faster``), against every depth evaluated."""

import numpy as np
import pytest

from autopar import costmodels
from autopar.passes.solve.pipeline_search import (LayerCosts, deeper_while_faster, evaluate_pipeline, search_pipeline,
                                                  useful_depths)

INTERLEAVED = costmodels.Schedule.INTERLEAVED_1F1B


def _costs(layers: int, send: float) -> LayerCosts:
    return LayerCosts(time=np.ones(layers), static_memory=np.zeros(layers), activation_memory=np.zeros(layers),
                      boundary_time=np.full(layers - 1, send))


@pytest.mark.parametrize("send", [0.0, 0.05, 0.3, 1.0])
def test_the_depth_found_is_the_fastest_of_every_depth(send):
    """A deeper pipeline shrinks the bubble and adds a send per chunk per micro-batch: with
    costly sends the best depth is in between, with free ones the deepest."""
    costs, p, m, deepest = _costs(24, send), 4, 8, 6
    every = {v: evaluate_pipeline(costs, p, m, INTERLEAVED, v).step_time for v in range(2, deepest + 1)}
    asked = []

    def at_depth(v):
        asked.append(v)
        return search_pipeline(lambda *_: costs, stage_counts=[p], micro_batch_counts=[m], schedules=(INTERLEAVED,),
                               chunks_per_rank=(v,))

    depths = useful_depths(24, p)
    assert depths == [2, 3, 6]  # 6 layers a rank: 3, 2 or 1 a chunk (4 and 5 chunks hold 2 at most, as 3 do)
    found = deeper_while_faster(at_depth(2), depths, at_depth)
    assert found.best.step_time == pytest.approx(min(every.values()))
    assert every[found.best.chunks_per_rank] == min(every.values())
    best = depths.index(found.best.chunks_per_rank)
    assert asked == depths[:best + 2]  # one depth past the best, and no further


def test_depth_2_stays_where_deeper_is_slower():
    costs = _costs(24, 2.0)
    at_depth = lambda v: search_pipeline(lambda *_: costs, stage_counts=[4], micro_batch_counts=[8],  # noqa: E731
                                         schedules=(INTERLEAVED, "1f1b"), chunks_per_rank=(v,))
    first = at_depth(2)
    found = deeper_while_faster(first, useful_depths(24, 4), at_depth)
    assert found.best.step_time == first.best.step_time
    assert {o.chunks_per_rank for o in found.options if o.schedule.interleaved} == {2, 3}


def test_the_deepest_depth_is_tried_where_memory_decides_the_recomputation():
    """30 layers on 4 ranks: 4 and 7 chunks per rank both hold 2 layers in their largest chunk
    (same bubble), but 7 keeps fewer layers' activations in flight, so under a tight limit it
    recomputes less and wins; the depths between (5, 6) are slower than 4."""
    layers, stages = 30, 4
    costs = LayerCosts(time=np.ones(layers), static_memory=np.zeros(layers), activation_memory=np.ones(layers),
                       boundary_time=np.full(layers - 1, 0.01), recompute_saving=np.full(layers, 0.9),
                       recompute_time=np.full(layers, 0.3))

    def at_depth(v):
        return search_pipeline(lambda *_: costs, stage_counts=[stages], micro_batch_counts=[8],
                               schedules=(INTERLEAVED,), chunks_per_rank=(v,), memory_limit=9.0)

    every = {v: at_depth(v).best.step_time for v in range(2, 8)}
    assert useful_depths(layers, stages) == [2, 3, 4, 7]
    assert every[7] < every[4] < min(every[5], every[6])
    found = deeper_while_faster(at_depth(2), useful_depths(layers, stages), at_depth)
    assert found.best.chunks_per_rank == 7 and found.best.step_time == pytest.approx(min(every.values()))

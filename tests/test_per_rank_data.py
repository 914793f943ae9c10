"""Per-rank data without processes: where a rank's rows of the batch lie (``DataParallel``)
and how the plan's shard of an input is cut from them (``Cut.within``)."""

import itertools

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.runtime.batch import Cut, DataParallel

MESH = (2, 2)


def test_data_ranks_follow_the_axes_that_split_every_input():
    tp_dp = [(Shard(0), Replicate()), (Shard(0), Shard(1))]  # batch on axis 0; one input also split on dim 1
    ranks = {c: DataParallel.of(tp_dp, MESH, c) for c in itertools.product(range(2), range(2))}
    assert {c: (d.num_replicas, d.rank, d.axes) for c, d in ranks.items()} == {
        (0, 0): (2, 0, (0,)), (0, 1): (2, 0, (0,)), (1, 0): (2, 1, (0,)), (1, 1): (2, 1, (0,))}
    both = DataParallel.of([(Shard(0), Shard(0))], MESH, (1, 0))
    assert (both.num_replicas, both.rank) == (4, 2)  # axis 0 outermost, as DTensor nests shards
    assert DataParallel.of([(Shard(0), Shard(0)), (Replicate(), Shard(0))], MESH, (1, 1)).axes == (1,)


def test_each_shard_is_cut_from_the_rows_as_from_the_whole():
    """For every layout of a (8, 6) input on a 2x2 mesh whose batch split the data axes
    allow, the shard cut from this rank's rows equals the shard cut from the whole."""
    whole = torch.arange(48.0).reshape(8, 6)
    layouts = [Replicate(), Shard(0), Shard(1)]
    checked = outside = 0
    for spec in itertools.product(layouts, repeat=2):
        dp = DataParallel.of([spec], MESH, (0, 0))
        for coord in itertools.product(range(2), range(2)):
            cut = Cut.of(whole.shape, spec, MESH, coord)
            rows = Cut.of(whole.shape, dp.spec(2), MESH, coord)
            inner = cut.within(rows)
            if inner is None:
                outside += 1
                continue
            assert torch.equal(inner.take(rows.take(whole)), cut.take(whole)), (spec, coord)
            checked += 1
    assert checked == 36 and outside == 0


def test_a_shard_outside_the_rows_is_refused():
    """One input splits its batch over both axes (axis 0 outermost), another over axis 1
    only: the data axis is axis 1, and the first input's shard at (1, 0) (rows 4-5) lies
    outside data rank 0's rows (0-3); the runtime then gathers the batch instead."""
    cut = Cut.of((8, 6), (Shard(0), Shard(0)), MESH, (1, 0))  # rows 4..5
    rows = Cut.of((8, 6), (Replicate(), Shard(0)), MESH, (1, 0))  # data rank 0: rows 0..3
    assert cut.within(rows) is None

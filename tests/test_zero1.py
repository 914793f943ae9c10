"""ZeRO-1's slices: which stored layouts are a view of the parameter as it is used."""

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.runtime.zero1 import slice_axes

R = Replicate()


def test_a_further_even_split_of_a_replicated_axis_is_a_slice():
    assert slice_axes((8, 6), (R,), (Shard(0),), (2,)) == (0,)
    assert slice_axes((8, 6), (R,), (Shard(1),), (2,)) == (0,)
    assert slice_axes((8, 6), (R, R), (Shard(0), Shard(0)), (2, 2)) == (0, 1)
    # tensor parallel on axis 1 (dim 1), the optimizer's slice split over axis 0 (dim 0)
    assert slice_axes((8, 3), (R, Shard(1)), (Shard(0), Shard(1)), (2, 2)) == (0,)


def test_layouts_that_are_not_a_view_are_refused():
    assert slice_axes((8, 6), (R,), (R,), (2,)) is None  # nothing split: not ZeRO-1
    assert slice_axes((7, 6), (R,), (Shard(0),), (2,)) is None  # uneven
    assert slice_axes((8, 6), (Shard(0),), (Shard(1),), (2,)) is None  # another split, not a further one
    assert slice_axes((8, 6), (Partial(),), (Shard(0),), (2,)) is None
    # axis 0 splits dim 0 outside axis 1's split of it: this rank's rows are not in its used piece
    assert slice_axes((4, 6), (R, Shard(0)), (Shard(0), Shard(0)), (2, 2)) is None

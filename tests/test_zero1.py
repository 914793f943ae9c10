"""ZeRO-1's slices: which stored layouts are a view of the parameter as it is used."""

import warnings

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.models import GPT, GPTConfig
from autopar.passes.capture import capture
from autopar.passes.placements import local_shape, parse_spec
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


def test_the_planner_stores_zero_slices_that_the_runtime_can_slice():
    """Megatron's distributed optimizer (``tp+zero1``): weights split on dim 0 by the inner
    tensor-parallel axis are stored split over the outer data-parallel axis on another dim, so
    that each rank's optimizer slice is a view of its shard (on dim 0 too, the runtime keeps
    the state whole: ``slice_axes`` refuses it, and memory is above the prediction)."""
    with torch.device("meta"):
        model = GPT(GPTConfig())
    inputs = (torch.zeros(8, 64, dtype=torch.long, device="meta"),)
    mesh = (2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, mesh, inputs, hardware="h100", layout="tp+zero1", pipeline=False)
        captured = capture(model, inputs)
    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}
    sliced = 0
    for ph, fqn in captured.params.items():
        if plan.zero[fqn] not in (1, 2):
            continue
        used = parse_spec(plan.strategies[ph].split("->")[-1].strip())
        stored = parse_spec(plan.params[fqn])
        if stored == used:  # nowhere to split it further (a bias split by tensor parallelism)
            continue
        assert slice_axes(local_shape(shapes[fqn], used, mesh), used, stored, mesh) is not None, (fqn, used, stored)
        sliced += any(isinstance(p, Shard) for p in used)  # a tensor-parallel weight, sliced further
    assert sliced > 0

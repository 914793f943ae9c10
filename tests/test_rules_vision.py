"""What the vision rules refuse to offer, and why: each refused split is shown wrong by
the SPMD simulator, each offered one right (the random calls in test_rules_property
cover the rest)."""

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes import rules
from autopar.passes.simulate import SimulationMismatch, check_strategy
from autopar.passes.op_strategies import OpInfo, ShardingStrategy

R = Replicate()


def _call(op, *args):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return OpInfo.from_call(op, args, {}), tensors


def _offered(info, mesh):
    return {str(s) for s in rules.strategies_for(info, mesh)}


def _all_correct(info, tensors, mesh):
    rng = random.Random(0)
    for s in rules.strategies_for(info, mesh):
        check_strategy(info, s, tensors, mesh, rng)


def _grouped_conv(groups, c_in, c_out):
    torch.manual_seed(0)
    x, w = torch.randn(2, c_in, 5, 5), torch.randn(c_out, c_in // groups, 3, 3)
    return _call(aten.conv2d.default, x, w, None, [1, 1], [1, 1], [1, 1], groups)


def test_depthwise_conv_splits_its_channels():
    info, tensors = _grouped_conv(groups=8, c_in=8, c_out=16)
    assert "(S(1), S(0)) -> S(1)" in _offered(info, (4,))
    _all_correct(info, tensors, (4,))


def test_grouped_conv_never_cuts_a_group():
    """2 groups of 2 channels on 4 devices: shards divide evenly but hold half a group."""
    info, tensors = _grouped_conv(groups=2, c_in=4, c_out=4)
    assert "(S(1), S(0)) -> S(1)" not in _offered(info, (4,))
    cut = ShardingStrategy(((Shard(1),), (Shard(0),)), ((Shard(1),),))
    with pytest.raises(SimulationMismatch):
        check_strategy(info, cut, tensors, (4,), random.Random(0))
    _all_correct(info, tensors, (4,))


def test_conv_input_channels_give_a_pending_sum_with_the_bias_added_once():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 4, 5), torch.randn(6, 4, 3), torch.randn(6)
    info, tensors = _call(aten.conv1d.default, x, w, b, [1], [0], [1], 1)
    assert "(S(1), S(1), P) -> P" in _offered(info, (2,))
    _all_correct(info, tensors, (2,))


def _batch_norm(training):
    torch.manual_seed(0)
    x, w, b = torch.randn(4, 6, 2, 2), torch.randn(6), torch.randn(6)
    mean, var = torch.randn(6), torch.rand(6) + 0.5
    return _call(aten.batch_norm.default, x, w, b, mean, var, training, 0.1, 1e-5, False)


def test_training_batch_norm_splits_channels_not_the_batch():
    """Batch statistics span the batch: per-shard statistics would not be synchronised."""
    info, tensors = _batch_norm(training=True)
    offered = _offered(info, (2,))
    assert offered == {"(R, R, R, R, R) -> R", "(S(1), S(0), S(0), S(0), S(0)) -> S(1)"}
    batch = ShardingStrategy(((Shard(0),),) + ((R,),) * 4, ((Shard(0),),))
    with pytest.raises(SimulationMismatch):
        check_strategy(info, batch, tensors, (2,), random.Random(0))
    _all_correct(info, tensors, (2,))


def test_eval_batch_norm_splits_any_dim():
    info, tensors = _batch_norm(training=False)
    assert "(S(0), R, R, R, R) -> S(0)" in _offered(info, (2,))
    assert "(S(2), R, R, R, R) -> S(2)" in _offered(info, (2,))
    _all_correct(info, tensors, (2,))


@pytest.mark.parametrize("groups, splits_channels", [(4, True), (2, False)])
def test_group_norm_splits_channels_only_one_per_group(groups, splits_channels):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 4, 3), torch.randn(4), torch.randn(4)
    info, tensors = _call(aten.group_norm.default, x, groups, w, b, 1e-5, False)
    assert ("(S(1), S(0), S(0)) -> S(1)" in _offered(info, (2,))) == splits_channels
    _all_correct(info, tensors, (2,))


def test_pad_keeps_padded_dims_whole_and_a_nonzero_fill_not_pending():
    """GPT-2 / Mixtral labels: ``pad(labels, [0, 1], value=-100)``."""
    labels = torch.randint(0, 9, (4, 8))
    info, tensors = _call(aten.pad.default, labels, [0, 1], "constant", -100.0)
    assert _offered(info, (2,)) == {"(R) -> R", "(S(0)) -> S(0)"}
    pending = ShardingStrategy(((Partial(),),), ((Partial(),),))
    with pytest.raises(SimulationMismatch):
        check_strategy(info, pending, tensors, (2,), random.Random(0))

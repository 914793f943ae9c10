"""The simulator must be able to fail: wrong strategies, written by hand, are caught."""

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten

from autopar.passes.simulate import SimulationMismatch, check_strategy
from autopar.passes.op_strategies import OpInfo, ShardingStrategy

R, P = Replicate(), Partial()


def S(d):
    return Shard(d)


def g(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


WRONG = {
    "softmax along its split dim": (aten.softmax.int, (g(4, 8), -1), [(S(1),)], [(S(1),)], None),
    "contraction split but output called replicated": (
        aten.mm.default, (g(4, 8), g(8, 4, seed=1)), [(S(1),), (S(0),)], [(R,)], None),
    "pending sum plus a constant": (aten.add.Tensor, (g(4, 4), 1.0), [(P,)], [(P,)], None),
    "reshape of a non-leading dim": (aten.view.default, (g(4, 6), [24]), [(S(1),)], [(S(0),)], None),
    "vocab-split embedding without masking": (
        aten.embedding.default, (g(8, 4), torch.tensor([[0, 7, 3, 5]])), [(S(0),), (R,)], [(P,)], None),
    "mean of a split dim without rescaling": (aten.mean.dim, (g(4, 8), [1]), [(S(1),)], [(P,)], None),
    "replicated output that differs per device": (aten.neg.default, (g(4, 4),), [(S(0),)], [(R,)], None),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_wrong_strategy_is_caught(case):
    op, args, ins, outs, kernel = WRONG[case]
    info = OpInfo.from_call(op, args)
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    strategy = ShardingStrategy(tuple(ins), tuple(outs), kernel)
    with pytest.raises(SimulationMismatch):
        check_strategy(info, strategy, inputs, (2,), random.Random(0))

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.placements import fits, local_shape, parse_spec, shard_offset, spec_str
from autopar.passes.op_strategies import ShardingStrategy


def test_short_form_round_trips():
    spec = (Shard(0), Replicate(), Partial(), Partial("max"))
    assert spec_str(spec) == "S(0)RPP(max)"
    assert parse_spec("S(0)RPP(max)") == spec


def test_bad_spec_text_is_a_clear_error():
    with pytest.raises(ValueError, match="autopar: cannot parse placement spec 'S0R'"):
        parse_spec("S0R")


def test_strategy_prints_in_short_form():
    s = ShardingStrategy(((Shard(0), Replicate()), (Replicate(), Shard(1))), ((Shard(0), Shard(1)),))
    assert str(s) == "(S(0)R, RS(1)) -> S(0)S(1)"
    multi = ShardingStrategy(((Shard(0),),), ((Shard(0),), (Shard(0),)))
    assert str(multi) == "(S(0)) -> (S(0), S(0))"


def test_fits_and_local_shape_nest_axis_zero_outermost():
    spec = (Shard(0), Shard(0))
    assert fits((8, 3), spec, (2, 2))
    assert not fits((6, 3), spec, (2, 2))  # 6 does not divide by 4
    assert not fits((8, 3), (Shard(2),), (2,))  # no such dim
    assert local_shape((8, 6), (Shard(0), Shard(1)), (2, 3)) == (4, 2)
    # axis 0 takes halves, axis 1 quarters inside each half
    assert shard_offset((8,), spec, (2, 2), (1, 0), 0) == (4, 6)
    assert shard_offset((8,), spec, (2, 2), (0, 1), 0) == (2, 4)

"""Resharding plans: which collective, on which axis, on how many bytes."""

import pytest
from torch.distributed.tensor import Partial as P
from torch.distributed.tensor import Replicate as R
from torch.distributed.tensor import Shard as S

from autopar.costmodels import backward_reshard_plan, h100, reshard_plan, reshard_time
from autopar.costmodels.comm import LOCAL_MOVES, Step, axis_move, grad_target, short
from autopar.passes.lowering.codegen import collectives

SHAPE, ITEM = (1024, 512), 4
FULL = 1024 * 512 * 4


def plan(src, dst, mesh=(4,), shape=SHAPE):
    return list(reshard_plan(shape, ITEM, tuple(src), tuple(dst), mesh))


def test_one_axis_transitions():
    assert plan([S(0)], [R()]) == [Step("all_gather", 0, FULL)]
    assert plan([P()], [R()]) == [Step("all_reduce", 0, FULL)]
    assert plan([P()], [S(1)]) == [Step("reduce_scatter", 0, FULL)]
    assert plan([S(0)], [S(1)]) == [Step("all_to_all", 0, FULL // 4)]
    assert plan([R()], [S(0)]) == []  # local slice
    assert plan([R()], [P()]) == []  # keep one copy
    assert plan([S(1)], [S(1)]) == []


def test_negative_dims_are_the_same_dims():
    assert plan([S(-1)], [S(1)]) == []


def test_two_axis_gathers_inner_first_like_dtensor():
    # (S(0), S(0)) -> (R, S(0)): DTensor replicates the nested inner shard, then the
    # outer one, then slices again (free)
    assert plan([S(0), S(0)], [R(), S(0)], mesh=(2, 4)) == [
        Step("all_gather", 1, FULL // 2),
        Step("all_gather", 0, FULL),
    ]


def test_two_axis_partial_to_replicate_reduces_on_both_axes():
    # nothing sharded: DTensor walks the axes outermost first
    assert plan([P(), P()], [R(), R()], mesh=(2, 4)) == [
        Step("all_reduce", 0, FULL),
        Step("all_reduce", 1, FULL),
    ]


def test_two_axis_partial_to_shard_reduce_scatters_then_shrinks():
    steps = plan([P(), P()], [S(0), S(1)], mesh=(2, 4))
    assert steps == [Step("reduce_scatter", 0, FULL), Step("reduce_scatter", 1, FULL // 2)]


def test_mixed_placements_cover_each_axis():
    steps = plan([S(0), P()], [R(), S(1)], mesh=(2, 4))
    assert steps == [Step("reduce_scatter", 1, FULL // 2), Step("all_gather", 0, FULL // 4)]


def test_uneven_shards_round_up_like_dtensor_padding():
    steps = plan([S(0)], [R()], mesh=(3,), shape=(10, 1))
    assert steps == [Step("all_gather", 0, 12 * ITEM)]


def test_bad_specs_are_clear_errors():
    with pytest.raises(ValueError, match="autopar: source placement .* 1 entries but the mesh"):
        plan([S(0)], [R(), R()], mesh=(2, 2))
    with pytest.raises(ValueError, match="autopar: target placement S\\(2\\) shards dim 2"):
        plan([R()], [S(2)])
    with pytest.raises(TypeError, match="autopar: expected a placement"):
        plan(["S0"], [R()])


def test_backward_reshards_the_gradient():
    bw = lambda src, dst, grad=None: list(backward_reshard_plan(SHAPE, ITEM, (src,), (dst,), (4,), grad))  # noqa: E731
    # a parameter all-gathered for data-parallel compute: its gradient arrives Partial
    assert bw(S(0), R(), (P(),)) == [Step("reduce_scatter", 0, FULL)]
    # the same all-gather under redundant compute: the gradient is sliced, free
    assert bw(S(0), R()) == []
    # Megatron's g (forward all-reduce P -> R): free in backward
    assert bw(P(), R()) == []
    # Megatron's f (identity on R into a column-parallel matmul): the gradient arrives
    # Partial and is all-reduced
    assert bw(R(), R(), (P(),)) == [Step("all_reduce", 0, FULL)]
    # a free slice R -> S: the gradient is all-gathered back
    assert bw(R(), S(0)) == [Step("all_gather", 0, FULL)]
    assert [short(p) for p in grad_target((P(), P(), S(1)), (R(), P(), S(1)))] == ["R", "P", "S(1)"]


def test_orderings_on_h100():
    prof = h100((8, 8))  # axis 0 crosses nodes, axis 1 is NVLink
    t = lambda src, dst: reshard_time(SHAPE, 2, src, dst, prof)  # noqa: E731
    assert t((R(), R()), (R(), S(0))) == 0.0
    assert t((R(), S(0)), (R(), R())) > 0.0
    # reduce-scatter moves half an all-reduce's bytes
    assert t((R(), P()), (R(), S(0))) < t((R(), P()), (R(), R()))
    # the same all-gather is dearer across nodes than inside one
    assert t((S(0), R()), (R(), R())) > t((R(), S(0)), (R(), R()))


def test_plans_are_cached_and_take_lists_too():
    a = reshard_plan(SHAPE, ITEM, (S(0),), (R(),), (4,))
    assert reshard_plan(SHAPE, ITEM, (S(0),), (R(),), (4,)) is a
    assert reshard_plan(list(SHAPE), ITEM, [S(0)], [R()], [4]) is a


def test_one_table_names_what_codegen_runs_and_what_the_cost_model_prices():
    # codegen names each Reshard by the cost model's moves, axis by axis
    assert collectives((S(0), P()), (R(), S(1))) == ["all_gather0", "reduce_scatter1"]
    assert collectives((R(), S(0)), (S(1), S(0))) == ["slice0"]
    # a local move sends nothing: named, never priced
    for src, dst in [(R(), S(0)), (R(), P()), (S(0), P())]:
        assert axis_move(src, dst) in LOCAL_MOVES and plan([src], [dst]) == []
    for src, dst in [(S(0), R()), (S(0), S(1)), (P(), R()), (P(), S(0)), (P("max"), P())]:
        move = axis_move(src, dst)
        assert move not in LOCAL_MOVES and [s.collective for s in plan([src], [dst])] == [move]
    with pytest.raises(TypeError, match="autopar: expected a placement"):
        axis_move("S0", R())

"""A training step from ops, collectives and the optimizer, by hand."""

import pytest

from autopar.costmodels import CollectiveFit, Op, Step, adamw_ops, step_time
from autopar.costmodels.step import ADAMW_OPS, dual_steps
from tests.test_costmodel_formulas import make_profile


def test_step_time_by_hand():
    p = make_profile((4,), alpha=1e-5, beta=1e9)
    fwd_ops = [Op(2e9, 1e6, "fp32"), Op(0, 4e6, "fp32")]
    t_f = (1e-6 + 2e9 / 1e12) + (2e-6 + 4e6 / 1e11)
    ag = Step("all_gather", 0, 4_000_000)
    t_ag = 1e-5 + 0.75 * 4e6 / 1e9
    ar = Step("all_reduce", 0, 1_000_000)
    t_ar = 1e-5 + 1.5 * 1e6 / 1e9
    opt = adamw_ops([1000], "fp32")
    t_opt = sum(2e-6 + k * 1000 * 4 / 1e11 for _, k in ADAMW_OPS)
    cost = step_time(fwd_ops, p, forward_comm=[ag], backward_extra=[ar], optimizer_ops=opt)
    assert cost.forward == pytest.approx(t_f)
    assert cost.backward == pytest.approx(2 * t_f)
    assert cost.forward_comm == pytest.approx(t_ag)
    # the all-gather's dual (a reduce-scatter of the same buffer) plus the extra all-reduce
    assert cost.backward_comm == pytest.approx(t_ag + t_ar)
    assert cost.optimizer == pytest.approx(t_opt)
    assert cost.total == pytest.approx(3 * t_f + 2 * t_ag + t_ar + t_opt)
    assert set(cost.to_dict()) == {
        "forward",
        "backward",
        "forward_comm",
        "backward_comm",
        "optimizer",
        "total",
    }


def test_blocking_collectives_are_priced_as_met_after_compute():
    p = make_profile((4,))
    p.axes[0].in_step = {"all_reduce": CollectiveFit(alpha_s=3e-5, beta_bytes_per_s=5e8)}
    blocking = Step("all_reduce", 0, 1_000_000, in_step=True)  # Megatron's g after a row-parallel layer
    bucket = Step("all_reduce", 0, 1_000_000)  # a gradient bucket
    cost = step_time([], p, forward_comm=[blocking], backward_extra=[bucket])
    after_compute, back_to_back = 3e-5 + 1.5 * 1e6 / 5e8, 1e-5 + 1.5 * 1e6 / 1e9
    assert cost.forward_comm == pytest.approx(after_compute)
    # the dual (Megatron's f) is blocking too; the bucket is priced as timed back to back
    assert cost.backward_comm == pytest.approx(after_compute + back_to_back)


def test_backward_is_priced_op_by_op():
    p = make_profile((4,))
    mm, gelu, add = Op(2e9, 1e6, "fp32", "aten.mm.default"), Op(0, 8e6, "fp32", "aten.gelu.default"), Op(
        0, 12e6, "fp32", "aten.add.Tensor"
    )
    cost = step_time([mm, gelu, add], p)
    t_mm = 1e-6 + 2e9 / 1e12
    assert cost.forward == pytest.approx(t_mm + (2e-6 + 8e6 / 1e10) + (2e-6 + 12e6 / 1e11))
    # two matmuls; one gelu_backward moving 1.5x the bytes at its own rate; nothing for the add
    assert cost.backward == pytest.approx(2 * t_mm + 2e-6 + 12e6 / 5e9)
    # the uniform approximation on request
    assert step_time([mm, gelu, add], p, backward_factor=2.0).backward == pytest.approx(2 * cost.forward)


def test_duals():
    steps = [Step(c, 0, 8) for c in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")]
    assert [s.collective for s in dual_steps(steps)] == [
        "reduce_scatter",
        "all_gather",
        "all_reduce",
        "all_to_all",
        "send_recv",
    ]


def test_adamw_ops_touch_20_parameter_sizes_per_element():
    ops = adamw_ops([10, 30], "bf16")
    assert len(ops) == 2 * len(ADAMW_OPS) == 20  # 8 updates, the step count and its .item()
    assert sum(o.bytes for o in ops) == 20 * 40 * 2


def test_sharding_the_optimizer_makes_its_step_cheaper():
    p = make_profile()
    full = step_time([], p, optimizer_ops=adamw_ops([1 << 24])).total
    shard = step_time([], p, optimizer_ops=adamw_ops([1 << 21])).total
    assert shard < full

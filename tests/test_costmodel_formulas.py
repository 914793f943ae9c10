"""Cost formulas against hand-computed values, and the orderings the planner relies on."""

import math

import pytest
import sympy as sp

from autopar.costmodels import formulas
from autopar.costmodels.comm import collective_time
from autopar.costmodels.compute import compute_time, matmul_flops, matmul_time, pointwise_time
from autopar.costmodels.opkinds import POINTWISE_KINDS, Op, backward_ops, op_kind
from autopar.costmodels.profile import (
    COLLECTIVES,
    AxisProfile,
    CollectiveFit,
    DeviceProfile,
    HardwareProfile,
    Rate,
)


# Made-up pointwise rates (bytes/s) per kind: the bandwidth-bound add at 1e11, the
# transcendental kinds slower, as on a CPU core.
KIND_RATES = {"memory": 1e11, "gelu": 1e10, "gelu_backward": 5e9, "exp": 2e10, "tanh": 1e10, "silu": 2e10,
              "softmax": 2e10, "layer_norm": 4e10, "layer_norm_backward": 3e10}


def make_profile(mesh=(4,), alpha=1e-5, beta=1e9, links=None) -> HardwareProfile:
    """A made-up profile with round numbers, so costs can be computed by hand."""
    links = links or ["intra_node"] * len(mesh)
    axes = [
        AxisProfile(
            name=f"a{i}",
            size=n,
            link=links[i],
            collectives={
                c: CollectiveFit(alpha_s=alpha * (i + 1), beta_bytes_per_s=beta / (i + 1))
                for c in COLLECTIVES
            },
        )
        for i, n in enumerate(mesh)
    ]
    dev = DeviceProfile(
        name="made-up",
        memory_bytes=10**10,
        matmul={d: Rate(latency_s=1e-6, rate=1e12) for d in ("fp32", "bf16", "fp16")},
        pointwise={k: {d: Rate(latency_s=2e-6, rate=r) for d in ("fp32", "bf16", "fp16")}
                   for k, r in KIND_RATES.items()},
        attention={w: {d: Rate(latency_s=3e-6, rate=5e11 if w == "forward" else 4e11)
                       for d in ("fp32", "bf16", "fp16")} for w in ("forward", "backward")},
        peak_matmul_flops={"fp32": 1e12, "bf16": 1e12, "fp16": 1e12},
        peak_memory_bandwidth=1e11,
    )
    return HardwareProfile(machine="test", backend="preset", mesh_shape=tuple(mesh), device=dev, axes=axes)


@pytest.mark.parametrize(
    "collective, factor",
    [
        ("all_reduce", 2 * 3 / 4),
        ("all_gather", 3 / 4),
        ("reduce_scatter", 3 / 4),
        ("all_to_all", 3 / 4),
        ("send_recv", 1.0),
    ],
)
def test_collective_time_by_hand(collective, factor):
    p = make_profile((4,))
    assert collective_time(collective, 1e6, 0, p) == pytest.approx(1e-5 + factor * 1e6 / 1e9)


def test_a_step_prices_collectives_as_timed_after_compute():
    p = make_profile((4,))
    back_to_back = collective_time("all_reduce", 1e6, 0, p)
    # no in-step fits (a preset): a step prices them as back to back
    assert collective_time("all_reduce", 1e6, 0, p, in_step=True) == back_to_back
    p.axes[0].in_step = {"all_reduce": CollectiveFit(alpha_s=3e-5, beta_bytes_per_s=5e8)}
    assert collective_time("all_reduce", 1e6, 0, p, in_step=True) == pytest.approx(3e-5 + 1.5 * 1e6 / 5e8)
    assert collective_time("all_reduce", 1e6, 0, p, 0.5, in_step=True) == pytest.approx(1.5e-5 + 1.5 * 1e6 / 5e8)
    assert collective_time("all_reduce", 1e6, 0, p) == back_to_back  # single collectives: as they were timed
    # a collective the in-step fits leave out is priced back to back
    assert collective_time("all_gather", 1e6, 0, p, in_step=True) == collective_time("all_gather", 1e6, 0, p)


def test_collective_on_axis_of_size_one_is_free():
    p = make_profile((1, 4))
    assert collective_time("all_reduce", 1e9, 0, p) == 0.0
    assert collective_time("all_reduce", 1e9, "a1", p) > 0


def test_all_reduce_costs_an_all_gather_plus_a_reduce_scatter_in_bandwidth():
    p = make_profile((8,), alpha=0.0)
    ar = collective_time("all_reduce", 1e8, 0, p)
    assert ar == pytest.approx(
        collective_time("all_gather", 1e8, 0, p) + collective_time("reduce_scatter", 1e8, 0, p)
    )


def test_compute_roofline_picks_the_binding_bound():
    p = make_profile()
    # matmul-bound: 2*1024^3 FLOPs at 1e12 FLOP/s, plus the matmul latency
    f = matmul_flops(1024, 1024, 1024)
    assert compute_time(f, 3 * 1024 * 1024 * 4, "fp32", p) == pytest.approx(1e-6 + f / 1e12)
    # bandwidth-bound: 4e6 bytes at 1e11 B/s, plus the pointwise latency
    assert compute_time(0, 4e6, "fp32", p) == pytest.approx(2e-6 + 4e6 / 1e11)
    # a view (no FLOPs, no bytes) still pays a fixed cost
    assert compute_time(0, 0, "bf16", p) == pytest.approx(2e-6)
    assert matmul_time(64, 64, 64, "fp32", p) < matmul_time(128, 128, 128, "fp32", p)


@pytest.mark.parametrize(
    "op, kind",
    [
        ("aten.gelu.default", "gelu"),
        ("aten.erf.default", "gelu"),
        ("aten.gelu_backward.default", "gelu_backward"),
        ("aten.exp.default", "exp"),
        ("aten.tanh.default", "tanh"),
        ("aten.silu.default", "silu"),
        ("aten.sigmoid.default", "silu"),
        ("aten._softmax.default", "softmax"),
        ("aten._log_softmax.default", "softmax"),
        ("aten.native_layer_norm.default", "layer_norm"),
        ("aten.native_layer_norm_backward.default", "layer_norm_backward"),
        ("aten.add.Tensor", "memory"),
        ("aten.mul_.Tensor", "memory"),
        ("aten.some_new_op.default", "memory"),
        ("", "memory"),
        ("aten.addmm.default", "matmul"),
        ("aten._scaled_dot_product_flash_attention_for_cpu.default", "attention"),
        ("aten._scaled_dot_product_flash_attention_for_cpu_backward.default", "attention_backward"),
        ("aten.view.default", "view"),
        ("gelu", "gelu"),
    ],
)
def test_op_kinds(op, kind):
    assert op_kind(op) == kind


@pytest.mark.parametrize("kind", POINTWISE_KINDS)
def test_pointwise_ops_are_priced_at_their_kinds_rate(kind):
    p = make_profile()
    # 1 Mi elements, 2 fp32 tensors (input and output): 8 MiB at the kind's rate
    assert pointwise_time(1 << 20, 2, "fp32", p, kind) == pytest.approx(2e-6 + 8 * 2**20 / KIND_RATES[kind])


def test_measured_points_are_interpolated_and_priced_continuously():
    # an add measured at 3 sizes: fast while its tensors fit in cache, slower beyond
    p = make_profile()
    p.device.pointwise["memory"]["fp32"] = Rate(
        latency_s=2e-6, rate=1e10, points=[[1e4, 3e-6], [1e6, 3e-5], [1e7, 1e-3]]
    )
    at = lambda b: compute_time(0, b, "fp32", p, "aten.add.Tensor")  # noqa: E731
    assert at(1e6) == pytest.approx(3e-5)  # a measured size: its measured time
    assert at(5.5e6) == pytest.approx((3e-5 + 1e-3) / 2)  # halfway between two: halfway
    assert at(5e3) == pytest.approx(2.5e-6)  # below the first: from the fixed cost up
    assert at(2e7) == pytest.approx(1e-3 + 1e7 / 1e10)  # beyond the last: the fitted rate
    sizes = [10 ** (k / 4) for k in range(12, 32)]
    times = [at(b) for b in sizes]
    assert times == sorted(times)  # a larger op never costs less
    # a noisy point below its neighbour does not make a larger op cheaper either
    p.device.pointwise["memory"]["fp32"] = Rate(latency_s=2e-6, rate=1e10, points=[[1e4, 5e-6], [1e5, 4e-6]])
    assert at(1e5) == pytest.approx(5e-6) and at(5e4) == pytest.approx(5e-6)


def test_a_gelu_costs_more_than_an_add_of_the_same_bytes_on_a_cpu_profile():
    p = make_profile()
    nbytes = 3 * 4 * (1 << 20)
    gelu = compute_time(0, nbytes, "fp32", p, "aten.gelu.default")
    add = compute_time(0, nbytes, "fp32", p, "aten.add.Tensor")
    assert gelu == pytest.approx(2e-6 + nbytes / 1e10) and add == pytest.approx(2e-6 + nbytes / 1e11)
    assert gelu > add
    assert compute_time(0, nbytes, "fp32", p) == add  # no name: the bandwidth-bound kind


def test_attention_is_priced_at_its_measured_rate():
    p = make_profile()
    f = 4 * 8 * 8 * 128 * 128 * 32  # flop_counter's count for (8, 8, 128, 32)
    fwd = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert compute_time(f, 1e6, "fp32", p, fwd) == pytest.approx(3e-6 + f / 5e11)
    assert compute_time(2.5 * f, 2e6, "fp32", p, "attention_backward") == pytest.approx(3e-6 + 2.5 * f / 4e11)


def test_backward_ops_by_hand():
    mm = Op(2e9, 1e6, "fp32", "aten.mm.default")
    assert backward_ops(mm) == [Op(2e9, 1e6, "fp32", "matmul")] * 2
    # with a bias: its gradient, a sum over the rows of the output's gradient
    addmm = Op(2e9, 1e6, "fp32", "aten.addmm.default", out_bytes=4e5)
    assert backward_ops(addmm) == [Op(2e9, 1e6, "fp32", "matmul")] * 2 + [Op(0, 4e5, "fp32", "memory")]
    gelu = Op(0, 8e6, "bf16", "aten.gelu.default")
    assert backward_ops(gelu) == [Op(0, 12e6, "bf16", "gelu_backward")]
    assert backward_ops(Op(0, 12e6, "fp32", "aten.add.Tensor")) == []
    assert backward_ops(Op(0, 0, "fp32", "aten.view.default")) == []
    assert backward_ops(Op(0, 12e6, "fp32", "aten.mul.Tensor")) == [Op(0, 12e6, "fp32", "memory")] * 2
    assert backward_ops(Op(0, 8e6, "fp32", "aten.mul.Scalar")) == [Op(0, 8e6, "fp32", "memory")]
    att = Op(1e9, 4e6, "fp32", "aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert backward_ops(att) == [Op(2.5e9, 8e6, "fp32", "attention_backward")]
    ln = Op(0, 2e6, "fp32", "aten.native_layer_norm.default")
    assert backward_ops(ln) == [Op(0, 3e6, "fp32", "layer_norm_backward")]
    # not in the table: twice the op itself (Kaplan et al.'s approximation)
    odd = Op(10.0, 4e6, "fp32", "aten.some_new_op.default")
    assert backward_ops(odd) == [odd, odd]


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="autopar: expected a floating dtype"):
        compute_time(1, 1, "int8", make_profile())


def test_formulas_print_and_compile_to_the_same_thing():
    assert formulas.describe("collective.all_reduce").startswith("collective.all_reduce = ")
    for name in formulas.names():
        expr = formulas.expression(name)
        args = formulas.signature(name)
        values = {s: 0.5 + i for i, s in enumerate(args)}
        want = float(
            expr.subs({sp.Symbol(k, positive=True): v for k, v in values.items()}).subs(
                {sp.Symbol(k, nonnegative=True): v for k, v in values.items()}
            )
        )
        got = formulas.compiled(name)(*values.values())
        assert math.isclose(got, want, rel_tol=1e-12), name


def test_compiled_functions_are_cached():
    assert formulas.compiled("compute") is formulas.compiled("compute")


def test_unknown_formula_name():
    with pytest.raises(KeyError, match="autopar: no cost formula"):
        formulas.describe("nope")


def test_attention_is_priced_head_by_head_between_measured_sizes():
    p = make_profile()
    # per head: 2 MFLOP in 40 us, 16 MFLOP in 200 us (bigger heads run faster per FLOP)
    p.device.attention["forward"]["fp32"] = Rate(latency_s=3e-6, rate=16e6 / 200e-6,
                                                 points=[[2e6, 40e-6], [16e6, 200e-6]])
    fwd = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert compute_time(64 * 2e6, 1e6, "fp32", p, fwd, 64) == pytest.approx(3e-6 + 64 * 40e-6)
    assert compute_time(8 * 16e6, 1e6, "fp32", p, fwd, 8) == pytest.approx(3e-6 + 8 * 200e-6)
    # between: the straight piece; below the first: towards zero; beyond the last: its rate
    assert compute_time(10 * 9e6, 1e6, "fp32", p, fwd, 10) == pytest.approx(3e-6 + 10 * 120e-6)
    assert compute_time(4 * 1e6, 1e6, "fp32", p, fwd, 4) == pytest.approx(3e-6 + 4 * 20e-6)
    assert compute_time(2 * 32e6, 1e6, "fp32", p, fwd, 2) == pytest.approx(3e-6 + 2 * 400e-6)
    # heads unknown: the whole op at the rate
    assert compute_time(64 * 2e6, 1e6, "fp32", p, fwd) == pytest.approx(3e-6 + 64 * 2e6 / 8e10)
    (bwd,) = backward_ops(Op(1e9, 4e6, "fp32", fwd, heads=64))
    assert bwd.heads == 64 and bwd.name == "attention_backward"

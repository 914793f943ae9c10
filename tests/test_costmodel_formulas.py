"""Cost formulas against hand-computed values, and the orderings the planner relies on."""

import math

import pytest
import sympy as sp

from costmodels import formulas
from costmodels.comm import collective_time
from costmodels.compute import compute_time, matmul_flops, matmul_time
from costmodels.profile import (
    COLLECTIVES,
    AxisProfile,
    CollectiveFit,
    DeviceProfile,
    HardwareProfile,
    Rate,
)


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
        pointwise={d: Rate(latency_s=2e-6, rate=1e11) for d in ("fp32", "bf16", "fp16")},
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

"""Least-squares fits of t = a + b x."""

import numpy as np
import pytest

from autopar.costmodels.fit import fit_linear, fit_per_item


def test_recovers_exact_line():
    x = [4096, 16384, 65536, 262144, 1 << 20]
    t = [2e-4 + 1e-9 * xi for xi in x]
    f = fit_linear(x, t)
    assert f.intercept == pytest.approx(2e-4, rel=1e-9)
    assert f.slope == pytest.approx(1e-9, rel=1e-9)
    assert f.median_rel_error < 1e-9
    assert f(1 << 21) == pytest.approx(2e-4 + 1e-9 * (1 << 21))


def test_relative_weighting_keeps_small_sizes_accurate():
    rng = np.random.default_rng(0)
    x = np.array([1e3, 1e4, 1e5, 1e6, 1e7])
    t = (1e-4 + 1e-9 * x) * (1 + 0.03 * rng.standard_normal(5))
    f = fit_linear(x, t)
    assert abs(f(1e3) - t[0]) / t[0] < 0.1


def test_negative_intercept_is_clamped_to_zero():
    f = fit_linear([1, 2, 3], [0.5, 1.5, 2.5])
    assert f.intercept == 0.0 and f.slope > 0


def test_bad_inputs():
    with pytest.raises(ValueError, match="autopar: a fit needs at least 2"):
        fit_linear([1], [1.0])
    with pytest.raises(ValueError, match="autopar: measured times must be positive"):
        fit_linear([1, 2], [1.0, 0.0])
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_linear([1, 2, 3], [3.0, 2.0, 1.0])


def test_per_item_fit_recovers_each_size_and_the_fixed_cost():
    # attention-like: heads (batch x heads) of four sizes, one size at two head counts
    counts = [8, 32, 16, 16, 8]
    sizes = [2.1e6, 2.1e6, 16.8e6, 4.2e6, 8.4e6]
    per = {2.1e6: 44e-6, 4.2e6: 83e-6, 8.4e6: 141e-6, 16.8e6: 244e-6}
    t = [2e-5 + n * per[s] for n, s in zip(counts, sizes)]
    f = fit_per_item(counts, sizes, t)
    assert f.intercept == pytest.approx(2e-5, rel=1e-6)
    assert [s for s, _ in f.points] == sorted(per) and all(g == pytest.approx(per[s]) for s, g in f.points)
    # no size at two counts: the fixed cost cannot be told apart, so it is 0
    g = fit_per_item(counts[1:], sizes[1:], t[1:])
    assert g.intercept == 0.0 and len(g.points) == 4
    with pytest.raises(ValueError, match="positive time"):
        fit_per_item([1, 2, 1], [1.0, 1.0, 2.0], [3.0, 1.0, 1.0])

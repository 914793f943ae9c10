"""Least-squares fits of t = a + b x."""

import numpy as np
import pytest

from costmodels.fit import fit_linear


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

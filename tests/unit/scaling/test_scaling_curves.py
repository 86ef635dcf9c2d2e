"""Sigmoid and power-law formulas and curve crossings, checked against hand calculations."""

import math
import sys

import numpy as np
import pytest

from scalerl_jax.scaling import crossing_computes, power_law, sigmoid


def recipe_x(c):
    return sigmoid(c, r0=0.30, a=0.60, b=2.0, c_mid=5_000.0)


def recipe_y(c):
    return sigmoid(c, r0=0.30, a=0.70, b=2.0, c_mid=10_000.0)


def test_worked_example_values():
    # ScaleRL explainer, both recipes start at R0 = 30%.
    # X (A=0.6, B=2, C_mid=5,000):  R(5,000)  = 0.3 + 0.3 / (1 + 1)        = 0.45
    #                               R(20,000) = 0.3 + 0.3 / (1 + (1/4)^2)  = 0.3 + 0.3 / 1.0625 = 0.58235
    # Y (A=0.7, B=2, C_mid=10,000): R(5,000)  = 0.3 + 0.4 / (1 + 2^2)      = 0.38
    #                               R(20,000) = 0.3 + 0.4 / (1 + (1/2)^2)  = 0.3 + 0.4 / 1.25 = 0.62
    assert recipe_x(5_000.0) == pytest.approx(0.45, abs=1e-12)
    assert recipe_x(20_000.0) == pytest.approx(0.3 + 0.3 / 1.0625, abs=1e-12)
    assert round(float(recipe_x(20_000.0)), 3) == 0.582
    assert recipe_y(5_000.0) == pytest.approx(0.38, abs=1e-12)
    assert recipe_y(20_000.0) == pytest.approx(0.62, abs=1e-12)


def test_worked_example_crossing_solved_by_hand():
    # X = Y  <=>  0.3 / (1 + 25e6 / C^2) = 0.4 / (1 + 1e8 / C^2).  With u = C^2:
    #   0.3 (1 + 1e8 / u) = 0.4 (1 + 25e6 / u)  =>  0.3 + 3e7 / u = 0.4 + 1e7 / u
    #   =>  2e7 / u = 0.1  =>  u = 2e8  =>  C = sqrt(2e8) = 10,000 sqrt(2) = 14,142.1356 GPU-hours,
    # where both are at 0.3 + 0.3 / (1 + 25e6 / 2e8) = 0.3 + 0.3 / 1.125 = 0.56667.
    # Y is behind at 5,000 and ahead at 20,000: one crossing in between.
    crossings = crossing_computes(recipe_x, recipe_y, c_lo=5_000.0, c_hi=20_000.0)
    assert len(crossings) == 1
    assert crossings[0] == pytest.approx(10_000.0 * math.sqrt(2.0), rel=1e-8)
    assert recipe_x(crossings[0]) == pytest.approx(0.3 + 0.3 / 1.125, abs=1e-9)
    assert recipe_y(crossings[0] * 1.01) > recipe_x(crossings[0] * 1.01)
    assert recipe_y(crossings[0] * 0.99) < recipe_x(crossings[0] * 0.99)


def test_crossing_absent_and_coincident():
    assert crossing_computes(recipe_x, recipe_y, c_lo=100.0, c_hi=10_000.0) == ()
    with pytest.raises(ValueError, match="coincide"):
        crossing_computes(recipe_x, recipe_x, c_lo=100.0, c_hi=10_000.0)


def test_sigmoid_matches_direct_formula_and_limits():
    c = np.geomspace(1.0, 1e6, 50)
    direct = 0.25 + (0.65 - 0.25) / (1.0 + (2_542.0 / c) ** 1.92)
    np.testing.assert_allclose(sigmoid(c, r0=0.25, a=0.65, b=1.92, c_mid=2_542.0), direct, rtol=1e-13)
    assert sigmoid(0.0, r0=0.25, a=0.65, b=1.92, c_mid=2_542.0) == 0.25  # R(0) = R0
    assert sigmoid(2_542.0, r0=0.25, a=0.65, b=1.92, c_mid=2_542.0) == pytest.approx(0.45)  # half way
    with np.errstate(all="raise"):  # no overflow for a steep curve far from its midpoint
        assert sigmoid(1e-3, r0=0.2, a=0.6, b=80.0, c_mid=1e4) == pytest.approx(0.2, abs=1e-12)


def test_power_law_hand_value():
    # 0.7 - 2 * 100^(-1/2) = 0.7 - 0.2 = 0.5
    assert power_law(100.0, a=0.7, d=2.0, alpha=0.5) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: sigmoid(-1.0, r0=0.3, a=0.6, b=2.0, c_mid=5.0), "compute must be >= 0"),
        (lambda: sigmoid(1.0, r0=0.3, a=0.6, b=0.0, c_mid=5.0), "b must be > 0"),
        (lambda: sigmoid(1.0, r0=0.3, a=0.6, b=1.0, c_mid=0.0), "c_mid must be > 0"),
        (lambda: power_law(0.0, a=0.7, d=2.0, alpha=0.5), "compute must be > 0"),
        (lambda: crossing_computes(recipe_x, recipe_y, c_lo=0.0, c_hi=1.0), "0 < c_lo < c_hi"),
    ],
)
def test_bad_curve_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_scaling_package_imports_only_numpy_scipy_matplotlib():
    # The fits are pure math: scaling/ imports nothing from the rest of the package and no jax.
    import ast
    import pathlib

    import scalerl_jax.scaling

    allowed_roots = {"numpy", "scipy", "matplotlib", "__future__"}
    for source in pathlib.Path(scalerl_jax.scaling.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.module is not None, f"{source.name}: a bare relative import"
                modules = [node.module]
            else:
                continue
            for module in modules:
                root = module.split(".")[0]
                in_package = module.startswith("scalerl_jax.scaling")
                assert in_package or root in allowed_roots or root in sys.stdlib_module_names, (
                    source.name,
                    module,
                )

"""The NumPy builtins' fast paths give the same values bit for bit: sigmoid, elu, elu + 1 and elu's slope without
np.where (whose loop branches on every element: with random signs 4–7 times as long), and a power's vector–Jacobian
products without the passes that treat a base of 0 where no base is 0."""
import numpy as np
import pytest

from linrec.numpy.runtime import elu, elu_plus_one, sigmoid
from linrec.numpy.vjp import vjp_elu, vjp_pow, vjp_pow_exponent


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_branch_free_builtins_give_their_piecewise_definitions_bit_for_bit(dtype):
    """sigmoid, elu, elu + 1 and elu's slope are written without np.where (whose loop branches on every element:
    with random signs 4–7 times as long): each the same values as its definition piece by piece, specials too."""
    rng = np.random.default_rng(0)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 88.0, -88.0, 800.0, -800.0]
    x = np.concatenate([rng.standard_normal(4096) * 30, specials]).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(-np.abs(x))
        pieces = {"sigmoid": (sigmoid(x), np.where(x >= 0, 1 / (1 + e), e / (1 + e))),
                  "elu": (elu(x), np.where(x > 0, x, np.expm1(np.minimum(x, 0)))),
                  "elu_plus_one": (elu_plus_one(x), np.where(x >= 0, x + 1, np.exp(np.minimum(x, 0)))),
                  "vjp_elu": (vjp_elu(x, g), g * np.where(x > 0, 1, np.exp(np.minimum(x, 0))))}
    for name, (got, want) in pieces.items():
        assert got.dtype == dtype, name
        assert np.array_equal(got, want, equal_nan=True), name


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_powers_products_without_a_zero_base_are_their_general_formulas_bit_for_bit(dtype):
    """vjp_pow and vjp_pow_exponent skip the passes for a base of 0 where there is none (checked on the base as
    given, a param's few values): the same values as the general code, which broadcasts the base and treats 0."""
    rng = np.random.default_rng(1)
    p = (rng.standard_normal((2, 30, 3, 8)) * 2).astype(dtype)
    p[0, 0, 0, :3] = [0, 1, 2]  # (exponents with special values at 0)
    g = rng.standard_normal(p.shape).astype(dtype)
    for x in (np.float64(2.0), (rng.random((3, 8)) + 0.1).astype(dtype), np.float64(1e-300), np.float64(1e300)):
        xb, gb, pb = np.broadcast_arrays(x, g, p)
        with np.errstate(all="ignore"):  # (the general formulas, as for a base with zeros)
            slope = np.where(pb == 0, 0.0, pb * np.where(xb == 0, 0.0, xb) ** (pb - 1))
            slope = np.where((xb == 0) & (pb == 1), 1.0, np.where((xb == 0) & (pb > 1), 0.0, slope))
            want = gb * slope
            want_exponent = np.where((xb == 0) & (pb >= 0), 0.0, gb * (x ** pb) * np.log(xb))
            got, got_exponent = vjp_pow(x, g, p), vjp_pow_exponent(x, g, p, x ** p)
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
        assert got_exponent.dtype == want_exponent.dtype and np.array_equal(got_exponent, want_exponent, equal_nan=True)

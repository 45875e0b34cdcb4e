"""A param's gradient from every token's outer product (Performer's W of W·x) is a matrix product over the tokens
(linrec.numpy.vjp.outer_sum), never the [B, T, H, m, n] array of the products that unbroadcast then summed (2 GB
at T = 4096, H = 8 for Performer's W [256, 64]: its backward took 2.6 s, now 0.26)."""
import numpy as np
import pytest

import linrec
from linrec.numpy.vjp import outer_sum, unbroadcast


@pytest.mark.parametrize("a_shape, b_shape, shape", [
    ((2, 5, 3, 7), (2, 5, 3, 4), (7, 4)),        # a shared param
    ((2, 5, 3, 7), (2, 5, 3, 4), (3, 7, 4)),     # a per-head one
    ((2, 5, 3, 7), (4,), (3, 7, 4)),             # one side the same for every token
    ((2, 5, 3, 7), (2, 5, 3, 4), (1, 7, 4)),     # an axis of size 1 (the products after all)
    ((7,), (4,), (7, 4)),
])
def test_outer_sum_is_the_sum_of_the_outer_products(a_shape, b_shape, shape):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    want = unbroadcast(a[..., :, None] * b[..., None, :], shape)
    got = outer_sum(a, b, shape)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_performers_backward_takes_ws_gradient_as_a_product_and_agrees_with_the_statements():
    rec = linrec.load("examples/performer.lin")
    for form, backend in (("chunkwise", "c"), ("recurrent", "numpy")):
        lines = [x.strip() for x in rec.emit_gradient(form, backend).splitlines() if x.strip().startswith("d_W +=")]
        assert lines and all(x.startswith("d_W += outer_sum(") for x in lines), (form, backend)
    x = rec.random_inputs(batch=1, tokens=24, heads=2, dims={"dk": 8, "dv": 8, "m": 16}, seed=3)
    up = {"o": np.random.default_rng(4).standard_normal(x["v"].shape)}
    dims = {"dk": 8, "dv": 8, "m": 16}
    want = rec.vjp(x, up, form="recurrent", backend="numpy", dims=dims).grads["W"]
    rng = np.random.default_rng(5)  # (the directional derivative of Σ up·o along a random direction of W)
    W = rec.default_params(heads=2, dims=dims)["W"]
    direction, h = rng.standard_normal(W.shape), 1e-6
    outputs = [rec.run(x, params={"W": W + s * h * direction}, dims=dims).outputs["o"] for s in (1, -1)]
    slope = np.sum(up["o"] * (outputs[0] - outputs[1])) / (2 * h)
    assert abs(np.sum(want * direction) - slope) <= 1e-6 * abs(slope)
    for form in ("chunkwise", "parallel"):
        got = rec.vjp(x, up, form=form, backend="c", dims=dims).grads["W"]
        assert np.abs(got - want).max() <= 1e-9 * np.abs(want).max(), form

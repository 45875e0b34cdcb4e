"""The one relative error the tests measure a result by (`from compare import rel_err`)."""
from __future__ import annotations

import numpy as np


def rel_err(actual, expected, floor: float = 1e-300) -> float:
    """max|actual − expected| / max|expected| (at least `floor`), in float64. A shape that differs or a value
    that is not finite fails here, rather than comparing as NaN or broadcasting; empty arrays agree."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), "non-finite values"
    if not expected.size:
        return 0.0
    return float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), floor)


def worst_gradient_error(rec, inputs: dict, upstream: dict, forms, backends, dims: dict | None = None) -> float:
    """The largest rel_err of any gradient of `rec.vjp` in these forms on these backends against NumPy's recurrent
    backward, which runs the statements token by token (the reference the gradient forms agree with at 1e-9 in
    float64)."""
    want = rec.vjp(inputs, upstream, form="recurrent", backend="numpy", dims=dims).grads
    return max(rel_err(rec.vjp(inputs, upstream, form=form, backend=backend, dims=dims).grads[name], g)
               for form in forms for backend in backends for name, g in want.items())

"""sigmoid far below 0. NumPy's runtime took it as 0.5·(tanh(x/2) + 1), which cancels there: 0 from x = −38 in
float64 and −17 in float32 (a probe found it). The NumPy recurrent form, the reference of every other, then
gave a gate written as in the GLA paper, sigmoid(a)^(1/16), a wrong decay (1e-2 off at a = −40), `vjp`
refused it with a false "no derivative at 0", and log(sigmoid(a)) was NaN. Now e^x/(1 + e^x) below 0, in
NumPy (linrec.numpy.runtime) and in the compiler's folding of constants and ranges (compiler.intervals)."""
import math

import numpy as np
import pytest

import linrec
from linrec.compiler.intervals import sigmoid as scalar_sigmoid
from linrec.numpy.runtime import sigmoid, silu
from test_grad import worst_error


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sigmoid_keeps_its_digits_far_below_zero(dtype):
    x = np.array([-1000.0, -100.0, -40.0, -38.0, -20.0, -17.0, -10.0, 0.0, 10.0, 40.0, 1000.0], dtype)
    exact = np.array([1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v)) for v in x.tolist()])
    got = sigmoid(x)
    assert got.dtype == dtype
    tiny = exact > np.finfo(dtype).tiny  # (below it the dtype holds 0 or a subnormal)
    assert np.all(np.abs(got[tiny] - exact[tiny]) <= 4 * np.finfo(dtype).eps * exact[tiny])
    assert np.all(got >= 0) and np.all(got <= 1)
    assert np.allclose(silu(x[tiny]), x[tiny] * exact[tiny], rtol=4 * np.finfo(dtype).eps, atol=0)
    assert np.isnan(sigmoid(np.array([np.nan], dtype))[0])
    assert sigmoid(np.array([np.inf, -np.inf], dtype)).tolist() == [1.0, 0.0]
    assert [scalar_sigmoid(v) for v in (-40.0, 0.0, math.inf, -math.inf)] == \
        [math.exp(-40.0) / (1.0 + math.exp(-40.0)), 0.5, 1.0, 0.0]


def test_a_gate_written_as_in_the_paper_agrees_in_every_form():
    """α = sigmoid(a)^(1/16) with a gate logit of −40: every form on both backends against the exact
    recurrence (α from a stable logsigmoid) at 1e-9, and its gradient finite and equal across the forms."""
    rec = linrec.compile("recurrence gate(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv], a[dk]\nstate S[dk, dv]\n"
                         "S = diag(sigmoid(a)^(1/16))·S + k⊗v\noutput o = q·S\n", "gate.lin")
    x = rec.random_inputs(batch=1, tokens=8, heads=1, seed=0)
    x["a"][0, 2, 0, 1] = -40.0
    S, exact = np.zeros((4, 4)), []
    for t in range(8):
        a = x["a"][0, t, 0]
        alpha = np.exp((np.minimum(a, 0) - np.log1p(np.exp(-np.abs(a)))) / 16)
        S = alpha[:, None] * S + np.outer(x["k"][0, t, 0], x["v"][0, t, 0])
        exact.append(x["q"][0, t, 0] @ S)
    exact = np.array(exact)
    for form in rec.forms:
        for backend in ("numpy", "c"):
            o = rec.run(x, form=form, backend=backend).outputs["o"][0, :, 0]
            assert np.abs(o - exact).max() <= 1e-9 * np.abs(exact).max(), (form, backend)
    up = {"o": np.random.default_rng(1).standard_normal((1, 8, 1, 4))}
    want = rec.vjp(x, up)  # (refused before: "a power below 1 has no derivative at 0")
    assert all(np.all(np.isfinite(g)) for g in want.grads.values())
    for form in rec.forms:
        assert worst_error(rec.vjp(x, up, form=form, backend="c").grads, want.grads) <= 1e-9, form


def test_log_of_sigmoid_far_below_zero_is_finite():
    rec = linrec.compile("recurrence ls(dk = 3, dv = 3)\ninput q[dk], k[dk], v[dv], a\nstate S[dk, dv]\n"
                         "S = S + (k*log(sigmoid(a)))⊗v\noutput o = q·S\n", "ls.lin")
    x = rec.random_inputs(1, 4, 1, seed=0)
    x["a"][0, 1, 0] = -40.0
    want = rec.run(x, form="recurrent", backend="c").outputs["o"]
    for form in rec.forms:
        for backend in ("numpy", "c"):
            got = rec.run(x, form=form, backend=backend).outputs["o"]
            assert np.all(np.isfinite(got)) and np.abs(got - want).max() <= 1e-9 * np.abs(want).max(), (form, backend)


"""The parallel backward of softmax attention (backends/numpy/adjoint_attention.py) against the recurrent
(KV-cache) backward, which tests/test_grad.py checks against finite differences: 1e-9 in float64, 5e-4 in
float32; causal, windowed and non-causal, with named values over the keys and a per-head param."""
import numpy as np
import pytest

import linrec
from linrec import verify_grad
from linrec.gradients import gradient_refusal
from test_grad import worst_error

WINDOWED = """recurrence windowed(dk = 6, dv = 5)
input q[dk], k[dk], v[dv]
param scale per head = 0.7
kn = l2norm(k)
output o = softmax(seq(kn, window=4)·(scale*q))·seq(v, window=4)
output p = q*scale
"""
NONCAUSAL = """recurrence bidirectional(dk = 6, dv = 5) noncausal
input q[dk], k[dk], v[dv]
output o = softmax(seq(k)·q)·seq(tanh(v))
"""
NONCAUSAL_WINDOW = NONCAUSAL.replace("seq(k)", "seq(k, window=3)").replace("seq(tanh(v))", "seq(tanh(v), window=3)")
PROGRAMS = {"softmax": lambda: linrec.load("examples/softmax.lin"),
            "windowed": lambda: linrec.compile(WINDOWED, "windowed.lin"),
            "noncausal": lambda: linrec.compile(NONCAUSAL, "noncausal.lin"),
            "noncausal_window": lambda: linrec.compile(NONCAUSAL_WINDOW, "noncausal_window.lin")}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("tokens", [1, 23])
def test_against_the_kv_cache_backward(name, tokens):
    rec = PROGRAMS[name]()
    assert gradient_refusal(rec, "parallel", "numpy") is None
    x = rec.random_inputs(batch=2, tokens=tokens, heads=3, dims={"dk": 6, "dv": 5}, seed=tokens)
    x["q"] *= 3.0  # peaked softmaxes
    rng = np.random.default_rng(tokens)
    up = {o.name: rng.standard_normal((2, tokens, 3) + ((5,) if o.name == "o" else (6,)))
          for o in rec.program.outputs}
    reference = rec.vjp(x, up, dims={"dk": 6, "dv": 5})
    got = rec.vjp(x, up, dims={"dk": 6, "dv": 5}, form="parallel")
    assert worst_error(got.grads, reference.grads) < 1e-9
    np.testing.assert_allclose(got.outputs["o"], reference.outputs["o"], rtol=1e-10, atol=1e-12)
    f32 = {k: v.astype(np.float32) for k, v in x.items()}
    single = rec.vjp(f32, {k: v.astype(np.float32) for k, v in up.items()}, dims={"dk": 6, "dv": 5},
                     form="parallel")
    assert all(g.dtype == np.float32 for g in single.grads.values())
    assert worst_error(single.grads, reference.grads) < 5e-4


def test_what_is_refused():
    other = linrec.compile("""recurrence summed(dk = 4, dv = 4)
input q[dk], k[dk], v[dv]
output o = softmax(seq(k)·q)·seq(v) + sum(seq(k)·q)*v
""", "summed.lin")
    assert gradient_refusal(other, "recurrent", "numpy") is None
    assert "softmax(K·q)·V" in gradient_refusal(other, "parallel", "numpy")
    assert "other than in softmax(s)·V" in gradient_refusal(other, "chunkwise", "numpy")


# ---- a point without a derivative in the sequence, the keys or the query (sqrt, a power below 1) -----------
NO_SLOPE_AT_0 = """recurrence roots(dk = 3, dv = 5)
input q[dk], k[dk], v[dv]
output o = softmax(seq(abs(k)^0.5)·sqrt(abs(q)))·seq(sqrt(abs(v) + 1)*(abs(v) + 1)^(-1))
"""


def test_the_parallel_backward_takes_sqrt_and_powers_below_1():
    """The parallel backward prints the vector–Jacobian products that check for an infinite slope (it failed to
    generate at all): the recurrent backward's gradients, and at an exact 0 under the root its error, naming the
    place and the index."""
    rec = linrec.compile(NO_SLOPE_AT_0, "roots.lin")
    assert gradient_refusal(rec, "parallel", "numpy") is None
    x = rec.random_inputs(batch=2, tokens=7, heads=2, seed=3)
    up = {"o": np.random.default_rng(4).standard_normal((2, 7, 2, 5))}
    reference = rec.vjp(x, up)
    got = rec.vjp(x, up, form="parallel")
    assert worst_error(got.grads, reference.grads) < 1e-9
    for name, at, where in (("k", (0, 3, 1, 2), "`abs(k)^0.5` at roots.lin:3:24"),
                            ("q", (1, 5, 0, 1), "`sqrt(abs(q))` at roots.lin:3:36")):
        zeroed = {n: a.copy() for n, a in x.items()}
        zeroed[name][at] = 0.0
        messages = []
        for form in ("recurrent", "parallel"):
            with pytest.raises(linrec.RuntimeInputError, match="has no derivative at 0") as caught:
                rec.vjp(zeroed, up, form=form)
            messages.append(str(caught.value))
        assert where in messages[0] and f"at index {list(at)}" in messages[0]
        assert messages[1] == messages[0]


# ---- verify --grad on a gradient that is zero by cancellation ---------------------------------------------
KEY_BIAS = """recurrence key_bias(dk = 3, dv = 5)
input q[dk], k[dk], v[dv]
param c[dk] per head = 0.1
output o = softmax(seq(k + c, window=8)·q)·seq(v, window=8)
"""


def test_verify_passes_a_gradient_zero_by_cancellation_and_fails_a_wrong_one(monkeypatch):
    """softmax ignores a shift of every score, so the gradient of a key bias is 0 exactly: each form gives the
    rounding of its B·T·H terms instead (~1e-15 in float64), which verify compares with that rounding, not
    with the gradient's own (zero) size. A gradient off by 1e-10 (the bias's) or 1e-7 (the query's, of size
    ~1) still fails."""
    rec = linrec.compile(KEY_BIAS, "key_bias.lin")
    x = rec.random_inputs(batch=2, tokens=9, heads=2, seed=0)
    up = {"o": np.random.default_rng(1).standard_normal((2, 9, 2, 5))}
    grads = rec.vjp(x, up).grads
    assert 0 < np.abs(grads["c"]).max() < 1e-13 and np.abs(grads["q"]).max() > 0.1  # (0 to rounding)
    rows = verify_grad.run(rec, backends=("numpy",), quick=True)
    assert {r.form for r in rows} == {"recurrent", "parallel", "chunkwise"}
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    right = rec.vjp
    for name, wrong in (("c", lambda g: g + 1e-10), ("q", lambda g: g + 1e-7)):
        def off(*args, name=name, wrong=wrong, **kwargs):
            result = right(*args, **kwargs)
            if kwargs.get("form") == "parallel":
                result.grads[name] = wrong(result.grads[name]).astype(result.grads[name].dtype)
            return result
        monkeypatch.setattr(rec, "vjp", off)
        rows = verify_grad.run(rec, backends=("numpy",), dtypes=("float64",), quick=True, forms=("parallel",))
        assert rows and not any(r.passed for r in rows), [r for r in rows if r.passed]
        assert all(r.note.endswith(f"worst: {name}") for r in rows)


# ---- log at 0: a log-mask of the scores, and log elsewhere -------------------------------------------------
LOG_MASK = """recurrence log_mask(dk = 3, dv = 5)
input q[dk], k[dk], v[dv]
input m in [0, 1]
output o = softmax(seq(k)·q + log(seq(m)))·seq(v)
"""


def _one_sided(loss, x, name, index, step=1e-7):
    """The derivative of loss at x in x[name][index], from the side of larger values (second order)."""
    def at(steps):
        moved = {n: a.copy() for n, a in x.items()}
        moved[name][index] += steps * step
        return loss(moved)
    return (-3 * at(0) + 4 * at(1) - at(2)) / (2 * step)


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # (the forward: log(0) = −∞)
def test_a_log_mask_of_the_scores_has_its_gradient_where_it_masks():
    """softmax(s + log(m)) = m·e^s / Σ m·e^s: at m = 0 (a key masked out) its derivative in m is finite, e^s/Σ
    m·e^s times the softmax's factor; through log the chain rule took it as 0/0 and gave NaN, silently. Now
    that derivative: against one-sided differences (m ≥ 0) and against the gradient a hair above 0, where the
    chain rule through log is exact."""
    rec = linrec.compile(LOG_MASK, "log_mask.lin")
    x = rec.random_inputs(batch=2, tokens=6, heads=2, seed=0)
    masked = [(0, 1, 0), (1, 3, 1), (1, 2, 0)]
    for index in masked:
        x["m"][index] = 0.0
    up = {"o": np.random.default_rng(1).standard_normal((2, 6, 2, 5))}
    grads = rec.vjp(x, up).grads
    assert all(np.all(np.isfinite(g)) for g in grads.values())
    near = dict(x, m=np.where(x["m"] == 0, 1e-13, x["m"]))
    assert worst_error(grads, rec.vjp(near, up).grads) < 1e-9
    loss = lambda arrays: float(np.sum(up["o"] * rec.run(arrays, form="recurrent").outputs["o"]))  # noqa: E731
    for index in masked:
        want = _one_sided(loss, x, "m", index)
        assert abs(grads["m"][index] - want) <= 1e-6 * max(1.0, abs(want)), (index, grads["m"][index], want)
    assert abs(grads["m"][0, 1, 0]) > 0.1  # (the key's weight matters: the gradient is no 0 by accident)


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # (the forward: log(0) = −∞)
@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_log_weights_of_a_softmax_in_every_form(backend):
    """A state written through softmax(k − b + log(m) + log(|k| + 1)) over the keys' axis, m = 0 at two places:
    every form on each backend gives the float64 recurrent NumPy gradient (1e-9; b's is 0, softmax ignoring a
    shift, and left out), which one-sided differences check at the masked places."""
    rec = linrec.compile("""recurrence weights(dk = 4, dv = 3)
input q[dk], k[dk], v[dv]
input m[dk] in [0, 1]
param b per head = 0.2
state S[dk, dv]
S = S + softmax(k - b + log(m) + log(abs(k) + 1))⊗v
output o = q·S
""", "weights.lin")
    x = rec.random_inputs(2, 6, 2, seed=0)
    masked = [(0, 2, 1, 1), (1, 4, 0, 3)]
    for index in masked:
        x["m"][index] = 0.0
    up = {"o": np.random.default_rng(1).standard_normal((2, 6, 2, 3))}
    reference = rec.vjp(x, up).grads
    loss = lambda arrays: float(np.sum(up["o"] * rec.run(arrays, form="recurrent").outputs["o"]))  # noqa: E731
    for index in masked:
        want = _one_sided(loss, x, "m", index)
        assert abs(reference["m"][index] - want) <= 1e-6 * max(1.0, abs(want))
    for form in rec.forms:
        grads = rec.vjp(x, up, form=form, backend=backend).grads
        assert worst_error({n: grads[n] for n in "qkvmS"}, {n: reference[n] for n in "qkvmS"}) < 1e-9, form


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_log_at_0_elsewhere_names_the_place(backend):
    """log(m) at m = 0 where no softmax weighs by m (sigmoid(log(m)) = m/(1 + m), finite): the gradient arriving
    at log is 0 and its slope infinite, 0·∞ — the error naming the place and index in every form (it was NaN,
    silently), as for sqrt; away from 0 the derivative, against central differences."""
    rec = linrec.compile("""recurrence logs(dk = 4, dv = 3)
input q[dk], k[dk], v[dv]
input m[dk] in [0, 1]
state S[dk, dv]
S = S + (sigmoid(log(m))*k)⊗v
output o = q·S
""", "logs.lin")
    x = rec.random_inputs(1, 5, 2, seed=0)
    up = {"o": np.random.default_rng(1).standard_normal((1, 5, 2, 3))}
    grads = rec.vjp(x, up, backend=backend).grads["m"]
    loss = lambda arrays: float(np.sum(up["o"] * rec.run(arrays, form="recurrent").outputs["o"]))  # noqa: E731
    index = (0, 2, 1, 3)
    step = {n: np.zeros_like(a) for n, a in x.items()}
    step["m"][index] = 1e-6
    central = (loss({n: x[n] + step[n] for n in x}) - loss({n: x[n] - step[n] for n in x})) / 2e-6
    assert abs(grads[index] - central) <= 1e-6 * max(1.0, abs(central))
    x["m"][index] = 0.0
    for form in rec.forms:
        with pytest.raises(linrec.RuntimeInputError, match=r"log has no derivative at 0.*`log\(m\)` at logs.lin:5:"
                                                           r"18, at index \[0, 2, 1, 3\] of its argument"):
            rec.vjp(x, up, form=form, backend=backend)

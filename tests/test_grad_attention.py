"""The parallel backward of softmax attention (backends/numpy/adjoint_attention.py) against the recurrent
(KV-cache) backward, which tests/test_grad.py checks against finite differences: 1e-9 in float64, 5e-4 in
float32; causal, windowed and non-causal, with named values over the keys and a per-head param."""
import numpy as np
import pytest

import linrec
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

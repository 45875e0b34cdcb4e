"""The parallel and chunkwise backward of elementwise decays exp(X)*S (backends/numpy/adjoint_elementwise.py),
against the recurrent backward (which tests/test_grad.py checks against finite differences): 1e-9 in float64,
5e-4 in float32; ragged T, strong decays, decays that underflow to 0 (a reset in effect) and an initial state
and gradient of the final state in every case."""
import numpy as np
import pytest

import linrec
from linrec.gradients import gradient_refusal
from test_grad import float32, worst_error

GATED = """recurrence elementwise(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], k2[dk], v2[dv], G[dk, dv] <= 0
state S[dk, dv]
output early = q·S                # a readout before the update
S = exp(G)*S + k⊗v + k2⊗v2        # two writes
output late = (q*k)·S
"""
DIMS = {"dk": 5, "dv": 4}


def _check(rec, x, seed):
    rng = np.random.default_rng(seed)
    tokens = next(iter(x.values())).shape[1]
    up = {o.name: rng.standard_normal((2, tokens, 2) + tuple(DIMS[d] for d in o.value.shape))
          for o in rec.program.outputs}
    s0 = {"S": rng.standard_normal((2, 2, 5, 4))}
    end = {"S": rng.standard_normal((2, 2, 5, 4))}
    reference = rec.vjp(x, up, initial_state=s0, grad_final_state=end, dims=DIMS)
    for form, chunk in (("parallel", None), ("chunkwise", 8), ("chunkwise", 13)):
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=end, dims=DIMS, form=form, chunk_size=chunk)
        assert worst_error(got.grads, reference.grads) < 1e-9, (form, chunk)
        assert all(np.all(np.isfinite(g)) for g in got.grads.values())
    single = rec.vjp(float32(x), float32(up), initial_state=float32(s0), grad_final_state=float32(end), dims=DIMS,
                     form="chunkwise", chunk_size=8)
    assert worst_error(single.grads, reference.grads) < 5e-4


@pytest.mark.parametrize("tokens", [1, 29, 64])
def test_mamba1(tokens):
    rec = linrec.load("examples/mamba1.lin")
    assert gradient_refusal(rec, "chunkwise", "numpy") is None
    x = rec.random_inputs(batch=2, tokens=tokens, heads=2, dims=DIMS, seed=tokens)
    x["dt"][:, ::3] *= 20.0  # strong decays: Δ·A down to about −300 on every third token
    _check(rec, x, tokens)


@pytest.mark.parametrize("tokens", [1, 37])
def test_readouts_before_the_update_several_writes_and_resets(tokens):
    rec = linrec.compile(GATED, "elementwise.lin")
    x = rec.random_inputs(batch=2, tokens=tokens, heads=2, seed=3, decay_scale=20.0)
    x["G"][:, 5::11, :, 1:3] = -800.0  # exp underflows to 0: these elements start again from their write
    _check(rec, x, tokens + 1)


def test_a_decay_of_exactly_zero_in_every_form():
    """An element's log-decay of −∞ (a reset of that element), which the parallel and chunkwise backward
    refused: the recurrent backward's gradients on both backends, ∂G 0 there."""
    rec = linrec.compile(GATED, "elementwise.lin")
    x = rec.random_inputs(batch=1, tokens=6, heads=1, seed=0)
    x["G"][0, 2, 0, 0, 0] = -np.inf
    up = {"early": np.ones((1, 6, 1, 4)), "late": np.ones((1, 6, 1, 4))}
    want = rec.vjp(x, up).grads
    assert all(np.all(np.isfinite(g)) for g in want.values())
    for backend in ("numpy", "c"):
        for form in ("parallel", "chunkwise"):
            got = rec.vjp(x, up, form=form, backend=backend, chunk_size=4).grads
            assert worst_error(got, want) <= 1e-9 and got["G"][0, 2, 0, 0, 0] == 0.0, (backend, form)


TRANSPOSED = """recurrence transposed(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], u[dv], X[dk] >= 0, Y[dv] >= 0, a[dk]
param w[dk] = 0.5
state S[dv, dk]                   # the transposed convention: S·q reads it
output early = S·q                # a readout before the update
S = exp(−Y⊗(X + softplus(a + w)))*S + v⊗k + u⊗(k*k)
output late = tanh(S·(q + k))
"""


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_in_the_transposed_convention(backend):
    """An elementwise decay of a state carried transposed (S[dv, dk], read as S·q): its forward forms carry
    Sᵀ, and so do its backward ones now — they were refused as not derived. Every gradient, the param's and the
    initial state's included, against NumPy's recurrent backward (the statements' adjoint, as written)."""
    rec = linrec.compile(TRANSPOSED, "transposed.lin")
    assert gradient_refusal(rec, "chunkwise", backend) is None
    rng = np.random.default_rng(5)
    x = rec.random_inputs(batch=2, tokens=29, heads=2, dims=DIMS, seed=5)
    up = {name: rng.standard_normal((2, 29, 2, 4)) for name in ("early", "late")}
    s0, end = ({"S": rng.standard_normal((2, 2, 4, 5))} for _ in range(2))
    reference = rec.vjp(x, up, initial_state=s0, grad_final_state=end, dims=DIMS)
    for form, chunk in (("recurrent", 4), ("parallel", None), ("chunkwise", 8), ("chunkwise", 13)):
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=end, dims=DIMS, form=form, chunk_size=chunk,
                      backend=backend)
        assert worst_error(got.grads, reference.grads) < 1e-9, (form, chunk)
    single = rec.vjp(float32(x), float32(up), initial_state=float32(s0), grad_final_state=float32(end), dims=DIMS,
                     form="chunkwise", chunk_size=8, backend=backend)
    assert worst_error(single.grads, reference.grads) < 5e-4
    corrected = linrec.compile(TRANSPOSED.replace("+ u⊗(k*k)", "").replace(
        "S = exp(", "S = (exp(").replace("*S + v⊗k", "*S)·(I − 0.1·k⊗k) + v⊗k"), "corrected.lin")
    assert gradient_refusal(corrected, "chunkwise", "numpy") is None  # (with a correction: NumPy's alone)
    assert "with rank-one corrections: the C backward does not take it" in gradient_refusal(corrected, "chunkwise", "c")

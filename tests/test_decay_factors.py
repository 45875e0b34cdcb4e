"""An elementwise log-decay factored into a rate the same for every token times a step per token
(compiler.decay_factors), as the C recurrent backward takes it (linrec.c.factored_decay, the DECAY 2 kernels of
templates/c_grad_elementwise.c.j2): what the factoring finds in the expressions, and the C recurrent backward of
programs with a step along the columns (Mamba-1's A·diag(Δ)) and along the rows, a rate per head and one shared
by the heads, a rate computed from a param, against the NumPy recurrent backward (which takes the log-decay as
one array) at 1e-9 in float64 and 5e-4 in float32 — several batch rows (the rate's gradient summed over them),
sizes that are not whole registers, segments that do not divide T, an initial state and a final state's
gradient; variants of the rate and the step (a per-head scalar times a shared matrix, named values, a second
write, a readout before the update)."""
from __future__ import annotations

import numpy as np
import pytest

import linrec
from linrec.compiler.analysis import to_text
from linrec.compiler.decay_factors import decay_factors
from test_grad import float32, worst_error

ROWS = """recurrence rows(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], u[dk] > 0
param P[dk, dv] = uniform(0.5, 2, seed=0)   # shared by the heads
state S[dk, dv]
output early = q·S                            # a readout before the update
S = exp(−(diag(u)·P))*S + k⊗v
output o = q·S
"""

INLINE = """recurrence inline(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], dt[dv] > 0
param A_log[dk, dv] per head = log(uniform(1, 4, seed=0))
state S[dk, dv]
S = exp(−exp(A_log)·diag(softplus(dt)))*S + k⊗(dt*v)
output o = q·S
"""

PER_TOKEN_RATE = """recurrence token(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], dt[dv] > 0, G[dk, dv] <= 0
state S[dk, dv]
S = exp(G·diag(dt))*S + k⊗v
output o = q·S
"""


def _factors(rec):
    t = rec.compiled.decomposition.transition("S")
    f = decay_factors(t, rec.compiled.program.lets)
    return None if f is None else (to_text(f.rate), to_text(f.step), f.rows)


def test_what_the_factoring_finds():
    assert _factors(linrec.load("examples/mamba1.lin")) == ("A", "dt", False)
    assert _factors(linrec.compile(ROWS, "rows.lin")) == ("−P", "u", True)
    assert _factors(linrec.compile(INLINE, "inline.lin")) == ("−exp(A_log)", "softplus(dt)", False)
    # a rate that changes with the token, and decays that are not elementwise: one array, as before
    assert _factors(linrec.compile(PER_TOKEN_RATE, "token.lin")) is None
    assert _factors(linrec.load("examples/gla.lin")) is None
    assert _factors(linrec.load("examples/mamba2.lin")) is None


def test_the_c_backward_takes_the_factors_and_makes_no_array_per_element():
    rec = linrec.load("examples/mamba1.lin")
    source = rec.emit_gradient("recurrent", "c")
    assert "factored_decay(A, per_token(dt, (batch, tokens, heads, dv)" in source
    assert "(batch, tokens, heads, dk, dv)" not in source  # (no log-decay, nor its gradient, per element)
    assert "d_A += unbroadcast(S_grads.log_decay.rate, d_A.shape)" in source
    # the other backwards (NumPy's scans, the C chunk kernels) take the log-decay as one array
    for form, backend in (("recurrent", "numpy"), ("chunkwise", "numpy"), ("chunkwise", "c")):
        assert "factored_decay" not in rec.emit_gradient(form, backend), (form, backend)


def _check(rec, dims, tokens, seed, chunks=(None, 7)):
    rng = np.random.default_rng(seed)
    batch, heads = 3, 2
    x = rec.random_inputs(batch=batch, tokens=tokens, heads=heads, dims=dims, seed=seed)
    shape = (batch, heads, dims["dk"], dims["dv"])
    up = {o.name: rng.standard_normal((batch, tokens, heads) + tuple(dims[d] for d in o.value.shape))
          for o in rec.program.outputs}
    s0, end = {"S": rng.standard_normal(shape)}, {"S": rng.standard_normal(shape)}
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=end, dims=dims, backend="numpy")
    for chunk in chunks:
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=end, dims=dims, backend="c", chunk_size=chunk)
        assert worst_error(got.grads, want.grads) < 1e-9, chunk
        assert worst_error(got.outputs, want.outputs) < 1e-9, chunk
    single = rec.vjp(float32(x), float32(up), initial_state=float32(s0), grad_final_state=float32(end), dims=dims,
                     backend="c", chunk_size=chunks[-1])
    assert all(g.dtype == np.float32 for g in single.grads.values() if isinstance(g, np.ndarray) and g.ndim > 1)
    assert worst_error(single.grads, want.grads) < 5e-4


@pytest.mark.parametrize("tokens", [1, 23])
def test_mamba1_the_step_along_the_columns(tokens):
    _check(linrec.load("examples/mamba1.lin"), {"dk": 5, "dv": 19}, tokens, tokens)


@pytest.mark.parametrize("tokens", [1, 23])
def test_the_step_along_the_rows_a_rate_shared_by_the_heads(tokens):
    _check(linrec.compile(ROWS, "rows.lin"), {"dk": 19, "dv": 6}, tokens, tokens + 1)


def test_a_rate_computed_from_a_param():
    _check(linrec.compile(INLINE, "inline.lin"), {"dk": 6, "dv": 17}, 30, 2)


def test_the_rate_is_checked():
    from linrec.c import factored_decay, grad_elementwise
    from linrec.dsl.errors import RuntimeInputError
    s0 = np.zeros((1, 2, 3, 4))
    decay = factored_decay.FactoredDecay(np.zeros((3, 3, 4)), np.zeros((1, 5, 2, 4)), False)  # three heads, not two
    with pytest.raises(RuntimeInputError, match=r"rate of a factored log-decay should have shape \[2, 3, 4\]"):
        grad_elementwise.elementwise_checkpoints(s0, decay, [(np.zeros((1, 5, 2, 3)), np.zeros((1, 5, 2, 4)))],
                                                 [(np.zeros((1, 5, 2, 3)), False)], None)


VARIANTS_HEAD = """recurrence variant(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], z[dv], w[dk]
param A[dk, dv] per head = −uniform(1, 4, seed=0)
param P[dk, dv] = uniform(0.5, 2, seed=2)
param c per head = uniform(0.5, 1, seed=3)
state S[dk, dv]
"""

VARIANTS = {  # body → the factors found
    # a per-head scalar times a matrix the heads share: the rate's gradient [H, dk, dv] times c [H]
    "S = exp((−c·P)·diag(softplus(z)))*S + k⊗v\noutput o = q·S": ("−c·P", "softplus(z)", False),
    # the step a named value, which the write reads too
    "s = softplus(z)\nS = exp(A·diag(s))*S + k⊗(s*v)\noutput o = q·S": ("A", "softplus(z)", False),
    # along the rows, from a named value an output reads too; a second write, a readout before the update
    "r = sigmoid(w)\noutput e = q·S\nS = exp(diag(r)·A)*S + k⊗v + w⊗z\noutput o = q·S + r·k": ("A", "sigmoid(w)", True),
}


@pytest.mark.parametrize("body", list(VARIANTS))
def test_variants(body):
    rec = linrec.compile(VARIANTS_HEAD + body + "\n", "variant.lin")
    assert _factors(rec) == VARIANTS[body]
    assert "factored_decay(" in rec.emit_gradient("recurrent", "c")
    _check(rec, {"dk": 6, "dv": 17}, 21, 4)

"""A readout whose query has a constant factor (`dk^(−1/2)` of `dk^(−1/2)·q`) goes to the C recurrent backward
as the query q and the factor (compiler.adjoint.constant_factor, c.grad): the kernels of c.grad_kernels multiply
the readout's upstream gradient by the factor as they read it, the elementwise and value-side kernels are given
q times it (c.grad_scans), and either way the query's gradient is q's. Here: which factors are split off, and the
C backward against the NumPy recurrent one — in float64 at 1e-9, in float32 at the forms' 5e-4 — on programs
that take each kernel, with a readout before the update, two readouts with different factors, and a factor
that must not be split (a param's: a caller may pass another value at every call)."""
import numpy as np
import pytest

import linrec
from linrec import gradients
from linrec.compiler import ir
from linrec.compiler.adjoint import constant_factor
from linrec.compiler.analysis import to_text
from test_grad import worst_error

PROGRAMS = {
    # c.grad_kernels without corrections (the windows), two readouts with their own factors, one before the update
    "two_factors": """
recurrence two_factors(dk = 16, dv = 16)
input q[dk], k[dk], v[dv]
input g[dk] <= 0
state S[dk, dv]
output before = 3·dv^(−1/3)·q·S
S = diag(exp(g))·S + k⊗v
output o = dk^(−1/2)·q·S
""",
    # c.grad_kernels with a rank-one correction (the delta rule: the stored states' way)
    "delta_factor": """
recurrence delta_factor(dk = 16, dv = 16)
input q[dk], k[dk], v[dv]
input beta in (0, 1)
kn = l2norm(k)
state S[dk, dv]
S = (I − beta·kn⊗kn)·S + beta·kn⊗v
output o = (dk·dv)^(−1/4)·l2norm(q)·S
""",
    # an elementwise decay: the factor applied to the query before the kernel
    "elementwise_factor": """
recurrence elementwise_factor(dk = 16, dv = 16)
input x[dv]
input dt[dv] > 0
input B[dk], C[dk]
param A[dk, dv] per head = −uniform(1, 4, seed=0)
state S[dk, dv]
S = exp(A·diag(dt))*S + B⊗(dt*x)
output y = 2·dk^(−1/2)·C·S
""",
    # a decay of the value axis with a correction there (c.grad_value_side)
    "value_side_factor": """
recurrence value_side_factor(dk = 16, dv = 16)
input q[dk], k[dk], v[dv]
input beta in (0, 1)
input gv[dv] <= 0
vn = l2norm(v)
state S[dk, dv]
S = S·diag(exp(gv))·(I − beta·vn⊗vn) + beta·k⊗vn
output o = dk^(−1/2)·q·S
""",
    # a param's factor stays in the query: not split, whatever its value at a call
    "param_factor": """
recurrence param_factor(dk = 16, dv = 16)
input q[dk], k[dk], v[dv]
input g <= 0
param s = 0.5
state S[dk, dv]
S = exp(g)·S + k⊗v
output o = s·dk^(−1/2)·q·S
""",
}


def _readout_queries(rec):
    return [r.query for r in rec.compiled.decomposition.readouts]


def test_constant_factors_split_off():
    """Numbers and sizes are split off a query; a param's factor and the per-token rest stay."""
    two = [constant_factor(q) for q in _readout_queries(linrec.compile(PROGRAMS["two_factors"]))]
    assert [(to_text(f), to_text(rest)) for f, rest in two] == [("3*dv^(−1/3)", "q"), ("dk^(−1/2)", "q")]
    factor, rest = constant_factor(_readout_queries(linrec.compile(PROGRAMS["delta_factor"]))[0])
    assert (to_text(factor), to_text(rest)) == ("(dk·dv)^(−1/4)", "l2norm(q)")
    factor, rest = constant_factor(_readout_queries(linrec.compile(PROGRAMS["param_factor"]))[0])
    assert (to_text(factor), to_text(rest)) == ("dk^(−1/2)", "s*q")
    query = ir.InputRef(("dk",), "q")
    assert constant_factor(query) == (None, query)  # (no factor)
    assert constant_factor(ir.Dot(("dk",), ir.Const((), 2.0), ir.DimSize((), "dk")))[0] is None  # (nothing else)


def test_the_generated_module_passes_the_factor():
    """The C backward's module gives the kernel q and the factor, and takes q's gradient as it comes."""
    source = linrec.load("examples/gla.lin").emit_gradient(form="recurrent", backend="c")
    assert "(per_token(q, (batch, tokens, heads, dk), dtype, scalar=False), False, dk ** (-1.0 / 2.0))" in source
    assert "d_q *= " not in source


def _case(rec, dims, tokens, dtype, seed):
    x = rec.random_inputs(batch=2, tokens=tokens, heads=2, dims=dims, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    ref = rec.run(x, dims=dims)
    up = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in ref.outputs.items()}
    s0 = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in ref.final_state.items()}
    gT = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in ref.final_state.items()}
    return x, up, s0, gT


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_c_backward_with_factors_matches_numpy(name):
    rec = linrec.compile(PROGRAMS[name])
    assert gradients.gradient_refusal(rec, "recurrent", "c") is None  # (the C backward: no NumPy fallback)
    dims = {"dk": 20, "dv": 33}
    for tokens, chunk in ((1, None), (77, 7), (150, None), (150, 64)):
        x, up, s0, gT = _case(rec, dims, tokens, np.float64, seed=tokens)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=dims, chunk_size=chunk)
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=dims, chunk_size=chunk, backend="c")
        assert worst_error(got.grads, want.grads) <= 1e-9, (name, tokens, chunk)
        assert worst_error(got.outputs, want.outputs) <= 1e-9, (name, tokens, chunk)


@pytest.mark.parametrize("name", ["two_factors", "delta_factor"])
def test_c_backward_with_factors_float32(name):
    rec = linrec.compile(PROGRAMS[name])
    dims = {"dk": 64, "dv": 64}
    x, up, s0, gT = _case(rec, dims, 300, np.float32, seed=11)
    wide = [{k: v.astype(np.float64) for k, v in a.items()} for a in (x, up, s0, gT)]
    want = rec.vjp(wide[0], wide[1], initial_state=wide[2], grad_final_state=wide[3], dims=dims)
    got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=dims, backend="c")
    assert worst_error(got.grads, want.grads) <= 5e-4, name

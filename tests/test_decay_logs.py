"""The log-decay the derived forms carry (compiler.transitions.log_of) for decays written as products: a product
is taken factor by factor, log(a·b) = log a + log b, only where it is elementwise and both factors are positive.
Two programs a probe found wrong: a scalar decay that is a contraction of two vectors, (exp(u)·exp(u))/dk, whose
log came out as u + u − log(dk) — a vector, where the decay is a scalar — and every gradient form but NumPy's
recurrent one 5–85% off, silently; and a positive decay of negative factors, (−a)*(−exp(g)), whose factors' logs
are NaN, so that every backward but NumPy's recurrent one refused the call with a false "NaN". Here: the log-decay
each gets, and every gradient form on both backends against NumPy's recurrent one (the statements as written),
and that one against central differences of the float64 forward."""
import pytest

import linrec
from linrec import verify_grad
from linrec.compiler.analysis import to_text

PROGRAMS = {
    "contraction": ("input q[dk], k[dk], v[dv], u[dk] <= -1\nstate S[dk, dv]\nS = ((exp(u)·exp(u))/dk)·S + k⊗v\n"
                    "output o = q·S\n", "log(exp(u)·exp(u)) − log(dk)"),
    "sigmoids": ("input q[dk], k[dk], v[dv], w[dk]\nstate S[dk, dv]\nS = ((sigmoid(w)·sigmoid(w))/dk)·S + k⊗v\n"
                 "output o = q·S\n", "log(sigmoid(w)·sigmoid(w)) − log(dk)"),
    "negative_factors": ("input q[dk], k[dk], v[dv], a in (0, 1), g <= 0\nstate S[dk, dv]\n"
                         "S = (−a)*(−exp(g))*S + k⊗v\noutput o = q·S\n", "log(−a*−exp(g))"),
    "shifted_factors": ("input q[dk], k[dk], v[dv], a in (0, 1), b in (0, 1)\nstate S[dk, dv]\n"
                        "S = (a − 1)*(b − 1)*S + k⊗v\noutput o = q·S\n", "log((a − 1)*(b − 1))"),
    # (still split where it may be: a positive factor's exact log beside a positive input's)
    "split": ("input q[dk], k[dk], v[dv], a in (0, 1), g <= 0\nstate S[dk, dv]\nS = exp(g)*a*S + k⊗v\n"
              "output o = q·S\n", "g + log(a)"),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_log_decay_and_every_gradient_form(name):
    body, log_decay = PROGRAMS[name]
    rec = linrec.compile("recurrence p(dk = 4, dv = 3)\n" + body, f"{name}.lin")
    transition = rec.decomposition.transitions[0]
    assert to_text(transition.log_decay) == log_decay and transition.log_decay.shape == ()
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    rows = verify_grad.run(rec, backends=("numpy", "c"), dtypes=("float64",), quick=True)
    assert {(r.form, r.backend) for r in rows} == {(f, b) for f in rec.forms for b in ("numpy", "c")}
    assert not [r for r in rows if not r.passed], [r for r in rows if not r.passed]

"""Bounds of values (compiler.intervals) that let a decay be proved positive and at most 1: cos and sin (and
their folding in param defaults, compiler.constants; their derivatives and every form are checked on rotary
features in test_unseen_variants, "rope"), and max and min, read as b + relu(a − b) and a − relu(a − b)."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings, strategies as st

import linrec
from linrec import compiler
from linrec.compiler.analysis import to_text
from linrec.compiler.intervals import Bounds, Interval, _apply


@settings(max_examples=300, deadline=None)
@given(st.floats(-50, 50), st.floats(0, 8), st.sampled_from(["cos", "sin"]))
def test_the_bounds_hold_every_value_and_no_more(lo, width, name):
    f = math.cos if name == "cos" else math.sin
    bound = _apply(name, Interval(lo, lo + width))
    xs = np.linspace(lo, lo + width, 4001)
    values = np.cos(xs) if name == "cos" else np.sin(xs)
    assert bound.lo <= values.min() + 1e-12 and values.max() <= bound.hi + 1e-12
    # tight: the bound's ends are values taken (to the sampling's resolution), not merely −1 and 1
    step = width / 4000
    assert bound.lo >= values.min() - step - 1e-12 and bound.hi <= values.max() + step + 1e-12
    assert -1 <= bound.lo <= bound.hi <= 1 and f(lo) >= bound.lo - 1e-15


def test_a_decay_made_of_sin_is_proved_positive_and_has_every_form():
    """0.5 + 0.4·sin(a) lies in [0.1, 0.9] for any a: a decay the parallel and chunkwise forms may take."""
    rec = linrec.compile("""recurrence trig(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], a
state S[dk, dv]
S = (0.5 + 0.4*sin(a))*S + k⊗v
output o = q·S
""", "trig.lin")
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(1, 9, 2, seed=0)
    want = np.zeros_like(x["v"])
    for h in range(2):
        S = np.zeros((4, 3))
        for t in range(9):
            S = (0.5 + 0.4 * np.sin(x["a"][0, t, h])) * S + np.outer(x["k"][0, t, h], x["v"][0, t, h])
            want[0, t, h] = x["q"][0, t, h] @ S
    for backend in ("numpy", "c"):
        for form in rec.forms:
            got = rec.run(x, form=form, backend=backend, chunk_size=4).outputs["o"]
            assert np.max(np.abs(got - want)) < 1e-12 * np.max(np.abs(want)), (form, backend)


def test_cos_and_sin_fold_in_param_defaults():
    rec = linrec.compile("""recurrence folded(dk = 2, dv = 1)
input q[dk], k[dk], v[dv]
param c = cos(0.3) + sin(0.2)
state S[dk, dv]
S = S + k⊗v
output o = c*(q·S)
""", "folded.lin")
    assert rec.run(rec.random_inputs(1, 2, 1, seed=0)).params["c"] == math.cos(0.3) + math.sin(0.2)


_ENDS = st.floats(-5, 5)


@settings(max_examples=300, deadline=None)
@given(_ENDS, st.floats(0.01, 4), _ENDS, st.floats(0.01, 4), st.sampled_from(["max", "min"]))
def test_max_and_min_are_bounded_by_their_operands(a_lo, a_width, b_lo, b_width, kind):
    """The bounds of max(a, b) and min(a, b) hold every value they take, and are those values' extremes: taken
    term by term (each a on its own) min(a, 0.9) with a in (0, 1) spanned (−0.1, 1)."""
    a_hi, b_hi = a_lo + a_width, b_lo + b_width
    program = compiler.compile_source(f"recurrence t(d = 2)\ninput q[d], k[d], a in [{a_lo!r}, {a_hi!r}], "
                                      f"b in [{b_lo!r}, {b_hi!r}]\nstate S[d, d]\nS = S + k⊗k\n"
                                      f"output o = {kind}(a, b)*(q·S)\n", "t.lin").program
    value = program.outputs[0].value.left
    bound = Bounds(program).of(value)
    pick = max if kind == "max" else min
    assert bound.lo == pick(a_lo, b_lo) and bound.hi == pick(a_hi, b_hi)


def test_a_refused_extremum_is_named_as_written():
    """An elementwise decay written min(a, 0.9) that can be negative (a unbounded) is named so in the reason, and the hint
    that bounds take each occurrence on its own is left out: built as a − relu(a − 0.9), the reason showed that
    and suggested writing a once."""
    rec = linrec.compile("recurrence t(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv], a[dk, dv]\nstate S[dk, dv]\n"
                         "S = min(a, 0.9)*S + k⊗v\noutput o = q·S\n", "t.lin")
    why = rec.decomposition.why_not("parallel")
    assert "the decay `min(a, 0.9)` of 'S' can be zero or negative (its values lie in (−∞, 0.9])" in why
    assert "relu" not in why and "occurrence" not in why
    assert to_text(rec.program.updates["S"].value) == "min(a, 0.9)*S + k⊗v"  # (linrec check's line)

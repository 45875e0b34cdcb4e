"""What the fuzzer (tests/fuzzing.py) found, one test per class of failure, each failing before its fix:
programs `check` accepts that then failed inside linrec, forms `check` listed that `run` refused, and
programs rejected without saying where. Errors are checked for their message and their source location."""
from __future__ import annotations

import numpy as np
import pytest

import linrec
from linrec import registry
from linrec.decode import run_by_steps
from linrec.dsl.errors import LinrecError, RuntimeInputError

FILE = "found.lin"
HEAD = "recurrence t(dk = 3, dv = 2)\ninput q[dk], k[dk], v[dv]\n"


def compile_error(source: str) -> LinrecError:
    with pytest.raises(LinrecError) as info:
        linrec.compile(source, FILE)
    assert not isinstance(info.value, RuntimeInputError)
    return info.value


def located(err: LinrecError, source: str, line: int, fragment: str, *words: str):
    """The error points at `fragment` in line `line` (1-based) and says each of `words`."""
    assert err.span is not None, str(err)
    column = source.splitlines()[line - 1].index(fragment) + 1
    assert (err.span.line, err.span.column) == (line, column), str(err)
    first = str(err).splitlines()[0]
    assert first.startswith(f"{FILE}:{line}:{column}: error: "), first
    for word in words:
        assert word in first, f"{word!r} not in {first!r}"


def every_form(rec, inputs, **options) -> dict:
    """(form, backend) → result, for every form `check` lists on every backend it lists."""
    out = {}
    for form in rec.forms:
        for backend in registry.building(rec.compiled, form):
            out[form, backend] = rec.run(inputs, form=form, backend=backend, **options)
    return out


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---- builtins outside the sequence -------------------------------------------------------------------
def test_softmax_of_a_vector_runs_on_every_form_and_backend():
    """softmax is a vector builtin: of a readout or of an input, not only of seq(…) scores (it had no NumPy
    spelling, nor a C one: 174 of 3000 fuzzed programs)."""
    rec = linrec.compile(HEAD + "state S[dk, dv]\nS = 0.5·S + k⊗v\noutput o = softmax(q·S)\n"
                         "output p = softmax(k)·S\n", FILE)
    x = rec.random_inputs(2, 9, 2)
    S = np.zeros((2, 2, 3, 2))
    o, p = [], []
    for t in range(9):
        S = 0.5 * S + x["k"][:, t, :, :, None] * x["v"][:, t, :, None, :]
        o.append(softmax(np.einsum("bhi,bhij->bhj", x["q"][:, t], S)))
        p.append(np.einsum("bhi,bhij->bhj", softmax(x["k"][:, t]), S))
    results = every_form(rec, x)
    assert {b for _, b in results} == {"numpy", "c"}
    for result in results.values():
        np.testing.assert_allclose(result.outputs["o"], np.stack(o, axis=1), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(result.outputs["p"], np.stack(p, axis=1), rtol=1e-12, atol=1e-14)


# ---- named values ------------------------------------------------------------------------------------
def test_named_constants_and_per_head_values():
    """A named value that is a constant (`c = 0.5`, `d = dk`) or built only from per-head params was read as
    if it had a token axis (`c[:, t]`: an internal error, or a per-head [H, dk] value indexed along dk)."""
    rec = linrec.compile(HEAD + "param p per head = 1 − 2^(−1 − h)\nparam r[dk] per head = uniform(0.5, 1, seed=2)\n"
                         "c = 0.5\nd = dk\ne = p·r\nstate S[dk, dv]\nS = c·p·S + (e*k)⊗v\noutput o = d·q·S\n", FILE)
    x = rec.random_inputs(2, 7, 2)
    p = np.array([0.5, 0.75])
    r = rec.default_params(2)["r"]
    S, o = np.zeros((2, 2, 3, 2)), []
    for t in range(7):
        key = p[:, None] * r * x["k"][:, t]
        S = 0.5 * p[:, None, None] * S + key[..., :, None] * x["v"][:, t, :, None, :]
        o.append(3 * np.einsum("bhi,bhij->bhj", x["q"][:, t], S))
    results = every_form(rec, x)
    assert len(results) == 6
    for result in results.values():
        np.testing.assert_allclose(result.outputs["o"], np.stack(o, axis=1), rtol=1e-12, atol=1e-14)
    step = run_by_steps(rec, x)
    np.testing.assert_allclose(step.outputs["o"], np.stack(o, axis=1), rtol=1e-12, atol=1e-14)


# ---- parameters --------------------------------------------------------------------------------------
def test_param_computed_from_a_per_head_param_must_be_per_head():
    """`param b = sigmoid(a)` with `a` per head has a head axis it is not declared with: an internal error in
    default_params before, a compile error at the reference now."""
    src = HEAD + "param a[dv] per head = randn(seed=1)\nparam b[dv] = sigmoid(a)\nstate S[dk, dv]\nS = S + k⊗(b*v)\n" \
                 "output o = q·S\n"
    located(compile_error(src), src, 4, "a)", "'b' is computed from the per-head parameter 'a'",
            "`param b per head`")

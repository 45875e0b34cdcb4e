"""What the fuzzer (tests/fuzzing.py) found, one test per class of failure, each failing before its fix:
programs `check` accepts that then failed inside linrec, forms `check` listed that `run` refused, and
programs rejected without saying where. Errors are checked for their message and their source location."""
from __future__ import annotations

import warnings

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


# ---- constants ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("default, fragment, words", [
    ("2·1e999", "1e999", ["this number is too large"]),
    ("dk^1000", "dk^1000", ["`dk^1000` overflows", "(at dk = 3)"]),
    ("0.5 + 1/0", "1/0", ["`1/0` divides by zero"]),
    ("(0.1 − dk)^0.5", "(0.1", ["has no real value", "a negative number (-2.9) to a fractional power",
                                "(at dk = 3)"]),
    ("log(dk − 3)", "log", ["the logarithm of zero", "(at dk = 3)"]),
    ("sqrt(−1)", "sqrt", ["the square root of a negative number"]),
    ("exp(1000)", "exp", ["overflows"]),
])
def test_constant_without_a_finite_value_is_a_compile_error(default, fragment, words):
    """Parts of a program built from numbers and sizes alone are folded at compile time: one that has no
    finite real value is an error there (it was an internal error in default_params — ZeroDivisionError,
    OverflowError, `inf` printed as a Python name — or a complex number cast to real)."""
    src = HEAD + f"param p = {default}\nstate S[dk, dv]\nS = p·S + k⊗v\noutput o = q·S\n"
    located(compile_error(src), src, 3, fragment, *words)


def test_constant_in_an_update_and_an_option():
    src = HEAD + "state S[dk, dv]\nS = S + (k/(dk − 3))⊗v\noutput o = q·S\n"
    located(compile_error(src), src, 4, "k/(dk", "`k/(dk − 3)` divides by zero (at dk = 3)")
    src = HEAD + "state S[dk, dv]\nS = S + l2norm(k, eps=1e999)⊗v\noutput o = q·S\n"
    located(compile_error(src), src, 4, "1e999", "option 'eps' must be a finite number")


def test_constant_checked_again_at_the_sizes_of_a_call():
    """A size given at run time can make a constant overflow or divide by zero that did not at the header's
    sizes: a RuntimeInputError at the expression, before any code runs."""
    src = HEAD + "param p = 1/(dk − 4)\nstate S[dk, dv]\nS = p·S + k⊗v\noutput o = q·S\n"
    rec = linrec.compile(src, FILE)
    x = rec.random_inputs(1, 3, 1, dims={"dk": 4})
    with pytest.raises(RuntimeInputError) as info:
        rec.run(x)
    located(info.value, src, 3, "1/(dk", "with this call's sizes, `1/(dk − 4)` divides by zero (at dk = 4)")
    x = rec.random_inputs(1, 3, 1, dims={"dk": 5})
    assert np.all(rec.run(x).params["p"] == 1.0)


def test_an_infinite_product_of_constants_is_printed_as_a_number():
    """The compiler multiplies constant coefficients out (1e200·(1e200·S): a decay of 1e400 = inf); the
    generated NumPy code printed it as `inf`, which is no Python name. Every form now gives what the
    recurrence gives: non-finite states, not an internal error."""
    rec = linrec.compile(HEAD + "state S[dk, dv]\nS = 1e200·(1e200·S) + k⊗v\noutput o = q·S\n", FILE)
    x = rec.random_inputs(1, 4, 1)
    with np.errstate(all="ignore"):
        for result in every_form(rec, x).values():
            assert not np.isfinite(result.final_state["S"]).any()


# ---- nesting -----------------------------------------------------------------------------------------
def nested(matrix: str, depth: int, x: str) -> str:
    """M·(M·(…·(M·x))) with `depth` products."""
    return "·(".join([matrix] * depth) + f"·{x}" + ")" * (depth - 1)


@pytest.mark.parametrize("depth", [2, 5])
def test_nested_products_of_one_matrix_parameter(depth):
    """The C printer reads a matrix param once for two products W·x and W·y (Performer's W·k and W·q); for
    W·(W·k) it took the inner product as the outer one's partner and recursed until the stack ran out (in
    `check`, which asks the C generator whether it takes the program)."""
    rec = linrec.compile(HEAD + "param M[dk, dk] = randn(std=0.5, seed=5)\nstate S[dk, dv]\n"
                         f"S = 0.5·S + ({nested('M', depth, 'k')})⊗v\noutput o = (M·q)·S\n", FILE)
    M = rec.default_params(1)["M"]
    x = rec.random_inputs(1, 6, 1)
    S, o = np.zeros((1, 1, 3, 2)), []
    for t in range(6):
        key = x["k"][:, t]
        for _ in range(depth):
            key = key @ M.T
        S = 0.5 * S + key[..., :, None] * x["v"][:, t, :, None, :]
        o.append(np.einsum("bhi,bhij->bhj", x["q"][:, t] @ M.T, S))
    results = every_form(rec, x)
    assert len(results) == 6
    for result in results.values():
        np.testing.assert_allclose(result.outputs["o"], np.stack(o, axis=1), rtol=1e-11, atol=1e-14)


def test_two_chains_of_products_of_one_matrix_parameter():
    """Two chains M·(M·(…q)) and M·(M·(…k)) in one update: pairing a product of one chain with one of the
    other to read M once, the C printer paired their inner products in turn, down both chains at once, until
    the stack ran out (30 and 6 products). Only products of vectors free of M-products are paired now."""
    rec = linrec.compile(HEAD + "param M[dk, dk] = randn(std=0.3, seed=5)\nstate S[dk, dv]\n"
                         f"S = 0.5·S + ({nested('M', 30, 'q')})⊗v + ({nested('M', 6, 'k')})⊗v\n"
                         "output o = q·S\n", FILE)
    M = rec.default_params(1)["M"]
    x = rec.random_inputs(1, 5, 1)
    S, o = np.zeros((1, 1, 3, 2)), []
    for t in range(5):
        key = x["q"][:, t] @ np.linalg.matrix_power(M, 30).T + x["k"][:, t] @ np.linalg.matrix_power(M, 6).T
        S = 0.5 * S + key[..., :, None] * x["v"][:, t, :, None, :]
        o.append(np.einsum("bhi,bhij->bhj", x["q"][:, t], S))
    results = every_form(rec, x)
    assert len(results) == 6
    for result in results.values():
        np.testing.assert_allclose(result.outputs["o"], np.stack(o, axis=1), rtol=1e-10, atol=1e-16)


def test_an_expression_nested_too_deeply_is_refused_where_it_is():
    """A few hundred levels of nesting exhausted Python's stack in the parser or the analyses (an internal
    error); the limit is now a compile error at the part past it, as written or with values written out."""
    src = HEAD + f"param M[dk, dk] = randn(seed=5)\nstate S[dk, dv]\nS = S + ({nested('M', 400, 'k')})⊗v\n" \
                 "output o = q·S\n"
    err = compile_error(src)
    assert err.span.line == 5 and "nests more than 64 levels deep" in str(err), str(err)
    chain = "".join(f"a{i} = a{i - 1} + k\n" for i in range(1, 300))
    src = HEAD + "a0 = k\n" + chain + "state S[dk, dv]\nS = S + a299⊗v\noutput o = q·S\n"
    located(compile_error(src), src, 3 + 129, "a128 + k", "with its named values and functions written out, "
            "this expression nests 129 levels deep; linrec's analyses take at most 128")


def test_the_deepest_nesting_allowed_runs_everywhere():
    """At the limits — 64 levels as written, 128 with named values written out — every stage (the analyses,
    both code generators, the C compiler) still takes the program."""
    chain = "".join(f"a{i} = a{i - 1} + k\n" for i in range(1, 64))
    rec = linrec.compile(HEAD + f"param M[dk, dk] = randn(std=0.3, seed=5)\nb = {nested('M', 60, 'k')}\n"
                         f"a0 = b + k\n{chain}c = a63 + k\nstate S[dk, dv]\nS = 0.5·S + c⊗v\noutput o = q·S\n",
                         FILE)
    x = rec.random_inputs(1, 4, 1)
    reference = rec.run(x, form="recurrent")
    for result in every_form(rec, x).values():
        np.testing.assert_allclose(result.outputs["o"], reference.outputs["o"], rtol=1e-10, atol=1e-300)
    np.testing.assert_allclose(run_by_steps(rec, x, backend="c").outputs["o"], reference.outputs["o"],
                               rtol=1e-10, atol=1e-300)


# ---- states with nothing to scan ---------------------------------------------------------------------
GATED = "recurrence t(dk = 3, dv = 2)\ninput q[dk], k[dk], v[dv]\ninput g[dk] <= 0\n"


@pytest.mark.parametrize("body", [
    "state z[dk]\nz = z\noutput y = z + q",                                # left as it is, read as a value
    "state S[dk, dv], w[dv]\nS = S + k⊗v\nw = w\noutput o = q·S",          # left as it is, never read
    "state S[dk, dv], z[dk]\nS = diag(exp(g))·S\nz = 0.5*z + k\noutput o = z",  # only decays, never read
    "state S[dk, dv], w[dv]\nS = S + k⊗v\nw = 0.9·w\noutput o = q·S\noutput y = w",  # only decays, read
    "state z[dk]\noutput p = q·z\nz = z\noutput y = z + k",             # left as it is, read both ways
])
def test_states_that_only_decay_or_stay_on_every_form(body):
    """A state that nothing writes — left as it is, or only decaying — and perhaps nothing reads: NumPy's
    scans found no per-token array to count the tokens from (an internal error), C's refused it ("nothing to
    scan"). Every form now gives the recurrence's outputs and final states; the untouched state is S_0 and
    the decaying one diag(exp(Σ g))·S_0 or 0.9^T·w_0."""
    rec = linrec.compile(GATED + body + "\n", FILE)
    x = rec.random_inputs(2, 5, 2)
    rng = np.random.default_rng(0)
    s0 = {s.name: rng.standard_normal((2, 2) + tuple({"dk": 3, "dv": 2}[d] for d in s.shape))
          for s in rec.program.states}
    expected = {"z = z": ("z", s0["z"]) if "z = z" in body else None,  # (the first that applies)
                "w = w": ("w", s0["w"]) if "w = w" in body else None,
                "diag": ("S", np.exp(x["g"].sum(axis=1))[..., None] * s0["S"]) if "diag" in body else None,
                "0.9·w": ("w", 0.9 ** 5 * s0["w"]) if "0.9·w" in body else None}
    name, value = next(e for e in expected.values() if e is not None)
    reference = rec.run(x, form="recurrent", initial_state=s0)
    np.testing.assert_allclose(reference.final_state[name], value, rtol=1e-13)
    results = every_form(rec, x, initial_state=s0)
    assert len(results) == 6
    for result in results.values():
        for group in ("outputs", "final_state"):
            for key, ref in getattr(reference, group).items():
                np.testing.assert_allclose(getattr(result, group)[key], ref, rtol=1e-12, atol=1e-14)


# ---- decays the log-space forms cannot take --------------------------------------------------------
SIGNED = "recurrence t(dk = 3, dv = 2)\ninput q[dk], k[dk], v[dv]\ninput dt in (-2, 3)\ninput a in (0, 1)\n"


@pytest.mark.parametrize("decay, values", [
    ("dt", "(−2, 3)"),
    ("a − 1", "(−1, 0)"),
    ("−exp(p)", "(−∞, 0)"),   # whatever the caller passes for p, a param without a default
])
def test_a_decay_that_can_be_zero_or_negative_takes_its_signs_in_the_log_space_forms(decay, values):
    """The parallel and chunkwise forms take the logarithm of a decay; where the compiler has no symbolic one
    (log(exp(x)) = x), the ranges of what the decay is computed from decide whether it may be negative. check
    listed the forms and run refused them on valid inputs ("the decay of state 'S' is not positive (min
    np.float64(-1.9))", a NumPy repr); then they were refused. A decay of the rows that may be negative now
    takes its signs apart (|decay| has a logarithm): every form equals the recurrent one. An elementwise one is
    still refused, with the reason."""
    rec = linrec.compile(SIGNED + f"param p per head\nstate S[dk, dv]\nS = ({decay})·S + k⊗v\noutput o = q·S\n", FILE)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    assert rec.decomposition.transitions[0].signed
    x = rec.random_inputs(1, 9, 2, seed=3)
    x["dt"] = np.random.default_rng(4).uniform(-2, 3, x["dt"].shape)
    params = {"p": np.array([0.1, -0.2])}
    reference = rec.run(x, form="recurrent", params=params).outputs["o"]
    for form in ("parallel", "chunkwise"):
        for backend in ("numpy", "c"):
            got = rec.run(x, form=form, backend=backend, params=params, chunk_size=4).outputs["o"]
            np.testing.assert_allclose(got, reference, rtol=1e-10, atol=1e-12 * np.abs(reference).max())
    elementwise = linrec.compile(SIGNED + f"param p per head\nstate S[dk, dv]\nS = (({decay})*(k⊗v))*S\n"
                                 f"output o = q·S\n", FILE)
    assert elementwise.forms == ("recurrent",)
    assert "of 'S' can be zero or negative" in elementwise.decomposition.why_not("chunkwise")


@pytest.mark.parametrize("decay", ["(1 + a)/2", "1 − sigmoid(dt)", "sigmoid(dt) + 0.1", "g", "2^(−a)·a",
                                   "(a − 2)^2/4", "(−1 − a)^(−1)·(−1)", "(−a)^4", "dt^2", "0"])
def test_a_decay_the_ranges_keep_positive_keeps_its_forms(decay):
    """…and a decay whose ranges keep it positive keeps them (g: a per-head param 1 − 2^(−5 − h), RetNet's; the
    whole-number powers of a negative range, (a − 2)^2 in (1, 4) and (−1 − a)^(−1) in (−1, −0.5), were taken to
    reach 0 or to be anything — a probe's finding); so does one that may be 0 but is never negative (dt^2, 0:
    a log-decay of −∞ there, which the forms take as a reset; they were refused, a probe's finding)."""
    rec = linrec.compile(SIGNED + "param g per head = 1 − 2^(−5 − h)\n"
                         f"state S[dk, dv]\nS = ({decay})·S + k⊗v\noutput o = q·S\n", FILE)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(2, 9, 2)
    reference = rec.run(x, form="recurrent")
    for result in every_form(rec, x).values():
        np.testing.assert_allclose(result.outputs["o"], reference.outputs["o"], rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("declared, update", [("a in [0, 1]", "S = a·S + k⊗v"),
                                              ("a[dk] in [0, 1]", "S = diag(a)·S + k⊗v"),
                                              ("a in [0, 1], beta in (0, 1)", "S = a·(S − beta·k⊗(k·S)) + beta·k⊗v")])
def test_a_decay_given_as_a_value_that_may_be_zero(declared, update):
    """`input a in [0, 1]` as a decay was refused the parallel and chunkwise forms ("can be zero"), where a
    decay of exactly 0 written exp(g) is a reset (a probe's finding). Its log is −∞ there, which the forms take
    as one: with zeros at some tokens every form on both backends equals the recurrent one, in float64 and
    float32, and every gradient form NumPy's recurrent backward (the statements as written, for a decay of 0)."""
    rec = linrec.compile(f"recurrence z(dk = 4, dv = 3)\ninput q[dk], k[dk], v[dv], {declared}\nstate S[dk, dv]\n"
                         f"{update}\noutput o = q·S\n", FILE)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(2, 13, 2, seed=0)
    x["a"][:, 3] = 0
    x["a"][0, 7] = 0
    reference = rec.run(x, form="recurrent")
    up = {"o": np.random.default_rng(1).standard_normal(reference.outputs["o"].shape)}
    want = rec.vjp(x, up)
    for backend in ("numpy", "c"):
        for form in rec.forms:
            for dtype, tolerance in ((np.float64, 1e-12), (np.float32, 1e-5)):
                got = rec.run({k: v.astype(dtype) for k, v in x.items()}, form=form, backend=backend, chunk_size=4)
                for group in ("outputs", "final_state"):
                    for name, ref in getattr(reference, group).items():
                        assert np.max(np.abs(getattr(got, group)[name] - ref)) <= tolerance * np.max(np.abs(ref))
            grads = rec.vjp(x, up, form=form, backend=backend, chunk_size=4).grads
            for name, ref in want.grads.items():
                np.testing.assert_allclose(grads[name], ref, rtol=1e-9, atol=1e-12, err_msg=f"{form} {backend}")


def test_a_negative_power_of_a_positive_input_as_a_decay():
    """a^(−3) with a > 0: the bounds of a power at the open end 0 are +∞ (math.pow raised a domain error there,
    and check stopped with an internal error — a probe's finding). With a ≥ 1 the decay lies in (0, 1]: every
    form on every backend, and the gradient forms against the recurrent one."""
    rec = linrec.compile("recurrence negpow(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv], a > 0\n"
                         "state S[dk, dv]\nS = a^(−3)·S + k⊗v\noutput o = q·S\n", FILE)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(2, 9, 2, seed=4)
    x["a"] = 1 + np.random.default_rng(4).random(x["a"].shape)
    reference = rec.run(x, form="recurrent")
    for result in every_form(rec, x).values():
        np.testing.assert_allclose(result.outputs["o"], reference.outputs["o"], rtol=1e-11, atol=1e-13)
    up = {"o": np.random.default_rng(5).standard_normal(reference.outputs["o"].shape)}
    want = rec.vjp(x, up)
    for form in rec.forms:
        for backend in ("numpy", "c"):
            got = rec.vjp(x, up, form=form, backend=backend)
            for name, g in want.grads.items():
                np.testing.assert_allclose(got.grads[name], g, rtol=1e-9, atol=1e-11, err_msg=f"{form} {backend} {name}")


@pytest.mark.parametrize("declared, decay", [(" > 0", "a^(−3)"), (" in (0, 1)", "a^(−0.5)"), ("", "softplus(a)^(−1)"),
                                             (" > 0", "abs(a)^(−1)"), (" > 0", "tanh(a)^(−2)"),
                                             (" in (−1e300, 0)", "a^2")])
def test_the_bounds_of_powers_at_zero_and_past_the_largest_float(declared, decay):
    """Powers whose bounds meet 0^(negative) or pass the largest float stopped check with an internal error
    (math.pow's domain and overflow errors, a probe's finding): they compile, and a decay positive by its
    bounds keeps its log-space forms."""
    rec = linrec.compile(f"recurrence f(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv], a{declared}\nstate S[dk, dv]\n"
                         f"S = ({decay})·S + k⊗v\noutput o = q·S\n", FILE)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")


def test_an_odd_power_past_the_largest_float_keeps_its_sign():
    """a^3 for a in (−1e300, 1e300): (−1e300)^3 overflows, and the bound took the overflow for +∞ — a decay in
    [∞, ∞), 'positive', listed with log-space forms that took its log. It can be negative: its forms take
    its signs apart."""
    rec = linrec.compile("recurrence f(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv], a in (−1e300, 1e300)\n"
                         "state S[dk, dv]\nS = (a^3)·S + k⊗v\noutput o = q·S\n", FILE)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    assert rec.decomposition.transitions[0].signed  # (taken positive, its log would be NaN where a < 0)


@pytest.mark.parametrize("update, kind", [("S = S − S + k⊗v", "a decay of 0"), ("S = 0.5·S + 0.5·S + k⊗v", "identity"),
                                          ("S = S − S + exp(X)*S + k⊗v", "elementwise decay")])
def test_constant_terms_of_a_state_that_cancel_or_add_up_are_folded(update, kind):
    """S − S is no term of S (a decay of 0, and none beside an elementwise decay), and 0.5·S + 0.5·S is S: `1 − 1`
    was a constant decay to take the log of, and beside exp(X)*S a scalar decay the forms do not take with it.
    Every form gives the recurrent form's outputs. (a·S − a·S is not folded: an infinite a makes it NaN as
    written, which the recurrent form computes and the others must give too — a probe's finding.)"""
    rec = linrec.compile(HEAD + f"input a in (0, 1), X[dk, dv] <= 0\nstate S[dk, dv]\n{update}\noutput o = q·S\n",
                         FILE)
    assert rec.decomposition.transitions[0].kind == kind
    x = rec.random_inputs(2, 9, 2, seed=1)
    s0 = {"S": np.random.default_rng(2).standard_normal((2, 2) + x["k"].shape[-1:] + x["v"].shape[-1:])}
    reference = rec.run(x, initial_state=s0, form="recurrent", backend="numpy").outputs["o"]
    results = every_form(rec, x, initial_state=s0)
    assert len(results) == 6
    for result in results.values():
        np.testing.assert_allclose(result.outputs["o"], reference, rtol=1e-10, atol=1e-12)


def test_an_input_taken_away_again_is_not_folded():
    """a·S − a·S + k⊗v with a = ∞ at a token is NaN from there on as written; folded to a decay of 0, the derived
    forms and C gave finite values (a probe's finding). It is the decay a − a, which the bounds take to be of
    either sign (each a on its own): every form and backend gives the NaN."""
    rec = linrec.compile(HEAD + "input a > 0\nstate S[dk, dv]\nS = a·S − a·S + k⊗v\noutput o = q·S\n", FILE)
    assert rec.decomposition.transitions[0].signed
    x = rec.random_inputs(1, 4, 1, seed=1)
    x["a"][0, 1, 0] = np.inf
    s0 = {"S": np.ones((1, 1) + x["k"].shape[-1:] + x["v"].shape[-1:])}
    for backend in ("numpy", "c"):
        for form in rec.forms:
            with warnings.catch_warnings():  # (NumPy's ∞ − ∞, said with its place in the program: wanted here)
                warnings.simplefilter("ignore", RuntimeWarning)
                o = rec.run(x, backend=backend, form=form, initial_state=s0).outputs["o"]
            assert np.isfinite(o[:, 0]).all() and np.isnan(o[:, 1:]).all(), (backend, form)


@pytest.mark.parametrize("update, reference_update", [
    ("S = k⊗(p·S) + k⊗v", "S = exp(g)·S + k⊗(p·S) + k⊗v"),
    ("S = k⊗v", "S = exp(g)·S + k⊗v"),
    ("S = −k⊗(k·S) + 2·k⊗v", "S = exp(g)·S − k⊗(k·S) + 2·k⊗v"),
    # (value-side terms only: a probe's finding — left as no decay, read as the identity, the forms ran
    # S·(I − a⊗b) for −(S·a)⊗b, off by 700)
    ("S = −0.5·(S·v)⊗v + k⊗v", "S = exp(g)·S − 0.5·(S·v)⊗v + k⊗v"),
    ("S = 0.5·S\nS = S·(v⊗v) + k⊗v", "S = exp(g)·S + 0.5·S·(v⊗v) + k⊗v"),
])
def test_a_state_with_no_term_of_itself_has_every_form(update, reference_update):
    """An update with no term of S itself — a decay of 0, S carried over by a correction alone, or holding this
    token's write only (Mamba-3's previous write) — was refused the parallel and chunkwise forms, where the same
    update written `0·S + …` had them: its log-decay is −∞ at every token, which the forms take as a reset.
    Every form, backend and initial state gives what the update written with a decay input of −∞ gives."""
    rec = linrec.compile(HEAD + f"input p[dk]\nstate S[dk, dv]\n{update}\noutput o = q·S\n", FILE)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    assert "a decay of 0" in rec.decomposition.transitions[0].kind
    x = rec.random_inputs(2, 11, 2, seed=2)
    s0 = {"S": np.random.default_rng(3).standard_normal((2, 2) + x["k"].shape[-1:] + x["v"].shape[-1:])}
    written = linrec.compile(HEAD + f"input p[dk], g <= 0\nstate S[dk, dv]\n{reference_update}\noutput o = q·S\n",
                             FILE)
    reference = written.run(dict(x, g=np.full(x["k"].shape[:3], -np.inf)), initial_state=s0)
    results = every_form(rec, x, initial_state=s0)
    assert len(results) == 6
    for result in results.values():
        np.testing.assert_allclose(result.outputs["o"], reference.outputs["o"], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(result.final_state["S"], reference.final_state["S"], rtol=1e-10, atol=1e-12)
    upstream = {"o": np.random.default_rng(4).standard_normal(reference.outputs["o"].shape)}
    want = rec.vjp(x, upstream, initial_state=s0, form="recurrent", backend="numpy").grads
    for form in rec.forms:
        for backend in ("numpy", "c"):
            got = rec.vjp(x, upstream, initial_state=s0, form=form, backend=backend).grads
            for name, ref in want.items():
                scale = max(np.max(np.abs(ref)), 1e-300)
                assert np.max(np.abs(got[name] - ref)) <= 1e-9 * scale, (form, backend, name)


# ---- programs that read the sequence -----------------------------------------------------------------
def test_errors_of_programs_that_read_the_sequence_say_where():
    """Three refusals of programs that read the sequence had no place in the program (`fuzz.lin: error: …`):
    now each points at what is in the way."""
    src = HEAD + "state S[dk, dv]\nS = S + k⊗v\noutput o = q·S + softmax(seq(k)·q)·seq(v)\n"
    located(compile_error(src), src, 5, "seq(k)", "a program with states (S) cannot also read the sequence")
    src = HEAD + "output o = softmax(seq(k, window=2)·q)·seq(v, window=3)\n"
    located(compile_error(src), src, 3, "seq(v", "every seq(…) of a program must use the same window (found [2, 3])")
    src = "recurrence t(dk = 3, dv = 2, m = 4, T = 8)\ninput q[dk], k[dk], v[dv]\nparam E[m, T] = randn(seed=0)\n" \
          "output o = softmax((E·seq(k))·q)·(E·seq(v))\n"
    located(compile_error(src), src, 3, "E", "parameter(s) E span the sequence axis 'T'", "`noncausal`")


@pytest.mark.parametrize("other, c_builds", [("(seq(k)·q)·seq(2*v)", False), ("softmax(seq(k)·q)·seq(v)", True)])
def test_lsh_attention_beside_another_read_of_the_sequence(other, c_builds):
    """The C glue of a program with lsh_attention took any other read of the sequence as supported and
    printed `vecmat(matvec(, q), )` (a SyntaxError); it is now listed on C only when the kernels take it
    (softmax(K·q)·V), and then agrees with NumPy."""
    rec = linrec.compile("recurrence t(dk = 4, dv = 2) noncausal\ninput q[dk], k[dk], v[dv]\n"
                         f"output o = {other}\noutput r = lsh_attention(q, v, buckets=2, rounds=1, chunk=4, seed=0)\n",
                         FILE)
    assert ("c" in registry.building(rec.compiled, "parallel")) is c_builds
    if not c_builds:
        assert "outside softmax(K·q)·V" in str(registry.refusal(rec.compiled, "c", "parallel"))
    x = rec.random_inputs(1, 10, 2)
    results = every_form(rec, x)
    assert len(results) == (4 if c_builds else 2)
    for (form, _), result in results.items():
        same = results[form, "numpy"]
        for name in ("o", "r"):
            np.testing.assert_allclose(result.outputs[name], same.outputs[name], rtol=1e-12, atol=1e-14)


# ---- form="auto" -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [8, 100])
def test_auto_chooses_among_the_forms_the_backend_builds(tokens):
    """form="auto" on C picked the recurrent form, which C does not build for this program (exponential
    keys, stabilized in the fused kernel only, and a state carried transposed, which the fused kernel does
    not take), though check listed C's parallel and chunkwise forms."""
    rec = linrec.compile(HEAD + "state R[dv, dk]\nR = R + v⊗exp(k)\noutput o = R·exp(q)\n",
                         FILE)
    assert registry.building(rec.compiled, "recurrent") == ["numpy"]
    assert registry.building(rec.compiled, "chunkwise") == ["numpy", "c"]
    form, why = rec.choose_form("c", tokens)
    assert form == "chunkwise" and "builds no recurrent form" in why
    x = rec.random_inputs(1, tokens, 2)
    np.testing.assert_allclose(rec.run(x, backend="c").outputs["o"], rec.run(x, form="recurrent").outputs["o"],
                               rtol=1e-10)


# ---- sizes, thread counts, options -------------------------------------------------------------------
def gla():
    return linrec.compile("recurrence gla(dk = 4, dv = 3)\ninput q[dk], k[dk], v[dv]\ninput g[dk] <= 0\n"
                          "state S[dk, dv]\nS = diag(exp(g))·S + k⊗v\noutput o = dk^(−1/2)·q·S\n", FILE)


@pytest.mark.parametrize("size", [16.0, "16", 0, -2, True])
def test_a_size_asked_for_must_be_a_whole_number(size):
    """dims={"dk": 16.0} failed inside NumPy's shape arithmetic ('float' object cannot be interpreted as an
    integer), dims={"dk": "16"} said `dk = 16 was asked for, but the inputs have dk = 16`."""
    rec = gla()
    message = f"dimension dk must be a whole number ≥ 1 (an int), got {size!r}"
    with pytest.raises(RuntimeInputError) as info:
        rec.random_inputs(1, 4, 1, dims={"dk": size})
    assert str(info.value) == f"error: {message}"
    x = rec.random_inputs(1, 4, 1, dims={"dk": 16})
    for backend in ("numpy", "c"):
        with pytest.raises(RuntimeInputError, match="must be a whole number"):
            rec.run(x, dims={"dk": size}, backend=backend)
    with pytest.raises(RuntimeInputError, match="must be a whole number"):
        rec.default_params(2, dims={"dk": size})
    assert rec.run(x, dims={"dk": np.int64(16)}).outputs["o"].shape == (1, 4, 1, 3)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_size_of_zero_from_the_arrays_is_refused(backend):
    """An input with an axis of size 0 gave `dk^(−1/2)` a zero to divide by, or C's recurrent kernel a
    ZeroDivisionError in its blocking (dv = 0); every size must be at least 1, like B, T and H."""
    rec = gla()
    x = rec.random_inputs(1, 4, 1)
    empty = dict(x, v=x["v"][..., :0])
    with pytest.raises(RuntimeInputError) as info:
        rec.run(empty, backend=backend)
    assert str(info.value) == "error: input 'v' (expected [B, T, H, dv]) has shape [1, 4, 1, 0] with dv = 0; " \
                              "every size must be at least 1"
    with pytest.raises(RuntimeInputError, match="initial state 'S' has dv = 0; every size must be at least 1"):
        rec.run({k: v for k, v in x.items()}, initial_state={"S": np.zeros((1, 1, 4, 0))}, backend=backend)


def test_an_absurd_thread_count_is_taken_as_the_most_the_kernels_use(monkeypatch):
    """LINREC_NUM_THREADS=99999999999 (or threads=) overflowed the kernels' C int (OverflowError); counts
    past MAX_THREADS are taken as MAX_THREADS (the kernels use at most one per batch row and head)."""
    from linrec.c import build as c_build
    rec = gla()
    x = rec.random_inputs(2, 9, 2)
    reference = rec.run(x, form="recurrent")
    monkeypatch.setenv("LINREC_NUM_THREADS", "99999999999")
    assert c_build.num_threads() == c_build.MAX_THREADS == 1024
    for form in rec.forms:
        np.testing.assert_allclose(rec.run(x, form=form, backend="c").outputs["o"], reference.outputs["o"],
                                   rtol=1e-12)
    monkeypatch.delenv("LINREC_NUM_THREADS")
    np.testing.assert_allclose(rec.run(x, backend="c", threads=10 ** 12).outputs["o"], reference.outputs["o"],
                               rtol=1e-12)


@pytest.mark.parametrize("output", ["softmax(seq(k, window=1e30)·q)·seq(v, window=1e30)",
                                    "softmax(seq(k, window=2147483648)·q)·seq(v, window=2147483648)",
                                    "lsh_attention(q, v, chunk=1e12)"])
def test_a_count_in_an_option_fits_the_kernels(output):
    """seq(k, window=1e30) passed check and overflowed the C kernels' integers (OverflowError)."""
    src = HEAD + f"output o = {output}\n"
    located(compile_error(src), src, 3, "seq(k" if "seq" in output else "lsh", "up to 2147483647")


# ---- exponential feature maps ------------------------------------------------------------------------
def test_exponential_keys_and_queries_with_a_scalar_factor_that_varies():
    """Keys c·exp(α) are stabilized (carried as S·exp(−M)); with c a scalar that varies per token or head
    and α a vector, the NumPy glue multiplied [B, T, H] (or [H]) by [B, T, H, dk] without a new axis (an
    internal error in every NumPy form and C's scans)."""
    rec = linrec.compile(HEAD + "input a\nparam s per head = uniform(0.5, 1, seed=1)\nstate S[dk, dv], z[dk]\n"
                         "S = S + (sigmoid(a)·exp(k))⊗v\nz = sigmoid(a)·z + (1 − sigmoid(a))·exp(k)\n"
                         "output o = ((s·exp(q))·S) / ((s·exp(q))·z)\noutput y = z*sigmoid(k)\n", FILE)
    x = rec.random_inputs(2, 9, 2)
    s = rec.default_params(2)["s"]
    sig = 1 / (1 + np.exp(-x["a"]))
    S, z, o, y = np.zeros((2, 2, 3, 2)), np.zeros((2, 2, 3)), [], []
    for t in range(9):
        key = sig[:, t, :, None] * np.exp(x["k"][:, t])
        S = S + key[..., :, None] * x["v"][:, t, :, None, :]
        z = sig[:, t, :, None] * z + (1 - sig[:, t, :, None]) * np.exp(x["k"][:, t])
        query = s[:, None] * np.exp(x["q"][:, t])
        o.append(np.einsum("bhi,bhij->bhj", query, S) / np.einsum("bhi,bhi->bh", query, z)[..., None])
        y.append(z / (1 + np.exp(-x["k"][:, t])))
    results = every_form(rec, x)
    assert len(results) == 6
    for result in results.values():
        np.testing.assert_allclose(result.outputs["o"], np.stack(o, axis=1), rtol=1e-11)
        np.testing.assert_allclose(result.outputs["y"], np.stack(y, axis=1), rtol=1e-11)
        np.testing.assert_allclose(result.final_state["z"], z, rtol=1e-11)


def test_a_range_with_an_infinite_end_is_a_compile_error():
    """`input dt > 1e999` declared a range no value lies in: every call was refused ("must lie in (inf, inf)")."""
    src = HEAD + "input dt > 1e999\nstate S[dk, dv]\nS = exp(−dt)·S + k⊗v\noutput o = q·S\n"
    located(compile_error(src), src, 3, "1e999", "this number is too large")
    src = HEAD + "input dt in (0, 1e999)\nstate S[dk, dv]\nS = exp(−dt)·S + k⊗v\noutput o = q·S\n"
    located(compile_error(src), src, 3, "1e999", "this number is too large")


# ---- precision ---------------------------------------------------------------------------------------
def test_a_readout_before_the_update_under_very_strong_decays():
    """The scans took b_(t−1) as b_t − l_t, which misses the prefix sum b_(t−1) by the rounding of b_t: with
    log-decays of −1e6 per token (A = −exp(16)), a readout of S_(t−1) came out 1e-9 off, past verify's
    tolerance. b_(t−1) is the previous prefix sum itself now: the forms agree to rounding."""
    rec = linrec.compile("recurrence m(dk = 4, dv = 3)\ninput x[dv], B[dk], C[dk]\ninput dt > 0\n"
                         "param A per head = −exp(16)\nstate S[dk, dv]\noutput y = C·S\nS = exp(dt·A)·S + (dt·B)⊗x\n",
                         FILE)
    x = rec.random_inputs(1, 12, 2)
    s0 = {"S": np.random.default_rng(0).standard_normal((1, 2, 4, 3))}
    reference = rec.run(x, form="recurrent", initial_state=s0).outputs["y"]
    for (form, backend), result in every_form(rec, x, initial_state=s0, chunk_size=5).items():
        error = np.abs(result.outputs["y"] - reference).max() / np.abs(reference).max()
        assert error < 1e-14, (form, backend, error)


def test_a_param_default_that_is_not_finite_is_refused_at_its_declaration():
    """A default computed from random draws can overflow (A = −exp(exp(uniform(1, 16)))): the recurrent form
    ran with A = −inf (a decay of 0) and the log-space forms gave NaN. Defaults are computed per call (they
    depend on H and the sizes), so the call is refused, at the param's declaration; given values are used."""
    src = "recurrence m(dk = 4, dv = 3)\ninput x[dv], B[dk], C[dk]\ninput dt > 0\n" \
          "param A_log per head = exp(uniform(1, 16, seed=0))\nparam A per head = −exp(A_log)\nstate S[dk, dv]\n" \
          "S = exp(dt·A)·S + (dt·B)⊗x\noutput y = C·S\n"
    rec = linrec.compile(src, FILE)
    x = rec.random_inputs(1, 6, 2)
    for form in rec.forms:
        with pytest.raises(RuntimeInputError) as info:
            rec.run(x, form=form)
        located(info.value, src, 5, "A per head", "the default of 'A' is not finite (-inf at index [0], with 2 "
                "head(s)): its definition overflows or divides by zero there; pass 'A' or change its definition")
    given = {"A": np.array([-1.0, -2.0])}
    reference = rec.run(x, form="recurrent", params=given).outputs["y"]
    np.testing.assert_allclose(rec.run(x, form="chunkwise", params=given).outputs["y"], reference, rtol=1e-12)


@pytest.mark.parametrize("argument", ["dv", "2", "p"])
def test_seq_of_a_value_that_does_not_change_per_token(argument):
    """seq(dv) — a mutation of softmax.lin — passed check and failed in the generated code (a size has no
    token axis to swap); seq(…) and lsh_attention read per-token values, a compile error at the argument."""
    src = HEAD + f"param p per head = 0.5\noutput o = softmax(seq(k)·q)·seq({argument})\n"
    located(compile_error(src), src, 4, f"{argument})", "reads values that change from token to token",
            f"`{argument}` is the same at every position")


def test_flash_attention_backward_of_seq_of_an_expression_that_is_also_a_named_value():
    """seq(l2norm(k)) beside kn = l2norm(k): the chunkwise (flash) backward refolded the keys to seq(kn) but
    looked their seq(…) up by l2norm(k) — StopIteration, then a KeyError. Its gradient agrees with the
    recurrent backward now."""
    rec = linrec.compile("recurrence a(dk = 4, dv = 2)\ninput q[dk], k[dk], v[dv]\nkn = l2norm(k)\n"
                         "output o = softmax(seq(l2norm(k), window=2)·q)·seq(2*v, window=2)\n", FILE)
    x = rec.random_inputs(2, 9, 2, dtype=np.float64, seed=1)
    upstream = {"o": np.random.default_rng(2).standard_normal((2, 9, 2, 2))}
    reference = rec.vjp(x, upstream, form="recurrent").grads
    for chunk in (None, 4):
        grads = rec.vjp(x, upstream, form="chunkwise", chunk_size=chunk).grads
        for name, value in reference.items():
            assert np.abs(grads[name] - value).max() <= 1e-12 * np.abs(value).max(), (name, chunk)


def test_every_gradient_form_gives_an_unused_params_gradient():
    """A staged program (S reads A's stage) with a param it never reads: the recurrent backward gave the param
    a zero gradient, the parallel and chunkwise ones left it out of `grads`. Every form gives every input,
    param and initial state its gradient now — the unused param's is zero."""
    rec = linrec.compile("recurrence p(dk = 3, dv = 2)\ninput q[dk], k[dk], v[dv]\ninput gA[dk] <= 0\n"
                         "state A[dk]\nA = exp(gA)*A + k*k\nkp = l2norm(k*A)\nstate S[dk, dv]\n"
                         "S = 0.9·S + kp⊗v\noutput o = q·S\nparam P per head = 0.5\n", FILE)
    x = rec.random_inputs(1, 7, 2, dtype=np.float64, seed=3)
    upstream = {"o": np.random.default_rng(4).standard_normal((1, 7, 2, 2))}
    reference = rec.vjp(x, upstream, form="recurrent").grads
    assert set(reference) == {"q", "k", "v", "gA", "A", "S", "P"}
    assert np.all(reference["P"] == 0) and reference["P"].shape == (2,)
    for form in ("parallel", "chunkwise"):
        grads = rec.vjp(x, upstream, form=form).grads
        assert set(grads) == set(reference), form
        for name, value in reference.items():
            assert np.abs(grads[name] - value).max() <= 1e-9 * max(np.abs(value).max(), 1e-300), (form, name)


def test_c_recurrent_scan_of_a_noncausal_value_side_decay():
    """A non-causal program with an exponential feature map (its recurrent form a stabilized scan) and a
    value-side decay S·diag(sigmoid(v)): C's recurrent_scan took no value_log_decay — a TypeError from the
    generated module. It takes NumPy's arguments now and agrees with NumPy's recurrent form."""
    rec = linrec.compile("recurrence n(dk = 3, dv = 2) noncausal\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                         "S = S·diag(sigmoid(v)) + exp(k)⊗v\noutput o = (q·S)*sigmoid(v)\n", FILE)
    if "c" not in registry.building(rec.compiled, "recurrent"):
        pytest.skip("no C compiler")
    x = rec.random_inputs(1, 7, 2, dtype=np.float64, seed=5)
    reference = rec.run(x, form="recurrent").outputs["o"]
    got = rec.run(x, form="recurrent", backend="c").outputs["o"]
    assert np.abs(got - reference).max() <= 1e-9 * np.abs(reference).max()


def test_programs_that_blow_up_when_written_out_are_refused_or_degrade_quickly():
    """Found by probing: a value used twice in each of a chain of named values (x2 = x1 + x1, …) or of nested
    calls of a function that uses its argument twice doubles at every link once written out — 24 links took
    minutes; 400 aliases in a row and 300 functions calling each other exhausted Python's stack (an internal
    RecursionError); and 18 assignment steps of the delta rule multiplied out into 2¹⁸ terms (minutes in the
    analyses). Now each is a located compile error, or (the steps) a program whose derived forms are refused
    with the reason and whose recurrent form runs. (No clock here: the bounds are what the messages name, and a
    return of the blow-up would be minutes, which CI's time limit shows.)"""
    doubling = "".join(f"x{i} = x{i - 1} + x{i - 1}\n" for i in range(1, 25))
    src = HEAD + "x0 = k\n" + doubling + "state S[dk, dv]\nS = S + x24⊗v\noutput o = q·S\n"
    err = compile_error(src)
    assert "this expression holds" in str(err) and "operations" in str(err) and err.span.line < 3 + 25
    src = HEAD + "f(x) = x + x\nstate S[dk, dv]\nS = S + k⊗v\noutput o = " + "f(" * 20 + "q" + ")" * 20 + "·S\n"
    assert "this expression holds" in str(compile_error(src))
    aliases = "".join(f"x{i} = x{i - 1}\n" for i in range(1, 401))
    src = HEAD + "x0 = k\n" + aliases + "state S[dk, dv]\nS = S + x400⊗v\noutput o = q·S\n"
    assert "nests 129 levels deep" in str(compile_error(src))
    calls = "".join(f"f{i}(x) = f{i - 1}(x) + x\n" for i in range(1, 301))
    src = HEAD + "f0(x) = x\n" + calls + "state S[dk, dv]\nS = S + f300(k)⊗v\noutput o = q·S\n"
    assert "functions call each other 129 deep" in str(compile_error(src))
    steps = "S = (I − 0.1·k⊗k)·S + k⊗v\n" * 18
    rec = linrec.compile(HEAD + "state S[dk, dv]\n" + steps + "output o = q·S\n", FILE)
    assert rec.forms == ("recurrent",) and "more than 256 terms" in rec.decomposition.why_not("chunkwise")
    x = rec.random_inputs(1, 3, 1, seed=0)
    assert np.all(np.isfinite(rec.run(x).outputs["o"]))


def test_a_sum_of_a_matrix_states_read_is_computed_from_the_read():
    """`sum(kg·S)` of a matrix state (an output) is computed from the readout kg·S, as before sum was taken as
    linear: taken as a readout by the vector of ones, its query was no array NumPy's derived forms could contract
    (an internal error: einsum's subscripts, found by the fuzzer). Every form against the recurrent one."""
    rec = linrec.compile("recurrence t(dk = 3, dv = 1)\ninput q[dk], k[dk], v[dv], dt in (-1, 0)\n"
                         "kg = k*sigmoid(q)\nkn = k/norm(k)\nstate S[dk, dv]\n"
                         "S = S − dt·kn⊗(kn·S) + sigmoid(q)⊗v\noutput o = sum(kg·S)\nS = S·diag(sigmoid(v))\n"
                         "output p = tanh(dk^(−1/2)·k·S)\n", FILE)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(batch=1, tokens=9, heads=2, seed=1)
    want = rec.run(x)
    for form in ("parallel", "chunkwise"):
        got = rec.run(x, form=form, chunk_size=4)
        for name in ("o", "p"):
            assert np.abs(got.outputs[name] - want.outputs[name]).max() <= 1e-9 * np.abs(want.outputs[name]).max()


def test_an_overflowing_delta_rule_runs_every_form():
    """A decay of 2^1001 per token beside a delta-rule correction (fuzzer, seed 11): the state overflows at once,
    and NumPy's chunkwise form raised LinAlgError ('Singular matrix', an internal error) — LAPACK's LU on the
    UT transform's block of ∞ and NaN, which with its unit diagonal is never singular. It runs now: such a program
    is not compared (forms.md: an expanding transition), but it must run. The substitution that takes over is
    checked against the solve on a finite system."""
    from linrec.numpy.scan import _substituted
    rng = np.random.default_rng(0)
    m = np.tril(0.1 * rng.standard_normal((3, 70, 70)), -1) + np.eye(70)
    rhs = rng.standard_normal((3, 70, 4))
    assert np.abs(_substituted(m, rhs) - np.linalg.solve(m, rhs)).max() < 1e-12
    rec = linrec.compile("recurrence fz465(dk = 2, dv = 2)\ninput q[dk], k[dk], v[dv]\ninput dt > 0\n"
                         "param p1[dk] per head = 2*dk^1000\nstate S[dk, dv]\n"
                         "S = (I − dt·k⊗k)·(diag(p1)·S) + dt·k⊗v\noutput o = (k·S)*sigmoid(v)\n", FILE)
    x = rec.random_inputs(2, 12, 2, seed=0)
    with np.errstate(all="ignore"):
        for form in rec.forms:
            for chunk in (None, 5):
                assert rec.run(x, form=form, chunk_size=chunk).outputs["o"].shape == (2, 12, 2, 2)


def test_a_groupnorm_of_one_value_is_zero_on_c():
    """groupnorm over one value (or equal ones) is 0 — x − mean(x) — where C gave 1e-13 in float64 and up to
    1e-4 in float32 (fuzzer, seed 85): the value a product, GCC made x − mean one multiply-add of the unrounded
    product, whose difference from the mean of the rounded one is the product's rounding, divided by √eps.
    Every form and the decode step against NumPy's exact zeros, in both dtypes."""
    rec = linrec.compile("recurrence t(dk = 3, dv = 1)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                         "S = 0.5·S + k⊗v\noutput o = groupnorm((q·S)*sigmoid(v))\n", FILE)
    for dtype in (np.float64, np.float32):
        x = rec.random_inputs(batch=2, tokens=20, heads=2, seed=3, dtype=dtype)
        assert not rec.run(x, form="recurrent", backend="numpy").outputs["o"].any()
        for form in rec.forms:
            assert not rec.run(x, form=form, backend="c").outputs["o"].any(), (form, dtype)
        steps = run_by_steps(rec, x, backend="c")
        assert not steps.outputs["o"].any(), dtype


def test_verify_takes_a_state_decayed_below_float32s_range_as_zero(tmp_path, capsys):
    """A state halved every token is 1e-60 after 200 tokens in the float64 reference and 0 in float32, which
    resolves nothing below its smallest normal number (1.2e-38): verify's float32 rows failed it as a relative
    error of 1 (fuzzer, seed 85). Their errors now scale from that floor over the tolerance; an error above it
    still fails."""
    from linrec import verify
    from linrec.cli import main
    path = tmp_path / "halved.lin"
    path.write_text("recurrence halved(dk = 2, dv = 2)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv], z[dk]\n"
                    "S = 0.9·S + k⊗v\nz = 0.5·z\noutput o = q·S + z·q\n")
    assert main(["verify", str(path), "--backend", "c", "--dtype", "float32", "--form", "recurrent"]) == 0
    assert "0 failed" in capsys.readouterr().out
    floor = verify.underflow_floor("float32", verify.TOLERANCE["float32"])
    ref = np.array([1e-60, 0.0])
    assert verify.difference(np.zeros(2, np.float32), ref, floor)[1] <= verify.TOLERANCE["float32"]
    assert verify.difference(np.array([1e-33, 0.0], np.float32), ref, floor)[1] > verify.TOLERANCE["float32"]

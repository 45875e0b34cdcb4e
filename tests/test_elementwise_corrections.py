"""An elementwise decay beside a rank-one correction (issue 22, item 4): `exp(X)*S + β·k⊗(v − k·S)`.

A key-side correction u⊗(w·S) acts on each column of S apart, and column c decays by X[:, c]: one
triangular system per column per chunk (linrec.numpy.scan._elementwise); a value-side one (S·a)⊗b on
each row apart. These tests check, from the structure alone:

- the compiler takes a correction of one side beside an elementwise decay, on the state as it was or (on
  the key side) on the decayed state, and refuses, with a reason, corrections on both sides, a correction
  between two factors, a contraction of the decayed state and a value-side correction under a factor;
- NumPy's parallel and chunkwise forms agree with the recurrent form at 1e-9 (float64, relative to the
  largest magnitude) over ragged T, chunk sizes that cut the 16-token sub-blocks, log-decays down to −40
  per token, resets (log-decay −∞) and random initial states, for the key-side program, two gated
  variants (a scalar decay on the state alone, or on the whole update), several corrections, the
  value-side twin, and the correction written on the decayed state (`(I − β·k⊗k)·(exp(X)*S)`: a w per
  column) or decayed with it (`exp(X)*((I − β·k⊗k)·S)`: a u per column, which C refuses);
- the key-side program against a loop written here from the math;
- C's forms (the row-decay scan kernel with one column per head for the pseudo-values, then the
  elementwise kernel) agree with the recurrent form at 1e-9 too, resets included.
"""
from __future__ import annotations

import numpy as np
import pytest

import linrec
from compare import rel_err

TOL = 1e-9
DIMS = {"dk": 5, "dv": 4}

HEAD = """recurrence {name}(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], p[dk], beta in (0, 1)
input X[dk, dv] <= 0
input g <= 0
kn = l2norm(k)
pn = l2norm(p)
vn = l2norm(v)
state S[dk, dv]
{update}
output o = q·S
"""

PROGRAMS = {
    # the delta rule with a decay per element, the correction on the state as it was
    "key_side": "S = exp(X)*S + beta·kn⊗(v − kn·S)",
    # a scalar gate on the state alone (joins the elementwise log-decay) …
    "gated_state": "S = exp(g)*(exp(X)*S) + beta·kn⊗(v − kn·S)",
    # … or on the whole update (it scales the correction and the write too), read before the update as well
    "gated_update": "early = q·S\nS = exp(g)*(exp(X)*S + beta·kn⊗(v − kn·S))\noutput e = early",
    # two corrections and two writes
    "two_corrections": "S = exp(X)*S − beta·kn⊗(kn·S) − 0.5·beta·pn⊗(pn·S) + beta·kn⊗v + pn⊗vn",
    # the value-side twin: Oja's rule with a decay per element
    "value_side": "S = exp(X)*S + beta·(k − S·vn)⊗vn",
    # the correction on the decayed state: column c reads (kn⊙exp(X[:, c]))·S[:, c] …
    "after": "S = (I − beta·kn⊗kn)·(exp(X)*S) + beta·kn⊗v",
    "gated_after": "S = exp(g)*((I − beta·kn⊗kn)·(exp(X)*S)) + beta·kn⊗v",
    # … or decayed with the state: column c writes (kn⊙exp(X[:, c]))·p[c]
    "before": "S = exp(X)*((I − beta·kn⊗kn)·S) + beta·kn⊗v",
    # … or both: a u and a w per column
    "sandwich": "S = exp(X)*((I − beta·kn⊗kn)·(exp(X)*S)) + beta·kn⊗v",
}


def program(name: str) -> linrec.Recurrence:
    return linrec.compile(HEAD.format(name=name, update=PROGRAMS[name]), f"{name}.lin")


@pytest.fixture(scope="module")
def recs() -> dict[str, linrec.Recurrence]:
    return {name: program(name) for name in PROGRAMS}


def inputs(rec, batch: int, tokens: int, heads: int, seed: int, strongest: float = -40.0, resets: int = 2):
    """Normal vectors; beta in (0.05, 0.95); log-decays X uniform in [strongest, 0] per element, and in
    `resets` random (token, element) places −∞ (a decay of 0); g in [−1, 0]; a random initial state."""
    rng = np.random.default_rng(seed)
    x = {}
    for inp in rec.program.inputs:
        shape = (batch, tokens, heads) + tuple(DIMS[d] for d in inp.shape)
        x[inp.name] = rng.uniform(strongest, 0.0, shape) if inp.name == "X" else \
            rng.uniform(0.05, 0.95, shape) if inp.name == "beta" else \
            rng.uniform(-1.0, 0.0, shape) if inp.name == "g" else rng.standard_normal(shape)
    for _ in range(resets):
        b, t, h, i, c = (rng.integers(n) for n in x["X"].shape)
        x["X"][b, t, h, i, c] = -np.inf
    s0 = {"S": rng.standard_normal((batch, heads, DIMS["dk"], DIMS["dv"]))}
    return x, s0


def assert_forms_agree(rec, x, s0, chunk_sizes):
    want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
    for form, chunks in (("parallel", (None,)), ("chunkwise", chunk_sizes)):
        for chunk in chunks:
            got = rec.run(x, form=form, initial_state=s0, dims=DIMS, chunk_size=chunk)
            for name in want.outputs:
                err = rel_err(got.outputs[name], want.outputs[name])
                assert err <= TOL, f"{form} (chunk {chunk}) output {name}: relative error {err:.2e}"
            err = rel_err(got.final_state["S"], want.final_state["S"])
            assert err <= TOL, f"{form} (chunk {chunk}) final state: relative error {err:.2e}"


# ---- the compiler ------------------------------------------------------------------------------------------
def test_a_correction_of_one_side_beside_an_elementwise_decay_has_every_form(recs):
    for name, rec in recs.items():
        t = rec.decomposition.transition("S")
        assert t.elementwise and t.log_decay.shape == ("dk", "dv") and t.value_decay is None, name
        # (u, w) a vector each, or, for a correction on the decayed state, a matrix (a vector per column)
        ranks = [(len(u.shape), len(w.shape)) for u, w in t.corrections]
        per_column = {"after": [(1, 2)], "gated_after": [(1, 2)], "before": [(2, 1)], "sandwich": [(2, 2)]}
        assert ranks == per_column.get(name, [(1, 1)] * len(ranks)), name
        assert (len(t.corrections), len(t.value_corrections)) == \
            ((0, 1) if name == "value_side" else (2, 0) if name == "two_corrections" else (1, 0)), name
        assert rec.forms == ("recurrent", "parallel", "chunkwise"), name
        assert "elementwise decay" in t.kind and "rank-one correction" in t.kind, name


@pytest.mark.parametrize("update, reason", [
    ("S = exp(X)*S − beta·(S·vn)⊗vn − beta·kn⊗(kn·S) + k⊗v", "rank-one corrections on both sides"),
    ("S = exp(X)*S − beta·kn⊗(kn·(exp(X)*S)) + k⊗v", "contracts an elementwise product with the state"),
    ("S = (I − kn⊗kn)·(exp(X)*((I − beta·kn⊗kn)·S)) + k⊗v", "meets another factor of it"),
    ("S = 0.5·S − (beta·kn⊗kn)·(exp(X)*S) + k⊗v", "without an elementwise decay"),
    ("S = (exp(X)*S)·(I − beta·vn⊗vn) + beta·k⊗vn", "on the state as it was"),
    ("S = exp(X)*S − diag(exp(p))·S·(vn⊗vn) + k⊗v", "beside its elementwise decay"),
])
def test_corrections_the_forms_do_not_take_are_refused_with_a_reason(update, reason):
    rec = linrec.compile(f"""recurrence r(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], p[dk] <= 0, beta in (0, 1), X[dk, dv] <= 0
kn = l2norm(k)
vn = l2norm(v)
state S[dk, dv]
{update}
output o = q·S
""", "r.lin")
    assert rec.forms == ("recurrent",)
    assert reason in rec.decomposition.why_not("parallel")
    assert reason in rec.decomposition.why_not("chunkwise")


# ---- NumPy's forms against the recurrent form ------------------------------------------------------------
@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("tokens", [1, 19, 41])
def test_forms_agree_with_the_recurrent_form(recs, name, tokens):
    x, s0 = inputs(recs[name], batch=2, tokens=tokens, heads=2, seed=tokens)
    assert_forms_agree(recs[name], x, s0, chunk_sizes=(1, 7, 17, 64))


def test_mild_decays_and_a_state_that_grows_stay_exact(recs):
    """Log-decays near 0 (the corrections, not the decays, then shape the state) and no reset."""
    for name in ("key_side", "value_side"):
        x, s0 = inputs(recs[name], batch=1, tokens=37, heads=3, seed=5, strongest=-0.05, resets=0)
        assert_forms_agree(recs[name], x, s0, chunk_sizes=(5, 16))


def test_a_reset_of_every_element_at_once(recs):
    """X = −∞ everywhere at token 10 (the correction of that token still reads S_9, as written), and at
    token 16, the first of a sub-block."""
    for name in ("key_side", "value_side"):
        x, s0 = inputs(recs[name], batch=1, tokens=23, heads=1, seed=9, resets=0)
        x["X"][:, [10, 16]] = -np.inf
        assert_forms_agree(recs[name], x, s0, chunk_sizes=(4, 16))


def test_a_nonfinite_token_runs_on_from_the_state_before_it(recs):
    """A NaN in one (batch row, head): the tokens before it from the derived form, the rest recurrent."""
    for name in ("key_side", "value_side"):
        rec = recs[name]
        x, s0 = inputs(rec, batch=2, tokens=30, heads=2, seed=1)
        x["v"][1, 12, 0, 1] = np.nan
        want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
        for form, chunk in (("parallel", None), ("chunkwise", 7)):
            got = rec.run(x, form=form, chunk_size=chunk, initial_state=s0, dims=DIMS)
            assert np.array_equal(np.isnan(got.outputs["o"]), np.isnan(want.outputs["o"])), (name, form)
            finite = ~np.isnan(want.outputs["o"])
            assert rel_err(got.outputs["o"][finite], want.outputs["o"][finite]) <= TOL, (name, form)
            assert rel_err(got.final_state["S"][0], want.final_state["S"][0]) <= TOL, (name, form)


# ---- a loop written from the math ------------------------------------------------------------------------
def key_side_loop(x, s0):
    """S_t = exp(X_t)⊙S_(t−1) + β_t·k̂_t⊗(v_t − k̂_t·S_(t−1)), o_t = q_t·S_t with k̂ = k/√(‖k‖² + 1e-6)
    (l2norm's eps), token by token."""
    batch, tokens, heads = x["q"].shape[:3]
    out = np.empty((batch, tokens, heads, DIMS["dv"]))
    state = np.array(s0, dtype=np.float64)
    for b in range(batch):
        for h in range(heads):
            s = state[b, h]
            for t in range(tokens):
                k = x["k"][b, t, h] / np.sqrt(np.sum(x["k"][b, t, h] ** 2) + 1e-6)
                s = np.exp(x["X"][b, t, h]) * s + x["beta"][b, t, h] * np.outer(k, x["v"][b, t, h] - k @ s)
                out[b, t, h] = x["q"][b, t, h] @ s
            state[b, h] = s
    return out, state


def test_the_key_side_program_against_its_loop(recs):
    rec = recs["key_side"]
    x, s0 = inputs(rec, batch=2, tokens=29, heads=2, seed=3)
    want_o, want_s = key_side_loop(x, s0["S"])
    for form, chunk in (("recurrent", None), ("parallel", None), ("chunkwise", 6)):
        got = rec.run(x, form=form, chunk_size=chunk, initial_state=s0, dims=DIMS)
        assert rel_err(got.outputs["o"], want_o) <= TOL, form
        assert rel_err(got.final_state["S"], want_s) <= TOL, form


# ---- C ----------------------------------------------------------------------------------------------------
# C runs them with the kernels it has (linrec.c.scan._elementwise_corrections): the scan kernel of a decay
# per row, one column (row) of S per head, gives the pseudo-values as readouts before the update; the
# elementwise kernel takes them as writes. The two programs share both kernels (their sizes are arguments).
@pytest.mark.parametrize("name", ["key_side", "value_side", "after"])
def test_c_forms_agree_with_the_recurrent_form(recs, name):
    rec = recs[name]
    for tokens in (19, 41):
        x, s0 = inputs(rec, batch=2, tokens=tokens, heads=2, seed=tokens)
        x["X"][:, 16] = -np.inf
        want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
        for form, chunk in (("parallel", None), ("chunkwise", 7), ("chunkwise", 17)):
            got = rec.run(x, form=form, chunk_size=chunk, initial_state=s0, dims=DIMS, backend="c")
            assert rel_err(got.outputs["o"], want.outputs["o"]) <= TOL, (tokens, form, chunk)
            assert rel_err(got.final_state["S"], want.final_state["S"]) <= TOL, (tokens, form, chunk)


def test_c_emits_the_kernels_it_runs(recs):
    source = recs["key_side"].emit("chunkwise", backend="c")
    assert "state 'S'" in source and "lr_elementwise_chunkwise" in source and "lr_chunkwise" in source


def test_c_refuses_a_correction_under_the_decay_with_its_reason(recs):
    """X⊙(u⊗(w·S)) writes u⊙X[:, c]·p[c] per column, no outer product for the elementwise kernel: refused
    before any kernel is built; NumPy runs it (above)."""
    rec = recs["before"]
    x, s0 = inputs(rec, batch=1, tokens=4, heads=1, seed=0)
    for form in ("parallel", "chunkwise"):
        with pytest.raises(linrec.LinrecError, match="no outer product for the elementwise kernels"):
            rec.run(x, form=form, backend="c", initial_state=s0, dims=DIMS)


def test_two_equal_corrections_under_an_elementwise_decay():
    """Two equal corrections beside an elementwise decay, whose u is one per column: merging the corrections
    that share a u (transitions._merged) took them for one group with no scalar, and compiling stopped with an
    AttributeError (a probe's finding, a regression of that merge). They stay as written: every form against
    the recurrent one."""
    rec = linrec.compile("""recurrence m(dk = 4, dv = 3)
input q[dk], k[dk], v[dv]
input X[dk, dv] <= 0
kn = l2norm(k)
state S[dk, dv]
S = exp(X)*(S − 0.25·kn⊗(kn·S) − 0.25·kn⊗(kn·S)) + kn⊗v
output o = q·S
""", "m.lin")
    assert len(rec.decomposition.transition("S").corrections) == 2
    x = rec.random_inputs(2, 11, 2, seed=3)
    want = rec.run(x, form="recurrent").outputs["o"]
    for form in rec.forms:
        got = rec.run(x, form=form, chunk_size=4).outputs["o"]
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12, err_msg=form)

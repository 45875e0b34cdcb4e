"""The derived forms (parallel, chunkwise) against the float64 recurrent form, on the shipped examples and
on combinations of the same operators that no example uses. Tolerance: 1e-9 normwise relative error in
float64 (observed ~1e-14), 5e-4 in float32 (see backends/verify.py for the reasoning)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import linrec
from linrec import verify
from linrec.verify import TOLERANCE, _initial_state

# the examples that carry a state (the sequence-level ones are tested in test_sequence.py)
EXAMPLES = [p for p in sorted(Path(__file__).resolve().parent.parent.joinpath("examples").glob("*.lin"))
            if linrec.load(p).program.states]

COMBINATIONS = {
    # a per-channel decay composed with the delta rule, on either side of the rank-one factor
    "diagonal_delta": """recurrence diagonal_delta(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dk] <= 0
input beta in (0, 1)
kn = l2norm(k)
state S[dk, dv]
S = diag(exp(g))·(I − beta·kn⊗kn)·S + beta·kn⊗v
output o = q·S
""",
    "delta_then_diagonal": """recurrence delta_then_diagonal(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dk] <= 0
input beta in (0, 1)
kn = l2norm(k)
state S[dk, dv]
S = (I − beta·kn⊗kn)·diag(exp(g))·S + beta·kn⊗v
output o = q·S
""",
    # the readout before the update, plus a current-token bonus term (RWKV-style)
    "bonus_before_update": """recurrence bonus(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dk] <= 0
param u[dk] per head = randn(seed=3)
state S[dk, dv]
output o = q·S + (q·(u*k))·v
S = diag(exp(g))·S + k⊗v
""",
    # a normalizer state under the same scalar decay as the numerator
    "decayed_normalizer": """recurrence decayed_normalizer(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], a in (0, 1)
phi(x) = exp(x)
state S[dk, dv], z[dk]
S = a·S + phi(k)⊗v
z = a·z + phi(k)
output o = (phi(q)·S) / (phi(q)·z)
""",
    # two matrix states on two time scales (a per-head constant decay and a data-dependent one), read
    # together: each state gets its own decay mask in the parallel and chunkwise forms
    "two_timescales": """recurrence two_timescales(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g <= 0
param gamma per head = 1 − 2^(−4 − h)
state S[dk, dv], R[dk, dv]
S = exp(g)·S + k⊗v
R = gamma·R + (1 − gamma)·k⊗v
output o = q·S + 0.5·q·R
""",
    # keys tied to the decay: k = 1 − exp(g)
    "tied_keys": """recurrence tied_keys(dk = 6, dv = 5)
input q[dk], v[dv], x[dk]
g = logsigmoid(x)
state S[dk, dv]
S = diag(exp(g))·S + (1 − exp(g))⊗v
output o = q·S
""",
    # the delta rule written out term by term
    "expanded_delta": """recurrence expanded_delta(dk = 6, dv = 5)
input q[dk], k[dk], v[dv]
input beta in (0, 1)
kn = l2norm(k)
state S[dk, dv]
S = S − beta·kn⊗(kn·S) + beta·kn⊗v
output o = q·S
""",
    # two rank-one factors in a row: three corrections after expansion
    "two_householders": """recurrence two_householders(dk = 6, dv = 5)
input q[dk], k[dk], k2[dk], v[dv]
input beta in (0, 1)
kn = l2norm(k)
kn2 = l2norm(k2)
state S[dk, dv]
S = (I − beta·kn⊗kn)·(I − 0.5·kn2⊗kn2)·S + beta·kn⊗v
output o = q·S
""",
    # an exponential input gate (a scalar exponent per token) times a vector key, a sigmoid forget gate in
    # log space and a normalizer state (mLSTM-like): the keys are stabilized by their running maximum
    "exp_input_gate": """recurrence exp_input_gate(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], i <= 0, f
lf = logsigmoid(f)
state S[dk, dv], n[dk]
S = exp(lf)·S + exp(i)·k⊗v
n = exp(lf)·n + exp(i)·k
output o = (q·S) / (abs(q·n) + 1)
""",
    # a normalizer whose per-channel decay is written elementwise (exp(g)*z is diag(exp(g))·z), and a vector
    # state decayed by a division
    "elementwise_decay": """recurrence elementwise_decay(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv], z[dk], y[dk]
S = diag(exp(g))·S + k⊗v
z = exp(g)*z + k
y = y/(1 + exp(g)) + k
output o = (q·S) / (abs(q·z) + 1) + q·y
""",
    # a state no output reads (only its final state is handed back) beside one that is read
    "unread_state": """recurrence unread_state(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g <= 0
state S[dk, dv], R[dk, dv]
S = exp(g)·S + k⊗v
R = R + q⊗v
output o = q·S
""",
    # vector states read as values of their own (HGRN- and RG-LRU-style elementwise reads), before and
    # after their update, beside a contraction of one of them
    # feature maps through parameter matrices, both ways round (W·x and x·P), shared and per head, at sizes
    # that leave rows and columns past whole registers (C: lr_matvec's 16-row blocks and their tails)
    "matrix_features": """recurrence matrix_features(dk = 21, dv = 5, m = 35)
input q[dk], k[dk], v[dv]
param W[m, dk] = randn(seed=1)
param P[dv, dv] per head = randn(seed=2)
phi(x) = relu(W·x)
state S[m, dv], z[m]
S = S + phi(k)⊗(v·P)
z = z + phi(k)
output o = (phi(q)·S) / (phi(q)·z + 1)
""",
    "elementwise_read": """recurrence elementwise_read(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], f[dk], g <= 0
state S[dk, dv], z[dk], w[dk]
early = w*sigmoid(q)
S = exp(g)·S + k⊗v
z = diag(sigmoid(f))·z + (1 − sigmoid(f))*k
w = w + k
output o = q·S + (q·z)*v
output y = z*sigmoid(q) + early + 0.5*w
""",
    # a vector state with a delta-rule correction, read as it is; and a non-causal one
    "delta_vector_read": """recurrence delta_vector_read(dk = 6, dv = 5)
input k[dk], v, beta in (0, 1)
kn = l2norm(k)
state z[dk]
z = (I − beta·kn⊗kn)·z + beta·kn*v
output y = z
""",
    "encoder_read": """recurrence encoder_read(dk = 6, dv = 5) noncausal
input k[dk], g[dk] <= 0
state z[dk]
z = diag(exp(g))·z + k
output y = z*k
""",
    "encoder": """recurrence encoder(dk = 6, dv = 5) noncausal
input q[dk], k[dk], v[dv], g <= 0
state S[dk, dv]
S = exp(g)·S + k⊗v
output o = q·S
""",
    # a decay of the value axis (S·diag(d) decays the columns), alone; beside a decay of the rows, and beside a
    # scalar decay, read before and after the update; non-causal; a vector state decayed from the right
    "value_decay": """recurrence value_decay(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dv] <= 0
state S[dk, dv]
S = S·diag(exp(g)) + k⊗v
output o = q·S
""",
    "both_axes": """recurrence both_axes(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], a[dk] <= 0, b[dv] <= 0, c <= 0
state S[dk, dv], R[dk, dv]
early = q·R
S = diag(exp(a))·S·diag(exp(b)) + k⊗v
R = exp(c)·R·diag(exp(b)) + 0.5·k⊗v
output o = q·S + early + q·R
""",
    "value_decay_encoder": """recurrence value_decay_encoder(dk = 6, dv = 5) noncausal
input q[dk], k[dk], v[dv], g[dv] <= 0
state S[dk, dv]
S = S·diag(exp(g)) + k⊗v
output o = q·S
""",
    "exp_keys_value_decay": """recurrence exp_keys_value_decay(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dv] <= 0
state S[dk, dv], z[dk]
S = S·diag(exp(g)) + exp(k)⊗v
z = z + exp(k)
output o = (exp(q)·S) / (exp(q)·z)
""",
    # the transposed convention of the source document (S ∈ R^(dv×dk), multiplied and read from the right):
    # the forms carry Sᵀ. The delta rule, under a scalar decay, a per-channel gate read before and after the
    # update, non-causal
    "delta_transposed": """recurrence delta_transposed(dk = 6, dv = 5)
input q[dk], k[dk], v[dv]
input beta in (0, 1)
kn = l2norm(k)
state S[dv, dk]
S = S·(I − beta·kn⊗kn) + beta·v⊗kn
output o = S·q
""",
    "gated_delta_transposed": """recurrence gated_delta_transposed(dk = 6, dv = 5)
input q[dk], k[dk], v[dv]
input beta in (0, 1), g <= 0
kn = l2norm(k)
state S[dv, dk]
S = exp(g)·S·(I − beta·kn⊗kn) + beta·v⊗kn
output o = S·(dk^(−1/2)·l2norm(q))
""",
    "gla_transposed": """recurrence gla_transposed(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dv, dk]
early = S·q
S = S·diag(exp(g)) + v⊗k
output o = S·q + 0.5*early
""",
    "encoder_transposed": """recurrence encoder_transposed(dk = 6, dv = 5) noncausal
input q[dk], k[dk], v[dv], g <= 0
state S[dv, dk]
S = exp(g)·S + v⊗k
output o = groupnorm(S·q)
""",
    "vector_right": """recurrence vector_right(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], g[dk] <= 0
state z[dk], S[dk, dv]
z = z·diag(exp(g)) + k
S = S + k⊗v
output y = (q·z)*v + q·S
""",
}


def _load(key: str) -> linrec.Recurrence:
    if key in COMBINATIONS:
        return linrec.compile(COMBINATIONS[key], f"{key}.lin")
    return linrec.load(key)


_cache: dict[str, linrec.Recurrence] = {}


def program(key: str) -> linrec.Recurrence:
    if key not in _cache:
        _cache[key] = _load(key)
    return _cache[key]


ALL = [str(p) for p in EXAMPLES] + list(COMBINATIONS)


def _rel_err(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-300))


def _check(rec, batch, tokens, heads, dims, decay_scale, chunk, dtype, tol, seed=0):
    rng = np.random.default_rng(seed)
    inputs = rec.random_inputs(batch, tokens, heads, dims, np.float64, seed=seed, decay_scale=decay_scale)
    all_dims = {d.name: d.default for d in rec.program.dims} | dims
    state0 = _initial_state(rec.program, batch, heads, all_dims, rng)
    reference = verify.reference_form(rec)  # (stabilized programs: the statements as written)
    ref = rec.run(inputs, initial_state=state0, form=reference)
    cast = {k: v.astype(dtype) for k, v in inputs.items()}
    s0 = {k: v.astype(dtype) for k, v in state0.items()}
    params = {k: v.astype(dtype) for k, v in ref.params.items()}
    for form in [f for f in ("recurrent", "parallel", "chunkwise") if f != reference]:
        res = rec.run(cast, form=form, initial_state=s0, params=params, chunk_size=chunk)
        for name, value in ref.outputs.items():
            assert res.outputs[name].dtype == np.dtype(dtype)
            err = _rel_err(res.outputs[name], value)
            assert err <= tol, f"{form} output {name}: rel err {err:.2e} > {tol:.0e}"
        for name, value in ref.final_state.items():
            err = _rel_err(res.final_state[name], value)
            assert err <= tol, f"{form} final state {name}: rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("key", ALL, ids=[Path(k).stem for k in ALL])
def test_every_form_is_available(key):
    assert program(key).forms == ("recurrent", "parallel", "chunkwise")


@pytest.mark.parametrize("key", ALL, ids=[Path(k).stem for k in ALL])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 2), tokens=st.integers(1, 90), heads=st.integers(1, 3),
       dk=st.integers(1, 9), dv=st.integers(1, 7), chunk=st.sampled_from([1, 3, 16, 64]),
       decay_scale=st.sampled_from([0.1, 1.0, 10.0, 40.0]), seed=st.integers(0, 2**16))
def test_forms_match_recurrent_float64(key, batch, tokens, heads, dk, dv, chunk, decay_scale, seed):
    rec = program(key)
    names = [d.name for d in rec.program.dims]
    dims = dict(zip(names, [dk, dv, 4, 4]))
    _check(rec, batch, tokens, heads, dims, decay_scale, chunk, np.float64, TOLERANCE["float64"], seed)


@pytest.mark.parametrize("key", ALL, ids=[Path(k).stem for k in ALL])
def test_forms_match_recurrent_float32(key):
    _check(program(key), 2, 77, 2, {}, 1.0, 16, np.float32, TOLERANCE["float32"])


@pytest.mark.parametrize("key", [str(p) for p in EXAMPLES], ids=[p.stem for p in EXAMPLES])
def test_strong_decay_long_sequence_stays_finite_and_exact(key):
    # log-decays around −20 per token over several thousand tokens: exponents stay differences ≤ 0
    _check(program(key), 1, 3000, 1, {d.name: 4 for d in program(key).program.dims}, 40.0, 64,
           np.float32, TOLERANCE["float32"])


def test_chunk_size_does_not_change_the_result():
    rec = program(str(EXAMPLES[0]))
    inputs = rec.random_inputs(1, 100, 2, seed=4)
    results = [rec.run(inputs, form="chunkwise", chunk_size=c).outputs for c in (1, 7, 64, 100, 1000)]
    for other in results[1:]:
        for name in other:
            assert np.max(np.abs(other[name] - results[0][name])) < 1e-10


def test_unfactorable_transition_has_only_the_recurrent_form():
    rec = linrec.compile("""recurrence dense(dk = 4, dv = 4)
input q[dk], k[dk], v[dv]
param M[dk, dk] = randn(seed=0)
state S[dk, dv]
S = M·S + k⊗v
output o = q·S
""", "dense.lin")
    assert rec.forms == ("recurrent",)
    why = rec.decomposition.why_not("chunkwise")
    assert "dense matrix" in why and "M" in why
    with pytest.raises(linrec.LinrecError, match="has no chunkwise form"):
        rec.run(rec.random_inputs(1, 3, 1), form="chunkwise")


def test_query_that_reads_a_state_is_derived_in_stages():
    """(q·U)·S reads S with a query that depends on the state U: not a readout one scan can take (it was
    taken for one, and the C kernel's source named an undeclared r0). U reads no other state, so U is derived
    first and hands q·U to S's stage (compiler.stages); every form on both backends matches the loops."""
    rec = linrec.compile("""recurrence qread(dk = 4, dv = 3)
input q[dk], k[dk], v[dv]
state S[dk, dv], U[dk, dk]
S = 0.5·S + k⊗v
U = 0.5·U + 0.1·k⊗k
output o = (q·U)·S
""", "qread.lin")
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    assert [s.states for s in rec.decomposition.stages] == [("U",), ("S",)]
    x = rec.random_inputs(2, 7, 2, seed=1)
    S, U = np.zeros((2, 2, 4, 3)), np.zeros((2, 2, 4, 4))
    expected = np.zeros((2, 7, 2, 3))
    for t in range(7):
        S = 0.5 * S + x["k"][:, t, :, :, None] * x["v"][:, t, :, None, :]
        U = 0.5 * U + 0.1 * x["k"][:, t, :, :, None] * x["k"][:, t, :, None, :]
        expected[:, t] = np.einsum("bhi,bhij,bhjk->bhk", x["q"][:, t], U, S)
    for backend in ("numpy", "c"):
        for form in rec.forms:
            got = rec.run(x, backend=backend, form=form, chunk_size=3).outputs["o"]
            assert np.max(np.abs(got - expected)) <= 1e-10 * np.max(np.abs(expected)), (backend, form)


def test_a_nonpositive_decays_advice_names_the_factor_at_fault():
    """`exp(G)·gamma` with gamma's default negative for heads from the tenth on (found by probing): the advice
    was to declare ranges of G, which no range fixes (exp(G) has its logarithm, G); it is gamma's default. (An
    elementwise decay: one of the rows may have either sign, below.)"""
    rec = linrec.compile("recurrence m1(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\ninput G[dk, dv] <= 0\n"
                         "param gamma per head = 0.95 − 0.1·h\nstate S[dk, dv]\nS = (exp(G)*gamma)*S + k⊗v\n"
                         "output o = q·S\n", "m1.lin")
    why = rec.decomposition.why_not("parallel")
    assert "change the defaults it is computed from" in why and "ranges of G" not in why
    rec = linrec.compile("recurrence m2(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\ninput G[dk, dv] <= 0, b\n"
                         "state S[dk, dv]\nS = (exp(G)*b)*S + k⊗v\noutput o = q·S\n", "m2.lin")
    assert "declare ranges of b that keep it positive" in rec.decomposition.why_not("parallel")


def test_a_value_written_twice_in_a_decay_is_named_and_once_is_seen_positive():
    """HGRN's lower-bounded gate lb + (1 − lb)*sigmoid(f): positive for lb ≥ 0, but the bounds take each lb on its
    own and found (−∞, ∞), and the message asked for ranges of f that cannot help (a probe's finding). It now
    names lb; the same decay written with lb once is seen positive. (Elementwise here: a decay of the rows or
    of the value axis of either sign has every form, below.)"""
    head = "recurrence hg(d = 4)\ninput f[d], c[d], u[d] in (0, 1]\nparam lb per head = 0.1*(h + 1)\nstate hh[d, d]\n"
    twice = linrec.compile(head + "hh = ((lb + (1 − lb)*sigmoid(f))⊗u)*hh + c⊗c\noutput o = c·hh\n", "hg.lin")
    assert "the bounds take each occurrence of lb on its own" in twice.decomposition.why_not("parallel")
    once = linrec.compile(head + "hh = ((lb*(1 − sigmoid(f)) + sigmoid(f))⊗u)*hh + c⊗c\noutput o = c·hh\n",
                          "hg.lin")
    assert once.forms == ("recurrent", "parallel", "chunkwise")


SIGNED_DECAY = """recurrence signed(dk = 3, dv = 3)
input q[dk], k[dk], v[dv], a
state S[dk, dv]
S = a·S + k⊗v
output o = q·S
"""


def test_a_decay_of_either_sign_has_every_form():
    """A decay of the rows with no symbolic logarithm that may be negative (an input without a range, a param
    without a default) was refused the log-space forms. It is |a| times a sign: the forms carry σ_t·S_t, σ_t the
    running product of the signs, whose decay |a| has a logarithm (docs/forms.md). Every form and backend equals
    the recurrent one on decays of both signs, zeros included; an elementwise decay that may be negative is
    still refused, and says why."""
    rec = linrec.compile(SIGNED_DECAY, "signed.lin")
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    assert rec.decomposition.transitions[0].kind == "data-dependent scalar decay of either sign"
    inputs = rec.random_inputs(2, 19, 2, seed=1)
    inputs["a"] = np.random.default_rng(2).uniform(-1.2, 1.2, inputs["a"].shape)
    inputs["a"][0, 4, 1] = 0.0
    s0 = {"S": np.random.default_rng(3).standard_normal((2, 2, 3, 3))}
    want = rec.run(inputs, form="recurrent", initial_state=s0)
    for backend in ("numpy", "c"):
        for form in rec.forms:
            got = rec.run(inputs, form=form, backend=backend, initial_state=s0, chunk_size=5)
            np.testing.assert_allclose(got.outputs["o"], want.outputs["o"], rtol=1e-10, atol=1e-10 * np.abs(
                want.outputs["o"]).max(), err_msg=f"{backend} {form}")
            np.testing.assert_allclose(got.final_state["S"], want.final_state["S"], rtol=1e-10, atol=1e-12)
    source = "recurrence signed(dk = 3, dv = 3)\ninput q[dk], k[dk], v[dv]\nparam a per head\nstate S[dk, dv]\n" \
             "S = a·S + k⊗v\noutput o = q·S\n"
    assert linrec.compile(source, "signed.lin").forms == ("recurrent", "parallel", "chunkwise")
    elementwise = linrec.compile(SIGNED_DECAY.replace("v[dv], a", "v[dv], a[dk, dv]").replace("a·S", "a*S"), "e.lin")
    assert elementwise.forms == ("recurrent",)
    assert "the decay `a` of 'S' can be zero or negative (its values lie in (−∞, ∞))" in \
        elementwise.decomposition.why_not("parallel")


def test_a_decay_a_default_keeps_positive_is_refused_negative_when_the_form_runs():
    """A param whose default keeps the decay positive gives the log-space forms without signs; a call that
    passes values that make it negative is refused when the form runs, as an input outside its range is."""
    source = "recurrence signed(dk = 3, dv = 3)\ninput q[dk], k[dk], v[dv]\nparam a per head\nstate S[dk, dv]\n" \
             "S = a·S + k⊗v\noutput o = q·S\n"
    rec = linrec.compile(source.replace("per head", "per head = 0.9"), "signed.lin")
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    inputs = rec.random_inputs(1, 5, 2, seed=1)
    refused = r"the decay of state 'S' must be positive in the parallel and chunkwise forms and in the C " \
              r"backward, which work with its logarithm, but it is as low as -0\.5 here"
    with pytest.raises(linrec.RuntimeInputError, match=refused):
        rec.run(inputs, form="parallel", params={"a": np.array([0.5, -0.5])})
    assert np.all(np.isfinite(rec.run(inputs, params={"a": np.array([0.5, -0.5])}).outputs["o"]))
    # the backwards that work with its logarithm say the same (they said the output was NaN: a probe's finding);
    # NumPy's recurrent backward takes it
    up = {"o": np.ones((1, 5, 2, 3))}
    for form, backend in (("recurrent", "c"), ("chunkwise", "numpy"), ("parallel", "c")):
        with pytest.raises(linrec.RuntimeInputError, match=refused):
            rec.vjp(inputs, up, form=form, backend=backend, params={"a": np.array([0.5, -0.5])})
    grads = rec.vjp(inputs, up, params={"a": np.array([0.5, -0.5])}).grads
    assert all(np.all(np.isfinite(g)) for g in grads.values())


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_exp_input_gate_against_a_loop(backend):
    """The stabilized forms of a scalar exponential gate times a vector key, against explicit loops over
    b, h, t (float64, 1e-10 relative): the running maximum M of the gate's exponent is a per-token scalar,
    and exp(i − M) has to meet every lane of k."""
    rec = program("exp_input_gate")
    dims = {"dk": 4, "dv": 3}
    x = rec.random_inputs(2, 23, 2, dims, np.float64, seed=7)
    x["i"] = np.asarray(x["i"]) * 30  # gates spread over e^−30 … 1
    state0 = _initial_state(rec.program, 2, 2, dims, np.random.default_rng(7))
    lf = -np.logaddexp(0.0, -np.asarray(x["f"]))  # logsigmoid
    expect = np.zeros(np.shape(x["v"]))
    for b in range(2):
        for h in range(2):
            S, n = state0["S"][b, h].copy(), state0["n"][b, h].copy()
            for t in range(23):
                a, w = np.exp(lf[b, t, h]), np.exp(x["i"][b, t, h])
                k, v, q = x["k"][b, t, h], x["v"][b, t, h], x["q"][b, t, h]
                S = a * S + w * np.outer(k, v)
                n = a * n + w * k
                expect[b, t, h] = (q @ S) / (abs(q @ n) + 1)
    for form in rec.forms:
        got = rec.run(x, form=form, backend=backend, initial_state=state0).outputs["o"]
        assert _rel_err(got, expect) <= 1e-10, f"{form} ({backend})"


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_elementwise_reads_against_a_loop(backend):
    """Vector states read as values of their own (an output gate times the state, the state before its
    update), against explicit loops over b, h, t (float64, 1e-10 relative): every form and the decode step
    on both backends (C's scans read them in c_values' kernels)."""
    rec = program("elementwise_read")
    dims = {"dk": 5, "dv": 3}
    x = rec.random_inputs(2, 37, 2, dims, np.float64, seed=3)
    state0 = _initial_state(rec.program, 2, 2, dims, np.random.default_rng(3))
    sig = lambda a: 1 / (1 + np.exp(-a))  # noqa: E731
    expect = {"o": np.zeros(np.shape(x["v"])), "y": np.zeros(np.shape(x["k"]))}
    for b in range(2):
        for h in range(2):
            S, z, w = (state0[n][b, h].copy() for n in ("S", "z", "w"))
            for t in range(37):
                q, k, v, f, g = (np.asarray(x[n])[b, t, h] for n in ("q", "k", "v", "f", "g"))
                early = w * sig(q)
                S = np.exp(g) * S + np.outer(k, v)
                z = sig(f) * z + (1 - sig(f)) * k
                w = w + k
                expect["o"][b, t, h] = q @ S + (q @ z) * v
                expect["y"][b, t, h] = z * sig(q) + early + 0.5 * w
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    for form in rec.forms:
        res = rec.run(x, form=form, backend=backend, initial_state=state0)
        for name in expect:
            assert _rel_err(res.outputs[name], expect[name]) <= 1e-10, f"{form} ({backend}): {name}"
        assert _rel_err(res.final_state["w"], state0["w"] + np.sum(x["k"], axis=1)) <= 1e-10
    # the decode step, token by token, carries the same states
    state = state0
    for t in range(37):
        out, state = rec.step({n: np.asarray(a)[:, t] for n, a in x.items()}, state, backend=backend)
        assert _rel_err(out["y"], expect["y"][:, t]) <= 1e-10, f"step {t} ({backend})"
    for chunk in (1, 16):  # chunks that end inside the sequence, and a chunk per token
        res = rec.run(x, form="chunkwise", backend=backend, initial_state=state0, chunk_size=chunk)
        assert _rel_err(res.outputs["y"], expect["y"]) <= 1e-10, f"chunk {chunk} ({backend})"



@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_parameter_matrix_feature_maps_against_a_loop(backend):
    """Feature maps through parameter matrices (W·x with W shared, v·P with P per head; were NumPy-only on
    C's recurrent form and decode step) against explicit loops over b, h, t (float64, 1e-10 relative):
    every form and the decode step on both backends, at sizes that are not whole registers."""
    rec = program("matrix_features")
    dims = {"dk": 21, "dv": 5, "m": 35}
    x = rec.random_inputs(2, 29, 3, dims, np.float64, seed=5)
    params = rec.default_params(3, dims)
    W, P = params["W"], params["P"]
    assert W.shape == (35, 21) and P.shape == (3, 5, 5)
    state0 = _initial_state(rec.program, 2, 3, dims | {"m": 35}, np.random.default_rng(5))
    state0["z"] = np.abs(state0["z"])  # the normalizer stays positive, as phi's are
    expect = np.zeros(np.shape(x["v"]))
    for b in range(2):
        for h in range(3):
            S, z = state0["S"][b, h].copy(), state0["z"][b, h].copy()
            for t in range(29):
                q, k, v = (np.asarray(x[n])[b, t, h] for n in ("q", "k", "v"))
                S = S + np.outer(np.maximum(W @ k, 0), v @ P[h])
                z = z + np.maximum(W @ k, 0)
                fq = np.maximum(W @ q, 0)
                expect[b, t, h] = (fq @ S) / (fq @ z + 1)
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    for form in rec.forms:
        got = rec.run(x, form=form, backend=backend, initial_state=state0).outputs["o"]
        assert _rel_err(got, expect) <= 1e-10, f"{form} ({backend})"
    state = state0
    for t in range(29):
        out, state = rec.step({n: np.asarray(a)[:, t] for n, a in x.items()}, state, backend=backend)
        assert _rel_err(out["o"], expect[:, t]) <= 1e-10, f"step {t} ({backend})"
    # float32: the same within the float32 tolerance
    x32 = {n: np.asarray(a, np.float32) for n, a in x.items()}
    s32 = {n: np.asarray(a, np.float32) for n, a in state0.items()}
    got = rec.run(x32, form="recurrent", backend=backend, initial_state=s32).outputs["o"]
    assert _rel_err(got, expect) <= TOLERANCE["float32"]


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("state, update, read", [
    ("S[dk, dv]", "S = diag(exp(g))·S", "q·S"),   # a matrix state, one decay per row
    ("S[dk, dv]", "S = exp(gs)·S", "q·S"),        # one per token
    ("z[dk]", "z = diag(exp(g))·z", "z*q"),       # a vector state read as it is
])
def test_a_state_that_only_decays_against_a_loop(backend, state, update, read):
    """A state with a decay and no write (was: C's recurrent kernel skipped the decay where a block had no
    write to fuse it with — wrong once the lazily applied scale ran out, 1e300 off at strong decays; NumPy's
    scans of a vector state read as it is stopped with an internal error). Every form and the decode step,
    decays from mild to e^−30 a token, against explicit loops (float64, 1e-10 relative)."""
    name = state.split("[")[0]
    rec = linrec.compile(f"""recurrence decaying(dk = 4, dv = 3)
input q[dk], g[dk] <= 0, gs <= 0
state {state}
{update}
output o = {read}
""", "decaying.lin")
    dims = {"dk": 4, "dv": 3}
    x = rec.random_inputs(2, 29, 2, dims, np.float64, seed=5)
    x["g"] = np.asarray(x["g"]) * np.linspace(0.1, 30, 29)[None, :, None, None]
    x["gs"] = np.asarray(x["gs"]) * np.linspace(0.1, 30, 29)[None, :, None]
    state0 = _initial_state(rec.program, 2, 2, dims, np.random.default_rng(5))
    s = np.asarray(state0[name], np.float64).copy()
    expect = np.zeros((2, 29, 2, 3 if name == "S" else 4))
    for t in range(29):
        a = np.exp(x["g"][:, t]) if "diag" in update else np.exp(x["gs"][:, t])[..., None]
        s = a[..., None] * s if name == "S" else a * s
        q = x["q"][:, t]
        expect[:, t] = np.einsum("bhi,bhij->bhj", q, s) if name == "S" else s * q
    for form in rec.forms:
        res = rec.run(x, form=form, backend=backend, initial_state=state0)
        assert _rel_err(res.outputs["o"], expect) <= 1e-10, f"{form} ({backend})"
        assert _rel_err(res.final_state[name], s) <= 1e-10, f"{form} ({backend}): final state"
    state = state0
    for t in range(29):
        out, state = rec.step({n: np.asarray(a)[:, t] for n, a in x.items()}, state, backend=backend)
        assert _rel_err(out["o"], expect[:, t]) <= 1e-10, f"step {t} ({backend})"

def test_a_vector_delta_rule_read_as_it_is_has_no_c_scan():
    """A vector state with a delta-rule correction, read as it is: its reads need the pseudo-values of the
    correction, which C's scan kernels keep to themselves. C builds its recurrent kernel; the parallel
    and chunkwise forms are NumPy's, and C says why."""
    rec = program("delta_vector_read")
    x = rec.random_inputs(1, 9, 2, {"dk": 6, "dv": 5}, np.float64, seed=2)
    with pytest.raises(linrec.LinrecError, match="vector state 'z': .*no rank-one correction"):
        rec.run(x, form="chunkwise", backend="c")
    ref = rec.run(x, form="recurrent", backend="numpy").outputs["y"]
    assert _rel_err(rec.run(x, form="recurrent", backend="c").outputs["y"], ref) <= 1e-10
    assert _rel_err(rec.run(x, form="chunkwise", backend="numpy").outputs["y"], ref) <= 1e-10


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_stabilized_readout_before_the_update_against_a_loop(backend):
    """A state carried as S·exp(−M) (exponential keys) read before its update as well as after: the read
    before sees S_(t−1)·exp(−M_(t−1)), one token behind M_t (was: scaled back by M_t, 0.9 off in every
    form; verify missed it, its reference being the same stabilized form — it now is the statements as
    written). Every form against explicit loops, float64, 1e-10 relative."""
    rec = linrec.compile("""recurrence before_after(dk = 3, dv = 7)
input q[dk], k[dk], v[dv], g <= 0
state S[dk, dv]
early = q·S
S = exp(g)·S + (exp(g)*k)⊗v
output o = q·S + early
""", "before_after.lin")
    x = rec.random_inputs(2, 19, 3, None, np.float64, seed=1)
    q, k, v, g = (np.asarray(x[n]) for n in "qkvg")
    expect = np.zeros(v.shape)
    for b in range(2):
        for h in range(3):
            S = np.zeros((3, 7))
            for t in range(19):
                early = q[b, t, h] @ S
                S = np.exp(g[b, t, h]) * (S + np.outer(k[b, t, h], v[b, t, h]))
                expect[b, t, h] = q[b, t, h] @ S + early
    for form in rec.forms:
        got = rec.run(x, form=form, backend=backend).outputs["o"]
        assert _rel_err(got, expect) <= 1e-10, f"{form} ({backend})"
    assert verify.reference_form(rec) == "definition"
    # the decode step (C: the fused kernel's, which multiplies the scales back per token) carries S.log_scale
    state = None
    for t in range(19):
        out, state = rec.step({n: np.asarray(a)[:, t] for n, a in x.items()}, state, backend=backend)
        assert _rel_err(out["o"], expect[:, t]) <= 1e-10, f"step {t} ({backend})"
    assert "S.log_scale" in state


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_stabilized_noncausal_readouts_against_a_loop(backend):
    """A non-causal program with exponential keys: every token reads the final state S_T·exp(−M_T), so its
    scale is M_T at every token (was: M_t, the running maximum up to the token). An output whose scales do
    not cancel (+ v) shows it. Every form against explicit loops, float64, 1e-10 relative."""
    rec = linrec.compile("""recurrence encoder_exp(dk = 3, dv = 4) noncausal
input q[dk], k[dk], v[dv]
state S[dk, dv]
S = S + exp(k)⊗v
output o = q·S + v
""", "encoder_exp.lin")
    x = rec.random_inputs(2, 13, 2, None, np.float64, seed=5)
    x["k"] = np.asarray(x["k"]) * 4  # a running maximum that moves
    q, k, v = (np.asarray(x[n]) for n in "qkv")
    final = np.einsum("bthi,bthj->bhij", np.exp(k), v)
    expect = np.einsum("bthi,bhij->bthj", q, final) + v
    for form in rec.forms:
        got = rec.run(x, form=form, backend=backend)
        assert _rel_err(got.outputs["o"], expect) <= 1e-10, f"{form} ({backend})"
        assert _rel_err(got.final_state["S"], final) <= 1e-10, f"{form} ({backend})"

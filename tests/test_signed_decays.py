"""Decays of either sign in the log-space forms (compiler.transitions.Transition.magnitude, value_magnitude): a
decay of the rows or of the value axis with no symbolic logarithm that may be negative is |D_t| times a sign, and
the forms carry σ_t ⊙ S_t (S_t·diag(τ_t) on the value axis), σ the running product of the signs, whose decay
|D_t| has a logarithm (linrec.numpy.scan.with_signs, with_value_signs). Every form and gradient form on both
backends against the float64 recurrent form and its backward, and the recurrent backward against central
differences."""
import numpy as np
import pytest

import linrec

HEAD = "recurrence signed(dk = 4, dv = 3){causal}\ninput q[dk], k[dk], v[dv]\n"
PROGRAMS = {
    # a scalar decay per token in [−1, 1]
    "scalar": ("", "input a in [−1, 1]\nstate S[dk, dv]\nS = a·S + k⊗v\noutput o = q·S\n"),
    # one decay per row with the delta rule, a readout before the update and a vector state read as it is
    "delta_rows": ("", "input a[dk] in [−1, 1]\ninput beta in (0, 1)\nstate S[dk, dv]\nstate z[dk]\n"
                       "output y = q·S\nS = diag(a)·S − beta·k⊗(k·S) + beta·k⊗v\nz = 0.5·a*z + k\n"
                       "output o = q·S\noutput n = z\n"),
    # the same, non-causal: every readout reads the final state
    "noncausal": (" noncausal", "input a[dk] in [−1, 1]\ninput beta in (0, 1)\nstate S[dk, dv]\nstate z[dk]\n"
                                "S = diag(a)·S − beta·k⊗(k·S) + beta·k⊗v\nz = 0.5·a*z + k\n"
                                "output o = q·S\noutput n = z\n"),
    # a negative per-head param (its gradient through log |gamma|)
    "param": ("", "param gamma per head = −0.9 + 0.3·h\nstate S[dk, dv]\nS = gamma·S + k⊗v\noutput o = q·S\n"),
    # a state of either sign read by a later stage
    "staged": ("", "input a[dk] in [−1, 1]\ninput g <= 0\nstate m[dk]\nstate S[dk, dv]\nm = a*m + k\n"
                   "S = exp(g)·S + m⊗v\noutput o = q·S\n"),
    # a scalar beside a correction on the value side, which the forms carry on the value axis
    "value_side": ("", "input a in [−1, 1]\ninput beta in (0, 1)\nstate S[dk, dv]\n"
                       "S = a·S·(I − beta·v⊗v) + beta·k⊗v\noutput o = q·S\n"),
    # a decay of the value axis of either sign beside one of the rows, read before and after the update
    "value_axis": ("", "input a[dv] in [−1, 1]\ninput g[dk] <= 0\nstate S[dk, dv]\noutput y = q·S\n"
                       "S = diag(exp(g))·S·diag(a) + k⊗v\noutput o = q·S\n"),
    "value_axis_noncausal": (" noncausal", "input a[dv] in [−1, 1]\ninput g[dk] <= 0\nstate S[dk, dv]\n"
                                           "S = diag(exp(g))·S·diag(a) + k⊗v\noutput o = q·S\n"),
    # the rows of a state read from the right, which the forms carry transposed: its value axis then
    "read_from_the_right": ("", "input a[dk] in [−1, 1]\nstate S[dk, dv]\nS = diag(a)·S + k⊗v\n"
                                "output r = S·v\n"),
}


def _compile(name):
    causal, body = PROGRAMS[name]
    return linrec.compile(HEAD.format(causal=causal) + body, f"{name}.lin")


def _case(rec, batch=2, tokens=23, heads=2, seed=0):
    """Inputs whose decay `a` takes both signs (uniform in [−1, 1]) and random initial states."""
    rng = np.random.default_rng(seed)
    x = rec.random_inputs(batch, tokens, heads, seed=seed)
    if "a" in x:
        x["a"] = rng.uniform(-1.0, 1.0, x["a"].shape)
    shapes = {k: v.shape for k, v in rec.run(x, form="recurrent").final_state.items()}
    s0 = {k: rng.standard_normal(shape) for k, shape in shapes.items()}
    return x, s0, rng


def _rel(got, want) -> float:
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_form_and_gradient_form_of_a_decay_of_either_sign(name):
    rec = _compile(name)
    assert rec.forms == ("recurrent", "parallel", "chunkwise"), rec.decomposition.why_not("parallel")
    assert any(t.signed or t.value_signed for t in rec.decomposition.transitions)
    x, s0, rng = _case(rec)
    want = rec.run(x, form="recurrent", initial_state=s0)
    up = {k: rng.standard_normal(v.shape) for k, v in want.outputs.items()}
    up_final = {k: rng.standard_normal(v.shape) for k, v in want.final_state.items()}
    grads = rec.vjp(x, up, form="recurrent", backend="numpy", initial_state=s0, grad_final_state=up_final).grads
    for backend in ("numpy", "c"):
        for form in rec.forms:
            got = rec.run(x, form=form, backend=backend, initial_state=s0, chunk_size=5)
            for group in ("outputs", "final_state"):
                for key, ref in getattr(want, group).items():
                    assert _rel(getattr(got, group)[key], ref) <= 1e-10, (backend, form, key)
            back = rec.vjp(x, up, form=form, backend=backend, initial_state=s0, grad_final_state=up_final,
                           chunk_size=5)
            for key, ref in grads.items():
                assert _rel(back.grads[key], ref) <= 1e-9, (backend, form, key)


@pytest.mark.parametrize("name", ["delta_rows", "param"])
def test_the_recurrent_backward_of_a_decay_of_either_sign_against_central_differences(name):
    rec = _compile(name)
    x, s0, rng = _case(rec, tokens=11, seed=1)
    ref = rec.run(x, form="recurrent", initial_state=s0)
    up = {k: rng.standard_normal(v.shape) for k, v in ref.outputs.items()}
    res = rec.vjp(x, up, form="recurrent", initial_state=s0)
    dx = {k: rng.standard_normal(np.shape(v)) for k, v in x.items()}
    ds = {k: rng.standard_normal(v.shape) for k, v in s0.items()}
    dp = {k: rng.standard_normal(np.shape(v)) for k, v in res.params.items()}

    def loss(h):
        out = rec.run({k: x[k] + h * dx[k] for k in x}, form="recurrent",
                      initial_state={k: s0[k] + h * ds[k] for k in s0},
                      params={k: res.params[k] + h * dp[k] for k in res.params}).outputs
        return sum(np.sum(out[k] * up[k]) for k in up)
    step = 1e-6
    numeric = (loss(step) - loss(-step)) / (2 * step)
    analytic = sum(np.sum(res.grads[k] * d[k]) for d in (dx, ds, dp) for k in d)
    assert abs(numeric - analytic) <= 1e-6 * abs(analytic)


def test_packed_sequences_resets_and_float32():
    """Packed sequences (the signs start again with each), decays of exactly 0 at a token (a reset; σ counts it
    +1) and float32 on C, against the float64 recurrent form."""
    rec = _compile("delta_rows")
    x, _, rng = _case(rec, batch=1, tokens=40, seed=2)
    x["a"][0, 5, 0, :] = 0.0
    x["a"][0, 9, 1, 2] = 0.0
    offsets = np.array([0, 7, 7, 19, 40])
    s0 = {"S": rng.standard_normal((4, 2, 4, 3)), "z": rng.standard_normal((4, 2, 4))}
    want = rec.run(x, form="recurrent", cu_seqlens=offsets, initial_state=s0)
    up = {k: rng.standard_normal(v.shape) for k, v in want.outputs.items()}
    grads = rec.vjp(x, up, form="recurrent", backend="numpy", cu_seqlens=offsets, initial_state=s0).grads
    x32 = {k: v.astype(np.float32) for k, v in x.items()}
    s32 = {k: v.astype(np.float32) for k, v in s0.items()}
    want32 = rec.run({k: v.astype(np.float64) for k, v in x32.items()}, form="recurrent", cu_seqlens=offsets,
                     initial_state=s32)
    for backend in ("numpy", "c"):
        for form in rec.forms:
            got = rec.run(x, form=form, backend=backend, cu_seqlens=offsets, initial_state=s0)
            for key, ref in want.outputs.items():
                assert _rel(got.outputs[key], ref) <= 1e-10, (backend, form, key)
            for key, ref in want.final_state.items():
                assert _rel(got.final_state[key], ref) <= 1e-10, (backend, form, key)
            back = rec.vjp(x, up, form=form, backend=backend, cu_seqlens=offsets, initial_state=s0)
            for key, ref in grads.items():
                assert _rel(back.grads[key], ref) <= 1e-9, (backend, form, key)
            single = rec.run(x32, form=form, backend=backend, cu_seqlens=offsets, initial_state=s32)
            for key, ref in want32.outputs.items():
                assert _rel(single.outputs[key], ref) <= 5e-4, (backend, form, key)



def test_an_elementwise_decay_of_either_sign_is_refused_with_its_reason():
    """Elementwise, a decay's signs are not taken apart (σ ⊙ k⊗v is no rank-one write): the program keeps the
    recurrent form, and the reason says it is the sign."""
    rec = linrec.compile(HEAD.format(causal="") + "input X[dk, dv] in [−1, 1]\nstate S[dk, dv]\nS = X*S + k⊗v\n"
                         "output o = q·S\n", "elementwise.lin")
    assert rec.forms == ("recurrent",)
    why = rec.decomposition.why_not("parallel")
    assert "the decay `X` of 'S' can be zero or negative" in why and "(a decay elementwise is taken positive: the " \
        "signs of a decay of the rows or of the value axis are taken apart)" in why, why

"""The parallel and chunkwise backward of states with rank-one corrections (docs/gradients.md: the UT
transform's solve, transposed, per chunk) and of states whose value axis decays (S·diag(e^m)): against the
recurrent backward at 1e-9 in float64 (relative to each gradient's largest entry,
test_grad.assert_same_gradients) and 5e-4 in float32, for every example whose decomposition has corrections —
found from the decomposition, not by name — and for programs of the same structure: several corrections on
either side of a per-key decay, the transposed convention, a vector state, a read before the update; a value
decay beside a scalar or a per-key decay, in either convention. Cases: ragged T with chunks that do not divide
it, odd sizes, T = 1, strong decay (log-decays to about −20 and beyond), random initial states and
final-state gradients.
"""
from __future__ import annotations

import numpy as np
import pytest

import linrec
from linrec.gradients import gradient_refusal
from test_grad import ALL_EXAMPLES, arrays_for, assert_same_gradients, example, float32

WITH_CORRECTIONS = [name for name in ALL_EXAMPLES if "chunkwise" in example(name).decomposition.forms
                    and any(t.corrections for t in example(name).decomposition.transitions)]

PROGRAMS = {
    # three corrections (two erasures, one of them behind a per-key decay, and their product) and two writes
    "several": """
recurrence several(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], a[dk], u[dv], beta in (0, 1), c in (0, 1)
input g[dk] <= 0
kn = l2norm(k)
an = l2norm(a)
state S[dk, dv]
S = (I − beta·kn⊗kn)·diag(exp(g))·(I − c·an⊗an)·S + beta·kn⊗v + an⊗u
output o = q·S
""",
    # the transposed convention (S·(I − β k⊗k)), a read before the update, a vector state with a correction
    "transposed": """
recurrence transposed(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], beta in (0, 1), g <= 0
kn = l2norm(k)
state S[dv, dk], z[dk]
y = S·q
S = exp(g)·S·(I − beta·kn⊗kn) + beta·v⊗kn
z = (I − beta·kn⊗kn)·z + kn
output o = y + S·sigmoid(q)
output m = q·z
""",
    # both axes decay: a scalar decay of the rows, a gate per value column (log: logsigmoid), a read before
    "value decay": """
recurrence valued(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], g <= 0, a[dv]
state S[dk, dv]
y = q·S
S = exp(g)·S·diag(sigmoid(a)) + k⊗v
output o = y + sigmoid(q)·S
""",
    # the transposed convention: S[dv, dk] decays per key channel from the right and per value from the left
    "value decay, transposed": """
recurrence valued_t(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], g[dk] <= 0, gv[dv] <= 0
state S[dv, dk]
S = diag(exp(gv))·S·diag(exp(g)) + v⊗k
output o = S·q
""",
}


def _program(kind: str, name: str) -> linrec.Recurrence:
    return example(name) if kind == "example" else linrec.compile(PROGRAMS[name], f"{name.replace(' ', '_')}.lin")


CASES = [("example", name) for name in WITH_CORRECTIONS] + [("program", name) for name in PROGRAMS]


def test_the_examples_with_corrections():
    """The examples found from their decompositions: the delta rule's family."""
    assert set(WITH_CORRECTIONS) >= {"deltanet", "gated_deltanet", "gdn2", "comba"}


@pytest.mark.parametrize("kind, name", CASES)
def test_against_the_recurrent_backward(kind, name):
    rec = _program(kind, name)
    small = {d.name: min(d.default, 6) for d in rec.program.dims}
    odd = {d.name: 5 + 2 * i for i, d in enumerate(rec.program.dims)}
    for form in ("parallel", "chunkwise"):
        assert gradient_refusal(rec, form, "numpy") is None
    # (batch, tokens, heads, dims, decay scale, chunk): chunks that do not divide T, T = 1, strong decay
    for batch, tokens, heads, dims, scale, chunk in [(2, 13, 3, small, 1.0, 4), (1, 11, 2, odd, 1.0, 5),
                                                    (1, 1, 2, small, 1.0, None), (2, 37, 2, small, 40.0, 8),
                                                    (1, 100, 1, small, 1.0, None)]:
        x, p, s0, g_out, g_state = arrays_for(rec, batch, tokens, heads, dims, seed=tokens, decay_scale=scale)
        reference = rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, params=p, dims=dims)
        for form in ("parallel", "chunkwise"):
            got = rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, params=p, dims=dims, form=form,
                          chunk_size=chunk)
            assert_same_gradients(got, reference)
            got = rec.vjp(float32(x), float32(g_out), grad_final_state=float32(g_state), initial_state=float32(s0), params=float32(p),
                          dims=dims, form=form, chunk_size=chunk)
            assert all(g.dtype == np.float32 for g in got.grads.values())
            assert_same_gradients(got, reference, 5e-4)


@pytest.mark.parametrize("name, tokens", [("gated_deltanet", 2000), ("gdn2", 600)])
def test_strong_decay_over_many_tokens(name, tokens):
    """Log-decays down to −80 per token (a scalar decay, and one per key channel, behind the correction) over
    T = 2000 and 600: every exponent is a difference ≤ 0 of float64 prefix sums, so the gradients stay finite
    and agree with the recurrent backward's to 1e-9 (chunkwise; parallel: one chunk of T = 300)."""
    rec = example(name)
    dims = {"dk": 6, "dv": 5}
    for form, tokens, chunk in (("chunkwise", tokens, 64), ("parallel", 300, None)):
        x, p, s0, g_out, g_state = arrays_for(rec, 1, tokens, 2, dims, seed=5, decay_scale=40.0)
        assert x["g"].min() < -20
        reference = rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, params=p, dims=dims)
        got = rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, params=p, dims=dims, form=form,
                      chunk_size=chunk)
        assert all(np.all(np.isfinite(g)) for g in got.grads.values())
        assert_same_gradients(got, reference)
        got = rec.vjp(float32(x), float32(g_out), grad_final_state=float32(g_state), initial_state=float32(s0), params=float32(p),
                      dims=dims, form=form, chunk_size=chunk)
        assert all(np.all(np.isfinite(g)) for g in got.grads.values())
        assert_same_gradients(got, reference, 5e-4)


def test_the_value_decays_are_what_is_tested():
    """The value-decay programs decompose with a decay of the value axis (of Sᵀ's, for the transposed one)."""
    for name in ("value decay", "value decay, transposed"):
        (t,) = _program("program", name).decomposition.transitions
        assert t.value_log_decay is not None and not t.corrections


def test_the_chunk_size_changes_nothing():
    """The gradients do not depend on the chunk (1, one that does not divide T, T itself, more than T)."""
    rec = example("gated_deltanet")
    x, p, s0, g_out, g_state = arrays_for(rec, 2, 19, 2, {"dk": 5, "dv": 4}, seed=2)
    runs = [rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, form="chunkwise", chunk_size=c)
            for c in (1, 7, 19, 64)]
    for other in runs[1:]:
        assert_same_gradients(other, runs[0], 1e-12)


def test_emitted_backward_names_the_corrections():
    """The generated chunkwise backward hands the corrections to both scans and seeds their adjoints."""
    source = example("deltanet").emit_gradient("chunkwise")
    assert source.count("corrections=S_corrections") == 2  # the forward scan and its backward
    assert "S_grads.corrections[0][0]" in source and "S_grads.corrections[0][1]" in source


def test_the_parallel_backward_of_a_long_non_causal_delta_rule_in_float32():
    """The parallel form's one chunk of T tokens runs its backward in sub-chunks: the UT transform's solve over
    the whole chunk had lost the float32 accuracy of the initial state's gradient — a product of T
    contractions — (8.8e-3 relative at T = 200 against the float64 recurrent backward; found by a probe with
    this program, which `linrec verify --grad --dtype float32` failed)."""
    rec = linrec.compile("""recurrence nc_delta(dk = 8, dv = 6) noncausal
input q[dk], k[dk], v[dv]
input beta in (0, 1)
kn = l2norm(k)
state S[dk, dv]
S = (I − beta·kn⊗kn)·S + beta·kn⊗v
output o = q·S
""", "nc_delta.lin")
    x, p, s0, g_out, g_state = arrays_for(rec, 1, 200, 1, seed=0)
    reference = rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, params=p)
    got = rec.vjp(float32(x), float32(g_out), grad_final_state=float32(g_state), initial_state=float32(s0),
                  params=float32(p), form="parallel")
    scale = float(np.max(np.abs(reference.grads["S"])))
    assert np.max(np.abs(got.grads["S"] - reference.grads["S"])) <= 5e-5 * scale
    assert_same_gradients(got, reference, 5e-4)

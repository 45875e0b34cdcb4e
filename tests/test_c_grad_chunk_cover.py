"""The C parallel and chunkwise backward of the structures the C chunk kernels take through a change of frame
(linrec.c.grad_chunk_scans; numpy.adjoint_frames, rows_only): an elementwise decay (Mamba-1: each column a state
of its own, as heads), a decay of the value axis and value-side corrections (the gated Oja rule: the
transpose; under a decay of the rows too: then its columns as heads), a decay of the value axis alone (the
columns as heads), a vector state read as a value (preconditioned DeltaNet's A, HGRN-style `z*sigmoid(g)`: the
readout g·z with gradient 1) — each form on C against the NumPy recurrent backward (the adjoint of the
statements as written) at 1e-9 in float64 and 5e-4 in float32: ragged T by chunks that do not divide it,
T = 1, strong decays, random initial states and final-state gradients; bit for bit the same on one thread and
on four; `linrec check` lists the forms on C. The sizes are tests/test_c_grad.py's (dk = 5, dv = 7), so the
recurrent C forwards these states run are tests/test_c_grad_cover.py's kernels; the programs share the chunk
kernels where they can (each kernel is a build)."""
import numpy as np
import pytest

import linrec
from linrec import gradients
from linrec.c import scan_kernels
from linrec.cli import main
from test_c_grad_chunkwise import assert_resets_as_recurrent
from test_c_grad_cover import PROGRAMS as COVER, DIMS, _call
from test_grad import float32, worst_error

EXAMPLES = ("mamba1", "gated_oja", "preconditioned_deltanet")
FORMS = ("parallel", "chunkwise")

# one program per structure beside the examples — an elementwise decay, a vector state read as a value (HGRN-
# style, decaying per row and not at all; one beside it stays its initial state), value-side corrections under
# decays of both axes (test_c_grad_cover's, readouts before and after the update: its transpose's columns as
# heads) — and a decay of the value axis alone, its columns as heads. (elementwise_gated's S and vector_values'
# z run the examples' kernels: a kernel is specialized for a scan's structure, not for the program around it.)
PROGRAMS = {
    "elementwise_gated": """recurrence elementwise_gated(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], X[dk, dv] <= 0
state S[dk, dv]
S = exp(X)*S + tanh(k)⊗(v*sigmoid(v))
output o = (q·S)*sigmoid(v) + v
""",
    "vector_values": """recurrence vector_values(dk = 5, dv = 7)
input x[dk], f[dk], g[dk]
state z[dk], n[dk], m[dk]
z = sigmoid(f)*z + (1 − sigmoid(f))*x
n = n + sigmoid(x)
m = m
output y = z*sigmoid(g) + n*x
""",
    "value_corrections": COVER["value_corrections"],
    "value_axis_decay": """recurrence value_axis_decay(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], g <= 0, gv[dv] <= 0
state S[dk, dv]
S = exp(g)·S·diag(exp(gv)) + k⊗v
output o = q·S
""",
}

# (batch, tokens, heads, chunk_size, decay_scale): ragged T by a chunk that does not divide it; T = 1; a
# chunk longer than the kernels' sub-chunks (16 or 32 tokens) over a ragged T, under strong decays
CASES = [(2, 13, 3, 5, None), (2, 1, 2, None, None), (1, 40, 2, 36, 40.0)]


@pytest.fixture(scope="module")
def recs():
    out = {name: linrec.load(f"examples/{name}.lin") for name in EXAMPLES}
    out.update((name, linrec.compile(text, f"{name}.lin")) for name, text in PROGRAMS.items())
    return out


def _forms(rec, x, up, s0, gT, chunk):
    return {form: rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", form=form,
                          chunk_size=chunk) for form in FORMS}


def test_listed_on_c(recs, capsys):
    for name, rec in recs.items():
        assert all(gradients.gradient_refusal(rec, form, "c") is None for form in FORMS), name
    for name in EXAMPLES:
        assert main(["check", f"examples/{name}.lin"]) == 0
        listed = capsys.readouterr().out.split("gradients")[1]
        for form in FORMS:
            assert f"{form:<11} available (backends: numpy, c)" in listed, (name, form)


@pytest.mark.parametrize("name", EXAMPLES + tuple(PROGRAMS))
def test_float64_matches_the_numpy_recurrent_backward(recs, name):
    rec = recs[name]
    for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=i, decay_scale=scale)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        for form, got in _forms(rec, x, up, s0, gT, chunk).items():
            assert worst_error(got.grads, want.grads) <= 1e-9, (name, form, CASES[i])
            assert worst_error(got.outputs, want.outputs) <= 1e-9, (name, form, CASES[i])
            assert worst_error(got.final_state, want.final_state) <= 1e-9, (name, form, CASES[i])
            assert all(g.dtype == np.float64 for g in got.grads.values())


@pytest.mark.parametrize("name", ["mamba1", "gated_oja"])  # (the two frames; float32 kernels: each a build)
def test_float32_within_5e_4_of_float64(recs, name):
    rec = recs[name]
    for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=10 + i, decay_scale=scale)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        for form, got in _forms(rec, float32(x), float32(up), float32(s0), float32(gT), chunk).items():
            assert all(g.dtype == np.float32 for g in got.grads.values())
            assert worst_error(got.grads, want.grads) <= 5e-4, (name, form, CASES[i])


@pytest.mark.parametrize("name", EXAMPLES)
def test_threads_give_the_same_bits(recs, name, monkeypatch):
    """(batch row, head) pairs fewer than the threads and more (the frames' heads: H·dv for Mamba-1): the
    gradients of one thread, bit for bit (the small-work rule, which would run these tiny calls on one
    thread, lifted)."""
    rec = recs[name]
    monkeypatch.setattr(scan_kernels, "SMALL_WORK", 0)
    for batch, heads in ((1, 1), (3, 5)):
        x, up, s0, gT = _call(rec, batch, 21, heads, seed=3)
        runs = []
        for threads in ("1", "4"):
            monkeypatch.setenv("LINREC_NUM_THREADS", threads)
            runs.append(_forms(rec, x, up, s0, gT, 8))
        for form in FORMS:
            assert worst_error(runs[1][form].grads, runs[0][form].grads) == 0.0, (name, form)


def test_resets_on_the_value_axis(recs):
    """Log-decays of −∞ on the value axis (the gated Oja rule's gv: the frames move it to the rows)."""
    assert_resets_as_recurrent(recs["gated_oja"], "gv")

"""The C recurrent backward of the programs it took last (issue 24): a program derived in stages
(preconditioned DeltaNet: its stages' C backwards, from the last), elementwise decays (Mamba-1's
`exp(A·diag(dt))*S`: templates/c_grad_elementwise.c.j2), vector states an output reads as values (HGRN-
style `z*sigmoid(g)`: the same kernel), decays of the value axis and rank-one corrections on the value side
(the gated Oja rule's `S·diag(exp(gv))·(I − β·v⊗v)`: templates/c_grad_value_side.c.j2, which also takes
key-side corrections beside a decay of the value axis), non-causal programs (readouts of the final state:
linrec.c.grad_scans) — against the NumPy recurrent backward, the adjoint of the statements as written, at
1e-9 in float64 and 5e-4 in float32:
ragged T, T = 1, several checkpoint intervals, strong decays, random initial states and final-state
gradients; the same gradients on one thread and on four. One size (dk = 5, dv = 7, as tests/test_c_grad.py)
so that the kernels are built once."""
import numpy as np
import pytest

import linrec
from linrec import gradients
from linrec.c import grad_elementwise, scan_kernels
from linrec.dsl.errors import LinrecError
from test_c_grad import DIMS, _call
from test_grad import float32, worst_error


# vector states read as values before their update and after it, beside readouts q·z; decays per row, per
# token (z and c: the same kernel, each decay becomes one per element) and none; a matrix state with an
# elementwise decay, two writes and readouts before and after the update; two value-side corrections under
# decays of both axes; two key-side ones beside a decay of the value axis; one under a scalar decay (carried on the value axis: gated_oja's kernel); a non-causal
# program (its outputs read the final states), with a vector state read as a value; states that stay their
# initial states (`m = m`), unread and read
PROGRAMS = {
    "vector_values": """recurrence vector_values(dk = 5, dv = 7)
input x[dk], f[dk], g[dk], a
state z[dk], c[dk], n[dk], m[dk]
output y = z*sigmoid(g) + c*x
z = sigmoid(f)*z + (1 − sigmoid(f))*x
c = exp(−softplus(a))*c + x
n = n + sigmoid(x)
m = m
output w = (g·z)*x + (x·c)*g + n*x
""",
    "elementwise_before": """recurrence elementwise_before(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], k2[dk], v2[dv], dt[dv] > 0
param A_log[dk, dv] per head = log(uniform(1, 16, seed=0))
param A[dk, dv] per head = −exp(A_log)
state S[dk, dv]
output p = q·S
S = exp(A·diag(dt))*S + k⊗v + tanh(k2)⊗v2
output o = (2*q)·S
""",
    "value_corrections": """recurrence value_corrections(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], u[dv], a[dk], gv[dv] <= 0, beta in (0, 1), gamma in (0, 1)
vn = l2norm(v)
un = l2norm(u)
state S[dk, dv]
output p = q·S
S = diag(sigmoid(a))·S·diag(exp(gv))·(I − beta·vn⊗vn − gamma·un⊗un) + beta·k⊗vn + k⊗un
output o = q·S
""",
    "key_corrections_value_decay": """recurrence key_corrections_value_decay(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], u[dk], beta in (0, 1), gamma in (0, 1), gv[dv] <= 0, g[dk] <= 0
kn = l2norm(k)
un = l2norm(u)
state S[dk, dv]
output p = q·S
S = (diag(exp(g)) − beta·kn⊗kn − gamma·un⊗un)·S·diag(exp(gv)) + kn⊗v + un⊗v
output o = q·S
""",
    "final_reads": """recurrence final_reads(dk = 5, dv = 7) noncausal
input q[dk], k[dk], v[dv], g <= 0, x[dk], f[dk]
state S[dk, dv], z[dk], u[dk]
S = exp(g)*S + k⊗v
z = sigmoid(f)*z + x
u = u
output o = q·S
output y = z*x + (q·z)*f + (f·u)*q
""",
    "scalar_decay_value_correction": """recurrence scalar_decay_value_correction(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], g <= 0, beta in (0, 1)
vn = l2norm(v)
state S[dk, dv]
S = exp(g)·S·(I − beta·vn⊗vn) + beta·k⊗vn
output o = q·S
""",
}
EXAMPLES = ("preconditioned_deltanet", "mamba1", "gated_oja")


@pytest.fixture(scope="module")
def recs():
    out = {name: linrec.load(f"examples/{name}.lin") for name in EXAMPLES}
    out.update((name, linrec.compile(text, f"{name}.lin")) for name, text in PROGRAMS.items())
    return out


# (batch, tokens, heads, chunk_size, decay_scale): ragged T with several checkpoint intervals (one token, a
# segment longer than the sequence, √T), T = 1, strong decays
CASES = [(2, 13, 3, None, None), (1, 13, 2, 1, None), (1, 9, 2, 64, None), (2, 1, 2, None, None),
         (1, 12, 2, 5, 40.0)]


def test_the_c_backend_builds_them(recs):
    for name, rec in recs.items():
        assert gradients.gradient_refusal(rec, "recurrent", "c") is None, name


@pytest.mark.parametrize("name", EXAMPLES + tuple(PROGRAMS))
def test_float64_matches_the_numpy_recurrent_backward(recs, name):
    rec = recs[name]
    for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=i, decay_scale=scale)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", chunk_size=chunk)
        assert worst_error(got.grads, want.grads) <= 1e-9, (name, CASES[i])
        assert worst_error(got.outputs, want.outputs) <= 1e-9, (name, CASES[i])
        assert worst_error(got.final_state, want.final_state) <= 1e-9, (name, CASES[i])
        assert all(g.dtype == np.float64 for g in got.grads.values())


@pytest.mark.parametrize("name", ["mamba1", "gated_oja"])  # (float32 kernels of two programs: each is a build)
def test_float32_within_5e_4_of_float64(recs, name):
    rec = recs[name]
    for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=10 + i, decay_scale=scale)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        got = rec.vjp(float32(x), float32(up), initial_state=float32(s0), grad_final_state=float32(gT), dims=DIMS,
                      backend="c", chunk_size=chunk)
        assert all(g.dtype == np.float32 for g in got.grads.values())
        assert worst_error(got.grads, want.grads) <= 5e-4, (name, CASES[i])


@pytest.mark.parametrize("name", EXAMPLES)
def test_threads_give_the_same_gradients(recs, name, monkeypatch):
    """Pairs (batch row, head) fewer than the threads and more: bit for bit the gradients of one thread (the
    small-work rule, which would run these tiny calls on one thread, lifted)."""
    rec = recs[name]
    monkeypatch.setattr(scan_kernels, "SMALL_WORK", 0)
    for batch, heads in ((1, 2), (3, 5)):
        x, up, s0, gT = _call(rec, batch, 11, heads, seed=3)
        runs = []
        for threads in ("1", "4"):
            monkeypatch.setenv("LINREC_NUM_THREADS", threads)
            runs.append(rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c",
                                chunk_size=3))
        assert worst_error(runs[1].grads, runs[0].grads) == 0.0


def test_stages_run_their_c_backwards_from_the_last(recs):
    """The staged program's C backward is its stages' (the emitted module says so, each calling the kernels);
    the stage that hands its vector state on reads it as a value, in the elementwise kernel. Each stage's C
    recurrent forward is a kernel of its own beside the whole program's, at the same sizes and dtype (the
    stages share the program's source: the disk cache once gave one's kernel for the other)."""
    rec = recs["preconditioned_deltanet"]
    text = rec.emit_gradient("recurrent", "c")
    assert text.index("backward of stage 2") < text.index("backward of stage 1")
    assert text.count("adjoint_recurrent(") == 2
    x, up, s0, gT = _call(rec, 1, 6, 2, seed=9)
    for _ in range(2):  # (the whole program's forward after the stages', then before them)
        whole = rec.run(x, initial_state=s0, dims=DIMS, backend="c")
        got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c")
        assert worst_error(got.outputs, whole.outputs) <= 1e-9
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    assert worst_error(got.grads, want.grads) <= 1e-9


def test_the_kernels_take_the_numpy_scans_arguments():
    """grad_elementwise's scans against linrec.numpy.adjoint_scan's, called directly: an elementwise decay,
    readouts before and after the update, with a chunk that does not divide T."""
    rng = np.random.default_rng(8)
    B, T, H, K, V = 2, 10, 3, 5, 7  # (elementwise_before's kernel: no other build)
    s0 = rng.standard_normal((B, H, K, V))
    log_decay = -rng.uniform(0, 3, (B, T, H, K, V))
    writes = [(rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, V))) for _ in range(2)]
    queries = [(rng.standard_normal((B, T, H, K)), True), (rng.standard_normal((B, T, H, K)), False)]
    grad_readouts = [rng.standard_normal((B, T, H, V)) for _ in queries]
    grad_final = rng.standard_normal((B, H, K, V))
    reads, final, starts = grad_elementwise.elementwise_checkpoints(s0, log_decay, writes, queries, 4)
    got = grad_elementwise.elementwise_recurrent(s0, log_decay, writes, queries, starts, 4, grad_readouts, grad_final)
    want_reads, want_final, want_starts = linrec.numpy.adjoint_scan.decay_scan(s0, log_decay, writes, queries, 4)
    want = linrec.numpy.adjoint_scan.decay_scan_backward(s0, log_decay, writes, queries, want_starts, 4,
                                                         grad_readouts, grad_final)
    assert max(np.abs(a - b).max() for a, b in zip(reads, want_reads)) <= 1e-12
    assert np.abs(final - want_final).max() <= 1e-12
    pairs = [(got.log_decay, want.log_decay), (got.initial_state, want.initial_state)] + \
        [x for g, w in zip(got.writes, want.writes) for x in zip(g, w)] + list(zip(got.queries, want.queries))
    assert max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in pairs) <= 1e-12


NOT_TAKEN = {  # (program, the structural reason the C backward gives)
    "summed_attention": ("""recurrence summed_attention(dk = 4, dv = 4)
input q[dk], k[dk], v[dv]
output o = softmax(seq(k)·q)·seq(v) + sum(seq(k)·q)*v
""", "reads the sequence"),
    "unchanging_value": ("""recurrence unchanging_value(dk = 4, dv = 4)
input x[dk]
state z[dk]
z = z
output y = z*x
""", "neither decays nor is written"),
    "corrected_values": ("""recurrence corrected_values(dk = 4, dv = 4)
input k[dk], beta in (0, 1)
state z[dk]
z = z − beta*k*(k·z) + k
output y = z
""", "rank-one corrections"),
}


@pytest.mark.parametrize("name", sorted(NOT_TAKEN))
def test_what_it_still_refuses_says_why(name):
    source, reason = NOT_TAKEN[name]
    rec = linrec.load(source) if source.endswith(".lin") else linrec.compile(source, f"{name}.lin")
    assert reason in gradients.gradient_refusal(rec, "recurrent", "c")
    assert gradients.gradient_refusal(rec, "recurrent", "numpy") is None
    with pytest.raises(LinrecError, match=reason):
        rec.vjp({}, {}, backend="c")

"""The C backend's parallel and chunkwise backward (linrec.c.grad_chunk, templates/c_grad_chunk.c.j2) against
the NumPy recurrent backward — the adjoint of the statements as written — at 1e-9 in float64 and 5e-4 in
float32: GLA (a decay per row), gated DeltaNet (per token, with a correction), DeltaNet (no decay, a
correction), Mamba-2 and RetNet (per token), and a program whose readouts read the state before the update.
The sizes are tests/test_c_grad.py's (dk = 5, dv = 7), so the forward kernels, which are the recurrent
backward's, are shared with it; the cases vary what the kernels take at run time: T (ragged, 1), chunks that
do not divide T and chunks longer than the kernel's sub-chunks (grad_chunk_kernels.sub_chunk: 32 tokens, 16
with corrections), strong and mild decays (the two ways of the per-row scores), random initial states and
final-state gradients, threads."""
import numpy as np
import pytest

import linrec
from linrec import gradients
from linrec.c import grad_chunk_kernels, grad_forward, scan_kernels
from linrec.dsl.errors import RuntimeInputError
from test_c_grad import DIMS, STRUCTURES, _call
from test_grad import float32, worst_error

EXAMPLES = ("gla", "gated_deltanet", "deltanet", "mamba2", "retnet")
FORMS = ("parallel", "chunkwise")

# (batch, tokens, heads, chunk_size, decay_scale): ragged T by a chunk that does not divide it; the default
# chunk (64) over T = 40 (one sub-chunk and a ragged one); chunks of 50 over T = 70 (two sub-chunks, the
# second ragged, then a short chunk) under strong decays (log-decays to about −78); T = 1
CASES = [(2, 13, 3, 5, None), (1, 40, 2, None, None), (1, 70, 2, 50, 40.0), (2, 1, 2, None, None)]


@pytest.fixture(scope="module")
def recs():
    return {name: linrec.load(f"examples/{name}.lin") for name in EXAMPLES}


def _both_forms(rec, x, up, s0, gT, chunk):
    return {form: rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", form=form,
                          chunk_size=chunk) for form in FORMS}


@pytest.mark.parametrize("name", EXAMPLES)
def test_float64_matches_the_numpy_recurrent_backward(recs, name):
    rec = recs[name]
    for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=i, decay_scale=scale)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        for form, got in _both_forms(rec, x, up, s0, gT, chunk).items():
            assert worst_error(got.grads, want.grads) <= 1e-9, (name, form, CASES[i])
            assert worst_error(got.outputs, want.outputs) <= 1e-9
            assert worst_error(got.final_state, want.final_state) <= 1e-9
            assert all(g.dtype == np.float64 for g in got.grads.values())


@pytest.mark.parametrize("name", EXAMPLES)
def test_float32_within_5e_4_of_float64(recs, name):
    rec = recs[name]
    for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=10 + i, decay_scale=scale)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        for form, got in _both_forms(rec, float32(x), float32(up), float32(s0), float32(gT), chunk).items():
            assert all(g.dtype == np.float32 for g in got.grads.values())
            assert worst_error(got.grads, want.grads) <= 5e-4, (name, form, CASES[i])


@pytest.mark.parametrize("log_decay", [-20.0, -0.4])
def test_per_row_decays_strong_and_mild(recs, log_decay):
    """A decay per row takes its scores factored, (q ⊙ e^b)·(k ⊙ e^−b)ᵀ, while a sub-chunk's log-decays span
    at most c_scan.SPAN_MAX (40 in float32, 300 in float64), else pairwise in log space: log-decays of −20 on
    every token (a span of 640 over a sub-chunk of 32) take the second way in both dtypes, −0.4 (a span of
    13) the first; both agree with the recurrent backward, and ∂g stays finite where e^{−20·T} underflows."""
    rec = recs["gla"]
    x, up, s0, gT = _call(rec, 1, 75, 2, seed=20)
    x["g"] = np.where(np.arange(75)[None, :, None, None] % 3 == 0, log_decay, log_decay / 2) + 0 * x["g"]
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    for dtype, tolerance in ((np.float64, 1e-9), (np.float32, 5e-4)):
        cast = (lambda d: d) if dtype == np.float64 else float32
        for form, got in _both_forms(rec, cast(x), cast(up), cast(s0), cast(gT), 40).items():
            assert all(np.isfinite(g).all() for g in got.grads.values())
            assert worst_error(got.grads, want.grads) <= tolerance, (form, dtype)


def test_a_decay_below_the_normal_range_has_a_zero_gradient(recs):
    """A token whose decay underflows (float32: a log-decay below about −87) has ∂l = exp(l)·… = 0, exactly,
    as the recurrent backward gives it: ∂l's sums over the sub-chunk would leave it the rounding of their large
    terms (eps32 times their sizes), which a log-decay's chain rule can multiply. Mamba-2 with dt = 50 on every
    fourth token (dt·A down to −800): its per-head A sums dt·∂l over the tokens, and came out 2e-4 off here (6e-4
    at T = 200, dk = dv = 16), against 6e-6 now and 7e-7 from the recurrent backward."""
    rec = recs["mamba2"]
    x, up, s0, gT = _call(rec, 2, 200, 2, seed=2)
    x["dt"][:, 1::4] = 50.0
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    for form, got in _both_forms(rec, float32(x), float32(up), float32(s0), float32(gT), None).items():
        assert worst_error(got.grads, want.grads) <= 5e-4, form
        for param in ("A", "A_log"):
            assert worst_error({param: got.grads[param]}, {param: want.grads[param]}) <= 5e-5, (form, param)
    gdn = recs["gated_deltanet"]
    x, up, s0, gT = _call(gdn, 1, 40, 2, seed=3)
    x["g"][:, ::4] = -200.0
    underflow = np.zeros(x["g"].shape, bool)
    underflow[:, ::4] = True
    recurrent = gdn.vjp(float32(x), float32(up), initial_state=float32(s0), grad_final_state=float32(gT),
                        dims=DIMS, backend="c", form="recurrent")
    assert (recurrent.grads["g"][underflow] == 0).all()
    for form, got in _both_forms(gdn, float32(x), float32(up), float32(s0), float32(gT), None).items():
        assert (got.grads["g"][underflow] == 0).all(), form
        assert (got.grads["g"][~underflow] != 0).all(), form


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_other_structures(name):
    """Readouts before the update (two readouts of one state, a vector state read by q·z), and a state
    carried transposed (tests/test_c_grad.py's programs)."""
    rec = linrec.compile(STRUCTURES[name], f"{name}.lin")
    x, up, s0, gT = _call(rec, 2, 45, 3, seed=7)
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    for chunk in (None, 7):
        for form, got in _both_forms(rec, x, up, s0, gT, chunk).items():
            assert worst_error(got.grads, want.grads) <= 1e-9, (form, chunk)


UNREAD = """recurrence unread(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], g <= 0
state S[dk, dv], U[dk, dv]
S = exp(g)·S + k⊗v
U = U + q⊗v
output o = q·U
"""


def test_a_state_no_readout_reads():
    """S is read by no readout and has no corrections: its kernel has no query-side array (NQ = 0), and its
    gradients come from the final state's alone (the state's terms of the query-side arrays are none)."""
    rec = linrec.compile(UNREAD, "unread.lin")
    x, up, s0, gT = _call(rec, 2, 45, 3, seed=11)
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    assert np.abs(want.grads["k"]).max() > 0.1 and np.abs(want.grads["g"]).max() > 0.1  # (S's, from ∂S_T)
    for chunk in (None, 7):
        for form, got in _both_forms(rec, x, up, s0, gT, chunk).items():
            assert worst_error(got.grads, want.grads) <= 1e-9, (form, chunk)


def test_threads_give_the_same_bits(recs, monkeypatch):
    """(batch row, head) pairs fewer than the threads and more: the same gradients, bit for bit, as on one
    thread (the kernels' small-work rule, which would run these tiny calls on one thread, is lifted)."""
    rec = recs["gated_deltanet"]
    monkeypatch.setattr(scan_kernels, "SMALL_WORK", 0)
    for batch, heads in ((1, 2), (3, 5)):
        x, up, s0, gT = _call(rec, batch, 41, heads, seed=3)
        runs = []
        for threads in ("1", "4"):
            monkeypatch.setenv("LINREC_NUM_THREADS", threads)
            runs.append(_both_forms(rec, x, up, s0, gT, 36))
        for form in FORMS:
            assert worst_error(runs[1][form].grads, runs[0][form].grads) == 0.0


def test_chunk_size_does_not_change_the_gradients(recs):
    rec = recs["gated_deltanet"]
    x, up, s0, gT = _call(rec, 1, 50, 2, seed=4)
    grads = [rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", form="chunkwise",
                     chunk_size=c).grads for c in (1, 13, 33, 100)]
    assert all(worst_error(g, grads[0]) <= 1e-12 for g in grads[1:])


def test_resets(recs):
    assert_resets_as_recurrent(recs["gla"], "g")


def assert_resets_as_recurrent(rec, decay: str):
    """Log-decays of exactly −∞ (a decay of 0, a reset) in input `decay`, at a token of every row and head, in
    one channel and at the last token: the parallel and chunkwise backward, which refused them, run them raised
    to numpy.scan.RESET_LOG_DECAY as the forward forms do — on both backends the NumPy recurrent backward's
    gradients (1e-9 in float64, 5e-4 in float32), ∂ of a reset exactly 0, the chunks ending anywhere."""
    x, up, s0, gT = _call(rec, 2, 23, 2, seed=6)
    x[decay][:, 4] = -np.inf
    x[decay][1, 9, 1, ..., :1] = -np.inf
    x[decay][0, -1] = -np.inf
    resets = np.isneginf(x[decay])
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
    for backend in ("numpy", "c"):
        for form in FORMS:
            for chunk in (4, 5, None):
                got = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend=backend,
                              form=form, chunk_size=chunk)
                assert worst_error(got.grads, want.grads) <= 1e-9, (backend, form, chunk)
                assert np.all(got.grads[decay][resets] == 0.0)
            got = rec.vjp(float32(x), float32(up), initial_state=float32(s0), grad_final_state=float32(gT), dims=DIMS,
                          backend=backend, form=form, chunk_size=5)
            assert worst_error(got.grads, want.grads) <= 5e-4, (backend, form, "float32")
            assert np.all(got.grads[decay][resets] == 0.0)


ELEMENTWISE_DELTA = """recurrence ew_delta(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], beta in (0, 1), X[dk, dv] <= 0
kn = l2norm(k)
state S[dk, dv]
S = exp(X)*S + beta·kn⊗(v − kn·S)
output o = q·S
"""


def test_listed_emitted_and_refused_for_structural_reasons(recs):
    gla = recs["gla"]
    assert all(gradients.gradient_refusal(gla, form, "c") is None for form in FORMS)
    # what the C backward does not take at all (c.grad.why_not) is refused, with the NumPy backend's form
    ew_delta = linrec.compile(ELEMENTWISE_DELTA, "ew_delta.lin")
    why = gradients.gradient_refusal(ew_delta, "chunkwise", "c")
    assert "elementwise" in why and "corrections" in why and "NumPy" in why
    text = recs["gated_deltanet"].emit_gradient("chunkwise", "c")
    assert "fused_forward(" in text and "adjoint_chunkwise(" in text  # (the forward: the fused kernel, c.grad_forward)
    # a chain rule that reads a readout's value (RetNet's groupnorm of q·S) keeps the chunk forward, which gives it
    assert "chunk_checkpoints(" in recs["retnet"].emit_gradient("chunkwise", "c")
    assert "# adjoint of S.correction0_u" in text
    assert "max(tokens, 1)" in recs["gla"].emit_gradient("parallel", "c")  # (one chunk of the whole sequence)
    # (what the recurrent C backward's other kernels take, the chunk kernels take in a change of frame:
    # tests/test_c_grad_chunk_cover.py)


NONCAUSAL = """recurrence decayed_noncausal(dk = 5, dv = 4) noncausal
input q[dk], k[dk], v[dv], g
state S[dk, dv]
S = exp(-softplus(g))·S + k⊗v
output o = q·S
"""


def test_a_noncausal_program_reads_the_final_state():
    """The module takes the readouts of the final state and their adjoints itself: the kernels run without
    readouts."""
    rec = linrec.compile(NONCAUSAL, "noncausal.lin")
    x = rec.random_inputs(2, 13, 2, seed=3)
    up = {"o": np.random.default_rng(4).standard_normal((2, 13, 2, 4))}
    want = rec.vjp(x, up)
    for form in FORMS:
        got = rec.vjp(x, up, form=form, backend="c", chunk_size=4)
        assert worst_error(got.grads, want.grads) <= 1e-9, form


def test_the_kernels_take_the_numpy_scans_arguments():
    """adjoint_chunkwise refuses states before each chunk that another chunk size made."""
    rng = np.random.default_rng(8)
    k, v, q = (rng.standard_normal((1, 9, 1, n)) for n in (5, 7, 5))
    log_decay = -rng.random((1, 9, 1, 1))  # (one per token: Mamba-2's kernels)
    s0 = rng.standard_normal((1, 1, 5, 7))
    outs, final, starts = grad_chunk_kernels.chunk_checkpoints(s0, log_decay, [(k, v)], [(q, False)], 4)
    assert starts.shape == (1, 1, 3, 5, 7)
    with pytest.raises(RuntimeInputError, match="chunk"):
        grad_chunk_kernels.adjoint_chunkwise(s0, log_decay, [(k, v)], [(q, False)], starts, 2, outs, None)


def test_the_fused_forward_gives_the_same_gradients(recs, monkeypatch):
    """The forward from the fused recurrent kernel (c.grad_forward: what calls above its MIN_WORK run; the
    small calls above run the chunk forward), here for every call: a decay per row, one per token, one with
    a correction; ragged chunks, T = 1, random initial states and final-state gradients — float64 to 1e-9 and
    float32 to 5e-4 against the NumPy recurrent backward. (Four fused kernels: GDN in both dtypes.)"""
    monkeypatch.setattr(grad_forward, "MIN_WORK", 0)
    for name, dtypes in (("gla", (np.float64,)), ("mamba2", (np.float64,)),
                         ("gated_deltanet", (np.float64, np.float32))):
        rec = recs[name]
        assert "fused_forward(" in rec.emit_gradient("chunkwise", "c")
        for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
            x, up, s0, gT = _call(rec, batch, tokens, heads, seed=20 + i, decay_scale=scale)
            want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
            for dtype in dtypes:
                cast = (lambda a: a) if dtype == np.float64 else float32
                got = _both_forms(rec, cast(x), cast(up), cast(s0), cast(gT), chunk)
                tol = 1e-9 if dtype == np.float64 else 5e-4
                for form, res in got.items():
                    assert worst_error(res.grads, want.grads) <= tol, (name, form, dtype, CASES[i])
                    assert worst_error(res.outputs, want.outputs) <= tol
                    assert worst_error(res.final_state, want.final_state) <= tol


def test_the_fused_forward_writes_the_chunks_states_where_the_kernel_reads_them(recs):
    """CRecurrent.forward_snapshots(into=…) (c.grad_forward's call): the state after each stop at
    [:, :, i + 1] of a [B, H, n + 1, K, V] array, the same bits as the [B, n, H, K, V] snapshots, index 0 left
    as it was; an array of another shape, or `into` for some states only, refused by name. (The fused kernel of
    the test above: GDN, float64.)"""
    rec = recs["gated_deltanet"]
    x, _, s0, _ = _call(rec, 2, 13, 3, seed=5)
    fused = grad_forward.FusedForward(rec.compiled).recurrent
    stops = np.array([4, 8, 12])
    _, final, snaps = fused.forward_snapshots(x, {}, s0, DIMS, stops)
    into = np.full((2, 3, 4) + s0["S"].shape[2:], 7.0)
    _, final2, got = fused.forward_snapshots(x, {}, s0, DIMS, stops, into={"S": into})
    assert np.array_equal(into[:, :, 1:], np.swapaxes(snaps["S"], 1, 2)) and np.all(into[:, :, 0] == 7.0)
    assert got["S"].base is into and np.array_equal(final["S"], final2["S"])
    with pytest.raises(RuntimeInputError, match=r"into\['S'\] must be .* shape \[2, 3, 4, 5, 7\]"):
        fused.forward_snapshots(x, {}, s0, DIMS, stops, into={"S": into[:, :, 1:].copy()})

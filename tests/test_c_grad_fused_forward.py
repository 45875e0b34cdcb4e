"""The C recurrent backward's forward from the fused recurrent kernel (c.grad: the module calls c.grad_forward's
FusedForward where the program fits it, with one segment for all its states, c.grad_scans.common_segment), and
Recurrence.vjp's finiteness check (gradients._check_finite, gradients.all_finite). The sizes are
tests/test_c_grad.py's (dk = 5, dv = 7), so the backward kernels are shared with it, and the fused kernels with
tests/test_c_grad_chunkwise.py's fused forward test (GLA, gated DeltaNet: float64)."""
import numpy as np
import pytest

import linrec
from linrec import gradients
from linrec.c import grad_forward, grad_scans
from test_c_grad import CASES, DIMS, _call
from test_grad import worst_error

# two matrix states, one segment for both (of GLA's structure and size each: its backward kernel serves both)
TWO_STATES = """recurrence two(dk = 5, dv = 7)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv], P[dk, dv]
S = diag(exp(g))·S + k⊗v
P = diag(exp(2*g))·P + q⊗v
output o = q·S
output p = k·P
"""


@pytest.fixture(scope="module")
def recs():
    return {"gla": linrec.load("examples/gla.lin"), "gated_deltanet": linrec.load("examples/gated_deltanet.lin"),
            "two": linrec.compile(TWO_STATES, "two.lin")}


def _vjp(rec, x, up, s0, gT, chunk=None):
    return rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", form="recurrent",
                   chunk_size=chunk)


def _counting_fused_calls(monkeypatch) -> list:
    """The calls that the fused forward answered (not None), counted."""
    answered = []
    call = grad_forward.FusedForward.__call__

    def counted(self, *args):
        result = call(self, *args)
        answered.append(result is not None)
        return result
    monkeypatch.setattr(grad_forward.FusedForward, "__call__", counted)
    return answered


def test_the_module_calls_the_fused_forward_where_the_program_fits(recs):
    for name in ("gla", "gated_deltanet", "two"):
        text = recs[name].emit_gradient("recurrent", "c")
        assert "fused_forward(" in text and "common_segment(tokens, " in text, name
    # a chain rule that reads a readout's value (RetNet's groupnorm of q·S): the kernels' own forward
    text = linrec.load("examples/retnet.lin").emit_gradient("recurrent", "c")
    assert "fused_forward(" not in text and "chunk = chunk_size  #" in text


@pytest.mark.parametrize("name", ["gla", "gated_deltanet", "two"])
def test_fused_forward_against_the_numpy_recurrent_backward(recs, name, monkeypatch):
    """Every call through the fused forward (MIN_WORK 0): ragged T, a checkpoint every token, a segment
    longer than T, T = 1, strong decays, random initial states and final-state gradients — 1e-9 in float64."""
    monkeypatch.setattr(grad_forward, "MIN_WORK", 0)
    answered = _counting_fused_calls(monkeypatch)
    rec = recs[name]
    for i, (batch, tokens, heads, chunk, scale) in enumerate(CASES):
        x, up, s0, gT = _call(rec, batch, tokens, heads, seed=30 + i, decay_scale=scale)
        want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS)
        got = _vjp(rec, x, up, s0, gT, chunk)
        for what in ("grads", "outputs", "final_state"):
            assert worst_error(getattr(got, what), getattr(want, what)) <= 1e-9, (name, what, CASES[i])
    assert answered == [True] * len(CASES)


@pytest.mark.parametrize("name, decay_scale", [("gla", None), ("gla", 40.0), ("gated_deltanet", None)])
def test_above_min_work_the_same_as_the_kernels_own_forward(recs, name, decay_scale, monkeypatch):
    """A call above MIN_WORK (B·T·H·K·V = 4.2M; the default segment, √T): the vjp with the fused forward
    equals the one with the kernels' own forward (MIN_WORK raised past the call) to 1e-12 in float64 — a
    decay per row (GLA: mild, the backward from the initial state; strong, log-decays to about −20, the
    backward from every checkpoint), one per token with a correction (gated DeltaNet: every checkpoint)."""
    rec = recs[name]
    x, up, s0, gT = _call(rec, 1, 60000, 2, seed=5, decay_scale=decay_scale)
    assert 60000 * 2 * DIMS["dk"] * DIMS["dv"] >= grad_forward.MIN_WORK
    answered = _counting_fused_calls(monkeypatch)
    fused = _vjp(rec, x, up, s0, gT)
    monkeypatch.setattr(grad_forward, "MIN_WORK", 1 << 62)
    own = _vjp(rec, x, up, s0, gT)
    assert answered == [True, False]
    for what in ("grads", "outputs", "final_state"):
        assert worst_error(getattr(fused, what), getattr(own, what)) <= 1e-12, (name, decay_scale, what)


def test_one_segment_for_all_states_by_the_largest():
    """default_segment's rule for the largest state (in its working dtype): √T, fewer tokens where the
    segment's states would pass SEGMENT_BYTES."""
    small, large = np.zeros((1, 2, 5, 7)), np.zeros((1, 2, 128, 128), np.float32)
    assert grad_scans.common_segment(4096, [small]) == 64
    assert grad_scans.common_segment(4096, [small, large]) == 31 == (2 << 20) // (128 * 128 * 4) - 1
    assert grad_scans.common_segment(4096, [large.astype(np.float64), small]) == 15


def test_finite_check_reads_a_sum_and_falls_back_element_by_element():
    """gradients.all_finite: a finite sum, finite; a NaN or an infinity anywhere, not; finite values whose sum
    overflows, finite (the elementwise fallback)."""
    big = np.full((3, 1000), 3e38, np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(np.sum(big))
    assert gradients.all_finite(big)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((3, 1000))
        x[2, 7] = bad
        assert not gradients.all_finite(x)
    assert gradients.all_finite(np.arange(5)) and gradients.all_finite(np.ones(4))


def test_an_output_that_overflows_from_finite_arguments_is_refused(recs):
    """Finite float32 inputs whose output q·S overflows (values of 1e30): the same RuntimeInputError as before
    the check read its sums; a non-finite input gives no error (non-finite in, non-finite out)."""
    rec = recs["gla"]
    x, up, _, _ = _call(rec, 1, 6, 2, seed=1, dtype=np.float32)
    x["v"][:] = 1e30
    x["k"][:] = 1e10
    with pytest.raises(linrec.RuntimeInputError, match="the output 'o' of the statements as written is not "
                                                       "finite for these \\(finite\\) arguments"):
        rec.vjp(x, up, dims=DIMS, backend="c")
    x["q"][0, 0, 0, 0] = np.inf
    got = rec.vjp(x, up, dims=DIMS, backend="c")
    assert not np.all(np.isfinite(got.outputs["o"]))


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_an_output_that_is_nan_from_finite_arguments_names_the_domain_not_an_overflow(backend):
    """sqrt of a random (negative) value: NaN with no overflow anywhere; the error said 'they overflow here;
    scale the inputs down', which sends the user the wrong way."""
    rec = linrec.compile("recurrence t(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                         "S = S + k⊗v\noutput o = q·S + sqrt(v)\n", "partnan.lin")
    x = rec.random_inputs(1, 4, 1, seed=0)
    assert (x["v"] < 0).any()
    with pytest.raises(linrec.RuntimeInputError, match="is NaN for these \\(finite\\) arguments \\(first at index "
                                                       "\\[0, 0, 0, [0-3]\\]\\).*a builtin outside its domain"):
        with np.errstate(invalid="ignore"):
            rec.vjp(x, {"o": np.ones((1, 4, 1, 4))}, backend=backend)


@pytest.mark.parametrize("form", ["recurrent", "chunkwise"])
def test_the_emitted_module_runs_on_its_own(recs, form):
    """`linrec emit --grad --backend c` prints a module that calls fused_forward where the program fits it: the
    module defines it (giving None, its own forward scans then run; linrec's loader replaces it), so saved and
    run without linrec's loader it gives Recurrence.vjp's gradients — GLA, 1e-10 in float64."""
    rec = recs["gla"]
    text = rec.emit_gradient(form, "c")
    assert "def fused_forward(" in text and "= fused_forward(" in text
    module = {}
    exec(compile(text, f"gla_{form}_backward.py", "exec"), module)  # (as a user's saved file: no loader)
    x, up, s0, gT = _call(rec, 2, 13, 3, seed=7)
    outputs, final, grads = module["backward"](x, module["default_params"](3, DIMS), s0, DIMS, up, gT)
    want = rec.vjp(x, up, initial_state=s0, grad_final_state=gT, dims=DIMS, backend="c", form=form)
    assert worst_error(grads, want.grads) <= 1e-10
    assert worst_error(outputs, want.outputs) <= 1e-10 and worst_error(final, want.final_state) <= 1e-10


def test_a_kept_forward_gives_the_backward_without_its_own(recs, monkeypatch):
    """gradients.vjp(saved=…): the backward from the forward kept by saved_forward (linrec.torch's training
    step) equals the whole vjp bit for bit; an input outside its declared range (GLA's g ≤ 0) is refused by
    saved_forward — the check the backward then skips on the same arguments — naming the input: by the fused
    kernel as it reads, and below MIN_WORK (no forward kept) by the scan over the inputs."""
    rec = recs["gla"]
    x, _, s0, _ = _call(rec, 1, 6, 2, seed=8)
    x["g"][0, 4, 1, 2] = 0.25
    small = dict(form="recurrent", backend="c", initial_state=s0, params=None, dims=DIMS, chunk_size=None)
    with pytest.raises(linrec.RuntimeInputError, match="input 'g' must lie in .* found 0.25 at index \\[0, 4, 1, 2\\]"):
        gradients.saved_forward(rec, x, **small)
    x["g"][0, 4, 1, 2] = -0.25
    assert gradients.saved_forward(rec, x, **small) is None  # (below MIN_WORK)
    monkeypatch.setattr(grad_forward, "MIN_WORK", 0)
    x, up, s0, gT = _call(rec, 2, 13, 3, seed=7)
    how = dict(form="recurrent", backend="c", initial_state=s0, params=None, dims=DIMS, chunk_size=4)
    saved = gradients.saved_forward(rec, x, **how)
    assert saved is not None
    kept = gradients.vjp(rec, x, up, grad_final_state=gT, missing="error", saved=saved, **how)
    whole = gradients.vjp(rec, x, up, grad_final_state=gT, missing="error", **how)
    for what in ("grads", "outputs", "final_state"):
        assert worst_error(getattr(kept, what), getattr(whole, what)) == 0, what
    x["g"][1, 5, 2, 3] = 0.5
    with pytest.raises(linrec.RuntimeInputError, match="input 'g' must lie in .* found 0.5 at index \\[1, 5, 2, 3\\]"):
        gradients.saved_forward(rec, x, **how)

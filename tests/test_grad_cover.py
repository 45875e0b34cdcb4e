"""The gradient forms issue 24 left to derive on NumPy (items 1, 2 and 4 of its follow-up; docs/gradients.md):

- the parallel and chunkwise backward of value-side rank-one corrections — examples/gated_oja.lin and variants
  under a decay of the key axis (then per-row systems), of both axes, two corrections — by transposition
  (linrec.numpy.adjoint_frames);
- of key-side corrections beside a decay of the value axis (one system per column: the columns' decay
  joins the rows'), which the parallel and chunkwise backward took before as if the columns did not decay;
- of elementwise decays with rank-one corrections of either side (tests/test_elementwise_corrections.py's
  programs: a state per column, the columns as heads);
- non-causal recurrences (every readout reads the final state: its adjoint takes the readouts' writes
  q ⊗ ∂r, the scan runs without readouts);
- the chunkwise (flash) backward of softmax attention, causal, windowed and non-causal.

Each against the NumPy recurrent backward at 1e-9 in float64 and 5e-4 in float32 (test_grad.assert_same_gradients:
relative to each gradient's largest entry, outputs and final states too) over ragged T with chunks that do
not divide it, T = 1, strong decays (log-decays to about −40), random initial states and final-state
gradients; the recurrent backward of the elementwise programs against central finite differences (float64,
directional, relative error ≤ 1e-6: test_grad.check_gradients).
"""
from __future__ import annotations

import numpy as np
import pytest

import linrec
import test_elementwise_corrections as elementwise
import test_grad
import test_grad_attention as attention
import test_value_side as value_side
from linrec import verify_grad
from linrec.gradients import gradient_refusal
from test_grad import arrays_for, assert_same_gradients, check_gradients, example, float32, worst_error

DIMS = {"dk": 5, "dv": 4}
EXAMPLES = test_grad.EXAMPLES

PROGRAMS = {
    "value_side_key_decay": value_side.HEAD.format(name="vk", update=value_side.VARIANTS["value_side_key_decay"]),
    "value_side_both_decays": value_side.HEAD.format(name="vb", update=value_side.VARIANTS["value_side_both_decays"]),
    "value_side_two": value_side.HEAD.format(name="v2", update=value_side.VARIANTS["value_side_two"]),
    "key_side_both_decays": value_side.HEAD.format(name="kb", update=value_side.VARIANTS["key_side_both_decays"]),
    "value_side_scalar_decay": value_side.HEAD.format(name="vs", update=value_side.VARIANTS["value_side_scalar_decay"]),
    # non-causal: every readout reads the final state (a vector state too; value-side and elementwise corrections)
    "noncausal": test_grad.PROGRAMS["noncausal"],
    "noncausal_value_side": value_side.NONCAUSAL,
    "noncausal_delta": """recurrence delta_encoder(dk = 5, dv = 4) noncausal
input q[dk], k[dk], v[dv], beta in (0, 1), g <= 0
kn = l2norm(k)
state S[dk, dv]
S = exp(g)·(I − beta·kn⊗kn)·S + beta·kn⊗v
output o = q·S
output p = sigmoid(q)·S
""",
    "noncausal_elementwise": elementwise.HEAD.format(name="ew_encoder", update=elementwise.PROGRAMS["key_side"])
    .replace("recurrence ew_encoder(dk = 5, dv = 4)", "recurrence ew_encoder(dk = 5, dv = 4) noncausal"),
} | {f"elementwise_{name}": elementwise.HEAD.format(name=name, update=elementwise.PROGRAMS[name])
     for name in ("key_side", "two_corrections", "value_side", "sandwich", "gated_update")}

_RECS: dict[str, linrec.Recurrence] = {}


def program(name: str) -> linrec.Recurrence:
    if name == "gated_oja":
        return example(name)
    if name not in _RECS:
        _RECS[name] = linrec.compile(PROGRAMS[name], f"{name}.lin")
    return _RECS[name]


def test_the_programs_have_the_structure_they_stand_for():
    """Found from the decompositions: value-side corrections, key-side ones beside a value-axis decay, and
    elementwise decays with corrections of either side."""
    transition = {name: program(name).decomposition.transition("S") for name in ["gated_oja", *PROGRAMS]}
    assert all(transition[n].value_corrections for n in ("gated_oja", "value_side_key_decay", "value_side_two"))
    assert transition["value_side_key_decay"].log_decay.shape == ("dk",)
    assert transition["key_side_both_decays"].corrections and transition["key_side_both_decays"].value_decay.shape
    assert transition["elementwise_value_side"].elementwise and transition["elementwise_value_side"].value_corrections
    assert transition["elementwise_sandwich"].elementwise and len(transition["elementwise_sandwich"].corrections[0][0].shape) == 2


@pytest.mark.parametrize("name", ["gated_oja", *PROGRAMS])
def test_against_the_recurrent_backward(name):
    rec = program(name)
    for form in ("parallel", "chunkwise"):
        assert gradient_refusal(rec, form, "numpy") is None
    # (batch, tokens, heads, decay scale, chunk): chunks that do not divide T, T = 1, strong decay
    for batch, tokens, heads, scale, chunk in [(2, 13, 2, 1.0, 4), (1, 1, 2, 1.0, None), (1, 29, 2, 40.0, 8)]:
        x, p, s0, g_out, g_state = arrays_for(rec, batch, tokens, heads, DIMS, seed=tokens, decay_scale=scale)
        reference = rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, params=p, dims=DIMS)
        for form in ("parallel", "chunkwise"):
            args = dict(params=p, dims=DIMS, form=form, chunk_size=chunk)
            assert_same_gradients(rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, **args), reference)
            low = rec.vjp(float32(x), float32(g_out), grad_final_state=float32(g_state), initial_state=float32(s0),
                          **args)
            assert all(g.dtype == np.float32 for g in low.grads.values())
            assert_same_gradients(low, reference, 5e-4)


def test_strong_decays_reach_the_gradients():
    """The strong-decay case is one: log-decays below −20 somewhere (so the prefix sums span far)."""
    x, *_ = arrays_for(program("gated_oja"), 1, 29, 2, DIMS, seed=29, decay_scale=40.0)
    assert x["gv"].min() < -20


@pytest.mark.parametrize("name", ["elementwise_sandwich", "elementwise_value_side", "key_side_both_decays",
                                  "noncausal_elementwise"])
def test_the_recurrent_backward_against_finite_differences(name):
    check_gradients(program(name), 2, 7, 2, DIMS, seed=3)


def test_a_reset_of_the_value_axis_in_the_chunkwise_backward():
    """A log-decay of −∞ on the value axis (gv), which the chunkwise backward refused: the recurrent
    backward's gradients, ∂gv 0 there."""
    rec = program("gated_oja")
    x, p, s0, g_out, _ = arrays_for(rec, 1, 9, 1, DIMS, seed=1)
    x["gv"][0, 4, 0, 1] = -np.inf
    want = rec.vjp(x, g_out, initial_state=s0, params=p, dims=DIMS).grads
    got = rec.vjp(x, g_out, initial_state=s0, params=p, dims=DIMS, form="chunkwise", chunk_size=4).grads
    assert worst_error(got, want) <= 1e-9 and got["gv"][0, 4, 0, 1] == 0.0


# ---- the chunkwise (flash) backward of softmax attention --------------------------------------------------
TWO_READOUTS = """recurrence two(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], k2[dk]
param W[dk, dk] = randn(seed=0, std=0.3)
output o = softmax(seq(k)·q)·seq(v) + softmax(seq(l2norm(k2)·W)·(2*q))·seq(v*v) + q·W·q
"""
ATTENTION = dict(attention.PROGRAMS, two=lambda: linrec.compile(TWO_READOUTS, "two.lin"))


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_flash_attention_backward_against_the_kv_cache_backward(name):
    """Causal, windowed, non-causal (with and without a window), two readouts with a param in the keys: blocks
    that do not divide T, T = 1, peaked softmaxes."""
    rec = ATTENTION[name]()
    assert gradient_refusal(rec, "chunkwise", "numpy") is None
    dims = {"dk": 6, "dv": 5}
    for tokens, chunk in ((23, 4), (23, 7), (1, None)):
        x = rec.random_inputs(batch=2, tokens=tokens, heads=3, dims=dims, seed=tokens)
        x["q"] *= 3.0
        rng = np.random.default_rng(tokens)
        up = {o.name: rng.standard_normal((2, tokens, 3, 5 if o.name == "o" else 6)) for o in rec.program.outputs}
        reference = rec.vjp(x, up, dims=dims)
        got = rec.vjp(x, up, dims=dims, form="chunkwise", chunk_size=chunk)
        assert_same_gradients(got, reference)
        single = rec.vjp(float32(x), float32(up), dims=dims, form="chunkwise", chunk_size=chunk)
        assert all(g.dtype == np.float32 for g in single.grads.values())
        assert_same_gradients(single, reference, 5e-4)


def test_flash_attention_backward_keeps_one_block_of_scores():
    """The emitted backward runs flash attention and its backward by blocks (no [T, T] score matrix)."""
    code = linrec.load("examples/softmax.lin").emit_gradient("chunkwise")
    assert "flash_attention(" in code and "flash_attention_backward(" in code and "visible_positions" not in code


# ---- programs that read the sequence through params over it: Linformer ------------------------------------
def test_linformer_parallel_backward_against_finite_differences():
    """examples/linformer.lin (E·seq(k), F·seq(v): params over the sequence axis, non-causal, a parallel form
    only): its parallel backward against central differences of its float64 parallel forward, every input
    and param (E and F, of which the call uses the first T positions: zero gradient beyond them)."""
    rec = example("linformer")
    assert gradient_refusal(rec, "parallel", "numpy") is None
    assert "no recurrent forward form" in gradient_refusal(rec, "recurrent", "numpy")
    dims = {"dk": 5, "dv": 4, "kproj": 6, "T": 16}
    rng = np.random.default_rng(0)
    x = rec.random_inputs(2, 11, 2, dims, seed=0)
    base = rec.run(x, form="parallel", dims=dims)
    params = {k: np.array(v) for k, v in base.params.items()}
    g_out = {"o": rng.standard_normal(base.outputs["o"].shape)}
    result = rec.vjp(x, g_out, params=params, dims=dims, form="parallel")
    assert result.grads["E"].shape == params["E"].shape == (6, 16)
    assert not np.any(result.grads["E"][:, 11:]) and np.any(result.grads["E"][:, :11])
    errors = verify_grad.directional_errors(rec, x, params, {}, g_out, {}, result.grads, dims, seed=1,
                                            form="parallel")
    assert set(errors) == {"q", "k", "v", "E", "F"}
    assert max(rel for _, rel in errors.values()) <= 1e-6, errors
    single = rec.vjp(float32(x), float32(g_out), params=float32(params), dims=dims, form="parallel")
    assert_same_gradients(single, result, 5e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_lsh_attention_backward_with_the_buckets_held_fixed(causal):
    """examples/reformer.lin (lsh_attention: the hash is piecewise constant, so the gradient is attention's within
    the fixed buckets): its parallel backward against central differences of both its forwards (the dense one
    and the bucketed chunkwise one: the same function), every input; its chunkwise backward (by the bucketed
    form's blocks) against the parallel one; causal and not, two hash rounds."""
    rec = example("reformer")
    if not causal:
        rec = linrec.compile((EXAMPLES / "reformer.lin").read_text().replace("reformer(dk = 16, dv = 16)",
                                                                            "reformer(dk = 16, dv = 16) noncausal"))
    assert gradient_refusal(rec, "parallel", "numpy") is None
    assert gradient_refusal(rec, "chunkwise", "numpy") is None
    dims = {"dk": 6, "dv": 5}
    x = rec.random_inputs(2, 40, 2, dims, seed=2)
    g_out = {"o": np.random.default_rng(2).standard_normal((2, 40, 2, 5))}
    result = rec.vjp(x, g_out, dims=dims, form="parallel")
    for form in ("parallel", "chunkwise"):
        errors = verify_grad.directional_errors(rec, x, {}, {}, g_out, {}, result.grads, dims, seed=3, form=form)
        assert set(errors) == {"q", "v"} and max(rel for _, rel in errors.values()) <= 1e-6, (form, errors)
    assert_same_gradients(rec.vjp(float32(x), float32(g_out), dims=dims, form="parallel"), result, 5e-4)
    assert_same_gradients(rec.vjp(x, g_out, dims=dims, form="chunkwise"), result)
    assert_same_gradients(rec.vjp(float32(x), float32(g_out), dims=dims, form="chunkwise"), result, 5e-4)

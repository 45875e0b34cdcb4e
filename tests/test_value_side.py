"""Corrections on the value side, and decays on both axes beside a correction (issue 22, item 5).

- examples/gated_oja.lin (flash-linear-attention's gated_oja_rule, `S·diag(exp(gv))·(I − beta·vn⊗vn)`):
  every form `check` lists, on both backends, against the float64 recurrent NumPy form and against its loop
  written from the math (tests/reference_impls.py);
- variants of the same operators — a value-side correction without a decay, under a decay of the key axis,
  under decays of both axes, with a scalar decay, two of them; the key-side twin under decays of both axes
  (a triangular system per value column) — every form against the recurrent one, over ragged T, chunks
  that cut the 16-token sub-blocks, strong decays and resets (log-decay −∞); on C for two of them (the
  kernels of the others are the example's), and C's reason where a triangular system per row or column is
  needed;
- a non-causal program (every readout reads the final state) on both backends; decays of both axes without a
  correction (C: one log-decay per element), with strong decays and resets;
- the programs the forms do not take say why: corrections on both sides, a value-side correction that is
  not under the key axis's decay.

Tolerance: 1e-9 relative to the largest magnitude (float64). C kernels: the example's recurrent form, and
the scans of the example and of the two variants run on C.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import linrec
import reference_impls as ref
from linrec.registry import builds, refusal
from compare import rel_err

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOL = 1e-9
B, H = 2, 2
DIMS = {"dk": 5, "dv": 4}

HEAD = """recurrence {name}(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], v2[dv], k2[dk]
input beta in (0, 1), b2 in (0, 1), g <= 0, gv[dv] <= 0, gk[dk] <= 0
vn = l2norm(v)
kn = l2norm(k)
state S[dk, dv]
output before = q·S
S = {update}
output o = q·S
"""
# name → the update of S; each is derived from its terms, none of them named anywhere in the compiler
VARIANTS = {
    "value_side_no_decay": "S·(I − beta·vn⊗vn) + beta·k⊗vn",
    "value_side_key_decay": "diag(exp(gk))·S·(I − beta·vn⊗vn) + beta·k⊗vn",
    "value_side_both_decays": "diag(exp(gk))·S·diag(exp(gv))·(I − beta·vn⊗vn) + beta·k⊗vn",
    "value_side_scalar_decay": "exp(g)·S·diag(exp(gv))·(I − beta·vn⊗vn) + beta·k⊗vn",
    "value_side_written_out": "S·diag(exp(gv)) − beta·(S·vn)⊗vn + beta·k⊗v",
    "value_side_two": "S·diag(exp(gv))·(I − beta·vn⊗vn)·(I − b2·l2norm(v2)⊗l2norm(v2)) + beta·k⊗vn",
    "key_side_both_decays": "(I − beta·kn⊗kn)·diag(exp(gk))·S·diag(exp(gv)) + beta·kn⊗v",
    "key_side_two_both_decays": "(I − beta·kn⊗kn)·(I − b2·l2norm(k2)⊗l2norm(k2))·diag(exp(gk))·S·diag(exp(gv))"
                                " + beta·kn⊗v",
}
C_VARIANTS = ("value_side_no_decay", "value_side_scalar_decay")  # (their kernels: a plain scan; the example's)
C_REFUSES = {"value_side_key_decay": "triangular system per row", "value_side_both_decays": "triangular system per row",
             "key_side_both_decays": "triangular system per value column"}
REFUSED = {
    # (update, words the reason must hold)
    "both_sides": ("(I − beta·kn⊗kn)·S·(I − beta·vn⊗vn) + beta·kn⊗vn", "both sides"),
    "not_under_the_decay": ("diag(exp(gk))·S − beta·(S·vn)⊗vn + beta·k⊗vn", "under the state's own decay"),
    # a key-side correction with its own factor per value column (a delta rule of a strength per column),
    # in one line and in steps: the reason names that factor and says what the forms take instead
    "per_column_strength": ("exp(g)·S − (kn⊗kn)·(exp(g)·S)·diag(sigmoid(v2)) + kn⊗(sigmoid(v2)*v)",
                            "is scaled per value column by `sigmoid(v2)` (line 8, column 40), "
                            "`diag(sigmoid(v2))` on its right, where its value axis does not decay"),
    "per_column_strength_in_steps": ("diag(exp(gk))·S\nS = S + kn⊗(sigmoid(v2)*(v − kn·S))",
                                     "is scaled per value column by `sigmoid(v2)`"),
    # decays on the two sides summed (each element decays by a sum, no product of two axes' decays): the
    # advice is a decay that is one product, of the factors written (it said "write it once", which cannot be)
    "decays_summed_on_two_sides": ("0.5·diag(exp(gk))·S + 0.5·S·diag(exp(gv)) + k⊗v",
                                   "only the recurrent form runs this update. For those forms, decay by one "
                                   "product, such as `diag(exp(gk))·S·diag(exp(gv))`"),
    # its twin: the correction skips the decay of the value axis
    "skips_the_value_decay": ("S·diag(exp(gv)) − beta·kn⊗(kn·S) + beta·kn⊗v",
                              "has no factor on its right, where its value axis decays by `diag(exp(gv))`: the "
                              "forms take a key-side correction whose factor on the right is the state's own decay"),
}

_recs: dict[str, linrec.Recurrence] = {}


def rec_of(name: str) -> linrec.Recurrence:
    if name not in _recs:
        if name in VARIANTS:
            _recs[name] = linrec.compile(HEAD.format(name=name, update=VARIANTS[name]), f"{name}.lin")
        else:
            _recs[name] = linrec.load(EXAMPLES / f"{name}.lin")
    return _recs[name]


def assert_close(got, want_outputs, want_states, what):
    for kind, have, want in (("output", got.outputs, want_outputs), ("final state", got.final_state, want_states)):
        for name in want:
            err = rel_err(have[name], want[name])
            assert err <= TOL, f"{what}: {kind} {name}: relative error {err:.2e} > {TOL:g}"


def inputs(rec, tokens, seed=0, strong=False, resets=False):
    x = rec.random_inputs(B, tokens, H, DIMS, seed=seed)
    rng = np.random.default_rng(seed + 7)
    for name in ("g", "gv", "gk"):
        if name in x:
            if strong:  # decays down to exp(−40): the prefix sums span thousands
                x[name] = -40 * rng.uniform(0, 1, x[name].shape)
            if resets:  # a decay of exactly 0 now and then
                x[name] = np.where(rng.uniform(size=x[name].shape) < 0.1, -np.inf, x[name])
    s0 = {s.name: rng.standard_normal((B, H) + tuple(DIMS[d] for d in s.shape)) for s in rec.program.states}
    return x, s0


def test_gated_oja_has_every_form_on_both_backends():
    rec = rec_of("gated_oja")
    assert rec.forms == ("recurrent", "parallel", "chunkwise")
    assert rec.decomposition.transition("S").value_corrections
    for form in rec.forms:
        for backend in ("numpy", "c"):
            assert builds(rec.compiled, backend, form), refusal(rec.compiled, backend, form)


@pytest.mark.parametrize("name", C_REFUSES)
def test_c_says_why_where_a_system_per_row_or_column_is_needed(name):
    rec = rec_of(name)
    for form in ("parallel", "chunkwise"):
        assert not builds(rec.compiled, "c", form)
        assert C_REFUSES[name] in refusal(rec.compiled, "c", form).reason


@pytest.mark.parametrize("tokens, chunk", [(37, 8), (70, 64), (1, 4)])
def test_gated_oja_every_form_against_its_loop(tokens, chunk):
    rec = rec_of("gated_oja")
    x, s0 = inputs(rec, tokens, seed=tokens)
    want_o, want_s = ref.gated_oja(x, {}, s0)
    recurrent = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
    assert_close(recurrent, want_o, want_s, "recurrent numpy vs loop")
    for form in rec.forms:
        for backend in ("numpy", "c"):
            got = rec.run(x, form=form, backend=backend, initial_state=s0, chunk_size=chunk, dims=DIMS)
            assert_close(got, recurrent.outputs, recurrent.final_state, f"{form} {backend} vs recurrent")
            assert_close(got, want_o, want_s, f"{form} {backend} vs loop")


@pytest.mark.parametrize("name", VARIANTS)
def test_variants_have_every_form_and_agree(name):
    rec = rec_of(name)
    assert rec.forms == ("recurrent", "parallel", "chunkwise"), rec.decomposition.why_not("parallel")
    for tokens, chunk, seed in ((37, 8, 0), (70, 64, 1)):  # (70: the sub-blocks of 16 cut by the chunks)
        x, s0 = inputs(rec, tokens, seed=seed)
        want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
        for form in ("parallel", "chunkwise"):
            for backend in ("numpy", "c") if name in C_VARIANTS else ("numpy",):
                got = rec.run(x, form=form, initial_state=s0, chunk_size=chunk, dims=DIMS, backend=backend)
                assert_close(got, want.outputs, want.final_state, f"{name} {form} {backend} T={tokens}")


@pytest.mark.parametrize("name", ["value_side_both_decays", "key_side_both_decays", "value_side_scalar_decay"])
@pytest.mark.parametrize("strong, resets", [(True, False), (False, True), (True, True)])
def test_strong_decays_and_resets(name, strong, resets):
    rec = rec_of(name)
    x, s0 = inputs(rec, 45, seed=3, strong=strong, resets=resets)
    want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
    for form, chunk in (("parallel", None), ("chunkwise", 16), ("chunkwise", 7)):
        for backend in ("numpy", "c") if name in C_VARIANTS else ("numpy",):
            got = rec.run(x, form=form, initial_state=s0, chunk_size=chunk, dims=DIMS, backend=backend)
            assert_close(got, want.outputs, want.final_state, f"{name} {form} {backend} chunk {chunk}")


@pytest.mark.parametrize("name", REFUSED)
def test_what_the_forms_do_not_take_says_why(name):
    update, words = REFUSED[name]
    rec = linrec.compile(HEAD.format(name=name, update=update), f"{name}.lin")
    assert rec.forms == ("recurrent",)
    why = rec.decomposition.why_not("chunkwise")
    assert words in why, why
    x, s0 = inputs(rec, 9)
    assert np.all(np.isfinite(rec.run(x, initial_state=s0, dims=DIMS).outputs["o"]))


NONCAUSAL = """recurrence oja_encoder(dk = 8, dv = 8) noncausal
input q[dk], k[dk], v[dv], beta in (0, 1), gv[dv] <= 0
vn = l2norm(v)
state S[dk, dv]
S = S·diag(exp(gv))·(I − beta·vn⊗vn) + beta·k⊗vn
output o = q·S
"""


def test_a_noncausal_program_reads_the_final_state_on_both_backends():
    rec = linrec.compile(NONCAUSAL, "oja_encoder.lin")
    x, s0 = inputs(rec, 29)
    want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
    for form in ("parallel", "chunkwise"):
        for backend in ("numpy", "c"):
            got = rec.run(x, form=form, backend=backend, initial_state=s0, chunk_size=8, dims=DIMS)
            assert_close(got, want.outputs, want.final_state, f"non-causal {form} {backend}")


# decays of both axes without corrections (GLA's general form): on C, one log-decay per element
BOTH_AXES = """recurrence both_axes(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], a[dk] <= 0, b[dv] <= 0, c <= 0
state S[dk, dv], R[dk, dv]
early = q·R
S = diag(exp(a))·S·diag(exp(b)) + k⊗v
R = exp(c)·R·diag(exp(b)) + 0.5·k⊗v
output o = q·S + early + q·R
"""


@pytest.mark.parametrize("strong, resets", [(False, False), (True, True)])
def test_decays_of_both_axes_on_both_backends(strong, resets):
    if "both_axes" not in _recs:
        _recs["both_axes"] = linrec.compile(BOTH_AXES, "both_axes.lin")
    rec = _recs["both_axes"]
    x, s0 = inputs(rec, 41, seed=2)
    rng = np.random.default_rng(9)
    for name in ("a", "b", "c"):
        if strong:
            x[name] = -40 * rng.uniform(0, 1, x[name].shape)
        if resets:
            x[name] = np.where(rng.uniform(size=x[name].shape) < 0.1, -np.inf, x[name])
    want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
    for form in ("parallel", "chunkwise"):
        for backend in ("numpy", "c"):
            got = rec.run(x, form=form, backend=backend, initial_state=s0, chunk_size=16, dims=DIMS)
            assert_close(got, want.outputs, want.final_state, f"both axes {form} {backend}")


@pytest.mark.parametrize("name", ["value_side_key_decay", "value_side_both_decays", "key_side_both_decays"])
@pytest.mark.parametrize("dims", [{"dk": 1, "dv": 5}, {"dk": 5, "dv": 1}])
def test_a_state_of_one_row_or_column(name, dims):
    """dk = 1 (or dv = 1): a decay per row of S has the shape of one per token. The NumPy scans took the key
    axis's decay of a value-side correction for one per token by that shape, and the parallel and chunkwise
    forms came out 1e-2 off the loop, growing with T."""
    rec = rec_of(name)
    x = rec.random_inputs(B, 45, H, dims, seed=3)
    rng = np.random.default_rng(4)
    s0 = {s.name: rng.standard_normal((B, H) + tuple(dims[d] for d in s.shape)) for s in rec.program.states}
    want = rec.run(x, form="recurrent", initial_state=s0, dims=dims)
    for form, chunk in (("parallel", None), ("chunkwise", 16)):
        got = rec.run(x, form=form, initial_state=s0, chunk_size=chunk, dims=dims)
        assert_close(got, want.outputs, want.final_state, f"{name} {form} {dims}")

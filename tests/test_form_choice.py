"""form="auto": a fused compiled kernel runs the recurrent form; otherwise the cheaper measured form."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import linrec
from linrec import form_choice

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DIMS = {"dk": 8, "dv": 8}


def test_numpy_choice_is_the_cheaper_measured_form():
    rec = linrec.load(EXAMPLES / "gated_deltanet.lin")
    form, why = rec.choose_form("numpy", 500, heads=2, batch=1, dims=DIMS, dtype=np.float64)
    costs = form_choice.per_token_cost(rec, "numpy", 2, 1, DIMS, np.float64)
    assert set(costs) == {"recurrent", "chunkwise"} and all(c > 0 for c in costs.values())
    assert form == min(costs, key=costs.get)
    assert "µs/token" in why
    # measured once per process: the same numbers come back
    assert form_choice.per_token_cost(rec, "numpy", 2, 1, DIMS, np.float64) is costs


def test_auto_runs_the_chosen_form():
    rec = linrec.load(EXAMPLES / "gla.lin")
    inputs = rec.random_inputs(batch=1, tokens=100, heads=2, dims=DIMS)
    form, _ = rec.choose_form("numpy", 100, heads=2, batch=1, dims=DIMS, dtype=np.float64)
    auto = rec.run(inputs, backend="numpy")
    chosen = rec.run(inputs, form=form, backend="numpy")
    np.testing.assert_array_equal(auto.outputs["o"], chosen.outputs["o"])


def test_short_sequences_and_compiled_code_take_the_recurrent_form():
    rec = linrec.load(EXAMPLES / "retnet.lin")
    assert rec.choose_form("numpy", form_choice.SHORT)[0] == "recurrent"
    assert rec.choose_form("c", 100000)[0] == "recurrent"
    softmax = linrec.load(EXAMPLES / "softmax.lin")
    assert softmax.choose_form("numpy", 4096)[0] == "chunkwise"  # blocked online softmax


def test_c_without_a_fused_recurrent_kernel_measures_like_numpy():
    """A non-causal program with exponential keys runs every form as a NumPy-prepared scan on C: no fused
    kernel to take on trust, so auto measures (and picks the cheaper measured form); GLA's recurrent form
    is the fused kernel, and so is Performer's (the kernel stabilizes its exponential features itself)."""
    encoder = linrec.compile("""recurrence encoder_exp(dk = 8, dv = 8) noncausal
input q[dk], k[dk], v[dv]
state S[dk, dv]
S = S + exp(k)⊗v
output o = q·S
""", "encoder_exp.lin")
    form, why = encoder.choose_form("c", 500, heads=2, batch=1, dims=DIMS, dtype=np.float64)
    costs = form_choice.per_token_cost(encoder, "c", 2, 1, DIMS, np.float64)
    assert form == min(costs, key=costs.get) and "µs/token" in why
    for name, dims in (("gla", DIMS), ("performer", {"dk": 8, "dv": 8, "m": 16})):
        form, why = linrec.load(EXAMPLES / f"{name}.lin").choose_form("c", 500, heads=2, batch=1, dims=dims)
        assert form == "recurrent" and "compiled recurrent kernel" in why, name

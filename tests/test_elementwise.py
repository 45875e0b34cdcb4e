"""Elementwise transitions of a matrix state (issue 22, item 4): `exp(X)*S` with X a per-token matrix of
log-decays — Mamba-1's selective scan — has parallel and chunkwise forms, one scalar recurrence per element
(linrec.numpy.elementwise_scan, and in C linrec.c.elementwise).

- the compiler recognises the elementwise decay from the structure (however the product is written) and
  lists the forms; beside corrections on both sides or a decay of another shape it gives the reason
  (a correction of one side: tests/test_elementwise_corrections.py);
- NumPy's parallel and chunkwise forms agree with the recurrent form at 1e-9 (float64, relative to the
  largest magnitude) over ragged T, random initial states, several chunk sizes, readouts before and after
  the update, several writes, non-causal programs and strong decays (log-decays down to −20 per token);
- so do C's (a kernel generated per structure: writes, readouts, causality, sizes, dtype), over the same
  programs, ragged T and chunk sizes, strong decays, resets (log-decay −∞) and a NaN; float32 stays close;
  C's recurrent form is the statement kernel; the derived backward is refused with a reason;
- examples/mamba1.lin against its loop written from the math (tests/reference_impls.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import linrec
import reference_impls as ref
from linrec.c import scan as c_scan
from linrec.registry import builds, refusal
from compare import rel_err

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-9
DIMS = {"dk": 5, "dv": 4}

# a per-token matrix of log-decays ≤ 0, read after the update
ELEMENTWISE = """recurrence elementwise(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], G[dk, dv] <= 0
state S[dk, dv]
S = exp(G)*S + k⊗v
output o = q·S
"""

# the same, written with the state first, two elementwise factors, two writes and a readout before the update
ELEMENTWISE_VARIANTS = """recurrence elementwise_variants(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], p[dk], w[dv], G[dk, dv] <= 0, a[dk, dv] in (0, 1)
state S[dk, dv]
early = q·S
S = (S*exp(G))*a + k⊗v + 0.5·p⊗w
output o = q·S + early
"""

NONCAUSAL = """recurrence elementwise_noncausal(dk = 5, dv = 4) noncausal
input q[dk], k[dk], v[dv], G[dk, dv] <= 0
state S[dk, dv]
S = exp(G)*S + k⊗v
output o = q·S
"""

_RECS: dict[str, linrec.Recurrence] = {}


def compiled(name: str, source: str | None = None) -> linrec.Recurrence:
    if name not in _RECS:
        _RECS[name] = linrec.compile(source, f"{name}.lin") if source else linrec.load(ROOT / "examples" / f"{name}.lin")
    return _RECS[name]


def inputs(rec: linrec.Recurrence, batch: int, tokens: int, heads: int, seed: int, strongest: float = -20.0):
    """Normal vectors; log-decays G uniform in [strongest, 0] (decays down to e^−20 per token); a in (0, 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for x in rec.program.inputs:
        shape = (batch, tokens, heads) + tuple(DIMS[d] for d in x.shape)
        out[x.name] = rng.uniform(strongest, 0.0, shape) if x.name == "G" else \
            rng.uniform(0.05, 0.95, shape) if x.name == "a" else rng.standard_normal(shape)
    s0 = {s.name: rng.standard_normal((batch, heads) + tuple(DIMS[d] for d in s.shape)) for s in rec.program.states}
    return out, s0


def assert_forms_agree(rec, x, s0, chunk_sizes=(None, 1, 3, 16), backend="numpy"):
    want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
    for form in ("parallel", "chunkwise"):
        for chunk in chunk_sizes:
            got = rec.run(x, form=form, initial_state=s0, dims=DIMS, chunk_size=chunk, backend=backend)
            for name in want.outputs:
                err = rel_err(got.outputs[name], want.outputs[name])
                assert err <= TOL, f"{form} (chunk {chunk}) output {name}: relative error {err:.2e}"
            for name in want.final_state:
                err = rel_err(got.final_state[name], want.final_state[name])
                assert err <= TOL, f"{form} (chunk {chunk}) final state {name}: relative error {err:.2e}"


# ---- the compiler ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, source", [("elementwise", ELEMENTWISE), ("elementwise_variants", ELEMENTWISE_VARIANTS),
                                          ("elementwise_noncausal", NONCAUSAL), ("mamba1", None)])
def test_an_elementwise_decay_has_every_form(name, source):
    rec = compiled(name, source)
    t = rec.decomposition.transition("S")
    assert t.kind == "elementwise decay" and t.elementwise
    assert t.log_is_exact == ("a" not in {x.name for x in rec.program.inputs})  # log(a) is taken numerically
    assert t.log_decay.shape == ("dk", "dv") and not t.corrections
    assert rec.forms == ("recurrent", "parallel", "chunkwise")


@pytest.mark.parametrize("update, reason", [
    ("S = (I − k⊗k)·(exp(G)*((I − k⊗k)·S)) + k⊗v", "meets another factor of it"),
    ("S = exp(G)*S − k⊗(k·S) − (S·v)⊗v + k⊗v", "rank-one corrections on both sides"),
    ("S = exp(G)*S + 0.5·S + k⊗v", "beside a scalar or diagonal one"),
    ("S = diag(exp(g))·(exp(G)*S) + k⊗v", "meets another factor of it"),
    ("S = (exp(G)*S)·diag(exp(v)) + k⊗v", "and a decay of its value axis"),
])
def test_what_an_elementwise_decay_does_not_take_is_refused_with_a_reason(update, reason):
    rec = linrec.compile(f"""recurrence r(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], g[dk] <= 0, G[dk, dv] <= 0
state S[dk, dv]
{update}
output o = q·S
""", "r.lin")
    assert rec.forms == ("recurrent",)
    assert reason in rec.decomposition.why_not("parallel")
    assert reason in rec.decomposition.why_not("chunkwise")


def test_a_decay_that_can_be_negative_is_refused():
    rec = linrec.compile("""recurrence r(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], M[dk, dv]
state S[dk, dv]
S = M*S + k⊗v
output o = q·S
""", "r.lin")
    assert rec.forms == ("recurrent",)
    assert "can be zero or negative" in rec.decomposition.why_not("parallel")


# ---- NumPy's parallel and chunkwise forms against the recurrent form -----------------------------------------
@pytest.mark.parametrize("tokens", [1, 2, 17, 40])
@pytest.mark.parametrize("name, source", [("elementwise", ELEMENTWISE), ("elementwise_variants", ELEMENTWISE_VARIANTS),
                                          ("elementwise_noncausal", NONCAUSAL)])
def test_forms_agree_with_the_recurrent_form(name, source, tokens):
    rec = compiled(name, source)
    x, s0 = inputs(rec, 2, tokens, 2, seed=tokens)
    assert_forms_agree(rec, x, s0)


@pytest.mark.parametrize("tokens", [1, 17, 40])
@pytest.mark.parametrize("name, source", [("elementwise", ELEMENTWISE), ("elementwise_variants", ELEMENTWISE_VARIANTS),
                                          ("elementwise_noncausal", NONCAUSAL)])
def test_c_forms_agree_with_the_recurrent_form(name, source, tokens):
    rec = compiled(name, source)
    for form in ("parallel", "chunkwise"):
        assert builds(rec.compiled, "c", form), refusal(rec.compiled, "c", form)
    x, s0 = inputs(rec, 2, tokens, 2, seed=tokens)
    assert_forms_agree(rec, x, s0, chunk_sizes=(None, 1, 3, 16), backend="c")


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_strong_and_mild_decays_in_one_state_stay_exact(backend):
    # one element barely decays, another by e^−20 per token: over 300 tokens the prefix sums reach −6000,
    # and every exponent is still a difference ≤ 0
    rec = compiled("elementwise", ELEMENTWISE)
    x, s0 = inputs(rec, 1, 300, 1, seed=3)
    x["G"][..., 0, 0] = -1e-3
    x["G"][..., 1, 1] = -20.0
    assert_forms_agree(rec, x, s0, chunk_sizes=(None, 64), backend=backend)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_reset_and_a_nonfinite_token(backend):
    # a decay of exactly 0 (log −∞) is a reset; a NaN value reaches only its own token and the later ones
    rec = compiled("elementwise", ELEMENTWISE)
    x, s0 = inputs(rec, 2, 30, 2, seed=5)
    x["G"][0, 10, 1] = -np.inf
    x["G"][1, 3:6, 0, 2, 1] = -np.inf
    assert_forms_agree(rec, x, s0, chunk_sizes=(None, 7), backend=backend)
    x["v"][1, 20, 0, 2] = np.nan
    want = rec.run(x, form="recurrent", initial_state=s0).outputs["o"]
    for form in ("parallel", "chunkwise"):
        got = rec.run(x, form=form, initial_state=s0, chunk_size=7, backend=backend).outputs["o"]
        assert np.array_equal(np.isnan(got), np.isnan(want))
        finite = ~np.isnan(want)
        assert np.max(np.abs(got[finite] - want[finite])) <= TOL * np.max(np.abs(want[finite]))


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_the_chunkwise_form_in_float32_stays_close(backend):
    rec = compiled("mamba1")
    x = rec.random_inputs(2, 50, 2, DIMS, seed=1)
    want = rec.run(x, form="recurrent", dims=DIMS).outputs["y"]
    got = rec.run({k: v.astype(np.float32) for k, v in x.items()}, form="chunkwise", chunk_size=16, dims=DIMS,
                  backend=backend).outputs["y"]
    assert got.dtype == np.float32 and rel_err(got, want) <= 1e-5


# ---- Mamba-1 ------------------------------------------------------------------------------------------------
def test_mamba1_against_its_loop_on_every_form_and_backend():
    rec = compiled("mamba1")
    x = rec.random_inputs(2, 23, 2, DIMS, seed=11)
    s0 = {"S": np.random.default_rng(12).standard_normal((2, 2, 5, 4))}
    params = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS).params
    want_o, want_s = ref.mamba1(x, params, s0)
    for form in ("recurrent", "parallel", "chunkwise"):
        for backend in ("numpy", "c"):
            assert builds(rec.compiled, backend, form), refusal(rec.compiled, backend, form)
            got = rec.run(x, form=form, backend=backend, initial_state=s0, dims=DIMS, chunk_size=6)
            assert rel_err(got.outputs["y"], want_o["y"]) <= TOL, f"{form} on {backend}"
            assert rel_err(got.final_state["S"], want_s["S"]) <= TOL, f"{form} on {backend}"


def test_c_emits_the_elementwise_kernel_of_the_structure():
    rec = compiled("mamba1")
    source = c_scan.emit(rec.compiled, "chunkwise", dtype=np.float64)
    assert "one log-decay per element; 1 write(s); readouts: after; causal; dk = 16, dv = 16, double" in source
    assert "lr_elementwise_chunkwise" in source


def test_the_recurrent_backward_against_central_differences():
    """(The parallel and chunkwise backward against this one: tests/test_grad_elementwise.py.)"""
    rec = compiled("mamba1")
    x = rec.random_inputs(1, 6, 1, DIMS, seed=2)
    # the recurrent backward: ∂L/∂dt and ∂L/∂A_log against central differences of L = Σ w·y
    w = np.random.default_rng(3).standard_normal((1, 6, 1, 4))
    got = rec.vjp(x, {"y": w}, form="recurrent", dims=DIMS)
    params = got.params

    def loss(x_, params_):
        return float(np.sum(w * rec.run(x_, form="recurrent", params=params_, dims=DIMS).outputs["y"]))
    eps = 1e-6
    for where in [(0, 2, 0, 1), (0, 5, 0, 3)]:
        up, down = {k: v.copy() for k, v in x.items()}, {k: v.copy() for k, v in x.items()}
        up["dt"][where] += eps
        down["dt"][where] -= eps
        numeric = (loss(up, params) - loss(down, params)) / (2 * eps)
        assert abs(got.grads["dt"][where] - numeric) <= 1e-6 * max(1.0, abs(numeric))
    up, down = dict(params), dict(params)
    up["A"], down["A"] = params["A"].copy(), params["A"].copy()
    up["A"][0, 1, 2] += eps
    down["A"][0, 1, 2] -= eps
    numeric = (loss(x, up) - loss(x, down)) / (2 * eps)
    assert abs(got.grads["A"][0, 1, 2] - numeric) <= 1e-6 * max(1.0, abs(numeric))

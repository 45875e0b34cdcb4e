"""Programs written as papers write them (issue 22, items 6, 2 and 7), on every form and both backends:

- updates in steps: a state assigned several times in a token composes into the one-line update — the gated
  delta rule in two steps gives what examples/gated_deltanet.lin gives, and an output between the steps
  reads the intermediate value (against a loop written from the math);
- elementwise powers with a vector exponent, against a loop;
- readouts by linearity: outputs linear in a state, written in any shape, get the parallel and chunkwise
  forms;
- the examples GDN-2 and Comba against loops written from their math (tests/reference_impls.py).

Tolerance: 1e-9 relative to the largest magnitude (float64), every form and backend against the float64
recurrent NumPy form or the loop. C kernels are built once per program (module-level cache).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import linrec
import reference_impls as ref
from linrec.cli import main
from linrec.registry import builds, refusal
from compare import rel_err

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TOL = 1e-9
B, T, H = 2, 37, 2
DIMS = {"dk": 5, "dv": 4}
CHUNK = 8  # several chunks, the last one partial
FORMS = ("recurrent", "parallel", "chunkwise")

# the gated delta rule as papers write it: decay, then the delta rule on the decayed state; `mid` reads the
# state between the two steps, and `p` the value the second step sees
GDN_IN_STEPS = """recurrence gdn_in_steps(dk = 16, dv = 16)
input q[dk], k[dk], v[dv]
input beta in (0, 1)
input g <= 0
qn = l2norm(q)
kn = l2norm(k)
state S[dk, dv]
S = exp(g)·S
output mid = qn·S
p = kn·S
S = S + beta·kn⊗(v − p)
output o = dk^(−1/2)·qn·S
"""

VECTOR_POWER = """recurrence vector_power(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], x[dk] in (0.5, 2), y[dk] in (−1, 1)
input a in (0, 1)
state S[dk, dv]
S = diag(a^(1 + y))·S + (k*x^y)⊗v
output o = (q*2^y)·S
"""

READOUT_HEAD = """recurrence {name}(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], p[dk], w[dv], a <= 0
param W[dv, dv] = randn(seed=0, std=0.3)
state S[dk, dv]
S = exp(a)·S + k⊗v
"""
# outputs linear in S written in shapes other than q·S (and one nonlinear use of such a read)
READOUTS = {
    "column_scale": "q·(S·diag(w))",
    "summed_query": "(q + p)·S",
    "mixed_sides": "q·S·W + p·S",
    "contracted_sum": "q·(S + k⊗v)",
    "read_then_matrix": "(q·S)·W",
    "scaled_inside": "2·(q·(exp(a)·S))",
    "matrix_inside": "q·(S·W)·W − (p·(S·diag(w)))*w",
    "both_sides": "q·(S·w) + (p·S)·w",  # a scalar
    "inside_a_function": "groupnorm(q·(S·diag(w)))*(p·S·w)",
}
READOUTS_TOGETHER = READOUT_HEAD.format(name="readouts_together") + "".join(
    f"output {name} = {expr}\n" for name, expr in READOUTS.items())

_compiled: dict[str, linrec.Recurrence] = {}


def compiled(key: str, source: str | None = None) -> linrec.Recurrence:
    if key not in _compiled:
        _compiled[key] = linrec.compile(source, f"{key}.lin") if source else linrec.load(EXAMPLES / f"{key}.lin")
    return _compiled[key]


def assert_close(result, outputs: dict, states: dict, what: str):
    for kind, got, want in (("output", result.outputs, outputs), ("final state", result.final_state, states)):
        for name in want:
            err = rel_err(got[name], want[name])
            assert err <= TOL, f"{what}: {kind} {name}: relative error {err:.2e} > {TOL:g}"


def inputs_for(rec: linrec.Recurrence, seed: int = 0):
    x = rec.random_inputs(B, T, H, DIMS, seed=seed)
    rng = np.random.default_rng(seed + 1)
    s0 = {s.name: rng.standard_normal((B, H) + tuple(DIMS[d] for d in s.shape)) for s in rec.program.states}
    return x, s0


def every_run(rec: linrec.Recurrence, x, s0, params=None):
    """(form, backend, result) for every form on both backends (C: the forms it builds)."""
    for form in FORMS:
        assert form in rec.forms, f"{rec.name}: no {form} form: {rec.decomposition.why_not(form)}"
        for backend in ("numpy", "c"):
            if backend == "c" and not builds(rec.compiled, "c", form):
                reason = refusal(rec.compiled, "c", form)
                assert reason, f"{rec.name}: C refuses the {form} form without a reason"
                continue
            yield form, backend, rec.run(x, form=form, backend=backend, initial_state=s0, params=params,
                                         chunk_size=CHUNK, dims=DIMS)


# ---- updates in steps -------------------------------------------------------------------------------------
def test_steps_compose_into_the_one_line_update():
    steps, one_line = compiled("gdn_in_steps", GDN_IN_STEPS), compiled("gated_deltanet")
    (update,) = [s for s in steps.program.steps if isinstance(s, linrec.compiler.ir.Update)]
    assert len(update.assignments) == 2
    assert steps.decomposition.transition("S").kind == one_line.decomposition.transition("S").kind
    x, s0 = inputs_for(one_line)
    want = one_line.run(x, form="recurrent", initial_state=s0, dims=DIMS)
    for form, backend, got in every_run(steps, x, s0):
        assert_close(got, {"o": want.outputs["o"]}, want.final_state, f"{form} on {backend}")


def test_a_read_between_steps_reads_the_intermediate_value():
    rec = compiled("gdn_in_steps", GDN_IN_STEPS)
    x, s0 = inputs_for(rec, seed=3)
    mid = np.zeros((B, T, H, DIMS["dv"]))
    for b in range(B):
        for h in range(H):
            S = s0["S"][b, h].copy()
            for t in range(T):
                qn, kn = ref.l2norm(x["q"][b, t, h]), ref.l2norm(x["k"][b, t, h])
                S = np.exp(x["g"][b, t, h]) * S
                mid[b, t, h] = qn @ S
                S = S + x["beta"][b, t, h] * np.outer(kn, x["v"][b, t, h] - kn @ S)
    for form, backend, got in every_run(rec, x, s0):
        assert_close(got, {"mid": mid}, {}, f"{form} on {backend}")


def test_a_read_between_steps_of_one_state_before_the_update_of_another():
    """mid reads S between its two assignments and z before z's update: q·(exp(g)·S_(t−1)) + Σ z_(t−1), on every
    form and backend (docs/dsl.md said such a read is refused; it is not, and it is right — a probe's finding)."""
    rec = compiled("read_before_other", "recurrence read_before_other(dk = 5, dv = 4)\n"
                   "input q[dk], k[dk], v[dv], g <= 0\nstate S[dk, dv], z[dk]\nS = exp(g)·S\nmid = q·S + sum(z)\n"
                   "z = z + k\nS = S + k⊗v\noutput o = q·S*mid\n")
    x, s0 = inputs_for(rec, seed=5)
    o = np.zeros((B, T, H, DIMS["dv"]))
    for b in range(B):
        for h in range(H):
            S, z = s0["S"][b, h].copy(), s0["z"][b, h].copy()
            for t in range(T):
                q, k, v, g = (x[n][b, t, h] for n in "qkvg")
                S = np.exp(g) * S
                mid = q @ S + z.sum()
                z = z + k
                S = S + np.outer(k, v)
                o[b, t, h] = (q @ S) * mid
    for form, backend, got in every_run(rec, x, s0):
        assert_close(got, {"o": o}, {}, f"{form} on {backend}")


def test_check_reports_the_composed_update(tmp_path, capsys):
    path = tmp_path / "gdn_in_steps.lin"
    path.write_text(GDN_IN_STEPS, encoding="utf-8")
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "S = exp(g)·S + beta·kn⊗(v − kn·(exp(g)·S))" in out
    assert "composed from its assignments on lines 8 and 11" in out
    assert "mid = qn·(exp(g)·S)" in out


def test_three_steps_and_a_vector_state():
    # each assignment sees the one before; z's steps interleave with S's
    rec = linrec.compile("""recurrence steps3(dk = 6, dv = 4)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv], z[dk]
z = exp(g)*z
S = diag(exp(g))·S
z = z + k
S = S + k⊗v
S = 0.5·S
output o = (q·S)/(1 + abs(q·z))
""", "steps3.lin")
    assert rec.forms == FORMS
    x = rec.random_inputs(B, T, H, {"dk": 6, "dv": 4}, seed=5)
    o = np.zeros((B, T, H, 4))
    for b in range(B):
        for h in range(H):
            S, z = np.zeros((6, 4)), np.zeros(6)
            for t in range(T):
                d = np.exp(x["g"][b, t, h])
                z = d * z + x["k"][b, t, h]
                S = 0.5 * (d[:, None] * S + np.outer(x["k"][b, t, h], x["v"][b, t, h]))
                o[b, t, h] = (x["q"][b, t, h] @ S) / (1 + abs(x["q"][b, t, h] @ z))
    for form in FORMS:
        got = rec.run(x, form=form, chunk_size=CHUNK)
        assert rel_err(got.outputs["o"], o) <= TOL, form


def test_noncausal_steps_with_a_value_between_them():
    # a value between the steps that only the update reads is fine in a non-causal program (its outputs read
    # the final state; test_errors has the refusal of an output between the steps)
    rec = linrec.compile(GDN_IN_STEPS.replace("dv = 16)", "dv = 16) noncausal").replace("output mid = qn·S\n", ""),
                         "noncausal_steps.lin")
    assert rec.forms == FORMS
    x, s0 = inputs_for(rec, seed=19)
    want = compiled("gated_deltanet").run(x, form="recurrent", initial_state=s0, dims=DIMS).final_state
    for form in FORMS:
        got = rec.run(x, form=form, initial_state=s0, chunk_size=CHUNK, dims=DIMS)
        assert rel_err(got.final_state["S"], want["S"]) <= TOL, form
        final = ref.l2norm(x["q"][0, 5, 1]) @ got.final_state["S"][0, 1] * DIMS["dk"] ** -0.5
        assert rel_err(got.outputs["o"][0, 5, 1], final) <= TOL, form


# ---- elementwise powers -----------------------------------------------------------------------------------
def test_a_vector_exponent_against_a_loop():
    rec = compiled("vector_power", VECTOR_POWER)
    x, s0 = inputs_for(rec, seed=7)
    o, S_final = np.zeros((B, T, H, DIMS["dv"])), np.zeros((B, H, DIMS["dk"], DIMS["dv"]))
    for b in range(B):
        for h in range(H):
            S = s0["S"][b, h].copy()
            for t in range(T):
                a, xv, y = x["a"][b, t, h], x["x"][b, t, h], x["y"][b, t, h]
                decay = np.array([a ** (1 + yi) for yi in y])
                key = np.array([ki * xi ** yi for ki, xi, yi in zip(x["k"][b, t, h], xv, y)])
                S = decay[:, None] * S + np.outer(key, x["v"][b, t, h])
                o[b, t, h] = np.array([qi * 2.0 ** yi for qi, yi in zip(x["q"][b, t, h], y)]) @ S
            S_final[b, h] = S
    for form, backend, got in every_run(rec, x, s0):
        assert_close(got, {"o": o}, {"S": S_final}, f"{form} on {backend}")


def test_exponent_shapes_must_agree():
    with pytest.raises(linrec.LinrecError, match=r"shape mismatch in '\^': \[dk\] and \[dv\]"):
        linrec.compile("recurrence t(dk = 4, dv = 3)\ninput k[dk], v[dv]\nstate z[dk]\nz = z + k^v\n"
                       "output o = z\n", "t.lin")


# ---- readouts by linearity --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(READOUTS))
def test_linear_reads_get_every_form_numpy(name):
    rec = compiled(name, READOUT_HEAD.format(name=name) + f"output o = {READOUTS[name]}\n")
    assert rec.forms == FORMS, rec.decomposition.why_not("chunkwise")
    x, s0 = inputs_for(rec, seed=11)
    want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
    for form in ("parallel", "chunkwise"):
        got = rec.run(x, form=form, initial_state=s0, chunk_size=CHUNK, dims=DIMS)
        assert_close(got, want.outputs, want.final_state, form)


def test_linear_reads_on_both_backends():
    rec = compiled("readouts_together", READOUTS_TOGETHER)
    x, s0 = inputs_for(rec, seed=13)
    want = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS)
    for form, backend, got in every_run(rec, x, s0):
        assert_close(got, want.outputs, want.final_state, f"{form} on {backend}")


def test_a_read_from_the_right_is_no_readout():
    # S·w reads S's rows, not its columns: linear, but not q·S (the transposed program would need all reads
    # from the right): only the recurrent form, with the reason — both reads named (alone, S·w is a readout of
    # the transposed state: every form)
    rec = linrec.compile(READOUT_HEAD.format(name="right") + "output o = q·S\noutput r = S·w\n", "right.lin")
    assert rec.forms == ("recurrent",)
    assert ("output 'r' reads matrix state 'S' from the right (`S·w`) and output 'o' from the left (`q·S`): the "
            "forms take the reads of a state on one side") in rec.decomposition.why_not("parallel")
    alone = linrec.compile(READOUT_HEAD.format(name="right") + "output r = S·w\n", "right.lin")
    assert alone.forms == ("recurrent", "parallel", "chunkwise")


# ---- the examples GDN-2 and Comba against loops -----------------------------------------------------------
@pytest.mark.parametrize("name", ["gdn2", "comba"])
def test_example_against_its_loop(name):
    rec = compiled(name)
    x, s0 = inputs_for(rec, seed=17)
    params = rec.run(x, form="recurrent", initial_state=s0, dims=DIMS).params
    want_o, want_s = ref.REFERENCES[name](x, params, s0)
    for form, backend, got in every_run(rec, x, s0, params):
        assert_close(got, want_o, want_s, f"{form} on {backend}")

"""Staged derivation over the state graph (compiler/stages.py, linrec.stages): a program whose states read each
other in one direction gets the forms every stage has, each stage derived on its own and handed the earlier
stages' per-token values as inputs.

Every form is checked against the float64 recurrent form (the program as written) at a relative 1e-9 —
max|form − recurrent| / max|recurrent|, per output and per final state — and the preconditioned delta rule
against its loop reference (tests/reference_impls.py) as well. The C kernels are built once per module (the
recurrences below are module-level, and each keeps the kernels it built).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import linrec
import reference_impls as ref
from linrec.cli import describe, format_check
from linrec.compiler.analysis import to_text
from compare import rel_err

ROOT = Path(__file__).resolve().parent.parent
RTOL = 1e-9
BACKENDS = ("numpy", "c")

PRECONDITIONED = linrec.load(ROOT / "examples" / "preconditioned_deltanet.lin")

# stage 2 attends over stage 1's readout: a softmax over q·U is the write key of S
ATTEND = linrec.compile("""
recurrence attend_memory(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], p[dv], a <= 0
state U[dk, dv], S[dv, dv]
U = exp(a)·U + k⊗v
w = softmax(q·U)
S = S + w⊗v
output o = p·S
output m = w
""")

# the states read each other: no state can be derived before the other
CYCLE = linrec.compile("""
recurrence cycle(d = 8)
input k[d], v[d], g[d] <= 0
state A[d], B[d]
A = exp(g)*A + k*tanh(B)
B = exp(g)*B + v*sigmoid(A)
output o = A + B
""")


# stage 2 decays elementwise by A_t⊗w, A_t a state of stage 1
DECAYED_BY_A_STATE = linrec.compile("""
recurrence decayed_by_a_state(dk = 4, dv = 4)
input q[dk], k[dk], v[dv], g[dk] <= 0, w[dv] > 0
state A[dk], S[dk, dv]
A = exp(g)*A + k*k
S = (A⊗w)*S + k⊗v
output o = q·S
""")

def assert_close(got, want, rtol=RTOL):
    for kind in ("outputs", "final_state"):
        a, b = getattr(got, kind), getattr(want, kind)
        assert set(a) == set(b), kind
        for name in b:
            err = rel_err(a[name], b[name])
            assert err <= rtol, f"{kind} '{name}': relative error {err:.3g} > {rtol:g}"


def preconditioned_case(B=2, T=37, H=2, dk=16, dv=16, seed=0):
    rng = np.random.default_rng(seed)
    x = {"q": rng.standard_normal((B, T, H, dk)), "k": rng.standard_normal((B, T, H, dk)),
         "v": rng.standard_normal((B, T, H, dv)), "beta": rng.uniform(0.05, 0.95, (B, T, H)),
         "g": -0.3 * np.abs(rng.standard_normal((B, T, H))), "gA": -0.3 * np.abs(rng.standard_normal((B, T, H, dk))),
         "betaA": rng.uniform(0.05, 0.95, (B, T, H))}
    # A is an energy (≥ 0, as log(A + eps) needs); S any matrix
    s0 = {"A": rng.uniform(0.0, 0.2, (B, H, dk)), "S": rng.standard_normal((B, H, dk, dv))}
    return x, s0


# ---- the stages the compiler finds --------------------------------------------------------------------------
def test_the_preconditioned_delta_rule_is_two_stages_with_every_form():
    d = PRECONDITIONED.decomposition
    assert PRECONDITIONED.forms == ("recurrent", "parallel", "chunkwise")
    assert [s.states for s in d.stages] == [("A",), ("S",)]
    first, second = d.stages
    assert [h.name for h in first.hands] == ["A_t"] and first.hands[0].version == "new"
    assert second.takes == ("A_t",) and second.outputs == ("o",) and first.outputs == ()
    assert first.forms == second.forms == ("recurrent", "parallel", "chunkwise")
    # stage 2 is the gated delta rule with a write key computed from its input A_t
    assert second.decomposition.transition("S").kind == "rank-one correction with data-dependent scalar decay"
    assert {x.name for x in second.program.inputs} >= {"A_t", "k", "beta", "g"}
    assert "A_t" in to_text(second.program.lets["r"])


def test_check_shows_the_stages_and_their_forms():
    text = format_check(describe(PRECONDITIONED, "preconditioned_deltanet.lin"))
    stages = text[text.index("\nstages"):text.index("\nforms")]
    assert "  1  A: recurrent, parallel, chunkwise" in stages
    assert "hands on A_t = A (after this token's update)" in stages
    assert "  2  S: recurrent, parallel, chunkwise" in stages and "takes A_t" in stages and "computes o" in stages
    assert "  parallel    available (backends: numpy, c)" in text


def test_states_that_read_each_other_stay_recurrent_only_with_the_reason():
    assert CYCLE.forms == ("recurrent",) and not CYCLE.decomposition.stages
    why = CYCLE.decomposition.why_not("chunkwise")
    assert "the update of 'A' reads state(s) B" in why
    assert "states A, B read each other (a cycle)" in why
    with pytest.raises(linrec.LinrecError, match="read each other"):
        CYCLE.run(CYCLE.random_inputs(tokens=4), form="parallel")


def test_a_matrix_state_read_as_a_whole_by_a_later_state_is_not_handed_on():
    rec = linrec.compile("""
recurrence wholeread(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], a <= 0
state U[dk, dv], S[dk, dv]
U = exp(a)·U + k⊗v
S = exp(a)·S + tanh(U)
output o = q·S
""")
    assert rec.forms == ("recurrent",) and not rec.decomposition.stages
    assert "its value per token is a matrix, which no stage hands on" in rec.decomposition.why_not("parallel")
    assert "holds only its token's write" not in rec.decomposition.why_not("parallel")


def test_a_matrix_state_holding_its_tokens_write_is_told_to_be_two_vectors():
    """Mamba-3's previous write as a matrix state P = k⊗v, read whole by the next token's update: no stage hands
    a matrix on; the reason says how to write it as two vector states, which then give every form."""
    source = """
recurrence prevwrite(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], g <= 0
state S[dk, dv], P[dk, dv]
S = exp(g)·S + exp(g)·P + k⊗v
P = 2·k⊗v
output o = q·S
"""
    rec = linrec.compile(source)
    assert rec.forms == ("recurrent",)
    assert ("'P' holds only its token's write `2·k⊗v`: as two vector states, `state P_a[dk], P_b[dv]` with "
            "`P_a = 2·k` and `P_b = v`, read as `P_a⊗P_b`") in rec.decomposition.why_not("parallel")
    other = linrec.compile(source.replace("P = 2·k⊗v", "P = 2·k⊗(v − 1)"))  # (a probe's finding: `2·k⊗v − 1`)
    assert "write `2·k⊗(v − 1)`: as two vector states" in other.decomposition.why_not("parallel")
    rewritten = linrec.compile(source.replace("P[dk, dv]", "P_a[dk], P_b[dv]").replace("·P +", "·P_a⊗P_b +")
                               .replace("P = 2·k⊗v", "P_a = 2*k\nP_b = v"))
    assert rewritten.forms == ("recurrent", "parallel", "chunkwise")
    x = rec.random_inputs(1, 9, 2, seed=1)
    want = rec.run(x).outputs["o"]
    for form in rewritten.forms:
        assert rel_err(rewritten.run(x, form=form, chunk_size=4).outputs["o"], want) < 1e-12, form


# the transposed convention (docs/forms.md): U ∈ R^(dv×dk), written v⊗k and read from the right, U·q — its
# readout, a [dv] vector per token, which a later stage takes as it takes q·U of the usual convention
TRANSPOSED_STAGE = linrec.compile("""
recurrence transposed_stage(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], f[dv] <= 0
input g <= 0
state U[dv, dk]
U = exp(g)·U + v⊗k
state z[dv]
z = exp(f)*z + (1 − exp(f))*tanh(U·q)
output o = z
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_readout_from_the_right_of_a_transposed_convention_state_feeds_a_later_stage(backend):
    d = TRANSPOSED_STAGE.decomposition
    assert TRANSPOSED_STAGE.forms == ("recurrent", "parallel", "chunkwise")
    assert [s.states for s in d.stages] == [("U",), ("z",)]
    first, second = d.stages
    (hand,) = first.hands
    assert (hand.side, to_text(hand.query), hand.version) == ("right", "q", "new")
    assert hand.text() == "U_read = U·(q) (after this token's update)"
    assert second.takes == (hand.name,) and second.outputs == ("o",)
    assert first.forms == second.forms == ("recurrent", "parallel", "chunkwise")
    assert first.decomposition.transposed == {"U"}  # stage 1 carries U transposed, as an output U·q would
    x = TRANSPOSED_STAGE.random_inputs(batch=2, tokens=29, heads=2, seed=5)
    rng = np.random.default_rng(6)
    s0 = {"U": rng.standard_normal((2, 2, 8, 8)), "z": rng.standard_normal((2, 2, 8))}
    want = TRANSPOSED_STAGE.run(x, form="recurrent", initial_state=s0)
    assert_close(TRANSPOSED_STAGE.run(x, form="recurrent", backend=backend, initial_state=s0), want)
    for form in ("parallel", "chunkwise"):
        for chunk in ((None,) if form != "chunkwise" else (8, 16)):
            got = TRANSPOSED_STAGE.run(x, form=form, backend=backend, initial_state=s0, chunk_size=chunk)
            assert_close(got, want)


def test_a_read_from_the_right_that_no_transpose_derives_gives_the_stage_its_reason():
    """U is read from both sides by S: stage 1 hands on U·v and q·U, and no orientation of U reads both as
    readouts, so stage 1 — and the program — keeps the recurrent form, with that stage's reason."""
    rec = linrec.compile("""
recurrence both_sides(dk = 8, dv = 8)
input q[dk], k[dk], v[dv], a <= 0
state U[dk, dv], S[dk, dv]
U = exp(a)·U + k⊗v
S = S + (U·v)⊗(q·U)
output o = q·S
""")
    first, second = rec.decomposition.stages
    assert first.forms == ("recurrent",) and second.forms == ("recurrent", "parallel", "chunkwise")
    assert rec.forms == ("recurrent",)
    why = rec.decomposition.why_not("parallel")
    assert why.startswith("stage 1 (U): ") and "reads matrix state 'U' from the right (`U·v`)" in why \
        and "from the left (`q·U`)" in why and "no stage hands on" not in why


# ---- every form against the recurrent one, and the loop reference ---------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_form_of_the_preconditioned_delta_rule_matches_the_recurrent_form_and_the_loops(backend):
    x, s0 = preconditioned_case()
    want = PRECONDITIONED.run(x, form="recurrent", initial_state=s0)
    loops_o, loops_s = ref.preconditioned_deltanet(x, want.params, s0)
    for name in loops_o:
        assert rel_err(want.outputs[name], loops_o[name]) <= 1e-10
    for name in loops_s:
        assert rel_err(want.final_state[name], loops_s[name]) <= 1e-10
    for form in PRECONDITIONED.forms:
        for chunk in ((None,) if form != "chunkwise" else (8, 16)):
            got = PRECONDITIONED.run(x, form=form, backend=backend, initial_state=s0, chunk_size=chunk)
            assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_softmax_over_a_stage_one_readout_feeds_stage_two(backend):
    d = ATTEND.decomposition
    assert ATTEND.forms == ("recurrent", "parallel", "chunkwise")
    assert [s.states for s in d.stages] == [("U",), ("S",)]
    assert d.stages[0].outputs == ("m",) and d.stages[1].outputs == ("o",)  # m reads U only: stage 1
    (hand,) = d.stages[0].hands
    assert hand.query is not None and to_text(hand.query) == "q"
    x = ATTEND.random_inputs(batch=2, tokens=29, heads=2, seed=3)
    rng = np.random.default_rng(4)
    s0 = {"U": rng.standard_normal((2, 2, 8, 8)), "S": rng.standard_normal((2, 2, 8, 8))}
    want = ATTEND.run(x, form="recurrent", initial_state=s0)
    for form in ("parallel", "chunkwise"):
        assert_close(ATTEND.run(x, form=form, backend=backend, initial_state=s0, chunk_size=8), want)


def test_three_stages_with_reads_before_and_after_the_updates():
    """z → U → S: U's write key reads z_t, S reads a readout of U whose query reads z (so U hands on what S
    needs), an output reads U before its update, and o mixes all three stages' values."""
    rec = linrec.compile("""
recurrence three(dk = 6, dv = 5)
input q[dk], k[dk], v[dv], a <= 0, g[dk] <= 0
state z[dk], U[dk, dv], S[dk, dv]
output before = q·U
S = exp(a)·S + k⊗silu((sigmoid(z)*q)·U)
z = exp(g)*z + k
U = exp(a)·U + (z*k)⊗v
output o = q·S + (z*q)·U
""")
    d = rec.decomposition
    assert [s.states for s in d.stages] == [("z",), ("U",), ("S",)]
    assert [(h.name, h.version) for h in d.stages[0].hands] == [("z_prev", "prev"), ("z_t", "new")]
    assert [(to_text(h.query), h.version) for h in d.stages[1].hands] == [("sigmoid(z_prev)*q", "prev"),
                                                                          ("z_t*q", "new")]
    assert d.stages[1].outputs == ("before",) and d.stages[2].outputs == ("o",)
    x = rec.random_inputs(batch=2, tokens=19, heads=2, seed=9)
    rng = np.random.default_rng(10)
    s0 = {"z": rng.standard_normal((2, 2, 6)), "U": rng.standard_normal((2, 2, 6, 5)),
          "S": rng.standard_normal((2, 2, 6, 5))}
    want = rec.run(x, form="recurrent", initial_state=s0)
    for form in ("parallel", "chunkwise"):
        assert_close(rec.run(x, form=form, initial_state=s0, chunk_size=4), want)


def test_a_stage_without_a_form_gives_the_program_its_reason():
    """S decays elementwise by A_t⊗w, A_t a state: no symbolic logarithm, and nothing bounds it above 0 (an
    elementwise decay is not taken with its signs). Stage 1 has every form, stage 2 the recurrent one: so has
    the program, with stage 2's reason (naming what A_t is)."""
    rec = DECAYED_BY_A_STATE
    first, second = rec.decomposition.stages
    assert first.forms == ("recurrent", "parallel", "chunkwise") and second.forms == ("recurrent",)
    assert rec.forms == ("recurrent",)
    why = rec.decomposition.why_not("chunkwise")
    assert why.startswith("stage 2 (S): state 'S': the decay `A_t⊗w` of 'S' can be zero or negative")
    assert why.endswith("(where A_t = A (after this token's update), handed on by an earlier stage)")


def test_a_non_causal_program_is_not_staged_and_says_why():
    rec = linrec.compile("""
recurrence both_ways(dk = 4, dv = 4) noncausal
input q[dk], k[dk], v[dv], g[dk] <= 0
state A[dk], S[dk, dv]
A = exp(g)*A + k*k
S = S + (tanh(A)*k)⊗v
output o = q·S
""")
    assert rec.forms == ("recurrent",)
    assert "a non-causal program is not derived in stages" in rec.decomposition.why_not("parallel")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_decode_step_across_stages_equals_the_staged_run(backend):
    x, s0 = preconditioned_case(T=12, seed=5)
    run = PRECONDITIONED.run(x, form="chunkwise", backend=backend, initial_state=s0, chunk_size=4)
    state = {k: v.copy() for k, v in s0.items()}
    outputs = []
    for t in range(12):
        out, state = PRECONDITIONED.step({k: v[:, t] for k, v in x.items()}, state, backend=backend)
        outputs.append(out["o"])
    assert rel_err(np.stack(outputs, axis=1), run.outputs["o"]) <= RTOL
    for name in s0:
        assert rel_err(state[name], run.final_state[name]) <= RTOL


def test_serving_across_stages_checkpoints_last_states_and_packed_sequences():
    x, s0 = preconditioned_case(B=1, T=23, seed=6)
    for form in ("parallel", "chunkwise"):
        got = PRECONDITIONED.run(x, form=form, initial_state=s0, state_every=5, keep_last=3, chunk_size=8)
        want = PRECONDITIONED.run(x, form="recurrent", initial_state=s0, state_every=5, keep_last=3)
        assert_close(got, want)
        for name in s0:
            assert rel_err(got.checkpoints[name], want.checkpoints[name]) <= RTOL
            assert rel_err(got.last_states[name], want.last_states[name]) <= RTOL
        cu = np.array([0, 9, 9, 23])
        states = {k: np.concatenate([v] * 3) for k, v in s0.items()}
        got = PRECONDITIONED.run(x, form=form, initial_state=states, cu_seqlens=cu, chunk_size=4)
        want = PRECONDITIONED.run(x, form="recurrent", initial_state=states, cu_seqlens=cu)
        assert_close(got, want)


def test_the_staged_forms_source_names_each_stage():
    source = PRECONDITIONED.emit("chunkwise")
    assert "# ==== stage 1: state(s) A; hands on A_t = A (after this token's update) ====" in source
    assert "# ==== stage 2: state(s) S; takes A_t ====" in source


@pytest.mark.parametrize("program", [PRECONDITIONED, ATTEND], ids=lambda rec: rec.name)
def test_the_emitted_staged_form_is_one_module_of_the_program(program):
    """`linrec emit FILE --form parallel|chunkwise` of a staged program prints one module: each stage's forward
    under a name of its own (stage1_forward, …), and the program's default_params and forward, which chains
    them as the driver's StagedModule does (it printed each stage's module in turn, so that a saved copy's
    forward was the last stage's alone). Saved and run on its own, it gives Recurrence.run's outputs and final
    states. The C source of a staged form is kernels to read (C's scan kernels say the NumPy module above
    runs them), still the stages' in order."""
    x = program.random_inputs(batch=2, tokens=21, heads=2, seed=5)
    sizes = {d.name: d.default for d in program.program.dims}
    rng = np.random.default_rng(6)
    s0 = {s.name: np.abs(rng.standard_normal((2, 2) + tuple(sizes[d] for d in s.shape)))
          for s in program.program.states}
    for form in ("parallel", "chunkwise"):
        text = program.emit(form)
        for function in ("forward", "default_params"):
            assert text.count(f"\ndef {function}(") == 1, (form, function)
        assert "\ndef stage1_forward(" in text and "\ndef stage2_forward(" in text
        module = {}
        exec(compile(text, f"{program.name}_{form}.py", "exec"), module)  # noqa: S102 - a user's saved copy
        params = module["default_params"](2, sizes)
        outputs, final = module["forward"](x, params, s0, sizes, chunk_size=8)
        want = program.run(x, form=form, params=params, initial_state=s0, chunk_size=8)
        assert_close(SimpleNamespace(outputs=outputs, final_state=final), want, rtol=1e-12)
        c_source = program.emit(form, backend="c")
        assert c_source.startswith("/* ==== stage 1: ") and "/* ==== stage 2: " in c_source


# ---- gradients: the recurrent backward runs the program as written ------------------------------------------
def test_the_recurrent_gradient_of_the_staged_example_matches_finite_differences():
    x, s0 = preconditioned_case(B=1, T=6, H=1, dk=4, dv=3, seed=7)
    rng = np.random.default_rng(8)
    dims = {"dk": 4, "dv": 3}
    upstream = {"o": rng.standard_normal((1, 6, 1, 3))}
    res = PRECONDITIONED.vjp(x, upstream, initial_state=s0, dims=dims)

    def loss(inputs, state):
        out = PRECONDITIONED.run(inputs, form="recurrent", initial_state=state, dims=dims).outputs["o"]
        return float(np.sum(out * upstream["o"]))
    eps = 1e-6
    for name, where in (("k", x), ("gA", x), ("betaA", x), ("A", s0)):
        direction = rng.standard_normal(where[name].shape)
        plus = {**where, name: where[name] + eps * direction}
        minus = {**where, name: where[name] - eps * direction}
        if where is x:
            numeric = (loss(plus, s0) - loss(minus, s0)) / (2 * eps)
        else:
            numeric = (loss(x, plus) - loss(x, minus)) / (2 * eps)
        assert abs(numeric - np.sum(res.grads[name] * direction)) <= 1e-6 * max(1.0, abs(numeric)), name
    # (its parallel and chunkwise backward run the stages' backwards: tests/test_grad_stages.py)
    assert PRECONDITIONED.decomposition.stages
    assert linrec.gradients.gradient_refusal(PRECONDITIONED, "chunkwise", "numpy") is None


def test_a_stages_own_values_are_said_to_be_handed_on_to_a_later_one():
    """A reason of stage 1 names the values it hands on (made-up names such as S1_read): the legend said they
    were "handed on by an earlier stage" (a probe's finding), where this stage hands them on to a later one."""
    rec = linrec.compile("""recurrence r(dk = 4, dv = 4)
input q[dk], k[dk], v[dv]
state S1[dk, dv], S2[dk, dv]
S1 = S1 + k⊗v
S2 = S2 + k⊗(q·S1) + (S1·v)⊗v
output o = q·S2
""")
    why = rec.decomposition.why_not("parallel")
    assert why.startswith("stage 1 (S1): ") and "handed on by an earlier stage" not in why
    assert why.endswith("(after this token's update), which this stage hands on to a later one)")

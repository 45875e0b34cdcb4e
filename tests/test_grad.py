"""Derived gradients (docs/gradients.md): Recurrence.vjp against central finite differences of the float64
forward, for every example that has a recurrent form and for programs that exercise every builtin and
every kind of statement; the checkpoint interval changes nothing; bad arguments are clear errors.

The finite-difference check is verify_grad.directional_errors: per input, param and initial state a random
direction d, ⟨∂L/∂x, d⟩ against a fourth-order central difference of L = Σ ḡ·outputs + Σ ḡ_S·final states
(ε = 1e-5), relative error ≤ 1e-6 (test_checker_catches_a_wrong_gradient shows it fails a gradient off by
1e-5). Cases: ragged T, random initial states (vector states positive, as normalizers are), strong decay
(log-decays to about −20), T = 1, odd sizes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fuzzing
import linrec
from linrec import verify_grad
from linrec.cli import main
from linrec.compiler import ir
from linrec.compiler.analysis import walk
from linrec.compiler.builtins import BUILTINS, SEQ
from linrec.gradients import gradient_refusal
from linrec.numpy.adjoint_derived import first_contributions
from linrec.numpy.vjp import own_array
from linrec.verify import _initial_state

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ALL_EXAMPLES = sorted(p.stem for p in EXAMPLES.glob("*.lin"))
FD_TOLERANCE = 1e-6

_RECS: dict[str, linrec.Recurrence] = {}


def example(name: str) -> linrec.Recurrence:
    if name not in _RECS:
        _RECS[name] = linrec.load(EXAMPLES / f"{name}.lin")
    return _RECS[name]


def arrays_for(rec, batch, tokens, heads, dims=None, seed=0, decay_scale=1.0):
    """Inputs, params (all passed), random initial states and random upstream gradients, float64."""
    rng = np.random.default_rng(seed + 100)
    inputs = rec.random_inputs(batch, tokens, heads, dims, np.float64, seed=seed, decay_scale=decay_scale)
    sizes = {d.name: d.default for d in rec.program.dims} | dict(dims or {})
    state0 = _initial_state(rec.program, batch, heads, sizes, rng)
    base = rec.run(inputs, form="recurrent", initial_state=state0, dims=dims)
    params = {k: np.array(v) for k, v in base.params.items()}
    grad_outputs = {k: rng.standard_normal(v.shape) for k, v in base.outputs.items()}
    grad_state = {k: rng.standard_normal(v.shape) for k, v in base.final_state.items()}
    return inputs, params, state0, grad_outputs, grad_state


def check_gradients(rec, batch, tokens, heads, dims=None, seed=0, decay_scale=1.0, chunk_size=None):
    inputs, params, state0, g_out, g_state = arrays_for(rec, batch, tokens, heads, dims, seed, decay_scale)
    result = rec.vjp(inputs, g_out, grad_final_state=g_state, initial_state=state0, params=params, dims=dims,
                     chunk_size=chunk_size)
    assert set(result.grads) == set(inputs) | set(params) | set(state0)
    for name, value in result.grads.items():
        where = inputs.get(name, params.get(name, state0.get(name)))
        assert np.shape(value) == np.shape(where), name
        assert np.all(np.isfinite(value)), name
    errors = verify_grad.directional_errors(rec, inputs, params, state0, g_out, g_state, result.grads, dims, seed)
    assert errors and set(errors) == set(result.grads)
    bad = {name: rel for name, (_, rel) in errors.items() if not rel <= FD_TOLERANCE}
    assert not bad, f"finite differences disagree (relative errors {bad})"
    return result


# ---- every example ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL_EXAMPLES)
def test_every_example(name):
    """Ragged T with random initial states, strong decay (log-decay down to about −20), T = 1 and odd
    sizes, for every example with a recurrent gradient; the others say why they have none."""
    rec = example(name)
    why = gradient_refusal(rec, "recurrent", "numpy")
    if why is not None:
        assert "recurrent" not in rec.forms, why  # (Linformer, Reformer: they have no recurrent form)
        pytest.skip(f"no recurrent gradient: {why}")
    small = {d.name: min(d.default, 6) for d in rec.program.dims}
    odd = {d.name: 5 + 2 * i for i, d in enumerate(rec.program.dims)}
    check_gradients(rec, 2, 11, 3, small, seed=1, chunk_size=4)
    check_gradients(rec, 2, 9, 2, small, seed=2, decay_scale=40.0)
    check_gradients(rec, 1, 1, 2, small, seed=3)
    check_gradients(rec, 1, 6, 1, odd, seed=4, chunk_size=2)


def test_a_program_without_a_state():
    """Found by probing: its NumPy recurrent backward was invalid Python (`checkpoints.append((,))`)."""
    rec = linrec.compile("recurrence no_state(dk = 5)\ninput q[dk], k[dk]\noutput o = q·k·q\n", "no_state.lin")
    check_gradients(rec, 2, 5, 2, {"dk": 5}, seed=1)


def test_strong_decay_reaches_minus_twenty():
    """The strong-decay case above has log-decays near −20 (the battery's decay_scale of 40)."""
    inputs = example("gla").random_inputs(2, 9, 2, {"dk": 6, "dv": 6}, decay_scale=40.0, seed=2)
    assert inputs["g"].min() < -20


def test_finite_differences_stay_inside_declared_ranges():
    """A random direction's steps (±ε, ±2ε) would carry an input drawn within 2ε of its declared bound out of
    it, and the forward refuses such an input — a battery at dk = 128 met one (`linrec verify --grad --dim`).
    Along the direction with those elements left out, the check runs and still catches a wrong gradient."""
    rec = example("gated_deltanet")
    dims = {"dk": 5, "dv": 4}
    inputs, params, state0, g_out, g_state = arrays_for(rec, 2, 7, 2, dims, seed=5)
    inputs["g"][0, :3, 0] = [-1e-7, 0.0, -1.5e-5]  # (log-decays: g <= 0)
    inputs["beta"][1, 2:4, 1] = [1e-6, 1 - 1e-6]  # (beta in (0, 1))
    result = rec.vjp(inputs, g_out, grad_final_state=g_state, initial_state=state0, params=params, dims=dims)
    errors = verify_grad.directional_errors(rec, inputs, params, state0, g_out, g_state, result.grads, dims)
    assert max(rel for _, rel in errors.values()) < 1e-8
    for name in ("g", "beta"):
        wrong = dict(result.grads, **{name: result.grads[name] * (1 + 1e-5)})
        errors = verify_grad.directional_errors(rec, inputs, params, state0, g_out, g_state, wrong, dims)
        assert errors[name][1] > FD_TOLERANCE


def test_checker_catches_a_wrong_gradient():
    rec = example("gated_deltanet")
    inputs, params, state0, g_out, g_state = arrays_for(rec, 2, 7, 2, {"dk": 5, "dv": 4}, seed=5)
    result = rec.vjp(inputs, g_out, grad_final_state=g_state, initial_state=state0, params=params,
                     dims={"dk": 5, "dv": 4})
    errors = verify_grad.directional_errors(rec, inputs, params, state0, g_out, g_state, result.grads,
                                            {"dk": 5, "dv": 4})
    assert max(rel for _, rel in errors.values()) < 1e-8
    wrong = dict(result.grads, k=result.grads["k"] * (1 + 1e-5))
    errors = verify_grad.directional_errors(rec, inputs, params, state0, g_out, g_state, wrong, {"dk": 5, "dv": 4})
    assert errors["k"][1] > FD_TOLERANCE


# ---- every builtin and every kind of statement -----------------------------------------------------------
PROGRAMS = {
    "elementwise": """
recurrence elementwise(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], a[dk], p in (0.5, 2)
state S[dk, dv]
kk = sigmoid(a)*exp(tanh(k)) + softplus(q)*silu(k) − logsigmoid(a)*relu(k) + elu(q)*abs(k)
S = diag(exp(−softplus(a)))·S + kk⊗v
output o = (sqrt(p)*q + log(p)*k)·S
""",
    "vectors": """
recurrence vectors(dk = 5, dv = 3)
input q[dk], k[dk], v[dv], g in (−3, −0.1)
state S[dk, dv]
S = exp(g)·S + l2norm(k, eps=1e-3)⊗rmsnorm(v)
output o = groupnorm(softmax(q)·S) * mean(q) + sum(k)·norm(q)·(q·S)
""",
    # several states, a value read before the update, per-head and shared params, a user function, powers
    # with a variable exponent, products of matrices, diag, a division, two outputs
    "statements": """
recurrence statements(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], beta in (0, 1), p in (0.5, 2)
param W[dk, dk] = randn(seed=0, std=0.3)
param u per head = randn(seed=1)
param decay[dk] = uniform(0.5, 0.9, seed=2)
phi(x) = elu(x) + 1
state S[dk, dv], z[dk], M[dk, dk]
y = q·S
S = diag(decay)·S + phi(k)⊗v
z = decay*z + phi(k)^2
M = 0.5·M·W + beta·k⊗k
r = (phi(q)·S) / (phi(q)·z + 1)
output o = r*u + y / (1 + norm(y)^2) + sum((1 + sigmoid(q))^p)
output m = (M·q)·(W·k) + sum((diag(k)·M)·q)·p^(−1/2)
""",
    # the transposed convention (S·(I − β k⊗k)), a vector state read as a value, a value decay
    "values": """
recurrence values(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], f[dv], beta in (0, 1)
state S[dv, dk], z[dv]
S = S·(I − beta·k⊗k) + beta·v⊗k
z = sigmoid(f)*z + (1 − sigmoid(f))*v
output o = S·q + z*sigmoid(v)
""",
    # reads before the update, a decay whose log is taken numerically, a vector state, two readouts of one state
    "before": """
recurrence before(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], a[dk]
param gamma per head = uniform(0.5, 0.9, seed=1)
state S[dk, dv], z[dk]
output o = (q·S) / (1 + sigmoid(q)·z)
S = diag(sigmoid(a))·S + k⊗v
z = gamma*z + sigmoid(k)
output p = (2*q)·S
""",
    # the transposed convention without a correction: S multiplied and read from the right
    "transposed": """
recurrence transposed(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dv, dk]
S = S·diag(exp(g)) + v⊗k
output o = S·q + cos(S·q)*sin(v)
""",
    # non-causal: every output reads the final states
    "noncausal": """
recurrence bidir(dk = 4, dv = 3) noncausal
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv], z[dk]
kk = l2norm(k)
S = diag(exp(g))·S + kk⊗v
z = z + exp(kk)
y = q·S
output o = y / (exp(q)·z) + q·S*sigmoid(v)
""",
    # attention over the sequence: a sliding window, a named value under seq, a scalar sequence
    "window": """
recurrence swa(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], g in (−2, 0)
kn = l2norm(k)
output o = softmax(seq(kn, window=3)·q + seq(g, window=3))·seq(v, window=3) * sigmoid(q·q)
""",
    # non-causal attention, a sum over the sequence, seq of an expression
    "bidirectional attention": """
recurrence battn(dk = 4, dv = 3) noncausal
input q[dk], k[dk], v[dv]
output o = softmax(seq(k)·q)·seq(exp(v)) + sum(seq(k)·q)*q·q
""",
    # a per-head param whose default is computed from another (the gradient flows on when it is not given)
    "chained": """
recurrence chained(dk = 4, dv = 3)
input q[dk], k[dk], v[dv]
param base per head = randn(seed=3)
param gamma per head = sigmoid(base + h)
param scale[dv] = uniform(0.5, 1.5, seed=4)
state S[dk, dv]
S = gamma·S + k⊗(v*scale)
output o = q·S
""",
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_programs(name):
    """Each program at ragged T with random initial states (checkpoints every 3 tokens), and at strong decay."""
    rec = linrec.compile(PROGRAMS[name])
    check_gradients(rec, 2, 8, 3, seed=6, chunk_size=3)
    check_gradients(rec, 1, 5, 2, seed=7, decay_scale=40.0)


def test_every_builtin_is_covered():
    """The programs above call every builtin (the sequence builtins aside: no recurrent gradient)."""
    called = set()
    for source in PROGRAMS.values():
        program = linrec.compile(source).program
        for e in [*(s.value for s in program.steps)]:
            called |= {n.function for n in walk(e) if isinstance(n, ir.Apply)}
    assert set(BUILTINS) <= called, set(BUILTINS) - called


def test_default_computed_from_another_param():
    """gamma = sigmoid(base + h): not passed, gamma's gradient flows into base; passed, base gets none."""
    rec = linrec.compile(PROGRAMS["chained"])
    inputs = rec.random_inputs(2, 6, 3, seed=1)
    rng = np.random.default_rng(0)
    g_out = {"o": rng.standard_normal((2, 6, 3, 3))}
    base = rng.standard_normal(3)
    result = rec.vjp(inputs, g_out, params={"base": base})

    def loss(b):
        return float(np.sum(g_out["o"] * rec.run(inputs, form="recurrent", params={"base": b}).outputs["o"]))
    d = rng.standard_normal(3)
    numeric = (loss(base + 1e-6 * d) - loss(base - 1e-6 * d)) / 2e-6
    assert abs(numeric - np.sum(result.grads["base"] * d)) <= 1e-7 * abs(numeric)
    given = rec.vjp(inputs, g_out, params={"base": base, "gamma": result.params["gamma"]})
    assert np.all(given.grads["base"] == 0)
    np.testing.assert_allclose(given.grads["gamma"], result.grads["gamma"], rtol=1e-12)


def test_mamba2_a_log():
    """Mamba-2's A = −exp(A_log) by default: the gradient of A_log is A's times −exp(A_log)."""
    rec = example("mamba2")
    inputs = rec.random_inputs(1, 5, 2, {"dk": 4, "dv": 3}, seed=3)
    g_out = {"y": np.random.default_rng(1).standard_normal((1, 5, 2, 3))}
    result = rec.vjp(inputs, g_out)
    np.testing.assert_allclose(result.grads["A_log"], result.grads["A"] * result.params["A"], rtol=1e-12)


# ---- the parallel and chunkwise backward -----------------------------------------------------------------
FORM_TOLERANCE = 1e-9  # another gradient form in float64 against the recurrent one (the forms' tolerance)


def worst_error(got: dict, want: dict) -> float:
    """max over the arrays (the same names in both) of max|got − want| / max|want|."""
    assert set(got) == set(want)
    return max(float(np.abs(got[k] - want[k]).max() / max(np.abs(want[k]).max(), 1e-300)) for k in want)


def float32(arrays: dict) -> dict:
    return {k: v.astype(np.float32) for k, v in arrays.items()}


def assert_same_gradients(got, reference, tolerance=FORM_TOLERANCE):
    """max|got − ref| / max|ref| per array (an array far below the call's largest gradient — an initial
    state's through a decay of e^−300 — at the rounding of the largest), outputs and final states too."""
    largest = max(float(np.max(np.abs(v), initial=0.0)) for v in reference.grads.values())
    for name, ref in reference.grads.items():
        scale = max(float(np.max(np.abs(ref), initial=0.0)), np.finfo(got.grads[name].dtype).eps * largest)
        assert np.max(np.abs(got.grads[name] - ref), initial=0.0) <= tolerance * scale, name
    for group in ("outputs", "final_state"):
        for name, ref in getattr(reference, group).items():
            err = np.max(np.abs(getattr(got, group)[name] - ref), initial=0.0)
            assert err <= tolerance * np.max(np.abs(ref), initial=1e-300), name


DERIVED = [("example", name) for name in ("gla", "mamba2", "retnet", "linear_transformer", "performer")] + \
    [("program", name) for name in ("elementwise", "vectors", "before", "chained", "transposed")]


@pytest.mark.parametrize("kind, name", DERIVED)
@pytest.mark.parametrize("form", ["parallel", "chunkwise"])
def test_parallel_and_chunkwise_backward(kind, name, form):
    """Decay plus writes, read by q·S: the adjoint recurrence run chunk by chunk in reverse (and as one chunk:
    the parallel form) gives the recurrent backward's gradients to 1e-9 — ragged T with chunks of 4, strong
    decay, T = 1, a sequence of several default chunks; float32 at 5e-4."""
    rec = example(name) if kind == "example" else linrec.compile(PROGRAMS[name])
    assert gradient_refusal(rec, form, "numpy") is None
    small = {d.name: min(d.default, 6) for d in rec.program.dims}
    for batch, tokens, heads, scale, chunk in [(2, 13, 3, 1.0, 4), (2, 20, 2, 40.0, 8), (1, 1, 2, 1.0, None),
                                              (1, 150, 1, 1.0, None)]:
        x, p, s0, g_out, g_state = arrays_for(rec, batch, tokens, heads, small, seed=11, decay_scale=scale)
        reference = rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, params=p, dims=small)
        got = rec.vjp(x, g_out, grad_final_state=g_state, initial_state=s0, params=p, dims=small, form=form,
                      chunk_size=chunk)
        assert_same_gradients(got, reference)
    f32 = lambda d: {k: v.astype(np.float32) for k, v in d.items()}  # noqa: E731
    got = rec.vjp(f32(x), f32(g_out), grad_final_state=f32(g_state), initial_state=f32(s0), params=f32(p),
                  dims=small, form=form)
    assert_same_gradients(got, reference, 5e-4)


def test_a_decay_of_zero():
    """A reset (log-decay −∞): the recurrent backward takes it (exp(−∞) = 0), and so do the parallel and
    chunkwise ones (which refused it), the reset raised to a finite log-decay whose exponentials underflow to 0
    alike: the same gradients, ∂g 0 at the reset."""
    rec = example("gla")
    x = rec.random_inputs(1, 6, 1, {"dk": 4, "dv": 4}, seed=0)
    x["g"][0, 3, 0, 1] = -np.inf
    up = {"o": np.ones((1, 6, 1, 4))}
    want = rec.vjp(x, up).grads
    assert all(np.all(np.isfinite(g)) for g in want.values()) and want["g"][0, 3, 0, 1] == 0.0
    for form in ("parallel", "chunkwise"):
        got = rec.vjp(x, up, form=form, chunk_size=2).grads
        assert worst_error(got, want) <= 1e-9 and got["g"][0, 3, 0, 1] == 0.0


def test_which_programs_have_the_derived_backward():
    """From the structure: attention that uses the sequence other than in softmax(K·q)·V has the recurrent
    backward only (reads before the update are no obstacle: `before` above; rank-one corrections neither:
    tests/test_grad_corrections.py; nor a vector state read as it is, `values`, nor stages:
    tests/test_grad_stages.py; nor an elementwise decay: tests/test_grad_elementwise.py; nor non-causal
    programs, value-side corrections or the flash backward of attention: tests/test_grad_cover.py)."""
    assert gradient_refusal(example("softmax"), "recurrent", "numpy") is None
    for name in ("deltanet", "gated_deltanet", "preconditioned_deltanet", "mamba1", "gated_oja", "softmax"):
        assert gradient_refusal(example(name), "chunkwise", "numpy") is None
    for name in ("values", "noncausal"):
        assert gradient_refusal(linrec.compile(PROGRAMS[name]), "parallel", "numpy") is None
    assert gradient_refusal(linrec.compile(PROGRAMS["window"]), "parallel", "numpy") is not None


# ---- random programs -------------------------------------------------------------------------------------
FUZZ_PROGRAMS = 40  # (tests/fuzzing.py's generator; ~5 s. 1300 of them passed when this was written)


def test_random_programs():
    """Programs from the fuzzer's generator (and mutated examples): every one with a gradient form gets a
    recurrent gradient that finite differences confirm, and parallel and chunkwise ones (where they exist)
    that agree with it to 1e-9 (outputs below 1e-2 of the inputs' scale are cancellation, as the fuzzer
    says: Performer with one feature has an output that does not depend on q, so its gradient is rounding)."""
    checked = 0
    for i, source in enumerate(fuzzing.programs(FUZZ_PROGRAMS, seed=7)):
        try:
            rec = linrec.compile(source)
        except linrec.LinrecError:
            continue
        forms = [f for f in ("recurrent", "parallel", "chunkwise") if gradient_refusal(rec, f, "numpy") is None]
        if not forms:
            continue
        rng = np.random.default_rng(i)
        dims = {d.name: min(d.default, 5) for d in rec.program.dims if d.name != SEQ}
        inputs = rec.random_inputs(2, 6, 2, dims, seed=i)
        drawn = fuzzing._draw_params(rec, 2, {d.name: d.default for d in rec.program.dims} | dims, rng)
        base = rec.run(inputs, form="recurrent", params=drawn or None, dims=dims)
        if not all(np.all(np.isfinite(v)) for v in [*base.outputs.values(), *base.final_state.values()]):
            continue  # (a program whose forward overflows at these inputs: vjp says so, tested above)
        params = {k: np.array(v) for k, v in base.params.items()}
        state0 = {k: rng.standard_normal(v.shape) * 0.3 for k, v in base.final_state.items()}
        g_out = {k: rng.standard_normal(v.shape) for k, v in base.outputs.items()}
        g_state = {k: rng.standard_normal(v.shape) for k, v in state0.items()}
        reference = rec.vjp(inputs, g_out, grad_final_state=g_state, initial_state=state0, params=params, dims=dims)
        errors = verify_grad.directional_errors(rec, inputs, params, state0, g_out, g_state, reference.grads, dims, i)
        assert max((rel for _, rel in errors.values()), default=0.0) <= FD_TOLERANCE, (errors, source)
        for form in forms[1:]:
            got = rec.vjp(inputs, g_out, grad_final_state=g_state, initial_state=state0, params=params, dims=dims,
                          form=form, chunk_size=4)
            for name, ref in reference.grads.items():
                scale = max(float(np.max(np.abs(ref), initial=0.0)), fuzzing.SCALE_FLOOR)
                assert np.max(np.abs(got.grads[name] - ref), initial=0.0) <= FORM_TOLERANCE * scale, (name, source)
        checked += 1
    assert checked >= FUZZ_PROGRAMS // 2


# ---- checkpoints, outputs, shapes ------------------------------------------------------------------------
def test_checkpoint_interval_changes_nothing():
    rec = example("gated_deltanet")
    inputs, params, state0, g_out, g_state = arrays_for(rec, 2, 17, 2, {"dk": 5, "dv": 4}, seed=8)
    results = [rec.vjp(inputs, g_out, grad_final_state=g_state, initial_state=state0, chunk_size=c)
               for c in (None, 1, 3, 16, 17, 1000)]
    for other in results[1:]:
        for name, value in results[0].grads.items():
            np.testing.assert_allclose(other.grads[name], value, rtol=0, atol=1e-12 * np.max(np.abs(value)))


def test_outputs_and_final_state_are_the_forward():
    rec = example("deltanet")
    inputs, params, state0, g_out, _ = arrays_for(rec, 2, 9, 2, {"dk": 5, "dv": 4}, seed=9)
    result = rec.vjp(inputs, g_out, initial_state=state0)
    forward = rec.run(inputs, form="recurrent", initial_state=state0)
    np.testing.assert_allclose(result.outputs["o"], forward.outputs["o"], rtol=0, atol=1e-13)
    np.testing.assert_allclose(result.final_state["S"], forward.final_state["S"], rtol=0, atol=1e-13)


def test_float32():
    rec = example("gla")
    inputs, params, state0, g_out, g_state = arrays_for(rec, 2, 40, 2, {"dk": 8, "dv": 8}, seed=10)
    exact = rec.vjp(inputs, g_out, grad_final_state=g_state, initial_state=state0)
    f32 = {k: v.astype(np.float32) for k, v in inputs.items()}
    result = rec.vjp(f32, {k: v.astype(np.float32) for k, v in g_out.items()},
                     grad_final_state={k: v.astype(np.float32) for k, v in g_state.items()},
                     initial_state={k: v.astype(np.float32) for k, v in state0.items()})
    for name, value in exact.grads.items():
        assert result.grads[name].dtype == np.float32
        assert np.max(np.abs(result.grads[name] - value)) <= 5e-4 * np.max(np.abs(value)), name


def test_missing_output_gradient():
    rec = linrec.compile(PROGRAMS["statements"])
    inputs = rec.random_inputs(1, 4, 2, seed=0)
    g_o = np.ones((1, 4, 2, 3))
    with pytest.raises(linrec.RuntimeInputError, match=r"no gradient for output 'm'.*missing='zero'"):
        rec.vjp(inputs, {"o": g_o})
    zero = rec.vjp(inputs, {"o": g_o}, missing="zero")
    explicit = rec.vjp(inputs, {"o": g_o, "m": np.zeros((1, 4, 2))})
    for name, value in explicit.grads.items():
        np.testing.assert_array_equal(zero.grads[name], value)
    with pytest.raises(linrec.RuntimeInputError, match="missing='maybe'"):
        rec.vjp(inputs, {"o": g_o}, missing="maybe")


@pytest.mark.parametrize("bad, message", [
    ({"o": np.ones((1, 4, 2, 5))}, r"grad_outputs\['o'\] should have shape \[B, T, H, dv\] = \[1, 4, 2, 4\]"),
    ({"o": np.ones((1, 4, 2, 4), np.float32)}, r"grad_outputs\['o'\] is float32 but the inputs are float64"),
    ({"o": np.ones((1, 4, 2, 4)), "p": np.ones(3)}, r"unknown output\(s\) 'p'; the outputs of 'gla' are o"),
])
def test_bad_output_gradients(bad, message):
    rec = example("gla")
    inputs = rec.random_inputs(1, 4, 2, {"dk": 4, "dv": 4})
    with pytest.raises(linrec.RuntimeInputError, match=message):
        rec.vjp(inputs, bad)


def test_bad_final_state_gradient():
    rec = example("gla")
    inputs = rec.random_inputs(1, 4, 2, {"dk": 4, "dv": 4})
    g_out = {"o": np.ones((1, 4, 2, 4))}
    with pytest.raises(linrec.RuntimeInputError, match=r"grad_final_state\['S'\] should have shape \[B, H, dk, dv\]"):
        rec.vjp(inputs, g_out, grad_final_state={"S": np.ones((1, 2, 4))})
    with pytest.raises(linrec.RuntimeInputError, match=r"unknown state\(s\) 'T'"):
        rec.vjp(inputs, g_out, grad_final_state={"T": np.ones((1, 2, 4, 4))})


def test_forms_and_backends_without_a_gradient():
    reformer = example("reformer")
    summed = linrec.compile("recurrence summed(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv]\n"
                            "output o = softmax(seq(k)·q)·seq(v) + sum(seq(k)·q)*v\n", "summed.lin")
    with pytest.raises(linrec.LinrecError, match=r"no recurrent gradient on the c backend: the program reads the "
                                                 r"sequence \(attention\): the C backend builds the backward of "
                                                 r"softmax\(K·q\)·V over the sequence, or of lsh_attention alone; "
                                                 r"here the sequence is used outside"):
        summed.vjp(summed.random_inputs(1, 4, 1), {}, backend="c")
    ew_delta = linrec.compile("recurrence ew_delta(dk = 5, dv = 4)\ninput q[dk], k[dk], v[dv], beta in (0, 1), "
                              "X[dk, dv] <= 0\nkn = l2norm(k)\nstate S[dk, dv]\nS = exp(X)*S + beta·kn⊗(v − kn·S)\n"
                              "output o = q·S\n", "ew_delta.lin")
    with pytest.raises(linrec.LinrecError, match="no chunkwise gradient on the c backend: 'S' decays elementwise "
                                                 r"\(`X\*S`\) with rank-one corrections"):
        ew_delta.vjp(ew_delta.random_inputs(1, 4, 1), {}, form="chunkwise", backend="c")
    with pytest.raises(linrec.LinrecError, match="no recurrent gradient.*there is no recurrent forward form: LSH"):
        reformer.vjp(reformer.random_inputs(1, 4, 1), {})


def test_a_refusal_lists_the_programs_own_gradient_forms():
    """The refusal ends with the gradient forms this program has (as `linrec check` lists them), not every
    form there is: Linformer has only a parallel backward, Reformer a parallel and a chunkwise one."""
    linformer, reformer = example("linformer"), example("reformer")
    with pytest.raises(linrec.LinrecError) as refused:
        linformer.emit_gradient("chunkwise")
    assert str(refused.value).endswith(". Gradient forms derived: parallel (see `linrec check`)")
    with pytest.raises(linrec.LinrecError) as refused:
        reformer.vjp(reformer.random_inputs(1, 4, 1), {}, form="recurrent", backend="c")
    assert str(refused.value).endswith(". Gradient forms derived: parallel, chunkwise (see `linrec check`)")


# ---- points without a derivative -------------------------------------------------------------------------
def test_sqrt_at_zero_names_the_place():
    rec = linrec.compile("recurrence r(dk = 3, dv = 2)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                         "S = S + sqrt(abs(k))⊗v\noutput o = q·S\n", "r.lin")
    inputs = rec.random_inputs(1, 3, 1, seed=0)
    inputs["k"][0, 1, 0, 2] = 0.0
    for backend in ("numpy", "c"):
        for form in rec.forms:  # the index [B, T, H, i] in every form (the recurrent one on NumPy left out T)
            with pytest.raises(linrec.RuntimeInputError, match=r"sqrt has no derivative at 0.*`sqrt\(abs\(k\)\)` at "
                                                               r"r.lin:4:9, at index \[0, 1, 0, 2\] of its argument"):
                rec.vjp(inputs, {"o": np.ones((1, 3, 1, 2))}, form=form, backend=backend)
    inputs["k"][0, 1, 0, 2] = 0.5
    assert np.all(np.isfinite(rec.vjp(inputs, {"o": np.ones((1, 3, 1, 2))}).grads["k"]))


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_power_of_zero_has_gradient_zero_in_its_exponent(backend):
    """∂(a^e)/∂e = a^e·log a is 0·(−∞) at a = 0: 0 for e ≥ 0 (PyTorch's choice) in every form, where it came out
    NaN and went into the training step; elsewhere a^e·log a as before (against central differences)."""
    rec = linrec.compile("recurrence pv(dk = 4, dv = 3)\ninput q[dk], k[dk], v[dv], e[dk]\nstate S[dk, dv]\n"
                         "S = S + (abs(k)^e)⊗v\noutput o = q·S\n", "pv.lin")
    x = rec.random_inputs(1, 3, 1, seed=0)
    x["e"][:] = np.array([2.0, 0.0, 1.5, 3.0])
    x["k"][0, 1, 0, :2] = 0.0
    up = {"o": np.random.default_rng(1).standard_normal((1, 3, 1, 3))}
    loss = lambda e: float(np.sum(up["o"] * rec.run(dict(x, e=e), form="recurrent").outputs["o"]))  # noqa: E731
    for form in rec.forms:
        grads = rec.vjp(x, up, form=form, backend=backend).grads["e"]
        assert np.all(np.isfinite(grads)) and np.all(grads[0, 1, 0, :2] == 0), (form, grads)
        for index in ((0, 0, 0, 1), (0, 1, 0, 2), (0, 2, 0, 3)):  # away from 0: the derivative itself
            step = np.zeros_like(x["e"])
            step[index] = 1e-6
            fd = (loss(x["e"] + step) - loss(x["e"] - step)) / 2e-6
            assert abs(grads[index] - fd) <= 1e-6 * max(1.0, abs(fd)), (form, index, grads[index], fd)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_an_infinite_slope_that_a_later_subgradient_stops_is_no_error(backend):
    """sqrt(relu(k)): at k < 0 sqrt's slope at 0 is infinite, and relu's subgradient 0 below 0 stops it (as in
    PyTorch); the call failed at the first such point. The gradient is 0 there and the derivative elsewhere
    (central differences), in every form; where nothing stops it (sqrt(abs(k)) at 0) it is still the error."""
    rec = linrec.compile("recurrence sr(dk = 4, dv = 3)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                         "S = S + sqrt(relu(k))⊗v\noutput o = q·S\n", "sr.lin")
    x = rec.random_inputs(1, 3, 1, seed=0)
    assert (x["k"] < 0).any() and (x["k"] > 0).any()
    up = {"o": np.random.default_rng(1).standard_normal((1, 3, 1, 3))}
    loss = lambda k: float(np.sum(up["o"] * rec.run(dict(x, k=k), form="recurrent").outputs["o"]))  # noqa: E731
    for form in rec.forms:
        grads = rec.vjp(x, up, form=form, backend=backend).grads["k"]
        assert np.all(grads[x["k"] < 0] == 0), form
        for index in map(tuple, np.argwhere(x["k"] > 0)[:3]):
            step = np.zeros_like(x["k"])
            step[index] = 1e-7
            fd = (loss(x["k"] + step) - loss(x["k"] - step)) / 2e-7
            assert abs(grads[index] - fd) <= 1e-6 * max(1.0, abs(fd)), (form, index, grads[index], fd)


def test_subgradients_at_zero():
    """abs and relu at 0: subgradient 0; norm of the zero vector: 0."""
    rec = linrec.compile("recurrence r(dk = 3, dv = 2)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                         "S = S + (abs(k) + relu(k))⊗v\noutput o = q·S*norm(q)\n")
    inputs = rec.random_inputs(1, 3, 1, seed=0)
    inputs["k"][0, 0, 0, :] = 0.0
    inputs["q"][0, 1, 0, :] = 0.0
    grads = rec.vjp(inputs, {"o": np.ones((1, 3, 1, 2))}).grads
    assert np.all(grads["k"][0, 0, 0] == 0) and np.all(grads["q"][0, 1, 0] == 0)
    assert np.all(grads["k"][0, 1, 0] != 0) and np.all(grads["q"][0, 2, 0] != 0)


# ---- command line ----------------------------------------------------------------------------------------
def test_cli(capsys):
    gla = str(EXAMPLES / "gla.lin")
    assert main(["check", gla]) == 0
    out = capsys.readouterr().out
    assert "gradients" in out and "  recurrent   available (backends: numpy, c)" in out.split("gradients")[1]
    assert main(["emit", gla, "--grad", "--form", "recurrent"]) == 0
    source = capsys.readouterr().out
    assert "def backward(" in source and "d_S_prev" in source
    assert main(["verify", gla, "--grad", "--quick", "--dtype", "float64"]) == 0
    assert "0 failed" in capsys.readouterr().out
    assert main(["emit", str(EXAMPLES / "softmax.lin"), "--grad"]) == 0
    assert "d_k_seq[:, :, keys] +=" in capsys.readouterr().out
    assert main(["emit", str(EXAMPLES / "linformer.lin"), "--grad"]) == 0  # (its only gradient form: parallel)
    assert "pad_to(d_E" in capsys.readouterr().out
    assert main(["emit", str(EXAMPLES / "reformer.lin"), "--grad", "--form", "chunkwise"]) == 0
    assert "vjp_lsh_attention_bucketed(q, v, d_o, causal" in capsys.readouterr().out


# ---- long sequences: gradients stay finite where the forward is stable ------------------------------------
LONG = 32768   # tokens; B = H = 1, small dims, float64
SPLIT = 256    # the last tokens, run again alone from the state the long forward had before them


def _long_inputs(rec, dims, seed):
    x = rec.random_inputs(1, LONG, 1, dims, np.float64, seed=seed)
    rng = np.random.default_rng(seed + 1)
    up = {o.name: rng.standard_normal((1, LONG, 1) + tuple(dims[d] for d in o.value.shape))
          for o in rec.program.outputs}
    return x, up


def _assert_finite(result):
    for name, g in result.grads.items():
        assert np.all(np.isfinite(g)), name


def _assert_split_agrees(rec, x, up, long, dims, form):
    """The long call's gradients of the last SPLIT tokens are those of the last SPLIT tokens run alone
    (recurrent backward: the definition) from the state the forward reaches before them — to 1e-9 of each
    array's largest value."""
    head = {k: v[:, :-SPLIT] for k, v in x.items()}
    before = rec.run(head, form=form, dims=dims).final_state
    tail = rec.vjp({k: v[:, -SPLIT:] for k, v in x.items()}, {k: v[:, -SPLIT:] for k, v in up.items()},
                   initial_state=before, dims=dims)
    for name in x:
        ref, got = tail.grads[name], long.grads[name][:, -SPLIT:]
        assert np.max(np.abs(got - ref)) <= FORM_TOLERANCE * np.max(np.abs(ref)), name


def test_long_gla_strong_and_vanishing_decays():
    """GLA at T = 32768 (chunkwise backward, the fastest gradient form) with log-decays from mild to −20 (strong)
    and from −20 to −700 (decays of e^−700, near zero but not a reset), mixed token by token and channel by
    channel: every gradient is finite, and the last tokens' agree with the same tokens run alone."""
    rec, dims = example("gla"), {"dk": 4, "dv": 4}
    x, up = _long_inputs(rec, dims, seed=3)
    rng = np.random.default_rng(7)
    kind = rng.integers(0, 3, x["g"].shape)
    x["g"] = np.choose(kind, [-rng.uniform(0, 1, kind.shape), -rng.uniform(1, 20, kind.shape),
                              -rng.uniform(20, 700, kind.shape)])
    long = rec.vjp(x, up, form="chunkwise", dims=dims)
    _assert_finite(long)
    assert np.max(np.abs(long.grads["g"])) > 0 and np.max(np.abs(long.grads["k"][:, :SPLIT])) > 0
    _assert_split_agrees(rec, x, up, long, dims, "chunkwise")


def test_long_gla_resets():
    """A decay of exactly 0 (log-decay −∞) at token t resets the state (docs/guarantees.md). At T = 32768 with
    resets in every channel at three tokens (the recurrent backward; test_a_decay_of_zero and the C tests hold
    the parallel and chunkwise ones to it at resets): every gradient is finite — ∂g is 0 where g = −∞ — the inputs before the
    last reset get exactly zero gradient from the outputs after it, the initial state too, and the tokens from
    the last reset on have the gradients of those tokens run alone from a zero state."""
    rec, dims = example("gla"), {"dk": 4, "dv": 4}
    x, up = _long_inputs(rec, dims, seed=5)
    resets = [1000, 20000, LONG - 300]
    x["g"][:, resets] = -np.inf
    last = resets[-1]
    after = {k: np.where(np.arange(LONG)[None, :, None, None] >= last, v, 0.0) for k, v in up.items()}
    state0 = {"S": np.random.default_rng(0).standard_normal((1, 1, 4, 4))}
    long = rec.vjp(x, after, initial_state=state0, dims=dims)
    _assert_finite(long)
    assert np.all(long.grads["g"][:, resets] == 0.0)
    for name in x:
        assert np.all(long.grads[name][:, :last] == 0.0), name   # exactly: a reset cuts every path
    assert np.all(long.grads["S"] == 0.0)
    alone = rec.vjp({k: v[:, last:] for k, v in x.items()}, {k: v[:, last:] for k, v in up.items()}, dims=dims)
    for name in x:
        ref = alone.grads[name]
        assert np.max(np.abs(long.grads[name][:, last:] - ref)) <= FORM_TOLERANCE * np.max(np.abs(ref)), name


def test_long_performer():
    """Performer (exponential feature maps: forward stabilized, backward the statements as written —
    docs/gradients.md) at T = 32768, chunkwise backward, inputs scaled up ×3 so the features span many orders
    of magnitude: every gradient is finite and the last tokens' agree with the same tokens run alone from the
    forward's state before them (whose sums have grown over 32512 tokens)."""
    rec, dims = example("performer"), {"dk": 4, "dv": 4, "m": 8}
    x, up = _long_inputs(rec, dims, seed=9)
    x = {k: 3 * v for k, v in x.items()}
    long = rec.vjp(x, up, form="chunkwise", dims=dims)
    _assert_finite(long)
    _assert_split_agrees(rec, x, up, long, dims, "chunkwise")


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_performer_in_float32_where_its_unstabilized_features_fail_runs_in_float64(backend):
    """Performer in float32 with q and k ×6: the forward forms (stabilized) are finite, the backward (the
    statements as written) is 0/0 there in float32. vjp then runs the backward again in float64 and rounds the
    results back: float32 arrays, finite, within float32's rounding (1e-5 of the largest) of the float64 call's.
    With q and k ×30 the features fail in float64 too, and the error says so and to scale the inputs down."""
    rec, dims = example("performer"), {"dk": 4, "dv": 4, "m": 8}
    x = {k: (6 * v if k in ("q", "k") else v) for k, v in rec.random_inputs(1, 64, 2, dims=dims, seed=0).items()}
    up = {"o": np.ones((1, 64, 2, 4))}
    x32 = {k: v.astype(np.float32) for k, v in x.items()}
    assert np.isfinite(rec.run(x32, form="chunkwise", backend=backend, dims=dims).outputs["o"]).all()
    narrow = rec.vjp(x32, {"o": up["o"].astype(np.float32)}, backend=backend, dims=dims)
    wide = rec.vjp(x, up, backend=backend, dims=dims)
    for name, ref in [*wide.grads.items(), *(("output " + k, v) for k, v in wide.outputs.items())]:
        got = narrow.grads[name] if name in narrow.grads else narrow.outputs[name.split()[1]]
        assert got.dtype == np.float32, name
        assert np.isfinite(got).all(), name
        assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref)), name
    x30 = {k: (5 * v if k in ("q", "k") else v) for k, v in x32.items()}
    with pytest.raises(linrec.RuntimeInputError, match="this program's feature maps are exponential.*without "
                                                       "the stabilization.*even in float64.*Scale the inputs down"):
        rec.vjp(x30, {"o": up["o"].astype(np.float32)}, backend=backend, dims=dims)


def test_performer_gradients_that_fail_alone_are_refused():
    """Performer's backward differentiates the statements without the forward's stabilization, so its gradients
    can fail where its outputs are finite (found by probing): with q and k ×12.75 in float64 every gradient was
    NaN, and with ×7 in float32 the initial states' gradients (8e42 in float64) came back ∞ — returned without a
    word, for an optimizer to step on. Such a call is now refused, naming the gradient; the gradient of an
    initial state the caller did not pass is not held against it."""
    rec, dims = example("performer"), {"dk": 16, "dv": 8, "m": 64}
    x = rec.random_inputs(batch=1, tokens=17, heads=2, dims=dims, seed=7)
    up = {"o": np.random.default_rng(0).standard_normal((1, 17, 2, 8))}
    big = {k: (12.75 * v if k in ("q", "k") else v) for k, v in x.items()}
    assert np.isfinite(rec.run(big, dims=dims).outputs["o"]).all()
    for backend in ("numpy", "c"):
        with pytest.raises(linrec.RuntimeInputError, match="the gradient of 'q' is NaN for these \\(finite\\) "
                                                           "arguments.*even in float64"):
            rec.vjp(big, up, dims=dims, backend=backend)
    x32 = {k: (7 * v if k in ("q", "k") else v).astype(np.float32) for k, v in x.items()}
    up32 = {"o": up["o"].astype(np.float32)}
    s0 = {s.name: np.zeros((1, 2) + tuple(dims[d] for d in s.shape), np.float32) for s in rec.program.states}
    for backend in ("numpy", "c"):
        with pytest.raises(linrec.RuntimeInputError, match="the gradient of '[Sz]' is not finite.*beyond float32's "
                                                           "range"):
            rec.vjp(x32, up32, dims=dims, backend=backend, initial_state=s0)
        result = rec.vjp(x32, up32, dims=dims, backend=backend)  # (no initial state passed)
        assert all(np.isfinite(result.grads[k]).all() for k in ("q", "k", "v", "W"))


def test_first_contributions_make_the_adjoint_from_its_value():
    """linrec.numpy.adjoint_derived.first_contributions: zeros plus a first add become own_array of the value —
    kept as it is only where the code made it or only reads the adjoint (and the array the value names) from then
    on (an array added to later, or handed back, is copied; one only read is READ: even a view of it is read
    where it lies) — and an adjoint whose first use reads it stays zeros."""
    lines = ["d_a = np.zeros_like(a)", "d_b = np.zeros((batch, n), dtype)", "d_c = np.zeros_like(c)",
             "d_e = np.zeros_like(e)", "# adjoint of d_a in a comment", "d_a += d_o",
             "d_b += x * 2", "d_c += d_c.sum()", "d_e += d_o", "d_e += y", "f(d_a)", "grads = {\"e\": d_e}",
             "d_f = np.zeros_like(f)", "d_f += d_g.x", "d_g += z", "f(d_f)"]
    got = first_contributions(lines)
    assert got == ["d_c = np.zeros_like(c)", "# adjoint of d_a in a comment",
                   "d_a = own_array(d_o, a.shape, a.dtype, 'read')",
                   "d_b = own_array(x * 2, (batch, n), dtype, True)", "d_c += d_c.sum()",
                   "d_e = own_array(d_o, e.shape, e.dtype, False)", "d_e += y", "f(d_a)", "grads = {\"e\": d_e}",
                   "d_f = own_array(d_g.x, f.shape, f.dtype, False)", "d_g += z", "f(d_f)"]
    given = np.ones((2, 3), np.float32)
    assert own_array(given, (2, 3), np.float32, True) is given
    for copied in (own_array(given, (2, 3), np.float32, False), own_array(given, (2, 3), np.float64, True),
                   own_array(given[:, :1], (2, 3), np.float32, True), own_array(given[0], (2, 3), np.float32, True)):
        assert copied is not given and copied.base is None and copied.shape == (2, 3) and np.all(copied == 1)

"""Variants no example and no compiler change was written for, as their papers write them, compiled unchanged:
every forward form on both backends against a loop written here from the math, and every gradient form on both
backends against the NumPy recurrent backward, itself checked against central finite differences.

    rwkv7      a generalized delta rule: (diag(e^w) − k̂⊗(a⊙k̂))·S + k⊗v, read by r
    longhorn   the delta rule with its step size from the key: β = ε/(1 + ε‖k‖²)
    hgrn2      a forget gate whose complement is the key: diag(f)·S + (1 − f)⊗v
    dproduct   two Householder-like steps per token (DeltaProduct), written as one nested update
    gsa        gated slot attention: two states of slots, read through a softmax over the slots
    mlstm      xLSTM's matrix memory with its normalizer state and max(|n·q|, 1) (as 1 + relu(|n·q| − 1))
    hedgehog   learned softmax feature maps over a param matrix, normalized by a second state
    ttt_linear TTT-Linear's inner gradient step on raw keys: a delta rule whose state grows
    aaren      attention as a recurrence with a learned query: exp(q0·k)-weighted sums of v and of 1, divided
    lru        the linear recurrent unit: a per-head decay and the input scaled by sqrt(1 − λ²)
    rope       rotary position features on q and k (cos and sin of the token's position times a param
               frequency, the rotation a param matrix), a per-head decay: RetNet's xPos as features
    positions  rope with the positions a running sum, P = P + theta, in a stage of its own that reads no input:
               a packed sequence or a decode step counts from its own initial state
    mamba3     Mamba-3's trapezoidal rule: the state takes a blend of this token's write and the previous
               token's, which two vector states of decay 0 (`K = k`) hold for the next token

Tolerances (float64): 1e-9 of the largest magnitude for every form and backend against the loop and for every
gradient form against the recurrent one (the forms' tolerance); the recurrent backward against central
differences on random directions at verify_grad's 1e-6.
"""
from __future__ import annotations

import numpy as np
import pytest

import linrec
from test_grad import FD_TOLERANCE, arrays_for, assert_same_gradients
from linrec import verify_grad

FORMS = ("recurrent", "parallel", "chunkwise")
B, T, H = 2, 13, 2
CHUNK = 4  # several chunks, the last one partial
TOL = 1e-9


def l2norm(x):
    return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# each: (program, the loop over one (batch row, head): arrays of one token → the next state and the output)
VARIANTS = {
    "rwkv7": ("""recurrence rwkv7(dk = 5, dv = 4)
input r[dk], k[dk], v[dv], a[dk] in (0, 1)
input w[dk] <= 0
kk = l2norm(k)
state S[dk, dv]
S = (diag(exp(w)) − kk⊗(a*kk))·S + k⊗v
output o = r·S
""", lambda x, s: _one_state(s, lambda S: (np.diag(np.exp(x["w"])) - np.outer(l2norm(x["k"]), x["a"] * l2norm(x["k"]))) @ S
                              + np.outer(x["k"], x["v"]), lambda S: {"o": x["r"] @ S})),
    "longhorn": ("""recurrence longhorn(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], eps > 0
beta = eps/(1 + eps*(k·k))
state S[dk, dv]
S = (I − beta·k⊗k)·S + beta·k⊗v
output o = q·S
""", lambda x, s: _one_state(s, lambda S: S - _b(x) * np.outer(x["k"], x["k"] @ S) + _b(x) * np.outer(x["k"], x["v"]),
                             lambda S: {"o": x["q"] @ S})),
    "hgrn2": ("""recurrence hgrn2(dk = 5, dv = 4)
input q[dk], f[dk] in (0, 1), v[dv]
state S[dk, dv]
S = diag(f)·S + (1 − f)⊗v
output o = q·S
""", lambda x, s: _one_state(s, lambda S: x["f"][:, None] * S + np.outer(1 - x["f"], x["v"]),
                             lambda S: {"o": x["q"] @ S})),
    "dproduct": ("""recurrence dproduct(dk = 5, dv = 4)
input q[dk], k1[dk], k2[dk], v1[dv], v2[dv], b1 in (0, 1), b2 in (0, 1)
n1 = l2norm(k1)
n2 = l2norm(k2)
state S[dk, dv]
S = (I − b2·n2⊗n2)·((I − b1·n1⊗n1)·S + b1·n1⊗v1) + b2·n2⊗v2
output o = q·S
""", lambda x, s: _one_state(s, lambda S: _householder(x, "2", _householder(x, "1", S)), lambda S: {"o": x["q"] @ S})),
    "gsa": ("""recurrence gsa(dk = 5, dv = 4, m = 3)
input q[dk], k[dk], v[dv], a[m] in (0, 1)
state K[m, dk], V[m, dv]
K = diag(a)·K + (1 − a)⊗k
V = diag(a)·V + (1 − a)⊗v
output o = softmax(K·q)·V
""", lambda x, s: _slots(x, s)),
    "mlstm": ("""recurrence mlstm(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], ipre, fpre
state C[dk, dv], n[dk]
C = sigmoid(fpre)·C + exp(ipre)·k⊗v
n = sigmoid(fpre)·n + exp(ipre)·k
output y = (dk^(−1/2)·q·C)/(1 + relu(abs(dk^(−1/2)·n·q) − 1))
""", lambda x, s: _mlstm(x, s)),
    # the delta rule on raw keys with a step up to 1: 1 − eta·‖k‖² down to −15, a state that grows
    "ttt_linear": ("""recurrence ttt_linear(d = 5)
input q[d], k[d], v[d], eta in (0, 1)
state W[d, d]
W = W − eta·k⊗(k·W − v)
output z = q + groupnorm(q·W)
""", lambda x, s: _ttt(x, s)),
    # a vector state of exponential writes, read as itself, normalized by another (its scales cancel)
    "aaren": ("""recurrence aaren(dk = 5, dv = 4, one = 1)
input k[dk], v[dv]
param q0[dk] per head = randn(std=0.25, seed=0)
s = q0·k
state a[dv], c[one]
a = a + exp(s)*v
c = c + exp(s)
output o = a/sum(c)
""", lambda x, s: _aaren(x, s)),
    # (C's fused kernel computed sqrt(1 − lam^2), fixed per head, before the token loop from the decay's per-token
    # array, and failed to compile: 'u' undeclared — a probe's finding)
    "lru": ("""recurrence lru(d = 4, n = 5)
input x[d]
param nu_log[n] per head = log(uniform(0.01, 1, seed=0))
param B[n, d] per head = randn(std=0.25, seed=1)
param C[d, n] per head = randn(std=0.25, seed=2)
param D[d] per head = randn(seed=3)
lam = exp(−exp(nu_log))
state hs[n]
hs = lam*hs + sqrt(1 − lam^2)*(B·x)
output y = C·hs + D*x
""", lambda x, s: _lru(x, s)),
    "hedgehog": ("""recurrence hedgehog(dk = 5, dv = 4, df = 6)
param W[df, dk] = randn(seed=0)
input q[dk], k[dk], v[dv]
fq = softmax(W·q)
fk = softmax(W·k)
state S[df, dv], z[df]
S = S + fk⊗v
z = z + fk
output o = (fq·S)/(fq·z)
""", lambda x, s: _hedgehog(x, s)),
    # rotary features of the token's position (an input: the caller's positions, packed or not)
    "rope": ("""recurrence rope(dk = 6, dv = 4)
input q[dk], k[dk], v[dv], pos
param theta[dk] = uniform(0, 1, seed=3)
param R[dk, dk] = randn(seed=4)
param gamma per head = uniform(0.8, 0.99, seed=5)
state S[dk, dv]
qr = q*cos(pos*theta) + (R·q)*sin(pos*theta)
kr = k*cos(pos*theta) + (R·k)*sin(pos*theta)
S = gamma*S + kr⊗v
output o = qr·S
""", lambda x, s: _rope(x, s)),
    # the positions as a state: (t + 1)·theta at token t, from the initial state
    "positions": ("""recurrence positions(dk = 6, dv = 4)
input q[dk], k[dk], v[dv]
param theta[dk] = uniform(0, 1, seed=3)
param R[dk, dk] = randn(seed=4)
param gamma per head = uniform(0.8, 0.99, seed=5)
state P[dk], S[dk, dv]
P = P + theta
qr = q*cos(P) + (R·q)*sin(P)
kr = k*cos(P) + (R·k)*sin(P)
S = gamma*S + kr⊗v
output o = qr·S
""", lambda x, s: _positions(x, s)),
    # the previous token's write: vector states that hold their token's value only (a decay of 0)
    "mamba3": ("""recurrence mamba3(dk = 5, dv = 4)
input q[dk], k[dk], v[dv], dt > 0, lam in (0, 1)
param A per head = uniform(0.5, 2, seed=6)
state S[dk, dv], K[dk], V[dv]
S = exp(−A*dt)·S + (1 − lam)·exp(−A*dt)·dt·K⊗V + lam·dt·k⊗v
K = k
V = v
output o = q·S
""", lambda x, s: _mamba3(x, s)),
}


def _b(x):
    return x["eps"] / (1 + x["eps"] * (x["k"] @ x["k"]))


def _householder(x, i, S):
    n, b, v = l2norm(x["k" + i]), x["b" + i], x["v" + i]
    return S - b * np.outer(n, n @ S) + b * np.outer(n, v)


def _one_state(state, update, read):
    (name,) = state
    new = {name: update(state[name])}
    return new, read(new[name])


def _slots(x, s):
    a = x["a"]
    K = a[:, None] * s["K"] + np.outer(1 - a, x["k"])
    V = a[:, None] * s["V"] + np.outer(1 - a, x["v"])
    return {"K": K, "V": V}, {"o": softmax(K @ x["q"]) @ V}


def _rotary(x, s, angle):
    """rope's step with the rotation by `angle` (the position times theta, given or kept as a state)."""
    c, sn = np.cos(angle), np.sin(angle)
    qr, kr = x["q"] * c + (x["R"] @ x["q"]) * sn, x["k"] * c + (x["R"] @ x["k"]) * sn
    S = x["gamma"] * s["S"] + np.outer(kr, x["v"])
    return {"S": S}, {"o": qr @ S}


def _rope(x, s):
    return _rotary(x, s, x["pos"] * x["theta"])


def _positions(x, s):
    P = s["P"] + x["theta"]
    states, outputs = _rotary(x, s, P)
    return {"P": P, **states}, outputs


def _mamba3(x, s):
    a, dt, lam = np.exp(-x["A"] * x["dt"]), x["dt"], x["lam"]
    S = a * s["S"] + (1 - lam) * a * dt * np.outer(s["K"], s["V"]) + lam * dt * np.outer(x["k"], x["v"])
    return {"S": S, "K": x["k"], "V": x["v"]}, {"o": x["q"] @ S}


def _mlstm(x, s):
    f, i = sigmoid(x["fpre"]), np.exp(x["ipre"])
    C = f * s["C"] + i * np.outer(x["k"], x["v"])
    n = f * s["n"] + i * x["k"]
    scale = len(x["q"]) ** -0.5
    return {"C": C, "n": n}, {"y": scale * (x["q"] @ C) / max(abs(scale * (n @ x["q"])), 1.0)}


def _ttt(x, s):
    k = x["k"]
    W = s["W"] - x["eta"] * np.outer(k, k @ s["W"] - x["v"])
    y = x["q"] @ W
    return {"W": W}, {"z": x["q"] + (y - y.mean()) / np.sqrt(y.var() + 1e-5)}


def _aaren(x, s):
    # (the states as the run returns them, at their true scale: initial ones too)
    w = np.exp(x["q0"] @ x["k"])
    a, c = s["a"] + w * x["v"], s["c"] + w
    return {"a": a, "c": c}, {"o": a / c.sum()}


def _lru(x, s):
    lam = np.exp(-np.exp(x["nu_log"]))
    hs = lam * s["hs"] + np.sqrt(1 - lam ** 2) * (x["B"] @ x["x"])
    return {"hs": hs}, {"y": x["C"] @ hs + x["D"] * x["x"]}


def _hedgehog(x, s):
    fq, fk = softmax(x["W"] @ x["q"]), softmax(x["W"] @ x["k"])
    S, z = s["S"] + np.outer(fk, x["v"]), s["z"] + fk
    return {"S": S, "z": z}, {"o": (fq @ S) / (fq @ z)}


_RECS: dict[str, linrec.Recurrence] = {}


def _rec(name: str) -> linrec.Recurrence:
    if name not in _RECS:
        _RECS[name] = linrec.compile(VARIANTS[name][0], f"{name}.lin")
    return _RECS[name]


def _loop(name, rec, inputs, params, state0):
    """The outputs by the loop of VARIANTS, token by token for every (batch row, head)."""
    step, per_head = VARIANTS[name][1], {p.name for p in rec.program.params if p.per_head}
    outputs = {o.name: np.zeros((B, T, H) + tuple(_size(rec, d) for d in o.value.shape)) for o in rec.program.outputs}
    for b in range(B):
        for h in range(H):
            state = {k: v[b, h] for k, v in state0.items()}
            for t in range(T):
                x = {k: v[b, t, h] for k, v in inputs.items()}
                x |= {k: (v[h] if k in per_head else v) for k, v in params.items()}
                state, out = step(x, state)
                for k, v in out.items():
                    outputs[k][b, t, h] = v
    return outputs


def _size(rec, dim: str) -> int:
    return next(d.default for d in rec.program.dims if d.name == dim)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_form_on_both_backends_equals_the_loop(name):
    rec = _rec(name)
    assert rec.forms == FORMS
    inputs, params, state0, _, _ = arrays_for(rec, B, T, H, seed=5)
    want = _loop(name, rec, inputs, params, state0)
    for backend in ("numpy", "c"):
        for form in FORMS:
            got = rec.run(inputs, form=form, backend=backend, params=params, initial_state=state0,
                          chunk_size=CHUNK).outputs
            for k, ref in want.items():
                err = np.max(np.abs(got[k] - ref)) / np.max(np.abs(ref))
                assert err < TOL, (form, backend, k, err)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_gradient_form_on_both_backends_equals_the_recurrent_one(name):
    rec = _rec(name)
    inputs, params, state0, g_out, g_state = arrays_for(rec, B, T, H, seed=6)
    call = dict(grad_final_state=g_state, initial_state=state0, params=params, chunk_size=CHUNK)
    reference = rec.vjp(inputs, g_out, form="recurrent", backend="numpy", **call)
    errors = verify_grad.directional_errors(rec, inputs, params, state0, g_out, g_state, reference.grads, None, 6)
    assert set(errors) == set(reference.grads)
    bad = {k: rel for k, (_, rel) in errors.items() if not rel <= FD_TOLERANCE}
    assert not bad, f"finite differences disagree (relative errors {bad})"
    for backend in ("numpy", "c"):
        for form in FORMS:
            assert_same_gradients(rec.vjp(inputs, g_out, form=form, backend=backend, **call), reference, TOL)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # (the final states at their true scale: beyond float32)
@pytest.mark.parametrize("dtype, scale", [(np.float32, 80), (np.float64, 600)])
def test_exponential_writes_whose_scales_cancel_stay_finite(dtype, scale):
    """Aaren's o = a/sum(c) with scores q0·k up to ~100 (float32) and ~840 (float64), where exp overflows: the
    states are stabilized (carried times exp(−max score)) and their scales cancel in the quotient. C's fused
    kernel and decode step multiplied them back in through sum(c) — inf/inf, NaN for every token of a head —
    and in float64 every form did (a probe's finding): sum, like every positively homogeneous builtin, passes
    a scale through. Every form on both backends and the decode step against the softmax-weighted mean of v."""
    rec = _rec("aaren")
    x = rec.random_inputs(1, 24, 2, seed=0)
    x["k"] = x["k"] * scale
    q0 = rec.run(x, form="recurrent").params["q0"]
    s = np.einsum("bthd,hd->bth", x["k"], q0)
    assert s.max() > (88 if dtype == np.float32 else 709)  # (exp overflows)
    want = np.zeros_like(x["v"])
    for t in range(24):
        w = np.exp(s[:, :t + 1] - s[:, :t + 1].max(1, keepdims=True))
        want[:, t] = np.einsum("bth,bthd->bhd", w, x["v"][:, :t + 1]) / w.sum(1)[..., None]
    x = {k: v.astype(dtype) for k, v in x.items()}
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    for backend in ("numpy", "c"):
        for form in FORMS:
            got = rec.run(x, form=form, backend=backend).outputs["o"]
            assert np.max(np.abs(got - want)) < tolerance, (form, backend)
        state, steps = None, []
        for t in range(24):
            o, state = rec.step({k: v[:, t] for k, v in x.items()}, state, backend=backend)
            steps.append(o["o"])
        assert np.max(np.abs(np.stack(steps, 1) - want)) < tolerance, backend


def test_a_growing_delta_rule_keeps_its_digits_in_numpys_parallel_and_chunkwise_forms():
    """TTT-Linear on raw keys: 1 − eta·‖k‖² reaches −15 at d = 16, so the state grows, and the entries of a
    segment's triangular system with it. NumPy's parallel and chunkwise forms solved each segment whole and were
    0.8 off at T = 512 (1e-5 at T = 64) where C's, which solve in sub-chunks of 16, were 1e-13 (a probe's finding).
    A segment that could grow by more than e^4 now runs in halves."""
    rec = linrec.compile(VARIANTS["ttt_linear"][0].replace("d = 5", "d = 16"), "ttt_linear.lin")
    x = rec.random_inputs(1, 512, 2, seed=1)
    want = rec.run(x, form="recurrent", backend="numpy").outputs["z"]
    for backend in ("numpy", "c"):
        for form in ("parallel", "chunkwise"):
            got = rec.run(x, form=form, backend=backend).outputs["z"]
            assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < TOL, (form, backend)


def test_a_growing_delta_rule_keeps_its_digits_in_numpys_parallel_and_chunkwise_backward():
    """The backward of the program above: NumPy's parallel and chunkwise backward solved the transposed system in
    sub-chunks of 64 tokens, and every gradient was 8e-8 off the recurrent backward at T = 512 (C's, in
    sub-chunks of 16: 5e-11). Its sub-chunks are now halved, as the forward's segments, until none can stretch
    the state by more than e^4."""
    rec = linrec.compile(VARIANTS["ttt_linear"][0].replace("d = 5", "d = 16"), "ttt_linear.lin")
    x = rec.random_inputs(1, 512, 2, seed=1)
    rng = np.random.default_rng(0)
    g_out = {k: rng.standard_normal(v.shape) for k, v in rec.run(x, form="recurrent").outputs.items()}
    reference = rec.vjp(x, g_out, form="recurrent", backend="numpy")
    for backend in ("numpy", "c"):
        for form in ("parallel", "chunkwise"):
            assert_same_gradients(rec.vjp(x, g_out, form=form, backend=backend), reference, TOL)


@pytest.mark.parametrize("steps", [3, 4])
def test_rank_one_steps_written_one_by_one_are_as_many_corrections(steps):
    """DeltaProduct's steps written one statement each multiply out to 2ⁿ − 1 rank-one terms; those that share a
    vector u are one correction, so n steps are n corrections, the product's rank (a probe's finding: six steps
    ran as 63, the C chunkwise form 1.4 s for 256 tokens). Every form on both backends against the loop."""
    lines = "\n".join(f"S = S + b{i}·l2norm(k{i})⊗(v{i} − l2norm(k{i})·S)" for i in range(steps))
    names = ", ".join(f"k{i}[dk], v{i}[dv], b{i} in (0, 1)" for i in range(steps))
    rec = linrec.compile(f"recurrence steps(dk = 5, dv = 4)\ninput q[dk], {names}, g <= 0\nstate S[dk, dv]\n"
                         f"S = exp(g)·S\n{lines}\noutput o = q·S\n", "steps.lin")
    assert len(rec.decomposition.transition("S").corrections) == steps
    assert rec.forms == FORMS
    inputs, params, state0, _, _ = arrays_for(rec, B, T, H, seed=3)
    want = np.zeros((B, T, H, 4))
    for b in range(B):
        for h in range(H):
            S = state0["S"][b, h]
            for t in range(T):
                x = {k: v[b, t, h] for k, v in inputs.items()}
                S = np.exp(x["g"]) * S
                for i in range(steps):
                    S = _householder({"k": x[f"k{i}"], "b": x[f"b{i}"], "v": x[f"v{i}"]}, "", S)
                want[b, t, h] = x["q"] @ S
    for backend in ("numpy", "c"):
        for form in FORMS:
            got = rec.run(inputs, form=form, backend=backend, params=params, initial_state=state0,
                          chunk_size=CHUNK).outputs["o"]
            assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < TOL, (form, backend)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_positions_kept_as_a_state_count_from_each_sequences_start(backend):
    """The positions as a running sum P = P + theta (a stage that reads no input, which had no per-token array to
    take its sizes from, and failed in every form but the recurrent one): in a packed batch every sequence counts
    from its own initial state, and a prefill followed by decode steps goes on counting where it stopped."""
    rec = _rec("positions")
    x = rec.random_inputs(1, 11, 2, seed=4)
    cu = np.array([0, 4, 11])
    packed = {form: rec.run(x, form=form, backend=backend, cu_seqlens=cu).outputs["o"] for form in FORMS}
    alone = np.concatenate([rec.run({k: v[:, a:b] for k, v in x.items()}, backend="numpy").outputs["o"]
                            for a, b in zip(cu[:-1], cu[1:])], axis=1)
    for form, got in packed.items():
        assert np.max(np.abs(got - alone)) <= TOL * np.max(np.abs(alone)), form
    whole = rec.run(x, backend="numpy").outputs["o"]
    state = rec.prefill({k: v[:, :6] for k, v in x.items()}, backend=backend).final_state
    for t in range(6, 11):
        out, state = rec.step({k: v[:, t] for k, v in x.items()}, state, backend=backend)
        assert np.max(np.abs(out["o"] - whole[:, t])) <= TOL * np.max(np.abs(whole)), t

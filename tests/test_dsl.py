"""DSL features: ASCII spellings, comments, readout order, noncausal programs, user functions, per-head
params, and names that are Python keywords or non-ASCII. Each program is checked against a hand loop
(float64, tolerance 1e-12 relative to the largest expected magnitude) unless stated otherwise."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import linrec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RTOL = 1e-12


def assert_close(actual, expected, rtol=RTOL):
    actual = np.asarray(actual)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-300)
    err = float(np.max(np.abs(actual - expected))) / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol:g}"


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def elu1(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


# ---- ASCII spellings and comments ------------------------------------------------------------------
ASCII = {
    "gla": """# GLA in ASCII: '@' for the contraction, outer(a, b) for the outer product, '-' for minus
recurrence gla(dk = 16, dv = 16)    # a comment after the header

input q[dk], k[dk], v[dv]
input g[dk] <= 0
# a comment on its own line between statements
state S[dk, dv]
S = diag(exp(g)) @ S + outer(k, v)   # the update
output o = dk^(-1/2) @ q @ S
""",
    "retnet": """recurrence retnet(dk = 16, dv = 16)
input q[dk], k[dk], v[dv]
param gamma per head = 1 - 2^(-5 - h)
state S[dk, dv]
S = gamma @ S + outer(k, v)
output o = groupnorm(dk^(-1/2) @ q @ S)
""",
    "mamba2": """recurrence mamba2(dk = 16, dv = 16)
input x[dv], B[dk], C[dk]
input dt > 0
param A_log per head = log(uniform(1, 16, seed=0))
param A per head = -exp(A_log)
param D per head = randn(seed=1)
state S[dk, dv]
S = exp(dt @ A) @ S + outer(dt @ B, x)
output y = C @ S + D @ x
""",
    "deltanet": """recurrence deltanet(dk = 16, dv = 16)
input q[dk], k[dk], v[dv]
input beta in (0, 1)
qn = l2norm(q)
kn = l2norm(k)
state S[dk, dv]
S = (I - beta @ outer(kn, kn)) @ S + beta @ outer(kn, v)
output o = dk^(-1/2) @ qn @ S
""",
    "gated_deltanet": """recurrence gated_deltanet(dk = 16, dv = 16)
input q[dk], k[dk], v[dv]
input beta in (0, 1)
input g <= 0
qn = l2norm(q)
kn = l2norm(k)
state S[dk, dv]
S = exp(g) @ (I - beta @ outer(kn, kn)) @ S \\
    + beta @ outer(kn, v)
output o = dk^(-1/2) @ qn @ S
""",
    "linear_transformer": """recurrence linear_transformer(dk = 16, dv = 16)
input q[dk], k[dk], v[dv]
phi(x) = elu(x) + 1
state S[dk, dv], z[dk]
S = S + outer(phi(k), v)
z = z + phi(k)
output o = (phi(q) @ S) / (phi(q) @ z)
""",
}


@pytest.mark.parametrize("name", sorted(ASCII))
def test_ascii_spelling_gives_the_same_results(name):
    assert not any(ord(c) > 127 for c in ASCII[name])
    uni = linrec.load(EXAMPLES / f"{name}.lin")
    asc = linrec.compile(ASCII[name], f"{name}_ascii.lin")
    assert asc.name == uni.name
    x = uni.random_inputs(batch=2, tokens=5, heads=3, dims={"dk": 5, "dv": 4}, seed=7)
    rng = np.random.default_rng(7)
    s0 = {s.name: rng.uniform(0.5, 1.5, (2, 3) + tuple({"dk": 5, "dv": 4}[d] for d in s.shape))
          for s in uni.program.states}
    a, b = uni.run(x, initial_state=s0, form="recurrent"), asc.run(x, initial_state=s0, form="recurrent")
    assert set(a.outputs) == set(b.outputs) and set(a.final_state) == set(b.final_state)
    for k in a.outputs:
        np.testing.assert_array_equal(a.outputs[k], b.outputs[k])
    for k in a.final_state:
        np.testing.assert_array_equal(a.final_state[k], b.final_state[k])
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])


def test_alternative_dot_and_comment_only_lines():
    """'⋅' (U+22C5) is a third spelling of the contraction; comments may contain any text."""
    a = linrec.compile("recurrence t(dk = 3, dv = 2)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
                       "S = S + k⊗v\noutput o = q·S\n", "a.lin")
    b = linrec.compile("\n# leading comment · ⊗ − ( [\n\nrecurrence t(dk = 3, dv = 2)\n"
                       "input q[dk], k[dk], v[dv]  # q·S\nstate S[dk, dv]\n#\n"
                       "S = S + outer(k, v)\n\n\noutput o = q⋅S\n# trailing comment", "b.lin")
    x = a.random_inputs(batch=1, tokens=4, heads=2, seed=1)
    oa, ob = a.run(x, form="recurrent").outputs["o"], b.run(x, form="recurrent").outputs["o"]
    np.testing.assert_array_equal(oa, ob)
    S = np.cumsum(np.einsum("bthi,bthj->bthij", x["k"], x["v"]), axis=1)
    assert_close(ob, np.einsum("bthi,bthij->bthj", x["q"], S))


# ---- readout before the update ----------------------------------------------------------------------
READ_BEFORE = """recurrence pre(dk = 4, dv = 3)
input q[dk], k[dk], v[dv]
input g <= 0
state S[dk, dv]
prev = q·S
output before = q·S          # written before the update: reads S(t-1)
S = exp(g)·S + k⊗v
output after = q·S           # after the update: reads S(t)
output delta = q·S - prev
"""


def test_readout_before_update_reads_previous_state():
    rec = linrec.compile(READ_BEFORE, "pre.lin")
    B, T, H, dk, dv = 2, 6, 2, 4, 3
    x = rec.random_inputs(batch=B, tokens=T, heads=H, seed=3)
    S0 = np.random.default_rng(3).standard_normal((B, H, dk, dv))
    res = rec.run(x, initial_state={"S": S0}, form="recurrent")
    before = np.zeros((B, T, H, dv))
    after = np.zeros((B, T, H, dv))
    S_end = np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            S = S0[b, h].copy()
            for t in range(T):
                q = x["q"][b, t, h]
                before[b, t, h] = q @ S
                S = np.exp(x["g"][b, t, h]) * S + np.outer(x["k"][b, t, h], x["v"][b, t, h])
                after[b, t, h] = q @ S
            S_end[b, h] = S
    assert_close(res.outputs["before"], before)
    assert_close(res.outputs["after"], after)
    assert_close(res.outputs["delta"], after - before, rtol=1e-11)
    assert_close(res.final_state["S"], S_end)
    # the first token's "before" readout sees exactly the initial state
    assert_close(res.outputs["before"][:, 0], np.einsum("bhi,bhij->bhj", x["q"][:, 0], S0))


# ---- noncausal --------------------------------------------------------------------------------------
NONCAUSAL = """recurrence enc(dk=4, dv=4) noncausal
input q[dk], k[dk], v[dv]
state S[dk, dv]
S = S + k⊗v
output o = q·S
"""

NONCAUSAL_DECAY = """recurrence enc2(dk = 4, dv = 3) noncausal
input q[dk], k[dk], v[dv], g <= 0
state S[dk, dv]
output early = q·S             # written before the update, but noncausal: still the final state
S = exp(g)·S + k⊗v
output o = q·S
"""


def test_noncausal_outputs_read_the_final_state():
    rec = linrec.compile(NONCAUSAL, "enc.lin")
    assert rec.program.causal is False
    B, T, H = 2, 5, 3
    x = rec.random_inputs(batch=B, tokens=T, heads=H, seed=4)
    S0 = np.random.default_rng(4).standard_normal((B, H, 4, 4))
    res = rec.run(x, initial_state={"S": S0}, form="recurrent")
    S_T = S0 + np.einsum("bthi,bthj->bhij", x["k"], x["v"])
    assert_close(res.final_state["S"], S_T)
    assert_close(res.outputs["o"], np.einsum("bthi,bhij->bthj", x["q"], S_T))
    # the first token already sees the last token's contribution: differs from the causal program
    causal_rec = linrec.compile(NONCAUSAL.replace(" noncausal", ""), "causal.lin")
    causal = causal_rec.run(x, initial_state={"S": S0}, form="recurrent")
    assert_close(causal.outputs["o"][:, -1], res.outputs["o"][:, -1])
    assert np.max(np.abs(causal.outputs["o"][:, 0] - res.outputs["o"][:, 0])) > 1e-3


def test_noncausal_with_decay_and_readout_written_first():
    rec = linrec.compile(NONCAUSAL_DECAY, "enc2.lin")
    B, T, H, dk, dv = 1, 4, 2, 4, 3
    x = rec.random_inputs(batch=B, tokens=T, heads=H, seed=5)
    S0 = np.random.default_rng(5).standard_normal((B, H, dk, dv))
    res = rec.run(x, initial_state={"S": S0}, form="recurrent")
    S_T = np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            S = S0[b, h].copy()
            for t in range(T):
                S = np.exp(x["g"][b, t, h]) * S + np.outer(x["k"][b, t, h], x["v"][b, t, h])
            S_T[b, h] = S
    want = np.einsum("bthi,bhij->bthj", x["q"], S_T)
    assert_close(res.final_state["S"], S_T)
    assert_close(res.outputs["o"], want)
    assert_close(res.outputs["early"], want)


# ---- user functions --------------------------------------------------------------------------------
USER_FUNCTIONS = """recurrence uf(dk = 4, dv = 3)
input q[dk], k[dk], v[dv], a
phi(x) = elu(x) + 1
mix(x, y) = x*sigmoid(y) + phi(x)      # two parameters, calls another user function
gate(s) = sigmoid(s)^2
state S[dk, dv]
S = gate(a)·S + mix(k, q)⊗v
output o = phi(q)·S
output m = sum(mix(q, k))
"""


def test_user_functions():
    rec = linrec.compile(USER_FUNCTIONS, "uf.lin")
    B, T, H, dk, dv = 2, 5, 2, 4, 3
    x = rec.random_inputs(batch=B, tokens=T, heads=H, seed=6)
    S0 = np.random.default_rng(6).standard_normal((B, H, dk, dv))
    res = rec.run(x, initial_state={"S": S0}, form="recurrent")
    o = np.zeros((B, T, H, dv))
    m = np.zeros((B, T, H))
    for b in range(B):
        for h in range(H):
            S = S0[b, h].copy()
            for t in range(T):
                q, k, v, a = (x[n][b, t, h] for n in ("q", "k", "v", "a"))
                mix_kq = k * sigmoid(q) + elu1(k)
                S = sigmoid(a) ** 2 * S + np.outer(mix_kq, v)
                o[b, t, h] = elu1(q) @ S
                m[b, t, h] = np.sum(q * sigmoid(k) + elu1(q))
    assert_close(res.outputs["o"], o)
    assert_close(res.outputs["m"], m)


# ---- per-head parameters -----------------------------------------------------------------------------
PER_HEAD = """recurrence ph(dk = 3, dv = 2)
input q[dk], k[dk], v[dv]
param decay per head = 0.5^(h + 1)
param bias[dv] per head = h
param w[dv] per head = randn(seed=3)
param c[dk] = 2
state S[dk, dv]
S = decay·S + (c*k)⊗v
output o = (q·S)*w + bias
"""


def _per_head_loop(x, S0, decay, bias, w, c):
    B, T, H, dk = x["q"].shape
    dv = x["v"].shape[-1]
    o = np.zeros((B, T, H, dv))
    S_end = np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            S = S0[b, h].copy()
            for t in range(T):
                S = decay[h] * S + np.outer(c * x["k"][b, t, h], x["v"][b, t, h])
                o[b, t, h] = (x["q"][b, t, h] @ S) * w[h] + bias[h]
            S_end[b, h] = S
    return o, S_end


def test_per_head_params_defaults():
    rec = linrec.compile(PER_HEAD, "ph.lin")
    B, T, H = 2, 4, 3
    x = rec.random_inputs(batch=B, tokens=T, heads=H, seed=8)
    S0 = np.random.default_rng(8).standard_normal((B, H, 3, 2))
    res = rec.run(x, initial_state={"S": S0}, form="recurrent")
    p = res.params
    np.testing.assert_array_equal(p["decay"], [0.5, 0.25, 0.125])
    np.testing.assert_array_equal(p["bias"], [[0, 0], [1, 1], [2, 2]])
    assert p["w"].shape == (H, 2) and len(np.unique(p["w"])) == 2 * H
    np.testing.assert_array_equal(p["c"], [2, 2, 2])
    o, S_end = _per_head_loop(x, S0, p["decay"], p["bias"], p["w"], p["c"])
    assert_close(res.outputs["o"], o)
    assert_close(res.final_state["S"], S_end)
    # the seeded default is reproducible, and more heads extend it
    np.testing.assert_array_equal(rec.default_params(H)["w"], p["w"])
    assert rec.default_params(5)["decay"].shape == (5,)


def test_per_head_params_overridden():
    rec = linrec.compile(PER_HEAD, "ph.lin")
    B, T, H = 1, 3, 2
    x = rec.random_inputs(batch=B, tokens=T, heads=H, seed=9)
    S0 = np.random.default_rng(9).standard_normal((B, H, 3, 2))
    params = {"decay": np.array([1.0, 0.0]), "bias": np.array([[1.0, -1.0], [0.5, 2.0]]),
              "w": np.ones((H, 2)), "c": np.array([1.0, 0.0, -1.0])}
    res = rec.run(x, params=params, initial_state={"S": S0}, form="recurrent")
    for k, v in params.items():
        np.testing.assert_array_equal(res.params[k], v)
    o, S_end = _per_head_loop(x, S0, **params)
    assert_close(res.outputs["o"], o)
    assert_close(res.final_state["S"], S_end)


# ---- names that are keywords, internal names or non-ASCII ---------------------------------------------
KEYWORD_NAMES = """recurrence kw(import = 3, dv = 2)
input σ[import], def[import], np[dv], t <= 0, u_3c3[import]
for = exp(t)
state lambda[import, dv], class[import]
lambda = for·lambda + def⊗np
class = class + def + u_3c3
output return = σ·lambda
output yield = σ·class
"""


def test_keyword_and_non_ascii_names():
    rec = linrec.compile(KEYWORD_NAMES, "kw.lin")
    B, T, H, n, dv = 2, 4, 2, 3, 2
    x = rec.random_inputs(batch=B, tokens=T, heads=H, dims={"import": n, "dv": dv}, seed=10)
    assert set(x) == {"σ", "def", "np", "t", "u_3c3"}
    rng = np.random.default_rng(10)
    s0 = {"lambda": rng.standard_normal((B, H, n, dv)), "class": rng.standard_normal((B, H, n))}
    res = rec.run(x, initial_state=s0, form="recurrent")
    assert set(res.outputs) == {"return", "yield"}
    assert set(res.final_state) == {"lambda", "class"}
    ret = np.zeros((B, T, H, dv))
    yld = np.zeros((B, T, H))
    lam_end = np.zeros((B, H, n, dv))
    cls_end = np.zeros((B, H, n))
    for b in range(B):
        for h in range(H):
            lam, cls = s0["lambda"][b, h].copy(), s0["class"][b, h].copy()
            for t in range(T):
                lam = np.exp(x["t"][b, t, h]) * lam + np.outer(x["def"][b, t, h], x["np"][b, t, h])
                cls = cls + x["def"][b, t, h] + x["u_3c3"][b, t, h]
                ret[b, t, h] = x["σ"][b, t, h] @ lam
                yld[b, t, h] = x["σ"][b, t, h] @ cls
            lam_end[b, h], cls_end[b, h] = lam, cls
    assert_close(res.outputs["return"], ret)
    assert_close(res.outputs["yield"], yld)
    assert_close(res.final_state["lambda"], lam_end)
    assert_close(res.final_state["class"], cls_end)
    # the generated module really is valid Python that does not use the raw names as identifiers
    code = rec.emit()
    compile(code, "<generated>", "exec")


def test_greek_names_everywhere():
    src = """recurrence γρ(δ = 3, ε = 2)
input α[δ], β[δ], ν[ε]
param κ per head = 0.5 + 0.25*h
φ(ξ) = elu(ξ) + 1
state Σ[δ, ε]
Σ = κ·Σ + φ(β)⊗ν
output ω = φ(α)·Σ
"""
    rec = linrec.compile(src, "greek.lin")
    x = rec.random_inputs(batch=1, tokens=3, heads=2, seed=12)
    res = rec.run(x, form="recurrent")
    np.testing.assert_array_equal(res.params["κ"], [0.5, 0.75])
    o = np.zeros((1, 3, 2, 2))
    for h in range(2):
        S = np.zeros((3, 2))
        for t in range(3):
            S = res.params["κ"][h] * S + np.outer(elu1(x["β"][0, t, h]), x["ν"][0, t, h])
            o[0, t, h] = elu1(x["α"][0, t, h]) @ S
    assert_close(res.outputs["ω"], o)


def test_name_that_matches_a_runtime_helper():
    src = """recurrence kw(dk = 3, dv = 2)
input elu_plus_one[dk], k[dk], v[dv]
state S[dk, dv]
S = S + (elu(k) + 1)⊗v
output o = elu_plus_one·S
"""
    rec = linrec.compile(src, "helper.lin")
    x = rec.random_inputs(batch=1, tokens=3, heads=1, seed=0)
    res = rec.run(x, form="recurrent")
    S = np.cumsum(np.einsum("bthi,bthj->bthij", elu1(x["k"]), x["v"]), axis=1)
    assert_close(res.outputs["o"], np.einsum("bthi,bthij->bthj", x["elu_plus_one"], S))


@pytest.mark.parametrize("comment", ['# a """ quote', r"# a path C:\x\N"])
def test_comments_with_quotes_or_backslashes(comment):
    src = f"""recurrence c(dk = 3, dv = 2)
input q[dk], k[dk], v[dv]   {comment}
state S[dk, dv]
S = S + k⊗v
output o = q·S
"""
    rec = linrec.compile(src, "c.lin")
    x = rec.random_inputs(batch=1, tokens=2, heads=1, seed=0)
    S = np.cumsum(np.einsum("bthi,bthj->bthij", x["k"], x["v"]), axis=1)
    assert_close(rec.run(x, form="recurrent").outputs["o"], np.einsum("bthi,bthij->bthj", x["q"], S))


DEPENDENT_DEFAULT = """recurrence dep(dk = 4, dv = 4)
input q[dk], k[dk], v[dv]
param A per head
param lam per head = exp(−exp(A))
state S[dk, dv]
S = lam·S + k⊗v
output o = q·S
"""


def test_a_default_computed_from_a_param_without_one():
    """lam = exp(−exp(A)) with A left to the caller was NumPy's TypeError (exp of None) from default_params and
    run: lam is None like A until A is given, run names A as the param to pass, and a given A makes lam."""
    rec = linrec.compile(DEPENDENT_DEFAULT, "dep.lin")
    assert rec.default_params(2) == {"A": None, "lam": None}
    A = np.array([0.5, -1.0])
    np.testing.assert_allclose(rec.default_params(2, given={"A": A})["lam"], np.exp(-np.exp(A)))
    x = rec.random_inputs(1, 3, 2, seed=1)
    with pytest.raises(linrec.RuntimeInputError, match=r"parameter 'A' has no default; pass it \(shape \[H\]\)"):
        rec.run(x)
    res = rec.run(x, params={"A": A}, form="recurrent")
    np.testing.assert_allclose(res.params["lam"], np.exp(-np.exp(A)))
    both = rec.run(x, params={"A": A, "lam": np.exp(-np.exp(A))}, form="recurrent")
    np.testing.assert_allclose(res.outputs["o"], both.outputs["o"], rtol=1e-12)

"""Independent reference implementations of the example recurrences, written from the math.

Nothing here imports linrec. Every function loops explicitly over batch b, head h and token t with plain
NumPy in float64, following the conventions of /work/shared/reference/forms.md:

    per-token arrays [B, T, H, *], states [B, H, *], S_t ∈ R^(dk×dv), readout o_t = S_tᵀ q_t.

Each function takes the input arrays (a dict by DSL name), the parameters (per-head ones as [H]) and the
initial states (a dict [B, H, *]), and returns (outputs, final_states) as dicts of float64 arrays.
"""
from __future__ import annotations

import numpy as np


def _f64(d):
    return {k: np.asarray(v, dtype=np.float64) for k, v in d.items()}


def l2norm(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x) + eps)


def groupnorm(x, eps=1e-5):
    """Zero mean, unit (population) variance over the vector, no affine."""
    mu = x.mean()
    var = ((x - mu) ** 2).mean()
    return (x - mu) / np.sqrt(var + eps)


def elu_plus_one(x):
    # elu(x) + 1: x + 1 for x > 0, exp(x) otherwise
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def gla(inputs, params, state0):
    """S = diag(exp(g)) S + k vᵀ;  o = dk^(-1/2) qᵀ S."""
    x = _f64(inputs)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    o = np.zeros((B, T, H, dv))
    S_final = np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            S = np.array(state0["S"][b, h], dtype=np.float64)
            for t in range(T):
                S = np.diag(np.exp(g[b, t, h])) @ S + np.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = dk ** -0.5 * (q[b, t, h] @ S)
            S_final[b, h] = S
    return {"o": o}, {"S": S_final}


def retnet(inputs, params, state0):
    """S = gamma_h S + k vᵀ;  o = groupnorm(dk^(-1/2) qᵀ S); gamma from params (per head [H])."""
    x = _f64(inputs)
    q, k, v = x["q"], x["k"], x["v"]
    gamma = np.asarray(params["gamma"], dtype=np.float64)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    o = np.zeros((B, T, H, dv))
    S_final = np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            S = np.array(state0["S"][b, h], dtype=np.float64)
            for t in range(T):
                S = gamma[h] * S + np.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = groupnorm(dk ** -0.5 * (q[b, t, h] @ S))
            S_final[b, h] = S
    return {"o": o}, {"S": S_final}


def retnet_gamma(heads):
    """RetNet's fixed per-head decay γ_h = 1 − 2^(−5−h), h = 0..H−1."""
    return np.array([1.0 - 2.0 ** (-5 - h) for h in range(heads)])


def mamba2(inputs, params, state0):
    """S = exp(dt·A_h) S + (dt·B) xᵀ;  y = Cᵀ S + D_h·x."""
    a = _f64(inputs)
    xs, Bm, Cm, dt = a["x"], a["B"], a["C"], a["dt"]
    A = np.asarray(params["A"], dtype=np.float64)
    D = np.asarray(params["D"], dtype=np.float64)
    Bsz, T, H, dk = Bm.shape
    dv = xs.shape[-1]
    y = np.zeros((Bsz, T, H, dv))
    S_final = np.zeros((Bsz, H, dk, dv))
    for b in range(Bsz):
        for h in range(H):
            S = np.array(state0["S"][b, h], dtype=np.float64)
            for t in range(T):
                S = np.exp(dt[b, t, h] * A[h]) * S + np.outer(dt[b, t, h] * Bm[b, t, h], xs[b, t, h])
                y[b, t, h] = Cm[b, t, h] @ S + D[h] * xs[b, t, h]
            S_final[b, h] = S
    return {"y": y}, {"S": S_final}


def mamba1(inputs, params, state0):
    """Mamba-1's selective scan, element by element: h[n, c] = exp(Δ[c]·A_h[n, c])·h[n, c] + Δ[c]·B[n]·x[c];
    y[c] = Σ_n C[n]·h[n, c] + D_h[c]·x[c]. Params A, D per head ([H, dk, dv] and [H, dv])."""
    a = _f64(inputs)
    xs, Bm, Cm, dt = a["x"], a["B"], a["C"], a["dt"]
    A = np.asarray(params["A"], dtype=np.float64)
    D = np.asarray(params["D"], dtype=np.float64)
    Bsz, T, H, dk = Bm.shape
    dv = xs.shape[-1]
    y = np.zeros((Bsz, T, H, dv))
    S_final = np.zeros((Bsz, H, dk, dv))
    for b in range(Bsz):
        for h in range(H):
            S = np.array(state0["S"][b, h], dtype=np.float64)
            for t in range(T):
                for n in range(dk):
                    for c in range(dv):
                        delta = dt[b, t, h, c]
                        S[n, c] = np.exp(delta * A[h, n, c]) * S[n, c] + delta * Bm[b, t, h, n] * xs[b, t, h, c]
                for c in range(dv):
                    y[b, t, h, c] = sum(Cm[b, t, h, n] * S[n, c] for n in range(dk)) + D[h, c] * xs[b, t, h, c]
            S_final[b, h] = S
    return {"y": y}, {"S": S_final}


def _delta(inputs, state0, gated):
    x = _f64(inputs)
    q, k, v, beta = x["q"], x["k"], x["v"], x["beta"]
    g = x["g"] if gated else np.zeros_like(beta)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    eye = np.eye(dk)
    o = np.zeros((B, T, H, dv))
    S_final = np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            S = np.array(state0["S"][b, h], dtype=np.float64)
            for t in range(T):
                qn = l2norm(q[b, t, h])
                kn = l2norm(k[b, t, h])
                bt = beta[b, t, h]
                S = np.exp(g[b, t, h]) * (eye - bt * np.outer(kn, kn)) @ S + bt * np.outer(kn, v[b, t, h])
                o[b, t, h] = dk ** -0.5 * (qn @ S)
            S_final[b, h] = S
    return {"o": o}, {"S": S_final}


def deltanet(inputs, params, state0):
    """S = (I − β k̂ k̂ᵀ) S + β k̂ vᵀ;  o = dk^(-1/2) q̂ᵀ S, with l2-normalized q̂, k̂."""
    return _delta(inputs, state0, gated=False)


def gated_deltanet(inputs, params, state0):
    """S = exp(g)(I − β k̂ k̂ᵀ) S + β k̂ vᵀ;  o = dk^(-1/2) q̂ᵀ S."""
    return _delta(inputs, state0, gated=True)


def linear_transformer(inputs, params, state0):
    """S = S + φ(k) vᵀ, z = z + φ(k);  o = (φ(q)ᵀ S) / (φ(q)ᵀ z), φ = elu + 1."""
    x = _f64(inputs)
    q, k, v = x["q"], x["k"], x["v"]
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    o = np.zeros((B, T, H, dv))
    S_final = np.zeros((B, H, dk, dv))
    z_final = np.zeros((B, H, dk))
    for b in range(B):
        for h in range(H):
            S = np.array(state0["S"][b, h], dtype=np.float64)
            z = np.array(state0["z"][b, h], dtype=np.float64)
            for t in range(T):
                fk = elu_plus_one(k[b, t, h])
                fq = elu_plus_one(q[b, t, h])
                S = S + np.outer(fk, v[b, t, h])
                z = z + fk
                o[b, t, h] = (fq @ S) / (fq @ z)
            S_final[b, h] = S
            z_final[b, h] = z
    return {"o": o}, {"S": S_final, "z": z_final}


def gdn2(inputs, params, state0):
    """S = (I − k̂ (b ⊙ k̂)ᵀ) diag(exp(g)) S + k̂ (w ⊙ v)ᵀ;  o = dk^(-1/2) q̂ᵀ S: an erase gate b on the key
    axis, a write gate w on the value axis, a decay per key channel."""
    x = _f64(inputs)
    q, k, v, b, w, g = x["q"], x["k"], x["v"], x["b"], x["w"], x["g"]
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    o = np.zeros((B, T, H, dv))
    S_final = np.zeros((B, H, dk, dv))
    for bi in range(B):
        for h in range(H):
            S = np.array(state0["S"][bi, h], dtype=np.float64)
            for t in range(T):
                qn = l2norm(q[bi, t, h])
                kn = l2norm(k[bi, t, h])
                erase = np.eye(dk) - np.outer(kn, b[bi, t, h] * kn)
                S = erase @ np.diag(np.exp(g[bi, t, h])) @ S + np.outer(kn, w[bi, t, h] * v[bi, t, h])
                o[bi, t, h] = dk ** -0.5 * (qn @ S)
            S_final[bi, h] = S
    return {"o": o}, {"S": S_final}


def comba(inputs, params, state0):
    """Per token: p = σ(d_h) k̂ (the read key); v' = v − Sᵀ p with the state before the decay;
    S = exp(g) S + β k̂ v'ᵀ;  o = dk^(-1/2) (q̂ − D_h p)ᵀ S. Params d, D per head ([H])."""
    x = _f64(inputs)
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x["g"]
    d, D = np.asarray(params["d"], np.float64), np.asarray(params["D"], np.float64)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    o = np.zeros((B, T, H, dv))
    S_final = np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            S = np.array(state0["S"][b, h], dtype=np.float64)
            for t in range(T):
                kn = l2norm(k[b, t, h])
                p = kn / (1.0 + np.exp(-d[h]))
                corrected = v[b, t, h] - S.T @ p
                S = np.exp(g[b, t, h]) * S + beta[b, t, h] * np.outer(kn, corrected)
                o[b, t, h] = dk ** -0.5 * ((l2norm(q[b, t, h]) - D[h] * p) @ S)
            S_final[b, h] = S
    return {"o": o}, {"S": S_final}


def preconditioned_deltanet(inputs, params, state0):
    """Per token: A = exp(gA) ⊙ A + βA k̂ ⊙ k̂ (a decayed energy per key channel); r = log(|A| + 1e-6) − c;
    M = x^(−r/(1 + |r|)) elementwise; k' = (k̂ ⊙ M)/‖k̂ ⊙ M‖; S = exp(g) (I − β k' k'ᵀ) S + β k' vᵀ;
    o = dk^(-1/2) q̂ᵀ S. Params x, c (scalars)."""
    xs = _f64(inputs)
    q, k, v, beta, g, gA, betaA = (xs[n] for n in ("q", "k", "v", "beta", "g", "gA", "betaA"))
    base, centre = float(params["x"]), float(params["c"])
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    o = np.zeros((B, T, H, dv))
    A_final, S_final = np.zeros((B, H, dk)), np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            A = np.array(state0["A"][b, h], dtype=np.float64)
            S = np.array(state0["S"][b, h], dtype=np.float64)
            for t in range(T):
                kn = l2norm(k[b, t, h])
                A = np.exp(gA[b, t, h]) * A + betaA[b, t, h] * kn * kn
                r = np.log(np.abs(A) + 1e-6) - centre
                M = base ** (-r / (1.0 + np.abs(r)))
                kp = l2norm(kn * M)
                S = np.exp(g[b, t, h]) * (S - beta[b, t, h] * np.outer(kp, kp @ S)) + beta[b, t, h] * np.outer(kp, v[b, t, h])
                o[b, t, h] = dk ** -0.5 * (l2norm(q[b, t, h]) @ S)
            A_final[b, h], S_final[b, h] = A, S
    return {"o": o}, {"A": A_final, "S": S_final}


def gated_oja(inputs, params, state0):
    """Per token, as flash-linear-attention's fused_recurrent_gated_oja_rule runs it: v̂ = v/‖v‖;
    S ← S·diag(exp(gv)) (each value column decays); S ← S + β (k − S v̂) v̂ᵀ (the state's response to v̂,
    taken away before writing);  o = dk^(-1/2) qᵀ S."""
    x = _f64(inputs)
    q, k, v, beta, gv = x["q"], x["k"], x["v"], x["beta"], x["gv"]
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    o = np.zeros((B, T, H, dv))
    S_final = np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            S = np.array(state0["S"][b, h], dtype=np.float64)
            for t in range(T):
                vn = l2norm(v[b, t, h])
                S = S * np.exp(gv[b, t, h])[None, :]
                S = S + beta[b, t, h] * np.outer(k[b, t, h] - S @ vn, vn)
                o[b, t, h] = dk ** -0.5 * (q[b, t, h] @ S)
            S_final[b, h] = S
    return {"o": o}, {"S": S_final}


REFERENCES = {
    "gla": gla,
    "retnet": retnet,
    "mamba2": mamba2,
    "mamba1": mamba1,
    "deltanet": deltanet,
    "gated_deltanet": gated_deltanet,
    "linear_transformer": linear_transformer,
    "gdn2": gdn2,
    "comba": comba,
    "preconditioned_deltanet": preconditioned_deltanet,
    "gated_oja": gated_oja,
}

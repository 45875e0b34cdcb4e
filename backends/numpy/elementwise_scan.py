"""The parallel and chunkwise forms of a matrix state with an elementwise decay, in NumPy (docs/forms.md).

    S_t = exp(L_t) ⊙ S_(t−1) + Σ_i κ_i,t ⊗ x_i,t          (L_t [dk, dv]: a log-decay per element)

Every element of S is a scalar linear recurrence of its own. With B_t = Σ_(s≤t) L_s (per element) and the
contributions N_j = Σ_i κ_i,j ⊗ x_i,j,

    S_t = exp(B_t) ⊙ S_0 + Σ_(j≤t) exp(B_t − B_j) ⊙ N_j,
    (q_t·S_t)[c] = Σ_r q_t[r] exp(B_t[r, c]) S_0[r, c] + Σ_(j≤t) Σ_r q_t[r] κ_j[r] x_j[c] exp(B_t[r, c] − B_j[r, c]),

the diagonal decays of scan.py generalised by one axis: the decay of a score depends on the value column as
well, so the scores are no GEMM but a contraction over [n, n, dk, dv]. Stability as in forms.md §3: every
exponent is a difference B_i − B_j ≤ 0 (decays ≤ 1) — within a sub-block of `block` tokens element-wise in
log space (masked before the exponential), and the tokens before it through their contributions anchored
at R = B of the sub-block's previous token, exp(R − B_j) ≤ 1 and exp(B_t − R) ≤ 1.

Memory: a sub-block holds [B, H, block, block, dk, dv] decays (block 16: 256·dk·dv numbers per batch row and
head), fine for a reference at modest sizes. Work is O(T²·dk·dv / block) in the parallel form (each sub-block
sums the contributions of every earlier token) and O(T·C·dk·dv) in the chunkwise one.

Arrays arrive head-major: l [B, H, n, dk, dv]; writes [(κ [B, H, n, dk], x [B, H, n, dv])] (κ may be
[B, H, n, dk, dv], a key per column); queries [B, H, n, dk].
"""
from __future__ import annotations

import numpy as np


def _mask(n: int, strict: bool) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool), -1 if strict else 0)


def _shifted(b: np.ndarray) -> np.ndarray:
    """B_(t−1) from the prefix sums B_t [.., n, dk, dv] (0 before the first token)."""
    return np.concatenate([np.zeros_like(b[..., :1, :, :]), b[..., :-1, :, :]], axis=-3)


def _read(q, decays, carried):
    """Σ_r q_t[r] · decays_t[r, c] · carried[r, c] for every token t of q [.., n, dk]."""
    return np.einsum("...tr,...trc,...rc->...tc", q, decays, carried)


def elementwise_segment(s0, l, writes, readouts, causal: bool, block: int = 16):
    """One segment (the whole sequence, or a chunk) from state s0 [B, H, dk, dv]: (readouts [B, H, n, dv]
    each, or None when non-causal; the state after the segment)."""
    dtype = s0.dtype
    # prefix sums in float64, as scan.py's (their rounding would grow with T)
    b = np.cumsum(l, axis=-3, dtype=np.float64)
    # (a key per column, [.., n, dk, dv]: the write of a correction under the decay, κ[:, c]·x[c])
    contributions = sum((kappa if kappa.ndim == b.ndim else kappa[..., :, None]) * x[..., None, :]
                        for kappa, x in writes) if writes else np.zeros(b.shape, dtype)
    n = b.shape[-3]
    results = None
    if causal:
        b_prev = _shifted(b)
        results = []
        for q, before in readouts:
            bq = b_prev if before else b
            out = _read(q, np.exp(bq).astype(dtype), s0)  # the initial state, decayed to each token
            for s in range(0, n, block):
                e = min(s + block, n)
                # the sub-block itself: element-wise in log space, masked before the exponential
                diff = bq[..., s:e, None, :, :] - b[..., None, s:e, :, :]
                diff = np.where(_mask(e - s, before)[:, :, None, None], diff, -np.inf)
                out[..., s:e, :] += np.einsum("...tr,...tjrc,...jrc->...tc", q[..., s:e, :],
                                              np.exp(diff).astype(dtype), contributions[..., s:e, :, :])
                if s:  # the tokens before it, anchored at R = B of its previous token: each factor ≤ 1
                    anchor = b[..., s - 1:s, :, :]
                    carried = np.sum(np.exp(anchor - b[..., :s, :, :]).astype(dtype) * contributions[..., :s, :, :],
                                     axis=-3)
                    out[..., s:e, :] += _read(q[..., s:e, :], np.exp(bq[..., s:e, :, :] - anchor).astype(dtype),
                                              carried)
            results.append(out)
    end = np.exp(b[..., -1, :, :]).astype(dtype) * s0 + np.sum(
        np.exp(b[..., -1:, :, :] - b).astype(dtype) * contributions, axis=-3)
    return results, end


"""The parallel and chunkwise forms of a decomposed linear recurrence, in NumPy.

Generated code hands each state over in the canonical form the compiler derived (compiler.transitions):

    S_t = diag(exp(l_t))·S_(t−1)·diag(exp(m_t)) + Σ_r u_r,t ⊗ (w_r,tᵀ S_(t−1) diag(exp(m_t)))
          + Σ_r (diag(exp(l_t)) S_(t−1) a_r,t) ⊗ b_r,t + Σ_i κ_i,t ⊗ x_i,t

with l_t the log-decay (absent, one value, one per row, or one per element: an elementwise decay
exp(l_t)⊙S_(t−1), [B, T, H, dk, dv], run by linrec.numpy.elementwise_scan, whose corrections read S_(t−1)
itself: one triangular system per column, or row, see _elementwise), m_t a
log-decay of the value axis (absent, or one per column), corrections on the key side (u, w), corrections on
the value side (a, b: `value_corrections`, never beside key-side ones) and writes (κ, x). Each correction is
taken with the decay of the other axis applied. With b_t = Σ_(s≤t) l_s and c_t = Σ_(s≤t) m_s every
contribution N_j = Σ_r u_r,j p_r,jᵀ + Σ_r P_r,j b_r,jᵀ + Σ_i κ_i,j x_i,jᵀ reaches S_t scaled by exp(b_t − b_j)
per row and exp(c_t − c_j) per column, so

    S_t = Σ_(j≤t) diag(exp(b_t − b_j)) N_j diag(exp(c_t − c_j)) + diag(exp(b_t)) S_0 diag(exp(c_t)).

The pseudo-values p_r,t = (w_r,tᵀ S_(t−1))⊙exp(m_t) therefore solve a unit lower-triangular system (the UT
transform of the delta rule, generalized to any decay and any number of corrections): one shared by every
value column, or, where the columns decay, one per column whose coefficients carry exp(c_t − c_j) (solved by
blocks of 16 tokens, anchored like the readouts). The pseudo-keys P_r,t = exp(l_t)⊙(S_(t−1) a_r,t) of the
value-side corrections are the pseudo-values of Sᵀ, whose rows decay by m and columns by l: the same solve
on the transposed problem. Every readout q·S is then a masked, decayed attention over the contributions (a
decay of the value axis weighs each value column by exp(c_t − c_j) on top of the scores). Exponents are
always differences b_i − b_j ≤ 0 for decays ≤ 1 (forms.md §3): diagonal decays use sub-blocks so that each
factor is ≤ 1, on either axis.

Arrays arrive [B, T, H, *] and are processed head-major [B, H, T, *].

Non-finite values (docs/guarantees.md#non-finite-values): a log-decay below RESET_LOG_DECAY (−∞ included:
a decay of 0, a reset) is raised to it, so that the prefix sums stay finite. From the first token of a
(batch row, head) with a value that is NaN or ±∞ on, the tokens run through recurrent_scan from the state
before it: in the derived products a later token's NaN would reach earlier ones (0·NaN is NaN).
"""
from __future__ import annotations

import numpy as np

from ..arrays import nonfinite_tokens
from ..dsl.errors import RuntimeInputError
from .elementwise_scan import elementwise_segment


# A log-decay at or below this is a decay of exactly 0: exp underflows to 0 below about −745.13 in float64
# (−103.97 in float32). The derived forms raise lower log-decays to it (−∞ included: a decay of 0, a reset,
# which `g <= 0` admits), so that the prefix sums b stay finite: a difference b_i − b_j across a reset is
# then ≤ RESET_LOG_DECAY, exactly 0 once exponentiated as in the recurrent form, and one within a stretch
# without a reset is unchanged.
RESET_LOG_DECAY = -750.0


def per_token(x, shape: tuple[int, int, int, int], dtype, scalar: bool) -> np.ndarray:
    """Broadcast a per-token, per-head or constant value to [B, T, H, size]; a scalar element gains
    the last axis (of size 1, or broadcast to `size`)."""
    x = np.asarray(x, dtype=dtype)
    return np.broadcast_to(x[..., None] if scalar else x, shape)


def log_decay(decay, state: str) -> np.ndarray:
    """log of a decay that has no symbolic logarithm. The derived forms work in log space, so a negative
    decay is an error; 0 is a reset (log −∞), and NaN or +∞ stay what they are (non-finite values of their
    token, see the module's docstring)."""
    decay = np.asarray(decay)
    if np.any(decay < 0):
        raise RuntimeInputError(f"the decay of state '{state}' must be positive in the parallel and chunkwise "
                                f"forms and in the C backward, which work with its logarithm, but it is as low as "
                                f"{float(np.nanmin(decay)):g} here; pass params that keep it positive, or use "
                                f"the recurrent form (for gradients, NumPy's). A decay of the rows or of the value "
                                f"axis that the program declares of either sign (an input range or a param default "
                                f"that admits negative values) runs in every form, its signs taken apart")
    with np.errstate(divide="ignore"):  # log(0) = −∞: a reset
        return np.log(decay)


def running_signs(decay) -> tuple[np.ndarray, np.ndarray]:
    """σ_t and σ_(t−1) of a decay of either sign ([B, T, H, n] each, as per_token gives the decay): the running
    product over the tokens of its signs, a decay of 0 counted +1 (it resets the state, and any sign then
    holds). Exactly ±1: the forms run S̃_t = σ_t ⊙ S_t, whose decay |D_t| has a logarithm (see with_signs)."""
    signs = np.where(np.asarray(decay) < 0, -1.0, 1.0).astype(np.asarray(decay).dtype)
    after = np.cumprod(signs, axis=1)
    before = np.concatenate([np.ones_like(after[:, :1]), after[:, :-1]], axis=1)
    return after, before


def with_signs(after, before, corrections, writes, readouts, causal=True):
    """A state's per-token arrays for S̃_t = σ_t ⊙ S_t (running_signs), which decays by |D_t|: S_t = D_t·S_(t−1)
    + Σ u⊗(w·S_(t−1)) + Σ κ⊗x is, times σ_t (σ_t·D_t = σ_(t−1)·|D_t|), S̃_t = |D_t|·S̃_(t−1) + Σ (σ_t u)⊗((σ_(t−1)
    w)·S̃_(t−1)) + Σ (σ_t κ)⊗x; a readout q·S_t is (σ_t q)·S̃_t, one before the update (σ_(t−1) q)·S̃_(t−1), a
    non-causal one's of the final state (σ_T q)·S̃_T. (corrections, writes, readouts) as the scans take them; a
    readout of the state itself (query None) stays, for signed_reads."""
    return ([(u * after, w * before) for u, w in corrections], [(k * after, x) for k, x in writes],
            [r if r[0] is None else (r[0] * _read_signs(after, before, r[1], causal),) + tuple(r[1:])
             for r in readouts])


def _read_signs(after, before, before_update: bool, causal: bool):
    """The signs a readout meets (running_signs): σ_t after the update, σ_(t−1) before it, σ_T at every token
    of a non-causal program (its readouts read the final state)."""
    if causal:
        return before if before_update else after
    return after[:, -1:] if after.shape[1] else after


def signed_grads(grads, after, before, readouts):
    """The gradients a backward scan gives of the arrays with_signs made (a ScanGrads) as those of the arrays
    before it: the same products again, σ² being 1. `readouts` as with_signs gave them; the log-decays',
    the values' and the initial state's gradients stay (S̃_0 = S_0)."""
    corrections, writes, queries = with_signs(after, before, grads.corrections, grads.writes,
                                              [(g,) + tuple(r[1:]) for g, r in zip(grads.queries, readouts)])
    return grads._replace(corrections=corrections, writes=writes, queries=[q[0] for q in queries])


def signed_state(state, after):
    """S = σ_T ⊙ S̃ of a state [B, H, n, m] carried as S̃ = σ ⊙ S (with_signs); None stays None. The same map
    takes the final state's gradient to S̃'s (σ_T² = 1)."""
    if state is None or not after.shape[1]:
        return state
    return state * after[:, -1, :, :, None]


def signed_reads(reads, after, before, readouts, causal=True):
    """Readouts of the state itself (a query None) back from S̃ (with_signs): σ_t ⊙ S̃_t (σ_(t−1) before the
    update, σ_T in a non-causal program; a vector state's, [B, T, H, n]); the others as they are. The same
    map takes their gradients to S̃'s."""
    return [r if q[0] is not None or r is None else r * _read_signs(after, before, q[1], causal)
            for r, q in zip(reads, readouts)]


def with_value_signs(after, before, writes, value_corrections):
    """A state's per-token arrays for S̃_t = S_t·diag(τ_t), τ the running product of the signs of a decay E_t
    of the value axis (running_signs), which decays by |E_t|: the writes' values times τ_t, the value-side
    corrections' (D·S_(t−1)·a)⊗b with a times τ_(t−1) and b times τ_t. (The corrections of the rows read
    S_(t−1)·E_t = S̃_(t−1)·|E_t|·diag(τ_t): they are S̃'s as they are.) Returns (writes, value_corrections)."""
    return ([(k, x * after) for k, x in writes], [(a * before, b * after) for a, b in value_corrections])


def value_signed_reads(reads, after, before, readouts, causal=True):
    """Readouts q·S̃ of a state carried as S̃ = S·diag(τ) (with_value_signs) back to q·S: times τ_t (τ_(t−1)
    before the update, τ_T in a non-causal program). The same map takes their gradients to S̃'s."""
    return [r if r is None else r * _read_signs(after, before, q[1], causal) for r, q in zip(reads, readouts)]


def value_signed_state(state, after):
    """S = S̃·diag(τ_T) of a state [B, H, n, m] carried as S̃ = S·diag(τ) (with_value_signs); None stays None.
    The same map takes the final state's gradient to S̃'s."""
    if state is None or not after.shape[1]:
        return state
    return state * after[:, -1, :, None, :]


def value_signed_grads(grads, after, before):
    """The gradients a backward scan gives of the arrays with_value_signs made as those of the arrays before it
    (τ² = 1)."""
    writes, value_corrections = with_value_signs(after, before, grads.writes, grads.value_corrections)
    return grads._replace(writes=writes, value_corrections=value_corrections)


def _head_major(x):
    return None if x is None else np.ascontiguousarray(np.swapaxes(x, 1, 2))


def _mask(n: int, strict: bool) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool), -1 if strict else 0)


def decayed_scores(q, bq, k, bk, strict: bool, block: int = 16) -> np.ndarray:
    """A[t, j] = Σ_c q_tc k_jc exp(bq_tc − bk_jc) for j ≤ t (j < t when strict), else 0.

    q, k: [B, H, n, d]; bq, bk: [B, H, n, 1 or d] cumulative log-decays, or None for no decay.
    """
    n = q.shape[-2]
    mask = _mask(n, strict)
    if bq is None:
        return np.where(mask, q @ np.swapaxes(k, -1, -2), 0.0)
    if bq.shape[-1] == 1:  # one decay per token: a mask on one GEMM
        diff = np.where(mask, bq[..., :, None, 0] - bk[..., None, :, 0], -np.inf)
        return (q @ np.swapaxes(k, -1, -2)) * np.exp(diff).astype(q.dtype)
    out = np.zeros(q.shape[:-2] + (n, n), dtype=q.dtype)
    starts = list(range(0, n, block))
    ends = [min(s + block, n) for s in starts]
    for bi, (s, e) in enumerate(zip(starts, ends)):
        # diagonal block, element-wise in log space
        diff = bq[..., s:e, None, :] - bk[..., None, s:e, :]
        local = _mask(e - s, strict)[..., None]
        diff = np.where(local, diff, -np.inf)
        out[..., s:e, s:e] = np.einsum("...tc,...jc,...tjc->...tj", q[..., s:e, :], k[..., s:e, :],
                                       np.exp(diff).astype(q.dtype))
        if bi == 0:
            continue
        # key blocks before: anchor r = b at the last token of the previous block, so that
        # exp(bq − r) ≤ 1 and exp(r − bk) ≤ 1 (secondary chunking, GLA §4)
        r = bk[..., s - 1:s, :]
        q_hat = q[..., s:e, :] * np.exp(bq[..., s:e, :] - r).astype(q.dtype)
        k_hat = k[..., :s, :] * np.exp(r - bk[..., :s, :]).astype(q.dtype)
        out[..., s:e, :s] = q_hat @ np.swapaxes(k_hat, -1, -2)
    return out


def decayed_values(bq, b, v, strict: bool, block: int = 16) -> np.ndarray:
    """R[t, c] = Σ_j v_jc exp(bq_tc − b_jc) over j ≤ t (j < t when strict): a vector state's own value as it
    reaches token t, without its initial state (the elementwise twin of decayed_scores; a readout with no
    query, see compiler.decompose.Readout).

    v: [B, H, n, d] the contributions of a state [d, 1]; bq, b: [B, H, n, 1 or d] or None."""
    n = v.shape[-2]
    if bq is None or bq.shape[-1] == 1:  # one decay (or none) per token: a masked, decayed matrix
        a = _mask(n, strict).astype(v.dtype)
        if bq is not None:
            diff = np.where(_mask(n, strict), bq[..., :, None, 0] - b[..., None, :, 0], -np.inf)
            a = np.exp(diff).astype(v.dtype)
        return a @ v
    out = np.zeros(bq.shape[:-2] + (n, v.shape[-1]), dtype=v.dtype)
    for s in range(0, n, block):
        e = min(s + block, n)
        # diagonal block, element-wise in log space
        diff = np.where(_mask(e - s, strict)[..., None], bq[..., s:e, None, :] - b[..., None, s:e, :], -np.inf)
        out[..., s:e, :] = np.einsum("...tjc,...jc->...tc", np.exp(diff).astype(v.dtype), v[..., s:e, :])
        if s:  # the tokens before, anchored at the block's previous token r: each factor ≤ 1
            r = b[..., s - 1:s, :]
            carried = np.sum(np.exp(r - b[..., :s, :]).astype(v.dtype) * v[..., :s, :], axis=-2, keepdims=True)
            out[..., s:e, :] += np.exp(bq[..., s:e, :] - r).astype(v.dtype) * carried
    return out


def decayed_columns(a, cq, c, x, strict: bool, block: int = 16) -> np.ndarray:
    """R[t, col] = Σ_j a_tj x_j,col exp(cq_t,col − c_j,col): scores a [B, H, n, n] (already masked) applied to
    values x [B, H, n, dv] that decay per column, c (cq for the queries' tokens) their cumulative log-decays
    [B, H, n, dv]. Sub-blocks of `block` queries: the diagonal block element-wise in log space (masked
    before the exponential, so that no exp of a positive exponent meets a zero score), the tokens before it
    through one product anchored at r = c of the block's previous token, both factors ≤ 1."""
    n = x.shape[-2]
    out = np.zeros(a.shape[:-1] + (x.shape[-1],), dtype=x.dtype)
    for s in range(0, n, block):
        e = min(s + block, n)
        diff = np.where(_mask(e - s, strict)[..., None], cq[..., s:e, None, :] - c[..., None, s:e, :], -np.inf)
        out[..., s:e, :] = np.einsum("...tj,...tjc,...jc->...tc", a[..., s:e, s:e], np.exp(diff).astype(x.dtype),
                                     x[..., s:e, :])
        if s:
            r = c[..., s - 1:s, :]
            carried = a[..., s:e, :s] @ (x[..., :s, :] * np.exp(r - c[..., :s, :]).astype(x.dtype))
            out[..., s:e, :] += np.exp(cq[..., s:e, :] - r).astype(x.dtype) * carried
    return out


def solve_unit_lower(m, rhs, block: int = 64):
    """Solve M·X = rhs for unit lower-triangular M [.., n, n] by blocked forward substitution."""
    n = m.shape[-1]
    x = np.empty_like(rhs)
    for s in range(0, n, block):
        e = min(s + block, n)
        r = rhs[..., s:e, :]
        if s:
            r = r - m[..., s:e, :s] @ x[..., :s, :]
        try:
            x[..., s:e, :] = np.linalg.solve(m[..., s:e, s:e], r)
        except np.linalg.LinAlgError:  # (∞ or NaN entries, an overflowing state's: LAPACK's LU calls the block
            # singular, which a unit diagonal never is; substitution gives their IEEE values, as the recurrence)
            x[..., s:e, :] = _substituted(m[..., s:e, s:e], r)
    return x


def _substituted(m, rhs):
    """M·X = rhs for unit lower-triangular M, row by row."""
    x = np.empty_like(rhs)
    for i in range(m.shape[-1]):
        x[..., i, :] = rhs[..., i, :] - (m[..., i, None, :i] @ x[..., :i, :])[..., 0, :] if i else rhs[..., i, :]
    return x


def _block(q, b_q, b_k, terms, strict, s0_term, block, c_q=None, c=None):
    """Σ over terms of decayed_scores(q, b_q, κ, b_k)·x — each value column decayed by exp(c_q − c) when
    the value axis decays — plus the initial-state term."""
    out = s0_term
    for kappa, x in terms:
        scores = decayed_scores(q, b_q, kappa, b_k, strict, block)
        out = out + (scores @ x if c is None else decayed_columns(scores, c_q, c, x, strict, block))
    return out


def _pseudo_values(corrections, writes, b, b_prev, s0, block, c=None):
    """p_r,t = (w_r,tᵀ S_(t−1))⊙exp(m_t) for the tokens of one segment, given the state s0 entering it; c the
    cumulative log-decays of the columns (None: they do not decay, and one system serves every column)."""
    if not corrections:
        return []
    if c is not None:
        return _pseudo_values_by_column(corrections, writes, b, b_prev, c, s0, block)
    r_count = len(corrections)
    n = b.shape[-2] if b is not None else corrections[0][0].shape[-2]
    rows = []
    rhs = []
    for _, w in corrections:
        w0 = w * np.exp(b_prev).astype(w.dtype) if b is not None else w
        rhs.append(_block(w, b_prev, b, writes, True, w0 @ s0, block))
        rows.append([decayed_scores(w, b_prev, u, b, True, block) for u, _ in corrections])
    if r_count == 1:
        m = np.eye(n, dtype=s0.dtype) - rows[0][0]
        return [solve_unit_lower(m, rhs[0], block=64)]
    # several corrections: interleave (t, r) so the system stays lower triangular in t
    a = np.stack([np.stack(row, axis=-1) for row in rows], axis=-3)  # [.., n, R, n, R]
    a = a.reshape(a.shape[:-4] + (n * r_count, n * r_count))
    m = np.eye(n * r_count, dtype=s0.dtype) - a
    stacked = np.stack(rhs, axis=-2).reshape(rhs[0].shape[:-2] + (n * r_count, rhs[0].shape[-1]))
    sol = solve_unit_lower(m, stacked, block=64 * r_count)
    sol = sol.reshape(rhs[0].shape[:-2] + (n, r_count, rhs[0].shape[-1]))
    return [sol[..., :, i, :] for i in range(r_count)]


def _pseudo_values_by_column(corrections, writes, b, b_prev, c, s0, block):
    """_pseudo_values where the columns decay: S_(t−1) carries exp(c_(t−1) − c_j) per column, so that the
    pseudo-values (w_tᵀ S_(t−1))⊙exp(m_t) of different tokens meet through exp(c_t − c_j) ≤ 1 per column:
    p_r,t = rhs_r,t + Σ_(j<t) Σ_r' A_rr',tj exp(c_t − c_j) p_r',j, a unit lower-triangular system per column."""
    rhs, rows = [], []
    for _, w in corrections:
        w0 = w * np.exp(b_prev).astype(w.dtype) if b is not None else w
        start = (w0 @ s0) * np.exp(c).astype(s0.dtype)
        rhs.append(_block(w, b_prev, b, writes, True, start, block, c, c))
        rows.append([decayed_scores(w, b_prev, u, b, True, block) for u, _ in corrections])
    a = np.stack([np.stack(row, axis=-1) for row in rows], axis=-3)  # [.., n, R, n, R]: A_rr',tj
    p = _solve_decayed_columns(a, c, np.stack(rhs, axis=-2))        # [.., n, R, dv]
    return [p[..., :, i, :] for i in range(len(corrections))]


def _solve_decayed_columns(a, c, rhs, block: int = 16):
    """Solve p_t = rhs_t + Σ_(j<t) Σ_r' a[t, r, j, r']·exp(c_t − c_j)⊙p_(j, r') for every column at once:
    a [.., n, R, n, R] strictly lower in the tokens, c [.., n, dv] cumulative log-decays (float64), rhs
    [.., n, R, dv]. By blocks of `block` tokens: the tokens before a block arrive through one product anchored
    at r = c of its previous token (exp(c_t − r) and exp(r − c_j), both ≤ 1); inside it, forward substitution
    token by token with the exponents taken as differences."""
    n = c.shape[-2]
    p = np.empty_like(rhs)
    for s in range(0, n, block):
        e = min(s + block, n)
        acc = np.array(rhs[..., s:e, :, :])
        if s:
            r = c[..., s - 1:s, :]
            past = p[..., :s, :, :] * np.exp(r - c[..., :s, :]).astype(p.dtype)[..., :, None, :]
            acc += np.exp(c[..., s:e, :] - r).astype(p.dtype)[..., :, None, :] * \
                np.einsum("...tRjQ,...jQc->...tRc", a[..., s:e, :, :s, :], past)
        for t in range(s, e):
            if t > s:
                near = p[..., s:t, :, :] * np.exp(c[..., t:t + 1, :] - c[..., s:t, :]).astype(p.dtype)[..., :, None, :]
                acc[..., t - s, :, :] += np.einsum("...RjQ,...jQc->...Rc", a[..., t, :, s:t, :], near)
            p[..., t, :, :] = acc[..., t - s, :, :]
    return p


def _pseudo_keys(value_corrections, writes, b, c, c_prev, s0, block):
    """P_r,t = exp(l_t)⊙(S_(t−1) a_r,t) for the value-side corrections (a, b): the pseudo-values of Sᵀ, whose
    rows decay by the value axis's log-decay (prefix sums c) and columns by the key axis's (b, one per row of
    S; a log-decay of shape [..., 1] is the same for every row, and broadcasts so). One way for both: a state
    of one row (dk = 1) has a decay per row of that shape too, and telling the two apart by shape took the
    key axis's decay for one of every row of Sᵀ, whose product with the correction came out wrong."""
    if not value_corrections:
        return []
    return _pseudo_values([(b_vec, a) for a, b_vec in value_corrections], [(x, kappa) for kappa, x in writes],
                          c, c_prev, np.swapaxes(s0, -1, -2), block, b)


def _shifted(b: np.ndarray) -> np.ndarray:
    """b_(t−1) from the prefix sums b_t (0 before the first token): the previous sum itself, not b_t − l_t,
    which differs from it by the rounding of b_t — |b|·ε, and exp(b_(t−1) − b_(t−1)) then misses 1 by as much
    where the decays are strong (|b| ~ 1e7 made a readout before the update 1e-9 off)."""
    return np.concatenate([np.zeros_like(b[..., :1, :]), b[..., :-1, :]], axis=-2)


def segment(s0, l, corrections, writes, readouts, causal, block, m=None, value_corrections=()):
    """One segment (the whole sequence, or a chunk) starting from state s0; m: the value axis's log-decay;
    value_corrections: the value-side corrections (a, b). Head-major arrays [B, H, n, *]. (The parallel and
    chunkwise forms run it, and so do the forward scans of their backward, linrec.numpy.adjoint_scan.)

    Returns (readouts or None when non-causal, state after the segment)."""
    if _is_elementwise(l):
        return _elementwise(s0, l, corrections, writes, readouts, causal, value_corrections)
    tokens = _tokens(l, corrections, writes, readouts, m, value_corrections)
    if tokens > 1 and growth(corrections, value_corrections) > GROWTH_LIMIT:  # (two halves, the state passed)
        pieces, state = [], s0
        for part in (slice(0, tokens // 2), slice(tokens // 2, tokens)):
            l_p, corr_p, wr_p, rd_p, m_p, vc_p = _cut(part, l, corrections, writes, readouts, m, value_corrections)
            results, state = segment(state, l_p, corr_p, wr_p, rd_p, causal, block, m=m_p, value_corrections=vc_p)
            pieces.append(results)
        first, second = pieces
        return (None if first is None else [np.concatenate(pair, axis=-2) for pair in zip(first, second)]), state
    # prefix sums of log-decays in float64: in float32 their rounding grows with T and, exponentiated,
    # becomes a relative error of the outputs (1e-3 at T = 3000); the products stay in the working dtype
    b = None if l is None else np.cumsum(l, axis=-2, dtype=np.float64)
    b_prev = None if l is None else _shifted(b)
    c = None if m is None else np.cumsum(m, axis=-2, dtype=np.float64)
    c_prev = None if m is None else _shifted(c)
    pseudo = _pseudo_values(corrections, writes, b, b_prev, s0, block, c)
    keys = _pseudo_keys(value_corrections, writes, b, c, c_prev, s0, block)
    terms = list(writes) + [(u, p) for (u, _), p in zip(corrections, pseudo)] + \
        [(key, b_vec) for key, (_, b_vec) in zip(keys, value_corrections)]
    results = None
    if causal:
        results = []
        for q, before in readouts:
            bq = b_prev if before else b
            if q is None:  # the state's own value (a vector state [d, 1])
                start = s0[..., None, :, 0] * (np.exp(bq).astype(s0.dtype) if b is not None else 1)
                # (a state that only decays has no contribution: zeros over the tokens of its log-decay)
                v = sum(kappa * x for kappa, x in terms) if terms else np.zeros(b.shape[:-1] + s0.shape[-2:-1],
                                                                                 s0.dtype)
                results.append(start + decayed_values(bq, b, v, before, block))
                continue
            s0_term = (q * np.exp(bq).astype(q.dtype) if b is not None else q) @ s0
            cq = c_prev if before else c
            if c is not None:
                s0_term = s0_term * np.exp(cq).astype(s0.dtype)
            results.append(_block(q, bq, b, terms, before, s0_term, block, cq, c))
    row = (lambda kappa: kappa) if b is None else \
        (lambda kappa: kappa * np.exp(b[..., -1:, :] - b).astype(kappa.dtype))  # noqa: E731
    col = (lambda x: x) if c is None else (lambda x: x * np.exp(c[..., -1:, :] - c).astype(x.dtype))  # noqa: E731
    end = s0
    if b is not None:
        end = np.exp(np.swapaxes(b[..., -1:, :], -1, -2)).astype(s0.dtype) * end
    if c is not None:
        end = end * np.exp(c[..., -1:, :]).astype(s0.dtype)
    end = end + sum(np.swapaxes(row(kappa), -1, -2) @ col(x) for kappa, x in terms)
    return results, end


# A segment's corrections solve a triangular system whose entries grow with the transitions I + u⊗w: where they
# grow (TTT-Linear's raw keys, W − eta·k⊗(k·W − v): 1 − eta·‖k‖² down to −15), a segment's solution loses the
# digits of that growth — NumPy's parallel form of such a program was 0.8 off at T = 512 where the recurrent
# form and C's (which solves in sub-chunks of 16 tokens) were not. A segment whose transitions could grow by more
# than e^GROWTH_LIMIT runs as two halves, the state passed between them, down to single tokens if need be.
GROWTH_LIMIT = 4.0


def growth(corrections, value_corrections) -> float:
    """The largest, over the (batch row, head) pairs, of Σ_t max(0, log |1 + Σ_r w_r·u_r|) over the segment's
    tokens — the factor by which the corrections can stretch the state along u, decays aside (they only shrink
    it) — and the value-side corrections' likewise; 0 without corrections. u, w [B, H, n, k]."""
    total = 0.0
    for pairs in (corrections, value_corrections):  # (u·w and a·b alike)
        if not pairs:
            continue
        stretch = 1 + sum(np.einsum("...i,...i->...", u, w) for u, w in pairs)  # [B, H, n]
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log(np.abs(stretch))
        logs = np.where(np.isfinite(logs), np.maximum(logs, 0), 0)  # (non-finite tokens: the recurrent form's)
        total += float(np.max(np.sum(logs, axis=-1), initial=0.0))  # (over the tokens, [B, H, n] → [B, H])
    return total


def _cut(tokens: slice, l, corrections, writes, readouts, m, value_corrections):
    """segment's per-token arguments for some of its tokens ([B, H, n, …] arrays: their third axis)."""
    cut = (slice(None), slice(None), tokens)
    return (None if l is None else l[cut], [(u[cut], w[cut]) for u, w in corrections],
            [(k[cut], x[cut]) for k, x in writes], [(None if q is None else q[cut], b) for q, b in readouts],
            None if m is None else m[cut], [(a[cut], b[cut]) for a, b in value_corrections])


def _elementwise(s0, l, corrections, writes, readouts, causal, value_corrections, block: int = 16):
    """segment for an elementwise decay exp(l_t)⊙S_(t−1) [.., n, dk, dv] with corrections of one side, each
    reading S_(t−1) itself. A key-side correction u⊗(wᵀS) acts on each column of S apart, and column c is a
    state [dk, 1] whose rows decay by l[.., c]: its pseudo-values p_t[c] = w_t·S_(t−1)[:, c] solve that
    column's unit lower-triangular system (_pseudo_values, with the columns as one more batch axis: dv
    systems of n tokens, their scores anchored by sub-blocks as for any decay of the rows). A value-side
    correction (S·a)⊗b is the same on Sᵀ, one system per row. With them every term is a write (u⊗p, P⊗b,
    κ⊗x) of elementwise_segment, which gives the readouts and the final state. A correction written on the
    decayed state has a w (or u) per column, [.., n, dk, dv]: column c's system takes its own, and a u per
    column writes u[:, c]·p[c] (elementwise_segment takes such a write)."""
    b = np.cumsum(l, axis=-3, dtype=np.float64)
    pseudo = _by_columns(corrections, writes, b, s0, block)
    keys = _by_columns([(b_vec, a) for a, b_vec in value_corrections], [(x, kappa) for kappa, x in writes],
                       np.swapaxes(b, -1, -2), np.swapaxes(s0, -1, -2), block)
    terms = list(writes) + [(u, p) for (u, _), p in zip(corrections, pseudo)] + \
        [(key, b_vec) for key, (_, b_vec) in zip(keys, value_corrections)]
    return elementwise_segment(s0, l, terms, readouts, causal, block)


def _by_columns(corrections, writes, b, s0, block):
    """The pseudo-values p_r,t [.., n, cols] = w_r,t·S_(t−1) of key-side corrections (u, w) [.., n, rows] of a
    state s0 [.., rows, cols] whose element (i, c) decays by exp(b_t[i, c] − b_(t−1)[i, c]) (b [.., n, rows,
    cols] prefix sums): each column c a state [rows, 1] with a decay per row, the columns a batch axis."""
    if not corrections:
        return []
    b_col = np.moveaxis(b, -1, -3)  # [.., cols, n, rows]
    lead = b_col.shape[:-1]

    def spread(x):  # a per-token vector [.., n, rows], the same for every column, or one per column
        #             ([.., n, rows, cols]: a correction on the decayed state): [.., cols, n, rows]
        if x.ndim == b.ndim:
            return np.moveaxis(x, -1, -3)
        return np.broadcast_to(x[..., None, :, :], lead + (x.shape[-1],))

    col_writes = [(spread(kappa), np.swapaxes(x, -1, -2)[..., None]) for kappa, x in writes]  # values [.., cols, n, 1]
    col_corrections = [(spread(u), spread(w)) for u, w in corrections]
    s0_col = np.swapaxes(s0, -1, -2)[..., None]  # [.., cols, rows, 1]
    pseudo = _pseudo_values(col_corrections, col_writes, b_col, _shifted(b_col), s0_col, block)
    return [np.swapaxes(p[..., 0], -1, -2) for p in pseudo]  # [.., n, cols]


def _is_elementwise(log_decay) -> bool:
    """A log-decay per element of a matrix state: [B, T, H, dk, dv] (head-major [B, H, T, dk, dv])."""
    return log_decay is not None and np.ndim(log_decay) == 5


def _prepare(s0, log_decay, corrections, writes, readouts, value_log_decay=None, value_corrections=()):
    hm = _head_major
    if corrections and value_corrections:
        raise ValueError("corrections on both sides of a state have no derived form")
    if _is_elementwise(log_decay) and value_log_decay is not None:
        raise ValueError("an elementwise decay beside a decay of the value axis has no derived form (write both "
                         "into the elementwise one)")
    return (s0, hm(log_decay), [(hm(u), hm(w)) for u, w in corrections], [(hm(k), hm(x)) for k, x in writes],
            [(hm(q), before) for q, before in readouts], hm(value_log_decay),
            [(hm(a), hm(b)) for a, b in value_corrections])


def _read(q, state):
    """query·S for one token's queries q [.., dk] (several tokens: [.., n, dk]), or S's own value when q is
    None (a vector state [.., d, 1])."""
    return state[..., 0] if q is None else np.einsum("...i,...ij->...j", q, state)


def _finish(results, end, readouts_hm, causal, tokens):
    if not causal:  # every readout reads the final state
        results = [np.broadcast_to(end[..., None, :, 0], end.shape[:-2] + (tokens, end.shape[-2])) if q is None
                   else q @ end for q, _ in readouts_hm]
    return [np.swapaxes(r, 1, 2) for r in results], end


def _tokens(log_decay, corrections, writes, readouts, value_log_decay=None, value_corrections=()) -> int:
    arrays = [q for q, _ in readouts if q is not None] + [k for k, _ in writes] + [u for u, _ in corrections] + \
        [a for a, _ in value_corrections]
    if arrays:
        return arrays[0].shape[-2]
    return log_decay.shape[-3] if _is_elementwise(log_decay) else \
        (log_decay if log_decay is not None else value_log_decay).shape[-2]


def parallel_scan(s0, log_decay, corrections, writes, readouts, causal=True, chunk_size=None, value_log_decay=None,
                  value_corrections=()):
    """The parallel form: every token against every earlier one, O(T²·(dk + dv)) work.

    s0 [B, H, dk, dv]; log_decay None or [B, T, H, 1 | dk]; corrections [(u, w)] and writes [(κ, x)]
    per token [B, T, H, *]; readouts [(query, before_update)]; value_log_decay None or [B, T, H, dv] (a
    matrix state's columns, S·diag(exp(m))); value_corrections [(a, b)], [B, T, H, dv] each: the
    value-side corrections (exp(l_t)⊙(S_(t−1)·a))⊗b. Returns ([readout [B, T, H, dv]], S_T)."""
    return _guarded(_parallel, s0, log_decay, corrections, writes, readouts, causal, chunk_size, value_log_decay,
                    value_corrections)


def chunkwise_scan(s0, log_decay, corrections, writes, readouts, causal=True, chunk_size=None,
                   value_log_decay=None, value_corrections=()):
    """The chunkwise form: state passing between chunks of C tokens, dense products inside a chunk."""
    return _guarded(_chunkwise, s0, log_decay, corrections, writes, readouts, causal, chunk_size, value_log_decay,
                    value_corrections)


def _parallel(s0, log_decay, corrections, writes, readouts, causal, chunk_size, value_log_decay, value_corrections):
    s0, l, corr, wr, rd, m, vc = _prepare(s0, log_decay, corrections, writes, readouts, value_log_decay,
                                          value_corrections)
    results, end = segment(s0, l, corr, wr, rd, causal, block=64, m=m, value_corrections=vc)
    return _finish(results, end, rd, causal, _tokens(l, corr, wr, rd, m, vc))


def _chunkwise(s0, log_decay, corrections, writes, readouts, causal, chunk_size, value_log_decay, value_corrections):
    chunk = int(chunk_size or 64)
    s0, l, corr, wr, rd, m, vc = _prepare(s0, log_decay, corrections, writes, readouts, value_log_decay,
                                          value_corrections)
    tokens = _tokens(l, corr, wr, rd, m, vc)
    state, pieces = s0, []
    for s in range(0, tokens, chunk):
        l_c, corr_c, wr_c, rd_c, m_c, vc_c = _cut(slice(s, min(s + chunk, tokens)), l, corr, wr, rd, m, vc)
        results, state = segment(state, l_c, corr_c, wr_c, rd_c, causal, block=16, m=m_c, value_corrections=vc_c)
        pieces.append(results)
    results = [np.concatenate([p[i] for p in pieces], axis=-2) for i in range(len(rd))] if causal else None
    return _finish(results, state, rd, causal, tokens)


# ---- non-finite values --------------------------------------------------------------------------------
def _guarded(derived, s0, log_decay, corrections, writes, readouts, causal, chunk_size, value_log_decay,
             value_corrections=()):
    """A derived form (_parallel or _chunkwise) under the rule for non-finite values: log-decays raised to
    RESET_LOG_DECAY; in each (batch row, head) the tokens from the first one with a NaN or ±∞ on run through
    recurrent_scan, from the state before it (the whole sequence where the initial state is not finite)."""
    log_decay, value_log_decay = raise_to_reset(log_decay), raise_to_reset(value_log_decay)
    corrections = [tuple(pair) for pair in corrections]
    writes = [tuple(pair) for pair in writes]
    value_corrections = [tuple(pair) for pair in value_corrections]
    arrays = (log_decay, corrections, writes, readouts, value_log_decay, value_corrections)
    per_token = [a for a in (log_decay, value_log_decay) if a is not None]
    per_token += [a for pair in corrections + writes + value_corrections for a in pair]
    queries = [q for q, _ in readouts if q is not None]
    tokens = (per_token + queries)[0].shape[1]
    first = _first_nonfinite(s0, per_token + (queries if causal else []), tokens)  # (non-causal: read at S_T)
    if np.all(first == tokens):
        return derived(s0, *arrays[:4], causal, chunk_size, value_log_decay, value_corrections)
    # the tokens from the first non-finite one on change nothing here: the derived form gives every earlier
    # token, and the state just before the first non-finite one as its final state
    before = _tokens_before(first, tokens, *arrays)
    results, end = derived(s0, *before[:4], causal, chunk_size, before[4], before[5])
    # (an initial state that is not finite enters the tail as it is: in the derived form's own final state a
    # pseudo-value 0·S would have met it)
    start = np.where(np.isfinite(s0).all(axis=(-2, -1))[..., None, None], end, s0).astype(end.dtype, copy=False)
    results, end = _recurrent_from(first, tokens, start, [np.array(r) for r in results], *arrays, causal)
    if not causal:  # every readout reads the final state
        results, end = _finish(None, end, [(_head_major(q), b) for q, b in readouts], False, tokens)
    return results, end


def _tokens_before(first, tokens: int, log_decay, corrections, writes, readouts, value_log_decay, value_corrections):
    """The per-token arrays with every token from `first` [B, H] on replaced by one that changes nothing:
    log-decay 0 and every vector 0 (a readout of it is 0)."""
    keep = np.arange(tokens)[None, :, None] < first[:, None, :]  # [B, T, H]

    def kept(a):  # (the keep mask [B, T, H] over the axes after H: one, or two for an elementwise log-decay)
        return None if a is None else np.where(keep.reshape(keep.shape + (1,) * (a.ndim - 3)), a,
                                                np.zeros((), a.dtype))

    return (kept(log_decay), [(kept(u), kept(w)) for u, w in corrections], [(kept(k), kept(x)) for k, x in writes],
            [(kept(q), b) for q, b in readouts], kept(value_log_decay), [(kept(a), kept(b)) for a, b in value_corrections])


def _recurrent_from(first, tokens: int, start, results, log_decay, corrections, writes, readouts, value_log_decay,
                    value_corrections, causal):
    """recurrent_scan over the tokens from `first` [B, H] on, from the states `start` [B, H, …], for every
    (batch row, head) that has such tokens: their readouts written into `results` ([B, T, H, n], causal)
    and their final states into the returned copy of `start`."""
    end = np.array(start)
    for f in np.unique(first[first < tokens]):
        rows, heads = np.nonzero(first == f)

        def tail(a):  # the tokens f… of these (batch row, head) pairs, as [pairs, T − f, 1, n]
            return None if a is None else a[rows, f:, heads][:, :, None]

        got, final = recurrent_scan(start[rows, heads][:, None], tail(log_decay),
                                    [(tail(u), tail(w)) for u, w in corrections],
                                    [(tail(k), tail(x)) for k, x in writes], [(tail(q), b) for q, b in readouts],
                                    causal, value_log_decay=tail(value_log_decay),
                                    value_corrections=[(tail(a), tail(b)) for a, b in value_corrections])
        end[rows, heads] = final[:, 0]
        for r, g in zip(results if causal else [], got):
            r[rows, f:, heads] = g[:, :, 0]
    return results, end


def raise_to_reset(log_decay):
    """Log-decays below RESET_LOG_DECAY raised to it (−∞ included; NaN stays NaN)."""
    if log_decay is None:
        return None
    log_decay = np.asarray(log_decay)
    if log_decay.size and log_decay.min() >= RESET_LOG_DECAY:  # the common case: one pass, no copy
        return log_decay
    return np.maximum(log_decay, np.asarray(RESET_LOG_DECAY, log_decay.dtype))


def _first_nonfinite(s0, per_token, tokens: int) -> np.ndarray:
    """[B, H]: per batch row and head, the first token with a NaN or ±∞ in any per-token array [B, T, H, n];
    0 where the initial state s0 [B, H, *] holds one; `tokens` where there is none."""
    bad = None
    for a in per_token:
        here = nonfinite_tokens(a)
        bad = here if bad is None else bad | here
    first = np.where(bad.any(axis=1), np.argmax(bad, axis=1), tokens)
    return np.where(np.isfinite(np.asarray(s0)).all(axis=(-2, -1)), first, 0)


def recurrent_scan(s0, log_decay, corrections, writes, readouts, causal=True, chunk_size=None,
                   value_log_decay=None, value_corrections=()):
    """The recurrent form of the decomposition: one token at a time, carrying the state."""
    s0, l, corr, wr, rd, m, vc = _prepare(s0, log_decay, corrections, writes, readouts, value_log_decay,
                                          value_corrections)
    state = s0.copy()
    tokens = _tokens(l, corr, wr, rd, m, vc)
    lead = state.shape[:-2] + (tokens,)
    results = [np.empty(lead + (state.shape[-2] if q is None else state.shape[-1],), dtype=state.dtype)
               for q, _ in rd]
    at = lambda q, t: None if q is None else q[..., t, :]  # noqa: E731
    for t in range(tokens):
        for r, (q, before) in zip(results, rd):
            if before and causal:
                r[..., t, :] = _read(at(q, t), state)
        pseudo = [np.einsum("...i,...ij->...j", w[..., t, :], state) if w.ndim == 4 else  # (a w per column)
                  np.sum(w[..., t, :, :] * state, axis=-2) for _, w in corr]
        keys = [np.einsum("...ij,...j->...i", state, a[..., t, :]) for a, _ in vc]
        if _is_elementwise(l):
            state = np.exp(l[..., t, :, :]).astype(state.dtype) * state
        elif l is not None:
            state = np.exp(l[..., t, :]).astype(state.dtype)[..., :, None] * state
        if m is not None:
            state = state * np.exp(m[..., t, :]).astype(state.dtype)[..., None, :]
        for (u, _), p in zip(corr, pseudo):  # (taken with the columns' decay, as the state is)
            p = p if m is None else p * np.exp(m[..., t, :]).astype(state.dtype)
            state = state + (u[..., t, :, None] if u.ndim == 4 else u[..., t, :, :]) * p[..., None, :]
        for (_, b), key in zip(vc, keys):  # (taken with the rows' decay; an elementwise one is not applied)
            key = key if l is None or _is_elementwise(l) else key * np.exp(l[..., t, :]).astype(state.dtype)
            state = state + key[..., :, None] * b[..., t, None, :]
        for kappa, x in wr:
            state = state + kappa[..., t, :, None] * x[..., t, None, :]
        for r, (q, before) in zip(results, rd):
            if not (before and causal):
                r[..., t, :] = _read(at(q, t), state)
    return _finish(results if causal else None, state, rd, causal, tokens)


def running_max(exponent, start=None) -> np.ndarray:
    """M_t = max over s ≤ t and over the last axis of exponent_s (and `start` [B, H], the log-scale a state
    came with): [B, T, H]. Shifting every exponent by M keeps exp(α − M) ≤ 1 with the largest key at 1;
    M_(t−1) − M_t ≤ 0 then acts as one more decay, and the state is carried as S·exp(−M) (forms.md §8)."""
    per_token = (np.max(exponent, axis=-1) if exponent.ndim == 4 else exponent).astype(np.float64)
    if start is not None:  # NaN: a state given at its true scale, with no scale to respect
        per_token = np.fmax(per_token, np.asarray(start, np.float64)[:, None, :])
    return np.maximum.accumulate(per_token, axis=1)


def scale_decay(running) -> np.ndarray:
    """M_(t−1) − M_t as a log-decay [B, T, H, 1]; 0 for the first token, whose scale M_1 the initial state
    is brought to beforehand (rescale)."""
    return -np.diff(running, axis=1, prepend=running[:, :1])[..., None]


def rescale(state, have, want, dtype) -> np.ndarray:
    """A state stored as S·exp(−have) re-expressed as S·exp(−want) ([B, H] log-scales; None and NaN are 0)."""
    have = 0.0 if have is None else np.nan_to_num(np.asarray(have, np.float64), nan=0.0)
    want = 0.0 if want is None else np.asarray(want, np.float64)
    with np.errstate(over="ignore"):  # (an infinite factor: below)
        factor = np.exp(np.asarray(have - want))
    if not np.any(factor != 1):  # the same scale (a decode step whose maximum did not move): a copy
        return np.array(state, dtype=dtype)
    if np.all((factor > 1e-30) & (factor < 1e30)):  # (then the factor is a normal number in float32 too)
        # in the working dtype: a float64 product of a float32 state would double a decode step's traffic
        return np.asarray(state, dtype) * factor.astype(dtype)[..., None, None]
    with np.errstate(over="ignore", invalid="ignore"):  # a tiny state times a huge factor, say
        scaled = state * factor[..., None, None]
    # a zero stays zero at any scale: a state started from zeros at its true scale (NaN) and brought to a scale
    # far below it (large inputs: M_1 of −2000) meets a factor of e^2000, and 0·∞ would be NaN
    return np.where(state == 0, 0.0, scaled).astype(dtype)

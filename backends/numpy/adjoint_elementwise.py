"""The parallel and chunkwise backward of a matrix state with an elementwise decay (docs/gradients.md):

    S_t = exp(L_t) ⊙ S_(t−1) + Σ_i k_i,t ⊗ v_i,t,   readouts r_t = q_t·S_t (or q_t·S_(t−1))

Every element of S is a scalar linear recurrence of its own, and so is its adjoint, run in reverse: with H_t
the readouts' rank-one writes q ⊗ ∂r of the readouts that read S_t,

    Ŝ_t = exp(Λ_L − Λ_t) ⊙ Ŝ_end + Σ_(t ≤ t' ≤ L) exp(Λ_t' − Λ_t) ⊙ H_t'    (Λ: the prefix sums of L)

inside a chunk of tokens ..L, Ŝ_end the adjoint of the state after the chunk (from the chunk after it). The
chunk's states S_t and S_(t−1) come the same way from the state before it, Σ_(j ≤ t) exp(Λ_t − Λ_j) ⊙ N_j.
Then every gradient is a product of bounded factors, per token: ∂k = Ŝ_t·v, ∂v = k·Ŝ_t, ∂q = S·∂r, and
∂L_t = Ŝ_t ⊙ exp(L_t) ⊙ S_(t−1) (no difference of two large terms). As the forward's (elementwise_scan.py):
every exponent is a difference Λ_a − Λ_b ≤ 0 of float64 prefix sums, masked before the exponential, so strong
decays never overflow. The pairwise sums take [B, H, ROWS, n, K, V] at once; the parallel backward is one
chunk of the whole sequence.

Arrays as adjoint_scan's: log_decay [B, T, H, K, V], writes [(key [B, T, H, K], value [B, T, H, V])], queries
[(q [B, T, H, K], before)]; the results [B, T, H, *].
"""
from __future__ import annotations

import numpy as np

from .adjoint_arrays import heads as _heads, tokens_major as _back

ROWS = 16  # the tokens t of the pairwise sums formed at once


def _pairwise(read, cum, terms, later: bool, strict: bool, dtype):
    """For each token t: Σ_j exp(read_t − cum_j) ⊙ terms_j over j ≤ t (later: the decay runs the other way,
    Σ_j exp(cum_j − read_t) ⊙ terms_j over j ≥ t); strict leaves j = t out. [B, H, n, K, V]."""
    n = cum.shape[2]
    out = np.zeros(terms.shape, dtype)
    index = np.arange(n)
    for first in range(0, n, ROWS):
        rows = index[first:first + ROWS]
        keep = (index[None, :] >= rows[:, None]) if later else (index[None, :] <= rows[:, None])
        if strict:
            keep &= index[None, :] != rows[:, None]
        keep = keep[:, :, None, None]
        diff = cum[:, :, None] - read[:, :, rows, None] if later else read[:, :, rows, None] - cum[:, :, None]
        decay = np.where(keep, np.exp(np.where(keep, diff, 0.0)), 0.0).astype(dtype, copy=False)
        out[:, :, first:first + len(rows)] = np.einsum("bhtjkv,bhjkv->bhtkv", decay, terms)
    return out


class _Chunk:
    """One chunk: its prefix sums (float64), its writes' sum N_j, and its states after and before each token."""

    def __init__(self, l, writes, start, stop, state, dtype):
        self.here = slice(start, stop)
        self.dtype = dtype
        self.cum = np.cumsum(l[:, :, self.here], axis=2, dtype=np.float64)
        self.prev = np.concatenate([np.zeros_like(self.cum[:, :, :1]), self.cum[:, :, :-1]], axis=2)
        self.writes = [(k[:, :, self.here], v[:, :, self.here]) for k, v in writes]
        self.n_j = sum(k[..., :, None] * v[..., None, :] for k, v in self.writes) if self.writes else \
            np.zeros(self.cum.shape, dtype)
        start_state = state[:, :, None]
        self.after = np.exp(self.cum).astype(dtype) * start_state + \
            _pairwise(self.cum, self.cum, self.n_j, later=False, strict=False, dtype=dtype)
        self.before = np.concatenate([start_state, self.after[:, :, :-1]], axis=2)

    def state_read(self, before: bool):
        return self.before if before else self.after


def _chunks(tokens: int, chunk: int):
    return [(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


def elementwise_decay_scan_backward(s0, log_decay, writes, queries, starts, chunk, grad_readouts, grad_final):
    """The backward of adjoint_scan.decay_scan for an elementwise decay plus writes (the states before each
    chunk it returned): (∂log_decay, [(∂key, ∂value)], [∂query], ∂initial state)."""
    l = _heads(log_decay)  # (finite: adjoint_scan.decay_scan_backward raised the resets)
    dtype = np.result_type(s0, l)
    ws = [(_heads(k), _heads(v)) for k, v in writes]
    qs = [(_heads(q), before) for q, before in queries]
    drs = [_heads(dr) for dr in grad_readouts]
    adjoint = np.zeros(np.shape(s0), dtype) if grad_final is None else np.array(grad_final, dtype=dtype)
    dl = np.zeros(l.shape, dtype)
    dws = [(np.zeros(k.shape, dtype), np.zeros(v.shape, dtype)) for k, v in ws]
    dqs = [np.zeros(q.shape, dtype) for q, _ in qs]
    bounds = _chunks(l.shape[2], chunk)
    for index in reversed(range(len(bounds))):
        start, stop = bounds[index]
        c = _Chunk(l, ws, start, stop, starts[index], dtype)
        # the readouts' writes q ⊗ ∂r into the adjoint of the state they read: S_t (after), or S_(t−1) — the
        # state after the token before, or the state before the chunk for its first token
        after = np.zeros(c.n_j.shape, dtype)
        first = np.zeros(adjoint.shape, dtype)
        for (q, before), dr, dq in zip(qs, drs, dqs):
            qc, drc = q[:, :, c.here], dr[:, :, c.here]
            dq[:, :, c.here] = np.einsum("bhtkv,bhtv->bhtk", c.state_read(before), drc)
            write = qc[..., :, None] * drc[..., None, :]
            if before:
                after[:, :, :-1] += write[:, :, 1:]
                first += write[:, :, 0]
            else:
                after += write
        # Ŝ_t: the adjoint of the state after each token of the chunk
        adj = np.exp(c.cum[:, :, -1:] - c.cum).astype(dtype) * adjoint[:, :, None] + \
            _pairwise(c.cum, c.cum, after, later=True, strict=False, dtype=dtype)
        dl[:, :, c.here] = adj * np.exp(l[:, :, c.here]).astype(dtype) * c.before
        for (k, v), (dk, dv) in zip(c.writes, dws):
            dk[:, :, c.here] = np.einsum("bhtkv,bhtv->bhtk", adj, v)
            dv[:, :, c.here] = np.einsum("bhtk,bhtkv->bhtv", k, adj)
        # the adjoint of the state before the chunk: Ŝ_0 decayed by the first token, and its first token's
        # readouts before the update
        adjoint = np.exp(l[:, :, start]).astype(dtype) * adj[:, :, 0] + first
    return _back(dl), [(_back(dk), _back(dv)) for dk, dv in dws], [_back(dq) for dq in dqs], adjoint

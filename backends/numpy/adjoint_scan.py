"""The parallel and chunkwise backward of a state whose update is a decay plus rank-one writes (no
corrections), read by readouts q·S (adjoint.md): generated gradient modules call these.

One state, per chunk of C tokens, with Λ_t the cumulative log-decay inside the chunk (a vector over the key
axis; a scalar decay is the same on every key):

    S_t = e^{Λ_t}·S_a + Σ_{j ≤ t} e^{Λ_t − Λ_j}·k_j ⊗ v_j            (S_a: the state before the chunk)
    r_t = q_t·S_t  (or q_t·S_(t−1): a read before the update: Λ_(t−1), j < t)
        = Σ_j A_tj v_j + (q_t ⊙ e^{Λ_t})·S_a,    A_tj = Σ_i q_ti k_ji e^{Λ_ti − Λ_ji}  (masked, j ≤ t)

The decayed products e^{Λ_t − Λ_j} are formed pairwise and masked before the exponential, so a strong decay
never overflows (every exponent that is kept is ≤ 0 for decays ≤ 1). The forward keeps the state before each
chunk (T/C states); the backward runs the chunks from the last, with the adjoint state Ŝ at the chunk's end:

    Ŝ_a = e^{Λ_L} ⊙ Ŝ_b + Σ_t (q_t ⊙ e^{Λ_t}) ⊗ ∂r_t       (the adjoint recurrence: decays transposed, the
                                                            readouts become rank-one writes)
    ∂v_j = Σ_t A_tj ∂r_t + (k_j ⊙ e^{Λ_L − Λ_j})·Ŝ_b,   ∂k_j = Σ_t ∂A_tj q_t ⊙ e^{Λ_t − Λ_j} + e^{Λ_L − Λ_j} ⊙ Ŝ_b v_j
    ∂q_t = Σ_j ∂A_tj k_j ⊙ e^{Λ_t − Λ_j} + e^{Λ_t} ⊙ S_a ∂r_t,   ∂A_tj = ∂r_t·v_j

and the log-decays' gradient through Λ: every pairwise product e^{Λ_t − Λ_j} gives +P to Λ_t and −P to Λ_j
(P its contribution to the loss), the chunk's end state Σ_v S_b ⊙ Ŝ_b to Λ_L; then ∂l_s = Σ_{t ≥ s} ∂Λ_t.
A parallel form is one chunk of the whole sequence. The pairwise products are formed ROWS tokens t at a
time, so memory stays [B, H, ROWS, C, K] however long the chunk.
"""
from __future__ import annotations

import numpy as np

from ..dsl.errors import RuntimeInputError


def _heads(x, width=None):
    """[B, T, H, n] → [B, H, T, n] (a copy: the chunks slice it), broadcast to `width` on the last axis."""
    x = np.moveaxis(np.asarray(x), 1, 2)
    if width is not None:
        x = np.broadcast_to(x, x.shape[:-1] + (width,))
    return np.ascontiguousarray(x)


ROWS = 64  # the rows (tokens t) of the pairwise products formed at once: memory [B, H, ROWS, C, K]


def _lower(rows: range, size: int, strict: bool) -> np.ndarray:
    """[rows, size, 1]: j ≤ t (j < t where strict) for the chunk's tokens t in `rows`, j < size."""
    return (np.arange(size)[None, :] <= np.asarray(rows)[:, None] - (1 if strict else 0))[:, :, None]


def _pairs(read, cumulative, rows: range, strict: bool):
    """e^{read_t − cumulative_j} for the tokens t in `rows` and j ≤ t (j < t where strict), else 0:
    [B, H, len(rows), C, K]. The exponent is masked before the exponential: what is kept is ≤ 0 for decays ≤ 1."""
    keep = _lower(rows, cumulative.shape[2], strict)
    diff = read[:, :, rows.start:rows.stop, None, :] - cumulative[:, :, None, :, :]
    return np.where(keep, np.exp(np.where(keep, diff, 0.0)), 0.0)


def _row_blocks(size: int):
    return [range(first, min(first + ROWS, size)) for first in range(0, size, ROWS)]


class _Chunk:
    """One chunk's cumulative log-decays and the readouts' versions of them."""

    def __init__(self, log_decay, start, stop):
        self.start, self.stop = start, stop
        self.l = log_decay[:, :, start:stop]
        self.cum = np.cumsum(self.l, axis=2)           # Λ_t, after token t

    def read(self, before: bool):
        return self.cum - self.l if before else self.cum  # Λ_(t−1) for a read before the update


def decay_scan(s0, log_decay, writes, queries, chunk):
    """The forward: (readouts [B, T, H, V] for each (query, before), the final state, the states before each
    chunk). s0 [B, H, K, V]; log_decay [B, T, H, K or 1]; writes [(key [B, T, H, K], value [B, T, H, V])]."""
    K, V = s0.shape[-2:]
    l = _heads(log_decay)  # (a scalar decay stays one column: its pairwise products are matrix products)
    if np.isneginf(l).any():
        raise RuntimeInputError("a decay of exactly 0 (a log-decay of −∞, a reset): the parallel and chunkwise "
                                "backward work with finite log-decays; use form='recurrent' for this call")
    ws = [(_heads(k, K), _heads(v, V)) for k, v in writes]
    qs = [(_heads(q, K), before) for q, before in queries]
    batch, heads, tokens = l.shape[:3]
    state = np.array(s0, dtype=np.result_type(s0, l))
    results = [np.empty((batch, heads, tokens, V), dtype=state.dtype) for _ in qs]
    starts = []
    for start in range(0, tokens, chunk):
        c = _Chunk(l, start, min(start + chunk, tokens))
        starts.append(state)
        for (q, before), out in zip(qs, results):
            qc, read = q[:, :, c.start:c.stop], c.read(before)
            r = np.einsum("bhtk,bhkv->bhtv", qc * np.exp(read), state)
            for rows in _row_blocks(c.stop - c.start):
                pairs = _pairs(read, c.cum, rows, before)
                at = slice(rows.start, rows.stop)
                for k, v in ws:
                    r[:, :, at] += _scores(qc[:, :, at], k[:, :, c.start:c.stop], pairs) @ v[:, :, c.start:c.stop]
            out[:, :, c.start:c.stop] = r
        last = c.cum[:, :, -1]
        state = np.exp(last)[..., None] * state
        for k, v in ws:
            decayed = k[:, :, c.start:c.stop] * np.exp(last[:, :, None] - c.cum)
            state = state + np.einsum("bhjk,bhjv->bhkv", decayed, v[:, :, c.start:c.stop])
    return [np.moveaxis(r, 2, 1) for r in results], state, starts


def decay_scan_backward(s0, log_decay, writes, queries, starts, chunk, grad_readouts, grad_final):
    """The backward of decay_scan: (∂log_decay [B, T, H, as given], [(∂key, ∂value)], [∂query], ∂s0) from the
    readouts' gradients [B, T, H, V] and the final state's (None: zero)."""
    K, V = s0.shape[-2:]
    l = _heads(log_decay)
    fold = (lambda x: x.sum(axis=-1, keepdims=True)) if l.shape[-1] == 1 else (lambda x: x)  # noqa: E731
    ws = [(_heads(k, K), _heads(v, V)) for k, v in writes]
    qs = [(_heads(q, K), before) for q, before in queries]
    drs = [_heads(dr, V) for dr in grad_readouts]
    batch, heads, tokens = l.shape[:3]
    dtype = np.result_type(s0, l)
    adjoint = np.zeros((batch, heads, K, V), dtype) if grad_final is None else np.array(grad_final, dtype=dtype)
    dl = np.zeros(l.shape, dtype)
    dws = [(np.zeros((batch, heads, tokens, K), dtype), np.zeros((batch, heads, tokens, V), dtype)) for _ in ws]
    dqs = [np.zeros((batch, heads, tokens, K), dtype) for _ in qs]
    bounds = list(range(0, tokens, chunk))
    for index in reversed(range(len(bounds))):
        c = _Chunk(l, bounds[index], min(bounds[index] + chunk, tokens))
        here, size = slice(c.start, c.stop), c.stop - c.start
        before_chunk = starts[index]
        last = c.cum[:, :, -1]
        # ∂l_s directly, as the sum of the terms whose decay spans token s (no ±P that cancel: float32 keeps
        # them): the chunk's end state e^{Λ_L}·S_a spans every token; a write j, decayed by e^{Λ_L − Λ_j},
        # spans j < s; a pair (t, j) of a readout spans j < s ≤ t (≤ t − 1 before the update), its S_a term
        # s ≤ t (≤ t − 1)
        end_state = fold(np.einsum("bhkv,bhkv->bhk", np.exp(last)[..., None] * before_chunk, adjoint))
        d_log = np.broadcast_to(end_state[:, :, None], c.cum.shape).copy()
        for (k, v), (dk, dv) in zip(ws, dws):
            tail = np.exp(last[:, :, None] - c.cum)
            decayed = k[:, :, here] * tail
            adjoint_v = np.einsum("bhkv,bhjv->bhjk", adjoint, v[:, :, here])   # Ŝ_b v_j
            dk[:, :, here] += tail * adjoint_v
            dv[:, :, here] += np.einsum("bhjk,bhkv->bhjv", decayed, adjoint)
            d_log += _exclusive_cumsum(fold(decayed * adjoint_v))
        adjoint_before = np.exp(last)[..., None] * adjoint
        for (q, before), dq, dr in zip(qs, dqs, drs):
            qc, drc, read = q[:, :, here], dr[:, :, here], c.read(before)
            for rows in _row_blocks(size):
                pairs = _pairs(read, c.cum, rows, before)
                spans = _lower(rows, size, before)  # the tokens s whose decay a row t's pairs span: s ≤ t (< t)
                at = slice(c.start + rows.start, c.start + rows.stop)
                q_rows, dr_rows = q[:, :, at], dr[:, :, at]
                for (k, v), (dk, dv) in zip(ws, dws):
                    kc, vc = k[:, :, here], v[:, :, here]
                    a = _scores(q_rows, kc, pairs)
                    da = dr_rows @ np.swapaxes(vc, -1, -2)                    # ∂A_tj = ∂r_t·v_j
                    dv[:, :, here] += np.swapaxes(a, -1, -2) @ dr_rows
                    dq[:, :, at] += _weighted(da, kc, pairs, columns=False)
                    dk[:, :, here] += _weighted(da, q_rows, pairs, columns=True)
                    if pairs.shape[-1] == 1:  # each pair's part of the loss, [t, j, key or 1]
                        contribution = (da * a)[..., None]
                    else:
                        contribution = da[..., None] * q_rows[:, :, :, None, :] * kc[:, :, None, :, :] * pairs
                    # token s gets Σ_t Σ_(j < s) of it, over the t whose decay spans s
                    d_log += np.where(spans, _exclusive_cumsum(contribution, axis=3), 0.0).sum(axis=2)
            grown = np.exp(read)
            state_dr = np.einsum("bhkv,bhtv->bhtk", before_chunk, drc)   # S_a ∂r_t
            dq[:, :, here] += grown * state_dr
            through = fold(qc * grown * state_dr)
            if before:
                through = np.concatenate([through[:, :, 1:], np.zeros_like(through[:, :, :1])], axis=2)
            d_log += np.flip(np.cumsum(np.flip(through, axis=2), axis=2), axis=2)   # Σ_(t ≥ s)
            adjoint_before = adjoint_before + np.einsum("bhtk,bhtv->bhkv", qc * grown, drc)
        dl[:, :, here] = d_log
        adjoint = adjoint_before
    back = lambda x: np.moveaxis(x, 2, 1)  # noqa: E731 - [B, H, T, n] → [B, T, H, n]
    return back(dl), [(back(dk), back(dv)) for dk, dv in dws], [back(dq) for dq in dqs], adjoint


def _scores(q_rows, k, pairs):
    """A_tj = Σ_i q_ti k_ji e^{read_ti − Λ_ji}; where the decay is a scalar (pairs [.., 1]), one matrix product."""
    if pairs.shape[-1] == 1:
        return (q_rows @ np.swapaxes(k, -1, -2)) * pairs[..., 0]
    return np.einsum("bhtk,bhjk,bhtjk->bhtj", q_rows, k, pairs)


def _weighted(da, x, pairs, columns: bool):
    """Σ_j ∂A_tj e^{…}_tj x_j for each row t, or (columns) Σ_t ∂A_tj e^{…}_tj x_t for each column j."""
    if pairs.shape[-1] == 1:
        w = da * pairs[..., 0]
        return (np.swapaxes(w, -1, -2) if columns else w) @ x
    return np.einsum("bhtj,bhtk,bhtjk->bhjk" if columns else "bhtj,bhjk,bhtjk->bhtk", da, x, pairs)


def _exclusive_cumsum(x, axis=2):
    """Σ_(j < s) x_j along `axis`."""
    total = np.cumsum(x, axis=axis)
    return np.concatenate([np.zeros_like(np.take(total, [0], axis=axis)),
                           np.take(total, np.arange(total.shape[axis] - 1), axis=axis)], axis=axis)

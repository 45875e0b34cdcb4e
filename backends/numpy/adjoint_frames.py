"""The parallel and chunkwise backward of the corrections adjoint_scan's scans do not take directly, by a change
of frame that makes them the key-side corrections u ⊗ (w·S_(t−1)) of a state whose columns do not decay
(docs/gradients.md). Three changes, applied in this order where the state needs them:

* **Transposition** — value-side corrections (D_t·S_(t−1)·a) ⊗ b (the gated Oja rule): the transpose S' = Sᵀ
  has them on its key side, b ⊗ (a·S'_(t−1)·D_t), its rows decaying as S's columns (E_t) and its columns as
  S's rows (D_t); the writes k ⊗ v become v ⊗ k. A readout q·S becomes a *column* readout S'·q.
* **Columns into the decay** — key-side corrections beside a decay of the value axis, u ⊗ (w·S_(t−1)·E_t):
  column c of S is a vector state of its own, decaying by l_t + m_t,c and corrected by (u_t·e^{m_t,c}, w_t).
  A scalar m joins the rows' decay (every column alike: one triangular system still); a vector m makes the
  decay elementwise, l ⊕ m, with a u per column.
* **Columns into the heads** — key-side corrections beside an elementwise decay (one triangular system per
  column, as the forward's scan._by_columns): each column c of S [K, V] is a state [K, 1] with the
  per-row decay L[:, c], so the V columns become V× the heads, and the plain scan runs them.

A column readout r_t = S'_t·q_t has the same backward, as a functional of the states, as the row readout
∂r_t·S'_t with gradient q_t — both are Σ_t ⟨S'_t, ∂r_t ⊗ q_t⟩ — so the plain backward takes it with query
and gradient swapped, and the query's own gradient ∂q_t = ∂r_t·S'_t is that readout's value: a forward in the
frame gives it (and the frame's states before each chunk). Each change is exact; the gradients go back
through them by the chain rule (a factor e^m on u: ∂m gets ∂u'·u·e^m; broadcast arrays: summed).

For a scan that takes a decay of the rows only (the C chunk kernels, c.grad_chunk_scans: rows_only), the last
two changes apply without corrections too — every decay of the value axis joins the rows', every elementwise
decay's columns become heads. Each change maps a state by itself (Plain.starts: a forward's states before each
chunk, in the frame).

(The forward of every state is the forms' own segments, adjoint_scan.decay_scan.)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


def needed(log_decay, corrections, value_log_decay, value_corrections, rows_only=False) -> bool:
    """Whether the state needs a change of frame: value-side corrections, or key-side ones beside a decay of
    the value axis or an elementwise decay. rows_only: for scans that take a decay of the rows only (the C
    chunk kernels), any decay of the value axis or elementwise one needs it too."""
    if rows_only and (value_log_decay is not None or np.ndim(log_decay) == 5):
        return True
    return bool(value_corrections) or bool(corrections) and (value_log_decay is not None or np.ndim(log_decay) == 5)


# ---- the problem in a frame, and its gradients ---------------------------------------------------------------
@dataclass
class Problem:
    """A state's scan, [B, T, H, *] arrays: s0 [B, H, K, V]; l [.., 1 | K] or elementwise [.., K, V]; m None or
    [.., 1 | V]; writes (k, v); key-side corrections (u, w), [.., K] or (elementwise) [.., K, V] each;
    value-side ones (a, b); readouts (q, before, column): q·S, or S·q where `column` (q never None: a vector
    state needs no change of frame); their gradients; the final state's gradient (None: zero)."""

    s0: np.ndarray
    l: np.ndarray
    m: np.ndarray | None
    writes: list
    corrections: list
    value_corrections: list
    readouts: list
    grads: list
    final: np.ndarray | None


@dataclass
class Grads:
    """The gradients of a Problem's arrays, in its frame (readouts: of each query)."""

    l: np.ndarray
    m: np.ndarray | None
    writes: list
    corrections: list
    value_corrections: list
    readouts: list
    s0: np.ndarray


class Plain:
    """The problem in the frame adjoint_scan's scans take directly — row readouts only, the column readouts'
    query and gradient swapped — the way its gradients go back, and the way a state goes into it."""

    def __init__(self, problem: Problem, steps, states=()):
        self.problem, self.steps, self.states = problem, steps, states
        p = problem
        self.queries = [(g if column else q, before) for (q, before, column), g in zip(p.readouts, p.grads)]
        self.grad_readouts = [q if column else g for (q, _, column), g in zip(p.readouts, p.grads)]
        # the readouts whose values are their queries' gradients (the column readouts', see the docstring)
        self.duals = [(g, before) for (_, before, column), g in zip(p.readouts, p.grads) if column]

    def starts(self, starts):
        """The states before each chunk, [B, H, n, K, V], in the frame: each change of frame maps a state by
        itself (every change is linear in it), so a forward in the original frame gives the frame's."""
        batch, heads, n = np.shape(starts)[:3]
        s = np.moveaxis(np.asarray(starts), 2, 1).reshape((batch * n, heads) + np.shape(starts)[3:])
        for into in self.states:
            s = into(s)
        return np.moveaxis(s.reshape((batch, n) + s.shape[1:]), 1, 2)

    def gradients(self, grads, duals):
        """The original problem's gradients, from the plain backward's (a ScanGrads) and the duals' values."""
        dual = iter(duals)
        readouts = [next(dual) if column else dq for (_, _, column), dq in zip(self.problem.readouts, grads.queries)]
        g = Grads(grads.log_decay, grads.value_log_decay, list(grads.writes), list(grads.corrections), [], readouts,
                  grads.initial_state)
        for back in reversed(self.steps):
            g = back(g)
        return g


def reframe(s0, log_decay, writes, queries, grad_readouts, grad_final, corrections, value_log_decay,
            value_corrections, rows_only=False) -> Plain:
    """The changes of frame the state needs (see the module's docstring), in order. rows_only: the frame's scan
    takes a decay of the rows only (the C chunk kernels): a decay of the value axis joins the rows' and an
    elementwise decay's columns become heads with or without corrections (as needed() says)."""
    p = Problem(np.asarray(s0), np.asarray(log_decay), None if value_log_decay is None else np.asarray(value_log_decay),
                list(writes), list(corrections), list(value_corrections),
                [(q, before, False) for q, before in queries], list(grad_readouts), grad_final)
    steps, states = [], []
    for change in (_transposed, _columns_into_decay, _columns_into_heads):
        p, back, into = change(p, rows_only)
        if back is not None:
            steps.append(back)
        if into is not None:  # (None: the state is the same in the new frame)
            states.append(into)
    return Plain(p, steps, states)


def _swap(x):
    return None if x is None else np.swapaxes(x, -1, -2)


def _transposed(p: Problem, rows_only=False):
    """S' = Sᵀ, where value-side corrections are its key-side ones."""
    if not p.value_corrections:
        return p, None, None
    elementwise = p.l.ndim == 5
    zero = np.zeros(p.l.shape[:3] + (1,), p.l.dtype)
    frame = Problem(_swap(p.s0), _swap(p.l) if elementwise else (zero if p.m is None else p.m),
                    None if elementwise else p.l, [(v, k) for k, v in p.writes], [(b, a) for a, b in p.value_corrections],
                    [], [(q, before, not column) for q, before, column in p.readouts], p.grads, _swap(p.final))

    def back(g: Grads) -> Grads:
        return Grads(_swap(g.l) if elementwise else g.m, None if elementwise or p.m is None else g.l,
                     [(dk, dv) for dv, dk in g.writes], [], [(da, db) for db, da in g.corrections], g.readouts,
                     _swap(g.s0))
    return frame, back, _swap


def _columns_into_decay(p: Problem, rows_only=False):
    """u ⊗ (w·S_(t−1)·E_t): the columns' decay joins the rows' (a scalar one), or makes it elementwise with a u
    per column (rows_only: without corrections too)."""
    if not (p.corrections or rows_only) or p.m is None:
        return p, None, None
    grown = np.exp(p.m)
    scalar = p.m.shape[-1] == 1
    if scalar:
        l = p.l + p.m
        corrections = [(u * grown, w) for u, w in p.corrections]
    else:
        rows = p.s0.shape[-2]
        l = np.broadcast_to(p.l[..., :, None], p.l.shape[:3] + (rows, p.m.shape[-1])) + p.m[..., None, :]
        corrections = [(np.asarray(u)[..., :, None] * grown[..., None, :], w) for u, w in p.corrections]
    frame = replace(p, l=l, m=None, corrections=corrections)

    def back(g: Grads) -> Grads:
        if scalar:
            dl = g.l if p.l.shape[-1] == g.l.shape[-1] else g.l.sum(axis=-1, keepdims=True)
            dm = g.l.sum(axis=-1, keepdims=True) + sum(
                (du * u * grown).sum(axis=-1, keepdims=True) for (du, _), (u, _) in zip(g.corrections, p.corrections))
            dcorr = [(du * grown, dw) for du, dw in g.corrections]
        else:
            dl = g.l.sum(axis=-1)
            dl = dl if p.l.shape[-1] == dl.shape[-1] else dl.sum(axis=-1, keepdims=True)
            dm = g.l.sum(axis=-2) + sum((du * np.asarray(u)[..., :, None] * grown[..., None, :]).sum(axis=-2)
                                        for (du, _), (u, _) in zip(g.corrections, p.corrections))
            dcorr = [((du * grown[..., None, :]).sum(axis=-1), dw) for du, dw in g.corrections]
        return replace(g, l=dl, m=dm, corrections=dcorr)
    return frame, back, None


def _columns_into_heads(p: Problem, rows_only=False):
    """An elementwise decay with key-side corrections (rows_only: with or without): each column a state [K, 1]
    of its own, one more head."""
    if not (p.corrections or rows_only) or p.l.ndim != 5:
        return p, None, None
    batch, tokens, head_count, rows, cols = p.l.shape

    def rows_in(x):  # [.., K] (the same for every column) or [.., K, V] → [B, T, H·V, K]
        x = np.asarray(x)
        x = np.moveaxis(x, -1, 3) if x.ndim == 5 else np.broadcast_to(x[:, :, :, None, :], (batch, tokens, head_count,
                                                                                              cols, rows))
        return x.reshape(batch, tokens, head_count * cols, rows)

    def rows_out(dx, like):  # the gradient of rows_in(x), in x's shape
        dx = dx.reshape(batch, tokens, head_count, cols, rows)
        return np.moveaxis(dx, 3, -1) if np.ndim(like) == 5 else dx.sum(axis=3)

    def cols_in(x):  # [.., V] → [B, T, H·V, 1]
        return np.asarray(x).reshape(batch, tokens, head_count * cols, 1)

    def cols_out(dx):
        return dx.reshape(batch, tokens, head_count, cols)

    def state_in(s):  # [B, H, K, V] → [B, H·V, K, 1] (B: any number of states)
        return None if s is None else np.moveaxis(s, -1, 2).reshape(len(s), head_count * cols, rows, 1)

    frame = Problem(state_in(p.s0), rows_in(p.l), None, [(rows_in(k), cols_in(v)) for k, v in p.writes],
                    [(rows_in(u), rows_in(w)) for u, w in p.corrections], [],
                    [(cols_in(q) if column else rows_in(q), before, column) for q, before, column in p.readouts],
                    [rows_in(g) if column else cols_in(g) for (_, _, column), g in zip(p.readouts, p.grads)],
                    state_in(p.final))

    def back(g: Grads) -> Grads:
        return Grads(rows_out(g.l, p.l), None, [(rows_out(dk, k), cols_out(dv)) for (dk, dv), (k, _) in
                                                zip(g.writes, p.writes)],
                     [(rows_out(du, u), rows_out(dw, w)) for (du, dw), (u, w) in zip(g.corrections, p.corrections)],
                     [], [cols_out(dq) if column else rows_out(dq, q) for dq, (q, _, column) in zip(g.readouts,
                                                                                                  p.readouts)],
                     np.moveaxis(g.s0.reshape(batch, head_count, cols, rows), 2, -1))
    return frame, back, state_in

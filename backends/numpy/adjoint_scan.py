"""The parallel and chunkwise backward of a state whose update is a decay plus rank-one corrections and
rank-one writes (or a decay of both axes plus writes), read by readouts q·S (adjoint.md): generated gradient
modules call these.

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

Rank-one corrections u_t ⊗ (w_tᵀ S_(t−1)) (the delta rule) are writes whose values are the pseudo-values
p_t = w_t·S_(t−1): a readout before the update, by the query w, of the state they themselves write. Inside a
chunk they solve the unit lower-triangular system (I − L) p = w·(the state without corrections), L_tj =
Σ_i w_ti u_ji e^{Λ_(t−1)i − Λ_ji} (j < t) — the UT transform. Its backward is the chain rule through that
solve: with c = ∂p the gradient the pseudo-values receive as the values of writes (from the readouts and Ŝ_b:
the backward above with the corrections among the writes), the gradient λ of the readouts w·S_(t−1) solves
the transposed system (I − L)ᵀ λ = c, backwards in time; then the backward above once more, the corrections'
queries w read before the update with gradients λ and no end state, gives their share of every gradient —
∂w from those readouts, ∂u as the corrections' keys, their terms of ∂l and of Ŝ_a (Σ_t (w_t ⊙ e^{Λ_(t−1)}) ⊗
λ_t). Several corrections interleave their tokens, (t, r), so the system stays triangular in t. No
correction's pseudo-value is kept between passes: each chunk's are recomputed from the state before it.

A decay of the value axis too, S_t = diag(e^{l_t})·S_(t−1)·diag(e^{m_t}) + k ⊗ v (then without corrections),
scales each value column of a pair (t, j) by e^{C_t − C_j} (C: the prefix sums of m), formed pairwise and
masked like the rows' factors: r_tc = Σ_j A_tj v_jc e^{C_tc − C_jc}, so ∂v_jc = Σ_t A_tj ∂r_tc e^{C_tc − C_jc},
∂A_tj = Σ_c ∂r_tc v_jc e^{C_tc − C_jc}, and ∂m_s sums per column the same spanning terms as ∂l_s per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import adjoint_frames as frames
from .adjoint_arrays import heads as _heads, refuse_subnormal_decays
from .adjoint_elementwise import elementwise_decay_scan_backward
from .scan import GROWTH_LIMIT, RESET_LOG_DECAY, growth, raise_to_reset, segment, solve_unit_lower


SEGMENT_BLOCK = 16  # the forward's sub-blocks (the chunkwise form's, linrec.numpy.scan)
ROWS = 64  # the rows (tokens t) of the pairwise products formed at once: memory [B, H, ROWS, C, K]
# the diagonal blocks of the corrections' triangular solves (np.linalg.solve on each; its LU of larger blocks
# ran 100× slower on 192 × 192 here, with three corrections: 64 interleaved tokens)
SOLVE_BLOCK = 32
# A chunk longer than this, with corrections, runs its backward in sub-chunks of this many tokens, as C's chunk
# backward does: the UT transform's solve over one long chunk (the parallel form's chunk of T tokens) loses the
# float32 accuracy of the initial state's gradient, a product of T contractions (a non-causal delta rule at
# T = 200: 8.8e-3 relative against 8.3e-6 in sub-chunks; verify's long-T case 9.3e-2)
BACKWARD_SUB_CHUNK = 64


def _lower(rows: range, size: int, strict: bool) -> np.ndarray:
    """[rows, size, 1]: j ≤ t (j < t where strict) for the chunk's tokens t in `rows`, j < size."""
    return (np.arange(size)[None, :] <= np.asarray(rows)[:, None] - (1 if strict else 0))[:, :, None]


def _row_blocks(size: int):
    return [range(first, min(first + ROWS, size)) for first in range(0, size, ROWS)]


class _Chunk:
    """One chunk's cumulative log-decays (of the key axis, and of the value axis where it decays) and the
    readouts' versions of them; the exponentials are cast back to the working dtype."""

    def __init__(self, log_decay, start, stop, dtype, value_log_decay=None):
        self.start, self.stop, self.size, self.dtype = start, stop, stop - start, dtype
        self.l = log_decay[:, :, start:stop]
        self.cum, self.prev = _prefix_sums(self.l)  # Λ_t after token t, Λ_(t−1)
        self.last = self.cum[:, :, -1]
        # the value axis's log-decays m (S·diag(e^m)) and their sums C, or None
        self.m = None if value_log_decay is None else value_log_decay[:, :, start:stop]
        self.col_cum, self.col_prev = (None, None) if self.m is None else _prefix_sums(self.m)

    def cut(self, x):
        return x[:, :, self.start:self.stop]

    def read(self, before: bool):
        return self.prev if before else self.cum

    def read_columns(self, before: bool):
        return self.col_prev if before else self.col_cum

    def columns(self, x, before: bool):
        """x [B, H, n, V] scaled by e^{C_t} (e^{C_(t−1)} where `before`): what the value axis's decay does to a
        readout of the state before the chunk."""
        return x if self.m is None else x * self.exp(self.read_columns(before))

    def column_pairs(self, rows: range, before: bool):
        """e^{C_t − C_j} per value column for the tokens t in `rows` and j ≤ t (j < t where `before`), else 0:
        [B, H, len(rows), C, V]; None where the value axis does not decay."""
        return None if self.m is None else self._masked(self.read_columns(before), self.col_cum, rows, before)

    def exp(self, x):
        return np.exp(x).astype(self.dtype, copy=False)

    def pairs(self, read, rows: range, strict: bool):
        """e^{read_t − Λ_j} for the tokens t in `rows` and j ≤ t (j < t where strict), else 0:
        [B, H, len(rows), C, K]. The exponent is masked before the exponential: what is kept is ≤ 0 for decays
        ≤ 1."""
        return self._masked(read, self.cum, rows, strict)

    def _masked(self, read, cum, rows: range, strict: bool):
        keep = _lower(rows, self.size, strict)
        diff = read[:, :, rows.start:rows.stop, None, :] - cum[:, :, None, :, :]
        return np.where(keep, self.exp(np.where(keep, diff, 0.0)), np.zeros((), self.dtype))


def _prefix_sums(l):
    """(Λ_t, Λ_(t−1)) along the tokens of l [B, H, n, *]: float64 (in float32 their rounding, |Λ|·ε, would
    become a relative error of every e^{Λ_t − Λ_j} of nearby tokens under strong decay); Λ_(t−1) is the previous
    sum itself, not Λ_t − l_t (which misses it by the rounding of Λ_t)."""
    cum = np.cumsum(l, axis=2, dtype=np.float64)
    return cum, np.concatenate([np.zeros_like(cum[:, :, :1]), cum[:, :, :-1]], axis=2)


# ---- the forward -------------------------------------------------------------------------------------------
def decay_scan(s0, log_decay, writes, queries, chunk, corrections=(), value_log_decay=None, value_corrections=()):
    """The forward: (readouts [B, T, H, V] for each (query, before) — [B, T, H, K] for a query None, the vector
    state itself —, the final state, the states before each chunk). s0 [B, H, K, V]; log_decay [B, T, H, K or 1]
    or, elementwise, [B, T, H, K, V]; writes [(key [B, T, H, K], value [B, T, H, V])]; corrections [(u, w)]:
    + u ⊗ (w·S_(t−1)·E_t), [B, T, H, K] each (beside an elementwise decay they read S_(t−1) itself, and u or w
    may be [B, T, H, K, V]); value_log_decay None or [B, T, H, V]: the columns decay too, S·diag(e^m) = S·E_t;
    value_corrections [(a, b), [B, T, H, V] each]: + (D_t·S_(t−1)·a) ⊗ b. It runs the forms' own segments
    (linrec.numpy.scan.segment) chunk by chunk."""
    log_decay, value_log_decay = raise_to_reset(log_decay), raise_to_reset(value_log_decay)  # (resets: −750)
    K, V = s0.shape[-2:]

    def along(x, width):  # a vector broadcast to its width; a matrix (one vector per column) as it is
        return _heads(x, width) if np.ndim(x) == 4 else _heads(x)
    l, m = _heads(log_decay), None if value_log_decay is None else _heads(value_log_decay)
    ws = [(along(k, K), along(v, V)) for k, v in writes]
    cs = [(along(u, K), along(w, K)) for u, w in corrections]
    vcs = [(_heads(a, V), _heads(b, V)) for a, b in value_corrections]
    qs = [(None if q is None else _heads(q, K), before) for q, before in queries]
    tokens = l.shape[2]
    state = np.array(s0, dtype=np.result_type(s0, l))
    starts, pieces = [], []
    for start in range(0, tokens, chunk):
        at = slice(start, min(start + chunk, tokens))
        cut = lambda x: None if x is None else x[:, :, at]  # noqa: E731
        starts.append(state)
        results, state = segment(state, cut(l), [(cut(u), cut(w)) for u, w in cs], [(cut(k), cut(v)) for k, v in ws],
                                 [(cut(q), b) for q, b in qs], True, SEGMENT_BLOCK, m=cut(m),
                                 value_corrections=[(cut(a), cut(b)) for a, b in vcs])
        pieces.append(results)
    readouts = [np.concatenate([p[i] for p in pieces], axis=2) for i in range(len(qs))]
    return [np.moveaxis(r, 2, 1) for r in readouts], state, starts


def _readout(c: _Chunk, state, q, before: bool, writes):
    """q_t·S_t (q_t·S_(t−1) where `before`) for the chunk's tokens: chunk-local q [B, H, n, K] and writes."""
    read = c.read(before)
    r = c.columns(np.einsum("bhtk,bhkv->bhtv", q * c.exp(read), state), before)
    for rows in _row_blocks(c.size):
        pairs, columns = c.pairs(read, rows, before), c.column_pairs(rows, before)
        at = slice(rows.start, rows.stop)
        for k, v in writes:
            a = _scores(q[:, :, at], k, pairs)
            r[:, :, at] += a @ v if columns is None else np.einsum("bhtj,bhjv,bhtjv->bhtv", a, v, columns)
    return r


def _column_tail(c: _Chunk, v):
    """v_j ⊙ e^{C_L − C_j}: a value as it reaches the chunk's end (v itself where the value axis does not decay)."""
    return v if c.m is None else v * c.exp(c.col_cum[:, :, -1:] - c.col_cum)


def _pseudo_values(c: _Chunk, state, corrections, writes):
    """The corrections' pseudo-values p_r,t = w_r,t·S_(t−1) over the chunk, and the system I − L they solve
    ([B, H, nR, nR], tokens and corrections interleaved as (t, r))."""
    n, count = c.size, len(corrections)
    rhs = [_readout(c, state, w, True, writes) for _, w in corrections]
    system = _correction_system(c, corrections)
    stacked = np.stack(rhs, axis=-2).reshape(rhs[0].shape[:-2] + (n * count, rhs[0].shape[-1]))
    solved = solve_unit_lower(system, stacked, block=SOLVE_BLOCK)
    solved = solved.reshape(rhs[0].shape[:-2] + (n, count, rhs[0].shape[-1]))
    return [solved[:, :, :, r] for r in range(count)], system


def _correction_system(c: _Chunk, corrections):
    """I − L, L[(t, r), (j, r')] = Σ_i w_r,ti u_r',ji e^{Λ_(t−1)i − Λ_ji} for j < t."""
    n, count = c.size, len(corrections)
    batch, heads = corrections[0][0].shape[:2]
    blocks = np.zeros((batch, heads, n, count, n, count), c.dtype)
    for rows in _row_blocks(n):
        pairs = c.pairs(c.prev, rows, True)
        for r, (_, w) in enumerate(corrections):
            for r2, (u, _) in enumerate(corrections):
                blocks[:, :, rows.start:rows.stop, r, :, r2] = _scores(w[:, :, rows.start:rows.stop], u, pairs)
    return np.eye(n * count, dtype=c.dtype) - blocks.reshape(batch, heads, n * count, n * count)


def _solve_transposed(system, rhs):
    """λ with systemᵀ λ = rhs, for the unit lower-triangular system of _correction_system: upper triangular,
    solved backwards in time (the system and the right-hand side reversed are lower triangular again).
    rhs: one [B, H, n, V] per correction; returns the same."""
    count = len(rhs)
    stacked = np.stack(rhs, axis=-2).reshape(rhs[0].shape[:-2] + (-1, rhs[0].shape[-1]))
    reversed_system = np.flip(np.swapaxes(system, -1, -2), axis=(-2, -1))
    solved = np.flip(solve_unit_lower(reversed_system, np.flip(stacked, axis=-2), block=SOLVE_BLOCK), axis=-2)
    solved = solved.reshape(rhs[0].shape[:-1] + (count, rhs[0].shape[-1]))
    return [solved[:, :, :, r] for r in range(count)]


# ---- the backward ------------------------------------------------------------------------------------------
class ScanGrads(NamedTuple):
    """decay_scan_backward's gradients, [B, T, H, *] as the arrays were given: of the log-decays, of each
    write's (key, value), of each readout's query, of the initial state [B, H, K, V], of each correction's (u,
    w), and of the value axis's log-decays (None where it does not decay)."""

    log_decay: np.ndarray
    writes: list
    queries: list
    initial_state: np.ndarray
    corrections: list
    value_log_decay: np.ndarray | None
    value_corrections: list = ()  # of each value-side correction's (a, b)

    def at_resets(self, log_decay, value_log_decay=None) -> "ScanGrads":
        """These gradients of a backward that ran on the log-decays raised to RESET_LOG_DECAY (raise_to_reset,
        as the forward's derived forms run them: a reset's −∞ would make the differences of prefix sums in the
        pairwise exponents NaN), with the log-decays' own gradient 0 where one (as given) lay below it: there
        ∂(e^l·X)/∂l = e^l·X underflows to 0, as in the recurrent form, where a form whose ∂l is a difference of
        sums over the tokens would leave their rounding."""
        def zeroed(grad, given):
            if grad is None or given is None:
                return grad
            below = np.asarray(given) < RESET_LOG_DECAY
            return np.where(below, np.zeros((), np.result_type(grad)), grad) if below.any() else grad
        return self._replace(log_decay=zeroed(self.log_decay, log_decay),
                             value_log_decay=zeroed(self.value_log_decay, value_log_decay))


def decay_scan_backward(s0, log_decay, writes, queries, starts, chunk, grad_readouts, grad_final, corrections=(),
                        value_log_decay=None, value_corrections=(), decays_as_values=False) -> ScanGrads:
    """The backward of decay_scan (the same arguments, the states before each chunk it returned, the readouts'
    gradients [B, T, H, V] and the final state's, None: zero), resets (log-decays of −∞) included: run raised,
    their gradients 0 (ScanGrads.at_resets). decays_as_values: the log-decays are logs of values, which are
    refused below the normal range, 0 included (adjoint_arrays.BelowNormalRange: vjp then runs the statements,
    whose product a·S has a finite derivative at a = 0 that no log-space form gives)."""
    if decays_as_values:
        refuse_subnormal_decays(log_decay, value_log_decay)
    grads = _decay_scan_backward(s0, raise_to_reset(log_decay), writes, queries, starts, chunk, grad_readouts,
                                 grad_final, corrections, raise_to_reset(value_log_decay), value_corrections)
    return grads.at_resets(log_decay, value_log_decay)


def _decay_scan_backward(s0, log_decay, writes, queries, starts, chunk, grad_readouts, grad_final, corrections=(),
                         value_log_decay=None, value_corrections=()) -> ScanGrads:
    """The backward of decay_scan (the same arguments, the states before each chunk it returned, the readouts'
    gradients [B, T, H, V] and the final state's, None: zero). Value-side corrections, and corrections beside a
    decay of the value axis or an elementwise one, run this scan in another frame (adjoint_frames), which
    recomputes its own states before each chunk. The log-decays are finite (decay_scan_backward raised them)."""
    if frames.needed(log_decay, corrections, value_log_decay, value_corrections):
        plain = frames.reframe(s0, log_decay, writes, queries, grad_readouts, grad_final, corrections,
                               value_log_decay, value_corrections)
        p = plain.problem
        duals, _, frame_starts = decay_scan(p.s0, p.l, p.writes, plain.duals, chunk, corrections=p.corrections)
        grads = decay_scan_backward(p.s0, p.l, p.writes, plain.queries, frame_starts, chunk, plain.grad_readouts,
                                    p.final, corrections=p.corrections)
        g = plain.gradients(grads, duals)
        return ScanGrads(g.l, g.writes, g.readouts, g.s0, g.corrections, g.m, g.value_corrections)
    if np.ndim(log_decay) == 5:  # an elementwise decay
        return ScanGrads(*elementwise_decay_scan_backward(s0, log_decay, writes, queries, starts, chunk,
                                                          grad_readouts, grad_final), [], None)
    sub = _sub_chunk(corrections, chunk)
    if sub < chunk:  # (the states before each sub-chunk: one forward again)
        _, _, sub_starts = decay_scan(s0, log_decay, writes, [], sub, corrections, value_log_decay)
        return decay_scan_backward(s0, log_decay, writes, queries, sub_starts, sub, grad_readouts, grad_final,
                                   corrections, value_log_decay)
    K, V = s0.shape[-2:]
    l, m = _heads(log_decay), None if value_log_decay is None else _heads(value_log_decay)
    fold = (lambda x: x.sum(axis=-1, keepdims=True)) if l.shape[-1] == 1 else (lambda x: x)  # noqa: E731
    ws = [(_heads(k, K), _heads(v, V)) for k, v in writes]
    cs = [(_heads(u, K), _heads(w, K)) for u, w in corrections]
    # a vector state read as it is (no query: decay_scan's readout [B, T, H, K]) with gradient g_t is the readout
    # g_t·S_t with gradient 1: the same functional Σ_t g_t·S_t, so the same gradients of everything but the
    # query (which is no argument here, and gets none)
    values = [q is None for q, _ in queries]
    qs = [(_heads(dr if q is None else q, K), before) for (q, before), dr in zip(queries, grad_readouts)]
    drs = [np.ones(np.shape(dr)[:3] + (1,), np.result_type(dr)).swapaxes(1, 2) if q is None else _heads(dr, V)
           for (q, _), dr in zip(queries, grad_readouts)]
    batch, heads, tokens = l.shape[:3]
    dtype = np.result_type(s0, l)
    adjoint = np.zeros((batch, heads, K, V), dtype) if grad_final is None else np.array(grad_final, dtype=dtype)
    dl = np.zeros(l.shape, dtype)
    dm = None if m is None else np.zeros(m.shape, dtype)
    dws = [(np.zeros((batch, heads, tokens, K), dtype), np.zeros((batch, heads, tokens, V), dtype)) for _ in ws]
    dcs = [(np.zeros((batch, heads, tokens, K), dtype), np.zeros((batch, heads, tokens, K), dtype)) for _ in cs]
    dqs = [np.zeros((batch, heads, tokens, K), dtype) for _ in qs]
    bounds = list(range(0, tokens, chunk))
    for index in reversed(range(len(bounds))):
        c = _Chunk(l, bounds[index], min(bounds[index] + chunk, tokens), dtype, m)
        before_chunk = starts[index]
        wc = [(c.cut(k), c.cut(v)) for k, v in ws]
        if cs:
            corr = [(c.cut(u), c.cut(w)) for u, w in cs]
            pseudo, system = _pseudo_values(c, before_chunk, corr, wc)
            wc += [(u, p) for (u, _), p in zip(corr, pseudo)]
        grads = _chunk_backward(c, before_chunk, adjoint, wc, [(c.cut(q), b) for q, b in qs],
                                [c.cut(dr) for dr in drs], fold)
        if cs:
            # the pseudo-values' gradient as values of writes is c; the readouts w·S_(t−1) that define them
            # get λ, (I − L)ᵀ λ = c; their backward adds each correction's share (see the module's docstring)
            direct = [dv for _, dv in grads.writes[len(ws):]]
            lam = _solve_transposed(system, direct)
            grads = grads.plus(_chunk_backward(c, before_chunk, None, wc, [(w, True) for _, w in corr], lam, fold))
        here = slice(c.start, c.stop)
        dl[:, :, here] = grads.log_decay
        if dm is not None:
            dm[:, :, here] = grads.value_log_decay
        for (dk, dv), (gk, gv) in zip(dws, grads.writes):
            dk[:, :, here], dv[:, :, here] = gk, gv
        for (du, dw), (gu, _), gw in zip(dcs, grads.writes[len(ws):], grads.queries[len(qs):]):
            du[:, :, here], dw[:, :, here] = gu, gw
        for dq, g in zip(dqs, grads.queries):
            dq[:, :, here] = g
        adjoint = grads.adjoint
    back = lambda x: np.moveaxis(x, 2, 1)  # noqa: E731 - [B, H, T, n] → [B, T, H, n]
    return ScanGrads(back(dl), [(back(dk), back(dv)) for dk, dv in dws],
                     [None if value else back(dq) for dq, value in zip(dqs, values)], adjoint,
                     [(back(du), back(dw)) for du, dw in dcs], None if dm is None else back(dm))


def _sub_chunk(corrections, chunk: int) -> int:
    """The chunk the backward of corrections runs in: at most BACKWARD_SUB_CHUNK tokens, and halved until no
    sub-chunk's corrections can stretch the state by more than e^GROWTH_LIMIT (scan.growth), as the forward's
    segments are — the transposed solve loses the digits of that growth as the forward's does (TTT-Linear on
    raw keys, whose 1 − eta·‖k‖² reaches −15: every gradient 8e-8 off at T = 512 in sub-chunks of 64 tokens,
    5e-11 in C's of 16). Without corrections: the chunk itself."""
    if not corrections:
        return chunk
    size = min(chunk, BACKWARD_SUB_CHUNK)
    pairs = [(_heads(u), _heads(w)) for u, w in corrections]  # (head-major [B, H, T, K], as growth takes them)
    tokens = pairs[0][0].shape[2]
    while size > 1 and any(growth([(u[:, :, at], w[:, :, at]) for u, w in pairs], ()) > GROWTH_LIMIT
                           for at in (slice(start, start + size) for start in range(0, tokens, size))):
        size //= 2
    return size


@dataclass
class _ChunkGrads:
    """One chunk's gradients, chunk-local [B, H, n, *]: of the log-decays (of the value axis too, or None), of
    each write's key and value, of each readout's query, and the adjoint state before the chunk."""

    log_decay: np.ndarray
    value_log_decay: np.ndarray | None
    writes: list
    queries: list
    adjoint: np.ndarray

    def plus(self, other: "_ChunkGrads") -> "_ChunkGrads":
        """The sum of two passes over the same writes; the queries of the other pass follow this one's."""
        value = None if self.value_log_decay is None else self.value_log_decay + other.value_log_decay
        return _ChunkGrads(self.log_decay + other.log_decay, value,
                           [(a + c, b + d) for (a, b), (c, d) in zip(self.writes, other.writes)],
                           self.queries + other.queries, self.adjoint + other.adjoint)


def _chunk_backward(c: _Chunk, before_chunk, adjoint, writes, queries, grad_readouts, fold) -> _ChunkGrads:
    """The backward of one chunk's readouts and end state, from the adjoint state at its end (None: zero)
    and the readouts' gradients (chunk-local arrays). ∂l_s directly, as the sum of the terms whose decay
    spans token s (no ±P that cancel: float32 keeps them): the chunk's end state e^{Λ_L}·S_a spans every
    token; a write j, decayed by e^{Λ_L − Λ_j}, spans j < s; a pair (t, j) of a readout spans j < s ≤ t
    (≤ t − 1 before the update), its S_a term s ≤ t (≤ t − 1). A decay of the value axis, e^{C_t − C_j} per
    column, spans the same tokens: ∂m_s sums the same terms, per value column."""
    size, valued = c.size, c.m is not None
    d_log = np.zeros(c.l.shape, c.dtype)
    d_col = np.zeros(c.m.shape, c.dtype) if valued else None
    dws = [(np.zeros_like(k), np.zeros_like(v)) for k, v in writes]
    dqs = [np.zeros_like(q) for q, _ in queries]
    adjoint_before = np.zeros_like(before_chunk)
    if adjoint is not None:
        grown_last = c.exp(c.last)[..., None]
        if valued:
            grown_last = grown_last * c.exp(c.col_cum[:, :, -1])[:, :, None, :]
        end = grown_last * before_chunk * adjoint          # the end state's S_a term, times Ŝ_b
        d_log += fold(end.sum(axis=-1))[:, :, None]
        if valued:
            d_col += end.sum(axis=-2)[:, :, None]
        tail = c.exp(c.last[:, :, None] - c.cum)
        for (k, v), (dk, dv) in zip(writes, dws):
            decayed, reaching = k * tail, _column_tail(c, v)
            adjoint_v = np.einsum("bhkv,bhjv->bhjk", adjoint, reaching)   # Ŝ_b v_j (as it reaches the end)
            adjoint_k = np.einsum("bhjk,bhkv->bhjv", decayed, adjoint)    # Ŝ_bᵀ k_j (as it reaches the end)
            dk += tail * adjoint_v
            dv += _column_tail(c, adjoint_k)
            d_log += _exclusive_cumsum(fold(decayed * adjoint_v))
            if valued:
                d_col += _exclusive_cumsum(reaching * adjoint_k)
        adjoint_before = adjoint_before + grown_last * adjoint
    for (q, before), dq, dr in zip(queries, dqs, grad_readouts):
        read = c.read(before)
        for rows in _row_blocks(size):
            pairs, columns = c.pairs(read, rows, before), c.column_pairs(rows, before)
            spans = _lower(rows, size, before)  # the tokens s whose decay a row t's pairs span: s ≤ t (< t)
            at = slice(rows.start, rows.stop)
            q_rows, dr_rows = q[:, :, at], dr[:, :, at]
            for (k, v), (dk, dv) in zip(writes, dws):
                a = _scores(q_rows, k, pairs)
                if columns is None:
                    da = dr_rows @ np.swapaxes(v, -1, -2)                    # ∂A_tj = ∂r_t·v_j
                    dv += np.swapaxes(a, -1, -2) @ dr_rows
                else:  # r_tc = Σ_j A_tj v_jc e^{C_tc − C_jc}
                    weighted = dr_rows[:, :, :, None, :] * columns            # ∂r_tc e^{C_tc − C_jc}
                    da = np.einsum("bhtjv,bhjv->bhtj", weighted, v)
                    dv += np.einsum("bhtj,bhtjv->bhjv", a, weighted)
                    contribution = a[..., None] * v[:, :, None] * weighted   # each pair's part, per column
                    d_col += np.where(spans, _exclusive_cumsum(contribution, axis=3), 0.0).sum(axis=2)
                dq[:, :, at] += _weighted(da, k, pairs, columns=False)
                dk += _weighted(da, q_rows, pairs, columns=True)
                if pairs.shape[-1] == 1:  # each pair's part of the loss, [t, j, key or 1]
                    contribution = (da * a)[..., None]
                else:
                    contribution = da[..., None] * q_rows[:, :, :, None, :] * k[:, :, None, :, :] * pairs
                # token s gets Σ_t Σ_(j < s) of it, over the t whose decay spans s
                d_log += np.where(spans, _exclusive_cumsum(contribution, axis=3), 0.0).sum(axis=2)
        grown = c.exp(read)
        dr_seen = c.columns(dr, before)                 # ∂r_t ⊙ e^{C_t}: what S_a's term sees
        state_dr = np.einsum("bhkv,bhtv->bhtk", before_chunk, dr_seen)   # S_a ∂r_t
        dq += grown * state_dr
        through = [fold(q * grown * state_dr)]
        if valued:  # the S_a term's part of the loss per value column: (q ⊙ e^{Λ_t})·S_a ⊙ ∂r_t e^{C_t}
            through.append(np.einsum("bhtk,bhkv->bhtv", q * grown, before_chunk) * dr_seen)
        for part, total in zip(through, (d_log, d_col)):
            if before:
                part = np.concatenate([part[:, :, 1:], np.zeros_like(part[:, :, :1])], axis=2)
            total += np.flip(np.cumsum(np.flip(part, axis=2), axis=2), axis=2)   # Σ_(t ≥ s)
        adjoint_before = adjoint_before + np.einsum("bhtk,bhtv->bhkv", q * grown, dr_seen)
    return _ChunkGrads(d_log, d_col, dws, dqs, adjoint_before)


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

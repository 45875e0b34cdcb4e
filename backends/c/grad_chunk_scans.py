"""The scans of the parallel and chunkwise backward on C (c.grad_chunk) for every structure the recurrent C
backward takes (c.grad_scans): the generated module calls these two with linrec.numpy.adjoint_scan's
decay_scan and decay_scan_backward arguments, as the NumPy backward calls those, and they run the C chunk
kernels (c.grad_chunk_kernels: a decay of the rows, key-side corrections, readouts q·S) on each state —

    as it is                              where it has that structure (the states before each chunk kept
                                          by the forward);
    in another frame (numpy.adjoint_frames, rows_only)   where it decays its value axis or elementwise, or
                                          has value-side corrections: transposed (S' = Sᵀ, its value side its
                                          key side, a readout q·S a column readout), a scalar decay of the
                                          columns joined to the rows', an elementwise decay's columns as
                                          heads (each column a state [K, 1] with a decay per row); the
                                          frame's states before each chunk those of the forward, mapped
                                          into it (each change of frame is linear in the state) — or, where
                                          the frame has column readouts, from a forward in the frame, which
                                          also gives their duals (the queries' gradients);
    a vector state read as it is          (a query None: the readout S_t, gradient g_t) as the readout g_t·S_t
                                          with gradient 1 — the same functional Σ_t g_t·S_t, so the same
                                          gradients of everything but the query, which has none.

A state that stays its initial state (`S = S`, read by no readout) runs no kernel (c.grad_scans). The forward
of a state that is not taken as it is runs the recurrent backward's C forward for its structure
(c.grad_scans): its readouts in the state's own frame, and its checkpoints every `chunk` tokens, which are
the states before each chunk.

    readouts, final, starts = chunk_checkpoints(s0, log_decay, writes, queries, chunk, corrections=(),
                                                value_log_decay=None, value_corrections=())
    grads = adjoint_chunkwise(s0, log_decay, writes, queries, starts, chunk, grad_readouts, grad_final,
                              corrections=(), value_log_decay=None, value_corrections=())      # a ScanGrads
"""
from __future__ import annotations

import numpy as np

from ..numpy import adjoint_frames as frames
from ..numpy.adjoint_scan import ScanGrads
from ..numpy.scan import raise_to_reset
from . import grad_chunk_kernels, grad_scans, scaled_keys, small_decays
from .scaled_keys import scaled  # noqa: F401  (the generated module's helper: c.grad_chunk imports it from here)


def _as_it_is(log_decay, queries, corrections, value_log_decay, value_corrections) -> bool:
    """Whether the chunk kernels take the state as it is: rows that decay (or not), no value side, readouts q·S."""
    return not frames.needed(log_decay, corrections, value_log_decay, value_corrections, rows_only=True) and \
        all(q is not None for q, _ in queries)


def chunk_checkpoints(s0, log_decay, writes, queries, chunk, corrections=(), value_log_decay=None,
                      value_corrections=()):
    """The forward: ([readout], final state, the states before each chunk [B, H, n, K, V]) — decay_scan's
    results. Resets (log-decays of −∞) run raised, as the NumPy parallel and chunkwise backward run them
    (linrec.numpy.scan.raise_to_reset)."""
    log_decay, value_log_decay = raise_to_reset(log_decay), raise_to_reset(value_log_decay)
    # (the recurrent backward's C forward for the state's structure, c.grad_scans' — for a state the chunk kernels
    # take as it is the same kernel as grad_chunk_kernels.chunk_checkpoints, its readouts times their queries'
    # constant factors; no kernel for a state that stays its initial state: its checkpoints every `chunk` tokens
    # are the states before each chunk, and a frame's are theirs, mapped)
    return grad_scans.adjoint_checkpoints(s0, log_decay, writes, queries, chunk, corrections, value_log_decay,
                                          value_corrections)


def adjoint_chunkwise(s0, log_decay, writes, queries, starts, chunk, grad_readouts, grad_final, corrections=(),
                      value_log_decay=None, value_corrections=(), decays_as_values=False) -> ScanGrads:
    """The backward, decay_scan_backward's ScanGrads (log_decay None where the rows do not decay; a query None
    gets the gradient None), from the readouts' gradients and the final state's (None: zero); resets run raised,
    their gradients 0, as there. decays_as_values: the log-decays are logs of values whose gradients the chain
    rule divides by them (c.small_decays). Factored key-side slots (c.scaled_keys) go to the chunk kernels as they
    are where those take the state as it is; elsewhere they are expanded, and their gradients folded back. A
    query's constant factor (a third item, as c.grad_scans takes it) the chunk kernels apply to its upstream
    gradient; elsewhere it is applied to the query."""
    given_queries, (queries, factors) = queries, grad_scans.query_factors(queries)
    if scaled_keys.any_scaled(corrections, writes) and (decays_as_values or not _as_it_is(
            log_decay, queries, corrections, value_log_decay, value_corrections)):
        plain_corrections, plain_writes = scaled_keys.expand(corrections, writes)
        grads = adjoint_chunkwise(s0, log_decay, plain_writes, given_queries, starts, chunk, grad_readouts,
                                  grad_final, plain_corrections, value_log_decay, value_corrections, decays_as_values)
        return scaled_keys.fold(grads, corrections, writes)
    if decays_as_values:
        grads = small_decays.backward_if_small(s0, log_decay, writes, grad_scans.scaled_queries(queries, factors),
                                               chunk, grad_readouts, grad_final, corrections, value_log_decay,
                                               value_corrections)
        if grads is not None:
            return grad_scans.unscaled_grads(grads, factors)
    if grad_scans.unchanging(log_decay, writes, queries, corrections, value_log_decay, value_corrections):
        return grad_scans.adjoint_recurrent(s0, log_decay, writes, given_queries, starts, chunk, grad_readouts,
                                            grad_final)
    if _as_it_is(log_decay, queries, corrections, value_log_decay, value_corrections):
        return grad_chunk_kernels.adjoint_chunkwise(s0, log_decay, writes, queries, starts, chunk, grad_readouts,
                                                    grad_final, corrections, read_scales=factors)
    return grad_scans.unscaled_grads(_in_a_frame(s0, log_decay, writes, grad_scans.scaled_queries(queries, factors),
                                                 starts, chunk, grad_readouts, grad_final, corrections,
                                                 value_log_decay, value_corrections), factors)


def _in_a_frame(s0, log_decay, writes, queries, starts, chunk, grad_readouts, grad_final, corrections,
                value_log_decay, value_corrections) -> ScanGrads:
    """adjoint_chunkwise of a state the chunk kernels take in another frame (see the module's docstring)."""
    s0 = np.asarray(s0)
    lead = np.shape(grad_readouts[0])[:3] if grad_readouts else None
    # a vector state read as it is: the readout g_t·S_t with gradient 1 (see the module's docstring)
    values = [q is None for q, _ in queries]
    queries = [(g if q is None else q, before) for (q, before), g in zip(queries, grad_readouts)]
    grad_readouts = [np.ones(lead + (1,), s0.dtype) if value else g for value, g in zip(values, grad_readouts)]
    needed = frames.needed(log_decay, corrections, value_log_decay, value_corrections, rows_only=True)
    rows_decay = log_decay
    if log_decay is None and needed:  # (the frames move a decay between the axes: none is a log-decay of 0)
        # (rows that do not decay need a frame only for a value side: its arrays give [B, T, H])
        side = value_log_decay if value_log_decay is not None else value_corrections[0][0]
        rows_decay = np.zeros(np.shape(side)[:3] + (1,), s0.dtype)
    plain = frames.reframe(s0, rows_decay, writes, queries, grad_readouts, grad_final, corrections, value_log_decay,
                           value_corrections, rows_only=True)
    p = plain.problem
    decay = p.l if needed else log_decay  # (no frame: the rows' decay as given, None where there is none)
    if plain.duals:  # the column readouts' values (their queries' gradients): a forward in the frame
        duals, _, frame_starts = grad_chunk_kernels.chunk_checkpoints(p.s0, decay, p.writes, plain.duals, chunk,
                                                                      p.corrections)
    else:  # the forward's states before each chunk, in the frame
        duals, frame_starts = [], plain.starts(starts)
    grads = grad_chunk_kernels.adjoint_chunkwise(p.s0, decay, p.writes, plain.queries, frame_starts, chunk,
                                                 plain.grad_readouts, p.final, p.corrections)
    g = plain.gradients(grads, duals)
    return ScanGrads(None if log_decay is None else g.l, g.writes,
                     [None if value else dq for value, dq in zip(values, g.readouts)], g.s0, g.corrections, g.m,
                     g.value_corrections)



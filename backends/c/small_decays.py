"""Decays given as values, where they are small: the C backward hands such a call to NumPy's decomposed one.

A log-decay that the compiler takes as the log of a value (compiler.transitions: `log_is_exact` False —
`input a in (0, 1)` with S = a·S + …, or (1 − beta)·S), or whose exact log divides by what it is computed from
(exp(log(a)), sigmoid(log(a)), exp(−c/a): Transition.decays_as_values), reaches that value's gradient through a
division in the chain rule: ∂a = ∂l / a. The C kernels sum ∂l exactly to the rounding of the terms they add — the recurrent
backward's two passes and the chunk kernels subtract sums over the later tokens, whose terms do not carry the
token's decay — so ∂l is exact relative to those terms, not to itself, and where a is small the division
multiplies that rounding by 1/a (found by probing: a = 1e-4 in float32 gave ∂a 3e-3 of its largest value off
in every C form; a = 1e-300 in float64, 1e284). NumPy's decomposed backward (linrec.numpy.adjoint_scan) sums,
for each token, only the terms whose decay spans it, each with that decay as a factor: ∂l to its own
precision. So where a call's value decays fall below SMALL_DECAY, the C module's scans run NumPy's instead —
slower, the same gradients within the forms' tolerance. Above it the division costs at most 2¹⁰ of the
rounding, far inside the tolerances (1e-9 in float64, 5e-4 in float32).

Below the normal range (a subnormal value) no log-space backward keeps enough bits, NumPy's included; nor
has a decay of exactly 0 (a log-decay −∞) a gradient in log space at all (∂l = 0 there, and ∂a = 0 / 0).
Every form's backward refuses both with adjoint_arrays.BelowNormalRange, and gradients.vjp then runs the
statements as written (linrec.numpy's recurrent backward: the product a·S differentiated directly).
"""
from __future__ import annotations

import math

import numpy as np

from ..numpy import adjoint_scan
from ..numpy.adjoint_arrays import refuse_subnormal_decays
from ..numpy.adjoint_derived import DEFAULT_CHUNK

SMALL_DECAY = 2.0 ** -10
SMALL_LOG_DECAY = math.log(SMALL_DECAY)


def backward_if_small(s0, log_decay, writes, queries, chunk, grad_readouts, grad_final, corrections=(),
                      value_log_decay=None, value_corrections=()):
    """What the C backward scans do first for decays given as values: refuse those below the normal range, 0
    included, then NumPy's backward where one is small (its ScanGrads); None: the C kernels run."""
    refuse_subnormal_decays(log_decay, value_log_decay)
    if not hand_over(log_decay, value_log_decay):
        return None
    return numpy_backward(s0, log_decay, writes, queries, chunk, grad_readouts, grad_final, corrections,
                          value_log_decay, value_corrections)


def hand_over(*log_decays) -> bool:
    """Whether a call whose value decays have these log-decays (None: none on that axis) runs NumPy's backward:
    one is below SMALL_LOG_DECAY, and none is NaN (then the C kernels' checks say so; −∞ was refused before)."""
    arrays = [np.asarray(d) for d in log_decays if d is not None]
    if not arrays or any(np.isnan(d).any() for d in arrays):
        return False
    return any(float(np.min(d)) < SMALL_LOG_DECAY for d in arrays if d.size)


def numpy_backward(s0, log_decay, writes, queries, chunk, grad_readouts, grad_final, corrections=(),
                   value_log_decay=None, value_corrections=()) -> adjoint_scan.ScanGrads:
    """decay_scan_backward on the states before each chunk that decay_scan gives (the C forward's checkpoints
    are laid out for the C kernels). The C scans' conventions in NumPy's: no decay of the rows (None) a log-decay
    of 0, no chunk (the recurrent backward's default segment) NumPy's default chunk."""
    chunk = chunk or DEFAULT_CHUNK
    if log_decay is None:
        lead = np.shape(grad_readouts[0])[:3] if grad_readouts else np.shape(writes[0][0])[:3]
        log_decay = np.zeros(lead + (1,), np.asarray(s0).dtype)
    _, _, starts = adjoint_scan.decay_scan(s0, log_decay, writes, [], chunk, corrections=corrections,
                                           value_log_decay=value_log_decay, value_corrections=value_corrections)
    return adjoint_scan.decay_scan_backward(s0, log_decay, writes, queries, starts, chunk, grad_readouts,
                                            grad_final, corrections=corrections, value_log_decay=value_log_decay,
                                            value_corrections=value_corrections)

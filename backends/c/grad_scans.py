"""Which C kernel runs a state's scans in the recurrent backward on C (c.grad): the generated module calls
these two with linrec.numpy.adjoint_scan.decay_scan's and decay_scan_backward's arguments, as the NumPy
chunkwise backward calls those, and they choose from the structure of the arrays, as decay_scan does:

    an elementwise decay (a log-decay [B, T, H, K, V]) or a state read as it is (a query None: a vector
    state an output uses as a value)   → c.grad_elementwise (every element its own recurrence)
    else: a decay of the rows, rank-one corrections and writes, readouts q·S   → c.grad_kernels

    readouts, final, checkpoints = adjoint_checkpoints(s0, log_decay, writes, queries, chunk, corrections=())
    grads = adjoint_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final,
                           corrections=())   (ScanGrads)
"""
from __future__ import annotations

import numpy as np

from ..dsl.errors import LinrecError
from . import grad_elementwise, grad_kernels


def _elementwise(log_decay, queries, corrections) -> bool:
    """The scans are an elementwise kernel's (and then there are no corrections: c.grad.why_not)."""
    elementwise = np.ndim(log_decay) == 5 or any(q is None for q, _ in queries)
    if elementwise and corrections:  # (c.grad refuses such programs; a direct caller gets the reason)
        raise LinrecError("a state with rank-one corrections that decays elementwise or is read as it is: the C "
                          "backward does not take it")
    return elementwise


def adjoint_checkpoints(s0, log_decay, writes, queries, chunk, corrections=()):
    """The forward of the recurrent backward (see the module's docstring)."""
    if _elementwise(log_decay, queries, corrections):
        return grad_elementwise.elementwise_checkpoints(s0, log_decay, writes, queries, chunk)
    return grad_kernels.adjoint_checkpoints(s0, log_decay, writes, queries, chunk, corrections=corrections)


def adjoint_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final, corrections=()):
    """The adjoint recurrence, from the last segment (see the module's docstring)."""
    if _elementwise(log_decay, queries, corrections):
        return grad_elementwise.elementwise_recurrent(s0, log_decay, writes, queries, checkpoints, chunk,
                                                      grad_readouts, grad_final)
    return grad_kernels.adjoint_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts,
                                          grad_final, corrections=corrections)

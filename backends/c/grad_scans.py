"""Which C kernel runs a state's scans in the recurrent backward on C (c.grad): the generated module calls
these two with linrec.numpy.adjoint_scan.decay_scan's and decay_scan_backward's arguments (and a state's
value-side corrections), as the NumPy chunkwise backward calls those, and they choose from the structure of
the arrays, as decay_scan does:

    a decay of the value axis or corrections on the value side     → c.grad_value_side (row by row; key-side
                                                                      corrections beside a value-axis decay too)
    an elementwise decay (a log-decay [B, T, H, K, V], or factored: c.factored_decay) or a state read as it
    is (a query None: a vector state an output uses as a value)     → c.grad_elementwise (every element its own
                                                                      recurrence)
    else: a decay of the rows, rank-one corrections and writes, readouts q·S   → c.grad_kernels

(No program has two of these at once: the decomposition has no elementwise decay beside a decay of the value
axis, and no vector state has a value axis; c.grad.why_not refuses corrections beside an elementwise decay or a
read of the state as it is.)

    readouts, final, checkpoints = adjoint_checkpoints(s0, log_decay, writes, queries, chunk, corrections=(),
                                                       value_log_decay=None, value_corrections=())
    grads = adjoint_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final,
                              corrections=(), value_log_decay=None, value_corrections=())

A query may come with a third item, a constant factor (c.grad: `dk^(−1/2)` of `dk^(−1/2)·q`, the query array q):
the readout is then factor·(q·S), and its query's gradient the gradient with respect to q. c.grad_kernels' kernels
multiply each readout's upstream gradient by it as they read it; for the others it is applied to q here.

(A non-causal program's readouts read the final state: the generated module calls these without readouts and
takes them, and their adjoints, itself — numpy.adjoint_derived.DecomposedEmitter.)

    chunk = common_segment(tokens, initial_states)

the tokens per checkpoint of every state of a call, where the module's forward is the fused kernel (c.grad_forward):
that kernel keeps the states before the same tokens for all states, so each state's adjoint_recurrent must take
that one segment rather than pick its own.
"""
from __future__ import annotations

import numpy as np

from ..dsl.errors import LinrecError
from ..numpy.adjoint_scan import ScanGrads
from . import grad_calls, grad_elementwise, grad_kernels, grad_value_side, normalized_rows, scaled_keys, small_decays
from .factored_decay import FactoredDecay, factored_decay  # noqa: F401  (factored_decay: the module's helper)
from .normalized_rows import normalized  # noqa: F401  (the generated module's helper, as scaled)
from .scaled_keys import scaled  # noqa: F401  (the generated module's helper: c.grad imports it from here)


def _kernel(log_decay, queries, corrections, value_log_decay, value_corrections) -> str:
    """The kernels that run a state's scans: "value_side", "elementwise" or "rows" (c.grad_kernels)."""
    value_side = value_log_decay is not None or bool(value_corrections)
    elementwise = isinstance(log_decay, FactoredDecay) or np.ndim(log_decay) == 5 or \
        any(q is None for q, _ in queries)
    if corrections and (elementwise or value_corrections):  # (c.grad refuses such programs; a direct caller: why)
        raise LinrecError("rank-one corrections on the key side beside value-side ones, an elementwise decay or a "
                          "read of the state as it is: the C backward does not take them")
    return "value_side" if value_side else "elementwise" if elementwise else "rows"


def unchanging(log_decay, writes, queries, corrections, value_log_decay, value_corrections) -> bool:
    """The state has no per-token arrays at all (`S = S`, read by no readout): it stays its initial state."""
    return log_decay is None and value_log_decay is None and not (writes or queries or corrections or
                                                                   value_corrections)


def common_segment(tokens: int, initial_states) -> int:
    """Tokens per checkpoint for all the states of a call (initial states [B, H, K, V]): default_segment's rule
    (√T) for the largest state in its working dtype (float32, else float64). Each state's backward keeps a
    segment's states in a buffer per thread, so the largest state's bound (SEGMENT_BYTES) keeps every state's
    buffer within it; a smaller state then has more checkpoints than it would choose alone."""
    def working_bytes(s0) -> int:
        s0 = np.asarray(s0)
        return int(np.prod(s0.shape[2:])) * (4 if s0.dtype == np.float32 else 8)
    return grad_calls.default_segment(tokens, max((working_bytes(s0) for s0 in initial_states), default=0))


def query_factors(queries) -> tuple[list, tuple[float, ...]]:
    """The queries as (query, before_update) pairs, and each one's constant factor (1 where none is given)."""
    return [(q[0], q[1]) for q in queries], tuple(float(q[2]) if len(q) > 2 else 1.0 for q in queries)


def scaled_queries(queries: list, factors: tuple[float, ...]) -> list:
    """The queries with their factors applied (for the kernels that do not apply them)."""
    return [(q if f == 1.0 or q is None else q * np.asarray(f, np.asarray(q).dtype), before)
            for (q, before), f in zip(queries, factors)]


def adjoint_checkpoints(s0, log_decay, writes, queries, chunk, corrections=(), value_log_decay=None,
                        value_corrections=()):
    """The forward of the recurrent backward (see the module's docstring)."""
    if normalized_rows.any_normalized(corrections, writes, queries):  # (every forward takes l2norm's arrays)
        corrections, writes, queries = normalized_rows.plain(corrections, writes, queries)
    queries, factors = query_factors(queries)
    if unchanging(log_decay, writes, queries, corrections, value_log_decay, value_corrections):
        state = np.array(s0, dtype=np.float32 if np.asarray(s0).dtype == np.float32 else np.float64)
        return [], state, None
    if scaled_keys.any_scaled(corrections, writes):  # (every forward takes each key-side slot's own array)
        corrections, writes = scaled_keys.expand(corrections, writes)
    return _forward(s0, log_decay, writes, queries, factors, chunk, corrections, value_log_decay, value_corrections)


def _forward(s0, log_decay, writes, queries, factors, chunk, corrections, value_log_decay, value_corrections):
    which = _kernel(log_decay, queries, corrections, value_log_decay, value_corrections)
    if which == "rows":
        readouts, final, checkpoints = grad_kernels.adjoint_checkpoints(s0, log_decay, writes, queries, chunk,
                                                                        corrections=corrections)
        for r, f in zip(readouts, factors):
            if f != 1.0:
                r *= np.asarray(f, r.dtype)  # (the readouts are the kernel's new arrays)
        return readouts, final, checkpoints
    queries = scaled_queries(queries, factors)
    if which == "value_side":
        return grad_value_side.value_side_checkpoints(s0, log_decay, writes, queries, chunk, value_log_decay,
                                                      value_corrections, corrections)
    return grad_elementwise.elementwise_checkpoints(s0, log_decay, writes, queries, chunk)


def adjoint_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final, corrections=(),
                      value_log_decay=None, value_corrections=(), decays_as_values=False):
    """The adjoint recurrence, from the last segment (see the module's docstring). decays_as_values: the
    log-decays are logs of values whose gradients the chain rule divides by them (c.small_decays). Factored
    key-side slots (c.scaled_keys) go to c.grad_kernels' backward as they are; for the other kernels they are
    expanded, and their gradients folded back; so are the vectors it normalizes itself (c.normalized_rows), which
    only its backward with corrections takes as they are."""
    if normalized_rows.any_normalized(corrections, writes, queries) and (
            decays_as_values or not corrections or _kernel(log_decay, query_factors(queries)[0], corrections,
                                                           value_log_decay, value_corrections) != "rows"):
        plain_corrections, plain_writes, plain_queries = normalized_rows.plain(corrections, writes, queries)
        grads = adjoint_recurrent(s0, log_decay, plain_writes, plain_queries, checkpoints, chunk, grad_readouts,
                                  grad_final, plain_corrections, value_log_decay, value_corrections, decays_as_values)
        return normalized_rows.fold(grads, corrections, writes, queries)
    given_queries, (queries, factors) = queries, query_factors(queries)
    if scaled_keys.any_scaled(corrections, writes) and (decays_as_values or _kernel(
            log_decay, queries, corrections, value_log_decay, value_corrections) != "rows"):
        plain_corrections, plain_writes = scaled_keys.expand(corrections, writes)
        grads = adjoint_recurrent(s0, log_decay, plain_writes, given_queries, checkpoints, chunk, grad_readouts,
                                  grad_final, plain_corrections, value_log_decay, value_corrections, decays_as_values)
        return scaled_keys.fold(grads, corrections, writes)
    if decays_as_values:
        grads = small_decays.backward_if_small(s0, log_decay, writes, scaled_queries(queries, factors), chunk,
                                               grad_readouts, grad_final, corrections, value_log_decay,
                                               value_corrections)
        if grads is not None:
            return unscaled_grads(grads, factors)
    if unchanging(log_decay, writes, queries, corrections, value_log_decay, value_corrections):
        state = np.asarray(s0)
        dtype = np.float32 if state.dtype == np.float32 else np.float64
        d_s0 = np.zeros(state.shape, dtype) if grad_final is None else np.array(grad_final, dtype=dtype)
        return ScanGrads(None, [], [], d_s0, [], None)
    which = _kernel(log_decay, queries, corrections, value_log_decay, value_corrections)
    if which == "rows":  # (the gradients with respect to the queries as given: the kernel applies the factors)
        return grad_kernels.adjoint_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts,
                                              grad_final, corrections=corrections, read_scales=factors)
    queries = scaled_queries(queries, factors)
    if which == "value_side":
        return unscaled_grads(grad_value_side.value_side_recurrent(
            s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final, value_log_decay,
            value_corrections, corrections), factors)
    return unscaled_grads(grad_elementwise.elementwise_recurrent(s0, log_decay, writes, queries, checkpoints, chunk,
                                                                 grad_readouts, grad_final), factors)


def unscaled_grads(grads: ScanGrads, factors: tuple[float, ...]) -> ScanGrads:
    """The gradients of a backward that ran on the queries times their factors (scaled_queries), with the queries'
    gradients taken to the queries as given (times the factor again)."""
    if all(f == 1.0 for f in factors):
        return grads
    return grads._replace(queries=[d if f == 1.0 or d is None else d * np.asarray(f, d.dtype)
                                   for d, f in zip(grads.queries, factors)])

"""The recurrent backward's kernels in C for a state whose every element is a recurrence of its own
(templates/c_grad_elementwise.c.j2): an elementwise decay, S_t = exp(L_t) ⊙ S_(t−1) + Σ κ ⊗ x (Mamba-1's
`exp(A·diag(dt))*S`), and a vector state, whose decay — none, per token or per element — is one too, with
readouts q·S or the state itself (a vector state an output uses as a value: a query None).

    readouts, final, checkpoints = elementwise_checkpoints(s0, log_decay, writes, queries, chunk)
    grads = elementwise_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final)

take linrec.numpy.adjoint_scan.decay_scan's and decay_scan_backward's arguments and give their results
(ScanGrads; no corrections): s0 [B, H, K, V] (a vector state: V = 1); log_decay None, [B, T, H, 1 | K] or,
elementwise, [B, T, H, K, V] or factored (c.factored_decay: its gradient factored too); writes [(key [B, T, H,
K], value [B, T, H, V])]; queries [(q [B, T, H, K] or None, before_update)] — a readout with no query gives
the state itself, [B, T, H, K·V]. A kernel is specialized per structure (no decay, one per element or
factored, the number of writes, each readout's query and place), per size and per dtype, built once through
c_build and memoized, as c.grad_kernels' are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dsl.errors import RuntimeInputError
from ..numpy.adjoint_scan import ScanGrads
from ..templating import environment
from ..version import VERSION
from . import build as c_build
from .build import CTYPES
from .factored_decay import FactoredDecay
from .grad_calls import Call, backward, forward, lead_and_state
from .grad_calls import cdef as grad_calls_cdef
from .kernel_source import Target, common_context
from .scan_kernels import cached_kernel, operand


@dataclass(frozen=True)
class Structure:
    """Everything one kernel is specialized for."""

    decay: int                 # 0: none; 1: a log-decay per element and token; 2: factored, a step and a rate
    step_rows: bool            # factored: the step scales the rows (else the columns)
    writes: int                # writes (key, value)
    reads: tuple[tuple[bool, bool], ...]  # per readout: (has a query, reads the state before the update)
    dk: int
    dv: int
    ctype: str
    vector_bytes: int

    @property
    def widths(self) -> list[int]:
        """Values per token of each per-token array, in the kernel's order: [log-decay,] key_0, value_0, …,
        the queries."""
        decay = {0: [], 1: [self.dk * self.dv], 2: [self.dk if self.step_rows else self.dv, self.dk * self.dv]}
        return decay[self.decay] + [self.dk, self.dv] * self.writes + \
            [self.dk for query, _ in self.reads if query]

    @property
    def read_widths(self) -> list[int]:
        return [self.dv if query else self.dk * self.dv for query, _ in self.reads]

    def describe(self) -> str:
        reads = ", ".join(("q·S" if query else "S") + (" before" if before else " after")
                          for query, before in self.reads) or "none"
        decay = ["no decay", "a log-decay per element",
                 f"a log-decay per element, a rate times a step per {'row' if self.step_rows else 'column'}"]
        return (f"{decay[self.decay]}; {self.writes} write(s); readouts: "
                f"{reads}; dk = {self.dk}, dv = {self.dv}, {self.ctype}")


def render(s: Structure) -> str:
    query, index = [], len(s.widths) - sum(has_query for has_query, _ in s.reads)
    for has_query, _ in s.reads:
        query.append(index if has_query else -1)
        index += has_query
    return environment(__package__).get_template("c_grad_elementwise.c.j2").render(
        **common_context(Target(s.ctype, s.vector_bytes)), block_tokens=1, inputs=[], checks_inputs=False,
        version=VERSION, description=s.describe(), dk=s.dk, dv=s.dv, decay=s.decay, step_rows=int(s.step_rows),
        writes=s.writes,
        readouts=len(s.reads), n_inputs=len(s.widths), before=", ".join("1" if b else "0" for _, b in s.reads),
        query=", ".join(map(str, query)), read_widths=", ".join(map(str, s.read_widths)))


def cdef(s: Structure) -> str:
    return grad_calls_cdef("lr_ew", s.ctype)


def kernel(s: Structure):
    """The built extension (ffi, lib) for a structure."""
    decay = ["none", "decay", "rows" if s.step_rows else "columns"][s.decay]
    label = f"grad_elementwise_{decay}_w{s.writes}_r{len(s.reads)}_{s.ctype}"
    return cached_kernel(s, "grad_elementwise", label, lambda: render(s), cdef(s))


def _per_element(log_decay, lead: tuple, dk: int, dv: int) -> np.ndarray:
    """The log-decay of every element, [B, T, H, K·V]: an elementwise one as it is, a per-row or per-token one
    broadcast along what it is the same for."""
    x = np.asarray(log_decay)
    if x.ndim == 4:  # [B, T, H, 1 | K]: the same for every column (and row)
        x = np.broadcast_to(x[..., None], lead + (dk, dv))
    if x.shape != lead + (dk, dv):
        raise RuntimeInputError(f"the log-decay of the recurrent backward should have shape "
                                f"{list(lead + (dk, dv))} but has shape {list(x.shape)}")
    return x.reshape(lead + (dk * dv,))


def _factored_arrays(log_decay: FactoredDecay, lead: tuple, dk: int, dv: int, dtype) -> list:
    """A factored log-decay as the kernel takes it: the step [B, T, H, V | K], the rate [H, K, V] as a per-token
    array [B, T, H, K·V] whose batch and token strides are 0 (in the working dtype before it is broadcast: cast
    after, it would be copied to every token)."""
    rate = np.asarray(log_decay.rate, dtype=dtype)
    if rate.shape != (lead[2], dk, dv):
        raise RuntimeInputError(f"the rate of a factored log-decay should have shape {[lead[2], dk, dv]} but has "
                                f"shape {list(rate.shape)}")
    return [log_decay.step, np.broadcast_to(rate.reshape(lead[2], dk * dv), lead + (dk * dv,))]


def _prepare(s0, log_decay, writes, queries) -> Call:
    factored = isinstance(log_decay, FactoredDecay)
    per_token = [a for pair in writes for a in pair] + [q for q, _ in queries if q is not None] + \
        ([] if log_decay is None else [log_decay.step if factored else log_decay])
    state, lead = lead_and_state(s0, per_token)
    dk, dv = state.shape[2:]
    s = Structure(0 if log_decay is None else 2 if factored else 1, factored and bool(log_decay.rows), len(writes),
                  tuple((q is not None, bool(b)) for q, b in queries), dk, dv, CTYPES[state.dtype],
                  c_build.vector_bytes())
    decay = [] if log_decay is None else _factored_arrays(log_decay, lead, dk, dv, state.dtype) if factored else \
        [_per_element(log_decay, lead, dk, dv)]
    arrays = decay + [a for pair in writes for a in pair] + [q for q, _ in queries if q is not None]
    ops = [operand(a, state.dtype, lead + (n,), "a per-token array of the recurrent backward")
           for a, n in zip(arrays, s.widths)]
    return Call(s, state, ops, lead)


def elementwise_checkpoints(s0, log_decay, writes, queries, chunk, num_threads=None):
    """The forward: ([readout [B, T, H, V], or the state itself [B, T, H, K·V]], final state [B, H, K, V], the
    state before every chunk [B, H, ⌈T/chunk⌉, K, V])."""
    c = _prepare(s0, log_decay, writes, queries)
    return forward(c, kernel(c.structure), "lr_ew_forward", c.structure.read_widths, chunk, num_threads)


def elementwise_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final,
                          num_threads=None) -> ScanGrads:
    """The backward, as linrec.numpy.adjoint_scan.decay_scan_backward's (the log-decay's gradient in the shape
    the log-decay was given; a readout with no query has none), from the readouts' gradients and the final
    state's (None: zero); checkpoints and chunk as elementwise_checkpoints gave and took them."""
    c = _prepare(s0, log_decay, writes, queries)
    s = c.structure
    batch, _, heads = c.lead
    # (a factored decay's rate: its gradient per pair, summed over the tokens by the kernel, over the batch here)
    given = {1: np.empty((batch, heads, s.dk * s.dv), c.state.dtype)} if s.decay == 2 else None
    outs, d_s0 = backward(c, kernel(s), "lr_ew_backward", s.read_widths, checkpoints, chunk, grad_readouts,
                          grad_final, num_threads, given)
    it = iter(outs)
    if s.decay == 2:
        d_step, d_rate = next(it), next(it)
        d_log_decay = FactoredDecay(d_rate.sum(axis=0).reshape(heads, s.dk, s.dv), d_step, log_decay.rows)
    else:
        d_log_decay = None if log_decay is None else _as_given(next(it), np.shape(log_decay), c.lead, s)
    d_writes = [(next(it), next(it)) for _ in writes]
    d_queries = [None if q is None else next(it) for q, _ in queries]
    return ScanGrads(d_log_decay, d_writes, d_queries, d_s0, [], None)


def _as_given(d, shape: tuple, lead: tuple, s: Structure) -> np.ndarray:
    """The gradient of the per-element log-decays [B, T, H, K·V], summed back to the shape the log-decay was
    given: [B, T, H, K, V], or [B, T, H, K | 1] (summed over the columns, and the rows)."""
    d = d.reshape(lead + (s.dk, s.dv))
    if len(shape) == 5:
        return d
    d = d.sum(axis=-1)
    return d if shape[-1] == s.dk else d.sum(axis=-1, keepdims=True)

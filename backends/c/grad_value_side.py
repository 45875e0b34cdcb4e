"""The recurrent backward's kernels in C for a matrix state with a decay of its value axis or rank-one
corrections on the value side (templates/c_grad_value_side.c.j2):

    S_t = diag(e^l_t)·(S_(t−1)·diag(e^m_t) + Σ_r (S_(t−1)·a_r) ⊗ b_r) + Σ_j κ_j ⊗ x_j,   read by q·S

(the gated Oja rule's S·diag(e^g)·(I − β v⊗v): a = e^g ⊙ βv, b = −v). A row of the state depends only on the
same row before the update, and so does the adjoint's, so the kernel runs row by row. Transposing the state
would turn the corrections into key-side ones, but the readouts q·S into S·q: the kernels of c.grad_kernels
read q·S only (and a program read as S·q is carried transposed already, compiler.transpose).

    readouts, final, checkpoints = value_side_checkpoints(s0, log_decay, writes, queries, chunk,
                                                          value_log_decay=None, value_corrections=())
    grads = value_side_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final,
                                 value_log_decay=None, value_corrections=())

take linrec.numpy.adjoint_scan.decay_scan's and decay_scan_backward's arguments (log_decay None or
[B, T, H, 1 | K]; value_log_decay None or [B, T, H, V]; value_corrections [(a [B, T, H, V], b [B, T, H, V])])
and give ScanGrads, the value-side corrections' gradients (∂a, ∂b) in its `value_corrections`. Key-side corrections (u, w) beside a decay of the value axis,
S_t = (D_t·S_(t−1) + Σ_r u_r ⊗ (w_r·S_(t−1)))·diag(e^m_t) + Σ κ ⊗ x, run here too (`corrections=`; KEYSIDE in
the template): each column of that update is its own recurrence.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..numpy.adjoint_scan import ScanGrads
from ..templating import environment
from ..version import VERSION
from . import build as c_build
from .build import CTYPES
from .grad_calls import Call, backward, forward, lead_and_state
from .grad_calls import cdef as grad_calls_cdef
from .kernel_source import Target, common_context
from .scan_kernels import cached_kernel, operand

ROW_DECAYS = ("none", "token", "row")


@dataclass(frozen=True)
class Structure:
    """Everything one kernel is specialized for."""

    row_decay: str             # "none", "token" (one log-decay per token) or "row" (one per row)
    value_decay: bool          # one log-decay per column
    corrections: int           # rank-one corrections: on the value side (a, b), or the key side (u, w)
    key_side: bool             # the corrections are on the key side (beside a decay of the value axis)
    writes: int                # writes (key, value)
    before: tuple[bool, ...]   # per readout q·S: reads the state before the update
    dk: int
    dv: int
    ctype: str
    vector_bytes: int

    @property
    def widths(self) -> list[int]:
        """Values per token of each per-token array, in the kernel's order: [l,] [m,] a_0, b_0 (or u_0, w_0), …,
        key_0, value_0, …, q_0, …"""
        rows = {"none": [], "token": [1], "row": [self.dk]}[self.row_decay]
        side = self.dk if self.key_side else self.dv
        return rows + [self.dv] * self.value_decay + [side] * 2 * self.corrections + \
            [self.dk, self.dv] * self.writes + [self.dk] * len(self.before)

    @property
    def read_widths(self) -> list[int]:
        return [self.dv] * len(self.before)

    def describe(self) -> str:
        reads = ", ".join("before" if b else "after" for b in self.before) or "none"
        rows = {"none": "no decay of the rows", "token": "one log-decay per token", "row": "one log-decay per row"}
        return (f"{rows[self.row_decay]}; {'a' if self.value_decay else 'no'} decay of the value axis; "
                f"{self.corrections} {'key' if self.key_side else 'value'}-side correction(s); {self.writes} write(s); "
                f"readouts: {reads}; "
                f"dk = {self.dk}, dv = {self.dv}, {self.ctype}")


def render(s: Structure) -> str:
    return environment(__package__).get_template("c_grad_value_side.c.j2").render(
        **common_context(Target(s.ctype, s.vector_bytes)), block_tokens=1, inputs=[], checks_inputs=False,
        version=VERSION, description=s.describe(), dk=s.dk, dv=s.dv, row_decay=ROW_DECAYS.index(s.row_decay),
        db=s.dk if s.row_decay == "row" else 1, value_decay=int(s.value_decay), corrections=s.corrections,
        key_side=int(s.key_side),
        writes=s.writes, readouts=len(s.before), n_inputs=len(s.widths),
        before=", ".join("1" if b else "0" for b in s.before))


def cdef(s: Structure) -> str:
    return grad_calls_cdef("lr_vs", s.ctype)


def kernel(s: Structure):
    """The built extension (ffi, lib) for a structure."""
    side = "k" if s.key_side else "c"
    label = f"grad_value_side_{s.row_decay}_m{int(s.value_decay)}_{side}{s.corrections}_w{s.writes}_{s.ctype}"
    return cached_kernel(s, "grad_value_side", label, lambda: render(s), cdef(s))


def _prepare(s0, log_decay, writes, queries, value_log_decay, value_corrections, corrections) -> Call:
    pairs = list(value_corrections or corrections)  # (one side only: c.grad_scans)
    per_token = [a for pair in pairs + list(writes) for a in pair] + [q for q, _ in queries] + \
        [x for x in (log_decay, value_log_decay) if x is not None]
    state, lead = lead_and_state(s0, per_token)
    dk, dv = state.shape[2:]
    rows = "none" if log_decay is None else ("token" if np.shape(log_decay)[-1] == 1 else "row")
    s = Structure(rows, value_log_decay is not None, len(pairs), not value_corrections and bool(corrections),
                  len(writes), tuple(bool(b) for _, b in queries), dk, dv, CTYPES[state.dtype], c_build.vector_bytes())
    arrays = [x for x in (log_decay, value_log_decay) if x is not None] + \
        [a for pair in pairs + list(writes) for a in pair] + [q for q, _ in queries]
    ops = [operand(a, state.dtype, lead + (n,), "a per-token array of the recurrent backward")
           for a, n in zip(arrays, s.widths)]
    return Call(s, state, ops, lead)


def value_side_checkpoints(s0, log_decay, writes, queries, chunk, value_log_decay=None, value_corrections=(),
                           corrections=(), num_threads=None):
    """The forward: ([readout [B, T, H, V]], final state [B, H, K, V], the state before every chunk
    [B, H, ⌈T/chunk⌉, K, V])."""
    c = _prepare(s0, log_decay, writes, queries, value_log_decay, value_corrections, corrections)
    return forward(c, kernel(c.structure), "lr_vs_forward", c.structure.read_widths, chunk, num_threads)


def value_side_recurrent(s0, log_decay, writes, queries, checkpoints, chunk, grad_readouts, grad_final,
                         value_log_decay=None, value_corrections=(), corrections=(), num_threads=None) -> ScanGrads:
    """The backward (ScanGrads, as decay_scan_backward gives it), from the
    readouts' gradients and the final state's (None: zero); checkpoints and chunk as value_side_checkpoints
    gave and took them."""
    c = _prepare(s0, log_decay, writes, queries, value_log_decay, value_corrections, corrections)
    s = c.structure
    outs, d_s0 = backward(c, kernel(s), "lr_vs_backward", s.read_widths, checkpoints, chunk, grad_readouts,
                          grad_final, num_threads)
    it = iter(outs)
    d_log_decay = None if log_decay is None else next(it)
    d_value_log_decay = None if value_log_decay is None else next(it)
    d_corrections = [(next(it), next(it)) for _ in range(s.corrections)]
    d_writes = [(next(it), next(it)) for _ in writes]
    d_queries = [next(it) for _ in queries]
    if value_corrections:  # (a state has corrections on one side only: the kernel's are the value side's)
        return ScanGrads(d_log_decay, d_writes, d_queries, d_s0, [], d_value_log_decay, d_corrections)
    return ScanGrads(d_log_decay, d_writes, d_queries, d_s0, d_corrections, d_value_log_decay)

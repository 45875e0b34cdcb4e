"""The parallel and chunkwise forms in C of a matrix state with an elementwise decay (`exp(X)*S`, Mamba-1's
selective scan: docs/forms.md#elementwise-decays), from templates/c_elementwise.c.j2.

c_scan's kernels carry one log-decay per token or per row; a log-decay per element ([B, T, H, dk, dv], a
matrix per token) makes each element of the state a scalar recurrence of its own, and its readouts q·S a
contraction over [tokens, tokens, dk, dv] — linrec.numpy.elementwise_scan in NumPy, here in C with the same
stability rules (exponents as differences ≤ 0, sub-blocks of 16 tokens anchored at their previous token).
c_scan.scan hands such a state over, so the generated NumPy module of a form calls the same chunkwise_scan /
parallel_scan either way. A kernel is specialized per number of writes, readouts (before or after the
update), causality, sizes dk, dv and dtype — the chunk is an argument —, and built once through c_build.

    outs, final = c_elementwise.scan("chunkwise", s0, log_decay, writes, readouts, causal=True, chunk_size=64)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dsl.errors import LinrecError, RuntimeInputError

from .build import CTYPES
from .scan_kernels import FORMS, cached_kernel, call, chunk_of, operand
from ..version import VERSION
from ..templating import environment

SUB_BLOCK = 16  # tokens per sub-block (the anchors of the decays)


@dataclass(frozen=True)
class Structure:
    """Everything one kernel is specialized for."""

    writes: int                # writes (κ, x)
    before: tuple[bool, ...]   # per readout q·S: reads the state before the update
    causal: bool
    dk: int
    dv: int
    ctype: str                 # "float" or "double"
    columns: bool = False      # one log-decay per column, shared by the rows (a decay of the value axis)

    def describe(self) -> str:
        reads = ", ".join("before" if b else "after" for b in self.before) or "none"
        return (f"one log-decay per {'column' if self.columns else 'element'}; {self.writes} write(s); readouts: {reads}; "
                f"{'causal' if self.causal else 'non-causal'}; dk = {self.dk}, dv = {self.dv}, {self.ctype}")


def render(s: Structure, form: str | None = None) -> str:
    """The C source of one kernel."""
    return environment(__package__).get_template("c_elementwise.c.j2").render(
        version=VERSION, title=f"the {form} form" if form else "the parallel and chunkwise forms",
        description=s.describe(), ctype=s.ctype, dk=s.dk, dv=s.dv, writes=s.writes, readouts=len(s.before),
        causal=s.causal, sb=SUB_BLOCK, before=", ".join("1" if b else "0" for b in s.before), columns=s.columns)


def cdef(s: Structure) -> str:
    t = s.ctype
    args = f"(const {t} *s0, {t} *sT, {t} **in, const int64_t *st, {t} **out, int B, int ntok, int H, int nthreads"
    return f"int lr_elementwise_chunkwise{args}, int chunk);\nint lr_elementwise_parallel{args});\n"


def kernel(s: Structure):
    """The built extension (ffi, lib) for a structure: memoized, else from the disk cache, else built."""
    label = f"elementwise{'_columns' if s.columns else ''}_w{s.writes}_{s.ctype}"
    return cached_kernel(s, "elementwise", label, lambda: render(s), cdef(s))


def scan(form: str, s0, log_decay, writes, readouts, causal=True, chunk_size=None, num_threads=None):
    """The readouts q·S of a state s0 [B, H, dk, dv] decaying by exp(log_decay) element by element (log_decay
    [B, T, H, dk, dv]; or [B, T, H, dv], one per column shared by the rows: a decay of the value axis); writes [(κ [B, T, H, dk], x [B, T, H, dv])], readouts [(query [B, T, H, dk], before)].
    Returns ([readout [B, T, H, dv]], final state [B, H, dk, dv]) in the working dtype of the per-token arrays
    (float32, else float64)."""
    if form not in FORMS:
        raise LinrecError(f"unknown scan form {form!r}; choose parallel or chunkwise")
    s0 = np.asarray(s0)
    log_decay = np.asarray(log_decay)
    if s0.ndim != 4 or log_decay.ndim not in (4, 5):
        raise RuntimeInputError(f"an elementwise decay needs a state [B, H, dk, dv] and log-decays [B, T, H, dk, dv] "
                                f"or [B, T, H, dv], got {list(s0.shape)} and {list(log_decay.shape)}")
    columns = log_decay.ndim == 4
    values = [np.asarray(a) for pair in writes for a in pair] + [np.asarray(q) for q, _ in readouts]
    # the working dtype is the values' (a stabilized program's log-decay may arrive in float64 whatever it is)
    working = np.result_type(*values) if values else s0.dtype
    dtype = np.dtype(np.float32) if working == np.float32 else np.dtype(np.float64)
    batch, tokens, heads = log_decay.shape[:3]
    dk, dv = int(s0.shape[2]), int(s0.shape[3])
    if s0.shape[:2] != (batch, heads):
        raise RuntimeInputError(f"the initial state should have shape [B, H, dk, dv] = [{batch}, {heads}, …], got "
                                f"{list(s0.shape)}")
    lead = (batch, tokens, heads)
    if columns:
        ops = [operand(log_decay, dtype, lead + (dv,), "the log-decay")]
    else:
        decays = operand(log_decay, dtype, lead + (dk, dv), "the log-decay")
        ops = [decays.reshape(lead + (dk * dv,)) if decays.strides[-2] == dv * dtype.itemsize
               else np.ascontiguousarray(decays).reshape(lead + (dk * dv,))]
    for i, (kappa, x) in enumerate(writes):
        ops += [operand(kappa, dtype, lead + (dk,), f"write {i}: key"), operand(x, dtype, lead + (dv,), f"write {i}: value")]
    ops += [operand(q, dtype, lead + (dk,), f"readout {i}: query") for i, (q, _) in enumerate(readouts)]
    state = np.ascontiguousarray(s0, dtype=dtype)
    outs = [np.empty(lead + (dv,), dtype) for _ in readouts]
    if batch * heads == 0 or tokens == 0:
        return outs, state.copy()
    s = Structure(len(writes), tuple(bool(b) for _, b in readouts), bool(causal), dk, dv, CTYPES[dtype], columns)
    chunk = chunk_of(chunk_size, tokens)
    work = batch * heads * tokens * dk * dv * (len(readouts) * (1 + SUB_BLOCK // 2) + len(writes) + 2)
    if form == "parallel":
        return outs, call(kernel(s), "lr_elementwise_parallel", state, ops, outs, work, num_threads)
    return outs, call(kernel(s), "lr_elementwise_chunkwise", state, ops, outs, work, num_threads, chunk)

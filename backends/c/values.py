"""The parallel and chunkwise forms in C of a vector state read as a value of its own (`z*sigmoid(g)`,
`output y = z`: HGRN- and RG-LRU-style recurrences), from templates/c_values.c.j2.

c_scan's kernels compute readouts q·S; a read with no query (compiler.decompose.Readout.is_value) is the
elementwise twin of those, numpy_scan.decayed_values, and runs here. c_scan.scan hands such readouts over,
so the generated NumPy module of a form calls the same chunkwise_scan / parallel_scan either way. A kernel
is specialized per decay (none, one per token, one per channel), number of writes, readouts (before or
after the update), causality, size D and dtype — the chunk is an argument —, and built once through c_build.

    outs, final = c_values.scan("chunkwise", s0, log_decay, writes, [False], causal=True, chunk_size=64)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dsl.errors import LinrecError, RuntimeInputError

from .build import CTYPES
from .scan_kernels import FORMS, cached_kernel, call, chunk_of, operand
from ..version import VERSION
from ..templating import environment

SUB_BLOCK = 16  # query tokens per block


@dataclass(frozen=True)
class Structure:
    """Everything one kernel is specialized for."""

    decay: str                 # "none", "token" (one log-decay per token) or "row" (one per channel)
    writes: int                # writes (κ, x), x one number per token
    before: tuple[bool, ...]   # per readout: reads the state before the update
    causal: bool
    d: int                     # channels of the state
    ctype: str                 # "float" or "double"

    def describe(self) -> str:
        decay = {"none": "no decay", "token": "one log-decay per token", "row": "one log-decay per channel"}
        reads = ", ".join("before" if b else "after" for b in self.before) or "none"
        return (f"a vector state read as it is; {decay[self.decay]}; {self.writes} write(s); readouts: {reads}; "
                f"{'causal' if self.causal else 'non-causal'}; d = {self.d}, {self.ctype}")


def render(s: Structure, form: str | None = None) -> str:
    """The C source of one kernel."""
    return environment(__package__).get_template("c_values.c.j2").render(
        version=VERSION, title=f"the {form} form" if form else "the parallel and chunkwise forms",
        description=s.describe(), ctype=s.ctype, d=s.d, db={"none": 0, "token": 1, "row": s.d}[s.decay],
        writes=s.writes, readouts=len(s.before), causal=s.causal, sb=SUB_BLOCK,
        before=", ".join("1" if b else "0" for b in s.before))


def cdef(s: Structure) -> str:
    t = s.ctype
    args = f"(const {t} *s0, {t} *sT, {t} **in, const int64_t *st, {t} **out, int B, int ntok, int H, int nthreads"
    return f"int lr_values_chunkwise{args}, int chunk);\nint lr_values_parallel{args});\n"


def kernel(s: Structure):
    """The built extension (ffi, lib) for a structure: memoized, else from the disk cache, else built."""
    return cached_kernel(s, "values", f"values_{s.decay}_w{s.writes}_{s.ctype}", lambda: render(s), cdef(s))


def scan(form: str, s0, log_decay, writes, before, causal=True, chunk_size=None, num_threads=None):
    """The reads of a vector state s0 [B, H, d, 1] as it is, for readouts `before` (True: before the update);
    log_decay None or [B, T, H, 1 | d], writes [(κ [B, T, H, d], x [B, T, H, 1])]. Returns ([read [B, T, H, d]],
    final state [B, H, d, 1]) in the working dtype of the writes, else of s0 (float32, else float64)."""
    if form not in FORMS:
        raise LinrecError(f"unknown scan form {form!r}; choose parallel or chunkwise")
    s0 = np.asarray(s0)
    if s0.ndim != 4 or s0.shape[-1] != 1:
        raise RuntimeInputError(f"a vector state read as it is should arrive as [B, H, d, 1], got {list(s0.shape)}")
    values = [np.asarray(a) for pair in writes for a in pair]
    if not values and log_decay is None:
        raise LinrecError("nothing to scan: no log-decay and no writes")
    # the working dtype is the writes' (a state that only decays: its own)
    working = np.result_type(*values) if values else s0.dtype
    dtype = np.dtype(np.float32) if working == np.float32 else np.dtype(np.float64)
    batch, tokens, heads = (values[0] if values else np.asarray(log_decay)).shape[:3]
    d = int(s0.shape[2])
    if s0.shape[:2] != (batch, heads):
        raise RuntimeInputError(f"the initial state should have shape [B, H, d, 1] = [{batch}, {heads}, {d}, 1], got "
                                f"{list(s0.shape)}")
    lead = (batch, tokens, heads)
    ops = []
    decay = "none"
    if log_decay is not None:
        width = np.shape(log_decay)[-1]
        if width not in (1, d):
            raise RuntimeInputError(f"the log-decay should have shape [B, T, H, 1 or d = {d}], got "
                                    f"{list(np.shape(log_decay))}")
        decay = "token" if width == 1 else "row"
        ops.append(operand(log_decay, dtype, lead + (width,), "the log-decay"))
    for i, (kappa, x) in enumerate(writes):
        ops += [operand(kappa, dtype, lead + (d,), f"write {i}: key"),
                operand(x, dtype, lead + (1,), f"write {i}: value")]
    state = np.ascontiguousarray(s0[..., 0], dtype=dtype)
    outs = [np.empty(lead + (d,), dtype) for _ in before]
    if batch * heads == 0 or tokens == 0:
        return outs, state[..., None].copy()
    s = Structure(decay, len(writes), tuple(bool(b) for b in before), bool(causal), d, CTYPES[dtype])
    chunk = chunk_of(chunk_size, tokens)
    # the parallel form's work grows with T², the chunkwise form's with T·chunk
    work = batch * heads * tokens * d * (tokens if form == "parallel" else chunk)
    if form == "parallel":
        final = call(kernel(s), "lr_values_parallel", state, ops, outs, work, num_threads)
    else:
        final = call(kernel(s), "lr_values_chunkwise", state, ops, outs, work, num_threads, chunk)
    return outs, final[..., None]

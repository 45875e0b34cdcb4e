"""The chunkwise and parallel backward's kernels in C (templates/c_grad_chunk.c.j2): what the C backend's
generated parallel and chunkwise backward (c.grad_chunk) calls for each state, where the NumPy one calls
linrec.numpy.adjoint_scan's decay_scan and decay_scan_backward — the same arguments and results:

    readouts, final, starts = chunk_checkpoints(s0, log_decay, writes, queries, chunk, corrections=())
    grads = adjoint_chunkwise(s0, log_decay, writes, queries, starts, chunk, grad_readouts, grad_final,
                              corrections=())                                          # a ScanGrads

s0 [B, H, K, V]; log_decay None (no decay) or [B, T, H, 1 | K]; writes [(key, value)], corrections [(u, w)]
and queries [(q, before_update)] per token [B, T, H, n] (a u, w or key of adjoint_chunkwise may be factored:
c.scaled_keys). chunk_checkpoints is the recurrent backward's C
forward (grad_kernels.adjoint_checkpoints), keeping the state before each chunk ([B, H, ⌈T/chunk⌉, K, V]);
adjoint_chunkwise runs the chunks from the last, each in sub-chunks of sub_chunk() tokens whose states it
recomputes from the chunk's (see the template). A parallel backward is one chunk of the whole sequence. The
arithmetic is in the initial state's dtype; a kernel is specialized per structure (decay none, per token or
per row; the numbers of corrections, writes and readouts, which readouts read the state before the update),
per size and per dtype, built once through c_build and memoized.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..dsl.errors import LinrecError, RuntimeInputError
from ..numpy.adjoint_scan import ScanGrads
from ..numpy.scan import raise_to_reset
from ..templating import environment
from ..version import VERSION
from . import grad_calls, grad_kernels
from . import scan as c_scan
from .build import CTYPES
from .scan_kernels import cached_kernel, call, chunk_of, operand


def sub_chunk(s: "Structure") -> int:
    """Tokens of a sub-chunk (a multiple of every register width: c_gemm's N): 32, or 16 where corrections
    double the pairs of arrays whose products within a sub-chunk grow with its square (measured: each the
    faster at dk = dv = 64 and 128)."""
    return 16 if s.corrections else 32


@dataclass(frozen=True)
class Structure(grad_kernels.Structure):
    """What one kernel is specialized for: the recurrent backward's structure (grad_kernels.Structure), a
    kernel of its own."""


def render(s: Structure) -> str:
    """The C source of one kernel."""
    lanes = s.lanes
    return environment(__package__).get_template("c_grad_chunk.c.j2").render(
        version=VERSION, description=s.describe(), ctype=s.ctype, vector_bytes=s.vector_bytes, lanes=lanes,
        dk=s.dk, dv=s.dv, dkp=-(-s.dk // lanes) * lanes, dvp=-(-s.dv // lanes) * lanes, sb=sub_chunk(s),
        decay=grad_kernels.DECAYS.index(s.decay), db=s.dk if s.decay == "row" else 1,
        corrections=s.corrections, writes=s.writes, readouts=len(s.before),
        qprev=", ".join(["1"] * s.corrections + ["1" if b else "0" for b in s.before]),
        widths=", ".join(map(str, s.widths + [s.dv] * len(s.before))), n_inputs=len(s.widths) + len(s.before),
        nb=c_scan.tile_registers(s.vector_bytes), tile_rows=c_scan.tile_rows(s.vector_bytes), gemm_transposed=True,
        read_scales=", ".join(map(repr, s.factors)), **grad_kernels.factoring(s))


def cdef(s: Structure) -> str:
    t = s.ctype
    return (f"int lr_chunk_backward(const {t} *gT, {t} *ds0, {t} **in, const int64_t *st, {t} **out, int B, "
            f"int ntok, int H, int nthreads, const {t} *starts, int chunk, double span_max);\n")


def kernel(s: Structure):
    """The built extension (ffi, lib) for a structure."""
    label = f"grad_chunk_{s.decay}_r{s.corrections}_w{s.writes}_{s.ctype}"
    return cached_kernel(s, "grad_chunk", label, lambda: render(s), cdef(s))


def chunk_checkpoints(s0, log_decay, writes, queries, chunk, corrections=(), num_threads=None):
    """The forward: ([readout [B, T, H, V]], final state [B, H, K, V], the state before each chunk
    [B, H, ⌈T/chunk⌉, K, V]) — decay_scan's. It is the recurrent backward's forward (grad_kernels: the
    update token by token, a column block of the state at a time, keeping the state every `chunk` tokens):
    O(T) for the parallel backward's one chunk too, where a chunkwise forward over one chunk is O(T²). Resets
    (log-decays of −∞) run raised, as in adjoint_chunkwise."""
    return grad_kernels.adjoint_checkpoints(s0, raise_to_reset(log_decay), writes, queries, chunk, corrections,
                                            num_threads)


def adjoint_chunkwise(s0, log_decay, writes, queries, starts, chunk, grad_readouts, grad_final, corrections=(),
                      num_threads=None, read_scales=()) -> ScanGrads:
    """The backward, as decay_scan_backward's (ScanGrads; log_decay None where the state does not decay), from
    the readouts' gradients [B, T, H, V] and the final state's (None: zero); starts and chunk as
    chunk_checkpoints gives and takes them. Resets (log-decays of −∞, which the pairwise factors would take as
    −∞ − (−∞)) run raised to RESET_LOG_DECAY, their gradients 0 (ScanGrads.at_resets). read_scales: per readout,
    the constant factor of its query, which the kernel applies to its upstream gradient as it reads it (as
    grad_kernels.adjoint_recurrent's)."""
    given, log_decay = log_decay, raise_to_reset(log_decay)
    c = grad_kernels._prepare(s0, log_decay, corrections, writes, queries, read_scales)
    if c.structure.normalized:  # (c.normalized_rows: only the recurrent backward with corrections takes them)
        raise LinrecError("the chunk kernels do not normalize rows themselves: give them l2norm's arrays")
    s = Structure(**{f.name: getattr(c.structure, f.name) for f in dataclasses.fields(grad_kernels.Structure)})
    batch, tokens, heads = c.lead
    dtype = c.state.dtype
    grads = [operand(g, dtype, c.lead + (s.dv,), f"the gradient of readout {i}") for i, g in enumerate(grad_readouts)]
    outs = grad_calls.gradient_arrays(c.lead, s.widths, dtype, c.unwritten)
    final = np.zeros_like(c.state) if grad_final is None else np.ascontiguousarray(grad_final, dtype=dtype)
    if batch * heads == 0 or tokens == 0:
        d_s0 = final.copy()
        for o in outs:
            if o is not None:
                o[...] = 0
    else:
        k = kernel(s)
        chunk = chunk_of(chunk, tokens)
        starts = np.ascontiguousarray(starts, dtype=dtype)
        if starts.shape != (batch, heads, -(-tokens // chunk), s.dk, s.dv):
            raise RuntimeInputError(f"the states before each chunk have shape {list(starts.shape)}; "
                                    f"chunk_checkpoints gives them for chunk {chunk}")
        d_s0 = call(k, "lr_chunk_backward", final, c.ops + grads, outs, 6 * c.work, num_threads,
                    k.ffi.from_buffer(CTYPES[dtype] + " *", starts), chunk, c_scan.SPAN_MAX[s.ctype])
    return grad_kernels.call_grads(s, outs, d_s0, log_decay, corrections, writes, queries).at_resets(given)

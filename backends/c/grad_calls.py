"""What the recurrent backward's per-state kernels (c.grad_kernels, c.grad_elementwise, c.grad_value_side)
share: a call's arrays checked and in the kernel's order (Call), its segments (default_segment), the entry
points' declarations (cdef), and the kernels' forward (the readouts, the final state and the state before
every segment) and backward (the gradients of the per-token arrays and of the initial state) run over them —
each kernel's entry points taking c.scan_kernels.call's arguments, then the checkpoints and the segment
length."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dsl.errors import RuntimeInputError
from ..numpy.vjp import hand_over
from .buffers import RecycledArrays
from .build import CTYPES
from .scan_kernels import call, chunk_of, operand


# The backward keeps a segment's states (its tokens + 1) in a buffer per thread; by default a segment is √T
# tokens, fewer where that buffer would pass this many bytes (it then leaves the core's L2: a state of
# dk = dv = 128 in float32 is 64 KB, and √16384 = 128 of them 8 MB) — at the price of more checkpoints.
SEGMENT_BYTES = 2 << 20


# The checkpoints are the forward's scratch for the backward, never returned to the caller: the arrays of a call
# are reused by the next one of the same shape once the backward has dropped them (buffers.RecycledArrays). A
# fresh array pays a page fault and the zeroing of every page at its first touch — 68 MB at dk = dv = 128,
# T = 4096, B·H = 8: the kernel's forward took about twice as long with fresh checkpoints as with reused ones.
# The price: the CHECKPOINT_ARRAYS most recently made stay allocated while idle (a state's each; a program
# with more states than that reuses none of them).
CHECKPOINT_ARRAYS = 2
_checkpoints = RecycledArrays(keep=CHECKPOINT_ARRAYS)

# The gradients a backward kernel writes are the caller's, but once the caller has dropped them (a training
# step's gradients, consumed before the next step's) they are reused the same way, as a caching allocator would:
# a fresh array's page faults and zeroing took a twelfth of the recurrent backward's time at dk = dv = 64. The
# price: the GRADIENT_ARRAYS most recently made and dropped stay allocated while idle.
GRADIENT_ARRAYS = 12
_gradients = RecycledArrays(keep=GRADIENT_ARRAYS)


def gradient_arrays(lead: tuple[int, int, int], widths, dtype, unwritten=frozenset()) -> list[np.ndarray | None]:
    """The arrays a backward kernel writes the per-token gradients into, [B, T, H, n] for each width n (None for
    the indices in `unwritten`): recycled (_gradients), cache-line aligned, and handed over — the module's own to
    keep and write into, never the caller's, who gets them back only from this call. The kernel writes every
    value."""
    return [None if i in unwritten else gradient_array(lead + (n,), dtype) for i, n in enumerate(widths)]


def gradient_array(shape: tuple, dtype) -> np.ndarray:
    """One such array, of any shape (linrec.c.chain_rows' new arrays too): recycled, aligned and handed over."""
    return hand_over(_gradients.take(tuple(shape), dtype))


def default_segment(tokens: int, state_bytes: int) -> int:
    """Tokens per checkpoint when the call gives none: √T, at most what keeps a segment's states within
    SEGMENT_BYTES (at least 8)."""
    fits = max(8, SEGMENT_BYTES // max(state_bytes, 1) - 1)
    return max(1, min(int(round(tokens ** 0.5)), fits))


def cdef(prefix: str, ctype: str) -> str:
    """The declarations of a backward kernel's two entry points, {prefix}_forward and {prefix}_backward."""
    args = f"{ctype} **in, const int64_t *st, {ctype} **out, int B, int ntok, int H, int nthreads"
    return (f"int {prefix}_forward(const {ctype} *s0, {ctype} *sT, {args}, {ctype} *ckpt, int seg);\n"
            f"int {prefix}_backward(const {ctype} *gT, {ctype} *ds0, {args}, const {ctype} *ckpt, int seg);\n")


@dataclass(frozen=True)
class Call:
    """One state's arrays, checked and in the kernel's order, and its kernel's structure."""

    structure: object          # the kernel's Structure: its widths, per-token and per readout
    state: np.ndarray          # s0 [B, H, K, V], contiguous, in the working dtype
    ops: list[np.ndarray]      # the per-token arrays [B, T, H, n]
    lead: tuple[int, int, int]
    passes: int | None = None  # multiply-adds per state value and token (None: one per per-token array)
    # the ops whose gradients the kernel does not write (a key-side slot whose vector another slot holds, whose
    # gradient goes with that one's: c.scaled_keys): no array for them, None in the backward's results
    unwritten: frozenset = frozenset()

    @property
    def state_bytes(self) -> int:
        return int(np.prod(self.state.shape[2:])) * self.state.itemsize

    @property
    def work(self) -> int:
        """Multiply-adds of one pass, roughly (call() runs a small one on one thread)."""
        (batch, tokens, heads), (dk, dv) = self.lead, self.state.shape[2:]
        return batch * tokens * heads * dk * dv * (self.passes or len(self.structure.widths))

    def segments(self, chunk: int | None) -> tuple[int, int]:
        """(tokens per segment, segments): chunk (None: default_segment), clamped."""
        tokens = self.lead[1]
        seg = chunk_of(default_segment(tokens, self.state_bytes) if chunk is None else chunk, tokens)
        return seg, -(-tokens // seg)


def lead_and_state(s0, per_token: list) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The initial state in the working dtype (float32, else float64) and (B, T, H), checked."""
    s0 = np.asarray(s0)
    if not per_token or np.ndim(per_token[0]) < 4:
        raise RuntimeInputError("the recurrent backward's per-token arrays should have shape [B, T, H, n]")
    batch, tokens, heads = np.shape(per_token[0])[:3]
    if s0.ndim != 4 or s0.shape[:2] != (batch, heads):
        raise RuntimeInputError(f"the initial state should have shape [B, H, K, V] = [{batch}, {heads}, …], got "
                                f"{list(s0.shape)}")
    dtype = np.dtype(np.float32) if s0.dtype == np.float32 else np.dtype(np.float64)
    return np.ascontiguousarray(s0, dtype=dtype), (batch, tokens, heads)


def forward(c: Call, k, function: str, read_widths, chunk, num_threads):
    """A kernel's forward over a call: (readouts, final state, checkpoints)."""
    batch, tokens, heads = c.lead
    dk, dv = c.state.shape[2:]
    seg, nseg = c.segments(chunk)
    outs = [np.empty(c.lead + (n,), c.state.dtype) for n in read_widths]
    checkpoints = _checkpoints.take((batch, heads, nseg, dk, dv), c.state.dtype)
    if batch * heads == 0 or tokens == 0:
        return outs, c.state.copy(), checkpoints
    ckpt = k.ffi.from_buffer(CTYPES[c.state.dtype] + " *", checkpoints)
    final = call(k, function, c.state, c.ops, outs, c.work, num_threads, ckpt, seg)
    return outs, final, checkpoints


def backward(c: Call, k, function: str, read_widths, checkpoints, chunk, grad_readouts, grad_final, num_threads,
             given_outs=None):
    """A kernel's backward over a call: (the gradients of c.ops, in their order, and
    the initial state's). given_outs: {index of an op: the array its gradient goes to} where that is not
    [B, T, H, n] per token (c.factored_decay's rate: [B, H, K·V], summed over the tokens)."""
    batch, tokens, heads = c.lead
    dtype = c.state.dtype
    seg, _ = c.segments(chunk)
    grads = [operand(g, dtype, c.lead + (n,), f"the gradient of readout {i}")
             for i, (g, n) in enumerate(zip(grad_readouts, read_widths))]
    given_outs = given_outs or {}
    # (aligned: the kernel streams rows)
    outs = gradient_arrays(c.lead, c.structure.widths, dtype, c.unwritten | frozenset(given_outs))
    for i, array in given_outs.items():
        outs[i] = array
    final = np.zeros_like(c.state) if grad_final is None else np.ascontiguousarray(grad_final, dtype=dtype)
    if batch * heads == 0 or tokens == 0:
        for o in outs:
            if o is not None:
                o[...] = 0
        return outs, final.copy()
    ckpt = k.ffi.from_buffer(CTYPES[dtype] + " *", np.ascontiguousarray(checkpoints, dtype=dtype))
    return outs, call(k, function, final, c.ops + grads, outs, 3 * c.work, num_threads, ckpt, seg)

"""What the recurrent backward's per-state kernels of c.grad_elementwise and c.grad_value_side share: a call's
arrays checked and in the kernel's order (Call), its segments, and the kernels' forward (the readouts, the final
state and the state before every segment) and backward (the gradients of the per-token arrays and of the
initial state) run over them — each kernel's entry points taking c.scan_kernels.call's arguments, then the
checkpoints and the segment length."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dsl.errors import RuntimeInputError
from .build import CTYPES
from .grad_kernels import default_segment
from .scan_kernels import call, chunk_of, operand


@dataclass(frozen=True)
class Call:
    """One state's arrays, checked and in the kernel's order, and its kernel's structure."""

    structure: object          # the kernel's Structure: its widths, per-token and per readout
    state: np.ndarray          # s0 [B, H, K, V], contiguous, in the working dtype
    ops: list[np.ndarray]      # the per-token arrays [B, T, H, n]
    lead: tuple[int, int, int]

    @property
    def state_bytes(self) -> int:
        return int(np.prod(self.state.shape[2:])) * self.state.itemsize

    @property
    def work(self) -> int:
        """Multiply-adds of one pass, roughly (call() runs a small one on one thread)."""
        (batch, tokens, heads), (dk, dv) = self.lead, self.state.shape[2:]
        return batch * tokens * heads * dk * dv * len(self.structure.widths)

    def segments(self, chunk: int | None) -> tuple[int, int]:
        """(tokens per segment, segments): chunk (None: c.grad_kernels.default_segment), clamped."""
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
    checkpoints = np.empty((batch, heads, nseg, dk, dv), c.state.dtype)
    if batch * heads == 0 or tokens == 0:
        return outs, c.state.copy(), checkpoints
    ckpt = k.ffi.from_buffer(CTYPES[c.state.dtype] + " *", checkpoints)
    final = call(k, function, c.state, c.ops, outs, c.work, num_threads, ckpt, seg)
    return outs, final, checkpoints


def backward(c: Call, k, function: str, read_widths, checkpoints, chunk, grad_readouts, grad_final, num_threads):
    """A kernel's backward over a call: (the gradients of c.ops, in their order, and
    the initial state's)."""
    batch, tokens, heads = c.lead
    dtype = c.state.dtype
    seg, _ = c.segments(chunk)
    grads = [operand(g, dtype, c.lead + (n,), f"the gradient of readout {i}")
             for i, (g, n) in enumerate(zip(grad_readouts, read_widths))]
    outs = [np.empty(c.lead + (n,), dtype) for n in c.structure.widths]
    final = np.zeros_like(c.state) if grad_final is None else np.ascontiguousarray(grad_final, dtype=dtype)
    if batch * heads == 0 or tokens == 0:
        for o in outs:
            o[...] = 0
        return outs, final.copy()
    ckpt = k.ffi.from_buffer(CTYPES[dtype] + " *", np.ascontiguousarray(checkpoints, dtype=dtype))
    return outs, call(k, function, final, c.ops + grads, outs, 3 * c.work, num_threads, ckpt, seg)

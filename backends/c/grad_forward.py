"""The C backward's forward from the fused recurrent kernel (c.fused: the fastest forward), which writes the
state before each chunk as it passes it (CRecurrent.forward_snapshots) where the backward kernels read it
([B, H, n, K, V], `into`: no copy from the snapshots' [B, n, H, K, V]): the forward of the parallel and
chunkwise backward (c.grad_chunk) and of the recurrent one (c.grad: a chunk is then a segment between
checkpoints, which its kernels read in the same layout, c.grad_calls). Without it the backward runs the
recurrent backward kernels' own forward (grad_chunk_kernels.chunk_checkpoints, grad_scans.adjoint_checkpoints)
for the same states: the update token by token with every state's decay kept, two to five times the fused
kernel's time.

    fits(compiled)                     whether the fused kernel takes the program as the backward needs it
    FusedForward(compiled)(inputs, params, initial_state, dims, chunk)
                                       (outputs, final states, the state before each chunk by name,
                                        [B, H, ⌈T/chunk⌉, K, V] as chunk_checkpoints gives them), or None
                                        for a call below MIN_WORK (the module then runs its own forward)

The generated module calls it as `fused_forward` (linrec.numpy.adjoint_derived.DecomposedEmitter.fused_forward)
where its chain rule reads no readout's value (the fused kernel gives the outputs, not the readouts q·S).
"""
from __future__ import annotations

import numpy as np

from ..compiler import Compiled
from .backend import CRecurrent
from .buffers import RecycledArrays
from .scan_kernels import chunk_of
from .stabilize import Scales
from .support import fused_refusal


# State values updated over the call (B·T·H·K·V summed over the states) below which the module runs its own
# forward scans instead: there the fused kernel would save little and cost a build of its own for each size
# (the tests' small calls would build one per program, dtype and size).
MIN_WORK = 1 << 22

# The states before each chunk are the backward's scratch, dropped when it returns: reused by the next call of
# the same shape (buffers.RecycledArrays) rather than made anew, whose every page the system faults in and
# clears at first touch (34 MB at dk = dv = 128, T = 4096, B·H = 8). The price: the ARRAYS most recently made
# stay allocated while idle.
ARRAYS = 2
_starts = RecycledArrays(keep=ARRAYS)


def fits(compiled: Compiled) -> bool:
    """The fused kernel takes the program, and no state of it is stabilized (those come with a log-scale the
    chunk kernels do not take)."""
    return fused_refusal(compiled) is None and not Scales(compiled).groups


class FusedForward:
    """The forward of one program, with the state before each chunk."""

    def __init__(self, compiled: Compiled):
        self.recurrent = CRecurrent(compiled)
        self.states = compiled.program.states

    def __call__(self, inputs, params, initial_state, dims, chunk):
        batch, tokens, heads = next(iter(inputs.values())).shape[:3]
        states = [np.asarray(initial_state[st.name]) for st in self.states]
        if batch * tokens * sum(s[0].size for s in states) < MIN_WORK:
            return None
        chunk = chunk_of(chunk, tokens)
        stops = np.arange(chunk, tokens, chunk)  # the token counts at the chunks' starts, after the first
        dtype = np.asarray(inputs[self.recurrent.program.inputs[0].name]).dtype  # (the kernel's)
        starts = {st.name: _starts.take((batch, heads, len(stops) + 1) + s0.shape[2:], dtype)
                  for st, s0 in zip(self.states, states)}
        for st, s0 in zip(self.states, states):
            starts[st.name][:, :, 0] = s0
        if len(stops):  # (the kernel writes the state at each stop in its place: starts[…][:, :, 1:])
            outputs, final, _ = self.recurrent.forward_snapshots(inputs, params, initial_state, dims, stops,
                                                                 into=starts)
        else:
            outputs, final = self.recurrent.forward(inputs, params, initial_state, dims)
        return outputs, final, starts

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

A training step runs the forward, then the backward, which would run the same forward again. The forward can
be kept for it instead (linrec.torch does; gradients.saved_forward and vjp(saved=…)):

    with capturing() as kept: module.backward(…)   the module's own forward, stopped once it has run:
                                                    kept.result is a Saved (or None below MIN_WORK)
    with reusing(saved): module.backward(…)         the backward, whose fused_forward gives `saved` where
                                                    its arrays fit the call (else it runs as ever)

Saved holds the outputs, the final states and one flat array of every state's states before each chunk
(layout: each state's [B, H, n, K, V] in turn, from a cache line), so that it travels as one tensor.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

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
# The states kept for a later backward (capturing: a training step's) are recycled the same way, once their
# backward has dropped them — a fresh 32 MB array each step (dk = dv = 128, T = 4096, B·H = 8) cost more in page
# faults than the forward it saves. A model holds one per layer until its backward: KEPT_ARRAYS layers of one
# shape reuse theirs, and as many arrays stay allocated while idle.
KEPT_ARRAYS = 8
_kept = RecycledArrays(keep=KEPT_ARRAYS)


@dataclass
class Saved:
    """A forward kept for its backward: outputs and final states by name, and `flat`, every state's states
    before each chunk in one 1-D array (starts_layout)."""

    outputs: dict
    final_state: dict
    flat: np.ndarray


class _Kept:
    """What capturing() found: the forward's Saved, or None (a call below MIN_WORK keeps nothing)."""

    result: Saved | None = None


class _Stopped(Exception):
    """The module's backward stopped after its forward (capturing)."""


_CAPTURE: ContextVar[_Kept | None] = ContextVar("linrec_capture_forward", default=None)
_REUSE: ContextVar[Saved | None] = ContextVar("linrec_reuse_forward", default=None)


@contextmanager
def capturing():
    """Run a generated backward's forward only: its fused_forward keeps what it computes and stops the module
    there (the rest, the adjoint, is the backward's, for later)."""
    kept = _Kept()
    token = _CAPTURE.set(kept)
    try:
        yield kept
    except _Stopped:
        pass
    finally:
        _CAPTURE.reset(token)


@contextmanager
def reusing(saved: Saved | None):
    """Run a generated backward on a kept forward: its fused_forward gives `saved` where it fits the call."""
    token = _REUSE.set(saved)
    try:
        yield
    finally:
        _REUSE.reset(token)


def starts_layout(shapes: list[tuple[int, ...]], dtype) -> tuple[list[int], int]:
    """Where each state's [B, H, n, K, V] starts in the flat array (in elements, each from a cache line, as
    the kernels' state buffers are), and the flat array's length."""
    line = 64 // np.dtype(dtype).itemsize
    offsets, total = [], 0
    for shape in shapes:
        offsets.append(total)
        total += -(-int(np.prod(shape)) // line) * line
    return offsets, total


def fits(compiled: Compiled) -> bool:
    """The fused kernel takes the program, and no state of it is stabilized (those come with a log-scale the
    chunk kernels do not take)."""
    return fused_refusal(compiled) is None and not Scales(compiled).groups


def attach(module, compiled: Compiled) -> None:
    """Give a loaded C backward module the fused kernel as its `fused_forward`, where the kernel takes the program
    and the module's code calls it (it defines the function only then; RetNet's, whose chain rule reads its
    readouts, does not)."""
    if fits(compiled) and hasattr(module, "fused_forward"):
        module.fused_forward = FusedForward(compiled)


class FusedForward:
    """The forward of one program, with the state before each chunk."""

    def __init__(self, compiled: Compiled):
        self.recurrent = CRecurrent(compiled)
        self.states = compiled.program.states

    def __call__(self, inputs, params, initial_state, dims, chunk):
        batch, tokens, heads = next(iter(inputs.values())).shape[:3]
        states = [np.asarray(initial_state[st.name]) for st in self.states]
        kept = _CAPTURE.get()
        if batch * tokens * sum(s[0].size for s in states) < MIN_WORK:
            if kept is not None:
                raise _Stopped
            return None
        chunk = chunk_of(chunk, tokens)
        stops = np.arange(chunk, tokens, chunk)  # the token counts at the chunks' starts, after the first
        dtype = np.asarray(inputs[self.recurrent.program.inputs[0].name]).dtype  # (the kernel's)
        shapes = [(batch, heads, len(stops) + 1) + s0.shape[2:] for s0 in states]
        saved = _REUSE.get()
        if saved is not None:
            found = self._reused(saved, shapes, dtype)
            if found is not None:
                return found
        if kept is not None:  # (one array of them all, kept: the recycled ones are the next call's)
            flat = _kept.take((starts_layout(shapes, dtype)[1],), dtype)
            starts = self._carved(flat, shapes)
        else:
            starts = {st.name: _starts.take(shape, dtype) for st, shape in zip(self.states, shapes)}
        for st, s0 in zip(self.states, states):
            starts[st.name][:, :, 0] = s0
        if len(stops):  # (the kernel writes the state at each stop in its place: starts[…][:, :, 1:])
            outputs, final, _ = self.recurrent.forward_snapshots(inputs, params, initial_state, dims, stops,
                                                                 into=starts)
        else:
            outputs, final = self.recurrent.forward(inputs, params, initial_state, dims)
        if kept is not None:
            kept.result = Saved(outputs, final, flat)
            raise _Stopped
        return outputs, final, starts

    def _reused(self, saved: Saved, shapes: list, dtype) -> tuple | None:
        """(outputs, final states, starts) from a kept forward, read-only (the backward's own arrays are its
        to overwrite; these are the caller's), or None where it does not fit this call (another chunk, size
        or dtype: then the forward runs again)."""
        flat = saved.flat
        if flat.dtype != dtype or flat.shape != (starts_layout(shapes, dtype)[1],) or \
                {st.name for st in self.states} != set(saved.final_state):
            return None
        return ({k: _read_only(v) for k, v in saved.outputs.items()},
                {k: _read_only(v) for k, v in saved.final_state.items()},
                {k: _read_only(v) for k, v in self._carved(flat, shapes).items()})

    def _carved(self, flat: np.ndarray, shapes: list) -> dict:
        """Each state's states before each chunk, [B, H, n, K, V] by name: views of the flat array
        (starts_layout)."""
        offsets, _ = starts_layout(shapes, flat.dtype)
        return {st.name: flat[o:o + int(np.prod(shape))].reshape(shape)
                for st, o, shape in zip(self.states, offsets, shapes)}


def _read_only(array) -> np.ndarray:
    view = np.asarray(array).view()
    view.flags.writeable = False
    return view

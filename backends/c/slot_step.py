"""The C decode step over a pool of states (lr_step_slots, the fused kernel's): the tokens of N requests
[N, H, *] advance the rows slots[·] of the pool's arrays [P, H, *] in place — one call for every request
and head, threaded across them, each state read and written once where it lies, no other row touched.

    step = SlotStep(form, params, dims)          # form: c.backend.CRecurrent, params as the decode step's
    outputs = step(token_inputs, pool, slots)    # slots: distinct int64 rows in [0, P), checked by the caller

The caller (linrec.slot_pool) checks the slots' values, the pool's names, shapes and dtype, and the
tokens' value ranges before it calls; here the arrays are taken as the kernel reads them (tokens converted
to C-contiguous arrays of the dtype, the pool's own arrays, which must be C-contiguous: `takes` says)."""
from __future__ import annotations

import numpy as np

from .. import arrays
from ..dsl.errors import RuntimeInputError
from . import build as c_build
from .buffers import checked, require_c_int_sizes
from .step import RecurrentForm


class SlotStep:
    """lr_step_slots bound to one set of params and sizes (a kernel per dtype, built when first used)."""

    def __init__(self, form: RecurrentForm, params: dict, dims: dict, state_is_bf16: bool = False):
        self.form = form
        self.state_is_bf16 = state_is_bf16  # the pool's states are uint16 arrays of bfloat16 bits
        self.params = params
        self.dims = {d.name: int(dims[d.name]) for d in form.program.dims}

    @staticmethod
    def takes(pool: dict) -> bool:
        """Whether the kernel can work on the pool's arrays where they lie (C-contiguous ones)."""
        return all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in pool.values())

    def outputs(self, token_inputs: dict, out: dict | None) -> dict:
        """The output arrays [N, H, *] a step on these tokens writes: out's, checked, or new ones (what a
        bound step checks once and reuses)."""
        first = arrays.native(np.asarray(token_inputs[self.form.program.inputs[0].name]))
        dims = self.form.kernel(first.dtype, self.dims, self.state_is_bf16).dims
        return self._outputs(first.shape[0], first.shape[1], first.dtype, dims, out)

    def _outputs(self, requests: int, heads: int, dtype, dims: dict, out: dict | None) -> dict:
        """(the decode step's: requests are its batch rows)"""
        shape = arrays.CallShape(requests, 1, heads, dims, np.dtype(dtype))
        return arrays.token_outputs(self.form.program, out, shape, dims)

    def __call__(self, token_inputs: dict, pool: dict, slots: np.ndarray, out: dict | None = None) -> dict:
        p = self.form.program
        first = arrays.native(np.asarray(token_inputs[p.inputs[0].name]))  # (>f8: converted by checked() below)
        dtype, (requests, heads) = first.dtype, first.shape[:2]
        require_c_int_sizes(batch=requests, heads=heads)
        k = self.form.kernel(dtype, self.dims, self.state_is_bf16)
        dims = k.dims
        fb, ptr = k.ffi.from_buffer, k.ptr
        keep = []  # (the arrays whose buffers the call reads: alive until it returns)
        for x in p.inputs:
            keep.append(checked(token_inputs[x.name], (requests, heads) + tuple(dims[d] for d in x.shape), dtype,
                                f"input '{x.name}'"))
        for prm in p.params:
            shape = ((heads,) if prm.per_head else ()) + tuple(dims[d] for d in prm.shape)
            keep.append(np.ascontiguousarray(checked(self.params[prm.name], shape, None, f"parameter '{prm.name}'"),
                                             dtype=dtype))
        states = [pool[s.name] for s in p.states]
        keep += [pool[key] for key, _ in self.form.scales]
        outputs = self._outputs(requests, heads, dtype, dims, out)
        keep += list(outputs.values())
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        state_ptr = "uint16_t[]" if self.state_is_bf16 else ptr
        n_read = len(p.inputs) + len(p.params)
        pointers = [fb(ptr, a) for a in keep[:n_read]] + [fb(state_ptr, a) for a in states] \
            + [fb(ptr, a) for a in keep[n_read:]]
        rc = k.lib.lr_step_slots(*pointers, fb("int64_t[]", slots), requests, heads, c_build.num_threads())
        if rc == 2:  # an input outside its declared range (a bound step's refilled token): say which
            arrays.check_ranges(p, {k: np.asarray(v) for k, v in token_inputs.items()})
            raise RuntimeInputError("an input lies outside its declared range")  # (the scan names it)
        if rc:
            raise MemoryError("the C decode step could not allocate its scratch buffer")
        return outputs

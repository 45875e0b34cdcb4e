"""Arrays at any alignment the C kernels take: NumPy gives a view one or two elements past a 64-byte boundary as
readily as an aligned array, and a kernel may assume no more than its element's alignment of what the caller
passes. Fuzz seed 62 found the C backward's forward (c_grad.c.j2) copying a token's rows with memcpy of 32 bytes,
which GCC 12 folded into one wide access and, vectorizing over tokens, loaded as an aligned vector: a segmentation
fault on rows 16 bytes past a 32-byte boundary (dk = 1, dv = 4, three writes, float64, one batch row and head).
Every form's forward and backward on C, the inputs and upstream gradients shifted by one and two elements, with
results those of aligned copies (within 1e-12 in float64 and 1e-5 in float32 of the largest: the same kernels)."""
from __future__ import annotations

import numpy as np
import pytest

import linrec

PROGRAMS = {
    # three writes to a state no output reads, a key of one value: the fuzz finding
    "writes": "recurrence writes(dk = 1, dv = 4)\ninput q[dk], k[dk], v[dv]\nstate S[dk, dv]\n"
              "S = S + k⊗v + q⊗v + sigmoid(k)⊗v\noutput o = sum(v)\n",
    "decayed": "recurrence decayed(dk = 2, dv = 4)\ninput q[dk], k[dk], v[dv], g[dk] <= 0\nstate S[dk, dv]\n"
               "S = diag(exp(g))·S + k⊗v + q⊗v + sigmoid(k)⊗v\noutput o = q·S\n",
    "delta": "recurrence delta(dk = 4, dv = 4)\ninput q[dk], k[dk], v[dv], beta in (0, 1)\nstate S[dk, dv]\n"
             "S = (I − beta·k⊗k)·S + beta·k⊗v\noutput o = q·S\n",
}


def shifted(a: np.ndarray, by: int) -> np.ndarray:
    """a copy of a that starts `by` elements past a 64-byte boundary"""
    buf = np.empty(a.size + 32, a.dtype)
    start = (-(buf.ctypes.data // a.itemsize)) % (64 // a.itemsize) + by
    view = buf[start:start + a.size].reshape(a.shape)
    view[...] = a
    return view


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_every_form_takes_arrays_off_their_vectors_alignment(name, dtype):
    rec = linrec.compile(PROGRAMS[name], f"{name}.lin")
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for tokens, batch, heads in ((8, 1, 1), (12, 1, 1), (33, 2, 3)):
        x = rec.random_inputs(batch, tokens, heads, dtype=dtype, seed=0)
        up = {k: np.ones_like(v) for k, v in rec.run(x, form="recurrent", backend="c").outputs.items()}
        for form in ("recurrent", "parallel", "chunkwise"):
            for chunk in (None, tokens):
                want = rec.vjp(x, up, form=form, backend="c", chunk_size=chunk)
                for by in (1, 2):
                    got = rec.vjp({k: shifted(v, by) for k, v in x.items()}, {k: shifted(v, by) for k, v in up.items()},
                                  form=form, backend="c", chunk_size=chunk)
                    for what, a, b in [(f"∂{k}", got.grads[k], want.grads[k]) for k in want.grads] + \
                            [(k, got.outputs[k], want.outputs[k]) for k in want.outputs]:
                        scale = max(float(np.max(np.abs(b))), 1e-30)
                        assert np.max(np.abs(a - b)) <= tol * scale, f"{form}, {what}, shifted by {by}"

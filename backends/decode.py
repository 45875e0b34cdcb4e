"""Run a whole sequence one token at a time through the decode step (`linrec run --form step`).

    res = run_by_steps(rec, inputs, backend="c")     # like rec.run(inputs, form="recurrent", backend="c")

It carries the state between `Recurrence.step` calls (updated in place), so it checks that prefill → step →
step … gives what the sequence forms give. It is the decode loop written out, not a fast way to run a
sequence: use the recurrent or chunkwise form for that.
"""
from __future__ import annotations

import numpy as np

from dsl.errors import LinrecError

from . import arrays


def run_by_steps(rec, inputs: dict, backend: str = "numpy", params: dict | None = None,
                 initial_state: dict | None = None):
    """Inputs [B, T, H, *] by DSL name; initial states [B, H, *] (zeros when absent); params override the
    file's defaults. Returns an api.Result: outputs [B, T, H, *], final states [B, H, *], params used."""
    from .api import BACKENDS, Result

    program = rec.program
    if _reads_the_sequence(program):
        raise LinrecError(f"'{program.name}' reads other tokens directly (seq, lsh_attention, or a parameter over "
                          f"the sequence axis): it has no recurrent state for a decode step to carry; use its "
                          f"{' or '.join(rec.forms)} form")
    if backend not in BACKENDS:
        raise LinrecError(f"unknown backend '{backend}'; choose one of {', '.join(BACKENDS)}")
    if not program.causal:
        raise LinrecError(f"'{program.name}' is non-causal: every output reads the final state, so it has no "
                          f"token-by-token decode step; use the recurrent, parallel or chunkwise form")
    # the same checks and parameter defaults as Recurrence.run, once for the whole sequence
    checked, shape = arrays.check_inputs(program, dict(inputs))
    module = rec.module("recurrent", backend)
    user = dict(params or {})
    dims = arrays.resolve_dims(program, shape, user)
    names = {p.name for p in program.params}
    given_f64 = {k: np.asarray(v, dtype=np.float64) for k, v in user.items() if k in names}
    defaults = {k: v for k, v in module.default_params(shape.heads, dims, given_f64).items() if k not in user}
    used = arrays.check_params(program, user, defaults, shape, dims)
    state = arrays.check_initial_state(program, initial_state, shape, dims)  # fresh C-contiguous copies
    state = {k: np.ascontiguousarray(v) for k, v in state.items()}

    outputs: dict[str, np.ndarray] = {}
    for t in range(shape.tokens):
        token = {k: np.ascontiguousarray(v[:, t]) for k, v in checked.items()}
        out, state = rec.step(token, state, backend=backend, params=used, inplace=True)
        if not outputs:
            outputs = {k: np.empty((shape.batch, shape.tokens) + v.shape[1:], dtype=v.dtype) for k, v in out.items()}
        for k, v in out.items():
            outputs[k][:, t] = v
    # every state is a fresh copy owned by this call: hand it back as the final state
    return Result(outputs, {k: np.asarray(v) for k, v in state.items()}, used)


def _reads_the_sequence(program) -> bool:
    """A sequence-level program (softmax attention and relatives): a step sees one token only."""
    try:
        from compiler.sequence import is_sequence_program
    except ImportError:  # a compiler without sequence-level programs
        return False
    return is_sequence_program(program)

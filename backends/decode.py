"""Run a whole sequence one token at a time through the decode step (`linrec run --form step`).

    res = run_by_steps(rec, inputs, backend="c")     # like rec.run(inputs, form="recurrent", backend="c")

It carries the state between `Recurrence.step` calls — the recurrent state, updated in place, or for a
program that reads the sequence (softmax attention …) its KV cache — so it checks that prefill → step →
step … gives what the sequence forms give. It is the decode loop written out, not a fast way to run a
sequence: use the recurrent or chunkwise form for that.
"""
from __future__ import annotations

import numpy as np

from . import arrays, bf16_state, registry
from .api import Result
from .compiler.stabilize import log_scale_keys
from .dsl.errors import LinrecError, RuntimeInputError
from .numpy.scan import rescale


def reads_the_sequence(rec) -> bool:
    """A program whose outputs read other tokens directly (seq, lsh_attention, params over the sequence
    axis): its decode state is a KV cache, not a fixed-size recurrent state."""
    return rec.decomposition.sequence is not None


def run_by_steps(rec, inputs: dict, backend: str = "numpy", params: dict | None = None,
                 initial_state: dict | None = None, state_dtype=None):
    """Inputs [B, T, H, *] by DSL name; initial states [B, H, *] (zeros when absent); params override the
    file's defaults. Returns an api.Result: outputs [B, T, H, *], final states [B, H, *], params used.
    state_dtype="bfloat16": the state is kept in bfloat16 between the steps (each token's rounded once), and
    the initial and final states are bfloat16 bits (uint16)."""
    program = rec.program
    registry.backend(backend)  # (an unknown name is an error)
    if not program.causal:
        raise LinrecError(f"'{program.name}' is non-causal: every output reads the final state, so it has no "
                          f"token-by-token decode step; use its {' or '.join(rec.forms)} form")
    sequence = reads_the_sequence(rec)
    if sequence and "recurrent" not in rec.forms:
        raise LinrecError(f"'{program.name}' has no recurrent form, so no decode step: "
                          f"{rec.decomposition.why_not('recurrent')}")
    # the same checks, sizes and parameters as Recurrence.run, once for the whole sequence
    checked, shape = arrays.check_inputs(program, dict(inputs))
    bits = bf16_state.resolve(state_dtype, checked) is not None
    if bits and sequence:  # (as step() refuses it: the KV cache stays the inputs' dtype, nothing is bfloat16)
        raise RuntimeInputError(bf16_state.kv_cache_refusal(program.name))
    if bits:
        initial_state = bf16_state.widen(program, initial_state, "initial state")
    module = rec.module("recurrent", backend if not sequence else "numpy")
    dims, used = rec.bind(module, shape, params, initial_state)
    if sequence:
        if initial_state:
            raise LinrecError(f"'{program.name}' has no recurrent state to start from (its decode state is the "
                              f"KV cache of the tokens so far)")
        state = None
    else:
        state = arrays.check_initial_state(program, initial_state, shape, dims)  # fresh copies, owned here
        state = {k: np.ascontiguousarray(v) for k, v in state.items()}
        if bits:
            state = bf16_state.narrow(program, state)

    outputs: dict[str, np.ndarray] = {}
    for t in range(shape.tokens):
        token = {k: np.ascontiguousarray(v[:, t]) for k, v in checked.items()}
        if sequence:
            out, state = rec.step(token, state, backend=backend, params=used)
        else:
            out, state = rec.step(token, state, backend=backend, params=used, inplace=True,
                                  state_dtype=state_dtype if bits else None)
        if not outputs:
            outputs = {k: np.empty((shape.batch, shape.tokens) + np.shape(v)[1:], dtype=np.asarray(v).dtype)
                       for k, v in out.items()}
        for k, v in out.items():
            outputs[k][:, t] = v
    # a recurrent state is a fresh copy owned by this call: hand it back as the final state, at its true scale
    # like the other forms'; a program that reads the sequence has none (its forms return none either)
    if bits:  # (at its true scale in float32, then bits again)
        final = bf16_state.narrow(program, at_true_scale(rec, bf16_state.widen(program, state)))
    else:
        final = {} if sequence else at_true_scale(rec, {k: np.asarray(v) for k, v in state.items()})
    return Result(outputs, final, used)


def at_true_scale(rec, state: dict) -> dict:
    """Stabilized states as the sequence forms return them: a state carried as S·exp(−m) between steps,
    with m at its "S.log_scale" key (NaN: at its true scale already), rescaled to m = 0, without the key."""
    keys = log_scale_keys(rec.compiled)
    out = {k: v for k, v in state.items() if k not in set(keys.values())}
    for name, key in keys.items():
        if key in state and name in out:
            s = out[name]
            vector = s.ndim == 3  # (rescale takes [B, H, rows, cols])
            s = rescale(s[..., None] if vector else s, state[key], None, s.dtype)
            out[name] = s[..., 0] if vector else s
    return out

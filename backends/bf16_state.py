"""States stored in bfloat16 between calls (state_dtype="bfloat16"), computed in float32 (docs/serving.md).

    res = rec.prefill(prompt, state_dtype="bfloat16")        # res.final_state["S"]: uint16, bfloat16 bits
    out, state = rec.step(token, res.final_state, state_dtype="bfloat16", inplace=True)

NumPy has no bfloat16 dtype: a bfloat16 state is a uint16 array of the bits (linrec.to_bfloat16 and
linrec.from_bfloat16 convert; arrays.py has them). The log-scales of stabilized states ("S.log_scale") are
not states: they stay in their float dtype. Where the backend's step keeps the states in bfloat16 itself
(capabilities.bfloat16_steps: the fused C kernel, which widens each head's state at the start of a call and
rounds it at the end), the step runs there; elsewhere (the NumPy backend, C's statement-by-statement kernel)
the states are widened to float32 here, the float32 step runs, and they are rounded back with the same
rounding. A prefill (run with initial_state and returned states) converts at its entry and exit.
"""
from __future__ import annotations

import numpy as np

from . import arrays
from .dsl.errors import RuntimeInputError


def inputs_dtype(given: dict) -> np.dtype:
    """The dtype of a call's first input (the one every input must share; checked with the rest later)."""
    for value in given.values():
        dtype = getattr(value, "dtype", None)
        return np.dtype(dtype) if dtype is not None else np.asarray(value).dtype
    raise RuntimeInputError("state_dtype needs the inputs, to know their dtype: pass them")


def resolve(state_dtype, given: dict) -> str | None:
    """arrays.check_state_dtype against the inputs' dtype: "bfloat16", or None (states in the inputs' dtype)."""
    if state_dtype is None:
        return None
    return arrays.check_state_dtype(state_dtype, inputs_dtype(given))


def kv_cache_refusal(name: str) -> str:
    """The message for a bfloat16 state asked of a program that reads the sequence (Recurrence.step,
    decode.run_by_steps): its decode state is the KV cache, kept in the inputs' dtype."""
    return (f"'{name}' reads the sequence: its decode state is a KV cache of the inputs, not a state to keep in "
            f"bfloat16; leave state_dtype out")


def no_state_refusal(name: str) -> str:
    """The message for a bfloat16 state asked of Recurrence.run on a program with no state (one that reads the
    sequence): as step() refuses it, rather than return what it would have without."""
    return f"'{name}' has no state: there is nothing to keep in bfloat16; leave state_dtype out"


def state_names(program) -> set[str]:
    return {s.name for s in program.states}


def widen(program, state: dict | None, what: str = "state") -> dict | None:
    """bfloat16 states (uint16 bits) → float32 arrays; other entries (log-scales) as they are."""
    if state is None:
        return None
    names = state_names(program)
    out = {}
    for key, value in state.items():
        if key in names:
            out[key] = arrays.from_bfloat16(arrays.bfloat16_bits(key, value, what))
        else:
            out[key] = value
    return out


def narrow(program, state: dict) -> dict:
    """float states → bfloat16 bits (uint16), rounded to nearest even; other entries as they are."""
    names = state_names(program)
    return {k: arrays.to_bfloat16(v) if k in names else v for k, v in state.items()}


def narrow_result(program, result):
    """A run's Result with its final states, checkpoints and last states in bfloat16 bits."""
    result.final_state = narrow(program, result.final_state)
    result.checkpoints = narrow(program, result.checkpoints)
    result.last_states = narrow(program, result.last_states)
    return result


def step_widened(rec, token_inputs: dict, state: dict | None, backend: str, params, inplace: bool,
                 out: dict | None) -> tuple[dict, dict]:
    """One token with bfloat16 states on a backend whose step has none: widened here, the float32 step,
    rounded back — into the given uint16 arrays with inplace=True (after the step has succeeded)."""
    if inplace and state is not None:
        _require_writeable_bits(rec.program, state, "to be updated in place (inplace=True)", every=False)
    # (the float32 step sees only widened copies: the given arrays are the ones written)
    arrays.refuse_shared_outputs(out, token_inputs, state, states_written=inplace)
    wide = widen(rec.program, state)
    outputs, final = rec.step(token_inputs, wide, backend=backend, params=params, inplace=False, out=out)
    final = narrow(rec.program, final)
    if inplace and state is not None:
        for key, value in final.items():
            if key in state and isinstance(state[key], np.ndarray) and state[key].shape == np.shape(value):
                state[key][...] = value
                final[key] = state[key]
            else:  # (a state not given, started from zeros, or a log-scale made here: the caller's dict gets it)
                state[key] = value
    return outputs, final


def _require_writeable_bits(program, state: dict, purpose: str, every: bool) -> None:
    """Each state of `state` (each of the program's, with every=True) a writeable uint16 array of bfloat16 bits,
    else an error saying so and what for."""
    for s in program.states:
        arr = state.get(s.name)
        if (arr is not None or every) and not (type(arr) is np.ndarray and arr.dtype == arrays.BFLOAT16_BITS
                                               and arr.flags.writeable):
            raise RuntimeInputError(f"state '{s.name}' must be a writeable uint16 array (bfloat16 bits) {purpose}")


def bind_widened(rec, token_inputs: dict, state: dict, backend: str, params, out: dict | None):
    """bind_step with bfloat16 states on a backend whose step has none: step() → outputs, each call widening
    the bound uint16 arrays, the float32 step and the rounding back into them."""
    _require_writeable_bits(rec.program, state, "to be bound: the step updates it in place every call", every=True)
    tokens, states = dict(token_inputs), dict(state)  # the arrays bound now
    buffers = dict(out) if out is not None else {}
    arrays.refuse_shared_outputs(buffers, tokens, states, states_written=True)

    def step():
        outputs, _ = step_widened(rec, tokens, states, backend, params, True, None)
        for name, value in outputs.items():
            if name in buffers:
                buffers[name][...] = value
            else:
                buffers[name] = value
        return buffers
    return step

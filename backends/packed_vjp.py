"""Recurrence.vjp with cu_seqlens: the gradient of packed variable-length sequences (flash-linear-attention's
varlen convention, as Recurrence.run takes it: serving.run_packed).

Inputs are one packed row [1, T_total, H, *], sequence i the tokens cu_seqlens[i] … cu_seqlens[i + 1] − 1;
initial states, final states and their gradients hold one row per sequence, [N, H, *]. No state crosses
from one sequence into the next, so the packed call is N independent ones: each sequence's backward runs on
its own tokens, from its own initial state, with its own final state's gradient, and the results are placed back —
inputs' gradients and outputs at the sequence's tokens, initial states' gradients and final states at its
row, params' gradients summed over the sequences. Sequences of one length run together, as the rows of one
batch [n, length, H, *] (one call per distinct length: packings of equal lengths cost a batch's time). An
empty sequence ends where it started: its final state is its initial one, and that state's gradient is its
final state's.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import arrays, gradients, serving
from .dsl.errors import RuntimeInputError


def vjp_packed(rec, inputs: dict, grad_outputs: dict | None, offsets: np.ndarray, *, form: str, backend: str,
               grad_final_state: dict | None, initial_state: dict | None, params: dict | None,
               dims: dict | None = None, missing: str = "error", **options) -> gradients.VjpResult:
    """Recurrence.vjp(…, cu_seqlens=offsets) (offsets as serving.check_cu_seqlens returns them); `options`:
    the rest of vjp's arguments, passed to each length's call. The arguments are checked whole first, so
    that an error gives the shapes the caller passed; one raised by a length's call says which sequences."""
    program = rec.program
    why = serving.why_not_packed(program, rec.decomposition.sequence)
    if why:
        raise RuntimeInputError(f"'{rec.name}' does not take cu_seqlens: {why}")
    checked, shape = arrays.check_inputs(program, arrays.by_name(inputs, "inputs"))
    serving.check_packed_call(offsets, shape.batch, shape.tokens)
    sequences = len(offsets) - 1
    serving.check_packed_states(initial_state, sequences)
    rows = replace(shape, batch=sequences)  # (the states' leading axis: one per sequence)
    sizes = arrays.resolve_dims(program, shape, dict(params or {}), initial_state, dims)
    state0 = arrays.check_initial_state(program, initial_state, rows, sizes)
    gradients.check_missing(missing)
    upstream = gradients.output_gradients(program, grad_outputs, shape, sizes, missing)
    finals_upstream = gradients.state_gradients(program, arrays.by_name(grad_final_state, "grad_final_state"), rows,
                                                sizes, rows_are="N")
    gradients.gradient_module(rec, form, backend)
    arrays.check_chunk_size(options.get("chunk_size"))  # (these two checked here: said of a length's call, an
    # error in them would seem to be the sequences')
    # only the states the caller passed go to each length's call, as zeros are what it takes for the others: an
    # initial state not passed is one whose gradient the caller only reads (gradients.vjp)
    passed = set(initial_state or {})
    lengths = np.diff(offsets)
    result = _empty_result(checked, upstream, state0, finals_upstream)
    for length in sorted(set(lengths.tolist()) - {0}):
        group = np.flatnonzero(lengths == length)
        tokens = offsets[group][:, None] + np.arange(length)  # [n, length]: each sequence's packed tokens
        try:
            ran = gradients.vjp(
                rec, {k: v[0, tokens] for k, v in checked.items()}, {k: v[0, tokens] for k, v in upstream.items()},
                grad_final_state={k: v[group] for k, v in finals_upstream.items()},
                initial_state={k: v[group] for k, v in state0.items() if k in passed}, params=params, dims=dims,
                missing=missing, form=form, backend=backend, **options)
        except RuntimeInputError as err:  # (its indices: a row of this group's batch, a token of that sequence)
            which = ", ".join(map(str, group.tolist()))
            raise RuntimeInputError(f"{err.message} — in the packed sequences of {length} tokens ({which} of "
                                    f"cu_seqlens, run as the rows of one batch: an index above is row b of them, "
                                    f"token t of its sequence, packed token cu_seqlens[sequence] + t)") from None
        _place(result, ran, group, tokens, program)
    return result


def _empty_result(inputs: dict, upstream: dict, state0: dict, finals_upstream: dict) -> gradients.VjpResult:
    """The packed call's result before any sequence has run: what an empty sequence leaves — its final state
    its initial one, whose gradient is its final state's (zero where none is given) — and zeros elsewhere."""
    dtype = next(iter(inputs.values())).dtype
    grads = {k: np.zeros_like(v) for k, v in inputs.items()}
    for name, s0 in state0.items():
        grads[name] = np.array(finals_upstream[name], dtype) if name in finals_upstream else np.zeros_like(s0)
    outputs = {k: np.zeros_like(v) for k, v in upstream.items()}
    final = {k: np.array(v) for k, v in state0.items()}
    return gradients.VjpResult(outputs, final, grads, {})


def _place(result: gradients.VjpResult, ran: gradients.VjpResult, group: np.ndarray, tokens: np.ndarray,
           program) -> None:
    """One length's batch of sequences (rows `group`, packed tokens `tokens`) into the packed result."""
    for x in program.inputs:
        result.grads[x.name][0, tokens] = ran.grads[x.name]
    for name, value in ran.outputs.items():
        result.outputs[name][0, tokens] = value
    for s in program.states:
        result.grads[s.name][group] = ran.grads[s.name]
        result.final_state[s.name][group] = ran.final_state[s.name]
    states = {s.name for s in program.states}
    for key, value in ran.final_state.items():  # (stabilized states' log-scales [n, H]; NaN: at the true scale)
        if key not in states:
            rows = len(result.final_state[program.states[0].name])
            result.final_state.setdefault(key, np.full((rows,) + value.shape[1:], np.nan, value.dtype))[group] = value
    for p in program.params:
        result.grads[p.name] = ran.grads[p.name] + result.grads.get(p.name, 0)
    result.params = result.params or dict(ran.params)

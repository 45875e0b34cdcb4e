"""Recurrence.vjp with cu_seqlens: the gradient of packed variable-length sequences (flash-linear-attention's
varlen convention, as Recurrence.run takes it: serving.run_packed).

Inputs are one packed row [1, T_total, H, *], sequence i the tokens cu_seqlens[i] … cu_seqlens[i + 1] − 1;
initial states, final states and their gradients hold one row per sequence, [N, H, *]. No state crosses
from one sequence into the next, so the packed call is N independent calls: each sequence's vjp runs on its
own slice, from its own initial state, with its own final state's gradient, and the results are joined —
inputs' gradients and outputs along the token axis, initial states' gradients and final states along the
sequence axis, params' gradients summed over the sequences. An empty sequence ends where it started: its
final state is its initial one, and that state's gradient is its final state's.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import arrays, gradients, serving
from .dsl.errors import RuntimeInputError


def vjp_packed(rec, inputs: dict, grad_outputs: dict | None, offsets: np.ndarray, *, grad_final_state: dict | None,
               initial_state: dict | None, params: dict | None, dims: dict | None = None, missing: str = "error",
               **options) -> gradients.VjpResult:
    """Recurrence.vjp(…, cu_seqlens=offsets) (offsets as serving.check_cu_seqlens returns them); `options`:
    the rest of vjp's arguments, passed to each sequence's call. The arguments are checked whole first, so
    that an error gives the shapes the caller passed; one raised by a sequence's call says which sequence."""
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
                                                sizes)
    runs: dict[int, gradients.VjpResult] = {}
    for i, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if end == start:
            continue  # (joined after the others: its state's shape is theirs)
        row = slice(i, i + 1)
        try:
            runs[i] = gradients.vjp(
                rec, {k: v[:, start:end] for k, v in checked.items()}, {k: v[:, start:end] for k, v in upstream.items()},
                grad_final_state={k: v[row] for k, v in finals_upstream.items()},
                initial_state={k: v[row] for k, v in state0.items()}, params=params, dims=dims, missing=missing,
                **options)
        except RuntimeInputError as err:  # (its indices count from the sequence's first token, its B from 0)
            raise RuntimeInputError(f"{err.message} — in sequence {i} of cu_seqlens (packed tokens {start}…{end - 1}; "
                                    f"an index above is the sequence's own: its token 0 is packed token {start})"
                                    ) from None
    return _joined(program, runs, sequences, state0, finals_upstream)


def _joined(program, runs: dict, sequences: int, state0: dict, finals_upstream: dict):
    """The per-sequence results as one packed call's (see the module's docstring)."""
    ran = [runs[i] for i in sorted(runs)]
    first = ran[0]  # (T_total ≥ 1: check_inputs refuses an all-empty batch)
    dtype = next(iter(first.grads.values())).dtype
    outputs = {name: np.concatenate([r.outputs[name] for r in ran], axis=1) for name in first.outputs}
    grads = {x.name: np.concatenate([r.grads[x.name] for r in ran], axis=1) for x in program.inputs}
    for p in program.params:
        grads[p.name] = sum(r.grads[p.name] for r in ran)
    final = {}
    for s in program.states:
        rows, grad_rows = [], []
        for i in range(sequences):
            if i in runs:
                rows.append(runs[i].final_state[s.name])
                grad_rows.append(runs[i].grads[s.name])
                continue
            # an empty sequence: its final state is its initial one, whose gradient is the final state's
            like = first.final_state[s.name]
            initial = state0.get(s.name)
            rows.append(np.zeros_like(like) if initial is None else np.asarray(initial[i:i + 1], like.dtype))
            upstream = finals_upstream.get(s.name)
            grad_rows.append(np.zeros_like(like, dtype=dtype) if upstream is None else
                             np.asarray(upstream[i:i + 1], dtype))
        final[s.name] = np.concatenate(rows, axis=0)
        grads[s.name] = np.concatenate(grad_rows, axis=0)
    for key in first.final_state:  # (stabilized states' log-scales, [1, H] per sequence; NaN: at the true scale)
        if key not in final:
            final[key] = np.concatenate([runs[i].final_state[key] if i in runs else
                                         np.full_like(first.final_state[key], np.nan) for i in range(sequences)])
    return gradients.VjpResult(outputs, final, grads, dict(first.params))

"""What a serving engine asks of a prefill besides the outputs: states along the way, and packed batches.

    res = rec.run(x, state_every=64)                   # res.checkpoints["S"]: [B, T // 64, H, *]
    res = rec.run(x, keep_last=4)                      # res.last_states["S"]: [B, 4, H, *]
    res = rec.run(packed, cu_seqlens=[0, 5, 37, 64])   # inputs [1, 64, H, *]; states [3, H, *]

How: the fused C kernel of the recurrent form writes the states asked for as it passes them (its blocks
end at those tokens), in one call. Every other form of every program runs segment by segment, each segment
starting from the state the previous one ended with, and the segments end at the tokens whose states are
asked for (every C-th token, each of the last K). A recurrence's state after token t does not depend on
how the tokens before it were grouped, so this is exact in every form (the chunkwise form's own chunk
boundaries coincide with the segments' when C is a multiple of its chunk size). A packed batch runs each sequence
as a call of its own, so that no sequence reads another's tokens in any form, whatever the chunk size.

A non-causal program's outputs read the final state of the whole sequence: its outputs come from one run
over all tokens, and the segments give only the states.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .compiler.builtins import SEQ
from .dsl.errors import RuntimeInputError

# forward(inputs [B, t, H, *], initial states [B, H, *] or None for zeros) → (outputs, final states)
Forward = Callable[[dict, "dict | None"], tuple[dict, dict]]
# snapshots(inputs, initial states, stops) → (outputs, final states, the states after each token count in
# stops [B, len(stops), H, *]): a kernel that writes them as it passes (the fused C kernel), in one call
Snapshots = Callable[[dict, "dict | None", list], tuple[dict, dict, dict]]


def _whole_number(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _none(count) -> bool:
    """None or 0, which the serving counts take as none (as the embeddable C's 0)."""
    return count is None or (_whole_number(count) and count == 0)


def check_state_every(state_every) -> int | None:
    """state_every: tokens between checkpoints, a positive integer (None or 0: no checkpoints, as the embeddable
    C's 0)."""
    if _none(state_every):
        return None
    if not _whole_number(state_every) or state_every < 1:
        raise RuntimeInputError(f"state_every must be a positive integer (tokens between checkpoints, e.g. 64), "
                                f"got {state_every!r}; leave it out (or pass 0) for no checkpoints")
    return int(state_every)


def check_keep_last(keep_last) -> int | None:
    """keep_last: how many of the last tokens' states to return, a positive integer (None or 0: none, as the
    embeddable C's 0 — an engine with no draft tokens this step). That it is at most T is checked once T is known
    (check_keep_last_fits)."""
    if _none(keep_last):
        return None
    if not _whole_number(keep_last) or keep_last < 1:
        raise RuntimeInputError(f"keep_last must be a positive integer (the states after each of the last K "
                                f"tokens, e.g. 4), got {keep_last!r}; leave it out (or pass 0) for none")
    return int(keep_last)


def check_cu_seqlens(cu_seqlens) -> np.ndarray | None:
    """cu_seqlens: the offsets of the packed sequences, an integer array [N + 1] that starts at 0 and does not
    decrease (flash-linear-attention's convention), as int64. Its end is checked against the inputs'
    T_total once they are known (check_packed_call)."""
    if cu_seqlens is None:
        return None
    try:
        offsets = np.asarray(cu_seqlens)
    except Exception:  # noqa: BLE001 - any failure to view the value as an array is the caller's error
        raise RuntimeInputError(f"cu_seqlens must be an integer array [N + 1] of offsets, got "
                                f"{type(cu_seqlens).__name__}") from None
    if offsets.dtype.kind not in "iu" and offsets.size > 0:  # ([] is a float64 array: too short, not a dtype)
        raise RuntimeInputError(f"cu_seqlens must be an integer array [N + 1] of offsets (e.g. [0, 5, 37, 64]), "
                                f"got dtype {offsets.dtype}; pass it as int32 or int64")
    if offsets.ndim != 1 or offsets.size < 2:
        raise RuntimeInputError(f"cu_seqlens must be a 1-D array [N + 1] of at least 2 offsets ([0, T_total] for "
                                f"one sequence: 0 and the packed length), got shape {list(offsets.shape)}")
    # checked in the caller's own dtype, so that a message gives the values passed (a uint64 offset above
    # int64's maximum would wrap to a negative one in int64), and only then cast
    beyond = offsets > np.iinfo(np.int64).max if offsets.dtype == np.uint64 else np.zeros(offsets.shape, bool)
    if beyond.any():
        i = int(np.argmax(beyond))
        raise RuntimeInputError(f"cu_seqlens[{i}] = {int(offsets[i])} lies beyond the end of the packed sequences "
                                f"(the inputs' token axis T_total): each offset lies in [0, T_total]")
    if offsets[0] != 0:
        raise RuntimeInputError(f"cu_seqlens must start at 0, got {int(offsets[0])}")
    falls = offsets[1:] < offsets[:-1]
    if falls.any():
        i = int(np.argmax(falls))
        raise RuntimeInputError(f"cu_seqlens must not decrease: cu_seqlens[{i + 1}] = {int(offsets[i + 1])} < "
                                f"cu_seqlens[{i}] = {int(offsets[i])}")
    if offsets[-1] == 0:
        raise RuntimeInputError(f"every sequence in cu_seqlens is empty (its {offsets.size} offsets are all 0): a "
                                f"packed call needs at least one token (cu_seqlens ends at T_total, the inputs' "
                                f"token count); skip the call until a sequence has a token")
    return offsets.astype(np.int64)


def check_packed_call(offsets: np.ndarray, batch: int, tokens: int) -> None:
    """A packed call's inputs: one batch row, T_total tokens where the offsets end."""
    if batch != 1:
        raise RuntimeInputError(f"with cu_seqlens the inputs are one packed row [1, T_total, H, *], got batch "
                                f"size {batch}; concatenate the sequences along the token axis")
    if offsets[-1] != tokens:
        raise RuntimeInputError(f"cu_seqlens must end at the packed length T_total = {tokens} (the inputs' token "
                                f"axis), got {int(offsets[-1])}")


def check_packed_states(initial_state: dict | None, sequences: int) -> None:
    """With cu_seqlens, an initial state per sequence: [N, H, *] (the shape's other axes are checked with
    the rest of the call)."""
    for name, value in (initial_state or {}).items():
        rows = np.shape(value)[0] if np.ndim(value) else None
        if rows != sequences:
            raise RuntimeInputError(f"with cu_seqlens, initial state '{name}' holds one state per sequence, "
                                    f"[N, H, *] with N = {sequences} (len(cu_seqlens) − 1), got shape "
                                    f"{list(np.shape(value))}")


def check_keep_last_fits(keep_last: int | None, lengths) -> None:
    """keep_last at most the length of every sequence (the states after tokens that exist)."""
    if keep_last is None:
        return
    lengths = [int(n) for n in lengths]
    shortest = min(lengths)
    if shortest == 0:  # (no pass is short enough: say so)
        raise RuntimeInputError(f"sequence {lengths.index(0)} of the packed batch is empty, so it has no states "
                                f"after its last {keep_last} token(s): with keep_last, leave empty sequences out "
                                f"of cu_seqlens")
    if keep_last > shortest:
        which = "the sequence" if len(lengths) == 1 else f"sequence {lengths.index(shortest)} of the packed batch"
        raise RuntimeInputError(f"keep_last = {keep_last} exceeds the {shortest} token(s) of {which}; pass at "
                                f"most {shortest}")


def why_not_packed(program, sequence_plan) -> str | None:
    """Why a program cannot take packed sequences (None: it can). Parameters over the sequence axis
    (Linformer's E·seq(k)) mix the positions of the whole row: position t is column t of the parameter, so
    the tokens of one sequence are weighted by where the others put it, and the row has no block-diagonal
    form — the compiler's 'mixing' programs."""
    if sequence_plan is None or sequence_plan.kind != "mixing":
        return None
    spanning = ", ".join(p.name for p in program.params if SEQ in p.shape)
    return (f"its parameter(s) {spanning} span the sequence axis '{SEQ}' and mix every position of the row, so "
            f"packed sequences cannot be kept apart; run each sequence as a call of its own")


def stack_states(states: list[dict], like: dict, batch: int) -> dict[str, np.ndarray]:
    """States [B, H, *] taken along the way → [B, n, H, *] per name (n = 0: an empty array shaped like one)."""
    if not states:
        return {k: np.empty((batch, 0) + np.shape(v)[1:], np.asarray(v).dtype) for k, v in like.items()}
    return {k: np.stack([s[k] for s in states], axis=1) for k in like}


def stops(tokens: int, every: int | None, last: int | None) -> list[int]:
    """The token counts after which a state is asked for, in order, ending at `tokens`: every `every`-th
    one and each of the last `last` ones."""
    at = {tokens}
    if every is not None:
        at.update(range(every, tokens + 1, every))
    if last is not None:
        at.update(range(tokens - last + 1, tokens + 1))
    return sorted(at)


@dataclass
class Served:
    """What one call gives back: outputs [B, T, H, *], final states, and the states asked for."""

    outputs: dict[str, np.ndarray]
    final: dict[str, np.ndarray]
    checkpoints: dict[str, np.ndarray] = field(default_factory=dict)
    last_states: dict[str, np.ndarray] = field(default_factory=dict)


def run_sequence(forward: Forward, inputs: dict, state0: dict | None, every: int | None, last: int | None,
                 causal: bool, stateful: bool, scales: frozenset[str] = frozenset(),
                 snapshots: Snapshots | None = None) -> Served:
    """One batch of equal-length sequences [B, T, H, *], with the states asked for: from `snapshots` in one
    call where the form writes them itself, else segment by segment. `scales`: the log-scale keys carried
    beside stabilized states (handed from segment to segment in float64, as check_initial_state gives them
    to the forms)."""
    first = next(iter(inputs.values()))
    batch, tokens = first.shape[:2]
    if not stateful or (every is None and last is None):  # (a program without states has none to give)
        outputs, final = forward(inputs, state0)
        return Served(outputs, final)
    if snapshots is not None:
        at = stops(tokens, every, last)
        outputs, final, taken = snapshots(inputs, state0, at)
        index = {t: i for i, t in enumerate(at)}
        served = Served(outputs, final)
        if every is not None:
            picked = [index[t] for t in range(every, tokens + 1, every)]
            first = picked == list(range(len(picked)))  # the first stops: a view of them, no copy
            served.checkpoints = {k: v[:, :len(picked)] if first else v[:, picked] for k, v in taken.items()}
        if last is not None:  # (a copy beside checkpoints, which may share its stops: two arrays of their own)
            served.last_states = {k: v[:, index[tokens - last + 1]:] for k, v in taken.items()}
            if every is not None:
                served.last_states = {k: v.copy() for k, v in served.last_states.items()}
        return served
    pieces, taken = [], {}
    state, start = state0, 0
    for end in stops(tokens, every, last):
        outputs, state = forward({k: v[:, start:end] for k, v in inputs.items()}, state)
        pieces.append(outputs)
        taken[end] = state
        state = {k: np.asarray(v, np.float64) if k in scales else v for k, v in state.items()}
        start = end
    final = taken[tokens]
    if causal:
        outputs = {k: np.concatenate([p[k] for p in pieces], axis=1) for k in pieces[0]}
    else:  # every output reads the whole sequence's final state: one run over all tokens
        outputs, _ = forward(inputs, state0)
    served = Served(outputs, final)
    if every is not None:
        served.checkpoints = stack_states([taken[t] for t in range(every, tokens + 1, every)], final, batch)
    if last is not None:
        served.last_states = stack_states([taken[t] for t in range(tokens - last + 1, tokens + 1)], final, batch)
    return served


def run_packed(forward: Forward, inputs: dict, state0: dict, offsets: np.ndarray, every: int | None,
               last: int | None, causal: bool, stateful: bool, scales: frozenset[str] = frozenset(),
               snapshots: Snapshots | None = None) -> tuple[Served, np.ndarray]:
    """Packed sequences: inputs [1, T_total, H, *], initial states [N, H, *] (given or zeros) → the outputs
    [1, T_total, H, *], final states [N, H, *], checkpoints packed per sequence [1, Σ ⌊len_i / C⌋, H, *],
    last states [N, K, H, *]; and the checkpoints' offsets [N + 1] (empty without checkpoints)."""
    outputs, finals, checkpoints, last_states, counts = [], [], [], [], []
    for i, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        own = {k: v[i:i + 1] for k, v in state0.items()}
        if end == start:  # an empty sequence ends where it started, with no checkpoint
            finals.append({k: v.copy() for k, v in own.items()})
            if every is not None:
                checkpoints.append(stack_states([], own, 1))
            counts.append(0)
            continue
        served = run_sequence(forward, {k: v[:, start:end] for k, v in inputs.items()}, own, every, last,
                              causal, stateful, scales, snapshots)
        outputs.append(served.outputs)
        finals.append(served.final)
        if every is not None and stateful:
            checkpoints.append(served.checkpoints)
        if last is not None and stateful:
            last_states.append(served.last_states)
        counts.append((end - start) // every if every is not None else 0)
    packed = Served({k: np.concatenate([o[k] for o in outputs], axis=1) for k in outputs[0]},
                    _concatenate(finals, axis=0))
    if every is not None and stateful:
        packed.checkpoints = _concatenate(checkpoints, axis=1)
    if last is not None and stateful:
        packed.last_states = _concatenate(last_states, axis=0)
    checkpoint_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64) \
        if every is not None and stateful else np.zeros(0, np.int64)
    return packed, checkpoint_offsets


def _concatenate(parts: list[dict], axis: int) -> dict[str, np.ndarray]:
    """Per name, the parts' arrays joined along `axis` (names: the first part's)."""
    return {k: np.concatenate([p[k] for p in parts], axis=axis) for k in parts[0]} if parts else {}

"""The decode step over a pool of state slots (continuous batching, as vLLM's Mamba cache keeps them):

    out, pool = rec.step(tokens, pool, slots=idx)   # tokens [N, H, *]; pool[name] [P, H, *]; idx int [N]

The rows pool[name][idx] advance by one token in place; every other row stays as it was, bit for bit.
How: where the backend's step indexes slots itself (capabilities.steps_slots: the fused C kernel's
lr_step_slots), one call reads and writes each active row where it lies. Otherwise the N rows are gathered
into contiguous [N, H, *] buffers, the ordinary decode step runs on them (one compiled call for all
requests and heads on C) and the rows are written back after it has succeeded. Every argument is checked
before the step runs, and the kernel checks the tokens' ranges before it touches a row, so a bad call (or
a token out of its declared range) leaves every row as it was.
"""
from __future__ import annotations

import numpy as np

from .arrays import array_kind_hint, refuse_shared_outputs
from .dsl.errors import RuntimeInputError


def slot_array(slots) -> np.ndarray:
    """slots as a 1-D integer array (not yet checked against the pool: check_slot_values)."""
    try:
        idx = np.asarray(slots)
    except Exception:  # noqa: BLE001 - any failure to view the value as an array is the caller's error
        raise RuntimeInputError(f"slots must be an integer array [N] of pool rows, got "
                                f"{type(slots).__name__}") from None
    if idx.size == 0 and idx.ndim == 1:  # ([] is a float64 array: an empty list of rows all the same)
        idx = idx.astype(np.int64)
    if idx.dtype.kind not in "iu":
        raise RuntimeInputError(f"slots must be an integer array [N] of pool rows, got dtype {idx.dtype}; pass "
                                f"int32 or int64 indices")
    if idx.ndim != 1:
        raise RuntimeInputError(f"slots must be a 1-D array [N] (one pool row per request), got shape "
                                f"{list(idx.shape)}")
    return idx


def check_slot_values(idx: np.ndarray, requests: int, pool_size: int) -> np.ndarray:
    """One distinct row in [0, P) per request, as int64."""
    if idx.shape[0] != requests:
        raise RuntimeInputError(f"slots has {idx.shape[0]} entries but the tokens are for N = {requests} "
                                f"requests; pass one pool row per request")
    # checked in the caller's own dtype, so that the message gives the value passed (a uint64 slot above
    # int64's maximum would wrap to a negative one in int64); cast once every slot is in [0, P)
    outside = (idx >= pool_size) | (idx < 0) if idx.dtype.kind == "i" else idx >= pool_size
    if outside.any():
        i = int(np.argmax(outside))
        raise RuntimeInputError(f"slots[{i}] = {int(idx[i])} is outside the pool's {pool_size} rows [0, {pool_size}); "
                                f"pass only the slots of active requests")
    idx = idx.astype(np.int64, copy=False)
    if np.unique(idx).size != idx.size:
        seen: dict[int, int] = {}
        for i, s in enumerate(idx.tolist()):
            if s in seen:
                raise RuntimeInputError(f"slots[{seen[s]}] and slots[{i}] are both {s}: each request needs a "
                                        f"slot of its own")
            seen[s] = i
    return idx


def require_dict(pool) -> None:
    if not isinstance(pool, dict):
        raise RuntimeInputError(f"the pool must be a dict of state arrays [P, H, *] by name, got "
                                f"{type(pool).__name__}")


def check_pool(program, pool, heads: int, dims: dict[str, int], dtype: np.dtype, scales, bits: bool = False) -> int:
    """The pool: a dict holding every state as a writeable array [P, H, *] of the tokens' dtype — uint16 arrays
    of bfloat16 bits with `bits` (state_dtype="bfloat16") — and the log-scales [P, H] of stabilized states,
    when present, in a float dtype (NumPy's prefill gives them in float64; _PoolCall converts them). Any
    ndarray, subclasses (np.memmap) included: the step writes into its memory. Returns P."""
    require_dict(pool)
    missing = [s.name for s in program.states if s.name not in pool]
    if missing:
        raise RuntimeInputError(f"the pool must hold every state (missing: {', '.join(missing)}), each [P, H, *]")
    unknown = sorted(set(pool) - {s.name for s in program.states} - set(scales))
    if unknown:
        raise RuntimeInputError(f"the pool holds unknown name(s) {', '.join(map(repr, unknown))}; the states of "
                                f"'{program.name}' are {', '.join(s.name for s in program.states)}")
    size = None
    wanted = [(s.name, tuple(dims[d] for d in s.shape), "[P, H" + "".join(", " + d for d in s.shape) + "]")
              for s in program.states] + [(key, (), "[P, H]") for key in sorted(scales) if key in pool]
    states = {s.name for s in program.states}
    for name, tail, label in wanted:
        arr = pool[name]
        wants = np.dtype(np.uint16) if bits and name in states else dtype
        right_dtype = arr.dtype == wants or (name not in states and arr.dtype.kind == "f") \
            if isinstance(arr, np.ndarray) else False
        if not (right_dtype and arr.ndim == 2 + len(tail) and arr.shape[1:] == (heads,) + tail
                and arr.flags.writeable):
            got = f"{arr.dtype} {list(arr.shape)}{array_kind_hint(arr, f'pool[{name!r}]')}" \
                if isinstance(arr, np.ndarray) else type(arr).__name__
            if wants != dtype:
                why = "bfloat16 bits, as state_dtype='bfloat16' keeps them, and the tokens' sizes"
            elif isinstance(arr, np.ndarray) and arr.dtype == np.uint16:
                why = "the tokens' dtype and sizes; a pool of bfloat16 bits needs state_dtype='bfloat16'"
            else:
                why = "the tokens' dtype and sizes"
            raise RuntimeInputError(f"pool['{name}'] must be a writeable {wants} array of shape {label} = "
                                    f"[P, {', '.join(str(n) for n in (heads,) + tail)}] ({why}), got {got}")
        if size is not None and arr.shape[0] != size:
            raise RuntimeInputError(f"pool['{name}'] has {arr.shape[0]} slots but the other pool arrays have "
                                    f"{size}; every pool array needs the same P")
        size = arr.shape[0]
    return size


def check_pool_sizes(program, pool: dict, token_inputs, bits: bool = False) -> None:
    """Each pool state's sizes against the tokens', where every token input that has a size agrees on it: a
    pool state that disagrees is the pool's error. (The token's own check takes a size where most of the
    step's arrays have it, a tie going to the state: it would blame the token for the pool's size.)"""
    tokens: dict[str, dict[int, list[str]]] = {}
    heads, dtype = "H", None
    for x in program.inputs:
        shape = np.shape(token_inputs.get(x.name)) if isinstance(token_inputs, dict) \
            and isinstance(token_inputs.get(x.name), np.ndarray) else None
        if shape is not None and len(shape) == 2 + len(x.shape):
            heads, dtype = str(shape[1]), dtype or token_inputs[x.name].dtype
            for d, n in zip(x.shape, shape[2:]):
                tokens.setdefault(d, {}).setdefault(n, []).append(f"input '{x.name}'")
    agreed = {d: next(iter(by.items())) for d, by in tokens.items() if len(by) == 1}
    for s in program.states:
        arr = pool.get(s.name)
        if not isinstance(arr, np.ndarray) or arr.ndim != 2 + len(s.shape):
            continue  # (check_pool says what is wrong with it)
        for d, n in zip(s.shape, arr.shape[2:]):
            if d in agreed and agreed[d][0] != n:
                size, where = agreed[d]
                label = "[P, H" + "".join(", " + e for e in s.shape) + "]"
                want = ", ".join(str(agreed[e][0]) if e in agreed else e for e in s.shape)
                kind = f"{np.dtype(np.uint16) if bits else dtype} array of shape"
                raise RuntimeInputError(f"pool['{s.name}'] has {d} = {n} but the tokens have {d} = {size} "
                                        f"({' and '.join(where)}): pool['{s.name}'] must be a writeable {kind} "
                                        f"{label} = [P, {heads}, {want}] (the tokens' sizes), got {arr.dtype} "
                                        f"{list(arr.shape)}; pass a pool made for these sizes")


class _PoolCall:
    """One slot-pool call's checked pieces: the pool's arrays (plain ndarray views of them; with the log-scales
    absent from it made at the true scale, NaN, and those of another float dtype converted: `made`, which
    the caller's pool takes once the step has run), the slots, and how the step runs — the kernel's own slot
    step where the backend has one and the pool's arrays suit it (C-contiguous), else on rows gathered into
    contiguous buffers."""

    def __init__(self, rec, token_inputs: dict, pool, slots, backend: str, params, bits: bool = False):
        if rec.decomposition.sequence is not None:
            raise RuntimeInputError(f"'{rec.name}' reads the sequence: its decode state is a KV cache that grows "
                                    f"every token, not a fixed-size state a pool of slots can hold")
        idx = slot_array(slots)
        require_dict(pool)
        first = token_inputs.get(rec.program.inputs[0].name) if isinstance(token_inputs, dict) else None
        if idx.size == 0 and np.ndim(first) >= 1 and np.shape(first)[0] == 0:
            raise RuntimeInputError("the step has no requests (N = 0 tokens and slots): run it only while a "
                                    "request is active")
        check_pool_sizes(rec.program, pool, token_inputs, bits)
        _, shape, module, dims, used = rec._token_call(token_inputs, backend, params,
                                                       {k: v for k, v in pool.items() if np.ndim(v) >= 2})
        scales = rec._log_scales
        size = check_pool(rec.program, pool, shape.heads, dims, shape.dtype, scales, bits)
        self.bits = bits  # bfloat16 states (state_dtype="bfloat16")
        self.idx = check_slot_values(idx, shape.batch, size)
        self.arrays = {k: np.asarray(v) for k, v in pool.items()}
        self.made = {key: np.full((size, shape.heads), np.nan, shape.dtype) for key in scales if key not in pool}
        self.made.update((key, v.astype(shape.dtype)) for key, v in self.arrays.items()
                         if key in scales and v.dtype != shape.dtype)
        self.arrays.update(self.made)
        self.requests, self.size = shape.batch, size
        able = module.capabilities
        self.kernel = module.slot_step(used, dims, **({"state_is_bf16": True} if bits else {})) \
            if able.steps_slots and (able.bfloat16_steps or not bits) \
            and all(a.flags.c_contiguous for a in self.arrays.values()) else None
        # the gathered rows, where the step runs on them: C-contiguous copies (fancy indexing keeps a Fortran-order
        # pool's order, which the in-place step refuses)
        self.rows = None if self.kernel else {k: np.ascontiguousarray(v[self.idx]) for k, v in self.arrays.items()}

    def require_writeable(self) -> None:
        """Every pool array still writeable, before a bound step writes any (its caller may have made one
        read-only since binding: found by probing, the rows' way then updated pool['S'] and failed on
        pool['z'], leaving the pool half-stepped, and the C slot step wrote into the read-only array)."""
        for key, v in self.arrays.items():
            if not v.flags.writeable:
                raise RuntimeInputError(f"pool['{key}'] has been made read-only since the step was bound: the step "
                                        f"updates it in place (nothing was written)")

    def gather(self, idx: np.ndarray) -> None:
        for k, v in self.arrays.items():  # (not np.take(…, out=): it copies a non-contiguous pool whole)
            self.rows[k][...] = v[idx]

    def scatter(self, idx: np.ndarray) -> None:
        for k, v in self.arrays.items():
            v[idx] = self.rows[k]


def step(rec, token_inputs: dict, pool: dict, slots, backend: str, params, out, bits: bool = False):
    """Recurrence.step(tokens, pool, slots=idx): (outputs [N, H, *], pool), the pool's rows idx advanced in
    place. A log-scale of a stabilized state that the pool lacks is added to it (NaN elsewhere: true scale)."""
    call = _PoolCall(rec, token_inputs, pool, slots, backend, params, bits)
    refuse_shared_outputs(out, token_inputs, pool, "pool['{}']", states_written=True)
    if call.kernel is not None:
        outputs = call.kernel(token_inputs, call.arrays, call.idx, out)
    else:
        outputs, _ = rec.step(token_inputs, call.rows, backend=backend, params=params, inplace=True, out=out,
                              state_dtype="bfloat16" if bits else None)
        call.scatter(call.idx)
    pool.update(call.made)
    return outputs, pool


def bind(rec, token_inputs: dict, pool: dict, slots, backend: str, params, out, bits: bool = False):
    """Recurrence.bind_step(tokens, pool, slots=idx): step() → outputs, one token for the requests at the
    slots on these very arrays. The slots are checked again every call, so an int array refilled in place
    (another set of N requests) is safe; the token buffers are refilled in place as for any bound step."""
    call = _PoolCall(rec, token_inputs, pool, slots, backend, params, bits)
    refuse_shared_outputs(out, token_inputs, pool, "pool['{}']", states_written=True)
    held = slots if isinstance(slots, np.ndarray) else call.idx  # (an array refilled in place is read again)
    if call.kernel is not None:
        kernel, arrays = call.kernel, call.arrays
        buffers = kernel.outputs(token_inputs, out)  # (checked here, once)
        pool.update(call.made)  # (bound now: the step writes them from its first call on)

        def run_kernel():
            idx = check_slot_values(slot_array(held), call.requests, call.size)
            call.require_writeable()
            outputs = kernel(token_inputs, arrays, idx, buffers)
            buffers.update(outputs)  # (made at the first call, reused after)
            return outputs
        return run_kernel
    inner = rec.bind_step(token_inputs, call.rows, backend=backend, params=params, out=out,
                          state_dtype="bfloat16" if bits else None)
    pool.update(call.made)

    def run_rows():
        idx = check_slot_values(slot_array(held), call.requests, call.size)
        call.require_writeable()
        call.gather(idx)
        outputs = inner()
        call.scatter(idx)
        return outputs
    return run_rows

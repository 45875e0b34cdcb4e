"""The C backend's decode step from Python: a Stepper binds lr_step to one set of params, one dtype and one
[B, H], checks each array when the array in a position changes, and takes a fast path (one identity test
per array, one C call) when a decode loop passes the same arrays again."""
from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Protocol

import numpy as np

from .. import arrays
from ..compiler import ir
from ..dsl.errors import LinrecError, RuntimeInputError
from . import build as c_build
from .buffers import aligned_copy, aligned_empty, aligned_zeros, checked, require_c_int_sizes
from .build import CTYPES


class RecurrentForm(Protocol):
    """What a Stepper needs of the recurrent form it steps (c.backend.CRecurrent)."""

    program: ir.Program
    scales: list[tuple[str, list[str]]]  # (log-scale key, the states it scales) per group of stabilized states

    def kernel(self, dtype, dims: dict[str, int], state_is_bf16: bool = False) -> Any:
        """The built kernel (ffi, lib, dims, ctype) for one dtype and sizes."""
        ...

_environ = os.environ


class ShapeChanged(RuntimeInputError):
    """The token arrays no longer match the batch size, heads or dtype a Stepper was bound to."""


@lru_cache(maxsize=None)
def _fast_step_maker(names: tuple[tuple[str, str], ...]):
    """make(fn, call, *arrays) → step(token_inputs, state, out), for a program whose arrays are `names`
    ((dict, key) in lr_step's order). step runs fn(call) and returns (out, state) when each dict holds, at
    each key, the very array bound there and no other key — and each array the step writes (states, outputs)
    is still writeable —, else None (nothing run); None too when the kernel refused an input out of its declared
    range (it updates nothing then; the checked path says which). An `is` test per array, written out: ~20 ns
    each, where a generic loop or tuples of ids cost 3–5 times that (the writeable flag: ~60 ns more)."""
    arrays = [f"a{i}" for i in range(len(names))]
    tests = " and\n                ".join(
        f"{d}[{key!r}] is {a}" + (f" and {a}.flags.writeable" if d != "token_inputs" else "")
        for (d, key), a in zip(names, arrays))
    counts = {d: sum(1 for dd, _ in names if dd == d) for d in ("token_inputs", "state", "out")}
    tests = " and\n                ".join([f"len({d}) == {n}" for d, n in counts.items()] + [tests])
    source = f"""def make(fn, call, {', '.join(arrays)}):
    def step(token_inputs, state, out):
        try:
            same = ({tests})
        except (KeyError, TypeError, IndexError):
            return None
        if not same or fn(call):
            return None
        return out, state
    return step
"""
    namespace: dict = {}
    exec(compile(source, "<linrec decode step: the same arrays again>", "exec"), namespace)
    return namespace["make"]


class Stepper:
    """A decode step bound to one set of params, one dtype and one [B, H]: one C call per token for every
    batch row and head. It checks each array's type, dtype, shape and strides whenever the array in a
    position changes and keeps the ffi pointer of the array it saw last in each position. A loop that
    passes the same arrays every call (the state with inplace=True, `out`, token buffers refilled in
    place) gets `fast`: one identity test per array and one C call with the addresses packed."""

    def __init__(self, rec: RecurrentForm, params: dict, dims: dict, num_threads=None, state_is_bf16: bool = False):
        if not rec.program.causal:
            raise LinrecError(f"'{rec.program.name}' is non-causal: every output reads the final state, so "
                              f"it has no token-by-token decode step")
        self.rec = rec
        self.params = params
        self.dims = {d.name: int(dims[d.name]) for d in rec.program.dims}
        self._fixed_threads = None if num_threads is None else int(num_threads)
        self._env = None
        self.threads = c_build.thread_count(self._fixed_threads)
        # bfloat16 states: the program's states are uint16 arrays of bfloat16 bits (log-scales stay in T), which
        # the kernel widens to float32 and rounds back (the kernel variant built for it)
        self.state_is_bf16 = state_is_bf16
        self._key = None
        # fast(token_inputs, state, out): the step when every array is the one of the last checked call
        # (inplace=True, with `out`), else None; None itself until such a call
        self.fast = None

    def _bind(self, dtype, batch, heads):
        require_c_int_sizes(batch=batch, heads=heads)
        rec, p = self.rec, self.rec.program
        if self.state_is_bf16 and np.dtype(dtype) != np.float32:
            raise RuntimeInputError(f"state_dtype='bfloat16' needs float32 inputs, got {np.dtype(dtype)}")
        k = rec.kernel(dtype, self.dims, self.state_is_bf16)
        dims = k.dims
        self._params = []
        for prm in p.params:
            if prm.name not in self.params:
                raise RuntimeInputError(f"missing parameter '{prm.name}'")
            shape = ((heads,) if prm.per_head else ()) + tuple(dims[d] for d in prm.shape)
            arr = checked(self.params[prm.name], shape, None, f"parameter '{prm.name}'")
            self._params.append(np.ascontiguousarray(arr, dtype=dtype))
        self._fb, self._ptr, self._fn = k.ffi.from_buffer, k.ptr, k.lib.lr_step
        self._ffi, self._packed_fn = k.ffi, k.lib.lr_step_packed
        self._param_ptrs = [self._fb(self._ptr, a) for a in self._params]
        size = np.dtype(dtype).itemsize

        def spec(name, tail, size=size):
            shape = (batch, heads) + tuple(dims[d] for d in tail)
            strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * size for i in range(len(shape)))
            return name, shape, strides
        self._inputs = [spec(x.name, x.shape) for x in p.inputs]
        # stabilized states' log-scales last, one per head (c_stabilize; NaN when absent: the true scale)
        bits = self.state_is_bf16
        self._states = [spec(s.name, s.shape, 2 if bits else size) for s in p.states] \
            + [spec(key, ()) for key, _ in rec.scales]
        self._scale_names = {key for key, _ in rec.scales}
        # each state position's dtype and cffi type: bfloat16 bits for the program's states of a bf16 step
        self._state_dtypes = [arrays.BFLOAT16_BITS if bits and name not in self._scale_names else np.dtype(dtype)
                              for name, _, _ in self._states]
        self._state_ptrs = ["uint16_t[]" if d == arrays.BFLOAT16_BITS else k.ptr for d in self._state_dtypes]
        self._outputs = [spec(o.name, o.value.shape) for o in p.outputs]
        n = len(self._inputs) + len(self._states) + len(self._outputs)
        self._seen = [None] * n   # the array last seen in each position …
        self._seen_ptr = [None] * n  # … and its pointer
        self._in_names = [x.name for x in p.inputs]
        self._st_names = [name for name, _, _ in self._states]
        self._out_names = [o.name for o in p.outputs]
        self._make_fast = _fast_step_maker(tuple(
            [("token_inputs", n) for n in self._in_names] + [("state", n) for n in self._st_names]
            + [("out", n) for n in self._out_names]))
        self._dtype, self._batch, self._heads = np.dtype(dtype), batch, heads
        self._key = (self._dtype, batch, heads)

    def __call__(self, token_inputs, state, inplace=False, out=None):
        """(outputs [B, H, *], states [B, H, *]) after one token. inplace=True updates the given state
        arrays (writeable, C-contiguous, of the inputs' dtype) and returns them; otherwise they are copied.
        `out` may hold output arrays to write into (reused across calls: no allocation per token).
        A loop that passes the same arrays every call (inplace=True, out=…, token buffers refilled in place)
        takes `fast`: one identity test per array and the C call, and `out` and `state` themselves come
        back; LINREC_NUM_THREADS is then read when the arrays change, not per call."""
        if inplace and out is not None and self.fast is not None:
            done = self.fast(token_inputs, state, out)
            if done is not None:
                return done
        self.fast = None  # an array changed (or this call copies): every check below, then maybe a new fast
        args, outputs, new_state, every_seen, adopted = self._arguments(token_inputs, state, inplace, out)
        rc = self._fn(*args, self._batch, self._heads, self.threads)
        if rc:
            self._refused(rc, token_inputs)
        if adopted:  # (only now: a refused step leaves the caller's dict as it was)
            state.update(adopted)
        if inplace and out is not None and state is not None and every_seen:
            # the next call with these very arrays needs no check: bind them to a fast path
            self.fast = self._make_fast(self._packed_fn, self._packed_call(), *self._seen)
        return outputs, new_state

    def bind(self, token_inputs: dict, state: dict, out: dict | None = None):
        """step() → outputs: one token on these very arrays, every array checked once, here. Each call reads
        the token buffers (refill them in place between calls), updates `state` in place and writes the
        outputs into `out` (created when absent). Value ranges are checked by the kernel on every call."""
        if state is None:
            raise RuntimeInputError("a bound step updates its state arrays in place: pass them (e.g. the "
                                    "final_state of prefill)")
        out = dict(out) if out is not None else {}
        # binds [B, H] and the dtype; checks every array. The caller's dict takes the arrays the step will
        # update in its place (a log-scale converted to this dtype, or carried here when the caller has none
        # yet) only once every check has passed
        adopted = self._arguments(token_inputs, state, True, out)[4]
        for key in self._scale_names - set(state):
            adopted[key] = self._seen[len(self._in_names) + self._st_names.index(key)]
        bound = {**state, **adopted}
        missing = [(name, shp) for name, shp, _ in self._outputs if out.get(name) is None]
        if missing:
            out.update((name, aligned_empty(shp, self._dtype)) for name, shp in missing)
            self._arguments(token_inputs, bound, True, out)
        # a token buffer the kernel cannot read where it lies (strided, Fortran order, the other byte order) is
        # copied into the kernel's own buffer every call, so that refills in place reach the step as on NumPy
        refills = []
        for name, arr in zip(self._in_names + self._st_names, self._seen):  # (inputs, then states, are seen first)
            given = token_inputs.get(name) if name in self._in_names else bound.get(name)
            if arr is given:
                continue
            if name in self._in_names and isinstance(given, np.ndarray) and given.shape == arr.shape \
                    and given.dtype.newbyteorder("=") == arr.dtype:
                refills.append((arr, given))
                continue
            what = f"input '{name}'" if name in self._in_names else f"state '{name}'"
            kind = "uint16 (bfloat16 bits)" if arr.dtype == arrays.BFLOAT16_BITS else self._dtype
            label = f"token_inputs[{name!r}]" if name in self._in_names else f"state[{name!r}]"
            raise RuntimeInputError(f"{what} must be a {'' if name in self._in_names else 'C-contiguous '}{kind} "
                                    f"array of shape {list(arr.shape)} to be bound: the step reads it every call"
                                    f"{arrays.byte_order_hint(given, label)}")
        state.update(adopted)
        fn, call = self._packed_fn, self._packed_call()
        refused = self._refused
        # the arrays the step writes, by name: each still writeable every call, as on NumPy (a caller may make one
        # read-only after binding; the kernel would write it all the same)
        written = [(f"state[{name!r}]", bound[name]) for name in self._st_names] + \
            [(f"out[{name!r}]", out[name]) for name in self._out_names]

        def step():
            for label, arr in written:
                if not arr.flags.writeable:
                    raise RuntimeInputError(f"{label} has been made read-only since the step was bound: the step "
                                            f"writes it (nothing was written)")
            for own, given in refills:
                np.copyto(own, given)
            rc = fn(call)
            if rc:
                refused(rc, token_inputs)
            return out
        return step

    def _packed_call(self):
        """The lr_step_call struct of the arrays seen last in every position (_seen_ptr and _param_ptrs
        keep their buffers alive and pinned)."""
        n_in = len(self._in_names)
        call = self._ffi.new("lr_step_call *")
        call.arrays = self._seen_ptr[:n_in] + self._param_ptrs + self._seen_ptr[n_in:] + [self._ffi.NULL]  # (no slots)
        call.B, call.H, call.nthreads = self._batch, self._heads, self.threads
        return call

    def _refused(self, rc: int, token_inputs):
        """The kernel returned rc ≠ 0 and updated nothing: 2, an input outside its declared range (say which);
        else it could not allocate its scratch."""
        if rc == 2:
            arrays.check_ranges(self.rec.program, {k: np.asarray(v) for k, v in token_inputs.items()})
            raise RuntimeInputError("an input lies outside its declared range")  # (the scan above names it)
        raise MemoryError("the C decode step could not allocate its scratch buffer")

    def _arguments(self, token_inputs, state, inplace, out):
        """The C arguments of one step, every array checked (or converted, or made): (args, outputs,
        new_state, every_seen, adopted), every_seen when each array is the very one now seen in its position,
        adopted the arrays the caller's state dict is to hold once the step has run (inplace=True: a
        log-scale of another dtype, converted)."""
        if self._fixed_threads is None:  # LINREC_NUM_THREADS, read as forward does (the fast path does not)
            env = _environ.get("LINREC_NUM_THREADS")
            if env != self._env:
                self._env, self.threads = env, c_build.num_threads()
        p = self.rec.program
        # names it does not read are errors, as on the checked path: a misspelt input, a state among the
        # tokens (it would start from zeros), a misspelt state
        arrays.refuse_unknown(token_inputs if isinstance(token_inputs, dict) else {}, [x.name for x in p.inputs],
                              "input array(s)", "inputs", p)
        if isinstance(state, dict):
            arrays.refuse_unknown_states(p, state, {key for key, _ in self.rec.scales})
        try:
            first = token_inputs[p.inputs[0].name]
        except (KeyError, TypeError, IndexError):
            raise RuntimeInputError(f"missing input '{p.inputs[0].name}' (shape [B, H, …], one token)") from None
        shape = getattr(first, "shape", None)
        dtype = getattr(first, "dtype", None)
        if shape is None or len(shape) < 2 or dtype not in CTYPES:
            first = arrays.native(np.asarray(first))  # (>f8: a layout, converted as checked() converts it)
            if first.ndim < 2 or first.dtype not in CTYPES:
                raise RuntimeInputError(f"input '{p.inputs[0].name}' should be a float32 or float64 array of "
                                        f"shape [B, H, …] (one token), got {first.dtype} {list(first.shape)}")
            shape, dtype = first.shape, first.dtype
        if self._key is None or dtype != self._dtype or shape[0] != self._batch or shape[1] != self._heads:
            if self._key is not None:
                raise ShapeChanged(f"this decode step is bound to [B, H] = [{self._batch}, {self._heads}] and "
                                   f"{self._dtype}; got {list(shape[:2])} and {dtype}")
            self._bind(dtype, shape[0], shape[1])
        seen, seen_ptr, fb, ptr, dt = self._seen, self._seen_ptr, self._fb, self._ptr, self._dtype
        args = []
        i = 0
        for name, shp, strides in self._inputs:
            arr = token_inputs.get(name) if name != p.inputs[0].name else first
            if arr is None:  # (before the test below: a position not seen yet holds None too)
                raise RuntimeInputError(f"missing input '{name}'")
            if arr is seen[i]:
                args.append(seen_ptr[i])
            else:
                if type(arr) is not np.ndarray or arr.dtype != dt or arr.shape != shp or arr.strides != strides:
                    arr = checked(arr, shp, dt, f"input '{name}'")
                pointer = fb(ptr, arr)
                seen[i], seen_ptr[i] = arr, pointer
                args.append(pointer)
            i += 1
        args += self._param_ptrs
        every_seen = True  # every array of this call is the one now seen in its position (none made here)
        new_state, adopted = {}, {}
        if state is not None:
            arrays.refuse_unknown_states(p, state, self._scale_names)
        arrays.refuse_unknown_outputs(p, out)
        for (name, shp, strides), sdt, sptr in zip(self._states, self._state_dtypes, self._state_ptrs):
            arr = state.get(name) if state is not None else None
            if arr is None:
                if state is not None and name in state and name not in self._scale_names:
                    raise arrays.given_none(name, "state")
                arr = aligned_zeros(shp, sdt)  # (bfloat16 zeros are zero bits)
                if name in self._scale_names:
                    arr[...] = np.nan
                if inplace and state is not None:
                    # the caller's dict takes the state this step starts (as on NumPy), so that an in-place
                    # decode loop goes on with it: made anew each call, it restarted every token, and a stabilized
                    # state's log-scale was dropped while its values stayed scaled by it
                    adopted[name] = arr
                every_seen = False
            elif name in self._scale_names and getattr(arr, "dtype", dt) != dt:
                # a log-scale from the NumPy backend (float64): converted, and the caller's dict given the
                # copy this step updates (so that an in-place decode loop goes on with it)
                arr = aligned_copy(checked(np.asarray(arr, dt), shp, dt, f"state '{name}'"))
                if inplace and state is not None:
                    adopted[name] = arr
                every_seen = False
            elif sdt != dt:  # bfloat16 bits: as given (uint16), never converted from floats
                given = arr
                arr = arrays.state_bits(name, arr, shp) if arr is not seen[i] else arr
                if not inplace:
                    arr = aligned_copy(arr)
                elif not (arr.flags.writeable if arr is seen[i] else
                          type(given) is np.ndarray and arr.strides == strides and arr.flags.writeable):
                    raise RuntimeInputError(f"state '{name}' must be a writeable C-contiguous uint16 array (bfloat16 "
                                            f"bits) of shape {list(shp)} to be updated in place")
            elif not inplace:  # copied in the call's dtype, as run() takes initial states
                arr = aligned_copy(np.asarray(checked(arr, shp, None, f"state '{name}'"), dtype=dt))
            elif not (arr.flags.writeable if arr is seen[i] else  # (made read-only since it was seen?)
                      type(arr) is np.ndarray and arr.dtype == dt and arr.shape == shp and arr.strides == strides
                      and arr.flags.writeable):
                raise arrays.not_in_place(name, arr, dt, shp)
            if arr is seen[i]:
                args.append(seen_ptr[i])
            else:
                pointer = fb(sptr, arr)
                seen[i], seen_ptr[i] = arr, pointer
                args.append(pointer)
            new_state[name] = arr
            i += 1
        outputs = {}
        for name, shp, strides in self._outputs:
            arr = out.get(name) if out is not None else None
            if arr is None:
                arr = np.empty(shp, dt)
                args.append(fb(ptr, arr))
                every_seen = False
            elif arr is seen[i] and arr.flags.writeable:
                args.append(seen_ptr[i])
            else:
                if not (type(arr) is np.ndarray and arr.dtype == dt and arr.shape == shp and arr.strides == strides
                        and arr.flags.writeable):
                    raise arrays.out_error(f"out['{name}']", arr, shp, dt)
                pointer = fb(ptr, arr)
                seen[i], seen_ptr[i] = arr, pointer
                args.append(pointer)
            outputs[name] = arr
            i += 1
        # (before the kernel writes anything; with inplace=True, states overlapping each other too)
        arrays.refuse_shared_outputs(out, token_inputs, state, states_written=inplace)
        return args, outputs, new_state, every_seen, adopted

"""The C backend: the recurrent form and a one-token decode step as C kernels, built with cffi and cached.

Generated for one scalar type and one assignment of sizes (dk, dv, … are compile-time constants) by
c_fused (templates/c_fused.c.j2) — one fused kernel for a factorable recurrence (decay + rank-one
corrections + rank-one writes per state, see compiler.transitions) read through readouts q·S — or, for any
other program, by c_statements (templates/c_statements.c.j2), its statements one by one; built lazily at the first
call with a given (dtype, sizes) and memoized, on disk by c_build and in the process here. The decode step's
Python side is c_step; the checks and buffers of the arrays passed to the kernels are c_arrays.

    mod = load(compiled, "recurrent")
    outputs, final = mod.forward(inputs, params, initial_state, dims)       # like the NumPy module
    outputs, state = mod.step(token_inputs, state, params, dims)            # one token, [B, H, *]
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..compiler import Compiled, stage_compiled
from ..dsl.errors import LinrecError, RuntimeInputError
from ..templating import c_comment_text

from .. import arrays
from ..compiler.stabilize import stabilized_states
from ..interface import FUSED, SCAN, STATEMENTS, Capabilities, no_such_form
from ..numpy import backend as numpy_backend
from ..numpy.derived import emit_derived
from ..numpy import sequence as numpy_sequence
from ..numpy.scan import rescale
from . import attention as c_attention
from . import build as c_build
from . import fork
from . import scan as c_scan
from . import staged_recurrent
from . import support
from . import value_split
from .buffers import C_INT_MAX, RecycledArrays, aligned_copy, aligned_zeros, checked, require_c_int_sizes
from .build import CTYPES
from . import fused as c_fused
from . import kernel_source
from .statements import StatementKernel
from .fused import FusedKernel, KernelSource, Target
from .stabilize import Scales
from .slot_step import SlotStep
from .step import Stepper



def recurrent_source(compiled: Compiled, dims: dict[str, int], target: Target,
                     state_is_bf16: bool = False, parts: int = 1) -> KernelSource:
    """The generator of the recurrent form's kernel: the fused one where it takes the program, else the
    statements one by one (c_statements). state_is_bf16: the fused kernel whose decode steps keep the states
    in bfloat16 (capabilities.bfloat16_steps); parts > 1: the fused one over that many parts of the value
    axis (value_split.py)."""
    if support.fused_refusal(compiled) is None:
        return FusedKernel(compiled, dims, target, state_is_bf16, parts)
    if state_is_bf16:
        raise LinrecError(f"'{compiled.name}' runs statement by statement on C: its step has no bfloat16 state")
    return StatementKernel(compiled, dims, target)


def kernel_tunables() -> tuple:
    """The generators' settings that tests change (segments, splits, threads per work, decode parts): part of
    a kernel's alias, so that a kernel rendered with other settings is never found in their place."""
    return (c_fused.SEGMENT_WORK, c_fused.SPLIT_ALWAYS, c_fused.POOL_PART_WORK, kernel_source.THREAD_WORK)


class Kernel:
    """One built extension: lr_forward (and lr_step) for one dtype and one assignment of sizes."""

    def __init__(self, compiled: Compiled, dims: dict[str, int], dtype: np.dtype, state_is_bf16: bool = False,
                 parts: int = 1):
        self.dtype = np.dtype(dtype)
        self.dims = dict(dims)  # the caller's sizes (a kernel over parts of the value axis: still the whole axis)
        self.parts = parts
        self.target = Target(CTYPES[self.dtype], c_build.vector_bytes())
        self.state_is_bf16 = state_is_bf16
        self._compiled = compiled
        # a cached kernel is found from the program and sizes alone: no rendering, no compiler run
        split = f" parts={parts}" if parts > 1 else ""  # (the unsplit kernels keep the alias they had)
        # (the program's name beside its source: each stage of a program derived in stages is a program of its
        # own with the whole program's source, compiler.stage_compiled)
        alias = c_build.alias_key("recurrent", compiled.source, compiled.name, repr(sorted(self.dims.items())),
                                  repr(self.target), repr(kernel_tunables()) + split,
                                  *(["bfloat16 state"] if state_is_bf16 else []))
        self.module = c_build.load_alias(alias)
        if self.module is None:
            gen = recurrent_source(compiled, self.dims, self.target, state_is_bf16, parts)
            label = f"{compiled.name}_{self.target.ctype}" + ("_bf16" if state_is_bf16 else "")
            self.module = c_build.build(gen.source(), gen.cdef(), label, alias)
        self.ffi, self.lib = self.module.ffi, self.module.lib
        self.ctype = self.target.ctype
        self.ptr = self.ctype + "[]"

    @property
    def source(self) -> str:
        return recurrent_source(self._compiled, self.dims, self.target, self.state_is_bf16, self.parts).source()


class CRecurrent:
    """What `load(compiled, "recurrent")` returns: forward and a decode step, kernels built lazily."""

    form = "recurrent"
    # lr_forward tests the declared value ranges as it reads (run() need not scan first) and starts from zeros
    # when given no initial state (run() need not make and copy them); the step binds to arrays (c.step)
    capabilities = Capabilities(checks_ranges=True, zero_states=True, binds_steps=True, largest_count=C_INT_MAX)

    def __init__(self, compiled: Compiled):
        _require(compiled, "recurrent")
        self.compiled = compiled
        self.program = compiled.program
        # a program the fused kernel takes only stage by stage runs its sequences so (c.staged_recurrent); its
        # decode step stays the statement kernel of the program as written
        stages = staged_recurrent.sequence_stages(compiled)
        self._staged = None if stages is None else staged_recurrent.StagedSequence(compiled, stages, CRecurrent)
        # the fused kernel writes the states asked for (checkpoints, the last K) as it passes them
        fused = support.fused_refusal(compiled) is None
        self.capabilities = replace(CRecurrent.capabilities, snapshots=fused or stages is not None,
                                    checks_ranges=stages is None or staged_recurrent.checks_every_range(compiled,
                                                                                                       stages),
                                    steps_slots=fused and compiled.program.causal,
                                    bfloat16_steps=fused and compiled.program.causal)
        self._kernels: dict[tuple, Kernel] = {}
        self._lock = fork.Lock()  # (held through a build; free in a forked child: fork.py)
        self._outputs = RecycledArrays(keep=2 * len(self.program.outputs))  # this call's and the last one's
        # stabilized states' log-scales ("S.log_scale", [B, H]): the kernels' arguments after the states
        self.scales = [(gr["key"], gr["states"]) for gr in Scales(compiled).groups]
        self._value_axis = value_split.value_axis(compiled)  # None: each head runs whole on one thread

    def kernel(self, dtype, dims: dict[str, int], state_is_bf16: bool = False, parts: int = 1) -> Kernel:
        """The built kernel for one dtype and sizes; state_is_bf16: the one whose decode steps keep the states
        in bfloat16 (float32 only); parts > 1: over that many parts of the value axis."""
        dtype = np.dtype(dtype)
        if dtype not in CTYPES:
            raise RuntimeInputError(f"the C backend runs float32 or float64 arrays, not {dtype}")
        used = {d.name: int(dims[d.name]) for d in self.program.dims}
        key = (dtype.str, tuple(sorted(used.items())), c_build.target_key(), kernel_tunables(), state_is_bf16, parts)
        k = self._kernels.get(key)
        if k is None:
            with self._lock:
                k = self._kernels.get(key)
                if k is None:
                    k = self._kernels[key] = Kernel(self.compiled, used, dtype, state_is_bf16, parts)
        return k

    def value_parts(self, dtype, dims: dict[str, int], heads: int, tokens: int, threads: int) -> int:
        """Parts of the value axis a prefill of `heads` (batch row, head) pairs should run in (1: none): when
        the threads its work pays for outnumber the heads and the program allows it (value_split.py)."""
        if self._value_axis is None or threads <= heads:
            return 1
        size = int(dims[self._value_axis])
        lanes = Target(CTYPES[np.dtype(dtype)], c_build.vector_bytes()).lanes
        work = tokens * heads * c_fused.token_work(self.compiled, dims)
        return value_split.value_parts(size, lanes, heads, threads, work, kernel_source.THREAD_WORK)

    def source(self, dtype=np.float32, dims: dict[str, int] | None = None) -> str:
        return emit_recurrent(self.compiled, dtype, dims)

    # ---- argument checks: shapes and dtypes, never a segfault ----
    def _arrays(self, inputs, params, states, dims, lead: tuple, state_lead: tuple, dtype,
                copy_states: bool):
        p = self.program
        args = []
        for x in p.inputs:
            if x.name not in inputs:
                raise RuntimeInputError(f"missing input '{x.name}'")
            args.append(checked(inputs[x.name], lead + tuple(dims[d] for d in x.shape), dtype,
                                 f"input '{x.name}'"))
        heads = lead[-1]
        for prm in p.params:
            if prm.name not in params:
                raise RuntimeInputError(f"missing parameter '{prm.name}'")
            shape = ((heads,) if prm.per_head else ()) + tuple(dims[d] for d in prm.shape)
            arr = checked(params[prm.name], shape, None, f"parameter '{prm.name}'")
            args.append(np.ascontiguousarray(arr, dtype=dtype))
        finals = {}
        for s in p.states:
            shape = state_lead + tuple(dims[d] for d in s.shape)
            if states is None or s.name not in states:
                arr = aligned_zeros(shape, dtype)
            else:
                arr = checked(states[s.name], shape, dtype, f"state '{s.name}'")
                if copy_states:
                    arr = aligned_copy(arr)
            finals[s.name] = arr
            args.append(arr)
        for key, _ in self.scales:  # NaN: the states are at their true scale
            given = None if states is None else states.get(key)
            arr = np.full(state_lead, np.nan, dtype) if given is None else \
                np.array(checked(given, state_lead, None, f"state '{key}'"), dtype=dtype)
            finals[key] = arr
            args.append(arr)
        return args, finals

    def forward(self, inputs, params, initial_state, dims, chunk_size=None, num_threads=None, out=None):
        """Inputs [B, T, H, *], params as from default_params, initial states [B, H, *] (not modified).
        Returns (outputs [B, T, H, *], final states [B, H, *]). `out` may hold preallocated output arrays
        (C-contiguous, right shape and dtype) to write into: a new array's first touch costs page faults."""
        if self._staged is not None:
            return self._staged.forward(inputs, params, initial_state, dims, num_threads, out)
        outputs, finals, _ = self._run(inputs, params, initial_state, dims, num_threads, out, None)
        return outputs, finals

    def forward_snapshots(self, inputs, params, initial_state, dims, stops, num_threads=None, into=None):
        """forward, and the states after each of the token counts `stops` (increasing, in 1 … T), written
        by the fused kernel as it passes them: (outputs, final states, snapshots [B, len(stops), H, *] by
        name). Stabilized states come as the final ones do: with their log-scale ([B, len(stops), H]) when
        the initial states have one, else at their true scale. `into`: arrays to write states' snapshots in
        instead, by name, each C-contiguous [B, H, len(stops) + 1, *] in the inputs' dtype — the state after
        stops[i] at [:, :, i + 1] (index 0 the caller's: the chunk backward puts the initial state there) —
        whose snapshots are then those arrays' [:, :, 1:]."""
        if self._staged is not None:
            return self._staged.forward_snapshots(inputs, params, initial_state, dims, stops, num_threads, into)
        return self._run(inputs, params, initial_state, dims, num_threads, None, stops, into or {})

    def _run(self, inputs, params, initial_state, dims, num_threads, out, stops, into=None):
        p = self.program
        if not p.inputs:
            raise RuntimeInputError("the program has no inputs to take B, T and H from")
        first = np.asarray(inputs[p.inputs[0].name]) if p.inputs[0].name in inputs else None
        if first is None or first.ndim < 3:
            raise RuntimeInputError(f"input '{p.inputs[0].name}' should have shape [B, T, H, …]")
        batch, tokens, heads = first.shape[:3]
        dtype = first.dtype
        if dtype not in CTYPES:
            raise RuntimeInputError(f"input '{p.inputs[0].name}' has dtype {dtype}; pass float32 or float64")
        k = self.kernel(dtype, dims)
        args, finals = self._arrays(inputs, params, initial_state, k.dims, (batch, tokens, heads),
                                    (batch, heads), dtype, copy_states=True)
        outputs = {}
        for o in p.outputs:
            shape = (batch, tokens, heads) + tuple(k.dims[d] for d in o.value.shape)
            given = (out or {}).get(o.name)
            outputs[o.name] = self._outputs.take(shape, dtype) if given is None else \
                arrays.out_array(given, f"out['{o.name}']", shape, dtype)
        threads = c_build.thread_count(num_threads)
        parts = self.value_parts(dtype, k.dims, batch * heads, tokens, threads) if stops is None else 1
        if parts > 1:  # fewer heads than threads: (head, part of the value axis) as the unit of work
            k = self.kernel(dtype, dims, parts=parts)
        fb, ptr = k.ffi.from_buffer, k.ptr
        cargs = [fb(ptr, a) for a in args] + [fb(ptr, outputs[o.name]) for o in p.outputs]
        snapshots = {}
        if stops is not None:
            stops = np.ascontiguousarray(stops, dtype=np.int64)
            lead = (batch, len(stops), heads)
            if into and (self.scales or set(into) != {st.name for st in p.states}):
                raise RuntimeInputError(f"forward_snapshots(into=…) takes an array for every state "
                                        f"({', '.join(st.name for st in p.states)}) and no stabilized state (their "
                                        "snapshots come with a log-scale)")
            shapes = {st.name: tuple(k.dims[d] for d in st.shape) for st in p.states}
            # (into: the kernel writes every element of each but index 0 of its third axis)
            snapshots = {st.name: arrays.out_array(into[st.name], f"into['{st.name}']",
                                                   (batch, heads, len(stops) + 1) + shapes[st.name], dtype)
                         if st.name in into else
                         np.empty(lead + shapes[st.name], dtype) for st in p.states}
            snapshots |= {key: np.empty(lead, dtype) for key, _ in self.scales}
            pointers = [fb(ptr, a) for a in snapshots.values()]  # (kept alive through the call)
            # (into: [B, H, n + 1, *], written from index 1 — the strides of (batch row, stop, head) in states)
            firsts = [a + (int(np.prod(shapes[name])) if name in into else 0)
                      for name, a in zip(snapshots, pointers)]
            strides = fb("int64_t[]", np.array([heads * (len(stops) + 1), 1, len(stops) + 1], np.int64)) \
                if into else k.ffi.NULL
            cargs += [fb("int64_t[]", stops), len(stops), k.ffi.new(f"{k.ctype} *[]", firsts), strides]
        if batch * tokens * heads:
            require_c_int_sizes(batch=batch, tokens=tokens, heads=heads)
            entry = k.lib.lr_forward if stops is None else k.lib.lr_forward_snapshots
            rc = entry(*cargs, batch, tokens, heads, threads) if stops is None else \
                entry(*cargs[:-4], batch, tokens, heads, threads, *cargs[-4:])
            if rc == 2:  # an input outside its declared range: find it and say where
                arrays.check_ranges(p, dict(zip((x.name for x in p.inputs), args)))
                raise RuntimeInputError("an input lies outside its declared range")  # (the scan names it)
            if rc != 0:
                raise MemoryError("the C kernel could not allocate its state buffers")
        for key, names in self.scales:
            if (initial_state or {}).get(key) is None:  # a caller with no log-scale gets the true scale back
                scale = finals.pop(key)
                for name in names:
                    finals[name] = _true_scale(finals[name], scale, dtype)
                if snapshots:  # (each snapshot a state of its own: [B·n, H, *])
                    scale = snapshots.pop(key)
                    for name in names:
                        kept = snapshots[name]
                        flat = _true_scale(kept.reshape((-1,) + kept.shape[2:]), scale.reshape(-1, heads), dtype)
                        snapshots[name] = flat.reshape(kept.shape)
        for name in into or ():
            snapshots[name] = snapshots[name][:, :, 1:]
        return outputs, finals, snapshots

    def step(self, token_inputs, state, params, dims, num_threads=None, inplace=False, out=None):
        """One token: inputs [B, H, *], states [B, H, *]. Returns (outputs [B, H, *], states). With
        inplace=True the given state arrays (C-contiguous, of the inputs' dtype) are updated and returned."""
        return self.stepper(params, dims, num_threads)(token_inputs, state, inplace=inplace, out=out)

    def stepper(self, params, dims, num_threads=None, state_is_bf16: bool = False) -> "Stepper":
        """The decode step bound to params and sizes; state_is_bf16: states as bfloat16 bits (uint16 arrays),
        widened and rounded by the kernel (capabilities.bfloat16_steps)."""
        return Stepper(self, params, dims, num_threads, state_is_bf16)

    def slot_step(self, params, dims, state_is_bf16: bool = False) -> SlotStep:
        """The decode step over a pool of states, by slot (capabilities.steps_slots: the fused kernel's)."""
        return SlotStep(self, params, dims, state_is_bf16)

def _true_scale(state: np.ndarray, log_scale: np.ndarray, dtype) -> np.ndarray:
    """A state [B, H, *] carried as S·exp(−σ), σ [B, H] (NaN: 0), back at its true scale S."""
    if state.ndim == 4:  # a matrix state
        return rescale(state, log_scale, None, dtype)
    return rescale(state[..., None], log_scale, None, dtype)[..., 0]


def emit_recurrent(compiled: Compiled, dtype=np.float32, dims: dict[str, int] | None = None) -> str:
    """The C source of the recurrent form (and decode step) for one dtype and sizes (default: the file's)."""
    _require(compiled, "recurrent")
    sizes = {d.name: d.default for d in compiled.program.dims} | dict(dims or {})
    target = Target(CTYPES[np.dtype(dtype)], c_build.vector_bytes())
    return recurrent_source(compiled, sizes, target).source()


def emit_recurrent_form(compiled: Compiled, dtype=np.float32, dims: dict[str, int] | None = None) -> str:
    """What the recurrent form runs on C, to read: its kernel; or, where its sequences run stage by stage
    (c.staged_recurrent), each stage's fused kernel and then the program's own, which the decode step runs
    (each a compilation unit of its own: they define the same entry points)."""
    stages = staged_recurrent.sequence_stages(compiled)
    whole = emit_recurrent(compiled, dtype, dims)
    if stages is None:
        return whole
    parts = [f"/* ==== {stage.header()}: its sequences' fused kernel ==== */\n"
             + emit_recurrent(stage_compiled(compiled, stage), dtype, dims) for stage in stages]
    parts.append("/* ==== the decode step (lr_step): the program as written, its statements one by one ==== */\n"
                 + whole)
    return "\n\n".join(parts)


def _require(compiled: Compiled, form: str) -> None:
    why = why_not(compiled, form)
    if why:
        raise LinrecError(f"the C backend does not build the {form} form of '{compiled.name}': {why}; "
                          f"{NUMPY_RUNS_IT}")


NUMPY_RUNS_IT = "the NumPy backend (backend='numpy') runs it"


def recurrent_kernel(compiled: Compiled) -> str:
    """How C runs the recurrent form (once why_not says it does): one fused kernel (c.fused), the
    statements one by one (c.statements), or a NumPy-prepared scan (c.scan: non-causal programs with
    exponential keys)."""
    if _scan_form(compiled, "recurrent"):
        return SCAN
    return FUSED if support.fused_refusal(compiled) is None else STATEMENTS


def _scan_form(compiled: Compiled, form: str) -> bool:
    """Parallel and chunkwise forms — and the recurrent form of non-causal programs with exponential
    feature maps, which are stabilized on their decomposition — run as NumPy-prepared scans over compiled
    kernels (the fused kernel stabilizes causal ones itself: c.stabilize)."""
    return form != "recurrent" or (bool(stabilized_states(compiled)) and not compiled.program.causal)


def _exec_module(source: str, compiled: Compiled, form: str, what: str, capabilities: Capabilities):
    module = numpy_backend.module_from_source(source, compiled, form, what)
    module.form = form
    module.capabilities = capabilities
    return module


def _sequence_source(compiled: Compiled, form: str, dtype=np.float32, dims=None) -> str:
    """The attention kernels' C source at the program's default sizes, after the NumPy glue that calls it."""
    glue = numpy_sequence.emit(compiled, form, kernels=c_attention.__name__)
    sizes = {d.name: d.default for d in compiled.program.dims} | dict(dims or {})
    plan = compiled.decomposition.sequence
    glue = "\n".join(c_comment_text(line) for line in glue.split("\n"))
    parts = [f"/* NumPy glue that prepares the arrays and calls the kernels below:\n\n{glue}\n*/"]
    for r in plan.softmax_readouts:
        keys, _, values = numpy_sequence.kernel_pattern(r)
        parts.append(c_attention.source(dtype, sizes[keys.shape[-1]], sizes[values.shape[-1]]))
    if plan.kind == "lsh":
        q_dim = next(x for x in compiled.program.inputs if len(x.shape) == 1)
        parts.append(c_attention.source(dtype, sizes[q_dim.shape[0]], sizes[q_dim.shape[0]]))
    return "\n\n".join(parts)


def emit(compiled: Compiled, form: str, **options) -> str:
    """The C source of a form (with, where NumPy prepares the arrays, the generated glue in a comment)."""
    _require(compiled, form)
    if compiled.decomposition.sequence is not None:
        return _sequence_source(compiled, form, **options)
    if _scan_form(compiled, form):
        return c_scan.emit(compiled, "chunkwise" if form == "recurrent" else form, **options)
    return emit_recurrent_form(compiled, **options)


def load(compiled: Compiled, form: str):
    _require(compiled, form)
    if compiled.decomposition.sequence is not None:
        return _exec_module(numpy_sequence.emit(compiled, form, kernels=c_attention.__name__), compiled, form,
                            "C attention", Capabilities(
                                decodes_over_cache=numpy_sequence.kernels_decode_over_cache(compiled),
                                largest_count=C_INT_MAX))
    if form == "recurrent" and _scan_form(compiled, form):
        return _exec_module(emit_derived(compiled, "recurrent", scan_module=c_scan.__name__),
                            compiled, form, "C scan", Capabilities(largest_count=C_INT_MAX))
    if form != "recurrent":
        return c_scan.load(compiled, form)
    return CRecurrent(compiled)


def fused_why_not(compiled: Compiled) -> str | None:
    """Why the fused recurrent kernel (c.fused) does not take the program, or None when it does."""
    return support.fused_refusal(compiled)


def why_not(compiled: Compiled, form: str) -> str | None:
    """Why this backend does not build `form` of the program (a reason about the program, without advice),
    or None when it does; from the program's structure (c.support), no code is generated. The recurrent form
    of a recurrence is the fused kernel's or, where that does not take it, the statement kernel's (c.statements),
    whose reason is then the one that counts."""
    refused = no_such_form(compiled, form)
    if refused:
        return refused.reason
    if compiled.decomposition.sequence is not None:
        return numpy_sequence.kernel_support(compiled)
    if _scan_form(compiled, form):
        return c_scan.why_not(compiled)
    if support.fused_refusal(compiled) is None:
        return None
    return support.statements_refusal(compiled)

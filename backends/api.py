"""The Python API: compile a program, emit its forms, call them on NumPy arrays.

    import linrec as linrec
    rec = linrec.load("examples/gla.lin")            # or linrec.compile("recurrence …")
    res = rec.run(q=q, k=k, v=v, g=g, form="chunkwise")
    res.outputs["o"], res.final_state["S"]
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from . import (arrays, bf16_state, compiler, float_warnings, form_choice, gradient_choice, gradients, packed_vjp,
               registry, serving, slot_pool)
from .c import build as c_build
from .compiler import Compiled
from .compiler import ir
from .compiler.analysis import refs
from .compiler.constants import check_constants, program_expressions
from .compiler.stabilize import log_scale_keys
from .dsl.errors import LinrecError, RuntimeInputError
from .interface import DEFINITION, FormModule
from .registry import NUMPY

PLANS_KEPT = 32  # call signatures whose plans run() keeps (the oldest goes first)


@dataclass
class Result:
    """A run's arrays by DSL name. The serving fields (docs/serving.md) are empty unless asked for:
    `checkpoints` [B, T // C, H, *] (state_every=C; with cu_seqlens [1, Σ ⌊len_i / C⌋, H, *], sequence i's at
    checkpoint_offsets[i]:checkpoint_offsets[i + 1]), `last_states` [B, K, H, *] (keep_last=K)."""
    outputs: dict[str, np.ndarray]
    final_state: dict[str, np.ndarray]
    params: dict[str, np.ndarray] = field(default_factory=dict)
    checkpoints: dict[str, np.ndarray] = field(default_factory=dict)
    last_states: dict[str, np.ndarray] = field(default_factory=dict)
    checkpoint_offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def _warnings_at_program(method):
    """NumPy's floating-point warnings during the call at the program's place, not the generated code's
    (float_warnings)."""
    @functools.wraps(method)
    def told_at_program(self, *args, **kwargs):
        with float_warnings.at_program(self.compiled, self._float_warnings):
            return method(self, *args, **kwargs)
    return told_at_program


class Recurrence:
    """A checked program and its generated forms (built once per backend and form, then reused)."""

    def __init__(self, compiled: Compiled):
        self.compiled = compiled
        self.program = compiled.program
        self.decomposition = compiled.decomposition
        self._modules: dict[tuple[str, str], object] = {}
        self._per_thread = _PerThread()  # each thread's compiled steps (see _PerThread)
        # a token call's sizes and params by (backend, [B, H], dtype, sizes, state shapes) → (params, dims, used):
        # a step that is not one compiled call (the NumPy backend's) would otherwise draw its params every token
        self._token_binds: dict[tuple, tuple] = {}
        self._plans: dict[tuple, _CallPlan] = {}  # run()'s plans by call signature (see _signature)
        self._sizes_checked: set[tuple] = set()   # sizes at which the program's constants are finite
        self._float_warnings: dict = {}  # NumPy's warnings told at the program's place, each once (float_warnings)

    @property
    def name(self) -> str:
        return self.program.name

    @property
    def forms(self) -> tuple[str, ...]:
        return self.decomposition.forms

    @property
    def warnings(self) -> tuple:
        """What the compiler found legal but suspicious (dsl.errors.LinrecWarning: declared inputs, params,
        values or functions that nothing uses), in source order; str(w) shows the place."""
        return self.compiled.warnings

    def __repr__(self) -> str:
        return f"<Recurrence '{self.name}' ({self.compiled.filename}): forms {', '.join(self.forms)}>"

    def __reduce__(self):
        """Pickled (copy.deepcopy, torch.save of a model that holds one, multiprocessing) as its source: the
        copy compiles it again, and its kernels load from the kernel cache when first used (the generated
        modules and bound calls held here are the process's own)."""
        return compile, (self.compiled.source, self.compiled.filename)

    # ---- code ----
    def _check_form(self, form: str, backend_name: str):
        """An error unless the backend builds this form of the program (the form's absence first)."""
        chosen = registry.backend(backend_name)
        if form == DEFINITION and chosen.why_not(self.compiled, form) is None:
            return  # the statements as written (verify's reference, see interface.DEFINITION)
        if form not in compiler.FORMS:
            raise RuntimeInputError(arrays.unknown_form(form, compiler.FORMS))
        why = self.decomposition.why_not(form)
        if why:
            raise LinrecError(f"'{self.name}' has no {form} form: {why}. Its forms: {', '.join(self.forms)}")
        refusal = chosen.why_not(self.compiled, form)
        if refusal:
            raise LinrecError(f"the {backend_name} backend does not build the {form} form of '{self.name}': "
                              f"{refusal}")

    def emit(self, form: str = "recurrent", backend: str = "numpy", dims: dict[str, int] | None = None) -> str:
        """The generated source of a form. `dims`: sizes (by dimension name; the others the file's) for a backend
        that compiles them into its code — C's kernels, whose tiles, strips and blocks follow the head size; the
        NumPy source takes its sizes when it runs, and refuses them here."""
        self._check_form(form, backend)
        chosen = registry.backend(backend)
        if dims is not None and not isinstance(dims, Mapping):
            raise RuntimeInputError(f"dims must be a dict of dimension name → size, got a {type(dims).__name__}")
        if not dims:
            return chosen.emit(self.compiled, form)
        if not chosen.compiles_sizes:
            raise LinrecError(f"the {backend} backend's source takes its sizes when it runs (`dims` of run), not "
                              f"when it is generated: leave out dims, or emit the C kernels (backend='c') at them")
        return chosen.emit(self.compiled, form, dims=arrays.checked_sizes(self.program, dims))  # (others: the file's)

    def module(self, form: str = "recurrent", backend: str = "numpy") -> FormModule:
        key = (backend, form)
        if key not in self._modules:
            self._check_form(form, backend)
            self._modules[key] = registry.backend(backend).load(self.compiled, form)
        return self._modules[key]

    # ---- arrays ----
    def default_params(self, heads: int, dims: dict[str, int] | None = None,
                       given: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The file's parameter defaults for `heads` heads (float64; per-head ones as [H, *]), except those
        `given`: a default computed from another param uses the given value of that one. A param without a
        default is None, and so is one whose default reads such a param not given (the caller passes them).
        Whatever backend runs the forms, the defaults are the NumPy backend's code (seeded draws included), so
        both agree."""
        sizes = {d.name: d.default for d in self.program.dims} | arrays.checked_sizes(self.program, dims)
        self._check_constants(sizes)
        given = dict(given or {})
        with np.errstate(all="ignore"):  # (a definition that overflows is reported below, with its place)
            values = self.module(self.forms[0], NUMPY.name).default_params(heads, sizes, given)
        for prm in self.program.params:
            value = values.get(prm.name)
            # (a default computed from a param the caller gave non-finite is the caller's value: A_log = +∞
            # makes A = −∞, a decay of 0, which resets — guarantees.md)
            sources = refs(prm.default, ir.ParamRef) if prm.default is not None else []
            if any(n in given and not np.all(np.isfinite(given[n])) for n in sources):
                continue
            if prm.name not in given and value is not None and not np.all(np.isfinite(value)):
                at = tuple(int(i) for i in np.argwhere(~np.isfinite(np.atleast_1d(value)))[0])
                raise RuntimeInputError(
                    f"the default of '{prm.name}' is not finite ({float(np.atleast_1d(value)[at]):g} at index "
                    f"{list(at)}, with {heads} head(s)): its definition overflows or divides by zero there; pass "
                    f"'{prm.name}' or change its definition", prm.span).located(self.compiled.source,
                                                                             self.compiled.filename)
        return values

    def _check_constants(self, sizes: dict[str, int]) -> None:
        """The program's constants folded again at a call's sizes where they differ from the header's (which
        the compiler checked): `dk^8` can overflow, `1/(dk − 4)` divide by zero, at other sizes."""
        key = tuple(sorted(sizes.items()))
        if key in self._sizes_checked:
            return
        if any(sizes.get(d.name) != d.default for d in self.program.dims):
            def error(message, span):
                return RuntimeInputError(f"with this call's sizes, {message}", span).located(
                    self.compiled.source, self.compiled.filename)
            for e in program_expressions(self.program):
                check_constants(e, sizes, error)
        self._sizes_checked.add(key)

    def random_inputs(self, batch: int = 2, tokens: int = 16, heads: int = 2, dims: dict | None = None,
                      dtype=np.float64, seed: int = 0, decay_scale: float = 1.0) -> dict[str, np.ndarray]:
        sizes = {d.name: d.default for d in self.program.dims} | dict(dims or {})
        return arrays.random_inputs(self.program, batch, tokens, heads, sizes, dtype, seed, decay_scale)

    def choose_form(self, backend: str, tokens: int, heads: int = 8, batch: int = 1,
                    dims: dict[str, int] | None = None, dtype=np.float32) -> tuple[str, str]:
        """The form `auto` picks for a call, and why (see form_choice: compiled code runs the recurrent
        form; NumPy's choice is measured once per heads, sizes and dtype)."""
        registry.backend(backend)  # (an unknown name is an error)
        return form_choice.choose(self, backend, tokens, heads, batch, dims, dtype)

    @_warnings_at_program
    def run(self, inputs: dict | None = None, *, form: str = "auto", backend: str = "numpy",
            params: dict | None = None, initial_state: dict | None = None, chunk_size: int | None = None,
            dims: dict[str, int] | None = None, threads: int | None = None, state_every: int | None = None,
            keep_last: int | None = None, cu_seqlens=None, state_dtype=None, **named_inputs) -> Result:
        """Run a form. Inputs [B, T, H, *] by DSL name (a dict, keywords, or both); initial states
        [B, H, *] (zeros when absent); params override the file's defaults (per-head ones [H, *]);
        `threads`: for the C backend (default LINREC_NUM_THREADS, else every core). `chunk_size`: tokens per
        chunk of the chunkwise form (a positive integer; one longer than the sequence is the whole sequence).
        Serving (docs/serving.md): `state_every=C` returns res.checkpoints, the states after every C-th token;
        `keep_last=K` res.last_states, the states after each of the last K tokens; `cu_seqlens` (an int array
        [N + 1] of offsets) runs packed sequences: inputs [1, T_total, H, *], states [N, H, *].
        `state_dtype="bfloat16"` (float32 inputs): initial and returned states are uint16 arrays of bfloat16
        bits, widened to float32 at entry and rounded at exit (backends/bf16_state.py)."""
        given = arrays.inputs_by_name(inputs, named_inputs, self.program, Recurrence.run)
        arrays.require_dicts(initial_state=initial_state, params=params)
        if bf16_state.resolve(state_dtype, given):
            if not self.program.states:
                raise RuntimeInputError(bf16_state.no_state_refusal(self.name))
            result = self.run(given, form=form, backend=backend, params=params,
                              initial_state=bf16_state.widen(self.program, initial_state, "initial state"),
                              chunk_size=chunk_size, dims=dims, threads=threads, state_every=state_every,
                              keep_last=keep_last, cu_seqlens=cu_seqlens)
            return bf16_state.narrow_result(self.program, result)
        chunk = arrays.check_chunk_size(chunk_size)
        every, last = serving.check_state_every(state_every), serving.check_keep_last(keep_last)
        offsets = serving.check_cu_seqlens(cu_seqlens)
        if offsets is not None:
            why = serving.why_not_packed(self.program, self.decomposition.sequence)
            if why:
                raise RuntimeInputError(f"'{self.name}' does not take cu_seqlens: {why}")
        signature = _signature(given, initial_state, form, backend, params, dims)
        plan = self._plans.get(signature) if signature is not None else None
        if plan is None:
            checked, plan = self._plan(given, form, backend, params, initial_state, dims)
            if signature is not None:
                _remember(self._plans, signature, plan)
        else:
            checked = given  # arrays of the names, shapes and dtypes that were checked when the plan was made
        if offsets is not None:
            serving.check_packed_call(offsets, plan.shape.batch, plan.shape.tokens)
            serving.check_packed_states(initial_state, len(offsets) - 1)
        serving.check_keep_last_fits(last, np.diff(offsets) if offsets is not None else [plan.shape.tokens])
        able = plan.module.capabilities
        if able.largest_count is not None:
            arrays.require_counts(plan.shape, able.largest_count, backend)
        if not able.checks_ranges:
            arrays.check_ranges(self.program, checked)
        if offsets is not None:  # one initial state per packed sequence (made here when absent, for the empty ones)
            state0 = arrays.check_initial_state(self.program, initial_state,
                                                replace(plan.shape, batch=len(offsets) - 1), plan.dims,
                                                self._log_scales)
        elif initial_state is None and able.zero_states:
            state0 = None
        else:
            state0 = arrays.check_initial_state(self.program, initial_state, plan.shape, plan.dims,
                                                self._log_scales)
        if chunk is not None:  # clamped to T for every form and backend: no chunk size overflows a kernel's int
            chunk = min(chunk, max(plan.shape.tokens, 1))
        with c_build.threads(threads) if threads is not None else nullcontext():
            if offsets is None and every is None and last is None:
                outputs, final = _forward(plan, checked, state0, chunk)
                return Result(outputs, final, dict(plan.params))
            return self._serve(plan, checked, state0, chunk, every, last, offsets)

    def _serve(self, plan: "_CallPlan", checked: dict, state0, chunk, every, last, offsets) -> Result:
        """run() with the states a serving engine asks for, or packed sequences (backends/serving.py): the
        kernel writes the states as it passes them where it can (capabilities.snapshots), else the plan's
        form runs over segments, each started from the state the previous one ended with."""
        def forward(inputs, state):
            tokens = next(iter(inputs.values())).shape[1]
            return _forward(plan, inputs, state, None if chunk is None else min(chunk, tokens))
        snapshots = None
        if plan.module.capabilities.snapshots and plan.nonfinite_tail is None:  # the kernel writes them itself
            def snapshots(inputs, state, stops):
                return plan.module.forward_snapshots(inputs, plan.params, state, plan.dims, stops)
        how = dict(every=every, last=last, causal=self.program.causal, stateful=bool(self.program.states),
                   scales=self._log_scales, snapshots=snapshots)
        if offsets is None:
            served, checkpoint_offsets = serving.run_sequence(forward, checked, state0, **how), None
        else:
            served, checkpoint_offsets = serving.run_packed(forward, checked, state0, offsets, **how)
        result = Result(served.outputs, served.final, dict(plan.params), served.checkpoints, served.last_states)
        if checkpoint_offsets is not None:
            result.checkpoint_offsets = checkpoint_offsets
        return result

    def _plan(self, given: dict, form: str, backend: str, params: dict | None, initial_state: dict | None,
              dims: dict[str, int] | None) -> tuple[dict, "_CallPlan"]:
        """What a call's array shapes and options decide: the form, its module, the sizes and the params (the
        file's defaults, or the caller's, checked and converted). Raises on names, shapes or dtypes that do
        not fit the program. Returns the inputs as arrays, and the plan."""
        checked, shape = arrays.check_inputs(self.program, given, ranges=False)
        if form == "auto":
            sizes = arrays.resolve_dims(self.program, shape, dict(params or {}), initial_state, dims)
            form, _ = self.choose_form(backend, shape.tokens, shape.heads, shape.batch, sizes, shape.dtype)
        module = self.module(form, backend)
        sizes, used = self.bind(module, shape, params, initial_state, dims)
        for value in used.values():
            value.flags.writeable = False  # shared by the calls of this plan and their results
        return checked, _CallPlan(module, shape, sizes, used, self._nonfinite_tail(form, backend),
                                  self.program.causal)

    def _nonfinite_tail(self, form: str, backend: str):
        """The module that runs the tokens from the first non-finite one on (docs/guarantees.md#non-finite-
        values) where the form does not keep the rule itself: the recurrent form over the KV cache, for the
        other forms of a program that reads the sequence through attention. Their products mask the attention
        weights, not the values, and a masked weight 0 times a later token's NaN is NaN. (A non-causal program
        runs all of its tokens so, from the first: with a window, a token sees only some of the others.) None
        for every other form (the scans keep the rule in their kernels)."""
        if self.decomposition.sequence is None or form == "recurrent" or "recurrent" not in self.forms:
            return None
        module = self.module("recurrent", backend)
        return module if module.capabilities.decodes_over_cache else self.module("recurrent", NUMPY.name)

    __call__ = run

    @functools.cached_property
    def _log_scales(self) -> frozenset[str]:
        """The log-scales a decode loop carries beside stabilized states ("S.log_scale")."""
        return frozenset(log_scale_keys(self.compiled).values())

    def bind(self, module, shape: arrays.CallShape, params: dict | None = None, initial_state: dict | None = None,
             dims: dict[str, int] | None = None) -> tuple[dict[str, int], dict[str, np.ndarray]]:
        """The sizes and the parameters of a call: (dims, params used in the inputs' dtype). Caller-given
        params override the file's defaults, and defaults computed from other params use the given ones."""
        params = dict(params or {})
        dims = arrays.resolve_dims(self.program, shape, params, initial_state, dims)
        arrays.check_sequence_length(self.program, shape, dims)
        given_f64 = {k: np.asarray(v, dtype=np.float64)
                     for k, v in arrays.check_given_params(self.program, params, shape, dims).items()}
        defaults = {k: v for k, v in self.default_params(shape.heads, dims, given_f64).items()
                    if k not in params}
        return dims, arrays.check_params(self.program, params, defaults, shape, dims)

    # ---- gradients (docs/gradients.md) ----
    def vjp(self, inputs: dict, grad_outputs: dict | None = None, *, form: str = "recurrent",
            backend: str = "numpy", grad_final_state: dict | None = None, initial_state: dict | None = None,
            params: dict | None = None, dims: dict[str, int] | None = None, chunk_size: int | None = None,
            missing: str = "error", cu_seqlens=None, threads: int | None = None) -> gradients.VjpResult:
        """The forward and its vector–Jacobian product: given the gradient of a loss with respect to every
        output [B, T, H, *] (`grad_outputs`, by output name) and optionally to the final states [B, H, *]
        (`grad_final_state`), the gradients of every input, param and initial state (`result.grads`, by name;
        per-head params [H, *], shared ones summed over heads). An output without a gradient is an error
        unless missing="zero". `form`: a gradient form, or "auto" — on C from 1024 tokens on, the faster of the
        recurrent and the chunkwise backward as measured once per process (backends/gradient_choice.py), else
        the recurrent one (without one, the chunkwise one, else the parallel one). `chunk_size`: tokens between
        the forward's checkpoints (default √T). `threads`: for the C backend, as in run(). `cu_seqlens`: packed
        variable-length sequences, as run() takes them — inputs, outputs and their gradients [1, T_total, H, *],
        initial and final states and their gradients [N, H, *] (backends/packed_vjp.py)."""
        arrays.require_dicts(grad_final_state=grad_final_state, initial_state=initial_state, params=params)
        offsets = serving.check_cu_seqlens(cu_seqlens)
        with c_build.threads(threads):
            if form == "auto":
                form = gradient_choice.form_for_call(self, inputs, backend, params, initial_state, dims, offsets)
            if offsets is not None:  # (a stabilized state with its log-scale: at its true scale, as unpacked)
                initial_state = gradients.at_true_scale(self, initial_state)
                return packed_vjp.vjp_packed(self, inputs, grad_outputs, offsets, form=form, backend=backend,
                                             grad_final_state=grad_final_state, initial_state=initial_state,
                                             params=params, dims=dims, chunk_size=chunk_size, missing=missing)
            return gradients.vjp(self, inputs, grad_outputs, form=form, backend=backend,
                                 grad_final_state=grad_final_state, initial_state=initial_state, params=params,
                                 dims=dims, chunk_size=chunk_size, missing=missing)

    def emit_gradient(self, form: str = "recurrent", backend: str = "numpy") -> str:
        """The generated source of a form's backward."""
        return gradients.emit(self, form, backend)

    # ---- decode: prefill a prompt, then one token at a time with O(1) state ----
    def prefill(self, inputs: dict | None = None, *, backend: str = "numpy", params: dict | None = None,
                initial_state: dict | None = None, dims: dict[str, int] | None = None,
                state_every: int | None = None, keep_last: int | None = None, cu_seqlens=None,
                state_dtype=None, threads: int | None = None, **named_inputs) -> Result:
        """Run the recurrent form over a prompt; `result.final_state` is the state to `step` from.
        Stabilized states come back scaled, with their log-scale ("S.log_scale"), for the steps to go on
        (checkpoints and last states too). `state_every`, `keep_last`, `cu_seqlens`, `state_dtype` and
        `threads` as in run()."""
        given = arrays.inputs_by_name(inputs, named_inputs, self.program, Recurrence.prefill)
        arrays.require_dicts(initial_state=initial_state, params=params)
        state = dict(initial_state or {})
        offsets = serving.check_cu_seqlens(cu_seqlens)
        if self._log_scales and given:
            first = np.asarray(next(iter(given.values())))
            if first.ndim >= 3:
                rows = first.shape[0] if offsets is None else len(offsets) - 1  # (one per packed sequence)
                for key in self._log_scales:
                    state.setdefault(key, np.full((rows, first.shape[2]), np.nan))
        return self.run(given, form="recurrent", backend=backend, params=params, initial_state=state or None,
                        dims=dims, state_every=state_every, keep_last=keep_last, cu_seqlens=offsets,
                        state_dtype=state_dtype, threads=threads)

    @_warnings_at_program
    def step(self, token_inputs: dict, state: dict | None, *, backend: str = "numpy",
             params: dict | None = None, inplace: bool = False, out: dict | None = None,
             slots=None, state_dtype=None) -> tuple[dict, dict]:
        """One token: inputs [B, H, *] by DSL name, states [B, H, *] → (outputs [B, H, *], new states).
        The same on every backend (docs/api.md, "Decode"): a state not given starts from zeros; inplace=True
        updates the given state arrays (of the inputs' dtype, writeable) and returns them — the fast decode
        loop — otherwise the given states are left alone (converted to the inputs' dtype, as run() does).
        `params` are read when a step first sees them: a dict whose values are replaced is read again, an
        array changed in place is not. `out` holds output arrays to reuse. The C backend checks shapes and
        dtypes when an array changes, and its kernel the declared value ranges on every call.
        `slots` (an int array [N] of distinct rows): `state` is a pool of slots, arrays [P, H, *], and the
        tokens [N, H, *] advance the rows pool[·][slots] in place, nothing else (backends/slot_pool.py).
        `state_dtype="bfloat16"` (float32 tokens): the states (or the pool's) are uint16 arrays of bfloat16 bits,
        widened to float32 for the step and rounded back (backends/bf16_state.py)."""
        _require_causal(self)
        arrays.require_token_inputs(token_inputs)
        bits = state_dtype is not None and bf16_state.resolve(state_dtype, dict(token_inputs)) is not None
        if slots is not None or bits:  # (a pool that is no dict has slot_pool's own message)
            arrays.require_dicts(state=None if slots is not None else state, params=params, out=out)
        if slots is not None:
            return slot_pool.step(self, token_inputs, state, slots, backend, params, out, bits)
        if bits:
            return self._step_bf16(token_inputs, state, backend, params, inplace, out)
        bound = self._per_thread.steppers.get(backend)  # a compiled step bound before (never for a KV cache)
        if bound is not None and bound[0].same(params):
            stepper = bound[1]
            fast = stepper.fast  # the decode loop passing the same arrays again: an identity test each
            if fast is not None and inplace and out is not None:
                done = fast(token_inputs, state, out)
                if done is not None:
                    return done
            try:
                return stepper(token_inputs, state, inplace, out)
            except RuntimeInputError:
                pass  # new sizes or dtype, or a bad array: check everything again below (and say what is wrong)
        arrays.require_dicts(state=state, params=params, out=out)  # (after the fast path: it costs the loop nothing)
        if self.decomposition.sequence is not None:
            return _cache_step(self, token_inputs, state, backend, params)
        checked, shape, module, dims, used = self._token_call(token_inputs, backend, params, state)
        if module.capabilities.binds_steps:  # compiled: bind once, then only shapes are checked per call
            stepper = module.stepper(used, dims)
            self._per_thread.steppers[backend] = (_ParamsSeen(params), stepper)
            return stepper(token_inputs, state, inplace=inplace, out=out)
        # stabilized states travel with their log-scale between steps, so that they neither over- nor
        # underflow however large the exponents get (NaN: a state at its true scale, e.g. from prefill)
        carried = dict(state or {})
        for key in self._log_scales:
            carried.setdefault(key, np.full((shape.batch, shape.heads), np.nan))
        state0 = arrays.check_initial_state(self.program, carried, shape, dims, self._log_scales, "state")
        if inplace and state is not None:
            arrays.check_states_in_place(self.program, state, shape, dims)
        outputs = arrays.token_outputs(self.program, out, shape, dims) if out else None
        # (before anything is written; with inplace=True, states overlapping each other too)
        arrays.refuse_shared_outputs(outputs, token_inputs, state, states_written=inplace)
        computed, final = module.forward(checked, used, state0, dims)
        if outputs is None:
            outputs = {k: v[:, 0] for k, v in computed.items()}
        else:
            for name, value in computed.items():
                outputs[name][...] = value[:, 0]
        if inplace and state is not None:
            for k, v in final.items():
                if k in state:
                    state[k][...] = v
                    final[k] = state[k]
                else:  # (a state not given, started from zeros: the caller's dict gets it)
                    state[k] = v
        return outputs, final


    def _step_bf16(self, token_inputs: dict, state: dict | None, backend: str, params: dict | None, inplace: bool,
                   out: dict | None) -> tuple[dict, dict]:
        """step() with bfloat16 states: the backend's own bfloat16 step where it has one (bound once, as the
        float32 step is), else widened around the float32 step (bf16_state.step_widened)."""
        key = (backend, arrays.BFLOAT16)
        bound = self._per_thread.steppers.get(key)
        if bound is not None and bound[0].same(params):
            try:
                return bound[1](token_inputs, state, inplace, out)
            except RuntimeInputError:
                pass  # new sizes, or a bad array: checked again below
        if self.decomposition.sequence is not None:
            raise RuntimeInputError(bf16_state.kv_cache_refusal(self.name))
        _, _, module, dims, used = self._token_call(token_inputs, backend, params, state)
        if module.capabilities.bfloat16_steps:
            stepper = module.stepper(used, dims, state_is_bf16=True)
            self._per_thread.steppers[key] = (_ParamsSeen(params), stepper)
            return stepper(token_inputs, state, inplace=inplace, out=out)
        return bf16_state.step_widened(self, token_inputs, state, backend, params, inplace, out)

    def _token_call(self, token_inputs: dict, backend: str, params: dict | None, state: dict | None):
        """One token's inputs checked in its own terms ([B, H, *], against the sizes of the states it goes on
        from) as a sequence of one ([B, 1, H, *]), and the recurrent module bound to them: (checked inputs,
        call shape, module, dims, params used)."""
        checked, shape = arrays.check_token_inputs(self.program, dict(token_inputs), state)
        # (the ranges on the token's own arrays, [B, H, *]: an error's index is one the caller's array has)
        arrays.check_ranges(self.program, {k: v[:, 0] for k, v in checked.items()})
        module = self.module("recurrent", backend)
        key = (backend, shape.batch, shape.heads, shape.dtype.str, tuple(sorted(shape.dims.items())),
               tuple(sorted((k, np.shape(v)) for k, v in (state or {}).items())))
        known = self._token_binds.get(key)
        if known is not None and known[0].same(params):
            return checked, shape, module, known[1], known[2]
        dims, used = self.bind(module, shape, params, state)
        for value in used.values():
            value.flags.writeable = False  # shared by the steps that reuse them
        _remember(self._token_binds, key, (_ParamsSeen(params), dims, used))
        return checked, shape, module, dims, used

    def bind_step(self, token_inputs: dict, state: dict, *, backend: str = "numpy", params: dict | None = None,
                  out: dict | None = None, slots=None, state_dtype=None):
        """The decode step bound to these very arrays: returns step(), which runs one token — reads the token
        buffers `token_inputs` ([B, H, *]; refill them in place between calls), updates `state` in place
        and writes the outputs — and returns the outputs dict (`out`'s arrays, created when absent). Every
        array is checked here, once (each call: only that the arrays it writes are still writeable); the C
        kernel checks the declared value ranges on every call (and updates nothing when one fails). The
        cheapest decode loop from Python: one call per token.
        On every backend the step is bound to the arrays the dicts hold now: putting another array into a
        dict later changes nothing (refill the bound ones in place), and every state must be given.
        `slots`: `state` is a pool of slots [P, H, *], as in step(); an int array of slots may be refilled in
        place between calls (it is checked every call). `state_dtype="bfloat16"`: as in step()."""
        _require_causal(self)
        arrays.require_token_inputs(token_inputs)
        bits = state_dtype is not None and bf16_state.resolve(state_dtype, dict(token_inputs)) is not None
        arrays.require_dicts(state=None if slots is not None else state, params=params, out=out)
        if slots is not None:
            return slot_pool.bind(self, token_inputs, state, slots, backend, params, out, bits)
        if self.decomposition.sequence is not None:
            raise RuntimeInputError(f"'{self.name}' reads the sequence: it decodes over a KV cache that grows "
                                    f"every token, so it has no step bound to fixed arrays; use step()")
        missing = [s.name for s in self.program.states if s.name not in (state or {})]
        if missing:
            raise RuntimeInputError(f"bind_step updates the state arrays in place: pass every state (missing: "
                                    f"{', '.join(missing)}; e.g. the final_state of prefill, or zeros)")
        arrays.refuse_unknown_states(self.program, state, self._log_scales)
        _, shape, module, dims, used = self._token_call(token_inputs, backend, params, state)
        if bits:
            if module.capabilities.bfloat16_steps:
                return module.stepper(used, dims, state_is_bf16=True).bind(token_inputs, state, out)
            arrays.check_states_in_place(self.program, state, shape, dims, bits=True)  # (here, not at the first call)
            return bf16_state.bind_widened(self, token_inputs, state, backend, params, out)
        if module.capabilities.binds_steps:
            return module.stepper(used, dims).bind(token_inputs, state, out)
        arrays.check_states_in_place(self.program, state, shape, dims)
        for key in self._log_scales - set(state):  # (a log-scale the caller has not got yet: carried here, as on C)
            state[key] = np.full((shape.batch, shape.heads), np.nan)
        tokens, states = dict(token_inputs), dict(state)  # the arrays bound now, as the compiled step binds them
        buffers = arrays.token_outputs(self.program, out, shape, dims)
        arrays.refuse_shared_outputs(buffers, tokens, states, states_written=True)

        def step():
            self.step(tokens, states, backend=backend, params=params, inplace=True, out=buffers)
            return buffers
        return step


class _PerThread(threading.local):
    """A thread's compiled decode steps: backend (or (backend, bfloat16)) → (params, step bound to them). A
    compiled step is bound to one [B, H] and dtype, rebinds itself to another, and keeps the arrays it saw
    last: shared by threads stepping requests of other shapes (or other arrays) at once, one thread's call
    read what the other's had just bound (heap corruption, another thread's numbers). Each thread binds its
    own, once."""

    def __init__(self):
        self.steppers: dict = {}


class _ParamsSeen:
    """The params a step was bound to: the same dict holding the same arrays (a value put in its place is a
    change; an array changed in place is not, as the step has converted it to its dtype by then)."""

    def __init__(self, params: dict | None):
        self.params = params
        self.values = dict(params) if params is not None else None  # (holds the arrays: ids stay theirs)

    def same(self, params: dict | None) -> bool:
        if params is not self.params:
            return False
        return params is None or (len(params) == len(self.values)
                                  and all(params.get(k) is v for k, v in self.values.items()))


def _require_causal(rec: "Recurrence") -> None:
    if not rec.program.causal:
        raise LinrecError(f"'{rec.name}' is non-causal: its outputs depend on tokens after their own, so it has "
                          f"no token-by-token decode step; use its {' or '.join(rec.forms)} form")


def _cache_step(rec: "Recurrence", token_inputs: dict, cache: dict | None, backend: str, params: dict | None):
    """Decode for programs that read the sequence: the state is the KV cache — every input so far,
    [B, t, H, *] by input name. Appends the token and computes its outputs only: the C backend runs the
    new token's query against the cache in its attention kernel; Reformer's LSH attention decodes on
    NumPy whatever `backend` says (it hashes and sorts the whole sequence)."""
    if "recurrent" not in rec.forms:
        raise LinrecError(f"'{rec.name}' has no recurrent form, so no decode step: "
                          f"{rec.decomposition.why_not('recurrent')}")
    cache = dict(cache or {})
    unknown = sorted(set(cache) - {x.name for x in rec.program.inputs})
    if unknown:
        raise RuntimeInputError(f"the KV cache of '{rec.name}' holds its inputs by name; unknown: {unknown}")
    held = {name for name, value in cache.items() if value is not None}
    missing = sorted({x.name for x in rec.program.inputs} - held)
    if held and missing:  # (else the token alone would stand for the inputs so far, and its sizes be the error)
        raise RuntimeInputError(f"the KV cache of '{rec.name}' holds no {', '.join(map(repr, missing))} (it holds "
                                f"{', '.join(map(repr, sorted(held)))}): it holds every input so far, [B, t, H, *] "
                                f"by name — pass the cache the last step returned")
    token, _ = arrays.check_token_inputs(rec.program, dict(token_inputs), cache=cache)
    grown = {name: value if cache.get(name) is None else _extended(cache[name], value, name)
             for name, value in token.items()}
    checked, shape = arrays.check_inputs(rec.program, grown)
    module = rec.module("recurrent", backend)
    if not module.capabilities.decodes_over_cache:
        module = rec.module("recurrent", NUMPY.name)
    dims, used = rec.bind(module, shape, params)
    outputs, _ = module.forward(checked, used, {}, dims, first=shape.tokens - 1)
    return {k: v[:, 0] for k, v in outputs.items()}, grown


def _extended(cache, token: np.ndarray, name: str) -> np.ndarray:
    """The KV cache's array of input `name` [B, t, H, *] with the token's [B, 1, H, *] appended; a cache array
    whose B, H or sizes are not the token's is an error naming both shapes (the token's have been checked)."""
    cache = np.asarray(cache)
    if cache.ndim != token.ndim or cache.shape[:1] + cache.shape[2:] != token.shape[:1] + token.shape[2:]:
        raise RuntimeInputError(f"the KV cache's '{name}' has shape {list(cache.shape)} but the token's '{name}' "
                                f"has {list(token.shape[:1] + token.shape[2:])}: the cache holds the inputs so far, "
                                f"[B, t, H, *], with the token's B, H and sizes")
    if cache.dtype != token.dtype:  # (concatenated, float32 and float64 would make float64 of the rest)
        raise RuntimeInputError(f"the KV cache's '{name}' is {cache.dtype} but the token's '{name}' is {token.dtype}: "
                                f"pass the token in the cache's dtype")
    return np.concatenate([cache, token], axis=1)


def compile(source: str, filename: str = "<source>") -> Recurrence:  # noqa: A001 - the natural name
    """Compile a program given as text."""
    if isinstance(source, (bytes, bytearray)):
        try:
            source = bytes(source).decode("utf-8")
        except UnicodeDecodeError as e:
            raise LinrecError(f"compile() takes the program's text; these bytes are not UTF-8 ({e.reason} at byte "
                              f"{e.start}): pass a str") from None
    if not isinstance(source, str):
        raise LinrecError(f"compile() takes the program's text as a str, not {type(source).__name__}; for a "
                          f"file, linrec.load(path)")
    if not isinstance(filename, str):
        raise LinrecError(f"compile()'s filename (the name its errors give the text) is a str, not "
                          f"{type(filename).__name__}")
    return Recurrence(compiler.compile_source(source, filename))


def load(path: str | Path) -> Recurrence:
    """Compile a program file (.lin)."""
    if not isinstance(path, (str, Path)) and not hasattr(path, "__fspath__"):
        raise LinrecError(f"load() takes the path of a .lin file (a str or a path), not {type(path).__name__}; for "
                          f"a program's text, linrec.compile(text)")
    if isinstance(path, str) and not path:  # (read as ".", the directory: the error would name no file given)
        raise LinrecError("load() was given an empty path: give the path of a .lin file")
    return Recurrence(compiler.compile_file(path))


def _remember(cache: dict, key, value) -> None:
    """cache[key] = value, the oldest entry dropped past PLANS_KEPT (another thread may have dropped it
    already)."""
    if len(cache) >= PLANS_KEPT:
        cache.pop(next(iter(cache), None), None)
    cache[key] = value


@dataclass(frozen=True)
class _CallPlan:
    module: object
    shape: arrays.CallShape
    dims: dict[str, int]
    params: dict[str, np.ndarray]
    nonfinite_tail: object = None  # (Recurrence._nonfinite_tail)
    causal: bool = True  # (a non-causal program's tail is all of its tokens)


def _forward(plan: _CallPlan, inputs: dict, state0, chunk):
    """plan.module.forward, and where the plan has a module for the tail, the tokens from the first one
    whose inputs hold NaN or ±∞ on through it: the tokens before run alone through the plan's form."""
    first = None if plan.nonfinite_tail is None else _first_nonfinite_token(inputs)
    if first is not None and not plan.causal:
        first = 0  # (a token sees later ones too: all of them through the recurrent form)
    if first is None:
        return plan.module.forward(inputs, plan.params, state0, plan.dims, chunk_size=chunk)
    tail, final = plan.nonfinite_tail.forward(inputs, plan.params, state0, plan.dims, first=first)
    if not first:
        return tail, final
    head, _ = plan.module.forward({name: a[:, :first] for name, a in inputs.items()}, plan.params, state0,
                                  plan.dims, chunk_size=None if chunk is None else min(chunk, first))
    return {name: np.concatenate([head[name], tail[name]], axis=1) for name in head}, final  # (tail: tokens first…)


def _first_nonfinite_token(inputs: dict) -> int | None:
    """The first token at which an input [B, T, H, *] holds NaN or ±∞ in any batch row and head, or None."""
    bad = None
    for a in inputs.values():
        here = arrays.nonfinite_tokens(a).any(axis=(0, 2))
        bad = here if bad is None else bad | here
    return int(np.argmax(bad)) if bad is not None and bad.any() else None


def _signature(given: dict, initial_state: dict | None, form: str, backend: str, params: dict | None,
               dims: dict[str, int] | None) -> tuple | None:
    """What a call's plan depends on, as a key: the inputs' names, shapes and dtypes, the initial states'
    shapes, the form, the backend and the sizes asked for. None when the plan cannot be reused: params given
    (their values are part of it), or a value that is not a NumPy array. A call that repeats an earlier one's
    signature skips the checks and choices that signature settled: after the first, a call costs the kernel
    and little else (on a short sequence the checks, with caches cold from the kernel, were ~25 % of a call)."""
    if params is not None or not all(isinstance(n, (int, np.integer)) for n in (dims or {}).values()):
        return None
    parts = [form, backend, tuple(sorted((name, int(n)) for name, n in dims.items())) if dims else ()]
    for name, value in given.items():
        if type(value) is not np.ndarray or not value.dtype.isnative:  # (non-native: converted by each call's checks)
            return None
        parts.append((name, value.shape, value.dtype))
    parts.append(None)  # (inputs | states)
    for name, value in (initial_state or {}).items():
        if type(value) is not np.ndarray:
            return None
        parts.append((name, value.shape))
    return tuple(parts)

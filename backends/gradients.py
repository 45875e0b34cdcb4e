"""Recurrence.vjp: the forward and its vector–Jacobian product, from the backward the compiler derives
(compiler.adjoint; docs/gradients.md). The arguments are checked here — the upstream gradients against the
outputs and states they belong to — and the backend's backward module does the rest."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import arrays, registry
from .c import grad_forward
from .compiler import FORMS
from .compiler.adjoint import GRADIENT_FORMS
from .compiler.stabilize import log_scale_keys, stabilized_states
from .dsl.errors import LinrecError, RuntimeInputError
from .numpy.adjoint_arrays import BelowNormalRange
from .numpy.scan import rescale
from .numpy.vjp import INFINITE_SLOPES

# the two errors of a program with stabilized exponential features whose backward over- or underflows
UNSTABILIZED = ("this program's feature maps are exponential, and the backward differentiates its statements as "
                "written, without the stabilization of the forward forms")
SCALE_DOWN = 'Scale the inputs down (docs/gradients.md, "Exponential feature maps")'
MISSING = ("error", "zero")  # what a missing output gradient is: an error, or zeros when the caller says so


@dataclass
class VjpResult:
    """outputs and final_state as run() gives them; grads: ∂L/∂x for every input, param and initial state by
    its name in the program (params as passed: per-head ones [H, *], shared ones summed over heads)."""

    outputs: dict[str, np.ndarray]
    final_state: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray] = field(default_factory=dict)


def random_upstream(rec, batch: int, tokens: int, heads: int, dims: dict[str, int], dtype) -> dict[str, np.ndarray]:
    """A random gradient for every output [B, T, H, *] (the loss Σ grad · output), for timing a backward: bench
    --grad's, and form="auto"'s measurement (gradient_choice). `dims`: sizes asked for, over the file's."""
    rng = np.random.default_rng(1)
    sizes = {d.name: d.default for d in rec.program.dims} | dict(dims)
    return {o.name: rng.standard_normal((batch, tokens, heads) + tuple(sizes[d] for d in o.value.shape)).astype(dtype)
            for o in rec.program.outputs}


def gradient_refusal(rec, form: str, backend: str) -> str | None:
    """Why the backend does not build the backward of this form of the program, or None."""
    if form == "step":  # (a forward form of decoding, run token by token: its backward is the recurrent one's)
        return ("the decode step has no backward of its own: the gradient of tokens run one at a time is the "
                "recurrent form's over them (form='recurrent'; linrec.torch's form='step' runs that)")
    if form not in FORMS:
        return arrays.unknown_form(form, FORMS)
    refusal = registry.backend(backend).gradient_why_not(rec.compiled, form)
    return None if refusal is None else str(refusal)


def derived_forms(rec) -> list[str]:
    """The program's gradient forms that some backend builds (`linrec check` lists them with their backends)."""
    return [f for f in GRADIENT_FORMS if any(gradient_refusal(rec, f, b) is None for b in registry.BACKENDS)]


# form="auto"'s backward (linrec.torch's, and `linrec bench --grad --form auto`'s), free of torch: at small
# dk the recurrent backward is the fastest NumPy one (docs/torch.md, "Gradients"); a program without it, the
# chunkwise one (its memory: a chunk's scores, not the parallel one's T × T), else the parallel one
AUTO_ORDER = ("recurrent", "chunkwise", "parallel")  # (on C from 1024 tokens on, measured: gradient_choice)


def gradient_module(rec, form: str, backend: str):
    """The loaded backward module of a form (built once per recurrence)."""
    key = ("gradient", backend, form)
    if key not in rec._modules:
        if form not in FORMS and form != "step":  # (an option's value: as run() says it)
            raise RuntimeInputError(arrays.unknown_form(form, FORMS))
        why = gradient_refusal(rec, form, backend)
        if why:
            raise LinrecError(f"'{rec.name}' has no {form} gradient on the {backend} backend: {why}. Gradient forms "
                              f"derived: {', '.join(derived_forms(rec)) or 'none'} (see `linrec check`)")
        rec._modules[key] = registry.backend(backend).load_gradient(rec.compiled, form)
    return rec._modules[key]


def emit(rec, form: str, backend: str) -> str:
    gradient_module(rec, form, backend)  # (the errors)
    return registry.backend(backend).emit_gradient(rec.compiled, form)


def saved_forward(rec, inputs: dict, *, form: str, backend: str, initial_state: dict | None, params: dict | None,
                  dims: dict | None, chunk_size: int | None) -> grad_forward.Saved | None:
    """The forward of vjp(…, form, backend) on these arguments, kept for vjp(…, saved=) — a training step's
    forward, whose backward then does not run it again (linrec.torch) — or None where the backward's forward is
    not the fused kernel's (the NumPy backend, a program it does not take, a call below its MIN_WORK): that
    backward runs its own forward, as ever. Its outputs and final states are run()'s."""
    chunk = arrays.check_chunk_size(chunk_size)
    module = gradient_module(rec, form, backend)
    if not isinstance(getattr(module, "fused_forward", None), grad_forward.FusedForward):
        return None
    # (the values' declared ranges: the fused kernel checks them as it reads, and names the input where one lies
    # outside; below its MIN_WORK it does not run, and they are checked here)
    checked, shape = arrays.check_inputs(rec.program, arrays.by_name(inputs, "inputs"), ranges=False)
    initial_state = at_true_scale(rec, initial_state)
    sizes, used = rec.bind(module, shape, params, initial_state, dims)
    state0 = arrays.check_initial_state(rec.program, initial_state, shape, sizes)
    chunk = None if chunk is None else min(chunk, shape.tokens)
    # (the module's own backward, stopped once its forward has run: the chunk, the prelude and the call are
    # exactly those of the backward that will take it; no upstream gradient is read before that)
    with grad_forward.capturing() as kept, np.errstate(all="ignore"):
        module.backward(checked, used, state0, sizes, {}, {}, (), chunk_size=chunk)
    if kept.result is None:
        arrays.check_ranges(rec.program, checked)
    return kept.result


def vjp(rec, inputs: dict, grad_outputs: dict | None, *, form: str, backend: str, grad_final_state: dict | None,
        initial_state: dict | None, params: dict | None, dims: dict | None, chunk_size: int | None,
        missing: str, wanted: frozenset | None = None, saved: grad_forward.Saved | None = None) -> VjpResult:
    """Recurrence.vjp. `wanted`: the inputs, states and params whose gradients the caller uses (linrec.torch:
    autograd's needs_input_grad); an infinite slope on the way to the others only is no error. None: all.
    `saved`: saved_forward's result for these very arguments (not checked against them: the caller's to keep
    together), whose forward the backward then reuses where it fits."""
    check_missing(missing)
    chunk = arrays.check_chunk_size(chunk_size)
    module = gradient_module(rec, form, backend)
    program = rec.program
    # (the values' declared ranges: saved_forward checked them on these very arguments, so a training step's
    # backward does not pass over every input again — 0.3 ms of GLA's 7.5 ms backward at d = 64, T = 4096)
    checked, shape = arrays.check_inputs(program, arrays.by_name(inputs, "inputs"), ranges=saved is None)
    initial_state = at_true_scale(rec, initial_state)
    sizes, used = rec.bind(module, shape, params, initial_state, dims)
    state0 = arrays.check_initial_state(program, initial_state, shape, sizes)
    upstream = output_gradients(program, grad_outputs, shape, sizes, missing)
    final_upstream = state_gradients(program, grad_final_state, shape, sizes)
    given = set(params or {})
    derived = tuple(p.name for p in program.params if p.name not in given)
    chunk = None if chunk is None else min(chunk, shape.tokens)
    arguments = (checked, used, state0, upstream, final_upstream)
    try:
        with grad_forward.reusing(saved):
            outputs, final, grads, slopes = _backward(module, arguments, sizes, derived, chunk)
    except BelowNormalRange:
        # a decay given as a value below its dtype's normal range, or (the recurrent backward) of exactly 0,
        # whose gradient the chain rule would take through its log (∂a = ∂l / a): the statements as written
        # (NumPy's recurrent backward, the product a·S differentiated directly)
        module = gradient_module(rec, "recurrent", "numpy")
        outputs, final, grads, slopes = _backward(module, arguments, sizes, derived, chunk)
    if _wider_would_be_finite(rec, arguments, (outputs, final, grads)):
        # exponential features, whose backward runs unstabilized, over- or underflow in float32 where the
        # stabilized forward is finite: the same backward in float64 (e^±709 against e^±88), rounded back
        wide = _backward(module, tuple(_as_float64(a) for a in arguments), sizes, derived, chunk)
        outputs, final, grads = (_cast_like(w, n) for w, n in zip(wide[:3], (outputs, final, grads)))
        slopes = wide[3]
    _check_finite(rec, checked, used, state0, outputs, final, grads)
    if slopes and not all(all_finite(g) for name, g in grads.items() if wanted is None or name in wanted):
        raise slopes[0]
    if stabilized_states(rec.compiled):  # (its backward runs other statements than its forward: see below)
        # (an initial state the caller did not pass: its gradient is there to read, not one the caller asked for)
        passed = wanted if wanted is not None else frozenset(grads) - (
            {s.name for s in program.states} - set(initial_state or {}))
        _check_finite_gradients(rec, arguments, grads, passed)
    return VjpResult(outputs, final, grads, dict(used))


def at_true_scale(rec, initial_state: dict | None) -> dict | None:
    """Initial states as the backward takes them: a stabilized state that comes with its log-scale (prefill's
    and a decode step's "S.log_scale" [B, H], which run and step take back) multiplied by exp of it — the
    state itself, whose gradient vjp gives (vjp refused the log-scale as an unknown state, so a prefilled
    continuation could not be differentiated: a probe's finding). decode.at_true_scale's rescaling (which this
    module cannot import: decode imports the API, which imports this), with the caller's errors said: a
    log-scale without its state or of another shape, and a state that overflows at its true scale. A NaN
    log-scale is 0, as run and step read it."""
    if not initial_state:
        return initial_state
    keys = {state: key for state, key in log_scale_keys(rec.compiled).items() if key in initial_state}
    if not keys:
        return initial_state
    out = {k: v for k, v in initial_state.items() if k not in set(keys.values())}
    for state, key in keys.items():
        if state not in out:
            raise RuntimeInputError(f"initial state '{key}' is given without '{state}', the state it scales; pass "
                                    f"both, as prefill and step return them")
        value = np.asarray(out[state])
        if value.dtype.kind != "f":  # (a bfloat16 state's bits, say: check_initial_state refuses its dtype)
            continue
        scale = np.asarray(initial_state[key], dtype=np.float64)
        if scale.shape != value.shape[:2]:
            raise RuntimeInputError(f"'{key}' should have shape [B, H] = {list(value.shape[:2])} but has shape "
                                    f"{list(scale.shape)}")
        # NaN is the true scale: bind_step and a slot pool hand a state back so until its first step, and run
        # and step take it so (rescale reads it as 0)
        vector = value.ndim == 3  # (rescale, decode.at_true_scale's, takes [B, H, rows, cols])
        with np.errstate(over="ignore", invalid="ignore"):
            true = rescale(value[..., None] if vector else value, scale, None, value.dtype)
        true = true[..., 0] if vector else true
        if not np.all(np.isfinite(true) | ~np.isfinite(value)):
            raise RuntimeInputError(f"initial state '{state}' times exp('{key}') is beyond {value.dtype.name}'s "
                                    f"range: the backward takes the state at its true scale, whose gradient it "
                                    f"gives; differentiate from a shorter prefill, or in float64")
        out[state] = true
    return out


def _check_finite_gradients(rec, arguments: tuple, grads: dict, wanted: frozenset | None) -> None:
    """A program with stabilized exponential features: its backward differentiates the statements as written,
    which can over- or underflow where the stabilized forward is finite, in the gradients alone (Performer
    with q and k ×13: every gradient NaN, the outputs finite; ×7 in float32: the initial states' gradients
    beyond float32's range, ∞ once rounded back from the float64 run). Such a call is refused, naming the
    gradient, rather than hand ∞ or NaN to an optimizer."""
    bad = next((name for name, g in grads.items() if (wanted is None or name in wanted) and not all_finite(g)),
               None)
    if bad is None or not _finite(*arguments):
        return  # (finite gradients; or non-finite arguments: docs/guarantees.md)
    value = np.asarray(grads[bad])
    index = np.argwhere(~np.isfinite(value))[0].tolist()
    what = "NaN" if np.isnan(value).any() else "not finite"
    raise RuntimeInputError(f"the gradient of '{bad}' is {what} for these (finite) arguments (first at index {index}), "
                            f"where the forward is finite: {UNSTABILIZED}; they over- or underflow at these "
                            f"arguments even in float64, or the gradient lies beyond {value.dtype}'s range. "
                            f"{SCALE_DOWN}")


def _backward(module, arguments: tuple, sizes: dict, derived: tuple, chunk: int | None) -> tuple:
    """The backend's backward on (inputs, params, initial states, output gradients, final-state gradients):
    (outputs, final states, gradients, the infinite slopes met on the way)."""
    inputs, params, state0, upstream, final_upstream = arguments
    slopes = []  # infinite slopes met (linrec.numpy.vjp.INFINITE_SLOPES): an error only where a gradient is not finite
    reset = INFINITE_SLOPES.set(slopes)
    try:
        with np.errstate(all="ignore"):  # (non-finite values are found by the caller, with what they mean)
            outputs, final, grads = module.backward(inputs, params, state0, sizes, upstream, final_upstream, derived,
                                                    chunk_size=chunk)
    finally:
        INFINITE_SLOPES.reset(reset)
    return outputs, final, grads, slopes


def _wider_would_be_finite(rec, arguments: tuple, results: tuple) -> bool:
    """Whether to run the backward again in float64: a program with stabilized exponential features (whose
    backward differentiates the statements as written), arguments narrower than float64 and all finite, and a
    result that is not finite."""
    inputs = arguments[0]
    if not stabilized_states(rec.compiled) or all(np.asarray(v).dtype == np.float64 for v in inputs.values()):
        return False
    return not _finite(*results) and _finite(*arguments)


def _finite(*groups: dict) -> bool:
    """Whether every array of these dicts is finite."""
    return all(all_finite(v) for values in groups for v in values.values())


def _as_float64(values: dict) -> dict:
    return {name: (np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else v)
            for name, v in values.items()}


def _cast_like(wide: dict, narrow: dict) -> dict:
    """float64 results in the dtypes the narrower call gave (under the float64 run's keys)."""
    with np.errstate(over="ignore"):  # (a value beyond float32 becomes ∞, which _check_finite then reports)
        return {name: np.asarray(v).astype(np.asarray(narrow[name]).dtype if name in narrow else np.asarray(v).dtype,
                                           copy=False)
                for name, v in wide.items()}


def _refuse_unknown(argument: str, kind: str, kinds: str, given: dict, names: list[str], program) -> None:
    """An error naming the keys of `given` that are none of `names` (the program's outputs or states)."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise RuntimeInputError(f"{argument} has unknown {kind} {', '.join(map(repr, unknown))}; the {kinds} of "
                                f"'{program.name}' are {', '.join(names) or 'none'}")


def check_missing(missing: str) -> None:
    """vjp's `missing`: what an output without a gradient is."""
    if missing not in MISSING:
        raise RuntimeInputError(f"missing={missing!r}: choose 'error' (every output needs a gradient) or 'zero' "
                                f"(an output without one has gradient zero)")


def output_gradients(program, given: dict | None, shape: arrays.CallShape, sizes: dict, missing: str) -> dict:
    given = arrays.by_name(given, "grad_outputs")
    _refuse_unknown("grad_outputs", "output(s)", "outputs", given, [o.name for o in program.outputs], program)
    out = {}
    for o in program.outputs:
        expected = (shape.batch, shape.tokens, shape.heads) + tuple(sizes[d] for d in o.value.shape)
        label = "[B, T, H" + "".join(", " + d for d in o.value.shape) + "]"
        if given.get(o.name) is None:
            if missing == "error":
                raise RuntimeInputError(f"no gradient for output '{o.name}' (shape {label} = {list(expected)}); "
                                        f"pass grad_outputs['{o.name}'], or missing='zero' if the loss does not "
                                        f"use it")
            out[o.name] = np.zeros(expected, shape.dtype)
            continue
        out[o.name] = _gradient_array(f"grad_outputs['{o.name}']", given[o.name], expected, label, shape.dtype)
    return out


def state_gradients(program, given: dict | None, shape: arrays.CallShape, sizes: dict, rows_are: str = "B") -> dict:
    """The final states' gradients [B, H, *] by name (absent or None: none); `rows_are` names their leading axis
    in an error ("N": one row per packed sequence)."""
    given = dict(given or {})
    _refuse_unknown("grad_final_state", "state(s)", "states", given, [s.name for s in program.states], program)
    out = {}
    for s in program.states:
        if given.get(s.name) is not None:
            expected = (shape.batch, shape.heads) + tuple(sizes[d] for d in s.shape)
            label = f"[{rows_are}, H" + "".join(", " + d for d in s.shape) + "]"
            out[s.name] = _gradient_array(f"grad_final_state['{s.name}']", given[s.name], expected, label,
                                          shape.dtype)
    return out


def _gradient_array(what: str, value, expected: tuple, label: str, dtype: np.dtype) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - any failure to view the value as an array is the caller's error
        raise RuntimeInputError(f"{what} is not an array") from None
    if arr.shape != expected:
        raise RuntimeInputError(f"{what} should have shape {label} = {list(expected)} (the shape of what it is "
                                f"the gradient of) but has shape {list(arr.shape)}")
    arr = arrays.native(arr)  # (a big-endian gradient: converted, as the inputs are)
    if arr.dtype != dtype:
        raise RuntimeInputError(f"{what} is {arr.dtype} but the inputs are {dtype}; pass the gradients in the "
                                f"inputs' dtype")
    return arr


def _check_finite(rec, inputs, params, state0, outputs, final, grads) -> None:
    """Finite arguments whose forward by the statements overflows: the gradient is the statements' (for
    stabilized exponential feature maps, their unstabilized math), and it is not finite there. The results are
    read first, the arguments only where one is not finite (with finite results there is nothing to report)."""
    bad = next(((what, name) for what, values in (("output", outputs), ("final state", final))
                for name, value in values.items() if not all_finite(value)), None)
    if bad is None or not all(map(all_finite, [*inputs.values(), *params.values(), *state0.values()])):
        return  # (finite results; or non-finite in, non-finite out: docs/guarantees.md)
    what, name = bad
    value = np.asarray((outputs if what == "output" else final)[name])
    index = np.argwhere(~np.isfinite(value))[0].tolist()
    found = (f"the {what} '{name}' of the statements as written is {{}} for these (finite) arguments (first at "
             f"index {index})")
    if stabilized_states(rec.compiled):  # (Performer: features that over- or underflow unstabilized, 0/0)
        raise RuntimeInputError(found.format("not finite") + f": {UNSTABILIZED} (which are finite here); they over- "
                                "or underflow at these arguments even in float64 (a narrower call's backward runs "
                                f"again in float64 when its own is not finite). {SCALE_DOWN}")
    if not np.isinf(value).any():  # NaN only: most often a builtin outside its domain, not an overflow
        raise RuntimeInputError(found.format("NaN") + ", so it has no gradient there: a builtin outside its domain — "
                                "sqrt or log of a negative value, 0/0 — or an overflow (∞ − ∞). Keep the arguments in "
                                "the domain, e.g. declare the range an input must keep (`input v[dv] >= 0`), or, for "
                                "an overflow, scale the inputs down or run in float64")
    raise RuntimeInputError(found.format("not finite") + ": the backward differentiates the statements as written — "
                            "for exponential feature maps, without the stabilization of the forward forms — and "
                            "they overflow here, or a builtin meets a pole (log of 0, a division by 0); scale the "
                            "inputs down or run in float64 for an overflow, keep the arguments away from the pole "
                            "for the other")


def all_finite(value) -> bool:
    """Whether every element of the array is finite: its sum, where that is finite (one pass, no array of
    flags: a sum with a NaN or an infinity in it is not finite), else element by element (finite values can
    sum to an overflow). A contiguous array is summed by einsum, in one pass of registers: np.sum's pairwise
    sum took about four times as long (an [1, 4096, 8, 64] float32 gradient: 0.38 against 0.10 ms), and a
    backward checks each of its gradients."""
    value = np.asarray(value)
    if value.dtype.kind not in "fc":  # (integers and booleans: always)
        return True
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.einsum("i->", value.reshape(-1)) if value.flags.c_contiguous else np.sum(value)
        if np.isfinite(total):
            return True
    return bool(np.isfinite(value).all())

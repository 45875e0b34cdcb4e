"""`linrec verify --grad`: every gradient form on every backend that builds it, over a battery of generated
inputs (T = 1, ragged T, odd sizes, strong decay to log-decay −20, random initial states and checkpoint
intervals), checked against central finite differences of the float64 recurrent forward.

The check is directional (adjoint.md, "Checking"): for each input, param and initial state x, a random
direction d, and the loss L = Σ ḡ_o·o + Σ ḡ_S·S_T with random upstream gradients, compare ⟨∂L/∂x, d⟩ with
the fourth-order central difference (8(L(x + εd) − L(x − εd)) − (L(x + 2εd) − L(x − 2εd))) / 12ε, ε = 1e-5.
The error of one comparison is |fd − ⟨∇, d⟩| / max(|fd|, |⟨∇, d⟩|, r/1e-6), where r = 64·eps·Σ|terms of L|/ε
bounds what rounding leaves of the difference quotient (a derivative that small — zero by cancellation, or
through a decay of e^−300 — is checked to r in absolute terms). Tolerance: 1e-6 in float64. Every other
gradient form (parallel, chunkwise) is compared with the float64 recurrent gradient at 1e-9, and a float32
gradient of any form at 5e-4: max|g − g64| / max|g64| per array, max|g64| at least what rounding leaves of
the terms the array sums, divided by the tolerance (_against: eps of g's dtype times B·T·H·d times the
largest gradient per token) — so that a gradient zero by cancellation (a bias softmax ignores) is checked to
that rounding in absolute terms. Finite differences check the recurrent gradient of the first backend
asked; another backend's (C's) is compared with it at 1e-9.
"""
from __future__ import annotations

import numpy as np

from . import gradients, verify
from .compiler import FORMS
from .dsl.errors import LinrecError
from .verify import Row, _initial_state, _params_without_default

FD_TOLERANCE = 1e-6
FORM_TOLERANCE = 1e-9       # another gradient form in float64 against the recurrent one
FLOAT32_TOLERANCE = 5e-4
EPSILON = 1e-5   # the step of the central differences
ROUNDING = 64 * np.finfo(np.float64).eps  # the relative rounding error of a loss, generously


# verify's cases; a gradient case's chunk_sizes are the vjp's chunk_size: tokens between the forward's
# checkpoints (None: √T)
Case = verify.Case
EVERY_SQRT_T = (None,)


def battery(program, quick: bool = False, sizes: dict | None = None) -> list[Case]:
    """The gradient cases, at small and odd sizes, or at `sizes` for the dimensions it names (verify.case_sizes)."""
    _, small, odd = verify.case_sizes(program, 6, sizes)
    cases = [Case("T=1", 2, 1, 2, small, chunk_sizes=EVERY_SQRT_T),
             Case("ragged T", 2, 13, 3, small, chunk_sizes=(None, 4)),
             Case("odd dims", 1, 9, 2, odd, chunk_sizes=(2,)),
             Case("strong decay", 2, 12, 2, small, decay_scale=40.0, chunk_sizes=EVERY_SQRT_T)]
    if not quick:
        cases += [Case("several B, H", 3, 24, 4, small, chunk_sizes=(5,)),
                  Case("long T", 1, 200, 1, small, chunk_sizes=(None, 64))]
    return cases


def gradient_forms(rec, backends) -> list[tuple[str, str]]:
    """(form, backend) for every gradient form a backend builds for the program."""
    return [(form, b) for form in FORMS for b in backends if gradients.gradient_refusal(rec, form, b) is None]


def missing(rec, backends) -> list[tuple[str, str, str]]:
    """(form, backend, why) for the gradient forms not built."""
    return [(form, b, why) for form in FORMS for b in backends
            if (why := gradients.gradient_refusal(rec, form, b)) is not None]


def reference_form(rec) -> str:
    """The forward whose finite differences check the gradients: the recurrent form (the definition), or,
    where a program has none (Linformer's params over the sequence), its parallel form."""
    forms = rec.compiled.decomposition.forms
    return "recurrent" if "recurrent" in forms else forms[0]


def directional_errors(rec, inputs, params, state0, grad_outputs, grad_state, grads, dims=None, seed: int = 0,
                       form: str = "recurrent", epsilon: float = EPSILON) -> dict[str, tuple[float, float]]:
    """name → (absolute, relative) error of ⟨grads[name], d⟩ against central differences of the float64
    forward `form` (the recurrent one, the definition, where the program has it), for one random direction d
    per input, param and initial state (see the module's docstring); `epsilon`: the differences' step."""
    rng = np.random.default_rng([seed, 1])  # (not the inputs' stream: d = x would hide a scale invariance)

    def loss(x, p, s) -> tuple[float, float]:
        r = rec.run(x, form=form, params=p, initial_state=s, dims=dims)
        terms = [g * r.outputs[k] for k, g in grad_outputs.items()] + \
            [g * r.final_state[k] for k, g in grad_state.items()]
        return sum(float(np.sum(t)) for t in terms), sum(float(np.sum(np.abs(t))) for t in terms)

    errors = {}
    declared = {x.name: x for x in rec.program.inputs}
    for group, values in (("input", inputs), ("param", params), ("state", state0)):
        for name, value in values.items():
            direction = rng.standard_normal(np.shape(value))
            if group == "input" and name in declared:
                direction = _inside_range(declared[name], value, direction, 2 * epsilon)

            def moved(steps: int) -> tuple[float, float]:
                args = {"input": dict(inputs), "param": dict(params), "state": dict(state0)}
                args[group][name] = value + steps * epsilon * direction
                return loss(args["input"], args["param"], args["state"])
            with np.errstate(all="ignore"):
                (a, size), (b, _), (c, _), (d, _) = moved(1), moved(-1), moved(2), moved(-2)
            numeric = (8 * (a - b) - (c - d)) / (12 * epsilon)  # fourth order: truncation ~ε⁴
            analytic = float(np.sum(np.asarray(grads[name], np.float64) * direction))
            # what rounding alone leaves of the difference quotient: a derivative below it is checked absolutely
            rounding = ROUNDING * size / epsilon
            scale = max(abs(numeric), abs(analytic), rounding / FD_TOLERANCE)
            errors[name] = (abs(numeric - analytic), 0.0 if scale == 0 else abs(numeric - analytic) / scale)
    return errors


def _inside_range(x, value, direction, reach: float):
    """The direction with its elements zeroed where steps of up to `reach` along it could leave the input's
    declared range (`input g[dk] <= 0`: a log-decay drawn within 2ε of 0 — which a model's inputs at dk = 128
    met in a battery of small ones — would step out of it, and the forward refuses such an input). The derivative
    along what is left is the one inside the domain."""
    value = np.asarray(value, np.float64)
    span = reach * np.abs(direction)
    keep = np.ones(np.shape(value), dtype=bool)
    if x.low is not None:
        keep &= value - span > x.low
    if x.high is not None:
        keep &= value + span < x.high
    return np.where(keep, direction, 0.0)


def _case_arrays(rec, case: Case, seed: int):
    rng = np.random.default_rng(seed)
    inputs = rec.random_inputs(case.batch, case.tokens, case.heads, case.dims, np.float64, seed=seed,
                               decay_scale=case.decay_scale)
    dims = {d.name: d.default for d in rec.program.dims} | case.dims
    state0 = _initial_state(rec.program, case.batch, case.heads, dims, rng)
    drawn = _params_without_default(rec.program, case.heads, dims, rng)
    def forward(arrays):
        return rec.run(arrays, form=reference_form(rec), initial_state=state0, params=drawn or None, dims=case.dims)
    with np.errstate(all="ignore"):
        base = forward(inputs)
    note = verify.nan_in_reference(rec, base, inputs, forward)
    if note:  # (finite differences of a NaN loss check nothing)
        raise LinrecError(f"cannot check gradients: {note}")
    params = {k: np.array(v, dtype=np.float64) for k, v in base.params.items()}
    grad_outputs = {k: rng.standard_normal(v.shape) for k, v in base.outputs.items()}
    grad_state = {k: rng.standard_normal(v.shape) for k, v in base.final_state.items() if k in state0}
    return inputs, params, state0, grad_outputs, grad_state


def run(rec, backends=("numpy",), dtypes=("float64", "float32"), quick: bool = False, seed: int = 0,
        on_row=None, forms=None, sizes: dict | None = None) -> list[Row]:
    """The recurrent gradient in float64 against finite differences; every other gradient form in float64
    against it (1e-9, the forms' tolerance); float32 gradients against the float64 recurrent one (5e-4).
    `forms`: only the rows of these gradient forms (None: every one built); the reference is computed all
    the same. `sizes`: dimensions' sizes for every case (battery)."""
    rows = []
    plan = gradient_forms(rec, backends)
    plan.sort(key=lambda fb: fb[0] != "recurrent")  # (the recurrent gradient first: the others' reference)
    asked = [fb for fb in plan if forms is None or fb[0] in forms]
    per_token = frozenset(x.name for x in rec.program.inputs)  # (the gradients of one token's values)
    for case in battery(rec.program, quick, sizes):
        if not asked:
            break
        inputs, params, state0, g_out, g_state = _case_arrays(rec, case, seed)
        reference = None
        for form, backend in asked:
            for dtype in dtypes:
                for chunk in (case.chunk_sizes if dtype == "float64" else (None,)):
                    cast = {k: v.astype(dtype) for k, v in inputs.items()}
                    result = rec.vjp(cast, {k: v.astype(dtype) for k, v in g_out.items()}, form=form,
                                     backend=backend, grad_final_state={k: v.astype(dtype) for k, v in g_state.items()},
                                     initial_state={k: v.astype(dtype) for k, v in state0.items()},
                                     params={k: v.astype(dtype) for k, v in params.items()},
                                     dims=case.dims, chunk_size=chunk)
                    # finite differences check the recurrent gradient of the first backend (NumPy's where
                    # asked); another backend's recurrent gradient is compared with it, as the other forms are
                    # (a program without a recurrent form: its first gradient form, against its own forward)
                    if dtype == "float64" and (form, backend) == plan[0]:
                        errors = directional_errors(rec, inputs, params, state0, g_out, g_state, result.grads,
                                                    case.dims, seed, form=reference_form(rec))
                        worst = max(errors, key=lambda k: errors[k][1]) if errors else ""
                        diff, err = errors.get(worst, (0.0, 0.0))
                        tol, note = FD_TOLERANCE, f"finite differences; worst: {worst}"
                        reference = reference or result.grads
                    else:
                        if reference is None:  # (the reference's row not asked for, or no float64: its gradient alone)
                            first, on = plan[0]
                            reference = rec.vjp(inputs, g_out, form=first, backend=on, grad_final_state=g_state,
                                                initial_state=state0, params=params, dims=case.dims).grads
                        tol = FORM_TOLERANCE if dtype == "float64" else FLOAT32_TOLERANCE
                        diff, err, worst = _against(result.grads, reference, tol, per_token)
                        note = f"against the float64 recurrent gradient; worst: {worst}"
                    row = Row(form, backend, dtype, case.name, chunk, diff, err, tol,
                              bool(err <= tol), note)
                    rows.append(row)
                    if on_row:
                        on_row(row)
    return rows


def _against(grads: dict, reference: dict | None, tolerance: float = FORM_TOLERANCE,
             per_token=frozenset()) -> tuple[float, float, str]:
    """(max abs, max rel, the worst array's name) of gradients against the float64 recurrent ones: each array's
    error relative to its reference's largest value or, where that lies below what rounding leaves of the
    terms it sums (divided by `tolerance`), to that — an array that small is checked in absolute terms, to the
    rounding, as directional_errors checks a derivative below the rounding of the differences.

    A gradient is a sum of contributions: a param's, of one per token and head; one token's, of those of the
    tokens that read it, each a sum over the values of a token in turn. Another form, another backend, adds
    them in another order, and the results differ by the rounding of the terms — about the dtype's eps times
    their sum, which cancellation does not shrink: the gradient of a bias that softmax ignores (softmax(K·q + b),
    seq(k + c)) is 0 exactly, and each form gives it as ~1e-15 in float64, ~1e-6 in float32. That sum is taken
    as the number of values of a gradient per token (`per_token`: the inputs'), B·T·H·d, times the largest of
    them; and at least the largest gradient of the call (an array far below it, an initial state's through a
    decay of e^−300, the dtype cannot hold beside it)."""
    if reference is None:
        return float("inf"), float("inf"), "no float64 reference"
    worst, worst_abs, name = 0.0, 0.0, ""
    largest = max((float(np.max(np.abs(ref), initial=0.0)) for ref in reference.values()), default=0.0)
    tokens = [reference[k] for k in per_token if k in reference]
    terms = max((np.size(g) * float(np.max(np.abs(g), initial=0.0)) for g in tokens), default=0.0)
    for k, ref in reference.items():
        got = np.asarray(grads[k], np.float64)
        if not np.all(np.isfinite(got)):
            return float("inf"), float("inf"), k
        diff = float(np.max(np.abs(got - ref), initial=0.0))
        rounding = float(np.finfo(grads[k].dtype).eps) * max(largest, terms)
        scale = max(float(np.max(np.abs(ref), initial=0.0)), rounding / tolerance)
        err = diff / scale if scale else diff
        if err >= worst:
            worst, worst_abs, name = err, diff, k
    return worst_abs, worst, name

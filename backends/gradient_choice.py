"""form="auto"'s backward: which gradient form runs a call (linrec.torch's backward, `linrec bench --grad --form
auto`), and why.

Which backward is fastest depends on the CPU as much as on the program. The rule of sizes this replaces (the
chunkwise backward first on C from a state of 128 × 128 values over 1024 tokens) came from an AMD Zen 4, where
the chunkwise `vjp` of GLA at dk = dv = 128 was 1.41 times faster than the recurrent one, and an Intel Xeon (as
fast); on an AMD Zen 5 it was 1.23 times slower there, and at dk = dv = 64, where the rule kept the recurrent one,
the chunkwise one was 1.31 times faster for Mamba-2 and 1.16 for gated DeltaNet (B = 1, H = 8, T = 4096, float32,
two threads; docs/benchmarks.md, "The backward against the forward"). So on C the choice is measured: from
CALIBRATION_TOKENS tokens on, the recurrent and the chunkwise backward each run on that many tokens of the
call's heads, sizes and dtype, once per process, and the faster runs from then on. Both forms' time
is linear in T past a few chunks; at 512 tokens gated DeltaNet's order at dk = dv = 64 was still the other way
round (the recurrent one 0.72 of the chunkwise one, 1.16 from 1024 tokens on), at 1024 every example's order was
T = 4096's. The gradients of the two agree to the forms' tolerance (docs/gradients.md), so the choice is one of
speed only; a caller who wants the same form on every machine names it.

Shorter calls, and the NumPy backend, run the first of gradients.AUTO_ORDER the backend builds: at the sizes of
small models the recurrent backward is the fastest NumPy one (docs/torch.md), and measuring would cost more than
such a call.
"""
from __future__ import annotations

import time

import numpy as np

from . import arrays, gradients
from .dsl.errors import LinrecError

# from this many tokens (the longest sequence of the call) form="auto" on C measures, on this many tokens
CALIBRATION_TOKENS = 1024
MEASURED = ("recurrent", "chunkwise")  # the forms measured against each other

_costs: dict[tuple, dict[str, float] | None] = {}


def auto_gradient_form(rec, backend: str, dims: dict[str, int] | None = None, tokens: int | None = None,
                       heads: int | None = None, batch: int = 1, dtype=np.float32) -> str | None:
    """The gradient form form="auto" runs on this backend for a call of these sizes: the measured faster one
    (measured_form) where there is one, else the first of AUTO_ORDER the backend builds; None when it builds
    none of them (linrec.torch then falls back to NumPy: torch.backward.gradient_plan)."""
    measured = measured_form(rec, backend, dims, tokens, heads, batch, dtype)
    if measured is not None:
        return measured
    return next((f for f in gradients.AUTO_ORDER if gradients.gradient_refusal(rec, f, backend) is None), None)


def no_auto_backward(rec, backend: str) -> str:
    """Why form="auto" has no backward to run on this backend: the forms it tries, each with the backend's
    reason (forms of the same reason together)."""
    why: dict[str, list[str]] = {}
    for form in gradients.AUTO_ORDER:
        why.setdefault(gradients.gradient_refusal(rec, form, backend), []).append(form)
    return f"the {backend} backend builds no backward form=\"auto\" runs: " + \
        "; ".join(f"{', '.join(forms)}: {reason}" for reason, forms in why.items())


def form_for_call(rec, inputs: dict, backend: str, params: dict | None, initial_state: dict | None,
                  dims: dict[str, int] | None, offsets: np.ndarray | None) -> str:
    """Recurrence.vjp(form="auto")'s gradient form for these arguments: auto_gradient_form at their sizes (with
    packed sequences, cu_seqlens' offsets, the longest one's tokens). The inputs' names and shapes are checked
    as vjp checks them; a backend that builds none of AUTO_ORDER is an error that gives each form's reason."""
    _, shape = arrays.check_inputs(rec.program, arrays.by_name(inputs, "inputs"), ranges=False)
    sizes = arrays.resolve_dims(rec.program, shape, dict(params or {}), initial_state, dims)
    tokens = shape.tokens if offsets is None else int(np.diff(offsets).max(initial=0))
    form = auto_gradient_form(rec, backend, sizes, tokens, shape.heads, shape.batch, shape.dtype)
    if form is None:
        raise LinrecError(f"'{rec.name}' has no backward for form='auto': {no_auto_backward(rec, backend)} "
                          f"(see `linrec check`)")
    return form


def measured_form(rec, backend: str, dims: dict[str, int] | None, tokens: int | None, heads: int | None,
                  batch: int = 1, dtype=np.float32) -> str | None:
    """The faster of the recurrent and the chunkwise backward for a call on C of CALIBRATION_TOKENS tokens or
    more (backward_costs), where C builds both; else None (the sizes not known yet, a shorter call, another
    backend, one form not built, or a program the calibration cannot run)."""
    if backend != "c" or None in (dims, tokens, heads) or tokens < CALIBRATION_TOKENS:
        return None
    if any(gradients.gradient_refusal(rec, f, backend) is not None for f in MEASURED):
        return None
    costs = backward_costs(rec, backend, heads, batch, dims, dtype)
    return None if costs is None else min(costs, key=costs.get)


def backward_costs(rec, backend: str, heads: int, batch: int, dims: dict[str, int], dtype) -> dict[str, float] | None:
    """Milliseconds of the whole `vjp` (its forward and backward: a training step's cost either way) of each
    MEASURED form on CALIBRATION_TOKENS tokens of these heads, sizes and dtype and at most 2 batch rows, the
    best of three timed calls (the forms in turn) after one each that builds the kernels; measured once per
    process. None where the program cannot be run on its own defaults (a param without one: the caller's values
    are not the calibration's to guess) or that does not fit in memory at 1024 tokens."""
    rows = min(batch, 2)  # (what is compared is the cost per row and head; more rows, more memory and time)
    key = (rec.compiled.source, backend, heads, rows, tuple(sorted(dims.items())), np.dtype(dtype).str)
    if key not in _costs:
        _costs[key] = _measure(rec, backend, heads, rows, dims, dtype)
    return _costs[key]


def _measure(rec, backend: str, heads: int, rows: int, dims: dict[str, int], dtype) -> dict[str, float] | None:
    try:
        inputs = rec.random_inputs(batch=rows, tokens=CALIBRATION_TOKENS, heads=heads, dims=dims, dtype=dtype, seed=0)
        upstream = gradients.random_upstream(rec, rows, CALIBRATION_TOKENS, heads, dims, dtype)

        def call(form):
            rec.vjp(inputs, upstream, form=form, backend=backend, dims=dims)
        for form in MEASURED:
            call(form)  # (builds the kernels)
        # the forms in turn, so that a spell of load on a shared machine slows both alike
        costs = dict.fromkeys(MEASURED, float("inf"))
        for _ in range(3):
            for form in MEASURED:
                start = time.perf_counter()
                call(form)
                costs[form] = min(costs[form], (time.perf_counter() - start) * 1e3)
        return costs
    except (LinrecError, MemoryError):  # (then the order of AUTO_ORDER decides, as for a shorter call)
        return None

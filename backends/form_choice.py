"""`form="auto"`: which form runs a call, and why.

At the shapes of the model grid (`linrec bench --shapes model`: the (dk, dv), H, B and T models use) the C
backend's choice is a measurement: form_table.json, written by benchmarks/form_table.py from the grid's
timings, holds per update structure (the kind of each state's transition, its corrections and writes, the
readouts — what sets the forms' costs, never a program's name) and per shape the median time of each form,
and `auto` takes the fastest (float32 calls; the table says which machine and thread count). Off the grid —
another shape, dtype or structure — the rules below decide.

Compiled recurrences run the recurrent form: it does the least arithmetic (4·dk·dv flops per token and
head for GLA, 6·dk·dv for the delta rules; the chunkwise and parallel forms add T·C or T² terms) and the C
kernel keeps the state in registers and L1 with no per-token overhead (`linrec bench` measures this).
Where the C backend has no fused recurrent kernel (a non-causal program with exponential keys: every form
is a scan prepared in NumPy), its choice is measured as NumPy's is.

On NumPy the answer depends on the structure of the update: the recurrent form pays interpreter overhead
per token, the chunkwise form per chunk but with more arithmetic — little for a scalar decay, a lot for a
per-channel decay (anchored sub-blocks) or for corrections (a triangular solve per chunk). So NumPy's
choice is measured: both forms run once on a short sequence of the call's heads, sizes and dtype, and the
per-token costs (both forms are linear in T) are remembered for the rest of the process.
"""
from __future__ import annotations

import json
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from . import arrays, registry
from .dsl.errors import LinrecError
from .interface import FUSED
from .registry import builds

# tokens of the calibration run: two chunks of the default chunk size, so that the chunkwise form pays
# its state pass between chunks
CALIBRATION_TOKENS = 128
# calls this short run the recurrent form without measuring (the measurement would cost more than the call)
SHORT = 16

_measured: dict[tuple, dict[str, float]] = {}

# the grid's measured times (benchmarks/form_table.py writes it; docs/benchmarks.md says how)
FORM_TABLE = Path(__file__).resolve().parent / "form_table.json"


def structure(compiled) -> str:
    """What sets the forms' relative costs, read off the decomposition: per state its rank and the kind of its
    transition (compiler.transitions: the decay, the corrections and their side), its corrections (either
    side's: the kind tells which) and writes; the readouts. Programs with the same structure share a row of the
    table."""
    d = compiled.decomposition
    states = {s.name: s for s in compiled.program.states}
    parts = [f"{'matrix' if len(states[t.state].shape) == 2 else 'vector'} state: {t.kind}, "
             f"{len(t.corrections) + len(t.value_corrections)} correction(s), {len(t.writes)} write(s)"
             for t in d.transitions]
    return "; ".join(parts + [f"{len(d.readouts)} readout(s)"])


def grid_sizes(compiled, sizes: dict[str, int]) -> tuple[int, int] | None:
    """(dk, dv) of the grid for these sizes: the rows and columns of the first matrix state (None: no matrix
    state, no row of the grid)."""
    matrix = next((s for s in compiled.program.states if len(s.shape) == 2), None)
    return None if matrix is None else (sizes[matrix.shape[0]], sizes[matrix.shape[1]])


@lru_cache(maxsize=None)
def _table(path: Path) -> dict:
    """The table as {(backend, dtype, structure, dk, dv, H, B, T): {form: ms}}, with its header."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    rows = {}
    for r in raw["rows"]:
        key = (raw["backend"], raw["dtype"], r["structure"], r["dk"], r["dv"], r["H"], r["B"], r["T"])
        rows[key] = r["ms"]
    return {"header": {k: v for k, v in raw.items() if k != "rows"}, "rows": rows}


def measured_choice(rec, backend: str, tokens: int, heads: int, batch: int, sizes: dict[str, int], dtype,
                    built: list[str], path: Path | None = None) -> tuple[str, str] | None:
    """(form, reason) from the table of measured times at this grid shape, or None off the grid (another
    shape, dtype, backend or structure, or fewer than two of the forms built measured there)."""
    path = FORM_TABLE if path is None else path
    dk_dv = grid_sizes(rec.compiled, sizes)
    if dk_dv is None or not path.exists():
        return None
    table = _table(path)
    key = (backend, np.dtype(dtype).name, structure(rec.compiled), *dk_dv, heads, batch, tokens)
    times = {f: ms for f, ms in table["rows"].get(key, {}).items() if f in built}
    if len(times) < 2:
        return None
    best = min(times, key=times.get)
    told = ", ".join(f"{f} {ms:.1f} ms" for f, ms in sorted(times.items(), key=lambda fm: fm[1]))
    return best, (f"fastest measured at this shape of the model grid ({told}; {table['header']['measured_on']}, "
                  f"{path.name})")


def choose(rec, backend: str, tokens: int, heads: int = 8, batch: int = 1,
           dims: dict[str, int] | None = None, dtype=np.float32) -> tuple[str, str]:
    """(form, reason) for a call of `tokens` tokens, among the forms `backend` builds (a form the program
    has may not be built by every backend: C does not run every recurrent form, say)."""
    forms = rec.forms
    sizes = {d.name: d.default for d in rec.program.dims} | arrays.checked_sizes(rec.program, dims)
    built = [f for f in forms if builds(rec.compiled, backend, f)]
    if not built:
        raise LinrecError(why_nothing_to_choose(rec, backend))
    if len(built) == 1:
        return built[0], (f"the only form '{rec.name}' has" if len(forms) == 1 else
                          f"the only form of '{rec.name}' the {backend} backend builds")
    sequence = rec.decomposition.sequence
    if sequence is not None and "chunkwise" in built:
        if sequence.kind == "lsh":
            return "chunkwise", "the bucketed form: O(T log T) instead of the dense reference's O(T²)"
        return "chunkwise", "blocked online softmax: linear memory, keys read once per query block"
    measured = measured_choice(rec, backend, tokens, heads, batch, sizes, dtype, built)
    if measured is not None:
        return measured
    if "recurrent" in built and registry.backend(backend).recurrent_kernel(rec.compiled) == FUSED:
        return "recurrent", "compiled recurrent kernel: least arithmetic, state kept in registers and L1"
    if "recurrent" not in built:  # (then the backend builds the parallel and chunkwise forms: C's scans)
        return "chunkwise", f"the {backend} backend builds no recurrent form of '{rec.name}', and the chunkwise " \
                            f"form's work grows with T, the parallel form's with T²"
    if "chunkwise" not in built or tokens <= SHORT:
        return "recurrent", f"T ≤ {SHORT} (or no chunkwise form): a few steps, nothing to amortize"
    costs = per_token_cost(rec, backend, heads, batch, sizes, dtype)
    if costs is None:
        return "chunkwise", ("not measured: the calibration runs the file's params, and a param has no default; "
                             "the chunkwise form, which pays its overhead per chunk where the recurrent one pays "
                             "it per token")
    best = min(costs, key=costs.get)
    told = ", ".join(f"{f} {c:.0f} µs/token" for f, c in sorted(costs.items(), key=lambda fc: fc[1]))
    return best, f"measured on {CALIBRATION_TOKENS} tokens ({told}); both forms are linear in T"


def why_nothing_to_choose(rec, backend: str) -> str | None:
    """Why `auto` has no form to pick on this backend (it builds none of the program's), or None when it has
    one: for callers that list such a backend with the reason (linrec bench) instead of failing as choose does."""
    if any(builds(rec.compiled, backend, f) for f in rec.forms):
        return None
    return f"the {backend} backend builds no form of '{rec.name}': " \
           f"{registry.refusal(rec.compiled, backend, rec.forms[0])}"


def per_token_cost(rec, backend: str, heads: int, batch: int, sizes: dict[str, int], dtype) -> dict[str, float] | None:
    """µs per token of the recurrent and chunkwise forms for these heads, sizes and dtype: the better of
    two timed runs after a warm-up, measured once per process. None for a program with a param without a
    default: the calibration runs the file's params, and the caller's values are not its to guess."""
    if any(p.default is None for p in rec.program.params):  # (as bench.require_param_defaults tells them)
        return None
    key = (rec.compiled.source, backend, heads, min(batch, 4), tuple(sorted(sizes.items())), np.dtype(dtype).str)
    if key not in _measured:
        inputs = rec.random_inputs(batch=min(batch, 4), tokens=CALIBRATION_TOKENS, heads=heads, dims=sizes,
                                   dtype=dtype, seed=0)
        costs = {}
        for form in ("recurrent", "chunkwise"):
            rec.run(inputs, form=form, backend=backend, dims=sizes)  # warm-up: builds the module
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                rec.run(inputs, form=form, backend=backend, dims=sizes)
                best = min(best, time.perf_counter() - t0)
            costs[form] = best / CALIBRATION_TOKENS * 1e6
        _measured[key] = costs
    return _measured[key]

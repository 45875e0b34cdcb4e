"""`linrec verify`: run every form on every backend over a battery of generated inputs and compare each
with the float64 recurrent form (outputs and final states).

The error of a result is max|x − ref| / max|ref| over each array (a normwise relative error, robust where
ref is near zero). Tolerances:
  * float64: 1e-9 — the forms reassociate sums (chunked GEMMs, a triangular solve) in double precision;
    observed errors are ~1e-13, the margin absorbs the conditioning of the delta rule's UT transform.
  * float32: 5e-4 — float32 rounding (eps 6e-8) accumulated over up to 32768 tokens, dot products of
    length dk and a C×C triangular solve; observed worst 7e-6 on the shipped examples (strong decay,
    parallel form). The field's hand-written tests accept 4e-3 to 8e-3 relative RMS (forms.md §6b).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np

from .compiler.builtins import SEQ
from .compiler.sequence import is_sequence_program
from .compiler.stabilize import stabilized_states
from .decode import run_by_steps
from .interface import DEFINITION
from .registry import STEP, refusal

TOLERANCE = {"float64": 1e-9, "float32": 5e-4}
PARALLEL_MAX_T = 4096  # the parallel form holds T×T scores per head: checked up to this length
# STEP ("step"): the sequence run one token at a time through the decode step (run --form step), state carried
STEP_MAX_T = 200  # a Python call per token: checked up to this length


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    tokens: int
    heads: int
    dims: dict = field(default_factory=dict)
    decay_scale: float = 1.0
    chunk_sizes: tuple = (64,)


def program_reads_sequence(program) -> bool:
    return is_sequence_program(program)


def decode_forms(rec) -> list[str]:
    """["step"] when the program decodes token by token (causal, with a recurrent form), else []."""
    return [STEP] if rec.program.causal and "recurrent" in rec.forms else []


def why_not(rec, form: str) -> str | None:
    """Why the program has no such form to check (None: it has), the decode step included."""
    if form == STEP:
        return None if decode_forms(rec) else "no decode step: it is non-causal, or has no recurrent form"
    return rec.decomposition.why_not(form)


def reference_form(rec) -> str:
    """The float64 recurrent form is the definition; a program without one (Linformer, Reformer) is checked
    against its dense parallel form, and one whose recurrent form is stabilized (exponential feature maps,
    carried as S·exp(−M)) against its statements as written (interface.DEFINITION): the stabilized
    recurrent form is then checked like every other."""
    if "recurrent" not in rec.forms:
        return "parallel"
    return DEFINITION if stabilized_states(rec.compiled) else "recurrent"


def battery(program, quick: bool = False) -> list[Case]:
    sized = [d for d in program.dims if d.name != SEQ]  # the maximum length stays as declared
    small = {d.name: min(d.default, 8) for d in sized}
    odd = {d.name: (5 + 2 * i) for i, d in enumerate(sized)}
    cases = [
        Case("T=1", 2, 1, 2, small, chunk_sizes=(64,)),
        Case("ragged T", 2, 37, 3, small, chunk_sizes=(16, 64)),
        Case("odd dims", 1, 50, 2, odd, chunk_sizes=(7, 32)),
        Case("mild decay", 1, 130, 2, small, decay_scale=0.1, chunk_sizes=(64,)),
        Case("strong decay", 2, 100, 2, small, decay_scale=40.0, chunk_sizes=(16, 64)),
        # forms that read the whole sequence are quadratic in T: their long case is shorter
        Case("long T", 1, 2048 if quick or program_reads_sequence(program) else 32768, 1, small,
             chunk_sizes=(64,)),
    ]
    if not quick:
        cases.insert(3, Case("several B, H", 3, 200, 4, small, chunk_sizes=(32, 64, 128)))
    longest = next((d.default for d in program.dims if d.name == SEQ), None)  # params over the sequence axis
    if longest is not None:
        cases = [replace(c, tokens=min(c.tokens, longest)) for c in cases]
    return cases


@dataclass
class Row:
    form: str
    backend: str
    dtype: str
    case: str
    chunk_size: int | None
    max_abs: float
    max_rel: float
    tolerance: float
    passed: bool
    note: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _initial_state(program, batch, heads, dims, rng):
    """Random initial states; vector states (normalizers, as in φ(q)·z) are kept positive."""
    out = {}
    for s in program.states:
        shape = (batch, heads) + tuple(dims[d] for d in s.shape)
        x = rng.standard_normal(shape) * 0.5
        out[s.name] = np.abs(x) + 0.5 if len(s.shape) == 1 else x
    return out


def _params_without_default(program, heads, dims, rng):
    """Values for the params a file leaves to the caller (standard normal, scaled like the initial states):
    the forms must agree whatever the values."""
    return {p.name: rng.standard_normal(((heads,) if p.per_head else ()) + tuple(dims[d] for d in p.shape)) * 0.5
            for p in program.params if p.default is None}


def _compare(result, reference) -> tuple[float, float]:
    worst_abs, worst_rel = 0.0, 0.0
    for group in ("outputs", "final_state"):
        for name, ref in getattr(reference, group).items():
            got = np.asarray(getattr(result, group)[name], dtype=np.float64)
            if not np.all(np.isfinite(got)):
                return float("inf"), float("inf")
            err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
            scale = float(np.max(np.abs(ref))) if ref.size else 1.0
            worst_abs = max(worst_abs, err)
            worst_rel = max(worst_rel, err / max(scale, 1e-300))
    return worst_abs, worst_rel


def run(rec, backends=("numpy",), forms=None, dtypes=("float64", "float32"), quick=False, seed=0,
        on_row=None, on_progress=None) -> list[Row]:
    """Every (form, backend, dtype, case, chunk size) against the float64 NumPy recurrent form; by default
    the decode step too (outputs and final states of the tokens run one at a time)."""
    forms = list(forms or list(rec.forms) + decode_forms(rec))
    rows = []
    cases = battery(rec.program, quick)
    plan = []
    for case in cases:
        for form in forms:
            for backend in backends:
                if not builds(rec, backend, form):
                    continue  # reported by `missing` below
                for dtype in dtypes:
                    for chunk in (case.chunk_sizes if form == "chunkwise" else (None,)):
                        plan.append((case, form, backend, dtype, chunk))
    refs = {}
    ref_form = reference_form(rec)
    for i, (case, form, backend, dtype, chunk) in enumerate(plan):
        if on_progress:
            on_progress(i, len(plan), f"{case.name}: {form} {backend} {dtype}")
        if case.name not in refs:
            rng = np.random.default_rng(seed)
            inputs = rec.random_inputs(case.batch, case.tokens, case.heads, case.dims, np.float64,
                                       seed=seed, decay_scale=case.decay_scale)
            dims = {d.name: d.default for d in rec.program.dims} | case.dims
            state0 = _initial_state(rec.program, case.batch, case.heads, dims, rng)
            drawn = _params_without_default(rec.program, case.heads, dims, rng)
            refs[case.name] = (inputs, state0, rec.run(inputs, form=ref_form, initial_state=state0,
                                                       params=drawn or None))
        inputs, state0, reference = refs[case.name]
        tol = TOLERANCE[dtype]
        if (form == "parallel" and case.tokens > PARALLEL_MAX_T) or (form == STEP and case.tokens > STEP_MAX_T):
            continue
        if (form, backend, dtype) == (ref_form, "numpy", "float64"):
            continue  # that is the reference itself
        cast = {k: v.astype(dtype) for k, v in inputs.items()}
        s0 = {k: v.astype(dtype) for k, v in state0.items()}
        params = {k: v.astype(dtype) for k, v in reference.params.items()}
        start = time.perf_counter()
        if form == STEP:
            result = run_by_steps(rec, cast, backend=backend, params=params, initial_state=s0)
        else:
            result = rec.run(cast, form=form, backend=backend, initial_state=s0, params=params, chunk_size=chunk)
        elapsed = time.perf_counter() - start
        max_abs, max_rel = _compare(result, reference)
        row = Row(form, backend, dtype, case.name, chunk, max_abs, max_rel, tol, bool(max_rel <= tol),
                  note=f"{elapsed * 1e3:.0f} ms")
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


def missing(rec, backends, forms=None) -> list[tuple[str, str, str]]:
    """(form, backend, why) for the forms the program has but a backend does not build."""
    out = []
    for f in forms or list(rec.forms) + decode_forms(rec):
        for b in backends:
            why = refusal(rec.compiled, b, f)
            if why:
                out.append((f, b, str(why)))
    return out


def builds(rec, backend: str, form: str) -> bool:
    """Whether `backend` builds `form` (the decode step: the recurrent form's kernel) of the program."""
    return refusal(rec.compiled, backend, form) is None


def format_row(row: Row) -> str:
    chunk = f"C={row.chunk_size}" if row.chunk_size else ""
    status = "pass" if row.passed else "FAIL"
    return (f"{row.form:<10} {row.backend:<6} {row.dtype:<8} {row.case:<13} {chunk:<6} "
            f"{row.max_abs:10.2e} {row.max_rel:10.2e} {row.tolerance:9.0e}  {status}")


HEADER = (f"{'form':<10} {'backend':<6} {'dtype':<8} {'case':<13} {'chunk':<6} {'max abs':>10} "
          f"{'max rel':>10} {'tolerance':>9}  result")


def progress_to_stderr(i: int, total: int, what: str):
    sys.stderr.write(f"\r[{i + 1}/{total}] {what:<60}")
    sys.stderr.flush()
    if i + 1 == total:
        sys.stderr.write("\n")

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
from . import bf16_state
from .decode import at_true_scale, run_by_steps
from .interface import DEFINITION
from .registry import STEP, refusal
from .serving import why_not_packed

TOLERANCE = {"float64": 1e-9, "float32": 5e-4}

# The decode step with its state kept in bfloat16 between tokens (state_dtype="bfloat16", float32 inputs): the
# row's dtype label, and its tolerance. Each token rounds the state once to bfloat16's 8-bit mantissa, a relative
# error of at most 2⁻⁹ per element; independent roundings add like a random walk, so over the battery's ≤ 256
# steps (STEP_MAX_T) ~√256·2⁻⁹ = 2⁻⁵ on the state (decay only shrinks the older ones). An output is a sum over
# a row of the state that partly cancels, and a normalized one (q·S / q·z) carries the errors of both: up to
# 4× that relative to its largest value, 2⁻³. The largest measured over every example's battery: 5.3e-2
# (RetNet, several B, H; docs/serving.md#a-bfloat16-state).
BF16_STATE = "float32+bf16"
TOLERANCE_BF16_STATE = 2.0 ** -3
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
    backends: tuple | None = None  # the backends it checks (None: every one asked for)


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


def case_sizes(program, largest: int, sizes: dict | None = None) -> tuple[list, dict, dict]:
    """A battery's sized dimensions (every one but the sequence's bound, which stays as declared), their small
    sizes (the file's, at most `largest`) and odd ones — each replaced by `sizes` where it names the dimension
    (verify --dim: the head sizes a model uses, at which the C kernels tile, block and split otherwise)."""
    sized = [d for d in program.dims if d.name != SEQ]
    small = {d.name: min(d.default, largest) for d in sized} | (sizes or {})
    odd = {d.name: (5 + 2 * i) for i, d in enumerate(sized)} | (sizes or {})
    return sized, small, odd


def battery(program, quick: bool = False, sizes: dict | None = None) -> list[Case]:
    """The cases, at small and odd sizes, or at `sizes` (case_sizes) in every case but the size-1 axis's own."""
    sized, small, odd = case_sizes(program, 8, sizes)
    cases = [
        Case("T=1", 2, 1, 2, small, chunk_sizes=(64,)),
        Case("ragged T", 2, 37, 3, small, chunk_sizes=(16, 64)),
        Case("odd dims", 1, 50, 2, odd, chunk_sizes=(7, 32)),
        # the first size 1 (a state of one row: a decay per row has the shape of one per token, and the NumPy
        # forms once told them apart by it); NumPy only, as a size of its own would build every C kernel again
        *([Case("size-1 axis", 1, 40, 2, odd | {sized[0].name: 1}, chunk_sizes=(16,), backends=("numpy",))]
          if sized else []),
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
    skipped: bool = False  # not comparable: the float64 reference lies beyond what this dtype can hold

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        if self.skipped:  # (no errors measured: null in JSON, not NaN, which JSON does not have)
            out["max_abs"] = out["max_rel"] = None
        return out


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


def underflow_floor(dtype: str, tolerance: float) -> float:
    """The least scale of a row's relative errors in `dtype`: a result resolves nothing below the dtype's smallest
    normal number (the kernels' exponentials give 0 there, and a value decayed past it may be flushed), so an
    error of that size passes — a float32 state that float64 decays to 1e-39 or 1e-60 is 0 in float32."""
    return float(np.finfo(dtype).tiny) / tolerance


def difference(got, ref, floor: float = 0.0) -> tuple[float, float]:
    """(max abs, max rel) of `got` against the reference `ref`, the relative error normwise (max|got − ref| /
    max|ref|, that scale at least `floor`) over the finite entries of ref. Where ref is NaN or ±∞, got must be
    the same (docs/guarantees.md, non-finite values: each form gives the reference's NaN, its infinities, its
    finite values); a shape that differs, or a non-finite value where ref has another value, is (inf, inf)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return float("inf"), float("inf")
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), finite):
        return float("inf"), float("inf")
    if not finite.all():
        odd = ~finite  # (NaN at the same places, the same infinities elsewhere)
        if not (np.array_equal(np.isnan(got[odd]), np.isnan(ref[odd]))
                and np.array_equal(got[odd & ~np.isnan(ref)], ref[odd & ~np.isnan(ref)])):
            return float("inf"), float("inf")
    if not finite.any():
        return 0.0, 0.0
    err = float(np.max(np.abs(got[finite] - ref[finite])))
    return err, err / max(float(np.max(np.abs(ref[finite]))), floor, 1e-300)


def _compare(result, reference, floor: float = 0.0) -> tuple[float, float]:
    worst_abs, worst_rel = 0.0, 0.0
    for group in ("outputs", "final_state"):
        for name, ref in getattr(reference, group).items():
            err, rel = difference(getattr(result, group)[name], ref, floor)
            worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
    return worst_abs, worst_rel


def nan_in_reference(rec, reference, inputs: dict, run_reference) -> str | None:
    """The note for a reference with NaN on random inputs, None without: where (the first array and index), and
    the input whose range to declare — the first without a declared range whose absolute value, in its place,
    leaves no NaN (`run_reference(inputs)`: the reference on other inputs), else a range in general."""
    where = next(((group, name, np.argwhere(np.isnan(value))[0]) for group in ("outputs", "final_state")
                  for name, value in getattr(reference, group).items() if np.isnan(value).any()), None)
    if where is None:
        return None
    group, name, index = where
    what = f"output '{name}'" if group == "outputs" else f"final state '{name}'"

    def has_nan(result) -> bool:
        return any(np.isnan(v).any() for group in ("outputs", "final_state") for v in getattr(result, group).values())
    culprit = None
    for x in rec.program.inputs:
        if x.low is None and x.high is None:
            with np.errstate(all="ignore"):
                if not has_nan(run_reference({**inputs, x.name: np.abs(inputs[x.name])})):
                    culprit = x
                    break
    example = f"`input {culprit.name}{'[' + ', '.join(culprit.shape) + ']' if culprit.shape else ''} >= 0`" \
        if culprit else "`input x[dk] >= 0` for the input that needs it"
    return (f"the reference itself has NaN on these random inputs ({what} at index {index.tolist()}); the forms "
            f"are compared NaN for NaN, but random inputs that give NaN usually mean an input needs a declared "
            f"range: declare one such as {example}")


def beyond_range(reference, dtype: str) -> str | None:
    """Why a row of `dtype` cannot be compared with this float64 reference, or None: the reference itself
    overflows (an infinity — a growth the random inputs compound past float64), or its values reach past the
    largest finite value of `dtype` (a float32 run must overflow there: no tolerance means anything)."""
    return _beyond(dtype, [v for group in ("outputs", "final_state") for v in getattr(reference, group).values()])


def _note_skip(notes: list | None, where: str, why: str) -> None:
    """The report's note, once, for rows not compared: where, and why."""
    if notes is not None and (note := f"{where}: {why}; its rows are not compared (skip)") not in notes:
        notes.append(note)


def _beyond(dtype: str, reference_arrays) -> str | None:
    """beyond_range's reason for these float64 reference arrays."""
    values = [np.asarray(v) for v in reference_arrays]
    if any(np.isinf(v).any() for v in values):
        return "the float64 reference itself overflows (an infinity) on these random inputs"
    largest = max((float(np.max(np.abs(v[np.isfinite(v)]), initial=0.0)) for v in values), default=0.0)
    limit = float(np.finfo(dtype).max)
    if largest > limit:
        return f"the float64 reference reaches {largest:.1e}, beyond {dtype}'s largest value ({limit:.1e})"
    return None


def run(rec, backends=("numpy",), forms=None, dtypes=("float64", "float32"), quick=False, seed=0,
        on_row=None, on_progress=None, state_bf16: bool = False, notes: list | None = None,
        sizes: dict | None = None) -> list[Row]:
    """Every (form, backend, dtype, case, chunk size) against the float64 NumPy recurrent form; by default
    the decode step too (outputs and final states of the tokens run one at a time). state_bf16: also the
    decode step with its state kept in bfloat16 (rows BF16_STATE, float32 tokens, TOLERANCE_BF16_STATE).
    `notes`: a list that gets what the report should say once (a reference with NaN: nan_in_reference).
    `sizes`: dimensions' sizes for every case and the serving rows (battery)."""
    forms = list(forms or list(rec.forms) + decode_forms(rec))
    rows = []
    cases = battery(rec.program, quick, sizes)
    plan = []
    for case in cases:
        for form in forms:
            for backend in backends:
                if case.backends is not None and backend not in case.backends:
                    continue
                if not builds(rec, backend, form):
                    continue  # reported by `missing` below
                with_bits = [BF16_STATE] if state_bf16 and form == STEP else []
                for dtype in list(dtypes) + with_bits:
                    for chunk in (case.chunk_sizes if form == "chunkwise" else (None,)):
                        plan.append((case, form, backend, dtype, chunk))
    refs = {}
    ref_form = reference_form(rec)
    nan_noted = False
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
            def reference_on(arrays):
                return rec.run(arrays, form=ref_form, initial_state=state0, params=drawn or None)
            with np.errstate(all="ignore"):  # (NaN from the statements: said once, below, as a note)
                refs[case.name] = (inputs, state0, reference_on(inputs))
            if notes is not None and not nan_noted and not beyond_range(refs[case.name][2], "float64"):
                note = nan_in_reference(rec, refs[case.name][2], inputs, reference_on)
                if note:
                    notes.append(note)
                    nan_noted = True  # (once: the first case whose reference has NaN)
        inputs, state0, reference = refs[case.name]
        bits = dtype == BF16_STATE  # (float32 inputs, the state in bfloat16 between the steps)
        tol = TOLERANCE_BF16_STATE if bits else TOLERANCE[dtype]
        dtype_run = "float32" if bits else dtype
        if (form == "parallel" and case.tokens > PARALLEL_MAX_T) or (form == STEP and case.tokens > STEP_MAX_T):
            continue
        if (form, backend, dtype) == (ref_form, "numpy", "float64"):
            continue  # that is the reference itself
        beyond = beyond_range(reference, dtype_run)
        if beyond:  # (a growth compounded over the case's tokens, say: said once per case and dtype, below)
            rows.append(Row(form, backend, dtype, case.name, chunk, float("nan"), float("nan"), tol, True,
                            note=beyond, skipped=True))
            every_dtype = beyond_range(reference, "float64")  # (an overflowing reference: no dtype compares)
            _note_skip(notes, f"case '{case.name}'" + ("" if every_dtype else f", {dtype_run}"), beyond)
            if on_row:
                on_row(rows[-1])
            continue
        cast = {k: v.astype(dtype_run) for k, v in inputs.items()}
        s0 = {k: v.astype(dtype_run) for k, v in state0.items()}
        params = {k: v.astype(dtype_run) for k, v in reference.params.items()}
        start = time.perf_counter()
        if bits:  # the initial state rounded to bfloat16 too: part of the error the tolerance covers
            result = run_by_steps(rec, cast, backend=backend, params=params,
                                  initial_state=bf16_state.narrow(rec.program, s0), state_dtype="bfloat16")
            result.final_state = bf16_state.widen(rec.program, result.final_state)
        elif form == STEP:
            result = run_by_steps(rec, cast, backend=backend, params=params, initial_state=s0)
        else:
            result = rec.run(cast, form=form, backend=backend, initial_state=s0, params=params, chunk_size=chunk)
        elapsed = time.perf_counter() - start
        max_abs, max_rel = _compare(result, reference, underflow_floor(dtype_run, tol))
        row = Row(form, backend, dtype, case.name, chunk, max_abs, max_rel, tol, bool(max_rel <= tol),
                  note=f"{elapsed * 1e3:.0f} ms")
        rows.append(row)
        if on_row:
            on_row(row)
    for row in serving_rows(rec, backends, forms, dtypes, seed, on_progress, sizes=sizes):
        rows.append(row)
        if row.skipped:
            _note_skip(notes, f"case '{row.case}', {row.dtype}", row.note)
        if on_row:
            on_row(row)
    return rows


# ---- serving (docs/serving.md): checkpoints, last-K states, packed batches, the slot-pool step ----
SERVING_TOKENS, SERVING_EVERY, SERVING_LAST = 37, 6, 3
SERVING_LENGTHS = (0, 1, 13, 0, 7, 16)  # ragged: empty, one token, none a multiple of the chunk sizes below
SERVING_CHUNKS = (4, 16)
POOL_SLOTS, POOL_ROWS = 6, (4, 0, 2)    # requests at these slots of a pool of 6; the other slots stay


def serving_rows(rec, backends, forms, dtypes, seed=0, on_progress=None, floor: float = 0.0,
                 sizes: dict | None = None, comparable=None) -> list[Row]:
    """Rows for what a serving engine asks, each against the float64 reference form run on its own:
    `checkpoints` (state_every: each the reference state after its token), `last K` (keep_last: entry j − 1
    is running the prompt and j draft tokens alone), `cu_seqlens` (each packed sequence equals it run alone,
    with its own initial state; lengths 0, 1 and none a multiple of the chunk size), and `slot pool` (with
    the decode step: the pool's rows equal per-request steps, the other rows bit-identical). `floor`: the
    smallest scale an array's error is measured against (difference; 0: its own largest value). `sizes`:
    dimensions' sizes instead of small ones (battery). `comparable`: a test of the reference run whole (a
    Result), no rows (an empty list) where it fails — tests/fuzzing.py's rule for comparing forms at all, which
    leaves out an expanding transition, whose forms round apart by up to ε times the growth."""
    program = rec.program
    _, small, _ = case_sizes(program, 8, sizes)
    dims = {d.name: d.default for d in program.dims} | small
    rng = np.random.default_rng(seed)
    ref_form = reference_form(rec)
    stateful = bool(program.states)
    packed = why_not_packed(program, rec.decomposition.sequence) is None
    tokens = SERVING_TOKENS if SEQ not in dims else min(SERVING_TOKENS, dims[SEQ])
    inputs = rec.random_inputs(2, tokens, 2, small, np.float64, seed=seed)
    state0 = _initial_state(program, 2, 2, dims, rng)
    drawn = _params_without_default(program, 2, dims, rng) or None
    whole = rec.run(inputs, form=ref_form, initial_state=state0, params=drawn)
    params = whole.params
    if comparable is not None and not comparable(whole):
        return []

    def prefix_states(ends, source=inputs, start=state0):
        return [rec.run({k: v[:, :end] for k, v in source.items()}, form=ref_form, initial_state=start,
                        params=params).final_state for end in ends]

    refs = {}
    if stateful:
        refs["checkpoints"] = prefix_states(range(SERVING_EVERY, tokens + 1, SERVING_EVERY))
        refs["last K"] = prefix_states(range(tokens - SERVING_LAST + 1, tokens + 1))
    offsets = np.concatenate([[0], np.cumsum(SERVING_LENGTHS)])
    if packed:
        row_inputs = rec.random_inputs(1, int(offsets[-1]), 2, small, np.float64, seed=seed + 1)
        row_state0 = _initial_state(program, len(SERVING_LENGTHS), 2, dims, rng)
        alone = []
        for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            own = {k: v[i:i + 1] for k, v in row_state0.items()}
            part = {k: v[:, a:b] for k, v in row_inputs.items()}
            if a == b:
                alone.append((None, own, []))
                continue
            res = rec.run(part, form=ref_form, initial_state=own, params=params)
            alone.append((res.outputs, res.final_state,
                          prefix_states(range(SERVING_EVERY, b - a + 1, SERVING_EVERY), part, own) if stateful else []))
    rows = []
    sequence_forms = [f for f in forms if f != STEP]
    plan = [(f, b, d, c) for f in sequence_forms for b in backends if builds(rec, b, f) for d in dtypes
            for c in (SERVING_CHUNKS if f == "chunkwise" else (None,))]
    for i, (form, backend, dtype, chunk) in enumerate(plan):
        if on_progress:
            on_progress(i, len(plan), f"serving: {form} {backend} {dtype}")
        cast = {k: v.astype(dtype) for k, v in inputs.items()}
        s0 = {k: v.astype(dtype) for k, v in state0.items()}
        used = {k: v.astype(dtype) for k, v in params.items()}
        run = dict(form=form, backend=backend, params=used, chunk_size=chunk)
        if stateful:
            res = rec.run(cast, initial_state=s0, state_every=SERVING_EVERY, **run)
            pairs = _result_pairs(res, whole) + _state_pairs(res.checkpoints, refs["checkpoints"])
            rows.append(_serving_row(form, backend, dtype, "checkpoints", chunk, pairs, floor=floor))
            res = rec.run(cast, initial_state=s0, keep_last=SERVING_LAST, **run)
            pairs = _result_pairs(res, whole) + _state_pairs(res.last_states, refs["last K"])
            rows.append(_serving_row(form, backend, dtype, "last K", chunk, pairs, floor=floor))
        if packed:
            res = rec.run({k: v.astype(dtype) for k, v in row_inputs.items()},
                          initial_state={k: v.astype(dtype) for k, v in row_state0.items()},
                          cu_seqlens=offsets, state_every=SERVING_EVERY if stateful else None, **run)
            pairs = []
            for n, (outputs, final, checkpoints) in enumerate(alone):
                a, b = offsets[n], offsets[n + 1]
                pairs += [(res.outputs[k][:, a:b], v) for k, v in (outputs or {}).items()]
                pairs += [(res.final_state[k][n:n + 1], v) for k, v in final.items()]
                c0, c1 = (res.checkpoint_offsets[n:n + 2] if stateful else (0, 0))
                if stateful and c1 - c0 != len(checkpoints):
                    pairs.append((np.array([np.inf]), np.array([1.0])))  # (a wrong count of checkpoints fails)
                taken = {k: v[:, c0:c1] for k, v in res.checkpoints.items()}
                pairs += _state_pairs(taken, checkpoints)
            rows.append(_serving_row(form, backend, dtype, "cu_seqlens", chunk, pairs, floor=floor))
    if STEP in forms and stateful and program.causal:
        for backend in backends:
            if builds(rec, backend, STEP):
                for dtype in dtypes:
                    rows.append(_slot_pool_row(rec, backend, dtype, params, dims, seed, floor))
    return rows


def _result_pairs(result, reference) -> list[tuple]:
    """(got, reference) for every output and final state of a run."""
    return [(getattr(result, group)[name], ref) for group in ("outputs", "final_state")
            for name, ref in getattr(reference, group).items()]


def _state_pairs(taken: dict, references: list[dict]) -> list[tuple]:
    """(got, reference) for states taken along the way ([B, n, H, *] by name) and the reference states
    [B, H, *] one by one; a count that differs is a failure."""
    pairs = []
    for name in (references[0] if references else taken):
        got = taken.get(name)
        if got is None or got.shape[1] != len(references):
            return [(np.array([np.inf]), np.array([1.0]))]
        pairs += [(got[:, j], ref[name]) for j, ref in enumerate(references)]
    return pairs


def _serving_row(form, backend, dtype, case, chunk, pairs, note="", floor: float = 0.0) -> Row:
    beyond = _beyond(dtype, [ref for _, ref in pairs])
    if beyond:  # (as the battery's rows: a float32 run must overflow where its reference passes float32's range)
        return Row(form, backend, dtype, case, chunk, float("nan"), float("nan"), TOLERANCE[dtype], True,
                   note=beyond, skipped=True)
    worst_abs, worst_rel = 0.0, 0.0
    tol = TOLERANCE[dtype]
    for got, ref in pairs:
        err, rel = difference(got, ref, max(floor, underflow_floor(dtype, tol)))
        worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, rel)
    return Row(form, backend, dtype, case, chunk, worst_abs, worst_rel, tol, bool(worst_rel <= tol), note)


def _slot_pool_row(rec, backend, dtype, params, dims, seed, floor: float = 0.0) -> Row:
    """One slot-pool step over a pool of POOL_SLOTS rows: the active rows against each request's float64
    step on NumPy, the other rows compared bit for bit (any change fails the row)."""
    rng = np.random.default_rng(seed + 2)
    pool = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in
            _initial_state(rec.program, POOL_SLOTS, 2, dims, rng).items()}
    before = {k: v.copy() for k, v in pool.items()}
    slots = np.array(POOL_ROWS)
    tokens = {k: np.ascontiguousarray(v[:, 0]) for k, v in
              rec.random_inputs(len(slots), 1, 2, {k: v for k, v in dims.items() if k != SEQ}, np.float64,
                                seed=seed + 3).items()}
    outputs, _ = rec.step({k: v.astype(dtype) for k, v in tokens.items()}, pool, backend=backend,
                          params={k: v.astype(dtype) for k, v in params.items()}, slots=slots)
    pairs = []
    for n, slot in enumerate(slots):
        own = {k: v[slot:slot + 1].astype(np.float64) for k, v in before.items()}
        ref_out, ref_state = rec.step({k: v[n:n + 1] for k, v in tokens.items()}, own, params=params)
        pairs += [(outputs[k][n:n + 1], v) for k, v in ref_out.items()]
        got = at_true_scale(rec, {k: v[slot:slot + 1] for k, v in pool.items()})
        pairs += [(got[k], v) for k, v in at_true_scale(rec, ref_state).items()]
    others = [s for s in range(POOL_SLOTS) if s not in set(POOL_ROWS)]
    kept = all(np.array_equal(pool[k][others], before[k][others]) for k in before)
    row = _serving_row(STEP, backend, dtype, "slot pool", None, pairs,
                       note="other slots bit-identical" if kept else "OTHER SLOTS CHANGED", floor=floor)
    row.passed = row.passed and kept
    return row


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
    status = "skip" if row.skipped else "pass" if row.passed else "FAIL"
    errors = f"{'—':>10} {'—':>10}" if row.skipped else f"{row.max_abs:10.2e} {row.max_rel:10.2e}"
    return (f"{row.form:<10} {row.backend:<6} {row.dtype:<8} {row.case:<13} {chunk:<6} "
            f"{errors} {row.tolerance:9.0e}  {status}")


HEADER = (f"{'form':<10} {'backend':<6} {'dtype':<8} {'case':<13} {'chunk':<6} {'max abs':>10} "
          f"{'max rel':>10} {'tolerance':>9}  result")


def progress_to_stderr(i: int, total: int, what: str):
    sys.stderr.write(f"\r[{i + 1}/{total}] {what:<60}")
    sys.stderr.flush()
    if i + 1 == total:
        sys.stderr.write("\n")

"""`linrec bench FILE --grad`: the backward's time against the forward's, per form and backend.

For B = 1, H = 8, float32, each (dk, dv) ∈ {(64, 64), (128, 128)} (only the dimensions the file declares;
`--dim` sets one size instead) and T ∈ {4096, 16384} (`--T` overrides) it times, with bench's repeats
(median after a warm-up call, bench.timed):

* the forward, `Recurrence.run`, of every form asked for on every backend that builds it;
* the backward, `Recurrence.vjp`, of every gradient form asked for on every backend that builds one (a
  backend that does not is listed with its reason, gradients.gradient_refusal). The vjp call includes the
  forward recomputation it starts with (its checkpoints), so its time is the whole training step of the
  layer: forward and backward.

Each backward row gives its ms, the forward ms of the same form and backend (when that was timed), the
fastest forward measured at the same size (any form, any backend) and the ratio backward / fastest forward.
The forms above bench.MAX_TOKENS are skipped as in bench (the parallel form's T² work, the NumPy recurrent
form's per-token interpreter overhead), forward and backward alike, unless --no-limits.
"""
from __future__ import annotations

import gc
import os
import statistics
import time

import numpy as np

from . import api, bench, form_choice, gradient_choice, gradients, registry
from .compiler.adjoint import GRADIENT_FORMS
from .dim_option import dims_with_overrides
from .dsl.errors import LinrecError

GRAD_TOKENS = (4096, 16384)
GRAD_DIMS = (64, 128)            # dk = dv, for the dimensions the file declares


def size_grid(rec, opts: bench.Options) -> list[dict[str, int]]:
    """The sizes of the run: --dim given, those (one set); else dk = dv = each of GRAD_DIMS (the ones the file
    declares; a file that declares neither runs once, at its own sizes)."""
    if opts.dims:
        return [dims_with_overrides(rec.program, opts.dims.items(), preset=bench.BENCH_DIMS)]
    grid = [dims_with_overrides(rec.program, (), preset={"dk": d, "dv": d}) for d in GRAD_DIMS]
    return [g for i, g in enumerate(grid) if g not in grid[:i]]


def grad_combos(rec, backend: str, forms: list[str], tokens: int,
                 limits: bool) -> tuple[list[str], list[dict]]:
    """The gradient forms this backend times at T, and what it skips (no backward, with the reason; above
    the T limit of the form)."""
    timed, skipped = [], []
    for f in forms:
        if f not in GRADIENT_FORMS:
            continue
        why = gradients.gradient_refusal(rec, f, backend)
        if why:
            skipped.append({"form": f, "backend": backend, "T": None, "pass": "backward",
                            "reason": f"the {backend} backend has no backward of it: {why}"})
            continue
        limit = bench.max_tokens(f, backend) if limits else None
        if limit is not None and tokens > limit:
            skipped.append(dict(bench.above_limit(f, backend, tokens, limit), **{"pass": "backward"}))
        else:
            timed.append(f)
    return timed, skipped


def upstream_gradients(rec, dims: dict[str, int], tokens: int, dtype) -> dict[str, np.ndarray]:
    """A random gradient for every output [B, T, H, *] at bench's B and H (gradients.random_upstream)."""
    return gradients.random_upstream(rec, bench.BATCH, tokens, bench.HEADS, dims, dtype)


def _time(fn, repeats: int, budget_s: float) -> tuple[float, list[float]]:
    """One warm-up call (s), then the timed calls (bench.timed)."""
    t0 = time.perf_counter()
    fn()
    warm = time.perf_counter() - t0
    return warm, bench.timed(fn, repeats, budget_s)


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def auto_forms(rec, backend: str, dims: dict[str, int], tokens: int) -> tuple[str | None, str | None]:
    """What form="auto" runs on this backend at this size: the forward (Recurrence.choose_form) and the backward
    (gradient_choice.auto_gradient_form, linrec.torch's choice; None: the backend builds no backward of it). The
    forward is None where the backend builds no form of the program (form_choice.why_nothing_to_choose)."""
    forward = None if form_choice.why_nothing_to_choose(rec, backend) else \
        rec.choose_form(backend, tokens, heads=bench.HEADS, batch=bench.BATCH, dims=dims, dtype=np.float32)[0]
    return forward, gradient_choice.auto_gradient_form(rec, backend, dims, tokens, heads=bench.HEADS,
                                                       batch=bench.BATCH, dtype=np.float32)


def _with(forms: list[str], form: str | None) -> list[str]:
    return forms if form is None or form in forms else forms + [form]


def size_rows(rec, dims: dict[str, int], tokens: int, forms: list[str], backends: list[str], limits: bool,
              repeats: int, budget_s: float, say, with_auto: bool = False) -> tuple[list[dict], list[dict], list[dict]]:
    """At one size: the forward rows, the backward rows (each against the fastest forward) and what was
    skipped or failed. with_auto: also the forms form="auto" runs (auto_forms), their rows marked "auto"."""
    where = {"dk": dims.get("dk"), "dv": dims.get("dv"), "T": tokens}
    forward, backward, skipped = [], [], []
    auto = {b: auto_forms(rec, b, dims, tokens) if with_auto else (None, None) for b in backends}
    gc.collect()
    x = rec.random_inputs(batch=bench.BATCH, tokens=tokens, heads=bench.HEADS, dims=dims, dtype=np.float32, seed=0)
    for b in backends:
        nothing = with_auto and form_choice.why_nothing_to_choose(rec, b)
        if nothing:  # (said once, at no size: a form the backend does not build is said so too)
            skipped.append({"form": "auto", "backend": b, "T": None, "reason": nothing, "pass": "forward"})
        combos, not_timed = bench.backend_combos(rec, b, _with(forms, auto[b][0]), [tokens], limits)
        skipped += [_at(dict(s, **{"pass": "forward"}), where) for s in not_timed]
        for f, _, _ in combos:
            say(f"forward  {f:<10} {b:<6} {where} …")
            try:
                warm, times = _time(lambda f=f, b=b: rec.run(x, form=f, backend=b), repeats, budget_s)
            except (LinrecError, MemoryError) as err:
                skipped.append(dict(where, form=f, backend=b, reason=f"failed: {err}", **{"pass": "forward"}))
                continue
            forward.append(dict(where, form=f, backend=b, ms=_median_ms(times), repeats=len(times), warmup_s=warm,
                                auto=f == auto[b][0]))
    grad_o = upstream_gradients(rec, dims, tokens, np.float32)
    for b in backends:
        if with_auto and auto[b][1] is None:  # (at no size: what the backend builds is the program's structure)
            skipped.append({"form": "auto", "backend": b, "T": None, "reason": gradient_choice.no_auto_backward(rec, b),
                            "pass": "backward"})
        grad_forms, not_timed = grad_combos(rec, b, _with(forms, auto[b][1]), tokens, limits)
        skipped += [_at(s, where) for s in not_timed]
        for f in grad_forms:
            say(f"backward {f:<10} {b:<6} {where} …")
            try:
                warm, times = _time(lambda f=f, b=b: rec.vjp(x, grad_o, form=f, backend=b), repeats, budget_s)
            except (LinrecError, MemoryError) as err:
                skipped.append(dict(where, form=f, backend=b, reason=f"failed: {err}", **{"pass": "backward"}))
                continue
            backward.append(dict(where, form=f, backend=b, ms=_median_ms(times), repeats=len(times),
                                 warmup_s=warm, auto=f == auto[b][1],
                                 kept_ms=_kept_ms(rec, x, grad_o, f, b, repeats, budget_s)))
    return forward, [against_forward(r, forward) for r in backward], skipped


def _kept_ms(rec, x: dict, grad_o: dict, form: str, backend: str, repeats: int, budget_s: float) -> float | None:
    """The backward alone, as a training step runs it: from the forward kept for it (gradients.saved_forward,
    as linrec.torch keeps it), without running that forward again — None where no forward is kept (the NumPy
    backend, or a backward whose forward is not the fused kernel's)."""
    saved = gradients.saved_forward(rec, x, form=form, backend=backend, initial_state=None, params=None, dims=None,
                                    chunk_size=None)
    if saved is None:
        return None
    _, times = _time(lambda: gradients.vjp(rec, x, grad_o, form=form, backend=backend, grad_final_state=None,
                                           initial_state=None, params=None, dims=None, chunk_size=None,
                                           missing="error", saved=saved), repeats, budget_s)
    return _median_ms(times)


def _at(skipped: dict, where: dict) -> dict:
    """A skipped entry at a size: a refusal (T None: at every size) stays as it is, said once by run()."""
    return skipped if skipped["T"] is None else dict(skipped, **where)


def against_forward(row: dict, forward: list[dict]) -> dict:
    """A backward row with the forward of its form and backend ("forward_ms", None when not timed), the
    fastest forward at its size ("fastest_forward_ms", "fastest_forward": "form (backend)") and the ratio
    backward / fastest forward ("ratio")."""
    same = [r for r in forward if (r["form"], r["backend"]) == (row["form"], row["backend"])]
    fastest = min(forward, key=lambda r: r["ms"], default=None)
    kept = row.get("kept_ms")
    return dict(row, forward_ms=same[0]["ms"] if same else None,
                fastest_forward_ms=fastest["ms"] if fastest else None,
                fastest_forward=f"{fastest['form']} ({fastest['backend']})" if fastest else None,
                ratio=row["ms"] / fastest["ms"] if fastest else None,
                kept_ratio=kept / fastest["ms"] if fastest and kept is not None else None)


def run(opts: bench.Options, progress=None) -> dict:
    """The --grad report, as plain data (the --json object)."""
    say = progress or (lambda text: None)
    ticks = bench.cpu_ticks()
    rec = api.load(opts.file)
    bench.require_param_defaults(rec.program)
    threads, threads_from = (opts.threads, "--threads") if opts.threads is not None else bench.default_threads()
    backends = list(dict.fromkeys(opts.backends or list(registry.BACKENDS)))
    forms, with_auto, skipped = bench.forms_asked(rec, opts)
    sizes, tokens = size_grid(rec, opts), sorted(set(opts.tokens))
    repeats = opts.repeats or (bench.QUICK_REPEATS if opts.quick else bench.REPEATS)
    budget_s = opts.budget_s if opts.budget_s is not None else (bench.QUICK_BUDGET_S if opts.quick else bench.BUDGET_S)
    forward, backward = [], []
    with bench.thread_settings(threads) as blas_limited:
        for dims in sizes:
            for t in tokens:
                fw, bw, sk = size_rows(rec, dims, t, forms, backends, opts.limits, repeats, budget_s, say, with_auto)
                forward, backward = forward + fw, backward + bw
                skipped += [s for s in sk if s not in skipped]
    others = bench.others_cores(ticks, bench.cpu_ticks())
    notes = [] if blas_limited else [bench.NO_THREADPOOLCTL]
    return {"file": opts.file, "program": rec.program.name, "grad": True, "dtype": "float32",
            "batch": bench.BATCH, "heads": bench.HEADS, "sizes": sizes, "tokens": tokens, "threads": threads,
            "threads_from": threads_from, "repeats": repeats, "budget_s": budget_s, "backends": backends,
            "machine": {"cpu": bench.cpu_name(), "cores": os.cpu_count()},
            "load_average_start": bench.load_average(), "other_processes_cores": others,
            "forward": forward, "rows": backward, "skipped": skipped,
            "notes": notes + bench.busy_notes(others, "these times")}  # (--grad times no matmul reference)


# ---- output -------------------------------------------------------------------------------------------
def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_report(rep: dict) -> str:
    out = [f"{rep['program']} ({rep['file']}): backward against forward, B={rep['batch']}, H={rep['heads']}, "
           f"{rep['dtype']}, {rep['threads']} thread(s) (from {rep['threads_from']})", ""]
    if rep["rows"]:
        table = [["dk", "dv", "T", "form", "backend", "forward ms", "backward ms", "kept ms", "fastest forward",
                  "ms", "backward / fastest", "kept / fastest", "reps"]]
        for r in rep["rows"]:
            form = f"{r['form']} (auto)" if r.get("auto") else r["form"]
            table.append([str(r["dk"]), str(r["dv"]), str(r["T"]), form, r["backend"], _ms(r["forward_ms"]),
                          _ms(r["ms"]), _ms(r.get("kept_ms")), r["fastest_forward"] or "-",
                          _ms(r["fastest_forward_ms"]), "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
                          "-" if r.get("kept_ratio") is None else f"{r['kept_ratio']:.2f}", str(r["repeats"])])
        out += bench.table_lines(table, {0, 1, 2, 5, 6, 7, 9, 10, 11, 12})
        out.append("  (medians after a warm-up call; backward ms: the whole Recurrence.vjp call, which runs the "
                   "forward again for its checkpoints; kept ms: the backward alone, from the forward kept for it "
                   "as linrec.torch keeps it in a training step (- where none is kept); forward ms: "
                   "Recurrence.run of the same form and backend; fastest forward: of every form and backend timed "
                   "at the size"
                   + ("; (auto): the backward form=\"auto\" runs on the backend at the size" if any(
                       r.get("auto") for r in rep["rows"]) else "") + ")")
    else:
        out.append("  (no backward measured)")
    if rep["skipped"]:
        out += ["not measured:"]
        for s in rep["skipped"]:
            where = " ".join(f"{k}={s[k]}" for k in ("dk", "dv", "T") if s.get(k) is not None)
            what = " ".join(v for v in (s.get("pass"), s["backend"], s["form"], where) if v)
            out.append(f"  {what}: {s['reason']}")
    out += [f"note: {n}" for n in rep["notes"]]
    return "\n".join(out)

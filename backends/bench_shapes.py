"""`linrec bench FILE --shapes model`: the shapes models use, each row against the machine's own limits.

The grid (issue 26): (dk, dv) ∈ {(64, 64), (128, 128), (256, 256), (128, 64)}, H ∈ {8, 16, 32}, B ∈ {1, 4},
T ∈ {4096, 16384} for the prefill (Recurrence.run of each form asked for, on the C backend unless --backend
says otherwise), and the decode step of a single request (B = 1) at each (dk, dv) and H. float32, the run's
thread count. Each prefill row: the median of `repeats` calls after a warm-up, its useful GFLOP/s
(bench.flop_count), the bound — those flops at the multiply-add peak measured in the same run — and the
row's fraction of it, the fraction of the same-run matmul, and how many times slower per useful flop it is
than the best shape of its form and backend ("vs best": the issue asks for at most 3×). Each decode row:
µs per step bound to its arrays, the bound — the state bytes a step reads and writes at the triad's
bandwidth — its fraction of it and "vs best" per state byte moved.

The grid can be run in parts: --grid-dims DKxDV, --heads H, --batch B and --T T (each repeatable) keep only
those values, --form and --backend choose what is timed, --no-decode leaves out the decode steps. A shape
whose arrays would take more than half of the memory available is not run (B = 4, T = 16384, H = 32,
d = 256 holds 2 GiB per array), and is listed with the reason, as are the forms above bench.MAX_TOKENS.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass
from math import prod

import numpy as np

from . import api, bench
from .c import build as c_build
from .dsl.errors import LinrecError

MODEL_DIMS = ((64, 64), (128, 128), (256, 256), (128, 64))
MODEL_HEADS = (8, 16, 32)
MODEL_BATCHES = (1, 4)
MODEL_TOKENS = (4096, 16384)
DECODE_BATCH = 1            # a single request
GRID_REPEATS = 3
GRID_BUDGET_S = 5.0
MEMORY_SHARE = 0.5          # a shape's arrays may take this share of the memory available, at most
DEFAULT_BACKENDS = ["c"]    # (the NumPy forms at these sizes take minutes a row)


@dataclass(frozen=True)
class Shape:
    dk: int
    dv: int
    heads: int
    batch: int
    tokens: int

    def dims(self, rec) -> dict[str, int]:
        return _dims(rec, self.dk, self.dv)


def _dims(rec, dk: int, dv: int) -> dict[str, int]:
    """The program's sizes with dk and dv set (those it declares; the rest at the file's defaults)."""
    declared = {d.name: d.default for d in rec.program.dims}
    return declared | {name: size for name, size in (("dk", dk), ("dv", dv)) if name in declared}


def _only(given, grid) -> list:
    return list(dict.fromkeys(given)) if given else list(grid)


def grid(opts: bench.Options) -> tuple[list[Shape], list[tuple[int, int, int]]]:
    """The prefill shapes and the decode (dk, dv, H) of the run: the model grid, kept to the values asked for."""
    dims, heads = _only(opts.grid_dims, MODEL_DIMS), _only(opts.heads, MODEL_HEADS)
    batches, tokens = _only(opts.batches, MODEL_BATCHES), sorted(set(opts.tokens or MODEL_TOKENS))
    shapes = [Shape(dk, dv, h, b, t) for (dk, dv) in dims for h in heads for b in batches for t in tokens]
    decode = [(dk, dv, h) for (dk, dv) in dims for h in heads] if opts.decode else []
    return shapes, decode


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def array_bytes(rec, shape: Shape) -> int:
    """The float32 inputs and outputs of one call at `shape` (per-token arrays [B, T, H, *])."""
    dims = shape.dims(rec)
    shapes = [x.shape for x in rec.program.inputs] + [o.value.shape for o in rec.program.outputs]
    per_token = sum(prod(dims[d] for d in shape) for shape in shapes)
    return shape.batch * shape.tokens * shape.heads * per_token * 4


def _too_large(rec, shape: Shape, free: int | None) -> str | None:
    """Why a shape is not run for want of memory (its arrays, twice: random_inputs makes them in float64
    first), or None."""
    need = 2 * array_bytes(rec, shape)
    if free is None or need <= MEMORY_SHARE * free:
        return None
    return (f"its arrays take {bench.format_bytes(need / 2)} (and as much again while they are made), more than "
            f"{MEMORY_SHARE:.0%} of the {bench.format_bytes(free)} of memory available")


def _shape_fields(shape: Shape) -> dict:
    return {"dk": shape.dk, "dv": shape.dv, "H": shape.heads, "B": shape.batch}


def _require_dk(rec) -> None:
    declared = {d.name for d in rec.program.dims}
    if "dk" not in declared and "dv" not in declared:
        raise LinrecError(f"--shapes model sets the sizes dk and dv; '{rec.program.name}' declares neither "
                          f"(its dimensions: {', '.join(declared) or 'none'})")


def prefill_rows(rec, opts: bench.Options, shapes: list[Shape], forms: list[str], backends: list[str],
                 limits: dict, sgemm: float | None, say) -> tuple[list[dict], list[dict]]:
    """Each shape × form × backend timed (one shape's inputs in memory at a time), and what was not."""
    rows, skipped = [], []
    repeats = opts.repeats or GRID_REPEATS
    budget = opts.budget_s if opts.budget_s is not None else GRID_BUDGET_S
    peak = limits["fma_peak_gflops"]
    for shape in shapes:
        where = _shape_fields(shape) | {"T": shape.tokens}
        combos = []
        for b in backends:
            timed, not_timed = bench.backend_combos(rec, b, forms, [shape.tokens], opts.limits)
            combos += timed
            skipped += [dict(s, **_shape_fields(shape)) for s in not_timed]
        if not combos:
            continue
        why = _too_large(rec, shape, available_memory())
        if why:
            skipped += [dict(where, form=f, backend=b, reason=f"not run: {why}") for f, b, _ in combos]
            continue
        dims = shape.dims(rec)
        flops, _, _ = bench.flop_count(rec, dims)
        gc.collect()
        x = rec.random_inputs(batch=shape.batch, tokens=shape.tokens, heads=shape.heads, dims=dims,
                              dtype=np.float32, seed=0)
        for f, b, t in combos:
            say(f"{f} {b} dk={shape.dk} dv={shape.dv} H={shape.heads} B={shape.batch} T={t} …")
            try:
                t0 = time.perf_counter()
                rec.run(x, form=f, backend=b)
                warm = time.perf_counter() - t0
                times = bench.timed(lambda: rec.run(x, form=f, backend=b), repeats, budget)
            except (LinrecError, MemoryError) as err:
                skipped.append(dict(where, form=f, backend=b, reason=f"failed: {err}"))
                continue
            rows.append(_shape_fields(shape) | bench.row_of(f, b, t, times, warm, flops, sgemm, peak,
                                                            batch=shape.batch, heads=shape.heads))
        x = None
    return rows, skipped


def decode_rows(rec, opts: bench.Options, decode: list[tuple[int, int, int]], backends: list[str],
                gbs: float | None, llc: int | None, say) -> tuple[list[dict], list[str]]:
    """The decode step of one request at each (dk, dv, H) on each backend, with its bandwidth bound and
    whether the state fits in the last-level cache `llc` (then a decode loop keeps it there, and a step can
    beat the bound)."""
    rows, notes = [], []
    if not decode:
        return rows, notes
    why = bench.no_decode_note(rec)
    if why:
        return rows, [why]
    for dk, dv, h in decode:
        dims = _dims(rec, dk, dv)
        moved = 2 * DECODE_BATCH * bench.state_bytes(rec, dims, heads=h)
        for b in backends:
            say(f"{b}: decode step dk={dk} dv={dv} H={h} …")
            try:
                d = bench.decode_step_us(rec, b, dims, opts.quick, batch=DECODE_BATCH, heads=h)
            except LinrecError as err:
                notes.append(f"{b}: no decode step at dk={dk} dv={dv} H={h}: {err}")
                continue
            d = bench.with_decode_bounds({b: d}, moved, gbs)[b]
            rows.append({"dk": dk, "dv": dv, "H": h, "B": DECODE_BATCH, "backend": b, **d,
                         "state_in_last_level_cache": bool(llc) and moved // 2 <= llc})
    return rows, notes


def against_best(rows: list[dict], rate) -> None:
    """"vs_best" in each row: the best rate of its form and backend over this rate (1 for the best row)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r.get("form"), r["backend"]), []).append(r)
    for group in groups.values():
        rates = [rate(r) for r in group if rate(r)]
        best = max(rates, default=None)
        for r in group:
            r["vs_best"] = best / rate(r) if best and rate(r) else None


def run(opts: bench.Options, progress=None) -> dict:
    """The --shapes model report, as plain data (the --json object)."""
    say = progress or (lambda text: None)
    ticks = bench.cpu_ticks()
    rec = api.load(opts.file)
    _require_dk(rec)
    bench.require_param_defaults(rec.program)
    threads, threads_from = (opts.threads, "--threads") if opts.threads is not None else bench.default_threads()
    backends = list(dict.fromkeys(opts.backends or DEFAULT_BACKENDS))
    forms, _, skipped = bench.forms_asked(rec, opts)
    shapes, decode = grid(opts)
    report = {"file": opts.file, "program": rec.program.name, "shapes": "model", "dtype": "float32",
              "threads": threads, "threads_from": threads_from, "backends": backends, "forms": forms,
              "machine": {"cpu": bench.cpu_name(), "cores": os.cpu_count()},
              "load_average_start": bench.load_average(), "c": bench.c_settings(),
              "grid": {"dims": sorted({(s.dk, s.dv) for s in shapes} | {(d[0], d[1]) for d in decode}),
                       "heads": sorted({s.heads for s in shapes} | {d[2] for d in decode}),
                       "batches": sorted({s.batch for s in shapes}), "tokens": sorted({s.tokens for s in shapes}),
                       "decode_batch": DECODE_BATCH}}
    report.update(bench.matmul_reference(threads, opts.quick, say))
    report.update(bench.machine_reference(threads, opts.quick, say))
    notes = []
    if report["fma_peak_gflops"] is None:
        notes.append(f"the machine's limits were not measured ({report['machine_limits']['error']}): no bounds")
    with bench.thread_settings(threads):
        rows, not_run = prefill_rows(rec, opts, shapes, forms, backends, report, report["sgemm_gflops"], say)
        llc = bench.last_level_cache(report["machine_limits"])
        steps, decode_notes = decode_rows(rec, opts, decode, backends, report["bandwidth_gbs"], llc, say)
    report.update(bench.machine_reference(threads, opts.quick, say, earlier=report))
    rows = bench.with_row_bounds(rows, report["fma_peak_gflops"])
    steps = [bench.with_decode_bounds({"_": d}, d["state_bytes_moved"], report["bandwidth_gbs"])["_"] for d in steps]
    against_best(rows, lambda r: r["gflops"])
    against_best(steps, lambda r: r["state_bytes_moved"] / r["us"] if r.get("us") else None)
    others = bench.others_cores(ticks, bench.cpu_ticks())
    report.update({"rows": rows, "decode": steps, "skipped": skipped + not_run, "other_processes_cores": others,
                   "openmp_wait_policy": c_build.openmp_wait_policy(),
                   "notes": notes + decode_notes + bench.busy_notes(others)})
    return report


# ---- output -------------------------------------------------------------------------------------------
def format_report(rep: dict) -> str:
    lim = rep.get("machine_limits", {})
    out = [f"{rep['program']} ({rep['file']}): the model grid, float32, {rep['threads']} thread(s) (from "
           f"{rep['threads_from']}), backends {', '.join(rep['backends'])}"]
    if rep["fma_peak_gflops"]:
        out.append(f"bounds: float32 multiply-add peak {rep['fma_peak_gflops']:.1f} GFLOP/s (prefill), memory "
                   f"bandwidth {rep['bandwidth_gbs']:.1f} GB/s (triad over 3 × "
                   f"{bench.format_bytes(lim['triad']['array_bytes'])}: decode), each the higher of a measurement at "
                   f"the start and one at the end of the run; matmul "
                   + (f"{rep['sgemm_gflops']:.1f} GFLOP/s" if rep["sgemm_gflops"] else "failed"))
    if rep["rows"]:
        table = [["dk", "dv", "H", "B", "T", "form", "backend", "ms", "GFLOP/s", "bound ms", "of bound",
                  "of matmul", "vs best"]]
        for r in rep["rows"]:
            table.append([str(r["dk"]), str(r["dv"]), str(r["H"]), str(r["B"]), str(r["T"]), r["form"],
                          r["backend"], f"{r['ms']:.2f}", bench.number(r["gflops"], ".1f"), bench.number(r["bound_ms"], ".2f"),
                          bench.percent(r["fraction_of_bound"]), bench.percent(r["fraction_of_sgemm"]),
                          bench.number(r["vs_best"], ".2f")])
        out += ["", "prefill (Recurrence.run, median; bound: the useful flops at the peak; vs best: × slower per "
                "useful flop than the best shape of the form and backend):"] + bench.table_lines(
                    table, {0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12})
    if rep["decode"]:
        table = [["dk", "dv", "H", "B", "backend", "µs", "state bytes", "bound µs", "of bound", "vs best", "in LLC"]]
        for d in rep["decode"]:
            table.append([str(d["dk"]), str(d["dv"]), str(d["H"]), str(d["B"]), d["backend"], f"{d['us']:.2f}",
                          str(d["state_bytes_moved"]), bench.number(d["bound_us"], ".2f"), bench.percent(d["fraction_of_bound"]),
                          bench.number(d["vs_best"], ".2f"), "yes" if d["state_in_last_level_cache"] else "no"])
        out += ["", "decode step of one request (bound to its arrays; state bytes: read and written; bound: those "
                "bytes at the bandwidth; vs best: × slower per state byte than the best shape; in LLC: the state "
                "fits in the last-level cache, where a decode loop keeps it, so a step can beat the bound):"
                ] + bench.table_lines(table, {0, 1, 2, 3, 5, 6, 7, 8, 9})
    if rep["skipped"]:
        out += ["", "not measured:"]
        for s in rep["skipped"]:
            where = " ".join(f"{k}={s[k]}" for k in ("dk", "dv", "H", "B", "T") if s.get(k) is not None)
            out.append(f"  {s['backend'] or ''} {s['form']} {where}: {s['reason']}".replace("  ", " ", 1))
    out += [f"note: {n}" for n in rep["notes"]]
    return "\n".join(out)

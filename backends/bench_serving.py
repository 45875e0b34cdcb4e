"""`linrec bench FILE --shapes serving`: what a serving engine runs, against the machine's own limits.

Two measurements (issue 23, item 6), float32, H = 16, dk = dv = 128 (those the file declares), on the C
backend unless --backend says otherwise, with the run's thread count:

* the slot-pool decode step (docs/serving.md): N ∈ {1, 16, 64} active requests whose states sit in a pool
  of 256 slots (`Recurrence.bind_step(tokens, pool, slots=idx)`, and `Recurrence.step(…, slots=idx)` passed
  the same arrays each call), the slots spread over the pool at random. Each row: µs per step
  (bench.per_call_us), tokens/s (N tokens a step), and its bound — the state bytes the step reads and
  writes (2 · N · H · Σ state sizes · 4) at the memory bandwidth (STREAM triad) measured in the same run,
  as for the plain decode step (bench.with_decode_bounds).
* the prefill of a packed batch of N sequences of mixed lengths (`Recurrence.run(x, cu_seqlens=offsets)`,
  inputs [1, Σ len, H, *]) against the same sequences padded to the longest into a batch [N, T_max, H, *]
  (`Recurrence.run(x)`), both timed (median of `repeats` after a warm-up), and the ratio padded ms / packed
  ms, beside the token ratio padded tokens / real tokens (what that ratio would be if each run cost only
  its tokens). The lengths are drawn uniformly from [1, T_max] (seeded), the first one T_max. The padding tokens are
  valid generated tokens after each sequence: their outputs are thrown away (timing only; an engine that
  pads needs the state before them, which the packed run gives directly). Tokens/s counts the real tokens
  for both. The forms timed: recurrent and chunkwise where the program has them (--form chooses).

--grid-dims DKxDV and --heads H (each repeatable), --requests N (repeatable), --pool P, --T T_max
(repeatable), --batch N (the number of sequences packed; repeatable), --form, --backend and --no-decode
keep or change parts of it.
"""
from __future__ import annotations

import gc
import os
import statistics
from math import prod

import numpy as np

from . import api, bench, bench_shapes, serving
from .c import build as c_build
from .dsl.errors import LinrecError

SERVING_DIMS = ((128, 128),)
SERVING_HEADS = (16,)
REQUESTS = (1, 16, 64)
POOL_SLOTS = 256
PREFILL_TOKENS = (2048,)          # T_max, the longest sequence of the packed batch
PREFILL_SEQUENCES = (8,)
PREFILL_FORMS = ("recurrent", "chunkwise")
DEFAULT_BACKENDS = ["c"]


def _lengths(sequences: int, longest: int, seed: int = 0) -> list[int]:
    """Mixed lengths: uniform in [1, longest] (seeded), the first `longest` so that T_max is what was asked."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest + 1, size=sequences).tolist()
    lengths[0] = longest
    return lengths


def _pool_bytes(rec, dims: dict[str, int], heads: int, slots: int) -> int:
    return slots * bench.state_bytes(rec, dims, heads=heads)


def pool_step_us(rec, backend: str, dims: dict[str, int], heads: int, pool: dict, requests: int,
                 quick: bool) -> dict:
    """One token for `requests` requests at random distinct slots of `pool`, through bind_step(…, slots=idx)
    and step(…, slots=idx) (bench.step_timings)."""
    slots = np.random.default_rng(requests).choice(next(iter(pool.values())).shape[0], size=requests,
                                                    replace=False)
    x = rec.random_inputs(batch=requests, tokens=1, heads=heads, dims=dims, dtype=np.float32, seed=2)
    tokens = {k: np.ascontiguousarray(v[:, 0]) for k, v in x.items()}
    return bench.step_timings(rec, tokens, pool, backend, quick, {"slots": slots}, {"slots": slots})


def _filled_pool(rec, dims: dict[str, int], heads: int, slots: int) -> dict[str, np.ndarray]:
    """Every state [P, H, *] in float32, small random values (a pool of live requests, not zeros)."""
    rng = np.random.default_rng(3)
    pool = {}
    for s in rec.program.states:
        arr = rng.standard_normal((slots, heads) + tuple(dims[d] for d in s.shape), dtype=np.float32)
        arr *= 0.1
        pool[s.name] = arr
    return pool


def _requests(opts: bench.Options) -> list[int]:
    """The N of the decode rows, each at most the pool's slots: those of --requests (one more than the slots is
    an error naming it), else the default counts that fit in the pool (a probe's finding: --pool 32 alone was
    refused for the default N = 64, as if --requests said it)."""
    slots = opts.pool or POOL_SLOTS
    if not opts.requests:
        return [n for n in REQUESTS if n <= slots]
    requests = list(dict.fromkeys(opts.requests))
    too_many = [n for n in requests if n > slots]
    if too_many:
        raise LinrecError(f"--requests {too_many[0]} is more than the pool's {slots} slots: pass --requests at most "
                          f"--pool (default {POOL_SLOTS})")
    return requests


def decode_rows(rec, opts: bench.Options, dims_grid: list[tuple[int, int]], heads: list[int],
                backends: list[str], say) -> tuple[list[dict], list[str]]:
    """The slot-pool step at each (dk, dv), H, backend and N (one pool of each size in memory at a time)."""
    why = bench.no_decode_note(rec)
    if why:
        return [], [why]
    rows, notes = [], []
    slots, requests = opts.pool or POOL_SLOTS, _requests(opts)
    for dk, dv in dims_grid:
        dims = bench_shapes._dims(rec, dk, dv)
        for h in heads:
            gc.collect()
            pool = _filled_pool(rec, dims, h, slots)
            for b in backends:
                for n in requests:
                    say(f"{b}: slot-pool step, N={n} of P={slots} slots, dk={dk} dv={dv} H={h} …")
                    try:
                        d = pool_step_us(rec, b, dims, h, pool, n, opts.quick)
                    except LinrecError as err:
                        notes.append(f"{b}: no slot-pool step at dk={dk} dv={dv} H={h} N={n}: {err}")
                        continue
                    rows.append({"dk": dk, "dv": dv, "H": h, "N": n, "P": slots, "backend": b,
                                 "pool_bytes": _pool_bytes(rec, dims, h, slots),
                                 "tokens_per_s": n / (d["us"] * 1e-6),
                                 "state_bytes_moved": 2 * n * bench.state_bytes(rec, dims, heads=h), **d})
            pool = None
    return rows, notes


def _padded(rec, packed: dict[str, np.ndarray], lengths: list[int], heads: int, dims: dict[str, int]) -> dict:
    """The packed sequences, each at the start of its own row of a batch [N, T_max, H, *]; the rest of a row
    valid generated tokens (whose outputs are thrown away)."""
    longest = max(lengths)
    x = rec.random_inputs(batch=len(lengths), tokens=longest, heads=heads, dims=dims, dtype=np.float32, seed=4)
    start = 0
    for i, n in enumerate(lengths):
        for k, v in x.items():
            v[i, :n] = packed[k][0, start:start + n]
        start += n
    return x


def _prefill_bytes(rec, dims: dict[str, int], heads: int, tokens: int) -> int:
    """The float32 inputs and outputs of `tokens` tokens."""
    shapes = [x.shape for x in rec.program.inputs] + [o.value.shape for o in rec.program.outputs]
    return tokens * heads * sum(prod(dims[d] for d in shape) for shape in shapes) * 4


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def prefill_rows(rec, opts: bench.Options, dims_grid: list[tuple[int, int]], heads: list[int], forms: list[str],
                 backends: list[str], say) -> tuple[list[dict], list[dict]]:
    """Each (dk, dv), H, T_max, N × form × backend: the packed batch and the padded batch, timed."""
    rows, skipped = [], []
    repeats = opts.repeats or bench_shapes.GRID_REPEATS
    budget = opts.budget_s if opts.budget_s is not None else bench_shapes.GRID_BUDGET_S
    for dk, dv in dims_grid:
        dims = bench_shapes._dims(rec, dk, dv)
        flops, _, _ = bench.flop_count(rec, dims)
        for h in heads:
            for longest in sorted(set(opts.tokens or PREFILL_TOKENS)):
                for sequences in dict.fromkeys(opts.batches or PREFILL_SEQUENCES):
                    where = {"dk": dk, "dv": dv, "H": h, "T_max": longest, "N": sequences}
                    combos = []
                    for b in backends:
                        timed, not_timed = bench.backend_combos(rec, b, forms, [longest], opts.limits)
                        combos += timed
                        skipped += [dict(s, **where) for s in not_timed]
                    if not combos:
                        continue
                    lengths = _lengths(sequences, longest)
                    total = sum(lengths)
                    need = 2 * _prefill_bytes(rec, dims, h, total + sequences * longest)
                    free = bench_shapes.available_memory()
                    if free is not None and need > bench_shapes.MEMORY_SHARE * free:
                        skipped += [dict(where, form=f, backend=b, T=longest,
                                         reason=f"not run: the packed and padded arrays take "
                                                f"{bench.format_bytes(need / 2)} (and as much again while they "
                                                f"are made), more than {bench_shapes.MEMORY_SHARE:.0%} of the "
                                                f"{bench.format_bytes(free)} available") for f, b, _ in combos]
                        continue
                    gc.collect()
                    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
                    packed = rec.random_inputs(batch=1, tokens=total, heads=h, dims=dims, dtype=np.float32, seed=0)
                    padded = _padded(rec, packed, lengths, h, dims)
                    for f, b, _ in combos:
                        say(f"{f} {b}: prefill of {sequences} sequences, T_max={longest}, {total} tokens, "
                            f"packed and padded, dk={dk} dv={dv} H={h} …")
                        try:
                            timings = {}
                            for kind, call in (
                                    ("packed", lambda f=f, b=b: rec.run(packed, cu_seqlens=offsets, form=f, backend=b)),
                                    ("padded", lambda f=f, b=b: rec.run(padded, form=f, backend=b))):
                                call()  # warm-up (builds or loads the kernel)
                                timings[kind] = bench.timed(call, repeats, budget)
                        except (LinrecError, MemoryError) as err:
                            skipped.append(dict(where, form=f, backend=b, T=longest, reason=f"failed: {err}"))
                            continue
                        packed_ms, padded_ms = _median_ms(timings["packed"]), _median_ms(timings["padded"])
                        rows.append(dict(where, form=f, backend=b, lengths=lengths, tokens=total,
                                         padded_tokens=sequences * longest, packed_ms=packed_ms,
                                         padded_ms=padded_ms, padded_over_packed=padded_ms / packed_ms,
                                         token_ratio=sequences * longest / total,
                                         packed_tokens_per_s=total / (packed_ms / 1e3),
                                         padded_tokens_per_s=total / (padded_ms / 1e3),
                                         useful_flops=total * h * flops if flops else None,
                                         repeats=len(timings["packed"])))
                    packed = padded = None
    return rows, skipped


def with_prefill_bounds(rows: list[dict], peak: float | None) -> list[dict]:
    """Each prefill row with its bound: the useful flops of its real tokens at the multiply-add peak `peak`
    (GFLOP/s), in ms, and the packed run's fraction of it (None without a peak or a flop count)."""
    out = []
    for r in rows:
        bound_ms = r["useful_flops"] / (peak * 1e6) if peak and r["useful_flops"] else None
        out.append(dict(r, bound_ms=bound_ms, packed_fraction_of_bound=bound_ms / r["packed_ms"] if bound_ms else None))
    return out


def _forms(rec, opts: bench.Options) -> tuple[list[str], list[dict], list[str]]:
    """The prefill's forms: those asked for (bench.forms_asked), by default those of PREFILL_FORMS the program
    has; what is skipped; and a note when there is no packed prefill to time (and why)."""
    why = serving.why_not_packed(rec.program, rec.decomposition.sequence)
    if why:
        return [], [], [f"'{rec.program.name}' does not take cu_seqlens ({why}): no prefill rows"]
    if opts.forms:
        forms, with_auto, skipped = bench.forms_asked(rec, opts)
        if with_auto:
            raise LinrecError("--shapes serving times the forms by name: pass --form recurrent or --form chunkwise "
                              "(not auto)")
        return forms, skipped, []
    forms = [f for f in PREFILL_FORMS if f in rec.forms and not rec.decomposition.why_not(f)]
    if not forms:
        return [], [], [f"'{rec.program.name}' has no {' or '.join(PREFILL_FORMS)} form (its forms: "
                        f"{', '.join(rec.forms)}): no prefill rows unless --form names one"]
    return forms, [], []


def run(opts: bench.Options, progress=None) -> dict:
    """The --shapes serving report, as plain data (the --json object)."""
    say = progress or (lambda text: None)
    ticks = bench.cpu_ticks()
    rec = api.load(opts.file)
    bench_shapes._require_dk(rec)
    bench.require_param_defaults(rec.program)
    threads, threads_from = (opts.threads, "--threads") if opts.threads is not None else bench.default_threads()
    backends = list(dict.fromkeys(opts.backends or DEFAULT_BACKENDS))
    forms, skipped, notes = _forms(rec, opts)
    requests = _requests(opts) if opts.decode else []
    dims_grid = list(dict.fromkeys(opts.grid_dims or SERVING_DIMS))
    heads = list(dict.fromkeys(opts.heads or SERVING_HEADS))
    report = {"file": opts.file, "program": rec.program.name, "shapes": "serving", "dtype": "float32",
              "threads": threads, "threads_from": threads_from, "backends": backends, "forms": forms,
              "machine": {"cpu": bench.cpu_name(), "cores": os.cpu_count()},
              "load_average_start": bench.load_average(), "c": bench.c_settings(),
              "grid": {"dims": dims_grid, "heads": heads, "requests": requests,
                       "pool": opts.pool or POOL_SLOTS, "T_max": sorted(set(opts.tokens or PREFILL_TOKENS)),
                       "sequences": list(opts.batches or PREFILL_SEQUENCES)}}
    report.update(bench.machine_reference(threads, opts.quick, say))
    if report["fma_peak_gflops"] is None:
        notes.append(f"the machine's limits were not measured ({report['machine_limits']['error']}): no bounds")
    with bench.thread_settings(threads):
        steps, decode_notes = (decode_rows(rec, opts, dims_grid, heads, backends, say) if opts.decode
                               else ([], []))
        rows, not_run = prefill_rows(rec, opts, dims_grid, heads, forms, backends, say)
    report.update(bench.machine_reference(threads, opts.quick, say, earlier=report))
    # the bounds at the higher of the two measurements
    steps = [bench.with_decode_bounds({"_": d}, d["state_bytes_moved"], report["bandwidth_gbs"])["_"] for d in steps]
    # the active rows fit in the last-level cache: a decode loop over the same requests keeps them there, so
    # a step can beat the bandwidth's bound
    llc = bench.last_level_cache(report.get("machine_limits", {}))
    steps = [dict(d, state_in_last_level_cache=bool(llc) and d["state_bytes_moved"] // 2 <= llc) for d in steps]
    rows = with_prefill_bounds(rows, report["fma_peak_gflops"])
    others = bench.others_cores(ticks, bench.cpu_ticks())
    report.update({"decode": steps, "prefill": rows, "skipped": skipped + not_run, "other_processes_cores": others,
                   "openmp_wait_policy": c_build.openmp_wait_policy(),
                   "notes": notes + decode_notes
                   + bench.busy_notes(others, "these times (and the bandwidth and peak measured)")})
    return report


# ---- output -------------------------------------------------------------------------------------------
def format_report(rep: dict) -> str:
    lim = rep.get("machine_limits", {})
    out = [f"{rep['program']} ({rep['file']}): serving, float32, {rep['threads']} thread(s) (from "
           f"{rep['threads_from']}), backends {', '.join(rep['backends'])}"]
    if rep["fma_peak_gflops"]:
        out.append(f"bounds: memory bandwidth {rep['bandwidth_gbs']:.1f} GB/s (triad over 3 × "
                   f"{bench.format_bytes(lim['triad']['array_bytes'])}: decode), float32 multiply-add peak "
                   f"{rep['fma_peak_gflops']:.1f} GFLOP/s (prefill), each the higher of a measurement at the start "
                   f"and one at the end of the run")
    if rep["decode"]:
        table = [["dk", "dv", "H", "N", "P", "backend", "µs", "tokens/s", "step() µs", "state bytes", "bound µs",
                  "of bound", "in LLC"]]
        for d in rep["decode"]:
            table.append([str(d["dk"]), str(d["dv"]), str(d["H"]), str(d["N"]), str(d["P"]), d["backend"],
                          f"{d['us']:.2f}", f"{d['tokens_per_s']:.4g}", f"{d['step_us']:.2f}",
                          str(d["state_bytes_moved"]), bench.number(d["bound_us"], ".2f"), bench.percent(d["fraction_of_bound"]),
                          "yes" if d["state_in_last_level_cache"] else "no"])
        out += ["", "slot-pool decode step, N requests in a pool of P slots (µs: bind_step(…, slots=idx), one call "
                "per token; step() µs: step(…, slots=idx); state bytes: the N rows read and written; bound: those "
                "bytes at the bandwidth; in LLC: the N rows fit in the last-level cache, where a decode loop keeps them, "
                "so a step can beat the bound):"] + bench.table_lines(table, {0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11})
    if rep["prefill"]:
        table = [["dk", "dv", "H", "N", "T_max", "tokens", "padded", "form", "backend", "packed ms", "padded ms",
                  "padded/packed", "token ratio", "packed tok/s", "of bound"]]
        for r in rep["prefill"]:
            table.append([str(r["dk"]), str(r["dv"]), str(r["H"]), str(r["N"]), str(r["T_max"]), str(r["tokens"]),
                          str(r["padded_tokens"]), r["form"], r["backend"], f"{r['packed_ms']:.2f}",
                          f"{r['padded_ms']:.2f}", f"{r['padded_over_packed']:.2f}", f"{r['token_ratio']:.2f}",
                          f"{r['packed_tokens_per_s']:.4g}", bench.percent(r["packed_fraction_of_bound"])])
        out += ["", "prefill of N sequences of mixed lengths: packed (cu_seqlens, [1, tokens, H, *]) against padded "
                "to the longest ([N, T_max, H, *]); median ms; tokens/s of the real tokens; of bound: the packed "
                "run's useful flops at the multiply-add peak; token ratio: padded tokens / real tokens, the padded/packed a "
                "packed run costing only its tokens would reach):"] + bench.table_lines(
                    table, {0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14})
    if rep["skipped"]:
        out += ["", "not measured:"]
        for s in rep["skipped"]:
            where = " ".join(f"{k}={s[k]}" for k in ("dk", "dv", "H", "N", "T_max") if s.get(k) is not None)
            out.append(f"  {s['backend'] or ''} {s['form']} {where}: {s['reason']}".replace("  ", " ", 1))
    out += [f"note: {n}" for n in rep["notes"]]
    return "\n".join(out)

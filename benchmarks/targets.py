"""The C backend's speed targets (issue #5), measured in interleaved rounds on a noisy machine.

    python benchmarks/targets.py                 # gla and gated_deltanet, 5 rounds
    python benchmarks/targets.py --rounds 9 --json

On a shared machine the speed drifts by tens of percent over tens of seconds, so one pass of `linrec bench`
can time one row in a fast spell and the next in a slow one. Here every round measures everything once,
back to back — the same-run matmul reference (2 threads and 1, in a fresh process, OPENBLAS_CORETYPE
unset) and the cores' float32 multiply-add peak (fma_peak.py), and per program the C recurrent form at
T = 16384 on 2 threads and on 1, at T = 32768 on 2, and the decode step (bound to its arrays, and through
Recurrence.step) — and each target is computed within its round; the report gives the median over rounds
and the spread. The NumPy chunkwise form (seconds per call) runs once per program. Float32, B = 1, H = 8,
dk = dv = 64; times are medians of 3 calls of `Recurrence.run` after a warm-up, input checks included.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import linrec
from fma_peak import fma_peak_gflops  # (benchmarks/, the script's own folder)
from linrec import bench
from linrec.c import build as c_build

ROOT = Path(__file__).resolve().parent.parent  # the repository: the example programs

PROGRAMS = ["examples/gla.lin", "examples/gated_deltanet.lin"]
DIMS = {"dk": 64, "dv": 64}


def median_ms(call, threads: int, calls: int = 3) -> float:
    """The median ms of `calls` calls of call() on `threads` threads, after a warm-up call (which builds or
    loads the kernels and touches the pages first)."""
    with c_build.threads(threads):
        call()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run_ms(rec, x, threads: int, form: str = "recurrent", backend: str = "c", calls: int = 3) -> float:
    return median_ms(lambda: rec.run(x, form=form, backend=backend), threads, calls)


def measure(rounds: int, progress) -> dict:
    recs = {Path(p).stem: linrec.load(ROOT / p) for p in PROGRAMS}
    flops = {name: bench.flop_count(rec, DIMS) for name, rec in recs.items()}
    out = {"rounds": [], "numpy_chunkwise_ms": {}, "flops": {n: f[1] for n, f in flops.items()}}
    inputs = {name: {t: rec.random_inputs(1, t, 8, dims=DIMS, dtype=np.float32, seed=0) for t in (16384, 32768)}
              for name, rec in recs.items()}
    for name, rec in recs.items():
        progress(f"{name}: NumPy chunkwise, T = 16384 …")
        out["numpy_chunkwise_ms"][name] = run_ms(rec, inputs[name][16384], 2, form="chunkwise", backend="numpy",
                                                 calls=1)
    for r in range(rounds):
        progress(f"round {r + 1}/{rounds} …")
        rnd = {"sgemm_gflops": {n: bench.sgemm_reference(n, 3)["gflops"] for n in (2, 1)}, "programs": {},
               "fma_peak_gflops": fma_peak_gflops(2)}
        for name, rec in recs.items():
            x16, x32 = inputs[name][16384], inputs[name][32768]
            ms2, ms1, ms32 = run_ms(rec, x16, 2), run_ms(rec, x16, 1), run_ms(rec, x32, 2)
            with c_build.threads(2):
                decode = bench.decode_step_us(rec, "c", DIMS, quick=True)
            useful = 16384 * 8 * flops[name][0]
            rnd["programs"][name] = {
                "ms_2_threads": ms2, "ms_1_thread": ms1, "ms_32768": ms32, "decode_us": decode["us"],
                "decode_step_us": decode["step_us"],
                "fraction_of_bound": useful / (rnd["sgemm_gflops"][2] * 1e6) / ms2,
                "fraction_of_fma_peak": useful / (rnd["fma_peak_gflops"] * 1e6) / ms2,
                "scaling_T": ms32 / ms2, "speedup_2_threads": ms1 / ms2,
            }
        out["rounds"].append(rnd)
    return out


def summary(res: dict) -> dict:
    rows = {}
    for name in res["rounds"][0]["programs"]:
        per = [r["programs"][name] for r in res["rounds"]]

        def stat(key):
            vals = [p[key] for p in per]
            return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        ms2 = stat("ms_2_threads")
        rows[name] = {"flops": res["flops"][name], "ms_2_threads": ms2, "fraction_of_bound": stat("fraction_of_bound"),
                      "fraction_of_fma_peak": stat("fraction_of_fma_peak"),
                      "x_numpy_chunkwise": res["numpy_chunkwise_ms"][name] / ms2["median"],
                      "numpy_chunkwise_ms": res["numpy_chunkwise_ms"][name],
                      "scaling_T": stat("scaling_T"), "speedup_2_threads": stat("speedup_2_threads"),
                      "decode_us": stat("decode_us"), "decode_step_us": stat("decode_step_us")}
    sg = [r["sgemm_gflops"][2] for r in res["rounds"]]
    pk = [r["fma_peak_gflops"] for r in res["rounds"]]
    return {"sgemm_gflops_2_threads": {"median": statistics.median(sg), "min": min(sg), "max": max(sg)},
            "fma_peak_gflops_2_threads": {"median": statistics.median(pk), "min": min(pk), "max": max(pk)},
            "programs": rows}


def report(s: dict, rounds: int) -> str:
    def span(d, fmt):
        return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}–{fmt.format(d['max'])})"
    sg = s["sgemm_gflops_2_threads"]
    lines = [f"{rounds} rounds; same-run matmul on 2 threads: {span(sg, '{:.0f}')} GFLOP/s "
             f"(median, min–max over rounds); float32 multiply-add peak (fma_peak.py): "
             f"{span(s['fma_peak_gflops_2_threads'], '{:.0f}')} GFLOP/s", ""]
    programs = s["programs"].values()

    def row(label, cell):
        return [label, *(cell(p) for p in programs)]
    head = ["target", *s["programs"]]
    table = [row("useful flops per token and head", lambda p: p["flops"]),
             row("C recurrent, T = 16384, 2 threads (ms)", lambda p: span(p["ms_2_threads"], "{:.1f}")),
             row("≥ 50% of the matmul bound", lambda p: span(p["fraction_of_bound"], "{:.0%}")),
             row("  (of the multiply-add peak)", lambda p: span(p["fraction_of_fma_peak"], "{:.0%}")),
             row("≥ 20× NumPy chunkwise",
                 lambda p: f"{p['x_numpy_chunkwise']:.0f}× ({p['numpy_chunkwise_ms']:.0f} ms)"),
             row("T = 32768 ≤ 2.2× T = 16384", lambda p: span(p["scaling_T"], "{:.2f}")),
             row("2 threads ≥ 1.7× 1 thread", lambda p: span(p["speedup_2_threads"], "{:.2f}")),
             row("decode step ≤ 3 µs: bound (bind_step)", lambda p: span(p["decode_us"], "{:.2f}")),
             row("  … through Recurrence.step", lambda p: span(p["decode_step_us"], "{:.2f}"))]
    widths = [max(len(str(row[i])) for row in [head] + table) for i in range(len(head))]
    for row in [head] + table:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the rounds and the summary as JSON")
    args = parser.parse_args(argv)
    res = measure(args.rounds, lambda msg: print(msg, file=sys.stderr, flush=True))
    s = summary(res)
    print(json.dumps({"rounds": res["rounds"], "summary": s}, indent=1) if args.json else report(s, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

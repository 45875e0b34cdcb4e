"""The value axis split across threads (linrec.c.value_split) against the whole head on one thread.

    python benchmarks/value_split.py [--rounds 15] [--T 4096] [--dims 128 256] [--examples gla gated_deltanet mamba2]

B = H = 1 prefill, float32, recurrent form on the C backend: the kernel's unit of work was a whole head, so
on two threads such a call ran on one (`--threads 1` here is what two threads did before the split); with
the split each thread runs a block of the value columns. Rounds alternate one thread and two, and the
medians (and ranges) are printed with the split's speedup. The outputs are the same bit for bit
(tests/test_c_threads.py); this only times them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

import linrec
from linrec.c import build as c_build

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", nargs="+", default=["gla", "gated_deltanet", "mamba2"])
    ap.add_argument("--dims", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    print("| program | dk = dv | T | 1 thread (whole head) ms | 2 threads (split) ms | speedup |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.examples:
        rec = linrec.load(ROOT / "examples" / f"{name}.lin")
        module = rec.module("recurrent", "c")
        for d in args.dims:
            dims = {"dk": d, "dv": d}
            inputs = rec.random_inputs(batch=1, tokens=args.T, heads=1, dims=dims, dtype=np.float32, seed=0)
            parts = module.value_parts(np.float32, dims, heads=1, tokens=args.T, threads=2)
            times = {1: [], 2: []}
            for threads in (1, 2):  # warm-up: builds both kernels
                rec.run(inputs, form="recurrent", backend="c", dims=dims, threads=threads)
            for _ in range(args.rounds):
                for threads in (1, 2):
                    t0 = time.perf_counter()
                    rec.run(inputs, form="recurrent", backend="c", dims=dims, threads=threads)
                    times[threads].append((time.perf_counter() - t0) * 1e3)
            one, two = statistics.median(times[1]), statistics.median(times[2])
            print(f"| {name} | {d} | {args.T} | {one:.2f} ({min(times[1]):.2f}–{max(times[1]):.2f}) | "
                  f"{two:.2f} ({min(times[2]):.2f}–{max(times[2]):.2f}), {parts} parts | {one / two:.2f}× |",
                  flush=True)
    print(f"\nOpenMP wait policy: {c_build.openmp_wait_policy()}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

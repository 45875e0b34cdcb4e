"""This machine's float32 multiply-add peak and memory bandwidth, measured: the ceilings of any float32 kernel.

    python benchmarks/fma_peak.py [--threads 2] [--bandwidth]

The measuring code is linrec's own (`linrec.machine`, which `linrec bench` also runs): each thread runs 12
independent chains of whole-register multiply-adds (no loads, no stores) for about half a second; GFLOP/s
counts 2 flops per lane and multiply-add. `--bandwidth` adds STREAM's triad over arrays larger than the
last-level cache. A kernel whose useful flops are fixed (GLA's recurrent form: 4·dk·dv per token and head)
cannot be faster than that count at this rate: ggml_compare.py prints what a ratio against ggml would need of it.
"""
from __future__ import annotations

import argparse
import os
import sys

from linrec import machine


def fma_peak_gflops(threads: int, seconds: float = 0.5) -> float:
    """The float32 multiply-add rate of `threads` threads, GFLOP/s (linrec.machine.fma_peak_gflops)."""
    return machine.fma_peak_gflops(threads, seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0))
                        if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    parser.add_argument("--bandwidth", action="store_true", help="also the triad's memory bandwidth")
    args = parser.parse_args(argv)
    for n in sorted({1, args.threads}):
        print(f"float32 multiply-add peak, {n} thread(s): {fma_peak_gflops(n):.1f} GFLOP/s")
        if args.bandwidth:
            t = machine.triad(n)
            print(f"memory bandwidth (triad, 3 × {t['array_bytes'] >> 20} MiB), {n} thread(s): {t['gbs']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

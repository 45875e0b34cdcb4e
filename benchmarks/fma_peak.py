"""This machine's float32 multiply-add peak, measured: the ceiling of any float32 kernel, beside the matmul.

    python benchmarks/fma_peak.py [--threads 2]

Each thread runs 12 independent chains of whole-register multiply-adds (no loads, no stores) for about
half a second; GFLOP/s counts 2 flops per lane and multiply-add. Built through linrec's own C build (the
same compiler, flags and target as the kernels, cached like them). The matmul reference of `linrec bench`
shows what a tuned kernel reaches on a shared machine at the time; this shows what the cores can do at all.
A kernel whose useful flops are fixed (GLA's recurrent form: 4·dk·dv per token and head) cannot be faster
than that count at this rate: ggml_compare.py prints what a ratio against ggml would need of it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SOURCE = r"""
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
typedef float vec __attribute__((vector_size(VECTOR_BYTES)));

/* 12 independent chains a[i] = a[i]·b + c per thread: enough in flight to cover the multiply-add's latency
   on every port; the returned sum keeps the compiler from dropping them */
float lr_fma_chains(int64_t iters, int threads)
{
    float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+:sink)
    {
        vec a[12], b = (vec){0} + 0.999f, c = (vec){0} + 1e-6f;
        for (int i = 0; i < 12; ++i) a[i] = (vec){0} + (float)i;
        for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; ++i) a[i] = a[i] * b + c;
        }
        for (int i = 0; i < 12; ++i)
            for (int l = 0; l < (int)(sizeof(vec) / sizeof(float)); ++l) sink += a[i][l];
    }
    return sink;
}
"""


def fma_peak_gflops(threads: int, seconds: float = 0.5) -> float:
    """The float32 multiply-add rate of `threads` threads, GFLOP/s (best of three timed runs)."""
    from linrec.c import build as c_build
    width = c_build.vector_bytes()
    lib = c_build.build(SOURCE.replace("VECTOR_BYTES", str(width)), "float lr_fma_chains(int64_t, int);",
                        "fma_peak").lib
    flops_per_iter = 2 * 12 * (width // 4) * threads
    iters = 1 << 20
    while True:  # calibrate: a run of ≥ 0.1 s
        t0 = time.perf_counter()
        lib.lr_fma_chains(iters, threads)
        took = time.perf_counter() - t0
        if took >= 0.1:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / took))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        lib.lr_fma_chains(iters, threads)
        best = min(best, time.perf_counter() - t0)
    return flops_per_iter * iters / best / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0))
                        if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    args = parser.parse_args(argv)
    for n in sorted({1, args.threads}):
        print(f"float32 multiply-add peak, {n} thread(s): {fma_peak_gflops(n):.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The chunkwise C kernel's matrix products one by one: GFLOP/s of its GEMM (lr_gemm, the register tiles of
templates/c_scan.c.j2) at the shapes a chunk of 64 tokens runs, against one core's multiply-add peak.

    python benchmarks/scan_gemm.py [--dims 128 256] [--repeats 200]

Each product is the kernel's own code: the scan kernel of gated DeltaNet's structure (one log-decay per
token, one correction, one write, one readout) is rendered at dk = dv = d and compiled with linrec's flags
together with a small timing main, which calls lr_gemm on one thread, hot in cache, and keeps the best of
`--repeats` timings (a shared machine preempts; the best is the kernel's own speed). The shapes (M × N × K):
the chunk's initial state read by a panel of 16 queries (16 × d × d), the scores of a panel against the
keys so far (16 × 16…64 × d), a score panel times the values (16 × d × 32), the state update
(d × d × 64); values with rows 8·d apart (where they lie in the inputs for 8 heads) and packed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from linrec import machine
from linrec.c import build as c_build
from linrec.c import scan as c_scan

MAIN = r"""
#include <stdio.h>
#include <time.h>
static double lr_now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static void lr_bench(const char *name, int M, int N, int K, int64_t lda, int64_t ldb, int acc, int repeats)
{
    T *A = aligned_alloc(64, sizeof(T) * (M * lda + 64)), *B = aligned_alloc(64, sizeof(T) * (K * ldb + 64));
    T *C = aligned_alloc(64, sizeof(T) * (M * (int64_t)N + 64));
    for (int64_t i = 0; i < M * lda; ++i) A[i] = (T)(0.001 * (i % 7));
    for (int64_t i = 0; i < K * ldb; ++i) B[i] = (T)(0.001 * (i % 5));
    for (int64_t i = 0; i < M * (int64_t)N; ++i) C[i] = 0;
    const int inner = (int)(2e6 / (2.0 * M * N * K)) + 1;  /* about a millisecond of work per timing */
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
        const double t0 = lr_now();
        for (int i = 0; i < inner; ++i) lr_gemm(M, N, K, A, lda, B, ldb, C, N, acc);
        const double t = (lr_now() - t0) / inner;
        best = t < best ? t : best;
    }
    printf("%-34s %4d x %4d x %4d  %8.2f us  %6.1f GFLOP/s\n", name, M, N, K, best * 1e6, 2.0 * M * N * K / best * 1e-9);
    free(A); free(B); free(C);
}
int main(int argc, char **argv)
{
    const int repeats = argc > 1 ? atoi(argv[1]) : 200, L = 64;
    lr_bench("initial state, a panel of queries", 16, DVP, DK, DK, DVP, 0, repeats);
    lr_bench("scores, a panel against 16 keys", 16, 16, DK, DK, L, 0, repeats);
    lr_bench("scores, a panel against 32 keys", 16, 32, DK, DK, L, 0, repeats);
    lr_bench("scores, a panel against 64 keys", 16, 64, DK, DK, L, 0, repeats);
    lr_bench("scores times values, rows 8·d apart", 16, DVP, 32, L, 8 * DVP, 1, repeats);
    lr_bench("scores times values, packed", 16, DVP, 32, L, DVP, 1, repeats);
    lr_bench("state update, rows 8·d apart", DK, DVP, L, L, 8 * DVP, 1, repeats);
    lr_bench("state update, packed", DK, DVP, L, L, DVP, 1, repeats);
    return 0;
}
"""


def run(d: int, repeats: int) -> str:
    """The timing program's output for dk = dv = d (float32)."""
    s = c_scan.Structure("token", 1, 1, (False,), True, d, d, "float", c_build.vector_bytes())
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler found (set CC)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "scan_gemm.c", Path(tmp) / "scan_gemm"
        src.write_text(c_scan.render(s) + MAIN)
        subprocess.run([cc, *[f for f in c_build.flags() if f != "-fPIC"], str(src), "-o", str(exe), "-lm"],
                       check=True)
        return subprocess.run([str(exe), str(repeats)], check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 256], help="dk = dv sizes")
    parser.add_argument("--repeats", type=int, default=200, help="timings per product (the best is kept)")
    args = parser.parse_args(argv)
    # the best of short measurements: on a shared machine a long one is preempted and comes out low
    peak = max(machine.fma_peak_gflops(1, 0.02) for _ in range(25))
    print(f"one core's float32 multiply-add peak (best of 25 short runs): {peak:.1f} GFLOP/s")
    for d in args.dims:
        print(f"dk = dv = {d} (M x N x K):")
        print(run(d, args.repeats), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The machine's own limits, measured: the float32 multiply-add peak and the memory bandwidth.

`linrec bench` divides by these (a prefill row by the time its useful flops take at the peak, a decode step by
the time its state bytes take at the bandwidth), so that a fraction says how close a kernel comes to what the
cores and the memory can do at all — not to another library's kernel, whose speed depends on its build.
Both run in this process, built through the C backend's own build (the same compiler, flags and target as the
kernels, cached like them), with the thread count asked for:

* fma_peak: each thread runs 12 independent chains of whole-register multiply-adds (no loads, no stores),
  enough in flight to cover the multiply-add's latency on every port; 2 flops per lane and multiply-add;
  the best of three timed runs of about `seconds` each.
* triad: STREAM's a = b + s·c over three float32 arrays, each at least as large as the last-level cache (so
  every pass streams from memory), split over the threads as the kernels split their work; the best of
  `repeats` passes, counted as STREAM counts it: 3 · 4 bytes per element. The stores bypass the caches
  (non-temporal) where the target has them, so that the bytes counted are the bytes moved: a plain store
  first reads its line (a fourth stream STREAM does not count). NumPy cannot measure the same: it runs on
  one thread, and b + s·c in NumPy is two passes with a temporary (five streams).
"""
from __future__ import annotations

import os
import time
from functools import lru_cache
from pathlib import Path

from .c import build as c_build
from .dsl.errors import LinrecError

CACHE_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
TRIAD_MIN_BYTES = 64 << 20        # each array at least this large …
TRIAD_UNKNOWN_LLC_BYTES = 256 << 20  # … and, when the last-level cache's size is unknown, this large

FMA_SOURCE = r"""
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
FMA_CDEF = "float lr_fma_chains(int64_t, int);"

TRIAD_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

static double lr_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* a[i] = b[i] + s·c[i] for i in [lo, hi): lo and hi multiples of 16, the arrays 64-byte aligned */
static void lr_triad_part(float *restrict a, const float *restrict b, const float *restrict c, float s,
                          int64_t lo, int64_t hi)
{
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(s);
    for (int64_t i = lo; i < hi; i += 16)
        _mm512_stream_ps(a + i, _mm512_fmadd_ps(vs, _mm512_load_ps(c + i), _mm512_load_ps(b + i)));
#elif defined(__AVX__)
    const __m256 vs = _mm256_set1_ps(s);
    for (int64_t i = lo; i < hi; i += 8)
        _mm256_stream_ps(a + i, _mm256_add_ps(_mm256_mul_ps(vs, _mm256_load_ps(c + i)), _mm256_load_ps(b + i)));
#else
    for (int64_t i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
#endif
}

/* The best time of `repeats` triad passes over three arrays of n floats (n a multiple of 16·threads), on
   `threads` threads, each thread always on the same part (its pages touched first by it); −1 when the
   arrays cannot be allocated. *check: an element of the result (so that no pass can be dropped). */
double lr_triad(int64_t n, int repeats, int threads, float *check)
{
    float *a = aligned_alloc(64, (size_t)n * sizeof(float));
    float *b = aligned_alloc(64, (size_t)n * sizeof(float));
    float *c = aligned_alloc(64, (size_t)n * sizeof(float));
    if (!a || !b || !c) {
        free(a); free(b); free(c);
        return -1;
    }
    const int64_t per = n / threads;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; ++t)
        for (int64_t i = t * per; i < (t + 1) * per; ++i) {
            a[i] = 0;
            b[i] = 1;
            c[i] = 2;
        }
    double best = 1e300;
    for (int r = 0; r < repeats; ++r) {
        const double t0 = lr_now();
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; ++t)
            lr_triad_part(a, b, c, 0.5f, t * per, (t + 1) * per);
#if defined(__AVX__)
        _mm_sfence();
#endif
        const double took = lr_now() - t0;
        if (took < best) best = took;
    }
    *check = a[n - 1];
    free(a); free(b); free(c);
    return best;
}
"""
TRIAD_CDEF = "double lr_triad(int64_t, int, int, float *);"


@lru_cache(maxsize=None)
def _fma_lib():
    width = c_build.vector_bytes()
    return c_build.build(FMA_SOURCE.replace("VECTOR_BYTES", str(width)), FMA_CDEF, "fma_peak").lib


@lru_cache(maxsize=None)
def _triad_module():
    return c_build.build(TRIAD_SOURCE, TRIAD_CDEF, "triad")


def fma_peak(threads: int, seconds: float = 0.5) -> dict:
    """The float32 multiply-add rate of `threads` threads: {"gflops" (the best of three timed runs), "threads",
    "vector_bytes", "runs_s" (each run's seconds)}."""
    lib = _fma_lib()
    width = c_build.vector_bytes()
    flops_per_iter = 2 * 12 * (width // 4) * threads
    iters = 1 << 16
    while True:  # calibrate: a run of at least a fifth of `seconds`
        t0 = time.perf_counter()
        lib.lr_fma_chains(iters, threads)
        took = time.perf_counter() - t0
        if took >= seconds / 5:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / took))
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        lib.lr_fma_chains(iters, threads)
        runs.append(time.perf_counter() - t0)
    return {"gflops": flops_per_iter * iters / min(runs) / 1e9, "threads": threads, "vector_bytes": width,
            "runs_s": runs}


def fma_peak_gflops(threads: int, seconds: float = 0.5) -> float:
    """fma_peak's GFLOP/s alone."""
    return fma_peak(threads, seconds)["gflops"]


def _size_bytes(text: str) -> int | None:
    """"48K", "2048K", "260M", "1G" or a number of bytes → bytes (None when unreadable)."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    try:
        return int(text.rstrip("KMG")) * scale
    except ValueError:
        return None


@lru_cache(maxsize=None)
def caches() -> dict[str, int]:
    """This CPU's data and unified caches by level ("L1", "L2", "L3" …) in bytes, from
    /sys/devices/system/cpu/cpu0/cache (else from sysconf; empty when neither says)."""
    found: dict[str, int] = {}
    for index in sorted(CACHE_SYSFS.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            level = (index / "level").read_text().strip()
            size = _size_bytes((index / "size").read_text())
        except OSError:
            continue
        if kind != "Instruction" and size:
            found[f"L{level}"] = max(size, found.get(f"L{level}", 0))
    if not found:
        for level, name in ((1, "SC_LEVEL1_DCACHE_SIZE"), (2, "SC_LEVEL2_CACHE_SIZE"), (3, "SC_LEVEL3_CACHE_SIZE")):
            try:
                size = os.sysconf(name)
            except (AttributeError, ValueError, OSError):
                continue
            if size and size > 0:
                found[f"L{level}"] = size
    return found


def last_level_cache_bytes() -> int | None:
    """The largest cache's size in bytes (None when unknown)."""
    sizes = caches()
    return max(sizes.values()) if sizes else None


def triad_array_bytes() -> int:
    """Each triad array's size: at least the last-level cache (three of them stream from memory on every pass)
    and TRIAD_MIN_BYTES; TRIAD_UNKNOWN_LLC_BYTES when the cache's size is unknown."""
    llc = last_level_cache_bytes()
    return max(llc if llc else TRIAD_UNKNOWN_LLC_BYTES, TRIAD_MIN_BYTES)


def triad(threads: int, repeats: int = 10) -> dict:
    """The memory bandwidth `threads` threads reach on STREAM's triad (module docstring): {"gbs" (GB/s, 1e9
    bytes, the best pass), "array_bytes", "threads", "repeats", "non_temporal" (whether the stores bypass the
    caches), "last_level_cache_bytes"}."""
    module = _triad_module()
    per_array = triad_array_bytes()
    unit = 16 * threads
    n = max(unit, per_array // 4 // unit * unit)
    check = module.ffi.new("float *")
    best = module.lib.lr_triad(n, repeats, threads, check)
    if best < 0:
        raise LinrecError(f"the memory bandwidth measurement could not allocate its three arrays of "
                          f"{n * 4 >> 20} MiB; free some memory or run `linrec bench` without it")
    if check[0] != 2.0:  # 1 + 0.5·2
        raise LinrecError(f"the triad kernel computed {check[0]} where 2 was due: the bandwidth measurement is "
                          f"wrong on this build")
    return {"gbs": 3 * 4 * n / best / 1e9, "array_bytes": n * 4, "threads": threads, "repeats": repeats,
            "non_temporal": c_build.vector_bytes() >= 32, "last_level_cache_bytes": last_level_cache_bytes()}


def limits(threads: int, quick: bool = False) -> dict:
    """Both limits for `threads` threads: {"fma_peak": fma_peak(…), "triad": triad(…), "caches": caches()};
    quick: shorter runs (0.1 s of multiply-adds per run, 3 triad passes)."""
    return {"fma_peak": fma_peak(threads, 0.1 if quick else 0.5), "triad": triad(threads, 3 if quick else 10),
            "caches": caches()}

"""Where a fused prefill kernel's time goes: the C recurrent kernel with one part taken away at a time.

    python benchmarks/prefill_parts.py [examples/gla.lin] [--dims 64 128 256] [--rounds 7] [--threads 1] [--tokens T]

The kernel is the standalone C (`linrec emit --backend c --standalone`, float32) of the program at dk = dv = d,
called directly (`lr_forward`: no Python, no pass over the inputs for their ranges) on the inputs `linrec bench`
uses (`random_inputs(seed=0)`, B = 1, H = 8, T = 4096 or --tokens), in arrays on huge pages as NumPy's large arrays are
(with 4 KiB pages the inputs' TLB misses alone cost GLA 1.36× at d = 64). Each variant is the same C with one
part changed, built with linrec's flags (only its time means anything; its outputs differ):

    whole         the kernel as generated
    no_phase1     phase 1 (the per-token values, the lazy decays' bookkeeping) cut out: phase 2 and 3 alone
    no_phase2     the passes over the states cut out: phase 1 (and 3) alone, reading the input rows
    phase1_in_l1  phase 1 alone, reading the same two tokens' rows over and over (inputs always in L1)
    inputs_in_l1  the whole kernel on the same two tokens' rows (no input row comes from memory)
    no_exp        phase 1's lr_exp_v replaced by a multiply-add

The variants alternate in one process, round by round; per round, each variant's best of 3 calls (one thread:
the calling thread's CPU time, which another program's load hardly changes; more threads: wall time); the
median over rounds, its fraction of the multiply-add peak measured in the same rounds (one thread's, times
the threads), and the median of the per-round ratios whole ÷ variant. Phase 1's share of the kernel is
1 − 1/ratio(no_phase1). The delta rules' passes (strips of columns, two tokens a pass) are phase 2 as the tiles
are; inputs may differ in size (gated DeltaNet's scalar gates beside its rows). Programs with params or several
regions (non-causal) are refused. On a
shared machine run it at a raised priority (`nice -n -10`, and its session's autogroup as under_load.py
--priority does): the ratios then hold to a few per cent while the absolute times drift by tens.
benchmarks/model_shapes.md ("GLA's prefill: where the time goes") has its figures for GLA.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import linrec
from linrec.bench import flop_count
from linrec.c import build as c_build
from linrec.c import standalone as c_standalone

ROOT = Path(__file__).resolve().parent.parent
B, H, T = 1, 8, 4096
VARIANTS = ("whole", "no_phase1", "no_phase2", "phase1_in_l1", "inputs_in_l1", "no_exp")

# the timing program: dlopens each variant (bench_forward), alternates them round by round
HARNESS = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
typedef int (*fwd_t)(float **in, float **st, float **out, int64_t B, int64_t T, int64_t H, int nth);
static double ms(clockid_t c) { struct timespec t; clock_gettime(c, &t); return t.tv_sec * 1e3 + t.tv_nsec * 1e-6; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }
static float *big(size_t n)
{
    size_t bytes = (n * sizeof(float) + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    float *p = aligned_alloc(2u << 20, bytes);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
    madvise(p, bytes, MADV_HUGEPAGE);  /* as NumPy's large arrays */
    memset(p, 0, bytes);
    return p;
}
/* one thread's float32 multiply-add rate: 12 independent chains of whole-register FMAs, GFLOP/s of CPU time */
#define LR_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
static double fma_peak(void)
{
    volatile float iv[12] = {1, 1.01f, 1.02f, 1.03f, 1.04f, 1.05f, 1.06f, 1.07f, 1.08f, 1.09f, 1.1f, 1.11f};
#define LR_INIT(i) __m512 a##i = _mm512_set1_ps(iv[i]);
    LR_CHAINS(LR_INIT)
    const __m512 m = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
    const long n = 400000;
    const double t0 = ms(CLOCK_THREAD_CPUTIME_ID);
#define LR_STEP(i) a##i = _mm512_fmadd_ps(a##i, m, c);
    for (long k = 0; k < n; ++k) { LR_CHAINS(LR_STEP) }
    const double t = ms(CLOCK_THREAD_CPUTIME_ID) - t0;
#define LR_SUM(i) s = _mm512_add_ps(s, a##i);
    __m512 s = _mm512_setzero_ps();
    LR_CHAINS(LR_SUM)
    volatile float sink = _mm512_reduce_add_ps(s); (void)sink;
    return n * 12.0 * 32 / t * 1e-6;
}
int main(int argc, char **argv)
{
    /* inputs.bin n_in n_st n_out in_values (one per input) st_values out_values threads rounds flops variant.so ... */
    int a = 1;
    const char *inputs = argv[a++];
    const int n_in = atoi(argv[a++]), n_st = atoi(argv[a++]), n_out = atoi(argv[a++]);
    size_t in_n[8];
    for (int i = 0; i < n_in; ++i) in_n[i] = atol(argv[a++]);
    const size_t st_n = atol(argv[a++]), out_n = atol(argv[a++]);
    const int nth = atoi(argv[a++]), rounds = atoi(argv[a++]);
    const double flops = atof(argv[a++]);
    const int nv = argc - a;
    fwd_t f[16];
    for (int i = 0; i < nv; ++i) {
        void *h = dlopen(argv[a + i], RTLD_NOW | RTLD_LOCAL);
        if (!h || !(f[i] = (fwd_t)dlsym(h, "bench_forward"))) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    }
    float *in[8], *st[8], *out[8];
    FILE *fp = fopen(inputs, "rb");
    for (int i = 0; i < n_in; ++i) { in[i] = big(in_n[i]); if (fread(in[i], sizeof(float), in_n[i], fp) != in_n[i]) return 1; }
    fclose(fp);
    for (int i = 0; i < n_st; ++i) st[i] = big(st_n);
    for (int i = 0; i < n_out; ++i) out[i] = big(out_n);
    const clockid_t clock = nth > 1 ? CLOCK_MONOTONIC : CLOCK_THREAD_CPUTIME_ID;
    double t[16][64], peak[64];
    for (int r = 0; r < rounds && r < 64; ++r) {
        peak[r] = 0;
        for (int k = 0; k < 3; ++k) { const double p = fma_peak(); if (p > peak[r]) peak[r] = p; }
        for (int i = 0; i < nv; ++i) {
            t[i][r] = 1e30;
            for (int k = 0; k < 3; ++k) {
                for (int s = 0; s < n_st; ++s) memset(st[s], 0, st_n * sizeof(float));
                const double t0 = ms(clock);
                f[i](in, st, out, 1, %(T)d, %(H)d, nth);
                const double dt = ms(clock) - t0;
                if (dt < t[i][r]) t[i][r] = dt;
            }
        }
    }
    qsort(peak, rounds, sizeof(double), cmp);
    printf("peak %%.1f\n", peak[rounds / 2] * nth);
    for (int i = 0; i < nv; ++i) {
        double s[64], q[64];
        for (int r = 0; r < rounds; ++r) { s[r] = t[i][r]; q[r] = t[0][r] / t[i][r]; }
        qsort(s, rounds, sizeof(double), cmp);
        qsort(q, rounds, sizeof(double), cmp);
        printf("%%d %%.3f %%.3f %%.3f %%.3f\n", i, s[rounds / 2], flops / s[rounds / 2] * 1e-6, q[rounds / 2], q[0] < q[rounds - 1] ? q[rounds - 1] - q[0] : 0);
    }
    return 0;
}
"""


def phase_lines(lines: list[str]) -> tuple[int, int, int, int]:
    """Where the float32 kernel's phase 1 token loop starts and ends, and its phase 2 (the template's markers)."""
    def find(text: str, start: int = 0) -> int:
        for i in range(start, len(lines)):
            if text in lines[i]:
                return i
        raise SystemExit(f"the generated C has no '{text}' where expected: the template changed; update {__file__}")
    m = find("1. the state-free values")
    p1s = find("for (int u = 0; u < nb; ++u) {", m)
    p1e = find("outside_lanes[l]", p1s) if "outside_lanes" in "\n".join(lines[p1s:p1s + 400]) else None
    p2s = find("2. the states over the block", p1s)
    if p1e is None or p1e > p2s:
        p1e = max(i for i in range(p1s, p2s) if lines[i].strip() == "}") + 1
    p2e = find("while (pf_next < pf_count)", p2s)
    return p1s, p1e, p2s, p2e


def variant(source: str, name: str) -> str:
    """The generated C with one part changed (VARIANTS); `#if 0` cuts a part out."""
    lines = source.split("\n")
    p1s, p1e, p2s, p2e = phase_lines(lines)
    def cut(a: int, b: int) -> None:
        lines[b:b] = ["#endif"]
        lines[a:a] = ["#if 0"]
    def in_phase1(old: str, new: str) -> None:
        for i in range(p1s, p1e):
            lines[i] = lines[i].replace(old, new)
    same_rows = ("tok = (b * ntok + t) * H + h;", "tok = (b * ntok + (u & 1)) * H + h;")
    if name == "no_phase1":
        cut(p1s, p1e)
    elif name == "no_phase2":
        cut(p2s, p2e)
    elif name == "phase1_in_l1":
        in_phase1(*same_rows)
        cut(p2s, p2e)
    elif name == "inputs_in_l1":
        in_phase1(*same_rows)
    elif name == "no_exp":
        in_phase1("lr32_exp_v(", "(lr32_splat(1) + 1e-6f * ")
    return "\n".join(lines)


def build(rec, d: int, tmp: Path) -> tuple[list[Path], list, list, list]:
    """The variants' shared objects for dk = dv = d, and the program's inputs, states and outputs."""
    program = rec.program
    if program.params or not program.causal:
        raise SystemExit(f"{program.name}: a program with params or a non-causal one is not covered here")
    dims = {dim.name: d for dim in program.dims}
    files = c_standalone.export(rec.compiled, dims, H, {})
    header = next(n for n in files if n.endswith(".h"))
    source = files[next(n for n in files if n.endswith(".c"))].decode()
    (tmp / header).write_bytes(files[header])
    ins, sts, outs = program.inputs, program.states, program.outputs
    args = ", ".join([f"in[{i}]" for i in range(len(ins))] + [f"st[{i}]" for i in range(len(sts))]
                     + [f"out[{i}]" for i in range(len(outs))])
    wrapper = ("\nint bench_forward(float **in, float **st, float **out, int64_t B, int64_t T, int64_t H, int nth)\n"
               f"{{ return lr32_forward({args}, B, T, H, nth); }}\n")
    sos = []
    for name in VARIANTS:
        c_file, so = tmp / f"{name}_{d}.c", tmp / f"{name}_{d}.so"
        c_file.write_text(variant(source, name) + wrapper)
        sos.append((c_file, so))
    procs = [subprocess.Popen([c_build.compiler(), *c_build.flags(), "-shared", "-I", str(tmp), str(c), "-o", str(so), "-lm"])
             for c, so in sos]
    if any(p.wait() for p in procs):
        raise SystemExit("a variant did not compile")
    return [so for _, so in sos], ins, sts, outs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", nargs="?", default=str(ROOT / "examples" / "gla.lin"))
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256], help="dk = dv sizes")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=T,
                        help=f"T (default {T}; the issue's table has d = 64 and 128 at 16384)")
    args = parser.parse_args(argv)
    try:
        rec = linrec.load(args.program)
    except linrec.LinrecError as err:  # (a missing or wrong program: its message, not a traceback)
        parser.error(str(err))
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # as linrec loads its kernels
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        exe = tmp / "harness"
        (tmp / "harness.c").write_text(HARNESS % {"T": args.tokens, "H": H})
        subprocess.run([c_build.compiler(), "-O2", "-march=native", str(tmp / "harness.c"), "-o", str(exe), "-ldl"],
                       check=True)
        for d in args.dims:
            sos, ins, sts, outs = build(rec, d, tmp)
            dims = {dim.name: d for dim in rec.program.dims}
            x = rec.random_inputs(batch=B, tokens=args.tokens, heads=H, dims=dims, dtype=np.float32, seed=0)
            sizes = [np.asarray(x[i.name]).size for i in ins]  # (each input's values: [B, T, H] or [B, T, H, n])
            with open(tmp / "inputs.bin", "wb") as f:
                for i in ins:
                    f.write(np.ascontiguousarray(x[i.name], dtype=np.float32).tobytes())
            values = lambda shape: int(np.prod([dims[s] for s in shape]))  # noqa: E731
            one = rec.run(rec.random_inputs(batch=1, tokens=1, heads=1, dims=dims, dtype=np.float32, seed=0),
                          form="recurrent", backend="numpy").outputs  # (each output's values per token)
            flops = B * args.tokens * H * flop_count(rec, dims)[0]  # the useful flops, as `linrec bench` counts them
            cmd = [str(exe), str(tmp / "inputs.bin"), str(len(ins)), str(len(sts)), str(len(outs)),
                   *map(str, sizes), str(B * H * max(values(s.shape) for s in sts)),
                   str(B * args.tokens * H * max(one[o.name].size for o in outs)), str(args.threads), str(args.rounds),
                   str(flops), *map(str, sos)]
            lines = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split("\n")
            peak = float(lines[0].split()[1])
            print(f"{rec.program.name}, dk = dv = {d}, T = {args.tokens}, {args.threads} thread(s), multiply-add peak "
                  f"{peak:.0f} GFLOP/s "
                  f"(measured in the same rounds):")
            whole = None
            for line in lines[1:]:
                if line:
                    i, t, gflops, ratio, spread = line.split()
                    name, t = VARIANTS[int(i)], float(t)
                    whole = whole or t
                    # a variant without phase 2 does none of the useful flops: its time as a share of the whole's
                    what = (f"{t / whole:6.1%} of the whole's time" if name in ("no_phase2", "phase1_in_l1")
                            else f"{float(gflops) / peak:6.1%} of the peak")
                    print(f"  {name:<13} {t:9.3f} ms  {what}  whole ÷ this {float(ratio):.3f} (spread {float(spread):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

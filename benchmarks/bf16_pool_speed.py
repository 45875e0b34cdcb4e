"""The slot-pool decode step with a float32 and with a bfloat16 state: µs per step and state bytes moved.

    python benchmarks/bf16_pool_speed.py [--requests 64] [--heads 16] [--dim 128] [--rounds 5]

N requests × H heads × d = dk = dv through Recurrence.bind_step(…, slots=…) on C, over a pool of 2·N slots
(every other slot active). The two state dtypes take turns, `rounds` times, each turn the median of 15
batches of 10 calls after a warm-up, in wall time and in this process's CPU time; printed: the medians over
the rounds. GB/s: the state bytes a step reads
and writes (2 · N · H · d² · itemsize) per second. The figures in docs/serving.md ("A bfloat16 state") are
this script's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import linrec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def bound_step(rec, requests: int, heads: int, dim: int, state_dtype):
    x = rec.random_inputs(requests, 1, heads, dims={"dk": dim, "dv": dim}, dtype=np.float32, seed=0)
    tokens = {k: v[:, 0].copy() for k, v in x.items()}
    S = (np.random.default_rng(0).standard_normal((2 * requests, heads, dim, dim)) * 0.1).astype(np.float32)
    pool = {"S": linrec.to_bfloat16(S) if state_dtype else S}
    slots = np.arange(0, 2 * requests, 2)
    return rec.bind_step(tokens, pool, slots=slots, backend="c", state_dtype=state_dtype)


def median_us(step) -> tuple[float, float]:
    """(wall µs, CPU µs of this process — every thread) per step: medians of 15 batches of 10 calls. On a
    machine shared with other jobs the wall time mostly says how much of a core this process got; the CPU
    time says what the step cost."""
    for _ in range(10):
        step()
    wall, cpu = [], []
    for _ in range(15):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(10):
            step()
        wall.append((time.perf_counter() - t0) / 10)
        cpu.append((time.process_time() - c0) / 10)
    return float(np.median(wall)) * 1e6, float(np.median(cpu)) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("files", nargs="*", help="program files (default: GLA and gated DeltaNet)")
    args = parser.parse_args(argv)
    files = [Path(f) for f in args.files] or [EXAMPLES / "gla.lin", EXAMPLES / "gated_deltanet.lin"]
    print(f"N = {args.requests} requests × H = {args.heads} × d = {args.dim}, pool of {2 * args.requests} slots, "
          f"C backend, LINREC_NUM_THREADS or every core")
    for path in files:
        try:
            rec = linrec.load(path)
        except linrec.LinrecError as err:  # (a missing or wrong program: its message, not a traceback)
            parser.error(str(err))
        steps = {sd: bound_step(rec, args.requests, args.heads, args.dim, sd) for sd in (None, "bfloat16")}
        taken = {sd: [] for sd in steps}
        for _ in range(args.rounds):
            for sd, step in steps.items():
                taken[sd].append(median_us(step))
        for sd, times in taken.items():
            us, cpu = (float(np.median([t[i] for t in times])) for i in (0, 1))
            moved = 2 * args.requests * args.heads * args.dim ** 2 * (2 if sd else 4)
            print(f"{rec.name:<16} {sd or 'float32':<9} {us:9.0f} µs per step ({moved / us / 1e3:5.1f} GB/s of state "
                  f"moved), CPU {cpu:9.0f} µs  (rounds, wall: {', '.join(f'{t[0]:.0f}' for t in times)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

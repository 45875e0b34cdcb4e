"""A prefill and a decode step with another process busy on one core: how far the kernels slow down.

    python benchmarks/under_load.py [--program examples/gla.lin] [--d 64] [--T 4096] [--rounds 5]

Each round measures, back to back, in this process: the C recurrent form over B = 1, H = 8, T tokens
(`Recurrence.run`, the median of a few calls) and one decode step (`Recurrence.bind_step`, µs per call,
the median over batches of calls), each with every core's thread count ("quiet"), then with one thread,
then the same two while another process spins (`python -c 'while True: pass'`, pinned to the last core with
sched_setaffinity: the "loaded" rows). It prints each condition's median over rounds and the ratios to the
quiet run with every core's threads — the issue's targets: a loaded decode step within 3× and a loaded
prefill within 2.5× of their quiet times. Only ratios taken inside one run mean anything on a shared machine;
the script also reports how busy the other processes kept the cores (besides the spinner it starts).
Speed is never asserted in the test suite: this is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import linrec
from linrec.c import build as c_build

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("quiet", "quiet, 1 thread", "loaded", "loaded, 1 thread")


def spinner() -> subprocess.Popen:
    """A process that keeps the last core busy (pinned there when the system allows)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cpus:
        try:
            os.sched_setaffinity(proc.pid, {cpus[-1]})
        except OSError:
            pass
    time.sleep(0.2)  # running, and the scheduler has seen it
    return proc


def raise_priority(n: int) -> None:
    """os.nice(-n) for this process and the spinner it starts; where the scheduler groups processes by
    session (autogroup), niceness counts only inside the group, so the group's is raised too."""
    os.nice(-n)
    try:
        with open("/proc/self/autogroup", "w", encoding="ascii") as f:
            f.write(str(-n))
    except OSError:
        pass


def prefill_ms(rec, x, threads: int, calls: int) -> float:
    with c_build.threads(threads):
        rec.run(x, form="recurrent", backend="c")
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            rec.run(x, form="recurrent", backend="c")
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def decode_us(rec, token, state, threads: int, batches: int, per_batch: int) -> float:
    with c_build.threads(threads):
        step = rec.bind_step(token, state, backend="c")
        for _ in range(per_batch):  # warm: helper threads started, states in cache
            step()
        per_call = []
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(per_batch):
                step()
            per_call.append((time.perf_counter() - t0) / per_batch)
    return statistics.median(per_call) * 1e6


def busy_ticks() -> tuple[float, int]:
    """(wall time, busy ticks of the whole machine minus this process's own)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    with open("/proc/self/stat", encoding="ascii") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return time.time(), sum(fields[:8]) - fields[3] - fields[4] - sum(int(v) for v in own[11:13])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", default=str(ROOT / "examples" / "gla.lin"))
    parser.add_argument("--d", type=int, default=64, help="dk = dv (default 64)")
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=15, help="prefill calls per condition and round")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--priority", type=int, default=0, metavar="N",
                        help="raise this process's and the spinner's priority by N (os.nice(-N), needs the right "
                             "to): on a machine other programs keep busy, 'quiet' then comes closer to quiet while "
                             "the spinner still competes with the kernels on equal terms")
    args = parser.parse_args(argv)
    if args.priority:
        if os.getsid(0) != os.getpid():  # a session of its own: its autogroup is this run's alone
            return subprocess.run([sys.executable, *sys.argv], start_new_session=True, check=False).returncode
        raise_priority(args.priority)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        rec = linrec.load(args.program)
    except linrec.LinrecError as err:  # (a missing or wrong program: its message, not a traceback)
        parser.error(str(err))
    dims = {d.name: args.d for d in rec.program.dims if d.name in ("dk", "dv")}
    x = rec.random_inputs(batch=1, tokens=args.T, heads=args.heads, dims=dims, dtype=np.float32, seed=0)
    small = rec.random_inputs(batch=1, tokens=17, heads=args.heads, dims=dims, dtype=np.float32, seed=1)
    token = {k: np.ascontiguousarray(v[:, -1]) for k, v in small.items()}
    state = rec.prefill({k: v[:, :-1] for k, v in small.items()}, backend="c").final_state
    rounds: list[dict[str, dict[str, float]]] = []
    start = busy_ticks()
    spin_seconds = 0.0
    for r in range(args.rounds):
        rnd = {}
        for cond in CONDITIONS:
            threads = 1 if "1 thread" in cond else cores
            proc = spinner() if cond.startswith("loaded") else None
            t0 = time.time()
            try:
                rnd[cond] = {"prefill_ms": prefill_ms(rec, x, threads, args.calls),
                             "decode_us": decode_us(rec, token, state, threads, 15, 2000)}
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
                    spin_seconds += time.time() - t0 + 0.2
        rounds.append(rnd)
        print(f"round {r + 1}: " + "; ".join(f"{c} {v['prefill_ms']:.2f} ms {v['decode_us']:.2f} µs"
                                             for c, v in rnd.items()), file=sys.stderr, flush=True)
    end = busy_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    others = max(0.0, ((end[1] - start[1]) / hz - spin_seconds) / (end[0] - start[0]))
    med = {c: {k: statistics.median(rnd[c][k] for rnd in rounds) for k in ("prefill_ms", "decode_us")}
           for c in CONDITIONS}
    ratio = {c: {k: statistics.median(rnd[c][k] / rnd["quiet"][k] for rnd in rounds)
                 for k in ("prefill_ms", "decode_us")} for c in CONDITIONS}
    result = {"program": rec.program.name, "d": args.d, "T": args.T, "heads": args.heads, "cores": cores,
              "rounds": rounds, "median": med, "ratio_to_quiet": ratio,
              "busy_cores_besides_this_run": others, "priority_raised_by": args.priority, "linrec": linrec.__file__}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{rec.program.name}: B=1, H={args.heads}, dk=dv={args.d}, T={args.T}, {cores} core(s); median of "
          f"{args.rounds} rounds (ratio to quiet: median of per-round ratios); other processes kept {others:.2f} "
          f"core(s) busy besides the spinner" + (f"; priority raised by {args.priority}" if args.priority else ""))
    print(f"  {'condition':<18} {'prefill ms':>10} {'ratio':>6}   {'decode µs':>9} {'ratio':>6}")
    for c in CONDITIONS:
        print(f"  {c:<18} {med[c]['prefill_ms']:>10.2f} {ratio[c]['prefill_ms']:>6.2f}   "
              f"{med[c]['decode_us']:>9.2f} {ratio[c]['decode_us']:>6.2f}")
    print("  targets: loaded prefill ≤ 2.5× quiet, loaded decode step ≤ 3× quiet")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run `linrec bench` on the benchmark programs with several thread counts; write JSON, plots and a summary.

    python benchmarks/run_all.py                  # gla and gated_deltanet, all cores and 1 thread
    python benchmarks/run_all.py --quick          # the CI-sized smoke run (T = 256, 1024)
    python benchmarks/run_all.py --threads 2 --threads 1 --file examples/deltanet.lin

Writes benchmarks/results/<program>_t<threads>.json (the `linrec bench --json` object), .png (when matplotlib
is installed) and .txt (stderr: progress), and benchmarks/results/summary.md (benchmarks/summarize.py).
Needs linrec installed (`pip install '.[bench]'` from the repository): it runs `python -m linrec bench`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_FILES = ["examples/gla.lin", "examples/gated_deltanet.lin"]

sys.path.insert(0, str(HERE))
from summarize import summarize  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", action="append", help="a program (repeatable; default: gla and gated_deltanet)")
    parser.add_argument("--threads", action="append", type=int,
                        help="a thread count (repeatable; default: every core, then 1)")
    parser.add_argument("--quick", action="store_true", help="pass --quick to linrec bench")
    parser.add_argument("--out", default=str(HERE / "results"), help="results directory (default: %(default)s)")
    parser.add_argument("extra", nargs="*", help="more arguments for linrec bench (after --)")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or ([cores, 1] if cores > 1 else [1])
    files = args.file or DEFAULT_FILES
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written, status = [], 0
    for file in files:
        path = Path(file) if Path(file).is_absolute() else ROOT / file
        for n in threads:
            stem = out / f"{path.stem}_t{n}"
            cmd = [sys.executable, "-m", "linrec", "bench", str(path), "--json", "--threads", str(n),
                   "--plot", f"{stem}.png", *(["--quick"] if args.quick else []), *args.extra]
            print(f"$ linrec {' '.join(cmd[3:])}", flush=True)
            start = time.perf_counter()
            with open(f"{stem}.txt", "w", encoding="utf-8") as log:
                res = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                                     check=False)
            if res.returncode != 0:
                print(f"  failed (exit status {res.returncode}); see {stem}.txt", flush=True)
                status = 1
                continue
            report = json.loads(res.stdout)
            Path(f"{stem}.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            written.append(report)
            print(f"  {time.perf_counter() - start:.0f} s → {stem}.json", flush=True)
    if written:
        text = summarize(written)
        (out / "summary.md").write_text(text + "\n", encoding="utf-8")
        print(text)
        print(f"\nwrote {out / 'summary.md'}")
    return status


if __name__ == "__main__":
    sys.exit(main())

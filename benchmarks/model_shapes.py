"""The model grid of `linrec bench --shapes model` over several programs: run it (in parts), tabulate, plot.

    python benchmarks/model_shapes.py run [--examples gla gated_deltanet] [linrec bench options …]
    python benchmarks/model_shapes.py table benchmarks/results/model_*.json      # Markdown, to stdout
    python benchmarks/model_shapes.py plot benchmarks/results/model_*.json --out model.png

`run` calls `python -m linrec bench examples/<name>.lin --shapes model --json` for each example, passing every
other option on (--grid-dims, --heads, --batch, --T, --form, --threads, --repeats, --no-decode …: the grid in
parts), and writes benchmarks/results/model_<name>.json (git-ignored). `table` prints one Markdown table of the
prefill rows and one of the decode steps, each row with its fraction of its bound and "vs best"; `plot` draws
the fraction of the bound per shape, one series per program and form (and one for the decode steps). The plot
needs matplotlib (`pip install 'linrec[bench]'`); without it `plot` says so and writes nothing (exit status 0).
benchmarks/model_shapes.md keeps this machine's figures.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def bench_json(name: str, options: list[str], out: Path) -> bool:
    """`python -m linrec bench examples/<name>.lin --shapes model --json OPTIONS` into `out`; False (and a line
    on stderr) when it fails."""
    cmd = [sys.executable, "-m", "linrec", "bench", str(ROOT / "examples" / f"{name}.lin"), "--shapes", "model",
           "--json", *options]
    print(" ".join(cmd[1:]), "→", out.relative_to(ROOT), file=sys.stderr, flush=True)
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if res.returncode != 0:
        print(f"{name}: linrec bench failed (exit status {res.returncode})", file=sys.stderr)
        return False
    out.write_text(res.stdout, encoding="utf-8")
    return True


def run(examples: list[str], passed: list[str]) -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    ok = [bench_json(name, passed, RESULTS / f"model_{name}.json") for name in examples]
    return 0 if all(ok) else 1


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x, spec) -> str:
    return "-" if x is None else format(x, spec)


def table(paths: list[str]) -> str:
    reports = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    out = []
    for rep in reports:
        out.append(f"* **{rep['program']}**: {rep['threads']} thread(s), multiply-add peak "
                   f"{_num(rep['fma_peak_gflops'], '.0f')} GFLOP/s, bandwidth {_num(rep['bandwidth_gbs'], '.1f')} GB/s, "
                   f"matmul {_num(rep['sgemm_gflops'], '.0f')} GFLOP/s; other processes kept "
                   f"{_num(rep.get('other_processes_cores'), '.2f')} core(s) busy")
    out += ["", "| program | form | dk×dv | H | B | T | ms | GFLOP/s | of bound | of matmul | vs best |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rep in reports:
        for r in rep["rows"]:
            out.append(f"| {rep['program']} | {r['form']} ({r['backend']}) | {r['dk']}×{r['dv']} | {r['H']} | {r['B']} | "
                       f"{r['T']} | {r['ms']:.1f} | {_num(r['gflops'], '.1f')} | {_pct(r['fraction_of_bound'])} | "
                       f"{_pct(r['fraction_of_sgemm'])} | {_num(r['vs_best'], '.2f')} |")
    steps = [(rep["program"], d) for rep in reports for d in rep["decode"]]
    if steps:
        out += ["", "| program | decode (B = 1) | dk×dv | H | µs | state bytes moved | of bound | vs best | state in LLC |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for program, d in steps:
            out.append(f"| {program} | {d['backend']} | {d['dk']}×{d['dv']} | {d['H']} | {d['us']:.2f} | "
                       f"{d['state_bytes_moved']} | {_pct(d['fraction_of_bound'])} | {_num(d['vs_best'], '.2f')} | "
                       f"{'yes' if d['state_in_last_level_cache'] else 'no'} |")
    skipped = [(rep["program"], s) for rep in reports for s in rep["skipped"]]
    if skipped:
        out += ["", "Not measured:"]
        for program, s in skipped:
            where = " ".join(f"{k}={s[k]}" for k in ("dk", "dv", "H", "B", "T") if s.get(k) is not None)
            out.append(f"* {program} {s['form']} ({s['backend']}) {where}: {s['reason']}")
    return "\n".join(out)


def plot(paths: list[str], out: str) -> int:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed, so no plot was written to {out} (pip install 'linrec[bench]')")
        return 0
    reports = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    decodes = any(rep["decode"] for rep in reports)  # (a grid run with --no-decode: no lower panel)
    fig, axes = plt.subplots(2 if decodes else 1, 1, figsize=(11, 8 if decodes else 4.5), squeeze=False)
    panels = [row[0] for row in axes]
    ax, bx = panels[0], panels[-1]
    for rep in reports:
        forms = dict.fromkeys((r["form"], r["backend"]) for r in rep["rows"])
        for form, backend in forms:
            rows = [r for r in rep["rows"] if (r["form"], r["backend"]) == (form, backend)]
            labels = [f"{r['dk']}×{r['dv']} H{r['H']} B{r['B']} T{r['T']}" for r in rows]
            ax.plot(labels, [100 * (r["fraction_of_bound"] or 0) for r in rows], marker="o",
                    label=f"{rep['program']} {form} ({backend})")
        if rep["decode"]:
            labels = [f"{d['dk']}×{d['dv']} H{d['H']}" for d in rep["decode"]]
            bx.plot(labels, [100 * (d["fraction_of_bound"] or 0) for d in rep["decode"]], marker="o",
                    label=f"{rep['program']} decode ({rep['decode'][0]['backend']})")
    ax.set_ylabel("% of the multiply-add-peak bound")
    if decodes:
        bx.set_ylabel("% of the bandwidth bound")
    for a in panels:
        a.tick_params(axis="x", labelsize=7)
        for label in a.get_xticklabels():  # (each label ends at its own tick)
            label.set(rotation=70, ha="right", rotation_mode="anchor")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    ax.set_title("linrec bench --shapes model: fraction of the bound per shape (float32)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the grid (other options go to linrec bench)")
    r.add_argument("--examples", nargs="+", default=["gla", "gated_deltanet"], metavar="NAME",
                   help="examples/NAME.lin to run (default: gla gated_deltanet)")
    t = sub.add_parser("table", help="Markdown tables of results")
    t.add_argument("files", nargs="+")
    p = sub.add_parser("plot", help="fraction of the bound per shape (needs matplotlib)")
    p.add_argument("files", nargs="+")
    p.add_argument("--out", default=str(RESULTS / "model_shapes.png"))
    args, rest = parser.parse_known_args(argv)
    if args.command == "run":
        return run(args.examples, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:  # (an unmatched glob, say results/model_*.json before any run, reaches here as itself)
        parser.error(f"no such result file: {', '.join(missing)}; `python benchmarks/model_shapes.py run` writes "
                     f"them into {RESULTS}")
    if args.command == "table":
        print(table(args.files))
        return 0
    return plot(args.files, args.out)


if __name__ == "__main__":
    sys.exit(main())

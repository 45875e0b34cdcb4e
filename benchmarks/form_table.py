"""The table `form="auto"` reads at the shapes of the model grid: run the grid's forms, write the table.

    python benchmarks/form_table.py run --tag b1_t4096 [--examples gla gated_deltanet mamba2 retnet] \
        -- --heads 8 --heads 16 --batch 1 --T 4096
    python benchmarks/form_table.py write benchmarks/results/forms_*.json      # → backends/form_table.json
    python benchmarks/form_table.py show                                         # the table, as Markdown

`run` times the recurrent and chunkwise forms (and the parallel form with `--form parallel` among the options
after `--`) of each example on the C backend at the grid's shapes, with `linrec bench FILE --shapes model
--no-decode --json` and the options after `--` (the grid in parts: --grid-dims, --heads, --batch, --T,
--threads, --repeats), into benchmarks/results/forms_<example>_<tag>.json (git-ignored). `write` reads such
files and writes the package's table, linrec/form_table.json: per update structure (form_choice.structure,
derived from the decomposition: programs of the same structure share a row, their times added) and per
shape (dk, dv, H, B, T) the median milliseconds of each form; a shape measured in several files keeps the
lowest median (another program's load only slows a run down). form_choice picks the fastest form of a row
for a float32 call of that shape; off the table it falls back to its rules.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import linrec
from linrec import form_choice  # (its structure() keys the table)
from model_shapes import RESULTS, ROOT, bench_json  # (benchmarks/, the script's own folder)

TABLE = ROOT / "backends" / "form_table.json"
EXAMPLES = ["gla", "gated_deltanet", "mamba2", "retnet"]
FORMS = ["recurrent", "chunkwise"]


def run(examples: list[str], tag: str, passed: list[str]) -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    forms = [] if "--form" in passed else [a for f in FORMS for a in ("--form", f)]
    ok = [bench_json(name, ["--no-decode", "--backend", "c", *forms, *passed], RESULTS / f"forms_{name}_{tag}.json")
          for name in examples]
    return 0 if all(ok) else 1


def table(paths: list[str]) -> dict:
    """The table from bench reports (linrec bench --shapes model --json)."""
    best: dict[tuple, float] = {}      # (structure, program, dk, dv, H, B, T, form) → lowest median ms
    dtypes, threads, loads, runs = set(), set(), [], []
    for path in paths:
        rep = json.loads(Path(path).read_text(encoding="utf-8"))
        dtypes.add(rep["dtype"])
        threads.add(rep["threads"])
        loads.append(rep.get("other_processes_cores"))
        runs.append(Path(path).name)
        key = form_choice.structure(linrec.load(rep["file"]).compiled)
        for r in rep["rows"]:
            if r.get("backend") != "c" or r.get("ms") is None:
                continue
            k = (key, rep["program"], r["dk"], r["dv"], r["H"], r["B"], r["T"], r["form"])
            best[k] = min(best.get(k, float("inf")), r["ms"])
    if len(dtypes) != 1 or len(threads) != 1:
        raise SystemExit(f"the reports mix dtypes {sorted(dtypes)} or thread counts {sorted(threads)}: one table "
                         f"is for one of each")
    # per program and shape its forms; then per structure and shape the sum over its programs, over the forms
    # every one of them has
    per_program: dict[tuple, dict[str, float]] = defaultdict(dict)
    for (key, program, dk, dv, h, b, t, form), ms in best.items():
        per_program[(key, dk, dv, h, b, t, program)][form] = ms
    rows: dict[tuple, dict] = {}
    for (key, dk, dv, h, b, t, program), times in sorted(per_program.items()):
        row = rows.setdefault((key, dk, dv, h, b, t), {"structure": key, "programs": [], "dk": dk, "dv": dv, "H": h,
                                                       "B": b, "T": t, "ms": None})
        row["programs"].append(program)
        row["ms"] = dict(times) if row["ms"] is None else {
            f: row["ms"][f] + ms for f, ms in times.items() if f in row["ms"]}
    cpu = json.loads(Path(paths[0]).read_text(encoding="utf-8"))["machine"]
    busy = [x for x in loads if x is not None]
    return {
        "about": "median ms of each form of the C backend at the shapes of the model grid, per update structure "
                 "(linrec.form_choice.structure); form='auto' takes the fastest form of a row for a float32 "
                 "call of that shape",
        "regenerate": "python benchmarks/form_table.py run --tag TAG -- [--heads H --batch B --T T …]; "
                      "python benchmarks/form_table.py write benchmarks/results/forms_*.json",
        "measured_on": f"{datetime.now(timezone.utc):%Y-%m-%d}, {cpu.get('cpu')} ({cpu.get('cores')} cores), "
                       f"{threads.pop()} threads",
        "other_processes_cores": [round(min(busy), 2), round(max(busy), 2)] if busy else None,
        "reports": runs,
        "backend": "c",
        "dtype": dtypes.pop(),
        "rows": [{**r, "ms": {f: round(ms, 2) for f, ms in r["ms"].items()}} for r in rows.values()],
    }


def write(paths: list[str], out: Path) -> None:
    """The table as JSON, a row a line (a regenerated table then diffs row by row)."""
    t = table(paths)
    rows = t.pop("rows")
    head = json.dumps(t, indent=1, ensure_ascii=False)[:-2]
    body = ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in rows)
    out.write_text(f'{head},\n "rows": [\n{body}\n ]\n}}\n', encoding="utf-8")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}", file=sys.stderr)


def show(path: Path) -> str:
    """The table as Markdown: per row the programs, the shape, each form's ms, the winner and its margin."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    forms = sorted({f for r in raw["rows"] for f in r["ms"]}, key=lambda f: (FORMS.index(f) if f in FORMS else 9, f))
    out = [f"{raw['measured_on']}, {raw['dtype']}; other processes kept {raw['other_processes_cores']} cores busy", "",
           "| programs | dk×dv | H | B | T | " + " | ".join(f"{f} ms" for f in forms) + " | auto | by |",
           "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in forms) + " | --- | --- |"]
    for r in raw["rows"]:
        ranked = sorted(r["ms"], key=r["ms"].get)
        by = f"{r['ms'][ranked[1]] / r['ms'][ranked[0]]:.2f}×" if len(ranked) > 1 else "-"
        cells = [f"{r['ms'][f]:.1f}" if f in r["ms"] else "-" for f in forms]
        out.append(f"| {', '.join(r['programs'])} | {r['dk']}×{r['dv']} | {r['H']} | {r['B']} | {r['T']} | "
                   + " | ".join(cells) + f" | {ranked[0]} | {by} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    passed = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="time the forms at grid shapes (linrec bench options after --)")
    r.add_argument("--examples", nargs="+", default=EXAMPLES)
    r.add_argument("--tag", required=True, help="names the reports: forms_<example>_<tag>.json")
    w = sub.add_parser("write", help="write the package's table from bench reports")
    w.add_argument("reports", nargs="+")
    w.add_argument("--out", type=Path, default=TABLE)
    s = sub.add_parser("show", help="print a table as Markdown")
    s.add_argument("path", nargs="?", type=Path, default=TABLE)
    args = ap.parse_args(argv)
    if args.command == "run":
        return run(args.examples, args.tag, passed)
    if args.command == "write":
        write(args.reports, args.out)
        return 0
    print(show(args.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())

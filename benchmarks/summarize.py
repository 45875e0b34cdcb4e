"""Summarize `linrec bench --json` results: one Markdown table per program, threads side by side.

    python benchmarks/summarize.py benchmarks/results/*.json            # print Markdown
    python benchmarks/summarize.py benchmarks/results/*.json -o summary.md

For every program it lines up the runs with different thread counts (the most threads first): median
ms, GFLOP/s and fraction of the same run's matmul per form, backend and T; the speedup of the most
threads over 1 thread; T-doubling ratios (linear = 2.00); decode µs, first build and cached load.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def summarize(reports: list[dict]) -> str:
    by_program: dict[str, list[dict]] = defaultdict(list)
    for r in reports:
        by_program[r["program"]].append(r)
    out = []
    for program, runs in by_program.items():
        runs.sort(key=lambda r: -r["threads"])
        threads = [r["threads"] for r in runs]
        first = runs[0]
        dims = ", ".join(f"{k}={v}" for k, v in first["dims"].items())
        out.append(f"## {program} ({first['file']}): B={first['batch']}, H={first['heads']}, {dims}, float32")
        out.append("")
        out.append(f"Useful flops per token and head: {first['flop_formula']} = {first['flops_per_token_head']}.")
        for r in runs:
            busy = r.get("other_processes_cores")
            out.append(f"- {r['threads']} thread(s): matmul reference {_f(r['sgemm_gflops'], '{:.1f}')} GFLOP/s "
                       f"({r.get('blas_summary', '?')}); with the environment as given "
                       f"{_f(r.get('sgemm_pinned_gflops'), '{:.1f}')} GFLOP/s"
                       + (f"; other processes used {busy:.2f} cores meanwhile" if busy is not None else ""))
        out.append("")
        header = ["form", "backend", "T"]
        for t in threads:
            header += [f"ms ({t}t)", f"GFLOP/s ({t}t)", f"of matmul ({t}t)"]
        if len(threads) > 1 and 1 in threads:
            header.append(f"speedup {threads[0]}t/1t")
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        keys = []
        for r in runs:
            for row in r["rows"]:
                k = (row["form"], row["backend"], row["T"])
                if k not in keys:
                    keys.append(k)
        keys.sort(key=lambda k: (k[1] != "c", k[1], k[0], k[2]))
        index = [{(row["form"], row["backend"], row["T"]): row for row in r["rows"]} for r in runs]
        for k in keys:
            cells = [k[0], k[1], str(k[2])]
            for rows in index:
                row = rows.get(k)
                cells += ([_f(row["ms"], "{:.3f}"), _f(row["gflops"]), _f(row["fraction_of_sgemm"] and
                                                                          100 * row["fraction_of_sgemm"], "{:.1f}%")]
                          if row else ["–"] * 3)
            if len(threads) > 1 and 1 in threads:
                a, b = index[0].get(k), index[threads.index(1)].get(k)
                cells.append(_f(b["ms"] / a["ms"]) + "×" if a and b else "–")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        for r in runs:
            doubling = [s for s in r["scaling"] if s["linear"] == 2]
            if doubling:
                out.append(f"- T doubling ({r['threads']} thread(s), linear = 2.00): " + "; ".join(
                    f"{s['form']} ({s['backend']}) {s['T_from']}→{s['T_to']}: {s['ratio']:.2f}" for s in doubling))
        for r in runs:
            decode = ", ".join(f"{b} {us:.2f} µs" for b, us in r["decode_us"].items())
            build = ", ".join(f"{b} first build {s:.2f} s" for b, s in r["build_s"].items())
            load = ", ".join(f"{b} cached load {ms:.1f} ms" for b, ms in r["cached_load_ms"].items())
            out.append(f"- {r['threads']} thread(s): decode step {decode or '–'}; {build or 'no build'}; "
                       f"{load or 'no cached load'}")
        kv = ", ".join(f"T={t}: {n / 2**20:.1f} MiB" for t, n in first["kv_cache_bytes"].items())
        out.append(f"- memory per layer: state {first['state_bytes'] / 1024:.0f} KiB vs softmax KV cache {kv}")
        autos = "; ".join(f"{a['backend']} T={a['T']} → {a['form']}"
                          + (f" (fastest measured: {a['fastest_measured']})" if a.get("fastest_measured") else "")
                          for a in first["auto"])
        out.append(f"- form auto: {autos}")
        for r in runs:
            for n in r.get("notes", []):
                out.append(f"- note ({r['threads']} thread(s)): {n}")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="JSON files written by `linrec bench --json`")
    parser.add_argument("-o", "--out", help="also write the Markdown to this file")
    args = parser.parse_args(argv)
    reports = []
    for path in args.files:
        try:
            reports.append(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError) as err:
            print(f"summarize: skipping {path}: {err}", file=sys.stderr)
    text = summarize(reports)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

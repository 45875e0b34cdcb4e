"""The prefill targets at the shapes models use (issue #26) and the backward's ratio to the forward (issue #24),
measured in interleaved rounds on a noisy machine.

    python benchmarks/shape_targets.py prefill [--rounds 5] [--tokens 4096] [--json]   # gla, gated_deltanet,
                                                                                        # gdn2; d = 64, 128, 256
    python benchmarks/shape_targets.py grad [--rounds 3] [--tokens 4096] [--json]      # gla, gated_deltanet,
                                                                                        # mamba2; d = 64, 128

On a shared machine the speed drifts by tens of percent over minutes (this VM: GLA's prefill at d = 128 took
23.6 ms in one `linrec bench` run and 16.0 ms in the next, ten minutes apart), so a table whose rows were
timed minutes apart compares a fast spell with a slow one. Here every round measures everything once, back to
back, and each figure is computed inside its round:

    prefill   the cores' float32 multiply-add peak on 2 threads (fma_peak.py's method), then per program and
              d = dk = dv the C recurrent form at B = 1, H = 8, T = --tokens (4096) on 2 threads (median of 3 calls of
              Recurrence.run after a warm-up): the fraction of the bound its useful flops set at that peak
              (targets: ≥ 80% GLA, ≥ 75% the delta rules);
    grad      per program and d, the fastest forward (the C recurrent form) and each gradient form's
              Recurrence.vjp (which runs its forward too) at B = 1, H = 8, T = --tokens (4096) on 2 threads: the fastest
              backward over the fastest forward (target ≤ 3×); and the backward alone, from the forward kept for
              it as a training step through linrec.torch runs it (gradients.saved_forward, vjp(saved=…)); and
              that ratio for the fastest such backward timed in pairs — a forward, then the backward, PAIRS
              times — as the median of the pairs' ratios: the two calls of a pair, tens of milliseconds apart,
              see the same spell of a machine whose speed drifts by a fifth over seconds.

The report gives the median over rounds and the range (min–max); --json the rounds too. Float32 throughout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import linrec
from fma_peak import fma_peak_gflops  # (benchmarks/, the script's own folder)
from linrec import bench, bench_grad, gradients
from linrec.c import build as c_build
from targets import median_ms, run_ms

ROOT = Path(__file__).resolve().parent.parent  # the repository: the example programs
B, H, T = bench.BATCH, bench.HEADS, 4096  # (bench_grad.upstream_gradients' B and H; T: --tokens' default)
PREFILL = {"programs": ["gla", "gated_deltanet", "gdn2"], "dims": [64, 128, 256],
           "target": {"gla": 0.80, "gated_deltanet": 0.75, "gdn2": 0.75}}
GRAD = {"programs": ["gla", "gated_deltanet", "mamba2"], "dims": [64, 128], "target": 3.0}
PAIRS = 5  # forward–backward pairs per round (measure_grad)


def _load(name: str):
    return linrec.load(ROOT / "examples" / f"{name}.lin")


def _span(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure_prefill(rounds: int, progress, tokens: int = T) -> dict:
    cases = []
    for name in PREFILL["programs"]:
        rec = _load(name)
        for d in PREFILL["dims"]:
            dims = {"dk": d, "dv": d}
            cases.append((name, d, rec, rec.random_inputs(B, tokens, H, dims=dims, dtype=np.float32, seed=0),
                          bench.flop_count(rec, dims)[0] * B * tokens * H))
    out = []
    for r in range(rounds):
        progress(f"prefill: round {r + 1}/{rounds} …")
        peak = fma_peak_gflops(2)
        rows = {}
        for name, d, rec, x, useful in cases:
            ms = run_ms(rec, x, 2)
            rows[f"{name} d={d}"] = {"ms": ms, "fraction_of_fma_peak": useful / (peak * 1e6) / ms}
        out.append({"fma_peak_gflops": peak, "rows": rows})
    return {"rounds": out}


def summarize_prefill(res: dict) -> dict:
    rounds = res["rounds"]
    rows = {key: {"ms": _span([r["rows"][key]["ms"] for r in rounds]),
                  "fraction_of_fma_peak": _span([r["rows"][key]["fraction_of_fma_peak"] for r in rounds])}
            for key in rounds[0]["rows"]}
    return {"fma_peak_gflops": _span([r["fma_peak_gflops"] for r in rounds]), "rows": rows}


def report_prefill(s: dict, rounds: int, tokens: int = T) -> str:
    pk = s["fma_peak_gflops"]
    lines = [f"{rounds} rounds; B = {B}, H = {H}, T = {tokens}, float32, 2 threads, the C recurrent form; multiply-add "
             f"peak {pk['median']:.0f} GFLOP/s ({pk['min']:.0f}–{pk['max']:.0f}); median (min–max over rounds)", "",
             "| program | " + " | ".join(f"d = {d}" for d in PREFILL["dims"]) + " | target |",
             "|---|" + "---|" * (len(PREFILL["dims"]) + 1)]
    for name in PREFILL["programs"]:
        cells = []
        for d in PREFILL["dims"]:
            row = s["rows"][f"{name} d={d}"]
            f = row["fraction_of_fma_peak"]
            cells.append(f"{f['median']:.0%} ({f['min']:.0%}–{f['max']:.0%}), {row['ms']['median']:.2f} ms")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | ≥ {PREFILL['target'][name]:.0%} |")
    return "\n".join(lines)


def measure_grad(rounds: int, progress, tokens: int = T) -> dict:
    cases = []
    for name in GRAD["programs"]:
        rec = _load(name)
        # (the gradient forms C builds at T, as linrec bench --grad times them)
        forms, _ = bench_grad.grad_combos(rec, "c", [f for f in rec.forms if not rec.decomposition.why_not(f)],
                                          tokens, limits=True)
        for d in GRAD["dims"]:
            dims = {"dk": d, "dv": d}
            x = rec.random_inputs(B, tokens, H, dims=dims, dtype=np.float32, seed=0)
            cases.append((name, d, rec, x, bench_grad.upstream_gradients(rec, dims, tokens, np.float32), forms))
    out = []
    for r in range(rounds):
        progress(f"grad: round {r + 1}/{rounds} …")
        rows = {}
        for name, d, rec, x, grads, forms in cases:
            forward_call = lambda: rec.run(x, form="recurrent", backend="c")  # noqa: E731
            forward = median_ms(forward_call, 2)
            vjp = {form: median_ms(lambda f=form: rec.vjp(x, grads, form=f, backend="c"), 2) for form in forms}
            fastest = min(vjp, key=vjp.get)
            backwards = {form: call for form in forms if (call := _kept_backward(rec, x, grads, form)) is not None}
            kept = {form: median_ms(call, 2) for form, call in backwards.items()}
            fastest_kept = min(kept, key=kept.get) if kept else None
            paired = paired_ratio(forward_call, backwards[fastest_kept], 2) if kept else None
            rows[f"{name} d={d}"] = {"forward_ms": forward, "vjp_ms": vjp, "fastest": fastest,
                                     "ratio": vjp[fastest] / forward, "kept_ms": kept,
                                     "kept_fastest": fastest_kept,
                                     "kept_ratio": kept[fastest_kept] / forward if kept else None,
                                     "paired_ratio": paired}
        out.append({"rows": rows})
    return {"rounds": out}


def _kept_backward(rec, x, grads, form: str):
    """The backward alone of `form` on C, from the forward kept for it (gradients.saved_forward, run once here),
    as a call; None where the form keeps no forward."""
    saved = gradients.saved_forward(rec, x, form=form, backend="c", initial_state=None, params=None, dims=None,
                                    chunk_size=None)
    if saved is None:
        return None
    return lambda: gradients.vjp(rec, x, grads, form=form, backend="c", grad_final_state=None, initial_state=None,
                                 params=None, dims=None, chunk_size=None, missing="error", saved=saved)


def paired_ratio(forward, backward, threads: int, pairs: int = PAIRS) -> float:
    """The median over `pairs` of (backward's time / forward's time), each pair timed back to back on `threads`
    threads, after a warm-up call of each."""
    with c_build.threads(threads):
        forward()
        backward()
        ratios = []
        for _ in range(pairs):
            t0 = time.perf_counter()
            forward()
            t1 = time.perf_counter()
            backward()
            ratios.append((time.perf_counter() - t1) / (t1 - t0))
    return statistics.median(ratios)


def summarize_grad(res: dict) -> dict:
    rounds = res["rounds"]
    rows = {}
    for key in rounds[0]["rows"]:
        per = [r["rows"][key] for r in rounds]
        rows[key] = {"forward_ms": _span([p["forward_ms"] for p in per]),
                     "vjp_ms": {f: _span([p["vjp_ms"][f] for p in per]) for f in per[0]["vjp_ms"]},
                     "fastest": [p["fastest"] for p in per], "ratio": _span([p["ratio"] for p in per]),
                     "kept_ms": {f: _span([p["kept_ms"][f] for p in per]) for f in per[0]["kept_ms"]},
                     "kept_fastest": [p["kept_fastest"] for p in per],
                     "kept_ratio": _span([p["kept_ratio"] for p in per]) if per[0]["kept_ms"] else None,
                     "paired_ratio": _span([p["paired_ratio"] for p in per]) if per[0]["kept_ms"] else None}
    return {"rows": rows}


def report_grad(s: dict, rounds: int, tokens: int = T) -> str:
    lines = [f"{rounds} rounds; B = {B}, H = {H}, T = {tokens}, float32, 2 threads, C; the fastest vjp (which runs its "
             f"forward too) over the fastest forward (the recurrent form), and the fastest backward alone (from the "
             f"forward kept for it, as in a training step), and that ratio timed in pairs (a forward, then the "
             f"backward, {PAIRS} times: the median of the pairs' ratios), median (min–max over rounds)", "",
             "| program | d | forward ms | vjp ms per form | fastest | × forward | backward alone ms per form | "
             "× forward | × forward, in pairs | target |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in s["rows"].items():
        name, d = key.split(" d=")
        forms = ", ".join(f"{f} {v['median']:.1f}" for f, v in row["vjp_ms"].items())
        kept = ", ".join(f"{f} {v['median']:.1f}" for f, v in row["kept_ms"].items()) or "-"
        fastest = max(set(row["fastest"]), key=row["fastest"].count)
        ratio, kept_ratio = row["ratio"], row["kept_ratio"]
        alone, paired = ("-" if r is None else f"{r['median']:.1f}× ({r['min']:.1f}–{r['max']:.1f})"
                         for r in (kept_ratio, row["paired_ratio"]))
        lines.append(f"| {name} | {d} | {row['forward_ms']['median']:.2f} | {forms} | {fastest} | "
                     f"{ratio['median']:.1f}× ({ratio['min']:.1f}–{ratio['max']:.1f}) | {kept} | {alone} | "
                     f"{paired} | ≤ {GRAD['target']:.0f}× |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("what", choices=["prefill", "grad"], help="which targets")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (default: 5 for prefill, 3 for grad)")
    parser.add_argument("--tokens", type=int, default=T, help=f"tokens per sequence, T (default {T})")
    parser.add_argument("--json", action="store_true", help="print the rounds and the summary as JSON")
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else 5 if args.what == "prefill" else 3
    if rounds < 1:
        parser.error("--rounds: expected a positive integer")
    if args.tokens < 1:
        parser.error("--tokens: expected a positive integer")
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.what == "prefill":
        res = measure_prefill(rounds, progress, args.tokens)
        s = summarize_prefill(res)
        text = report_prefill(s, rounds, args.tokens)
    else:
        res = measure_grad(rounds, progress, args.tokens)
        s = summarize_grad(res)
        text = report_grad(s, rounds, args.tokens)
    print(json.dumps({"rounds": res["rounds"], "summary": s}, indent=1) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

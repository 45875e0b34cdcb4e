"""ggml's own CPU ops on the benchmark's shapes, for comparison with `linrec bench` (optional).

    pip install ggml-python          # not a linrec dependency; builds ggml from source (a few minutes)
    python benchmarks/ggml_compare.py [--T 4096 --T 16384] [--threads 2] [--repeats 5] [--json]

Times `ggml_gated_linear_attn` (GLA: S = diag(exp g)·S + k⊗v, o = scale·q·S) and, when the installed ggml
has it, `ggml_gated_delta_net` (gated DeltaNet), float32, B = 1, H = 8, dk = dv = 64, as a graph of that
one op computed by `ggml_graph_compute_with_ctx` with the given thread count (median of repeats; the inputs
are written into ggml's tensors once, outside the timing), in rounds alternating with linrec's C recurrent
form on the same inputs (the ratio is the median over rounds), plus the one-token decode call (T = 1) from
Python. Both sides' GFLOP/s count the useful flops `linrec bench` counts (the recurrent form's, e.g.
4·dk·dv per token and head for GLA), each also as a fraction of the same-run float32 matmul (bench's
reference, measured before and after each op's rounds): how far each side is from what this machine's
cores do at the time, which the ratio alone does not show; and as a fraction of the cores' float32
multiply-add peak (fma_peak.py), with what a ratio of 5 would need of it. Before timing, a short sequence checks that
the op computes the same recurrence as linrec's example (examples/gla.lin, examples/gated_deltanet.lin)
and prints the relative difference — ggml gets its inputs in its own conventions (the decay exp(g) rather
than the log-decay g; q and k already normalized for the delta net), prepared with NumPy outside the timed
call.

Without ggml-python it prints how to install it and exits with status 0.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
H, D = 8, 64


def _install_hint() -> str:
    return ("ggml-python is not installed, so there is nothing to compare.\n"
            "  pip install ggml-python      # builds ggml from source with CMake (a few minutes); not a linrec "
            "dependency\n"
            "then run this script again. linrec's own figures: linrec bench examples/gla.lin")


class Graph:
    """One ggml context holding the inputs, the op's result and a graph of that op."""

    def __init__(self, ggml, op: str, tokens: int):
        self.ggml, self.op, self.tokens = ggml, op, tokens
        n_in = tokens * H * D
        data = 4 * (4 * n_in + 2 * tokens * H + 2 * (n_in + D * D * H)) + (64 << 20)
        params = ggml.ggml_init_params(mem_size=data, mem_buffer=None, no_alloc=False)
        self.ctx = ggml.ggml_init(params)
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        f32 = ggml.GGML_TYPE_F32
        new3 = lambda a, b, c: ggml.ggml_new_tensor_3d(self.ctx, f32, a, b, c)  # noqa: E731
        new4 = lambda a, b, c, d: ggml.ggml_new_tensor_4d(self.ctx, f32, a, b, c, d)  # noqa: E731
        if op == "gla":
            self.q, self.k, self.v, self.g = (new3(D, H, tokens) for _ in range(4))
            self.state = ggml.ggml_new_tensor_2d(self.ctx, f32, D * D * H, 1)
            self.out = ggml.ggml_gated_linear_attn(self.ctx, self.k, self.v, self.q, self.g, self.state, D ** -0.5)
        else:
            self.q, self.k, self.v = (new4(D, H, tokens, 1) for _ in range(3))
            self.g, self.beta = new4(1, H, tokens, 1), new4(1, H, tokens, 1)
            self.state = new4(D, D, H, 1)
            self.out = ggml.ggml_gated_delta_net(self.ctx, self.q, self.k, self.v, self.g, self.beta, self.state, 1)
        self.graph = ggml.ggml_new_graph(self.ctx)
        ggml.ggml_build_forward_expand(self.graph, self.out)

    def view(self, tensor, shape) -> np.ndarray:
        n = int(np.prod(shape))
        buf = (ctypes.c_float * n).from_address(self.ggml.ggml_get_data(tensor))
        return np.ctypeslib.as_array(buf).reshape(shape)

    def fill(self, inputs: dict):
        t = self.tokens
        for name, arr in inputs.items():
            tensor = getattr(self, name)
            shape = (t, H, D) if name in ("q", "k", "v") or (name == "g" and self.op == "gla") else (t, H)
            self.view(tensor, shape)[...] = arr.reshape(shape)
        self.view(self.state, (H, D, D))[...] = 0

    def compute(self, threads: int):
        status = self.ggml.ggml_graph_compute_with_ctx(self.ctx, self.graph, threads)
        if status not in (0, None):
            raise RuntimeError(f"ggml_graph_compute_with_ctx returned {status}")

    def output(self) -> np.ndarray:
        return self.view(self.out, (self.tokens, H, D)).copy()

    def close(self):
        self.ggml.ggml_free(self.ctx)


def _ggml_inputs(op: str, x: dict) -> dict:
    """linrec's example inputs [1, T, H, *] in ggml's conventions."""
    if op == "gla":
        return {"q": x["q"][0], "k": x["k"][0], "v": x["v"][0], "g": np.exp(x["g"][0])}
    norm = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)  # noqa: E731 - linrec's l2norm eps
    return {"q": norm(x["q"][0]), "k": norm(x["k"][0]), "v": x["v"][0], "g": x["g"][0], "beta": x["beta"][0]}


def check(ggml, op: str, threads: int) -> dict:
    """The op against linrec's float64 recurrent form on 64 tokens: relative difference of the outputs
    (and of the outputs scaled by √d, in case the op leaves out the 1/√d linrec's example has)."""
    import linrec
    rec = linrec.load(ROOT / "examples" / ("gla.lin" if op == "gla" else "gated_deltanet.lin"))
    x = rec.random_inputs(batch=1, tokens=64, heads=H, dims={"dk": D, "dv": D}, dtype=np.float32, seed=0)
    ref = rec.run({k: v.astype(np.float64) for k, v in x.items()}, form="recurrent").outputs["o"][0]
    gr = Graph(ggml, op, 64)
    try:
        gr.fill(_ggml_inputs(op, x))
        gr.compute(threads)
        got = gr.output()
    finally:
        gr.close()
    rel = lambda a: float(np.abs(a - ref).max() / np.abs(ref).max())  # noqa: E731
    return {"rel_diff": rel(got), "rel_diff_if_unscaled": rel(got * D ** -0.5)}


def time_op(ggml, op: str, tokens: int, threads: int, repeats: int, per_round: int = 3) -> dict:
    """ggml's op and linrec's C recurrent form (Recurrence.run, input checks included) on the same inputs, in
    `repeats` rounds of `per_round` calls of each, back to back: their median ms over all calls and the
    median over rounds of the ratio of the two rounds' medians. Each side runs as `linrec bench` times it
    (repeated calls on the same inputs), and the ratio of two rounds a few hundred ms apart is immune to the
    machine's slow and fast spells; alternating call by call instead would make each side evict the
    other's inputs from the shared last-level cache before every call."""
    import linrec
    from linrec import bench
    from linrec.c import build as c_build
    rec = linrec.load(ROOT / "examples" / ("gla.lin" if op == "gla" else "gated_deltanet.lin"))
    x = rec.random_inputs(batch=1, tokens=tokens, heads=H, dims={"dk": D, "dv": D}, dtype=np.float32, seed=0)
    gr = Graph(ggml, op, tokens)

    def timed(fn) -> list[float]:
        fn()  # the first call after the other side's: not counted
        out = []
        for _ in range(per_round):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    try:
        gr.fill(_ggml_inputs(op, x))
        with c_build.threads(threads):
            ggml_s, linrec_s, ratios = [], [], []
            for _ in range(repeats):
                g = timed(lambda: gr.compute(threads))
                lr = timed(lambda: rec.run(x, form="recurrent", backend="c"))
                ggml_s += g
                linrec_s += lr
                ratios.append(statistics.median(g) / statistics.median(lr))
    finally:
        gr.close()
    useful = bench.flop_count(rec, {"dk": D, "dv": D})[0] * tokens * H
    ggml_ms, linrec_ms = statistics.median(ggml_s) * 1e3, statistics.median(linrec_s) * 1e3
    return {"ggml_ms": ggml_ms, "linrec_ms": linrec_ms, "ratio": statistics.median(ratios),
            "ggml_gflops": useful / (ggml_ms * 1e6), "linrec_gflops": useful / (linrec_ms * 1e6)}


def decode_us(ggml, op: str, threads: int) -> float:
    """One token of one layer (T = 1), the graph computed from Python per call."""
    gr = Graph(ggml, op, 1)
    try:
        rng = np.random.default_rng(0)
        inputs = {"q": rng.standard_normal((1, H, D)), "k": rng.standard_normal((1, H, D)) / 8,
                  "v": rng.standard_normal((1, H, D)), "g": np.full((1, H, D) if op == "gla" else (1, H),
                                                                   0.99 if op == "gla" else -0.01)}
        if op != "gla":
            inputs["beta"] = np.full((1, H), 0.5)
        gr.fill({k: v.astype(np.float32) for k, v in inputs.items()})
        n = 2000
        per_call = []
        for _ in range(11):
            t0 = time.perf_counter()
            for _ in range(n):
                gr.compute(threads)
            per_call.append((time.perf_counter() - t0) / n)
    finally:
        gr.close()
    return statistics.median(per_call) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", dest="tokens", action="append", type=int, help="sequence length (repeatable; "
                        "default: 1024, 4096, 16384)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0))
                        if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        import ggml
    except ImportError:
        print(_install_hint())
        return 0
    except (OSError, RuntimeError) as err:  # the bindings are there but their shared library does not load
        print(f"ggml-python is installed but does not load ({err}); nothing to compare")
        return 0
    from linrec import bench
    from fma_peak import fma_peak_gflops
    tokens = args.tokens or [1024, 4096, 16384]
    ops = ["gla"] + (["gated_delta_net"] if hasattr(ggml, "ggml_gated_delta_net") else [])
    report = {"threads": args.threads, "B": 1, "H": H, "dk": D, "dv": D, "ops": {}}
    for op in ops:
        name = "ggml_gated_linear_attn" if op == "gla" else "ggml_gated_delta_net"
        entry = {"op": name, "check": check(ggml, op, args.threads), "ms": {}, "decode_us": None}
        sgemm = [bench.sgemm_reference(args.threads, 3)["gflops"]]
        for t in tokens:
            entry["ms"][str(t)] = time_op(ggml, op, t, args.threads, args.repeats)
        sgemm.append(bench.sgemm_reference(args.threads, 3)["gflops"])
        entry["sgemm_gflops"] = statistics.median(sgemm) if None not in sgemm else None
        for m in entry["ms"].values():
            for side in ("ggml", "linrec"):
                m[f"{side}_fraction_of_bound"] = (m[f"{side}_gflops"] / entry["sgemm_gflops"]
                                                  if entry["sgemm_gflops"] else None)
        # what a ratio of 5 would need: GFLOP/s against the cores' multiply-add peak (no kernel can pass it)
        entry["fma_peak_gflops"] = fma_peak_gflops(args.threads)
        for m in entry["ms"].values():
            m["five_times_ggml_of_fma_peak"] = 5 * m["ggml_gflops"] / entry["fma_peak_gflops"]
            m["linrec_of_fma_peak"] = m["linrec_gflops"] / entry["fma_peak_gflops"]
        entry["decode_us"] = decode_us(ggml, op, args.threads)
        entry["decode_us_1_thread"] = decode_us(ggml, op, 1) if args.threads != 1 else entry["decode_us"]
        report["ops"][op] = entry
        if not args.json:
            c = entry["check"]
            same = "same recurrence" if c["rel_diff"] < 1e-3 else (
                "same recurrence without linrec's 1/√d scale" if c["rel_diff_if_unscaled"] < 1e-3 else
                "DIFFERENT results: compare with care")
            print(f"{name} ({args.threads} thread(s), B=1, H={H}, d={D}, float32): vs linrec's example: max rel "
                  f"diff {c['rel_diff']:.2e} ({same})")
            for t, m in entry["ms"].items():
                print(f"  T={t:>6}: ggml {m['ggml_ms']:9.3f} ms ({int(t) / m['ggml_ms'] * 1e3:.4g} tokens/s); linrec C "
                      f"recurrent {m['linrec_ms']:.3f} ms; ggml / linrec = {m['ratio']:.2f}× (median of "
                      f"{args.repeats} alternating rounds)")
                print(f"          useful GFLOP/s: ggml {m['ggml_gflops']:.1f}, linrec {m['linrec_gflops']:.1f}"
                      + (f"; of the same-run matmul's {entry['sgemm_gflops']:.0f} GFLOP/s: ggml "
                         f"{m['ggml_fraction_of_bound']:.0%}, linrec {m['linrec_fraction_of_bound']:.0%}"
                         if entry["sgemm_gflops"] else "; no matmul reference (it failed to run)"))
                print(f"          of the cores' float32 multiply-add peak ({entry['fma_peak_gflops']:.0f} GFLOP/s, "
                      f"fma_peak.py): linrec {m['linrec_of_fma_peak']:.0%}; 5× ggml would need "
                      f"{m['five_times_ggml_of_fma_peak']:.0%}")
            print(f"  decode (T=1, graph computed from Python): {entry['decode_us']:.2f} µs per call with "
                  f"{args.threads} thread(s), {entry['decode_us_1_thread']:.2f} µs with 1")
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

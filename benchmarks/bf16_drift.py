"""The drift of a bfloat16 state against a float32 one over a long decode: every example with a decode step.

    python benchmarks/bf16_drift.py [--tokens 32768] [--heads 4] [--dims 64,128] [--backend c] [--markdown]

For each example whose decode state is a fixed-size recurrent state (causal, with a recurrent form), the same
random float32 tokens (rec.random_inputs: the declared ranges, unit-scale values, decays as the file draws
them) run through the bound decode step twice from a zero state: once with the state in float32, once with
state_dtype="bfloat16" (the state rounded to bfloat16 after every token, accumulated in float32 inside the
step). Printed per example: the largest relative error of the outputs over all tokens (max |o_bf16 − o_f32|
/ max |o_f32|), the same of the final state, and how much the float32 state grew (max |S_T| / max |S_64|:
≫ 1 where nothing decays, as in the linear transformer, whose state is a running sum).
--dims D,D…: run every file at each head dimension D in turn (dk = dv = D, as `linrec bench` presets them; the
file's other sizes, Performer's m, as it declares them); without it, at the file's own sizes.
The table in docs/serving.md ("A bfloat16 state") is this script's output.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import linrec
from linrec import arrays
from linrec.decode import reads_the_sequence
from linrec.dim_option import dims_with_overrides

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EARLY = 64  # the state's size after this many tokens: what "grew" compares the final state with


def decodes(rec) -> bool:
    return rec.program.causal and "recurrent" in rec.forms and not reads_the_sequence(rec)


def decode(rec, x: dict, backend: str, state_dtype) -> tuple[dict, dict, dict]:
    """The bound decode step over every token of x ([1, T, H, *]): (outputs [1, T, H, *], the state after
    EARLY tokens and the final state, both as float32 arrays at their true scale)."""
    tokens = next(iter(x.values())).shape[1]
    buffer = {k: v[:, 0].copy() for k, v in x.items()}  # (a copy: with B = 1 the slice may be a view of x)
    first = rec.prefill({k: v[:, :1] for k, v in x.items()}, backend=backend, state_dtype=state_dtype)
    state = {k: np.zeros_like(v) for k, v in first.final_state.items()}
    for key in state:
        if key.endswith(".log_scale"):  # (a stabilized state starts at its true scale)
            state[key][...] = np.nan
    step = rec.bind_step(buffer, state, backend=backend, state_dtype=state_dtype)
    outputs, early = None, None
    for t in range(tokens):
        for k, v in x.items():
            buffer[k][...] = v[:, t]
        out = step()
        if outputs is None:
            outputs = {k: np.empty((v.shape[0], tokens) + v.shape[1:], v.dtype) for k, v in out.items()}
        for k, v in out.items():
            outputs[k][:, t] = v
        if t + 1 == EARLY:
            early = true_state(rec, state)
    return outputs, early, true_state(rec, state)


def true_state(rec, state: dict) -> dict:
    """float32 values of the program's states at their true scale (bfloat16 bits widened)."""
    wide = {k: arrays.from_bfloat16(v) if v.dtype == np.uint16 else np.array(v) for k, v in state.items()}
    return linrec.decode.at_true_scale(rec, wide)


def relative(got: np.ndarray, ref: np.ndarray) -> float:
    scale = float(np.max(np.abs(ref)))
    return float(np.max(np.abs(got.astype(np.float64) - ref))) / scale if scale > 0 else float("nan")


def drift(path: Path, tokens: int, heads: int, backend: str, seed: int, head_dim: int | None = None) -> dict | None:
    """The drift of one file (None: no fixed-size decode state); head_dim: dk = dv = head_dim."""
    rec = linrec.load(path)
    if not decodes(rec):
        return None
    dims = dims_with_overrides(rec.program, [], {"dk": head_dim, "dv": head_dim} if head_dim else None)
    x = rec.random_inputs(batch=1, tokens=tokens, heads=heads, dims=dims, dtype=np.float32, seed=seed)
    start = time.perf_counter()
    out32, early32, final32 = decode(rec, x, backend, None)
    out16, _, final16 = decode(rec, x, backend, "bfloat16")
    states = [s.name for s in rec.program.states]
    return dict(
        name=rec.name, file=path.name,
        outputs=max(relative(out16[k], out32[k]) for k in out32),
        state=max(relative(final16[s], final32[s]) for s in states),
        grew=max(float(np.max(np.abs(final32[s])) / max(np.max(np.abs(early32[s])), 1e-30)) for s in states),
        dims=", ".join(f"{name}={size}" for name, size in dims.items()),
        seconds=time.perf_counter() - start)


def head_dims(text: str) -> list[int]:
    """--dims 64,128: positive sizes, comma-separated."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive head dimensions separated by commas, e.g. 64,128")
    return sizes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--backend", default="c", choices=("c", "numpy"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dims", type=head_dims, metavar="D[,D…]",
                        help="head dimensions to run each file at, dk = dv = D (default: the files' sizes)")
    parser.add_argument("--markdown", action="store_true", help="the table as docs/serving.md shows it")
    parser.add_argument("files", nargs="*", help="program files (default: every example)")
    args = parser.parse_args(argv)
    files = [Path(f) for f in args.files] or sorted(EXAMPLES.glob("*.lin"))
    rows, skipped = [], []
    for path in files:
        for head_dim in args.dims or [None]:
            try:
                row = drift(path, args.tokens, args.heads, args.backend, args.seed, head_dim)
            except linrec.LinrecError as err:  # (a missing or wrong program: its message, not a traceback)
                parser.error(str(err))
            if row is None:
                skipped.append(path.stem)
                break
            rows.append(row)
            print(f"{row['name']} ({row['dims']}): {row['seconds']:.1f} s", file=sys.stderr)
    sizes = f"dk = dv = {', '.join(map(str, args.dims))}" if args.dims else "the files' sizes"
    print(f"T = {args.tokens} decode steps, B = 1, H = {args.heads}, {sizes}, {args.backend} backend, "
          f"seed {args.seed}; relative to the float32-state decode")
    if args.markdown:
        print("\n| example | sizes | outputs: max rel. error | final state: max rel. error | float32 state grew |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['name']} | {r['dims']} | {r['outputs']:.1e} | {r['state']:.1e} | {r['grew']:.1f}× |")
    else:
        print(f"{'example':<20} {'sizes':<24} {'outputs':>10} {'state':>10} {'grew':>10}")
        for r in rows:
            print(f"{r['name']:<20} {r['dims']:<24} {r['outputs']:10.2e} {r['state']:10.2e} {r['grew']:9.1f}x")
    if skipped:
        print(f"no fixed-size decode state (non-causal, or reads the sequence): {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

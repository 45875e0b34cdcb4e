#!/usr/bin/env python3
"""Train small models on multi-query associative recall (MQAR, from the Zoology study of efficient
architectures), one per LAYERS argument, on the CPU; then decode with each trained model token by token and
compare the memory of its states with the KV cache of an all-softmax model.

    python examples/train_recall.py examples/gla.lin
    python examples/train_recall.py examples/gla.lin examples/gla.lin,examples/gla.lin,examples/softmax.lin \
        --steps 400 --plot recall.png

Each LAYERS argument is one model: a .lin file (--depth layers of it, default 2), or a comma-separated list of
them, one per layer (a hybrid).
A model is an embedding, then per layer a linear projection into the program's inputs, the program (a
linrec.torch.Layer, its params trained), a projection back and an MLP (both residual, pre-norm), then a head.
How the projection maps onto the inputs comes from the program's declarations only: an input's shape gives its
width, its declared range its map (`in (a, b)`: a sigmoid into it, `> a`: a softplus, `<= b`: a log-sigmoid,
none: as it is). See docs/torch.md, "Training on associative recall".
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

import linrec
import linrec.torch as lt
from linrec.compiler import ir
from linrec.compiler.analysis import walk
from linrec.decode import reads_the_sequence

SOFTMAX = Path(__file__).with_name("softmax.lin")  # the all-softmax baseline of the memory comparison
LONG_CONTEXT = 32768  # tokens at which the memory is compared
# an input bounded above only is a log-decay in every shipped program; 1/16 of a log-sigmoid keeps exp(g) near
# 1 when training starts (GLA's normalizer), so the first steps do not forget the context within a few tokens
UPPER_BOUND_SCALE = 1 / 16
# an input bounded below only starts near its bound, softplus(−4) ≈ 0.02 above it: in the shipped programs it is
# a step size (Mamba-2's dt, which Mamba initializes in [0.001, 0.1]); at softplus(0) ≈ 0.69 times A in
# [−16, −1] a layer forgets within a few tokens, and a model of them stayed at chance (docs/torch.md)
LOWER_BOUND_SHIFT = -4.0
OPEN_MARGIN = 1e-4  # an open bound is kept this far off: sigmoid and softplus round onto it in float32


@dataclass
class Task:
    """MQAR: `pairs` key-value pairs, then every key again (in a random order, at random places) followed by
    its value. The model predicts the token after each queried key: its value. Keys are tokens
    [1, vocab/2), values [vocab/2, vocab), 0 fills the gaps."""

    vocab: int = 64
    tokens: int = 64
    pairs: int = 8

    def batch(self, size: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [size, T], targets [size, T]: a query's value, -100 where nothing is asked)."""
        half = self.vocab // 2
        slots = (self.tokens - 2 * self.pairs) // 2  # places for a query and its answer after the context
        if slots < self.pairs or half - 1 < self.pairs:
            raise SystemExit(f"error: {self.pairs} pairs need T >= {4 * self.pairs} and vocab >= {2 * self.pairs + 2}")
        x = np.zeros((size, self.tokens), np.int64)
        y = np.full((size, self.tokens), -100, np.int64)
        for row in range(size):
            keys = rng.choice(np.arange(1, half), self.pairs, replace=False)
            values = rng.integers(half, self.vocab, self.pairs)
            x[row, 0:2 * self.pairs:2], x[row, 1:2 * self.pairs:2] = keys, values
            order = rng.permutation(self.pairs)
            places = 2 * self.pairs + 2 * np.sort(rng.choice(slots, self.pairs, replace=False))
            x[row, places], x[row, places + 1] = keys[order], values[order]
            y[row, places] = values[order]
        return torch.from_numpy(x), torch.from_numpy(y)


def input_map(declared: ir.Input):
    """The map from a projection onto the input's declared range (docs/dsl.md, input ranges)."""
    low, high = declared.low, declared.high
    if low is None and high is None:
        return lambda t: t
    if low is not None and high is not None:
        lo = low + OPEN_MARGIN * (high - low) * declared.low_open
        hi = high - OPEN_MARGIN * (high - low) * declared.high_open
        return lambda t: (low + (high - low) * torch.sigmoid(t)).clamp(lo, hi)
    if low is not None:
        margin = OPEN_MARGIN if declared.low_open else 0.0
        return lambda t: low + margin + nn.functional.softplus(t + LOWER_BOUND_SHIFT)
    margin = OPEN_MARGIN if declared.high_open else 0.0
    return lambda t: high - margin + UPPER_BOUND_SCALE * nn.functional.logsigmoid(t)


class Mixer(nn.Module):
    """One linrec layer: a projection into the program's inputs [B, T, H, *], the program, and a projection of
    its outputs back to the model's width."""

    def __init__(self, path: str, d_model: int, heads: int, dims: dict[str, int], backend: str):
        super().__init__()
        rec = linrec.load(path)
        declared = {d.name for d in rec.program.dims}
        self.layer = lt.Layer(rec, heads=heads, dims={k: v for k, v in dims.items() if k in declared},
                              backend=backend)
        sizes = {d.name: self.layer.dims.get(d.name, d.default) for d in rec.program.dims}
        self.heads = heads
        self.shapes = {x.name: tuple(sizes[d] for d in x.shape) for x in rec.program.inputs}
        self.maps = {x.name: input_map(x) for x in rec.program.inputs}
        widths = [heads * math.prod(shape) for shape in self.shapes.values()]
        self.into = nn.Linear(d_model, sum(widths))
        self.widths = widths
        out = sum(heads * math.prod(sizes[d] for d in o.value.shape) for o in rec.program.outputs)
        self.back = nn.Linear(out, d_model)

    def forward(self, h: torch.Tensor, state: dict | None = None):
        batch, tokens = h.shape[:2]
        given = {}
        for (name, shape), part in zip(self.shapes.items(), self.into(h).split(self.widths, dim=-1)):
            given[name] = self.maps[name](part.reshape(batch, tokens, self.heads, *shape))
        o, state = self.layer(**given, state=state)
        outputs = [o] if isinstance(o, torch.Tensor) else list(o.values())
        return self.back(torch.cat([t.reshape(batch, tokens, -1) for t in outputs], dim=-1)), state


class Block(nn.Module):
    def __init__(self, path: str, d_model: int, heads: int, dims: dict[str, int], backend: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.mixer = Mixer(path, d_model, heads, dims, backend)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, h: torch.Tensor, state: dict | None = None):
        mixed, state = self.mixer(self.norm1(h), state)
        h = h + mixed
        return h + self.mlp(self.norm2(h)), state


class Model(nn.Module):
    def __init__(self, paths: list[str], vocab: int, d_model: int, heads: int, dims: dict[str, int],
                 positions: int, backend: str = "c"):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        # learned absolute positions (as Zoology's models have): softmax attention has no other sense of order
        self.position = nn.Embedding(positions, d_model)
        self.blocks = nn.ModuleList(Block(p, d_model, heads, dims, backend) for p in paths)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor, states: list | None = None, start: int = 0):
        """Logits [B, T, vocab] and each layer's state (its recurrent state, or a softmax layer's KV cache).
        With `states`, the tokens continue from them (one token: the decode step) at position `start`."""
        h = self.embed(x) + self.position(torch.arange(start, start + x.shape[1]))
        new = []
        for block, state in zip(self.blocks, states or [None] * len(self.blocks)):
            h, state = block(h, state)
            new.append(state)
        return self.head(self.norm(h)), new


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    asked = y != -100
    return float((logits.argmax(-1)[asked] == y[asked]).float().mean())


def progress(step: int, steps: int, loss: float, acc: float, seconds: float) -> None:
    width = 30
    done = width * step // steps
    line = f"  [{'#' * done}{'.' * (width - done)}] {step}/{steps} loss {loss:.3f} acc {acc:.3f} {seconds:.0f}s"
    if sys.stdout.isatty():
        print("\r" + line, end="" if step < steps else "\n", flush=True)
    elif step == steps or step % max(1, steps // 10) == 0:
        print(line, flush=True)


def one_cycle(optimizer, lr: float, steps: int):
    """OneCycleLR over the run: a tenth of the steps warming up, at least one and a half. Each of its two
    phases needs a length above 0 (its warm-up ends at pct_start · steps − 1: at 10 steps of 0.1, step 0, and it
    divided by zero); a run of one step takes the first step of a two-step cycle."""
    total = max(steps, 2)
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total, pct_start=max(0.1, 1.5 / total))


def train(model: Model, task: Task, steps: int, batch: int, lr: float, seed: int, evals: int = 10,
          show: bool = True) -> dict:
    """AdamW on fresh batches; the accuracy on a fixed held-out set every steps/evals steps. Returns the
    losses, the accuracy curve [(step, acc)], the final accuracy and the seconds taken."""
    rng = np.random.default_rng(seed)
    held_x, held_y = task.batch(256, np.random.default_rng(seed + 10_000))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    schedule = one_cycle(optimizer, lr, steps)
    losses, curve = [], []
    start = time.perf_counter()

    def evaluate() -> float:
        with torch.no_grad():
            return accuracy(model(held_x)[0], held_y)

    acc = evaluate()
    curve.append((0, acc))
    for step in range(1, steps + 1):
        x, y = task.batch(batch, rng)
        logits, _ = model(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step == steps or step % max(1, steps // evals) == 0:
            acc = evaluate()
            curve.append((step, acc))
        if show:
            progress(step, steps, losses[-1], acc, time.perf_counter() - start)
    return {"losses": losses, "curve": curve, "accuracy": curve[-1][1], "seconds": time.perf_counter() - start}


def decode_difference(model: Model, x: torch.Tensor) -> float:
    """The largest difference between the logits of one forward pass over x and of decoding x token by token
    (the decode step: each layer's recurrent state, or a softmax layer's KV cache)."""
    with torch.no_grad():
        full, _ = model(x)
        states, steps = None, []
        for t in range(x.shape[1]):
            logits, states = model(x[:, t:t + 1], states, start=t)
            steps.append(logits)
        return float((torch.cat(steps, dim=1) - full).abs().max())


def cached_inputs(program: ir.Program) -> set[str]:
    """The inputs a program reads through seq(…): what its KV cache must hold (named values followed back)."""
    lets = {s.name: s.value for s in program.steps if isinstance(s, ir.Let)}
    found: set[str] = set()

    def inputs_of(expr: ir.Expr) -> None:
        for node in walk(expr):
            if isinstance(node, ir.InputRef):
                found.add(node.name)
            elif isinstance(node, ir.LetRef) and node.name in lets:
                inputs_of(lets[node.name])

    for step in program.steps:
        for node in walk(step.value):
            if isinstance(node, ir.Apply) and node.function == "seq":
                inputs_of(node)
    return found


def layer_memory(layer: lt.Layer, tokens: int, bytes_per_value: int = 4) -> int:
    """Bytes of one sequence's decode state after `tokens` tokens: the recurrent states (fixed), or for a
    program that reads the sequence the KV cache of the inputs it reads through seq (window: at most that)."""
    program = layer.rec.program
    sizes = {d.name: layer.dims.get(d.name, d.default) for d in program.dims}
    if not reads_the_sequence(layer.rec):
        return sum(layer.heads * math.prod(sizes[d] for d in s.shape) for s in program.states) * bytes_per_value
    window = layer.rec.decomposition.sequence.window
    kept = min(tokens, int(window)) if window else tokens
    per_token = sum(layer.heads * math.prod(sizes[d] for d in x.shape)
                    for x in program.inputs if x.name in cached_inputs(program))
    return kept * per_token * bytes_per_value


def megabytes(n: int) -> str:
    """Bytes as KB, MB or GB (binary)."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KB"


def run_model(spec: str, args, show: bool = True) -> dict:
    paths = [p.strip() for p in spec.split(",") if p.strip()]
    if len(paths) == 1:  # one file: a model of --depth layers of it (recall needs two: one finds, one reads)
        paths = paths * args.depth
    torch.manual_seed(args.seed)
    task = Task(args.vocab, args.tokens, args.pairs)
    dims = {"dk": args.dk, "dv": args.dk}
    model = Model(paths, task.vocab, args.d_model, args.heads, dims, task.tokens, args.backend)
    label = " + ".join(linrec.load(p).name for p in paths)
    print(f"{label}: {sum(p.numel() for p in model.parameters())} parameters")
    result = train(model, task, args.steps, args.batch, args.lr, args.seed, show=show)
    x, _ = task.batch(2, np.random.default_rng(args.seed + 20_000))
    result["decode"] = decode_difference(model, x)
    layers = [block.mixer.layer for block in model.blocks]
    result["memory"] = sum(layer_memory(layer, LONG_CONTEXT) for layer in layers)
    softmax = [lt.Layer(SOFTMAX, heads=args.heads, dims=dims) for _ in layers]
    result["softmax_memory"] = sum(layer_memory(layer, LONG_CONTEXT) for layer in softmax)
    print(f"  accuracy {result['accuracy']:.3f} after {args.steps} steps ({result['seconds']:.0f} s); decode step "
          f"vs forward: max |difference| of the logits {result['decode']:.2e}; decode state at {LONG_CONTEXT} "
          f"tokens {megabytes(result['memory'])} (all-softmax KV cache {megabytes(result['softmax_memory'])})")
    result["label"], result["model"] = label, model
    return result


def table(results: list[dict], args) -> str:
    rows = ["| model | layers | steps | accuracy | train time | decode vs forward | state at 32k tokens | "
            "vs all-softmax KV cache |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['label']} | {len(r['model'].blocks)} | {args.steps} | {r['accuracy']:.3f} | "
                    f"{r['seconds']:.0f} s | {r['decode']:.1e} | {megabytes(r['memory'])} | "
                    f"{r['memory'] / r['softmax_memory']:.2%} |")
    return "\n".join(rows)


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib: pip install 'linrec[bench]' (or matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        steps, accs = zip(*r["curve"])
        ax.plot(steps, accs, label=r["label"], marker=".")
    ax.set_xlabel("training step")
    ax.set_ylabel("MQAR accuracy (held out)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def step_count(text: str) -> int:
    """--steps: a whole number of at least one step."""
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number of steps") from None
    if steps < 1:
        raise argparse.ArgumentTypeError(f"{steps} steps: give at least 1")
    return steps


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layers", nargs="+", metavar="LAYERS",
                   help="a model: one .lin file, or a comma-separated list of them, one per layer (a hybrid); "
                        "several LAYERS train several models")
    p.add_argument("--steps", type=step_count, default=300, help="training steps per model (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="OUT.png", help="draw the held-out accuracy per model (needs matplotlib)")
    p.add_argument("--depth", type=int, default=2, help="layers of a model given as one file (default 2)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dk", type=int, default=16, help="the programs' dk and dv, where they declare them")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64, help="sequence length")
    p.add_argument("--pairs", type=int, default=8, help="key-value pairs per sequence")
    p.add_argument("--backend", default="c",
                   help="the layers' backend (default c): the forward runs on it, and so does the backward where "
                        "it builds it, else the backward runs on NumPy (docs/torch.md, Gradients)")
    p.add_argument("--threads", type=int, default=1,
                   help="PyTorch's threads (default 1: its ops here are tiny, and more threads contend)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    for spec in args.layers:
        for path in spec.split(","):
            if not Path(path.strip()).is_file():
                raise SystemExit(f"error: no such program file '{path.strip()}' in LAYERS '{spec}'")
            if not linrec.load(path.strip()).program.causal:  # (refused before any training, not after it)
                raise SystemExit(f"error: {path.strip()} is non-causal: its outputs read the whole sequence, later "
                                 f"tokens included, so a model of it sees the answers it is trained to predict and "
                                 f"cannot decode token by token; give causal programs")
    results = [run_model(spec, args) for spec in args.layers]
    print(f"\nMQAR: T = {args.tokens}, {args.pairs} pairs, vocab {args.vocab}; d_model {args.d_model}, "
          f"{args.heads} heads, dk = dv = {args.dk}; {args.steps} steps of batch {args.batch}, seed {args.seed}\n")
    print(table(results, args))
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    try:
        main()
    except linrec.LinrecError as err:
        raise SystemExit(str(err)) from None

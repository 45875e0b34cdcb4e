"""A seeded fuzzer for linrec: random programs over the grammar, and what must hold for each of them.

    gen = ProgramGenerator(seed)           # one stream of programs per seed, the same on every machine
    source = gen.program()                 # mostly programs `check` accepts: recurrences and attention
    source = gen.mutant()                  # an example file (examples/*.lin) with a few random edits
    failures = exercise(source, backends=("numpy",))   # [] when everything below holds

What `exercise` asserts of a program (each violation is a Failure with a class and a message):

* compiling it raises nothing but LinrecError, and a rejection carries a source location (a span);
* `linrec check`'s report (cli.describe, format_check) is made without an internal error;
* every form the report lists as available, on every backend it lists that is asked for, runs on valid
  inputs (rec.random_inputs: declared ranges respected; params without a default drawn, see _draw_params)
  and agrees with the float64 reference form (verify.reference_form) within verify's float64 tolerance —
  on a backend other than NumPy from arrays that start off a 64-byte boundary (_off_a_line);
  so do the decode step (token by token, on each backend that builds the recurrent form) and form="auto";
* with `gradients` (a sample of the programs, see _gradients): every gradient form `check` lists on NumPy
  agrees with NumPy's recurrent backward (verify_grad's reference form where there is none) within verify's
  gradient tolerance (1e-9), that reference agrees with central differences of the float64 forward
  (verify_grad.directional_errors, 1e-6), and every gradient form listed on another backend asked for agrees
  with NumPy's; a program whose gradient `check` refuses is refused by `vjp` with a LinrecError;
* with `serving` (a sample): what a serving engine asks of a program (verify.serving_rows: the checkpoints of
  state_every, the states of keep_last, packed sequences under cu_seqlens, the slot-pool decode step) agrees
  with the float64 reference form run on its own, on every backend asked for and every form check lists there,
  and nothing it needs is refused;
* with `through_torch` (a sample, where torch is installed): linrec.torch.apply on each backend asked for gives
  the reference form's outputs and final states, and autograd's gradients of a random weighting of them (with
  respect to the inputs, the initial states and every param) are NumPy's `vjp` of the same weights;
* nothing takes longer than a time limit (signal.setitimer: a hang is a failure, not a stuck test run).

The programs are small (dk ≤ 5, dv ≤ 4, the examples' 16 in mutants), where every C kernel is a partial
register; `--model-sizes-every N` runs one C program in N at a model's head sizes instead (at_model_sizes:
dk, dv from 64 to 200), where the kernels tile, block and split the state as they will in a model.

Run it longer than the test suite does with `python -m pytest tests/test_fuzz.py --fuzz-programs 20000`
(see tests/README.md), or from here: `python tests/fuzzing.py 20000 --c 200` prints the failure classes
(gradients of every program there, on C of every C one: --grad-every, --grad-c to thin them).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import random
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import linrec
from linrec import cli, decode, verify, verify_grad
from linrec.c import chain_rows
from linrec.c.buffers import aligned_empty
from linrec.dsl.errors import LinrecError, RuntimeInputError

TORCH = importlib.util.find_spec("torch") is not None  # (linrec[torch]: _through_torch runs only with it)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOLERANCE = verify.TOLERANCE["float64"]


# ---- the programs --------------------------------------------------------------------------------------
@dataclass
class _Names:
    """What a program under construction has declared so far, by kind."""

    vectors_k: list       # per-token vectors over dk (q, k and derived ones)
    vectors_v: list       # per-token vectors over dv
    scalars: list         # per-token scalars
    gates: list           # per-token log-decays ≤ 0 over dk
    params: dict          # name → (shape, per_head)
    functions: list       # user functions of one argument


class ProgramGenerator:
    """Random programs from one seed. Biased towards programs `check` accepts: shapes are tracked, every
    state is updated once, linear in itself; a few programs carry deliberate oddities (constants folded at
    compile time, named constants, states that only decay or are never read, windows, sizes of 1)."""

    FEATURE_MAPS = ["elu(x) + 1", "relu(x)", "exp(x)", "sigmoid(x)", "l2norm(x)", "softplus(x)", "x*x",
                    "silu(x) + 2", "exp(x − norm(x)^2/2)", "abs(x) + 0.5", "rmsnorm(x)"]

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.count = 0

    # -- helpers --
    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def pick(self, items):
        return self.rng.choice(list(items))

    def number(self) -> str:
        return self.pick(["0.5", "2", "0.9", "1", "0.25", "3", "1e-3", "0.1", "1.5", "0"])

    # -- whole programs --
    def program(self) -> str:
        self.count += 1
        text = self.attention_program() if self.chance(0.12) else self.recurrence()
        return self.spelled(text)

    def spelled(self, text: str) -> str:
        """The same program in other spellings now and then: ASCII operators, comments, continued lines."""
        if self.chance(0.1):
            text = text.replace("·", "@").replace("−", "-").replace("≤", "<=")
        lines = text.splitlines()
        if self.chance(0.1):
            i = self.rng.randrange(len(lines))
            lines[i] += "   # a comment: · ⊗ − */ \\"
        if self.chance(0.05):
            i = self.rng.randrange(1, len(lines))
            if " + " in lines[i]:
                lines[i] = lines[i].replace(" + ", " + \\\n    ", 1)
        return "\n".join(lines) + "\n"

    def header(self, dims: dict, causal: bool) -> str:
        text = ", ".join(f"{d} = {n}" for d, n in dims.items())
        return f"recurrence fz{self.count}({text})" + ("" if causal else self.pick([" noncausal", " noncausal"]))

    def recurrence(self) -> str:
        r = self.rng
        dims = {"dk": r.choice([1, 2, 3, 4, 5]), "dv": r.choice([1, 2, 3, 4])}
        if self.chance(0.2):
            dims["m"] = r.choice([2, 3, 6])
        causal = not self.chance(0.15)
        lines = [self.header(dims, causal)]
        names = _Names(["q", "k"], ["v"], [], [], {}, [])
        lines.append("input q[dk], k[dk], v[dv]")
        # scalar inputs with and without ranges
        for name in ("a", "beta", "dt"):
            if self.chance(0.45):
                rng_text = self.pick(["", " <= 0", " < 0", " > 0", " in (0, 1)", " in [0.5, 1]", " >= 0",
                                      " in (-1, 0)", " in (-2, 3)"])
                lines.append(f"input {name}{rng_text}")
                names.scalars.append(name)
        if self.chance(0.45):
            lines.append("input g[dk]" + self.pick([" <= 0", " < 0", "", " in (-1, 0)", " >= 0"]))
            names.gates.append("g")
        if self.chance(0.15):
            lines.append("input x[dv]")
            names.vectors_v.append("x")
        # params
        for i in range(r.choice([0, 0, 1, 1, 2, 3])):
            lines.append(self.param(f"p{i}", dims, names))
        if self.chance(0.1):
            lines.append(f"param M[dk, dk]{self.pick([' = randn(std=0.3, seed=5)', ''])}")
            names.params["M"] = (("dk", "dk"), False)
        if "m" in dims and self.chance(0.7):
            default = self.pick([" = random_features(seed=0)", " = randn(seed=3, std=0.3)", "",
                                 " = random_features(seed=1, orthogonal=0)"])
            lines.append(f"param W[m, dk]{default}")
            names.params["W"] = (("m", "dk"), False)
        # user functions and named values
        if self.chance(0.5):
            body = self.pick(self.FEATURE_MAPS)
            lines.append(f"phi(x) = {body}")
            names.functions.append("phi")
        if self.chance(0.1):  # a function of two arguments
            lines.append("gate(x, y) = x*sigmoid(y)")
            lines.append("kg = gate(k, q)")
            names.vectors_k.append("kg")
        if self.chance(0.4):
            lines.append("kn = " + self.pick(["l2norm(k)", "k/norm(k)", "k", "phi(k)" if names.functions else "k"]))
            names.vectors_k.append("kn")
        if self.chance(0.2):
            lines.append("qn = " + self.pick(["l2norm(q)", "dk^(−1/2)·q", "q*2", "tanh(q)"]))
            names.vectors_k.append("qn")
        if self.chance(0.12):  # named constants and values of params only
            lines.append("c = " + self.pick(["0.5", "dk", "dk^(−1/2)", "2·dv", "exp(−1)"] +
                                            [p for p, (s, _) in names.params.items() if not s]))
            names.scalars.append("c")
        # states and their updates, outputs around them
        states = []
        if not self.chance(0.1):
            states.append(("S", ("dk", "dv")))
        if self.chance(0.3 if states else 1.0):
            states.append(("z", ("dk",)))
        if self.chance(0.15):
            states.append(("w", ("dv",)))
        if self.chance(0.08):
            states.append(("R", ("dv", "dk")))
        if "W" in names.params and self.chance(0.6):  # random features: a state over m, FAVOR+-style
            states.append(("P", ("m", "dv")))
        lines.append("state " + ", ".join(f"{s}[{', '.join(shape)}]" for s, shape in states))
        body, outputs = [], []
        for s, shape in states:
            if self.chance(0.25):
                outputs.append(self.output(len(outputs), states, names, before=True))
                body.append(outputs[-1])
            body.append(f"{s} = {self.update(s, shape, names)}")
            if self.chance(0.15):  # updates in steps: each assignment sees the one before it
                if self.chance(0.3):
                    outputs.append(self.output(len(outputs) + len(body), states, names, before=True))
                    body.append(outputs[-1])
                body.append(f"{s} = {self.next_step(s, shape, names)}")
        for _ in range(r.choice([1, 1, 1, 2, 3])):
            body.append(self.output(len(outputs) + len(body), states, names, before=False))
        if not any(b.startswith("output") for b in body):
            body.append(self.output(99, states, names, before=False))
        if self.chance(0.2) and len(body) > 2:  # statement order matters: shuffle a pair
            i = r.randrange(len(body) - 1)
            body[i], body[i + 1] = body[i + 1], body[i]
        return "\n".join(lines + body) + "\n"

    def param(self, name: str, dims: dict, names: _Names) -> str:
        shape = self.pick([(), (), ("dk",), ("dv",)])
        per_head = self.chance(0.5)
        choices = [" = randn(seed=1)", " = randn(std=0.1, seed=2)", " = uniform(0.5, 1, seed=0)",
                   " = uniform(seed=4)", " = 0.9", " = dk^(−1/2)", " = log(uniform(1, 16, seed=0))", "",
                   " = 1 − 2^(−5 − h)" if per_head else " = 0.5"]
        earlier = [p for p, (s, ph) in names.params.items() if (s == shape or not s) and (per_head or not ph)]
        if earlier:
            other = self.pick(earlier)
            choices += [f" = −exp({other})", f" = sigmoid({other})", f" = {other}*2"]
        if self.chance(0.03):  # constants that fold to something impossible
            choices = [" = 1e999", " = dk^1000", " = 1/0", " = (0.1 − dk)^0.5", " = log(0)", " = sqrt(−1)",
                       " = exp(1000)", " = 0/0"]
        default = self.pick(choices)
        names.params[name] = (shape, per_head)
        return f"param {name}{'[' + ', '.join(shape) + ']' if shape else ''}{' per head' if per_head else ''}{default}"

    # -- expressions --
    def key(self, names: _Names) -> str:
        k = self.pick(names.vectors_k)
        choices = [k, f"{k}", f"phi({k})" if names.functions else k, f"{self.pick(names.scalars)}·{k}"
                   if names.scalars else k, f"sigmoid({k})", f"{self.number()}·{k}",
                   f"{k}*sigmoid(q)^(1 + tanh({k}))"]  # an elementwise power with a vector exponent
        square = [p for p, (s, _) in names.params.items() if s == ("dk", "dk")]
        if square and self.chance(0.4):
            depth = self.rng.choice([1, 2, 3, 6, 30])
            return "·(".join([square[0]] * depth) + f"·{k}" + ")" * (depth - 1)
        return self.pick(choices)

    def write(self, names: _Names) -> str:
        """key⊗value (⊗ binds like · and *, left to right: compound operands go in parentheses)."""
        return f"{_operand(self.key(names))}⊗{_operand(self.value(names))}"

    def value(self, names: _Names) -> str:
        v = self.pick(names.vectors_v)
        return self.pick([v, v, f"{self.number()}*{v}", f"tanh({v})", f"sin({v})",
                          f"{self.pick(names.scalars)}·{v}" if names.scalars else v])

    def scalar_decay(self, names: _Names) -> str:
        choices = ["0.9", "0.5", "1"]
        for a in names.scalars:
            # (a and tanh(a): decays of either sign, which the forms take with their signs apart)
            choices += [f"exp({a})", f"sigmoid({a})", a, f"exp(−softplus({a}))", f"1 − sigmoid({a})", f"tanh({a})"]
        for p, (s, _) in names.params.items():
            if not s:
                choices += [p, f"exp({p})", f"sigmoid({p})"]
        return self.pick(choices)

    def diagonal(self, names: _Names) -> str | None:
        choices = []
        for g in names.gates:
            choices += [f"exp({g})", f"sigmoid({g})", f"exp({g})*0.5", f"tanh({g})"]  # (tanh(g): in (−1, 0])
        for p, (s, _) in names.params.items():
            if s == ("dk",):
                choices += [f"exp(−abs({p}))", f"sigmoid({p})", p]
        choices.append("sigmoid(k)")
        return self.pick(choices)

    def features(self, x: str) -> str:
        """A random-feature map of x through W[m, dk] (Performer's exponential one, and others)."""
        return self.pick([f"exp(W·{x} − norm({x})^2/2)", f"relu(W·{x})", f"exp(W·{x})", f"sigmoid(W·{x})"])

    def update(self, s: str, shape: tuple, names: _Names) -> str:
        if shape == ("dk", "dv"):
            return self.matrix_update(s, names)
        if shape == ("m", "dv"):
            decay = self.pick(["", "", "0.9·", "sigmoid(beta)·" if "beta" in names.scalars else ""])
            self.feature_map = self.pick([self.features("k"), self.features("k")])
            return f"{decay}{s} + ({self.feature_map.replace('k', 'k')})⊗{_operand(self.value(names))}"
        if shape == ("dv", "dk"):  # the transposed convention: multiplied and read from the right
            beta = self.pick(names.scalars) if names.scalars else "0.5"
            kn = self.pick(names.vectors_k)
            return self.pick([f"{s}·(I − {beta}·{kn}⊗{kn}) + {beta}·v⊗{kn}", f"{s} + v⊗k",
                              f"{s}·diag(exp(−abs(k))) + v⊗k"])
        over_k = shape == ("dk",)
        vec = self.key(names) if over_k else self.value(names)
        decay = self.pick([None, "scalar", "diag", "diag", "right", "identity"])
        if decay is None:
            base = s
        elif decay == "scalar":
            base = f"{_operand(self.scalar_decay(names))}·{s}"
        elif decay == "identity":
            base = s if not self.chance(0.3) else f"1·{s}"
        else:
            d = self.diagonal(names) if over_k else self.pick(["sigmoid(v)", "exp(−abs(v))"])
            base = f"{d}*{s}" if decay == "diag" else f"{s}·diag({d})"
        if self.chance(0.06):
            return self.pick([s, base])  # a state that only decays (or is left as it is)
        if self.chance(0.15) and names.scalars:
            a = self.pick(names.scalars)
            return f"sigmoid({a})·{s} + (1 − sigmoid({a}))·{vec}"
        if self.chance(0.08):  # the same value added to every element (a probe's find: tests/test_scalar_writes.py)
            vec = self.pick(names.scalars + [self.number(), "1/dk" if over_k else "1/dv"])
        return f"{base} + {vec}"

    def next_step(self, s: str, shape: tuple, names: _Names) -> str:
        """A further assignment of a state already assigned in this token (linear in it)."""
        kn = self.pick(names.vectors_k)
        choices = [f"0.5·{s}", f"{s}"]
        if shape == ("dk", "dv"):
            choices += [f"{s} + {self.write(names)}", f"{s} − 0.5·{kn}⊗({kn}·{s})", f"{s}·diag(sigmoid(v))",
                        f"{s} + 0.5·{kn}⊗(v − {kn}·{s})"]
        elif shape == ("dk",):
            choices += [f"{s} + {self.key(names)}", f"sigmoid(k)*{s}"]
        elif shape == ("dv",):
            choices += [f"{s} + {self.value(names)}"]
        return self.pick(choices)

    def matrix_update(self, s: str, names: _Names) -> str:
        kn = self.pick(names.vectors_k)
        beta = self.pick(names.scalars) if names.scalars and self.chance(0.7) else "0.5"
        kind = self.pick(["identity", "scalar", "scalar", "diag", "diag", "value", "both", "elementwise",
                          "dense", "none"])
        if kind == "identity":
            base = s
        elif kind == "scalar":
            base = f"{_operand(self.scalar_decay(names))}·{s}"
        elif kind == "diag":
            base = f"diag({self.diagonal(names)})·{s}"
        elif kind == "value":
            base = f"{s}·diag(sigmoid(v))"
        elif kind == "both":
            base = f"diag({self.diagonal(names)})·{s}·diag(exp(−abs(v)))"
        elif kind == "elementwise":  # Mamba-1's selective scan: an elementwise decay of the matrix
            base = f"exp(−(abs(k)⊗abs(v)))*{s}"
        elif kind == "dense":
            params = [p for p, (sh, _) in names.params.items() if sh == ("dk", "dk")]  # M
            base = f"(I − 0.1·k⊗k)·(I + 0.1·q⊗q)·{s}" if not params else f"{params[0]}·{s}"
        else:
            base = None
        correction = self.chance(0.3)
        write = self.write(names)
        if correction and base is not None:
            form = self.pick(["(I − {b}·{k}⊗{k})·({base}) + {b}·{k}⊗v", "{base} − {b}·{k}⊗({k}·({base})) + {w}",
                              "{base} − {b}·{k}⊗({k}·{s}) + {b}·{k}⊗v"])
            text = form.format(b=beta, k=kn, base=base, w=write, s=s)
            return text
        if base is None:
            return write if self.chance(0.5) else f"0·{s} + {write}"
        if self.chance(0.06):
            return base  # only decays
        if self.chance(0.2):
            return f"{base} + {write} + {self.write(names)}"
        return f"{base} + {write}"

    def output(self, i: int, states, names: _Names, before: bool) -> str:
        matrices = [s for s, sh in states if sh == ("dk", "dv")]
        transposed = [s for s, sh in states if sh == ("dv", "dk")]
        over_k = [s for s, sh in states if sh == ("dk",)]
        over_v = [s for s, sh in states if sh == ("dv",)]
        q = self.pick(names.vectors_k)
        choices = []
        for S in matrices:
            qq = self.pick([q, f"phi({q})" if names.functions else q, f"dk^(−1/2)·{q}", f"l2norm({q})"])
            choices += [f"{qq}·{S}", f"{qq}·{S}", f"groupnorm({qq}·{S})", f"tanh({qq}·{S})", f"sum({qq}·{S})",
                        f"{qq}·{S} + {self.value(names)}", f"softmax({qq}·{S})", f"({qq}·{S})*sigmoid(v)",
                        # linear reads in other shapes (readouts by linearity)
                        f"{qq}·({S}·diag(sigmoid(v)))", f"(k + {qq})·{S}", f"{qq}·({S} + k⊗v)",
                        f"0.5·({qq}·(2·{S}))", f"{qq}·({S}·v)"]
            for z in over_k:
                choices.append(f"({qq}·{S}) / ({qq}·{z} + 1)")
        for P in [s for s, sh in states if sh == ("m", "dv")]:
            feature = getattr(self, "feature_map", "relu(W·k)").replace("k", "q")
            choices += [f"{feature}·{P}", f"({feature}·{P}) / sum({feature})", f"groupnorm({feature}·{P})"]
        for R in transposed:
            choices += [f"{R}·{q}", f"{R}·l2norm({q})"]
        for z in over_k:
            choices += [f"{q}·{z}", f"{z}", f"{z}*sigmoid({q})", f"sum({z})", f"{z} + {q}"]
        for w in over_v:
            choices += [f"{w}", f"{w}*sigmoid(v)", f"{w} + v", f"norm({w})"]
        if not choices or self.chance(0.03):
            choices.append(self.pick(["q", "sum(q)", "v*2"]))
        return f"output o{i} = {self.pick(choices)}"

    def attention_program(self) -> str:
        r = self.rng
        dims = {"dk": r.choice([1, 2, 3, 4]), "dv": r.choice([1, 2, 3])}
        causal = not self.chance(0.3)
        lines = [self.header(dims, causal), "input q[dk], k[dk], v[dv]"]
        window = self.pick(["", "", ", window=2", ", window=1", ", window=5", ", window=0"])
        score = self.pick([f"seq(k{window})·(dk^(−1/2)·q)", f"seq(k{window})·q", f"seq(l2norm(k){window})·q"])
        values = self.pick([f"seq(v{window})", f"seq(2*v{window})", f"seq(tanh(v){window})"])
        out = self.pick([f"softmax({score})·{values}", f"softmax({score})·{values} + v",
                         f"tanh(softmax({score})·{values})", f"({score})·{values}",
                         f"softmax({score})·{values}", f"sum(softmax({score}))·v",
                         f"2·(softmax({score})·{values})"])
        if self.chance(0.2):  # named values: per token, and constant
            lines.append(self.pick(["kn = l2norm(k)", "c = 0.5", "c = dk^(−1/2)"]))
            out = out.replace("seq(k", "seq(kn" if "kn" in lines[-1] else "seq(k").replace(
                "(dk^(−1/2)·q)", "(c·q)" if lines[-1].startswith("c") else "(dk^(−1/2)·q)")
        if self.chance(0.15):  # the readout given a name (written into the outputs that use it)
            lines.append(f"a = {out}")
            out = self.pick(["a", "2*a", "a + v", "a*sigmoid(v)"])
        lines.append(f"output o = {out}")
        if self.chance(0.2):
            lines.append(f"output p = softmax({score})·{values}")
        if self.chance(0.08):
            lines.append("output r = lsh_attention(q, v, buckets=2, rounds=1, chunk=4, seed=0)")
        return "\n".join(lines) + "\n"

    # -- mutations of the examples --
    def mutant(self) -> str:
        self.count += 1
        files = sorted(EXAMPLES.glob("*.lin"))
        lines = self.pick(files).read_text(encoding="utf-8").splitlines()
        for _ in range(self.rng.choice([1, 1, 2, 3])):
            lines = self.mutate(lines)
        return "\n".join(lines) + "\n"

    TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|\d+(?:\.\d+)?(?:e-?\d+)?|[·⊗−+*/^@]")

    def mutate(self, lines: list[str]) -> list[str]:
        lines = list(lines)
        body = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith(("#", "recurrence"))]
        head = next(i for i, line in enumerate(lines) if line.startswith("recurrence"))
        how = self.pick(["token", "token", "token", "delete", "duplicate", "swap", "mode", "dims", "wrap", "append"])
        if how == "delete" and len(body) > 2:
            del lines[self.pick(body)]
        elif how == "duplicate" and body:
            i = self.pick(body)
            lines.insert(i, lines[i])
        elif how == "swap" and len(body) > 1:
            i = self.rng.randrange(len(body) - 1)
            a, b = body[i], body[i + 1]
            lines[a], lines[b] = lines[b], lines[a]
        elif how == "mode":
            line = lines[head]
            lines[head] = line.replace(" noncausal", "") if "noncausal" in line else line + " noncausal"
        elif how == "dims":
            lines[head] = re.sub(r"= (\d+)", lambda m: "= " + self.pick(["1", "2", "3", m.group(1), "0", "7"]),
                                 lines[head])
        elif how == "wrap" and body:
            i = self.pick(body)
            if "=" in lines[i] and not lines[i].startswith(("input", "param", "state")):
                left, right = lines[i].split("=", 1)
                lines[i] = f"{left}= {self.pick(['tanh', 'sigmoid', 'exp', 'sum', 'l2norm', 'softmax', 'abs'])}" \
                           f"({right.split('#')[0].strip()})"
        elif how == "append":
            lines.append(self.pick(["c = 0.5", "output extra = q", "z2 = z2", "output y2 = softmax(q)",
                                    "c = dk", "output n = sum(k)", "param P per head = 0.5", "u = u"]))
        elif body:
            i = self.pick(body)
            tokens = list(self.TOKEN.finditer(lines[i]))
            if tokens:
                m = self.pick(tokens)
                words = set(self.TOKEN.findall("\n".join(lines)))
                replacement = self.replacement(m.group(0), sorted(words))
                lines[i] = lines[i][:m.start()] + replacement + lines[i][m.end():]
        return lines

    def replacement(self, token: str, words: list[str]) -> str:
        if token[0].isdigit():
            return self.pick(["0", "1", "2", "0.5", "1e999", "1000", "1e-300", "16", "3"])
        if token in "·⊗−+*/^@":
            return self.pick(["·", "⊗", "−", "+", "*", "/", "^"])
        return self.pick(words + ["exp", "sigmoid", "I", "h", "dk", "dv", "softmax", "seq", "tanh"])


def _operand(text: str) -> str:
    """text as an operand of a product: in parentheses unless it is a name or a call."""
    return text if re.fullmatch(r"[A-Za-z_]\w*(\(.*\))?", text) and text.count("(") <= 1 else f"({text})"


# ---- what must hold of each program ------------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    kind: str      # the class of failure, e.g. "internal error: compile"
    message: str
    source: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}\n--- program ---\n{self.source}"


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise Timeout in the main thread after `seconds` (a program that hangs is a failure, not a stuck run)."""
    def expire(signum, frame):
        raise Timeout(f"still running after {seconds:g} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _draw_params(rec, heads: int, dims: dict, rng) -> dict:
    """Values for the params a program leaves to the caller: any real is valid (no range can be declared for
    a param), so they are drawn as verify draws them, standard normal × 0.5."""
    return {p.name: rng.standard_normal(((heads,) if p.per_head else ()) + tuple(dims[d] for d in p.shape)) * 0.5
            for p in rec.program.params if p.default is None}


# The smallest scale an array's error is measured against. The inputs are ~1: an output below this is mostly
# cancellation — sum(groupnorm(x)) and groupnorm of a one-element vector are 0 up to rounding, which differs
# between forms and which groupnorm's 1/√eps amplifies — not a value to match to nine digits.
SCALE_FLOOR = 1e-2


def off_a_line(a, offset: int) -> np.ndarray:
    """A copy of `a` starting `offset` bytes past a 64-byte boundary: a view into a cache-line aligned buffer
    (linrec.c.buffers.aligned_empty), `offset` bytes on."""
    a = np.asarray(a)
    raw = aligned_empty((a.nbytes + offset,), np.uint8)
    out = raw[offset:].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _off_a_line(arrays: dict, seed: int) -> dict:
    """Copies of `arrays` starting 8·(1 + seed % 7) bytes past a 64-byte boundary, what the other backends run
    on: NumPy's own arrays start where its allocator puts them, and a kernel must not take a row for aligned
    (gcc once read rows of one register with aligned loads: test_c_grad.py)."""
    return {name: off_a_line(a, 8 * (1 + seed % 7)) for name, a in arrays.items()}


def _error(result, reference) -> float:
    """verify's normwise relative error max|x − ref| / max|ref| over every output and final state, the scale
    at least SCALE_FLOOR (inf when the result is not finite where the reference is)."""
    worst = 0.0
    for group in ("outputs", "final_state"):
        for name, ref in getattr(reference, group).items():
            got = np.asarray(getattr(result, group)[name], dtype=np.float64)
            if got.shape != ref.shape:
                return float("inf")
            if not ref.size:
                continue
            if not np.all(np.isfinite(got)):
                return float("inf")
            worst = max(worst, float(np.max(np.abs(got - ref))) / max(float(np.max(np.abs(ref))), SCALE_FLOOR))
    return worst


# Outputs and states past this size (the inputs are ~1, T ≤ 20) come from an expanding transition, such as
# the delta rule's I − β·k⊗k with β·‖k‖² ≫ 2: the forms then round differently by up to ε times the growth
# (the triangular solve of the parallel and chunkwise forms against the token loop), past verify's tolerance
# for no fault of theirs. Such programs still have to run; their forms are not compared.
GROWTH_LIMIT = 1e6


def _comparable(result) -> bool:
    """The reference is finite and within GROWTH_LIMIT."""
    arrays = list(result.outputs.values()) + list(result.final_state.values())
    return all(np.all(np.isfinite(a)) and (not a.size or np.max(np.abs(a)) <= GROWTH_LIMIT) for a in arrays)


class Stats(Counter):
    """What a run covered: programs, rejected, accepted, runs (a form on a backend), compared, not compared."""


def exercise(source: str, backends=("numpy",), tokens: int = 12, seed: int = 0, seconds: float = 20.0,
             scan_forms_on_c: int = 1, stats: Stats | None = None, command_line: bool = False,
             gradients: tuple = (), serving: tuple = (), through_torch: tuple = ()) -> list[Failure]:
    """Every check listed in the module's docstring, for one program. `backends`: the backends whose listed
    forms run (C builds cost ~0.5 s each: on C the recurrent form, the decode step, form="auto" and
    `scan_forms_on_c` of the scan forms). command_line: also `linrec check FILE` and `linrec run FILE`, whose
    exit status must not be 2 (an internal error), and check's 0 or 1 must agree with the API's verdict.
    gradients: the backends whose listed gradient forms are checked (see _gradients; () for none). serving: the
    backends on which what a serving engine asks is checked (see _serving; () for none). through_torch: the
    backends linrec.torch.apply runs the program on (see _through_torch; () for none, as without torch)."""
    failures: list[Failure] = []
    stats = Stats() if stats is None else stats
    stats["programs"] += 1

    def fail(kind: str, message: str):
        failures.append(Failure(kind, message, source))

    try:  # (overflows and NaNs of odd programs are their own business: no warnings from them)
        with time_limit(seconds), warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            accepted = _exercise(source, backends, tokens, seed, scan_forms_on_c, fail, stats, gradients, serving,
                                 through_torch)
            if command_line:
                _command_line(source, accepted, fail, stats)
    except Timeout as err:
        fail("hang", str(err))
    return failures


def _guarded(fail, refused: str, what: str, where: str, run):
    """run()'s result, or None after a failure: a LinrecError is the failure class `refused` ("{what}: the
    error"), any other exception but a Timeout an internal error at `where`."""
    try:
        return run()
    except Timeout:
        raise
    except LinrecError as err:
        fail(refused, f"{what}: {err}")
    except Exception as err:  # noqa: BLE001 - what the fuzzer looks for
        _internal(fail, where, err)
    return None


def _internal(fail, where: str, err: BaseException):
    frames = traceback.extract_tb(err.__traceback__)
    last = next((f for f in reversed(frames) if "linrec" in f.filename or "backends" in f.filename), frames[-1]
                if frames else None)
    place = f" at {Path(last.filename).name}:{last.lineno} ({last.name})" if last else ""
    fail(f"internal error: {where}", f"{type(err).__name__}: {err}{place}")


def _exercise(source, backends, tokens, seed, scan_forms_on_c, fail, stats, gradients=(), serving=(),
              through_torch=()) -> bool:
    """Compile the program; one it accepts goes on to _run_forms. Returns whether it was accepted."""
    try:
        rec = linrec.compile(source, "fuzz.lin")
    except LinrecError as err:
        stats["rejected"] += 1
        if err.span is None:
            fail("rejected without a location", str(err))
        return False
    except Timeout:
        raise
    except Exception as err:  # noqa: BLE001 - what the fuzzer looks for
        _internal(fail, "compile", err)
        return False
    _run_forms(rec, backends, tokens, seed, scan_forms_on_c, fail, stats, gradients, serving, through_torch)
    return True


def _run_forms(rec, backends, tokens, seed, scan_forms_on_c, fail, stats, gradients=(), serving=(),
               through_torch=()) -> None:
    """check's report, then every form it lists on each of `backends` against the reference."""
    try:
        info = cli.describe(rec, "fuzz.lin")
        cli.format_check(info)
    except Timeout:
        raise
    except Exception as err:  # noqa: BLE001
        _internal(fail, "check", err)
        return
    stats["accepted"] += 1
    listed = {f["form"]: f["backends"] for f in info["forms"] if f["available"]}
    program = rec.program
    rng = np.random.default_rng(seed)
    batch, heads = 1 + seed % 2, 1 + (seed // 2) % 2
    dims = {d.name: d.default for d in program.dims}
    tokens = min(tokens, dims.get("T", tokens))  # (params over the sequence axis hold at most T positions)
    try:
        inputs = rec.random_inputs(batch, tokens, heads, dims, np.float64, seed=seed)
        params = _draw_params(rec, heads, dims, rng) or None
        state0 = verify._initial_state(program, batch, heads, dims, rng)
    except Timeout:
        raise
    except Exception as err:  # noqa: BLE001
        _internal(fail, "random inputs", err)
        return
    ref_form = verify.reference_form(rec)
    try:
        reference = rec.run(inputs, form=ref_form, initial_state=state0, params=params)
    except Timeout:
        raise
    except RuntimeInputError as err:
        if err.span is None:
            fail("listed form refused", f"{ref_form} on numpy (the reference): {err}")
        else:  # the program's own values at these sizes (a param default or constant that overflows): said where
            stats["refused at these sizes"] += 1
        return
    except LinrecError as err:
        fail("listed form refused", f"{ref_form} on numpy (the reference): {err}")
        return
    except Exception as err:  # noqa: BLE001
        _internal(fail, f"run {ref_form} numpy", err)
        return
    comparable = _comparable(reference)

    def attempt(what: str, run):
        result = _guarded(fail, "listed form refused", what, f"run {what}", run)
        if result is None:
            return
        stats[f"runs on {backend}"] += 1  # (the loop's backend below: attempt runs inside it)
        if comparable:
            stats["compared"] += 1
            error = _error(result, reference)
            if not error <= TOLERANCE:
                fail("forms disagree", f"{what}: relative error {error:.3g} against the float64 {ref_form} form "
                                       f"(tolerance {TOLERANCE:g})")
        else:
            stats["not compared"] += 1

    shifted = _off_a_line(inputs, seed)
    for backend in backends:
        x = inputs if backend == "numpy" else shifted  # (the same values, off a cache line: see _off_a_line)
        chosen = [f for f, built in listed.items() if backend in built]
        if backend != "numpy":  # C builds are dear: the recurrent form and a sample of the scan forms
            scans = [f for f in chosen if f != "recurrent"]
            chosen = [f for f in chosen if f == "recurrent"] + scans[:scan_forms_on_c]
        for form in chosen:
            if (form, backend) == (ref_form, "numpy"):
                continue
            for chunk in ((None, 5) if form == "chunkwise" and backend == "numpy" else (None,)):
                attempt(f"{form} on {backend}" + (f" (chunk {chunk})" if chunk else ""),
                        lambda f=form, c=chunk: rec.run(x, form=f, backend=backend, initial_state=state0,
                                                        params=params, chunk_size=c))
        if program.causal and backend in listed.get("recurrent", []):
            attempt(f"decode step on {backend}",
                    lambda: decode.run_by_steps(rec, x, backend=backend, params=params, initial_state=state0))
        if any(backend in built for built in listed.values()):
            attempt(f"form auto on {backend}",
                    lambda: rec.run(x, form="auto", backend=backend, initial_state=state0, params=params))
    if gradients:
        def redraw(draw: int):  # (the same call's inputs, another draw)
            return rec.random_inputs(batch, tokens, heads, dims, np.float64, seed=seed + 1000 * draw)
        _gradients(rec, info, gradients, inputs, state0, reference, comparable, seed, fail, stats, redraw)
    if serving and comparable:
        _serving(rec, listed, serving, seed, fail, stats)
    if through_torch and comparable and TORCH and not (state0 and decode.reads_the_sequence(rec)):
        _through_torch(rec, info, listed, through_torch, inputs, state0, reference, seed, fail, stats)


def _through_torch(rec, info, listed: dict, backends: tuple, inputs, state0, reference, seed, fail, stats) -> None:
    """linrec.torch.apply on each of `backends` that builds a form of the program, float64 tensors of the
    reference's arguments (its params, defaults too, as leaves): the outputs and final states within verify's
    tolerance of the reference form's (_error), and autograd's gradients of Σ w·o + Σ w_S·S_T (random weights)
    within verify_grad.FORM_TOLERANCE of NumPy's vjp of the same weights (_gradient_error) — where check lists
    a gradient form and that vjp runs. Where it lists none, the forward runs on tensors that ask for no
    gradient."""
    import torch

    import linrec.torch as lt
    rng = np.random.default_rng([seed, 3])
    weights = {k: rng.standard_normal(v.shape) for k, v in reference.outputs.items()}
    state_weights = {k: rng.standard_normal(v.shape) for k, v in reference.final_state.items()}
    params = {k: np.array(v, dtype=np.float64) for k, v in reference.params.items()}
    differentiable = any(g["available"] for g in info["gradients"])
    want = None
    if differentiable:
        try:
            want = rec.vjp(inputs, weights, grad_final_state=state_weights or None, initial_state=state0 or None,
                           params=params, form=verify_grad.reference_form(rec)).grads
        except LinrecError:
            stats["gradient refused at these values"] += 1  # (torch's backward is then not compared)
    for backend in [b for b in backends if any(b in built for built in listed.values())]:
        # (a program with no gradient form: tensors that ask for none, or apply refuses it up front, as it should)
        leaves = {name: torch.tensor(v, requires_grad=differentiable)
                  for name, v in {**inputs, **state0, **params}.items()}
        applied = _guarded(fail, "torch refused", f"apply on {backend}", f"torch apply on {backend}",
                           lambda b=backend: lt.apply(rec, {x.name: leaves[x.name] for x in rec.program.inputs},
                                                      initial_state={k: leaves[k] for k in state0} or None,
                                                      params={k: leaves[k] for k in params} or None,
                                                      output_final_state=True, backend=b))
        if applied is None:
            continue
        o, final = applied
        stats[f"torch runs on {backend}"] += 1
        outputs = o if isinstance(o, dict) else {rec.program.outputs[0].name: o}
        got = linrec.Result(outputs={k: v.detach().numpy() for k, v in outputs.items()},
                            final_state={k: v.detach().numpy() for k, v in final.items()})
        error = _error(got, reference)
        if not error <= TOLERANCE:
            fail("torch disagrees", f"apply on {backend}: relative error {error:.3g} against the float64 reference "
                                    f"form (tolerance {TOLERANCE:g})")
        loss = sum((outputs[k] * torch.from_numpy(w)).sum() for k, w in weights.items()) + \
            sum((final[k] * torch.from_numpy(w)).sum() for k, w in state_weights.items())
        if not differentiable or not loss.requires_grad:
            continue
        try:
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        except Timeout:
            raise
        except LinrecError as err:
            if want is not None:
                fail("torch refused", f"backward on {backend}: {err}")
            continue
        except Exception as err:  # noqa: BLE001
            _internal(fail, f"torch backward on {backend}", err)
            continue
        if want is None:
            continue
        stats[f"torch gradients on {backend}"] += 1
        by_name = {k: (np.zeros(leaves[k].shape) if g is None else g.numpy()) for k, g in zip(leaves, grads)}
        error, name = _gradient_error(by_name, {k: v for k, v in want.items() if k in by_name})
        if not error <= verify_grad.FORM_TOLERANCE:
            fail("torch disagrees", f"autograd through apply on {backend}: ∂{name} relative error {error:.3g} "
                                    f"against NumPy's vjp (tolerance {verify_grad.FORM_TOLERANCE:g})")


def _serving(rec, listed: dict, backends: tuple, seed: int, fail, stats) -> None:
    """verify.serving_rows on `backends`, over every form check lists and the decode step: each row within
    verify's float64 tolerance of the reference form run on its own, an array's error measured against at least
    SCALE_FLOOR, as the forms' (a row whose reference passes float64's range is skipped there too; none where the
    reference grows past GROWTH_LIMIT at serving_rows' sizes, as the forms are not compared then), the pool's
    other slots untouched, and no refusal — serving is asked of every program, form and backend
    (docs/serving.md). The program's own values overflowing at serving_rows' sizes (a refusal with a place in
    the program) are counted, as for the forms."""
    forms = [f for f in listed if any(b in listed[f] for b in backends)] + \
        ([verify.STEP] if rec.program.causal and "recurrent" in listed else [])
    # (serving_rows' sizes are at most 8, but a program at a model's head sizes is checked at them)
    model = {d.name: d.default for d in rec.program.dims if d.name in ("dk", "dv") and d.default >= MODEL_SIZE}
    try:
        rows = verify.serving_rows(rec, backends, forms, ("float64",), seed=seed, floor=SCALE_FLOOR,
                                   sizes=model or None, comparable=_comparable)
    except Timeout:
        raise
    except RuntimeInputError as err:
        if err.span is None:
            fail("serving refused", str(err))
        else:
            stats["refused at these sizes"] += 1
        return
    except LinrecError as err:
        fail("serving refused", str(err))
        return
    except Exception as err:  # noqa: BLE001
        _internal(fail, "serving", err)
        return
    if not rows:  # (an expanding transition, whose reference _comparable refuses; or nothing to serve: non-causal)
        stats["serving: no rows"] += 1
    for row in rows:
        stats[f"serving rows on {row.backend}"] += 1
        if not row.passed and not row.skipped:
            fail("serving disagrees", f"{row.case}: {row.form} on {row.backend}"
                 + (f" (chunk {row.chunk_size})" if row.chunk_size else "")
                 + f": relative error {row.max_rel:.3g} (tolerance {row.tolerance:g})"
                 + (f"; {row.note}" if row.note else ""))


# the central differences' steps at which a gradient must disagree with them to fail (the last on another draw
# of the inputs)
FD_STEPS = (verify_grad.EPSILON, verify_grad.EPSILON / 4, verify_grad.EPSILON)

# The smallest scale a gradient array's error is measured against, as a fraction of the largest gradient of
# the call (verify_grad's floor is float64's eps of it). A gradient that is zero by cancellation — of q in
# (φ(q)·S)/(φ(q)·z) with dk = 1, or through k/norm(k) of one element, whose terms grow as 1/|k| — is the
# rounding of its terms, which differs between forms, not a value to match to nine digits.
GRADIENT_FLOOR = 1e-4


def _near_zero(inputs: dict) -> bool:
    """Some input lies within a few steps of 0, where abs(c·x) or relu(c·x) has its kink: both steps of the
    central differences cross it and miss the slope alike (x = 1.6e-10 under abs(2q): 4% off at either step, a
    seed-16 finding that was no fault of the gradient), so that their agreeing proves nothing — the inputs are
    drawn again instead."""
    return any(np.min(np.abs(v), initial=np.inf) < 4 * FD_STEPS[0] for v in inputs.values())


def _converged(first: float, second: float) -> bool:
    """Whether two steps' relative errors against the gradient agree within 10%: the differences have
    converged, so the error is the gradient's, not the step's."""
    return abs(first - second) <= 0.1 * max(first, second)


def _gradient_error(grads: dict, reference: dict) -> tuple[float, str]:
    """(the worst relative error, its array's name): max|g − ref| / max(max|ref|, GRADIENT_FLOOR × the largest
    reference gradient), inf where g is not finite."""
    largest = max((float(np.max(np.abs(r), initial=0.0)) for r in reference.values()), default=0.0)
    worst, name = 0.0, ""
    for k, ref in reference.items():
        got = np.asarray(grads[k], np.float64)
        if not np.all(np.isfinite(got)):
            return float("inf"), k
        diff = float(np.max(np.abs(got - ref), initial=0.0))
        scale = max(float(np.max(np.abs(ref), initial=0.0)), GRADIENT_FLOOR * largest)
        error = diff / scale if scale else diff
        if error >= worst:
            worst, name = error, k
    return worst, name


def _gradients(rec, info, backends, inputs, state0, reference, comparable, seed, fail, stats, redraw) -> None:
    """The gradient forms `check` lists (info["gradients"]), float64, on the forward's inputs and random
    upstream gradients: on NumPy each against NumPy's recurrent backward (verify_grad.reference_form's where
    the program has no recurrent form; else the first listed), at verify_grad.FORM_TOLERANCE, and that one
    against central differences of the float64 forward (verify_grad.directional_errors, FD_TOLERANCE); on
    each other backend in `backends`, every form it lists against NumPy's reference. A program whose
    gradient `check` refuses must be refused by vjp with a LinrecError. Only a `comparable` forward (finite,
    within GROWTH_LIMIT) is compared; the others must still run or be refused with a reason."""
    listed = {g["form"]: g["backends"] for g in info["gradients"] if g["available"]}
    first = verify_grad.reference_form(rec)
    rng = np.random.default_rng([seed, 2])
    grad_outputs = {k: rng.standard_normal(v.shape) for k, v in reference.outputs.items()}
    grad_state = {k: rng.standard_normal(v.shape) for k, v in reference.final_state.items() if k in state0}
    params = {k: np.array(v, dtype=np.float64) for k, v in reference.params.items()}  # (defaults too: their grads)

    shifted = [_off_a_line(d, seed) for d in (inputs, grad_outputs)]  # (for the other backends: _off_a_line)

    def vjp(form, backend, chunk=None):
        x, up = (inputs, grad_outputs) if backend == "numpy" else shifted
        return rec.vjp(x, up, form=form, backend=backend, grad_final_state=grad_state,
                       initial_state=state0, params=params, chunk_size=chunk)

    if not any("numpy" in built for built in listed.values()):
        try:  # refused by check: vjp must refuse it too, with a reason
            vjp(first, "numpy")
        except Timeout:
            raise
        except LinrecError:
            stats["gradient refused"] += 1
            return
        except Exception as err:  # noqa: BLE001
            _internal(fail, f"gradient refusal {first} numpy", err)
            return
        fail("gradient check disagrees", f"check lists no {first} gradient on numpy, but vjp built it")
        return

    def attempt(what: str, run):
        try:
            return run()
        except Timeout:
            raise
        except RuntimeInputError as err:
            if comparable:  # (a finite forward within GROWTH_LIMIT has a finite gradient to give)
                fail("listed gradient refused", f"{what}: {err}")
            else:
                stats["gradient refused at these values"] += 1
        except LinrecError as err:
            fail("listed gradient refused", f"{what}: {err}")
        except Exception as err:  # noqa: BLE001
            _internal(fail, f"gradient {what}", err)
        return None

    order = [f for f in (["recurrent", first] + list(listed)) if "numpy" in listed.get(f, [])]
    ref_form = order[0]
    base = attempt(f"{ref_form} gradient on numpy", lambda: vjp(ref_form, "numpy"))
    if base is None:
        return
    stats["gradients"] += 1
    if not comparable:
        return
    if not all(np.all(np.isfinite(g)) for g in base.grads.values()):
        worst = next(k for k, g in base.grads.items() if not np.all(np.isfinite(g)))
        fail("gradient not finite", f"{ref_form} gradient on numpy: '{worst}' is not finite where the forward is")
        return
    # central differences across a kink (abs(v), or l2norm of one element, a sign, with an input within 2e-5
    # of 0) or near a pole (1/l2norm(q) with a component near 0: the step's truncation error) are off for no
    # fault of the gradient: a failure must repeat with a quarter of the step and on another draw of the inputs.
    # Their error moves with the step (δ/ε across a kink, ε² near a pole); a wrong gradient's does not — so
    # when the two steps on the same inputs give the same error, the differences have converged and the
    # failure stands without another draw (an input-dependent bug is not excused by inputs that miss it).
    draw_inputs, draw_base, previous, verdict = inputs, base, None, None
    for draw, epsilon in enumerate(FD_STEPS):
        if draw == len(FD_STEPS) - 1:
            draw_inputs = redraw(draw)
            draw_base = attempt(f"{ref_form} gradient on numpy (inputs drawn again)", lambda: rec.vjp(
                draw_inputs, grad_outputs, form=ref_form, backend="numpy", grad_final_state=grad_state,
                initial_state=state0, params=params))
            if draw_base is None:
                return
        try:
            errors = verify_grad.directional_errors(rec, draw_inputs, params, state0, grad_outputs, grad_state,
                                                    draw_base.grads, seed=seed, form=verify_grad.reference_form(rec),
                                                    epsilon=epsilon)
        except Timeout:
            raise
        except Exception as err:  # noqa: BLE001
            _internal(fail, "finite differences", err)
            return
        stats["gradients against finite differences"] += draw == 0
        worst = max(errors, key=lambda k: errors[k][1]) if errors else None
        if worst is None or errors[worst][1] <= verify_grad.FD_TOLERANCE:
            break
        if previous is not None and draw_inputs is inputs and _converged(previous, errors[worst][1]) \
                and not _near_zero(inputs):
            verdict = "the same at steps {} and {}: the differences converged".format(*FD_STEPS[:2])
            break
        previous = errors[worst][1]
    else:
        verdict = f"at steps {', '.join(map(str, FD_STEPS))}, the last on other inputs"
    if verdict:
        fail("gradient against finite differences", f"{ref_form} gradient on numpy: '{worst}' relative error "
                                                     f"{errors[worst][1]:.3g} (tolerance {verify_grad.FD_TOLERANCE:g}; "
                                                     f"{verdict})")
    for backend in backends:
        for form, built in listed.items():
            if backend not in built:
                continue
            for chunk in ((None, 4) if backend == "numpy" else (None,)):
                if (form, backend, chunk) == (ref_form, "numpy", None):
                    continue
                what = f"{form} gradient on {backend}" + (f" (checkpoints every {chunk})" if chunk else "")
                result = attempt(what, lambda f=form, b=backend, c=chunk: vjp(f, b, c))
                if result is None:
                    continue
                stats[f"gradient runs on {backend}"] += 1
                if set(result.grads) != set(base.grads):
                    fail("gradients disagree", f"{what}: gradients of {sorted(result.grads)}, the {ref_form} "
                                               f"gradient on numpy of {sorted(base.grads)}")
                    continue
                error, name = _gradient_error(result.grads, base.grads)
                if not error <= verify_grad.FORM_TOLERANCE:
                    fail("gradients disagree", f"{what}: '{name}' relative error {error:.3g} against the {ref_form} "
                                               f"gradient on numpy (tolerance {verify_grad.FORM_TOLERANCE:g})")


def _command_line(source: str, accepted: bool, fail, stats) -> None:
    """`linrec check` and, for a program it accepts, `linrec run --tokens 5` on the program as a file;
    `accepted`: whether linrec.compile took it."""
    with tempfile.TemporaryDirectory(prefix="linrec-fuzz-") as folder:
        path = Path(folder) / "fuzz.lin"
        path.write_text(source, encoding="utf-8")
        for argv in (["check", str(path)], ["run", str(path), "--tokens", "5", "--quiet"]):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = cli.main(argv)
            stats[f"linrec {argv[0]}"] += 1
            if status == 2:
                fail("internal error: command line", f"linrec {argv[0]} exited with status 2: {err.getvalue()}")
            if argv[0] == "check" and (status == 0) != accepted:
                fail("command line disagrees", f"linrec check exited with {status}, the API "
                                               f"{'accepted' if accepted else 'rejected'} it: {err.getvalue()}")
            if argv[0] == "check" and status != 0:
                return  # (rejected: nothing to run)


COMMAND_LINE_EVERY = 10  # programs of a run that also go through `linrec check` and `linrec run`


# (dk, dv) of at_model_sizes: whole registers and key blocks, partial ones, dk ≠ dv both ways
MODEL_SIZES = ((64, 64), (128, 128), (96, 80), (200, 72), (72, 136))
MODEL_SIZE = min(min(pair) for pair in MODEL_SIZES)  # (a size from which _serving keeps a program's own)


def at_model_sizes(source: str, index: int) -> str:
    """The program with the sizes of dk and dv in its header at a model's (MODEL_SIZES, by `index`); its other
    sizes as they are."""
    dk, dv = MODEL_SIZES[index % len(MODEL_SIZES)]
    sizes = {"dk": dk, "dv": dv}

    def header(line: re.Match) -> str:
        return re.sub(r"\b(dk|dv)(\s*=\s*)\d+", lambda m: f"{m.group(1)}{m.group(2)}{sizes[m.group(1)]}", line.group(0))
    return re.sub(r"^recurrence\b.*$", header, source, count=1, flags=re.MULTILINE)


def programs(count: int, seed: int, mutants: float = 0.25):
    """`count` programs of one seed: generated ones and, a `mutants` fraction, mutated examples."""
    gen = ProgramGenerator(seed)
    for _ in range(count):
        yield gen.mutant() if gen.chance(mutants) else gen.program()


def summarize(failures: list[Failure]) -> str:
    """One line per class of failure: how many programs failed that way."""
    classes = Counter(key for key in {(f.kind, _signature(f.message), f.source) for f in failures})
    classes = Counter((kind, message) for kind, message, _ in classes.elements())
    lines = [f"{n:5d}  {kind}: {message}" for (kind, message), n in classes.most_common()]
    return "\n".join(lines)


def _signature(message: str) -> str:
    """A failure's message without the program's particulars, to count failures by class."""
    text = re.sub(r"'[^']*'|`[^`]*`|\d+(\.\d+)?(e[-+]?\d+)?", "…", message.splitlines()[0])
    return text[:140]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="fuzz linrec with random programs")
    parser.add_argument("count", type=int, nargs="?", default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--c", type=int, default=0, help="of these, how many also run on the C backend")
    parser.add_argument("--grad-every", type=int, default=1,
                        help="the gradients of one program in N (default 1: every program; 0: none)")
    parser.add_argument("--grad-c", type=int, default=None,
                        help="of the C programs, how many check their gradients on C too (default: all)")
    parser.add_argument("--serving-every", type=int, default=1,
                        help="what a serving engine asks of one program in N, on the backends it runs on "
                             "(default 1: every program; 0: none)")
    parser.add_argument("--torch-every", type=int, default=10,
                        help="linrec.torch.apply and autograd on one program in N, on the backends it runs on "
                             "(default 10; 0: none; nothing without torch installed)")
    parser.add_argument("--model-sizes-every", type=int, default=0,
                        help="one C program in N at a model's head sizes (dk, dv from 64 to 200: at_model_sizes) "
                             "instead of its own small ones (default 0: none)")
    parser.add_argument("--show", type=int, default=3, help="failing programs to print per class")
    args = parser.parse_args(argv)
    # the C backward's runs of the chain rule in C at the fuzzer's small sizes too, where a call gives them to NumPy
    # below c.chain_rows.MIN_ROW_VALUES: the random programs' chain rules then meet the kernel
    chain_rows.MIN_ROW_VALUES = 0
    with tempfile.TemporaryDirectory(prefix="linrec-fuzz-cache-") as cache:
        os.environ.setdefault("LINREC_CACHE_DIR", cache)  # (kernels built here go away with the run)
        return _run(args)


def _run(args) -> int:
    failures, stats, start = [], Stats(), time.perf_counter()
    every = max(1, args.count // max(args.c, 1)) if args.c else 0
    c_gradients = 0  # C programs whose gradients ran (on C where it builds them)
    for i, source in enumerate(programs(args.count, args.seed)):
        backends = ("numpy", "c") if every and i % every == 0 else ("numpy",)
        if "c" in backends and args.model_sizes_every and (i // every) % args.model_sizes_every == 0:
            source = at_model_sizes(source, i // every // args.model_sizes_every)
            stats["at a model's sizes"] += 1
        gradients = ()
        if args.grad_every and i % args.grad_every == 0:
            gradients = ("numpy",)
            if "c" in backends and (args.grad_c is None or c_gradients < args.grad_c):
                gradients, c_gradients = backends, c_gradients + 1
        serving = backends if args.serving_every and i % args.serving_every == 0 else ()
        through_torch = backends if args.torch_every and i % args.torch_every == 0 else ()
        failures += exercise(source, backends, seed=i, stats=stats, command_line=i % COMMAND_LINE_EVERY == 0,
                             gradients=gradients, serving=serving, through_torch=through_torch,
                             seconds=120 if "c" in backends else 20)  # (C builds: ~1 s each)
    failed = len({f.source for f in failures})
    print(f"{args.count} programs in {time.perf_counter() - start:.1f} s: {failed} failed ({len(failures)} failures)")
    print(", ".join(f"{key}: {n}" for key, n in sorted(stats.items())))
    print(summarize(failures))
    shown = Counter()
    for f in failures:
        key = (f.kind, _signature(f.message))
        if shown[key] < args.show:
            shown[key] += 1
            print("\n" + str(f))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

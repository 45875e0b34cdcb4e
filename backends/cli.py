"""The `linrec` command line.

    linrec check FILE.lin...      what the compiler understood, and which forms exist
    linrec emit FILE.lin          the generated source of one form
    linrec run FILE.lin           run a form on seeded random inputs, or on arrays from an .npz file
    linrec verify FILE.lin        check every form on every backend against the float64 recurrent form
    linrec bench FILE.lin         time every form on every backend against the machine's own limits
    linrec cache info|clear       the C backend's on-disk kernel cache

Each subcommand is one entry of COMMANDS: a function that adds its arguments to its parser (and sets the
parser's epilog) and a handler that takes the parsed namespace and returns the exit status. The first line
of the handler's docstring is the one-line help, the rest its description. To add a command, write the two
functions and add one line to COMMANDS.

Exit status: 0 success, 1 a problem with the program or the arrays (one message on stderr, no traceback),
2 an internal error (set LINREC_DEBUG=1 for the traceback). Bad command-line usage is bad input too: 1.
"""
from __future__ import annotations

import argparse
import errno
import io
import json
import math
import os
import sys
import tempfile
import textwrap
import traceback
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from . import api, bench, bench_grad, bench_serving, bench_shapes, compiler, gradients, quality, registry, verify, verify_grad
from .c import cache as c_cache
from .c import standalone as c_standalone
from .compiler import ir
from .compiler.analysis import inline_lets, to_text, walk
from .compiler.builtins import SEQ
from .compiler.resolve import SIZE_LIMIT, too_large
from .compiler.steps import composed_update
from .arrays import BFLOAT16, BFLOAT16_BITS, CHUNK_SIZE_RULE, FLOAT_DTYPES, check_chunk_size, from_bfloat16
from .decode import run_by_steps
from .dim_option import dims_with_overrides
from .dsl.errors import LinrecError, RuntimeInputError
from .interface import DEFINITION, STATEMENTS
from .version import VERSION

PROG = "linrec"
DEBUG_VARIABLE = "LINREC_DEBUG"


# ---- helpers ---------------------------------------------------------------------------------


def _shape(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _path(what: str):
    """An argparse type for a path: an empty one is a usage error saying so (found by probing: `check ""` read
    the directory "." and named it; `run --out ""` wrote nothing, `verify --against ""` ran the other check)."""
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"the path is empty: give {what}")
        return text
    return parse


PROGRAM_PATH = _path("a program file (.lin)")


def _load(path: str):
    """The compiled program; its warnings (declared names nothing uses) go to stderr, with their places."""
    rec = api.load(path)
    for warning in rec.compiled.warnings:
        print(warning, file=sys.stderr)
    return rec


def _backend_names() -> list[str]:
    return list(registry.BACKENDS)


def _form_names() -> list[str]:
    return list(compiler.FORMS)


def _implemented(rec, form: str) -> list[str]:
    """The backends that generate `form` of this program today (a form can exist mathematically before a
    backend has it)."""
    return registry.building(rec.compiled, form)


def _range_text(x) -> str | None:
    """An input's declared range in the DSL's own spelling: `in (0, 1)`, `<= 0`, `> 0`."""
    if x.low is None and x.high is None:
        return None
    if x.low is not None and x.high is not None:
        return f"in {'(' if x.low_open else '['}{x.low:g}, {x.high:g}{')' if x.high_open else ']'}"
    if x.high is not None:
        return f"{'<' if x.high_open else '<='} {x.high:g}"
    return f"{'>' if x.low_open else '>='} {x.low:g}"


def _reads(program, value) -> list[tuple[str, str]]:
    """Which states an output reads and when: "before" (S_(t−1)), "after" (S_t) or "final" (non-causal)."""
    seen: dict[tuple[str, str], None] = {}
    for node in walk(inline_lets(value, program.lets)):
        if isinstance(node, ir.StateRef):
            when = "final" if not program.causal else ("before" if node.version == "prev" else "after")
            seen.setdefault((node.name, when), None)
    return list(seen)


_WHEN = {"before": "before this token's update ({s}_(t−1))", "after": "after this token's update ({s}_t)",
         "final": "as the final state, after every token (non-causal)"}


# ---- check -----------------------------------------------------------------------------------
def describe(rec, path: str) -> dict:
    """Everything `check` reports, as plain data (the --json output for one file)."""
    p, d = rec.program, rec.decomposition
    updates = p.updates
    info = {
        "file": path,
        "name": p.name,
        "mode": "causal" if p.causal else "noncausal",
        "dims": [{"name": dim.name, "default": dim.default} for dim in p.dims],
        "inputs": [], "params": [], "states": [], "outputs": [], "forms": [], "gradients": [],
        "warnings": [{"message": w.message, "line": w.span.line, "column": w.span.column}
                     for w in rec.compiled.warnings],
    }
    for x in p.inputs:
        info["inputs"].append({
            "name": x.name, "shape": ["B", "T", "H", *x.shape],
            "range": None if x.low is None and x.high is None else {
                "low": x.low, "high": x.high, "low_open": x.low_open, "high_open": x.high_open,
                "text": _range_text(x)},
        })
    for prm in p.params:
        info["params"].append({
            "name": prm.name, "shape": (["H"] if prm.per_head else []) + list(prm.shape),
            "per_head": prm.per_head, "default": None if prm.default is None else to_text(prm.default),
        })
    for s in p.states:
        t = d.transition(s.name)
        info["states"].append({
            "name": s.name, "shape": ["B", "H", *s.shape], "transition": t.kind,
            "update": f"{s.name} = {to_text(composed_update(p, updates[s.name]))}", "reasons": list(t.reasons),
            "assignments": [span.line for span in updates[s.name].assignments],  # more than one: composed
            "transposed": s.name in d.transposed,  # the derived forms carry it as its transpose
        })
    for out in p.outputs:
        info["outputs"].append({
            "name": out.name, "shape": ["B", "T", "H", *out.value.shape],
            "value": f"{out.name} = {to_text(out.value)}",
            "reads": [{"state": state, "when": when} for state, when in _reads(p, out.value)],
        })
    info["stages"] = [{  # a program derived in stages (compiler.stages): each stage's states and forms
        "stage": st.number, "states": list(st.states), "forms": list(st.forms), "takes": list(st.takes),
        "hands": [{"name": h.name, "state": h.state, "value": h.text()} for h in st.hands],
        "outputs": list(st.outputs)} for st in d.stages]
    for form in _form_names():
        why = d.why_not(form)
        entry = {"form": form, "available": why is None, "reason": why,
                 "backends": _implemented(rec, form) if why is None else []}
        # (a form that exists but that a backend does not build: that backend's reason)
        entry["refused"] = {} if why else {b: str(registry.backend(b).why_not(rec.compiled, form))
                                           for b in _backend_names() if b not in entry["backends"]}
        if form == "recurrent" and "c" in entry["backends"] and d.sequence is None:
            entry["c_sequences_in_stages"] = registry.backend("c").sequences_in_stages(rec.compiled)
            entry["c_kernel"] = registry.backend("c").recurrent_kernel(rec.compiled)
        info["forms"].append(entry)
    for form in _form_names():  # the backward of each form (docs/gradients.md)
        backends = [b for b in _backend_names() if gradients.gradient_refusal(rec, form, b) is None]
        reason = None if backends else gradients.gradient_refusal(rec, form, "numpy")
        if d.why_not(form):
            reason = f"there is no {form} forward form"
        refused = {} if not backends else {b: gradients.gradient_refusal(rec, form, b)
                                           for b in _backend_names() if b not in backends}
        info["gradients"].append({"form": form, "available": bool(backends), "reason": reason,
                                  "backends": backends, "refused": refused})
    plan = d.sequence
    info["sequence"] = None if plan is None else {
        "kind": plan.kind, "window": plan.window,
        "description": {"attention": "attends over the visible positions (seq)",
                        "mixing": "mixes every position through parameters over the sequence axis",
                        "lsh": "attends within locality-sensitive hash buckets"}[plan.kind]}
    return info


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def format_check(info: dict) -> str:
    """The human-readable report of `check`."""
    out = [f"{info['name']}: a {info['mode']} recurrence ({info['file']})", ""]
    out.append("dimensions (default size)")
    out += _table([[dim["name"], f"= {dim['default']}"] for dim in info["dims"]]) if info["dims"] else ["  none"]

    out += ["", "inputs"]
    if info["inputs"]:
        out += _table([[x["name"], _shape(x["shape"]), x["range"]["text"] if x["range"] else ""]
                       for x in info["inputs"]])
    else:
        out.append("  none")

    if info["params"]:
        out += ["", "params"]
        out += _table([[prm["name"], _shape(prm["shape"]),
                        "per head" if prm["per_head"] else "",
                        f"= {prm['default']}" if prm["default"] is not None else "(no default: must be given)"]
                       for prm in info["params"]])

    out += ["", "states"]
    if not info["states"]:
        seq = info.get("sequence")
        out.append(f"  none: the program {seq['description']}" if seq else "  none")
    for s, row in zip(info["states"], _table([[s["name"], _shape(s["shape"]), s["transition"]]
                                              for s in info["states"]])):
        out.append(row + (f" of {s['name']}ᵀ (multiplied and read from the right)" if s["transposed"] else ""))
        out.append("      " + s["update"])
        if len(s["assignments"]) > 1:
            lines = ", ".join(map(str, s["assignments"][:-1])) + f" and {s['assignments'][-1]}"
            out.append(f"      composed from its assignments on lines {lines}")

    out += ["", "outputs"]
    for o, row in zip(info["outputs"], _table([[o["name"], _shape(o["shape"])] for o in info["outputs"]])):
        out.append(row)
        out.append("      " + o["value"])
        for r in o["reads"]:
            out.append(f"      reads {r['state']} {_WHEN[r['when']].format(s=r['state'])}")
        if not o["reads"]:
            out.append("      reads no state")

    if info.get("stages"):
        out += ["", "stages (derived one after another; the values a stage hands on are per-token inputs of the "
                    "later ones)"]
        for st in info["stages"]:
            out.append(f"  {st['stage']}  {', '.join(st['states'])}: {', '.join(st['forms'])}")
            if st["takes"]:
                out.append(f"      takes {', '.join(st['takes'])}")
            for h in st["hands"]:
                out.append(f"      hands on {h['value']}")
            if st["outputs"]:
                out.append(f"      computes {', '.join(st['outputs'])}")

    out += ["", "forms"]
    for f in info["forms"]:
        if f["available"]:
            where = (f"backends: {', '.join(f['backends'])}" if f["backends"]
                     else "no backend generates it yet")
            if f.get("c_sequences_in_stages"):
                where += "; C runs a fused kernel per stage"
            elif f.get("c_kernel") == STATEMENTS:
                where += "; C runs its statements one by one"
            out.append(f"  {f['form']:<10}  available ({where})")
            out += _refusals(f["refused"])
        else:
            reason = textwrap.fill(f["reason"], width=96, initial_indent=" " * 14,
                                   subsequent_indent=" " * 14)
            out.append(f"  {f['form']:<10}  not available:")
            out.append(reason)

    out += ["", "gradients (the backward of each form: linrec emit --grad, Recurrence.vjp)"]
    for g in info["gradients"]:
        if g["available"]:
            out.append(f"  {g['form']:<10}  available (backends: {', '.join(g['backends'])})")
            out += _refusals(g["refused"])
        else:
            out.append(f"  {g['form']:<10}  not available:")
            out.append(textwrap.fill(g["reason"], width=96, initial_indent=" " * 14, subsequent_indent=" " * 14))
    return "\n".join(out)


def _refusals(refused: dict[str, str]) -> list[str]:
    """The lines under an available form that some backend does not build: the backend and its reason."""
    return [textwrap.fill(f"not on {b}: {why}", width=96, initial_indent=" " * 14, subsequent_indent=" " * 16)
            for b, why in refused.items()]


def _add_check(parser: argparse.ArgumentParser):
    parser.add_argument("files", nargs="+", type=PROGRAM_PATH, metavar="FILE",
                        help="a program file (.lin); several may be given")
    parser.add_argument("--json", action="store_true",
                        help="print a machine-readable report: one JSON object for one file, "
                             "a JSON array for several")
    parser.epilog = """\
examples:
  linrec check examples/gla.lin
  linrec check examples/*.lin
  linrec check --json examples/mamba2.lin

Shapes: inputs and outputs are [B, T, H, *] (batch, tokens, heads, then the
declared element axes); states are [B, H, *]; per-head params are [H, *].
A form that does not exist says why. Exit status 1 if any file has an error."""


def cmd_check(args) -> int:
    """Check programs and show what the compiler understood.

    Prints the recurrence's name and mode, its dimensions and defaults, its inputs with their shapes and
    declared ranges, its parameters and their default definitions, each state with the class of its
    transition and its update as written, each output with the states it reads (before or after the
    token's update), and which forms exist, with the reason for each that does not.
    """
    reports, status = [], 0
    for path in args.files:
        try:
            reports.append(describe(_load(path), path))
        except LinrecError as err:
            _error(err)
            status = 1
    if args.json:
        if reports or len(args.files) > 1:
            data = reports[0] if len(args.files) == 1 else reports
            print(json.dumps(data, indent=2, ensure_ascii=False))
    elif reports:
        print("\n\n".join(format_check(info) for info in reports))
    return status


# ---- emit ------------------------------------------------------------------------------------
def _add_backend_form(parser: argparse.ArgumentParser, default_form: str | None = None, step: bool = False):
    parser.add_argument("--backend", default="numpy", choices=_backend_names(),
                        help="code generator (default: numpy)")
    choices = _form_names() + (["auto"] if default_form == "auto" else []) + (["step"] if step else [])
    parser.add_argument("--form", default=default_form, choices=choices,
                        help="recurrent: token by token, as written; parallel: all tokens at once "
                             "(attention-like); chunkwise: parallel within chunks, recurrent across "
                             "them" + ("; auto: the fastest for the shape and backend" if default_form == "auto"
                                       else "")
                             + ("; step: one Recurrence.step call per token (the decode step), carrying the "
                                "state — it equals the other forms" if step else "")
                             + f" (default: {default_form or 'recurrent, else the first form the program has'})")


def _add_emit(parser: argparse.ArgumentParser):
    parser.add_argument("file", type=PROGRAM_PATH, metavar="FILE", help="a program file (.lin)")
    _add_backend_form(parser)
    parser.add_argument("--grad", action="store_true",
                        help="the form's backward instead: the forward with checkpoints and the adjoint of the "
                             "statements (docs/gradients.md)")
    parser.add_argument("--dim", dest="dims", action=_DimOnce, type=_dim, metavar="NAME=SIZE",
                        help="with --backend c: a dimension's size, compiled into the kernels printed or written "
                             "(repeatable; default: the file's) — their tiles, strips and blocks follow it")
    alone = parser.add_argument_group("kernels to embed without Python (--backend c --standalone)")
    alone.add_argument("--standalone", action="store_true",
                       help="write NAME.h and NAME.c (prefill, prefill with checkpoints and last states, decode "
                            "step, slot-pool step; float and double) and NAME_params.bin into --out, instead of "
                            "printing the source; see docs/embedding.md")
    alone.add_argument("--out", "-o", type=_path("the directory to write to"), metavar="DIR",
                       help="the directory to write them to (created if missing)")
    alone.add_argument("--heads", type=_positive_int, metavar="H",
                       help=f"heads of the params' defaults in NAME_params.bin (default: {RUN_HEADS}; the file may "
                            f"take up to {PARAMS_FILE_LIMIT >> 30} GiB)")
    parser.epilog = """\
examples:
  linrec emit examples/gla.lin
  linrec emit examples/gla.lin --form chunkwise > gla_chunkwise.py
  linrec emit examples/retnet.lin --backend numpy --form parallel
  linrec emit examples/gated_deltanet.lin --backend c --dim dk=128 --dim dv=128
  linrec emit examples/gla.lin --backend c --standalone --out build --dim dk=64 --dim dv=64
  linrec emit examples/deltanet.lin --grad --form recurrent

The NumPy source defines default_params(heads, dims, given={}) and
forward(inputs, params, initial_state, dims, chunk_size=None, first=0); with --grad,
backward(inputs, params, initial_state, dims, grad_outputs, grad_final_state,
derived_params=(), chunk_size=None)."""


def cmd_emit(args) -> int:
    """Print the generated source of one form of a program.

    The source goes to stdout; redirect it to a file to keep it.
    """
    rec = _load(args.file)
    if args.standalone:
        if args.grad:
            raise LinrecError(f"--standalone writes the forward kernels only: leave out --grad (the backward is a "
                              f"Python module, which `linrec emit {args.file} --grad` prints; with --backend c, where "
                              f"C builds it, one that calls linrec's C backward kernels: docs/gradients.md)")
        return _emit_standalone(rec, args)
    if args.out or args.heads:
        raise LinrecError("--out and --heads go with --standalone (the kernels written to files)")
    if args.dims and args.grad:
        raise LinrecError("--dim sizes the C kernels emit prints; the backward (--grad) is a Python module that takes "
                          "its sizes when it runs: leave out --dim")
    if args.dims and args.backend != "c":
        raise LinrecError(f"--dim sizes the C kernels: add --backend c (the {args.backend} source takes its sizes "
                          f"when it runs)")
    form = args.form or rec.forms[0]  # the recurrent form when the program has one
    if args.grad:
        sys.stdout.write(rec.emit_gradient(form, args.backend))
    else:
        sizes = dims_with_overrides(rec.program, args.dims) if args.dims else None  # (a name it lacks: an error)
        sys.stdout.write(rec.emit(form, args.backend, dims=sizes))
    return 0


def _emit_standalone(rec, args) -> int:
    """`emit --standalone`: NAME.h, NAME.c and NAME_params.bin (c.standalone) written into --out."""
    if args.backend != "c":
        raise LinrecError("--standalone writes C kernels: add --backend c")
    if args.form not in (None, "recurrent"):
        raise LinrecError(f"--standalone exports the recurrent form (prefill and decode steps), not --form {args.form}")
    if not args.out:
        raise LinrecError("--standalone writes files: say where with --out DIR")
    why = c_standalone.refusal(rec.compiled)
    if why:
        raise LinrecError(why)
    sizes = dims_with_overrides(rec.program, args.dims or [])
    heads = args.heads or RUN_HEADS
    _refuse_large_params_file(rec.program, sizes, heads)
    params = {k: v for k, v in rec.default_params(heads, sizes).items() if v is not None}
    files = c_standalone.export(rec.compiled, sizes, heads, params)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LinrecError(f"cannot write to {out}: {err.strerror or err}") from None
    _write_files({out / name: (lambda f, data=data: f.write(data)) for name, data in files.items()})
    for name in files:
        print(out / name)
    return 0


PARAMS_FILE_LIMIT = 1 << 30  # bytes: the most `emit --standalone` writes to NAME_params.bin


def _refuse_large_params_file(program, sizes: dict[str, int], heads: int) -> None:
    """NAME_params.bin holds the params' defaults at --heads heads, float64: a size that would make it larger
    than PARAMS_FILE_LIMIT is an error naming its size and the options that set it — before the defaults are
    computed (found by probing: mamba2 at --heads 100000000 wrote 2.4 GB without a word)."""
    written = [prm for prm in program.params if prm.default is not None]
    size = 8 * sum((heads if prm.per_head else 1) * math.prod(sizes[d] for d in prm.shape)
                   for prm in written)
    if size <= PARAMS_FILE_LIMIT:
        return
    options = (["--heads"] if any(prm.per_head for prm in written) else []) + \
        [f"--dim {d}" for d in dict.fromkeys(d for prm in written for d in prm.shape)]
    limit = f"{PARAMS_FILE_LIMIT >> 30} GiB"
    raise LinrecError(f"{program.name}_params.bin would be {c_cache.human_bytes(size)} ({size} bytes: the float64 defaults "
                      f"of {', '.join(prm.name for prm in written)} for {heads} head(s)), above the {limit} that "
                      f"--standalone writes: make {' or '.join(options)} smaller")


# ---- run -------------------------------------------------------------------------------------
def _int_at_least(minimum: int, what: str):
    """An argparse type: an integer ≥ minimum, else a usage error saying what was expected."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "a non-negative integer")


def _chunk_size(text: str) -> int | str:
    """--chunk-size: an integer as an int, anything else as typed; Recurrence.run checks chunk sizes, the
    command line's as any other (exit status 1 and what a chunk size must be)."""
    try:
        return int(text)
    except ValueError:
        return text


# the options that take a size, by dest: each at most SIZE_LIMIT, checked as the command starts (naming the
# option) so that no size reaches NumPy or a kernel's int, or the loops of emitted C, wrapped or overflowed.
# (--dim is checked where every command reads it, dims_with_overrides, with the name of its dimension.)
SIZE_OPTIONS = ("batch", "batches", "tokens", "heads", "cu_seqlens", "requests", "pool")


def _refuse_oversized(args) -> None:
    """A size option above SIZE_LIMIT is an error naming the option and the value, with the fix."""
    parser = getattr(args, "command_parser", None)
    for action in parser._actions if parser is not None else []:
        value = getattr(args, action.dest, None)
        if action.dest not in SIZE_OPTIONS or value is None or not action.option_strings:
            continue
        for n in value if isinstance(value, list) else [value]:
            if isinstance(n, int) and n > SIZE_LIMIT:
                raise LinrecError(too_large(f"{action.option_strings[0]} {n}"))


def _option_text(value) -> str:
    """A parsed option value as it was typed: --cu-seqlens' offsets comma-separated, --dim as NAME=SIZE."""
    if isinstance(value, tuple):
        return f"{value[0]}={value[1]}"
    if isinstance(value, float):
        return f"{value:g}"
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _given_twice(parser, first: str, second: str, what: str):
    """The usage error of an option given again with another value: which one was meant? (the last would win
    silently)."""
    parser.error(f"{first} and {second}: give {what} once")


class _Once(argparse.Action):
    """Every single-valued option (argparse's `store`, which _Parser makes this): given again with another value
    it is a usage error naming both (found by probing: `run --tokens 8 --tokens 16` ran 16 tokens without a
    word); the same value again is harmless."""

    def __call__(self, parser, namespace, value, option_string=None):
        if self.option_strings:  # (a positional is given once by construction)
            seen = namespace.__dict__.setdefault("_once", {})  # dest → (option as typed, value), of this parse
            if self.dest in seen and seen[self.dest][1] != value:
                typed, before = seen[self.dest]
                long = next((o for o in self.option_strings if o.startswith("--")), self.option_strings[0])
                _given_twice(parser, f"{typed} {_option_text(before)}", f"{option_string} {_option_text(value)}",
                             long)
            seen[self.dest] = (option_string, value)
        setattr(namespace, self.dest, value)


class _DimOnce(argparse.Action):
    """--dim NAME=SIZE, repeatable: a name given again with another size is a usage error (which one was
    meant? the last would win silently)."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = list(getattr(namespace, self.dest, None) or [])
        for name, size in given:
            if name == value[0] and size != value[1]:
                _given_twice(parser, f"--dim {name}={size}", f"--dim {name}={value[1]}", "each dimension")
        setattr(namespace, self.dest, given + [value])


def _dim(text: str) -> tuple[str, int]:
    name, eq, size = text.partition("=")
    name = name.strip()
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=SIZE (e.g. dk=8), got {text!r}")
    return name, _positive_int(size.strip())


def _offsets(text: str) -> list[int]:
    """--cu-seqlens: comma-separated integers (Recurrence.run checks that they are offsets that fit)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integer offsets such as 0,5,37,64, got "
                                         f"{text!r}") from None


GENERATION_OPTIONS = ("batch", "tokens", "heads", "dims", "dtype", "seed")
RUN_BATCH, RUN_TOKENS, RUN_HEADS, RUN_DTYPE, RUN_SEED = 2, 16, 2, "float64", 0  # generated inputs' defaults


def _add_run(parser: argparse.ArgumentParser):
    parser.add_argument("file", type=PROGRAM_PATH, metavar="FILE", help="a program file (.lin)")
    _add_backend_form(parser, "auto", step=True)
    parser.add_argument("--chunk-size", type=_chunk_size, metavar="C",
                        help="chunk length for the chunkwise form, a positive integer (default: the form's own "
                             "choice; one longer than the sequence runs it as one chunk)")
    serve = parser.add_argument_group("serving (docs/serving.md)")
    serve.add_argument("--state-every", type=_positive_int, metavar="C",
                       help="also return the state after every C-th token (checkpoints [B, T // C, H, *], "
                            "written to --out as checkpoints.NAME)")
    serve.add_argument("--keep-last", type=_positive_int, metavar="K",
                       help="also return the states after each of the last K tokens, oldest first (last states "
                            "[B, K, H, *], written to --out as last_states.NAME)")
    serve.add_argument("--cu-seqlens", type=_offsets, metavar="OFFSETS",
                       help="packed variable-length sequences: offsets 0,…,T_total into one row [1, T_total, H, "
                            "*]; initial and final states [N, H, *] (generated inputs: B = 1 and T = the last "
                            "offset; --batch and --tokens, if given, must agree)")
    serve.add_argument("--state-dtype", choices=("float32", BFLOAT16), metavar="{float32,bfloat16}",
                       help="how states are stored between calls, either with float32 inputs (generated ones "
                            "are float32 then): float32 in the inputs' dtype; bfloat16 keeps initial, final and "
                            "returned states as uint16 arrays of bfloat16 bits, and with --form step every "
                            "token's state is rounded to bfloat16")
    io = parser.add_argument_group("arrays from and to files")
    io.add_argument("--inputs", type=_path("the .npz file to read"), metavar="IN.npz",
                    help="arrays by DSL name: inputs [B, T, H, *]; arrays named like a state are initial "
                         "states [B, H, *]; arrays named like a param override its default ([H, *] per "
                         "head). Any other name is an error. The inputs' dtype is kept.")
    io.add_argument("--out", "-o", type=_path("the .npz file to write"), metavar="OUT.npz",
                    help="write every output [B, T, H, *], every final state [B, H, *] and every param "
                         "used, by DSL name")
    io.add_argument("--save-inputs", type=_path("the .npz file to write"), metavar="IN.npz",
                    help="with generated inputs: also write them, to rerun with --inputs (e.g. with "
                         "another form)")
    io.add_argument("--quiet", "-q", action="store_true", help="print no summary")
    gen = parser.add_argument_group("generated inputs (without --inputs)")
    gen.add_argument("--batch", type=_positive_int, metavar="B", help=f"batch size (default: {RUN_BATCH})")
    gen.add_argument("--tokens", type=_positive_int, metavar="T", help=f"sequence length (default: {RUN_TOKENS})")
    gen.add_argument("--heads", type=_positive_int, metavar="H", help=f"number of heads (default: {RUN_HEADS})")
    gen.add_argument("--dim", dest="dims", action=_DimOnce, type=_dim, metavar="NAME=SIZE",
                     help="a dimension's size, e.g. --dim dk=8 (repeatable; default: the file's)")
    gen.add_argument("--dtype", choices=("float32", "float64"), help=f"element type (default: {RUN_DTYPE})")
    gen.add_argument("--seed", type=_nonnegative_int, metavar="N", help=f"random seed (default: {RUN_SEED})")
    parser.epilog = """\
examples:
  linrec run examples/gla.lin
  linrec run examples/gla.lin --tokens 64 --heads 4 --dim dk=8 --dim dv=8 --dtype float32
  linrec run examples/gla.lin --save-inputs in.npz --out recurrent.npz
  linrec run examples/gla.lin --inputs in.npz --form chunkwise --chunk-size 16 --out chunkwise.npz
  linrec run examples/gla.lin --backend c --form step     # token by token through the decode step
  linrec run examples/gla.lin --cu-seqlens 0,5,37,64 --state-every 16 --keep-last 2

Making an input file with NumPy (names as in the program):
  np.savez("in.npz", q=q, k=k, v=v, g=g)   # each [B, T, H, *]; S=S0 for an initial state

Generated inputs are seeded and respect declared ranges (e.g. `input g[dk] <= 0`)."""


_STREAMS: dict[str, bytes] = {}  # what a pipe (/dev/stdin) held, by path: it can be read only once


def _stream_bytes(path: str) -> bytes:
    """The whole of a file that is no regular one (a pipe, /dev/stdin), read once per process — np.load seeks,
    and the command reads --inputs twice (the form auto chooses looks at its shapes): the second read of
    `… | linrec run P --inputs /dev/stdin` found the pipe empty, "not a NumPy .npz file"."""
    if path not in _STREAMS:
        with open(path, "rb") as f:
            _STREAMS[path] = f.read()
    return _STREAMS[path]


def _read_npz(path: str) -> dict[str, np.ndarray]:
    hint = f"write one with np.savez('{Path(path).stem}.npz', q=q, k=k, …)"
    try:
        data = np.load(io.BytesIO(_stream_bytes(path)) if _special(path) else path, allow_pickle=False)
    except FileNotFoundError:
        raise LinrecError(f"cannot read {path}: no such file") from None
    except IsADirectoryError:
        raise LinrecError(f"cannot read {path}: it is a directory") from None
    except PermissionError:
        raise LinrecError(f"cannot read {path}: permission denied") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile):
        raise LinrecError(f"{path} is not a NumPy .npz file; {hint}") from None
    if isinstance(data, np.ndarray):
        raise LinrecError(f"{path} holds a single unnamed array (.npy), but the arrays must be named; {hint}")
    try:
        with data:
            arrays = {name: data[name] for name in data.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise LinrecError(f"cannot read the arrays in {path}: {err}") from None
    for name, value in arrays.items():  # (a member that is not .npy data comes back as its raw bytes)
        if not isinstance(value, np.ndarray):
            raise LinrecError(f"{path}: member '{name}' is not a NumPy array; write it with np.savez")
    return arrays


def _split_arrays(program, arrays: dict[str, np.ndarray], path: str):
    """Sort the arrays of an .npz by DSL name into inputs, initial states and params."""
    inputs = {x.name for x in program.inputs}
    states = {s.name for s in program.states}
    params = {p.name for p in program.params}
    unknown = [name for name in arrays if name not in inputs | states | params]
    if unknown:
        valid = [f"inputs {', '.join(x.name for x in program.inputs) or '(none)'}",
                 f"states (initial) {', '.join(s.name for s in program.states)}"]
        if program.params:
            valid.append(f"params {', '.join(p.name for p in program.params)}")
        raise RuntimeInputError(f"unknown array name(s) {', '.join(map(repr, unknown))}; the names "
                                f"'{program.name}' takes are: {'; '.join(valid)}", filename=path)
    pick = lambda names: {k: v for k, v in arrays.items() if k in names}  # noqa: E731
    return pick(inputs), pick(states), pick(params)


def _stat_cells(arr: np.ndarray) -> list[str]:
    """mean, std, min, max over the finite entries, and a warning when some are not finite."""
    finite = np.isfinite(arr)
    values = arr[finite].astype(np.float64)
    cells = [f"{f(values):.4g}" for f in (np.mean, np.std, np.min, np.max)] if values.size else ["-"] * 4
    bad = int(arr.size - values.size)
    return cells + ([f"{bad} non-finite!"] if bad else [""])


def _summary(sections: list[tuple[str, dict[str, np.ndarray]]]) -> list[str]:
    """One aligned table: kind, name, shape, then mean/std/min/max over the finite entries."""
    header = ["", "", "", "mean", "std", "min", "max", ""]
    table = [header] + [[kind, name, _shape(arr.shape)] + _stat_cells(arr)
                        for kind, arrays in sections for name, arr in arrays.items()]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return [("  " + "  ".join(c.rjust(w) if 3 <= i <= 6 else c.ljust(w)
                              for i, (c, w) in enumerate(zip(r, widths)))).rstrip() for r in table]


def _param_rows(params: dict[str, np.ndarray]) -> list[str]:
    width = max(len(k) for k in params)
    rows = []
    for name, arr in params.items():
        flat = np.asarray(arr, dtype=np.float64).ravel()
        values = ", ".join(f"{v:.6g}" for v in flat[:6]) + (", …" if flat.size > 6 else "")
        rows.append(f"  {name:<{width}}  {_shape(arr.shape)}  = [{values}]")
    return rows


def _npz_target(path: str, option: str) -> str:
    """The file an .npz option writes (np.savez adds .npz); a directory, or a folder that does not exist, is an
    error, said before any work."""
    if Path(path).is_dir():  # (np.savez would write PATH.npz beside it, which nobody asked for)
        raise LinrecError(f"cannot write {option} {path}: it is a directory; give a file name, such as "
                          f"{Path(path) / 'out.npz'}")
    if _special(path):
        return path  # (/dev/stdout, a pipe: as it is — np.savez's .npz would make a file /dev/stdout.npz)
    target = path if path.endswith(".npz") else path + ".npz"
    folder = Path(target).parent
    if not folder.is_dir():  # (found by probing: the whole run happened first, and then this failed)
        raise LinrecError(f"cannot write {option} {path}: the folder {folder} does not exist; create it first")
    return target


def _write_npz(path: str, arrays: dict[str, np.ndarray], option: str = "--out") -> str:
    target = _npz_target(path, option)
    _write_files({Path(target): lambda f: np.savez(f, **arrays)})
    return target


def _write_files(writes: dict[Path, Callable]) -> None:
    """Write each file whole or not at all: write(f) fills a temporary file in the target's directory, and only
    when every one is complete are they renamed over their targets (found by probing: a full disk left a
    truncated .npz, or the first of the --standalone files, behind). On a failure the temporary files are
    removed and the targets left as they were; an OSError is an error naming the file and the reason. (A target
    that is a symlink is written where it points; one that is no regular file, such as a device, directly.)"""
    done: list[tuple[str, str, Path]] = []  # (temporary file, where it goes, the target as given)
    target = None  # (the file being written or renamed: the one an OSError names)
    try:
        for target, write in writes.items():
            real = os.path.realpath(target)
            if _is_stdout(target):  # (its own descriptor: a `>>` redirection appends, which open() would truncate)
                sys.stdout.flush()
                write(sys.stdout.buffer)
                sys.stdout.buffer.flush()
                continue
            if _special(target):
                with open(target, "wb") as f:  # (as given: the real path of a pipe is no path)
                    write(f)
                continue
            fd, temporary = tempfile.mkstemp(dir=os.path.dirname(real), prefix=f".{os.path.basename(real)}.",
                                             suffix=".tmp")
            done.append((temporary, real, target))
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.chmod(temporary, _file_mode(real))
        for temporary, real, target in done:
            os.replace(temporary, real)
    except BaseException as err:
        for temporary, _, _ in done:  # (a renamed one is gone already: nothing to remove)
            try:
                os.unlink(temporary)
            except OSError:
                pass
        if isinstance(err, OSError):
            raise LinrecError(f"cannot write {target}: {err.strerror or err}") from None
        raise


def _special(path) -> bool:
    """Whether the path names a descriptor or a device rather than a file: /dev/stdout, /dev/fd/N or anything
    under /proc, or a symlink on the way to one (/dev/stdout is a link to /proc/self/fd/1, which resolves to
    whatever the shell redirected stdout to — a regular file that renaming a temporary file over would unlink
    from under the open descriptor: `--out /dev/stdout > f.npz` left f.npz empty, with exit status 0); or an
    existing file that is no regular one (a FIFO, a device). Such a path is written directly and as it is. A
    file in a folder of /dev such as /dev/shm is an ordinary file."""
    here = os.path.abspath(path)
    for _ in range(40):  # (a cycle of links: as many hops as the system allows)
        if here in ("/dev/stdin", "/dev/stdout", "/dev/stderr") or here.startswith(("/dev/fd/", "/proc/")):
            return True
        if not os.path.islink(here):
            return os.path.exists(here) and not os.path.isfile(here) and not os.path.isdir(here)
        here = os.path.normpath(os.path.join(os.path.dirname(here), os.readlink(here)))
    return False


def _is_stdout(path: str, stream=None) -> bool:
    """Whether path names the file standard output (or `stream`) writes to: /dev/stdout, or the file it is
    redirected to."""
    try:
        return os.path.samestat(os.stat(path), os.fstat((stream or sys.stdout).fileno()))
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # (no such file, no descriptor)
        return False


def _file_mode(path: str) -> int:
    """The permissions a written file gets: an existing file's own, else those open() gives a new one."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@dataclass
class RunOutcome:
    """One `linrec run`: the inputs it ran on, its Result and where the inputs came from (for the summary)."""
    inputs: dict[str, np.ndarray]
    result: api.Result
    origin: str


def _generated_shape(args) -> tuple[int, int, int, np.dtype]:
    """B, T, H and dtype of generated inputs: the options given, else the defaults (with --cu-seqlens, one
    packed row as long as the last offset)."""
    packed = args.cu_seqlens is not None
    if packed and args.inputs is None:  # (the packed inputs' shape is the offsets': other sizes cannot fit)
        last = args.cu_seqlens[-1]
        if args.tokens is not None and args.tokens != last:
            raise LinrecError(f"--tokens {args.tokens} disagrees with --cu-seqlens, which ends at {last}: the packed "
                              f"inputs have T = the last offset; drop --tokens (or give --tokens {last})")
        if args.batch is not None and args.batch != 1:
            raise LinrecError(f"--batch {args.batch} with --cu-seqlens: packed sequences lie in one row (B = 1), "
                              f"each sequence its own state; drop --batch")
    batch = args.batch or (1 if packed else RUN_BATCH)
    tokens = args.tokens or (max(args.cu_seqlens[-1], 1) if packed else RUN_TOKENS)
    # a state dtype asks for float32 inputs: bfloat16 states go with float32 inputs only, and a float32 state
    # is kept in the inputs' dtype (float64 inputs would make it float64, which the run refuses)
    default = "float32" if getattr(args, "state_dtype", None) else RUN_DTYPE
    return batch, tokens, args.heads or RUN_HEADS, np.dtype(args.dtype or default)


def _auto_form(rec, args) -> str:
    """The form `--form auto` runs: Recurrence.choose_form's pick for the backend at the run's sizes (those of
    the arrays in --inputs when given), said on stderr unless --quiet."""
    batch, tokens, heads, dtype = _generated_shape(args)
    if args.inputs is not None:
        names = {x.name for x in rec.program.inputs}
        first = next((v for k, v in _read_npz(args.inputs).items() if k in names), None)
        if first is not None and first.ndim >= 3:
            batch, tokens, heads = first.shape[:3]
            # (another dtype: the run below names the array and the file in its error)
            dtype = first.dtype if first.dtype.type in FLOAT_DTYPES else dtype
    sizes = dims_with_overrides(rec.program, args.dims or [])  # (an unknown or oversized --dim named as such)
    form, why = rec.choose_form(args.backend, tokens, heads, batch, sizes, dtype)
    if not args.quiet:
        print(f"{PROG}: form auto → {form} ({why})", file=sys.stderr)
    return form


def _run_form(rec, form: str, args, inputs, params=None, initial_state=None):
    """rec.run with the chosen form; --form step goes token by token through Recurrence.step."""
    serving = {"state_every": args.state_every, "keep_last": args.keep_last, "cu_seqlens": args.cu_seqlens}
    if form == "step":
        given = [f"--{name.replace('_', '-')}" for name, value in serving.items() if value is not None]
        if given:
            raise LinrecError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to the sequence forms, "
                              f"not to --form step; choose {' or '.join(rec.forms)}")
        return run_by_steps(rec, inputs, backend=args.backend, params=params, initial_state=initial_state,
                            state_dtype=args.state_dtype)
    return rec.run(inputs, form=form, backend=args.backend, params=params, initial_state=initial_state,
                   chunk_size=args.chunk_size, state_dtype=args.state_dtype, **serving)


def _refuse_generation_options(args) -> None:
    """With --inputs the sizes and dtype come from the arrays: an option that shapes generated inputs (or
    --save-inputs) is an error, not silently ignored."""
    given = [f"--{o.rstrip('s') if o == 'dims' else o}" for o in GENERATION_OPTIONS if getattr(args, o) is not None]
    if given or args.save_inputs:
        extra = ", ".join(given + (["--save-inputs"] if args.save_inputs else []))
        verb = "applies" if "," not in extra else "apply"
        raise LinrecError(f"{extra} {verb} only to generated inputs; with --inputs the sizes and dtype come "
                          f"from the arrays in {args.inputs}")


def _run_on_file(rec, form: str, args) -> RunOutcome:
    """The form run on the arrays of --inputs: inputs, initial states and params by DSL name (an input error
    names the file)."""
    _refuse_generation_options(args)
    inputs, state0, params = _split_arrays(rec.program, _read_npz(args.inputs), args.inputs)
    try:
        result = _run_form(rec, form, args, inputs, params=params or None, initial_state=state0 or None)
    except RuntimeInputError as err:
        if err.filename is None and err.span is None:
            err.filename = args.inputs  # the arrays came from this file: say so
        raise
    return RunOutcome(inputs, result, f"from {args.inputs}")


def _refuse_params_without_default(program) -> None:
    """Generated inputs do not make params: a param without a default must come from --inputs."""
    missing = [prm for prm in program.params if prm.default is None]
    if missing:
        shapes = ", ".join(f"'{prm.name}' {_shape((['H'] if prm.per_head else []) + list(prm.shape))}"
                           for prm in missing)
        raise LinrecError(f"param(s) {shapes} have no default, so generated inputs are not enough: "
                          f"write the inputs and these params to an .npz file and pass it with --inputs")


def _params_at(rec, sizes: dict[str, int], heads: int) -> dict[str, np.ndarray] | None:
    """A size only params (not inputs) fix reaches the run through the params' defaults at that size: those
    defaults when such a size differs from the file's, else None (the run makes its own)."""
    program = rec.program
    declared = {dim.name: dim.default for dim in program.dims}
    from_inputs = {d for x in program.inputs for d in x.shape}
    if all(d in from_inputs or sizes[d] == declared[d] for d in sizes):
        return None
    return {k: v for k, v in rec.default_params(heads, sizes).items() if v is not None}


def _run_on_generated(rec, form: str, args) -> RunOutcome:
    """The form run on seeded random inputs that respect the declared ranges (written to --save-inputs when
    given)."""
    sizes = dims_with_overrides(rec.program, args.dims or [])
    _refuse_params_without_default(rec.program)
    batch, tokens, heads, dtype = _generated_shape(args)
    seed = RUN_SEED if args.seed is None else args.seed
    inputs = rec.random_inputs(batch=batch, tokens=tokens, heads=heads, dims=sizes, dtype=dtype, seed=seed)
    result = _run_form(rec, form, args, inputs, params=_params_at(rec, sizes, heads))
    dim_text = ", ".join(f"{k}={v}" for k, v in sizes.items())
    origin = f"random, seed {seed}, B={batch}, T={tokens}, H={heads}" + (f", {dim_text}" if dim_text else "")
    if args.save_inputs:
        origin += f"; saved to {_write_npz(args.save_inputs, inputs, '--save-inputs')}"
    return RunOutcome(inputs, result, origin)


def _run_summary(name: str, form: str, args, ran: RunOutcome, written: str | None) -> str:
    """What ran and on what, a table of statistics of every input, output and final state, the params as
    used, and the file written."""
    dtype = next(iter(ran.inputs.values())).dtype if ran.inputs else "?"
    how = f"{form} form, {args.backend} backend, {dtype}" if form != "step" else \
        f"one decode step per token (Recurrence.step), {args.backend} backend, {dtype}"
    if form == "chunkwise" and args.chunk_size:
        how += f", chunk size {args.chunk_size}"
    result = ran.result
    if args.state_dtype == BFLOAT16:
        how += ", bfloat16 state"
    lines = [f"{name}: {how}", f"inputs: {ran.origin}"]

    def values(states):  # (the statistics of a bfloat16 state's values, not of its bits)
        return {k: from_bfloat16(v) if v.dtype == BFLOAT16_BITS else v for k, v in states.items()}
    lines += _summary([("input", ran.inputs), ("output", result.outputs), ("state", values(result.final_state)),
                       ("checkpoint", values(result.checkpoints)), ("last", values(result.last_states))])
    if result.checkpoint_offsets.size:
        lines.append(f"checkpoint offsets (per packed sequence): {','.join(map(str, result.checkpoint_offsets))}")
    if result.params:
        lines += ["params (as used):"] + _param_rows(result.params)
    if written:
        lines.append(f"wrote {len(_saved(result))} array(s) to {written}")
    return "\n".join(lines)


def _saved(result: api.Result) -> dict[str, np.ndarray]:
    """What --out writes: outputs, final states and params by DSL name, checkpoints and last states as
    checkpoints.NAME and last_states.NAME, and checkpoint_offsets (packed runs)."""
    arrays = {**result.outputs, **result.final_state, **result.params}
    arrays |= {f"checkpoints.{k}": v for k, v in result.checkpoints.items()}
    arrays |= {f"last_states.{k}": v for k, v in result.last_states.items()}
    if result.checkpoint_offsets.size:
        arrays["checkpoint_offsets"] = result.checkpoint_offsets
    return arrays


def cmd_run(args) -> int:
    """Run a form of a program on seeded random inputs or on arrays from an .npz file.

    Without --inputs it generates seeded random inputs that respect the declared ranges and prints a
    summary of the shapes and a few statistics of every output, final state and parameter. With --out
    it writes every output, final state and parameter used to an .npz file, by DSL name.
    """
    rec = _load(args.file)
    targets = {option: os.path.realpath(_npz_target(path, option))
               for path, option in ((args.out, "--out"), (args.save_inputs, "--save-inputs")) if path}
    if len(targets) == 2 and targets["--out"] == targets["--save-inputs"]:  # (the results would overwrite the inputs)
        raise LinrecError(f"--save-inputs {args.save_inputs} and --out {args.out} name the same file, "
                          f"{targets['--out']}: give them different names")
    for path, option in ((args.out, "--out"), (args.save_inputs, "--save-inputs")):
        if path and not args.quiet and _is_stdout(path):  # (the summary would land inside the .npz)
            raise LinrecError(f"{option} {path} writes the .npz to standard output, where the run's summary goes "
                              f"too: add --quiet")
        if path and _is_stdout(path, sys.stderr) and not _is_stdout(path):  # (notes and warnings go there)
            raise LinrecError(f"{option} {path} writes the .npz to standard error, where linrec's notes and "
                              f"warnings go too: write it to standard output (with --quiet) or to a file")
    try:  # (before the form is chosen and its note said, as every other size option is checked as the command starts)
        check_chunk_size(args.chunk_size)
    except RuntimeInputError:
        raise LinrecError(f"--chunk-size {args.chunk_size}: {CHUNK_SIZE_RULE}; leave it out for the form's "
                          f"default") from None
    form = _auto_form(rec, args) if args.form == "auto" else args.form
    if args.chunk_size is not None and form != "chunkwise":
        print(f"{PROG}: note: --chunk-size only affects the chunkwise form (running the {form} form)",
              file=sys.stderr)
    ran = _run_on_file(rec, form, args) if args.inputs is not None else _run_on_generated(rec, form, args)
    result = ran.result
    written = _write_npz(args.out, _saved(result)) if args.out else None
    if not args.quiet:
        print(_run_summary(rec.program.name, form, args, ran, written))
    return 0


# ---- verify ----------------------------------------------------------------------------------
def _add_verify(parser: argparse.ArgumentParser):
    parser.add_argument("file", type=PROGRAM_PATH, metavar="FILE", help="a program file (.lin)")
    parser.add_argument("--backend", action="append", choices=_backend_names(),
                        help="check this backend (repeatable; default: every backend)")
    parser.add_argument("--form", action="append", choices=_form_names() + ["step"],
                        help="check this form (repeatable; default: every form the program has, and 'step': "
                             "the tokens one at a time through the decode step, up to 200 tokens)")
    parser.add_argument("--dtype", action="append", choices=("float32", "float64"),
                        help="check this dtype (repeatable; default: both)")
    parser.add_argument("--state-dtype", choices=("float32", BFLOAT16), metavar="{float32,bfloat16}",
                        help="bfloat16: also the decode step with its state kept in bfloat16 (float32 tokens; "
                             "rows 'float32+bf16', form step, at their own tolerance, docs/serving.md)")
    parser.add_argument("--quick", action="store_true", help="a shorter battery (long T = 2048, fewer cases)")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    parser.add_argument("--seed", type=_nonnegative_int, default=0, help="seed of the generated inputs")
    parser.add_argument("--against", type=PROGRAM_PATH, metavar="EXACT.lin",
                        help="instead: the error of FILE's outputs against EXACT's on the same inputs, for "
                             "16, 64, 256, 1024 random features, orthogonal and i.i.d. (e.g. Performer "
                             "against examples/softmax.lin)")
    parser.add_argument("--seeds", type=_positive_int, help=f"seeds averaged by --against (default: {AGAINST_SEEDS})")
    parser.add_argument("--grad", action="store_true",
                        help="instead: the gradient forms: the recurrent one against central finite differences "
                             "of the float64 forward, the others against it (docs/gradients.md)")
    parser.add_argument("--dim", dest="dims", action=_DimOnce, type=_dim, metavar="NAME=SIZE",
                        help="a dimension's size in every case (repeatable; default: small and odd sizes) — "
                             "the head sizes a model uses, at which the C kernels tile, block and split as "
                             "they will run")
    parser.epilog = """\
examples:
  linrec verify examples/performer.lin --against examples/softmax.lin
  linrec verify examples/gla.lin --grad --quick
  linrec verify examples/gla.lin --backend c --dim dk=128 --dim dv=128 --quick
  linrec verify examples/gated_deltanet.lin --form step --state-dtype bfloat16
  linrec verify examples/gla.lin
  linrec verify examples/deltanet.lin --quick --json > deltanet.json

Each row compares one form on one backend in one dtype, on one case of generated inputs
(T = 1, ragged T, odd sizes, several B and H, mild and strong decay, long T; chunk sizes vary),
with the float64 NumPy recurrent form: outputs and final states, as max|x − ref| (max abs) and
max|x − ref| / max|ref| (max rel). Tolerances: 1e-9 in float64, 5e-4 in float32.
The last rows check what serving asks of each form (docs/serving.md): checkpoints (state_every), the
last K states (keep_last), packed batches (cu_seqlens, ragged lengths with 0 and 1) and the slot-pool
decode step (other slots bit-identical).
Exit status 1 when any row fails."""


AGAINST_SEEDS = 8  # verify --against: seeds averaged per row
MAX_SEEDS = 1000  # … and the most --seeds may ask for (each seed runs both programs at every feature count)


def _verify_against(rec, exact, args) -> int:
    """`verify --against EXACT.lin`: the relative error of rec's outputs against exact's on the same inputs,
    one row per feature count and kind, mean over --seeds."""
    printed_header = False

    def on_row(row):  # (the header with the first row: a comparison refused at its start prints none)
        nonlocal printed_header
        if not printed_header:
            print(f"{rec.name} against {exact.name}: relative error ‖o − o_exact‖/‖o_exact‖, mean over seeds")
            print(quality.HEADER)
            printed_header = True
        print(quality.format_row(row), flush=True)
    rows = quality.compare(rec, exact, seeds=args.seeds or AGAINST_SEEDS, on_row=None if args.json else on_row)
    if args.json:
        print(json.dumps({"program": rec.name, "against": exact.name, "rows": [r.__dict__ for r in rows]}))
    return 0


def _verify_gradients(rec, args) -> int:
    """`verify --grad`: every gradient form a backend builds, on the gradient battery (verify_grad)."""
    backends = args.backend or _backend_names()
    built = verify_grad.gradient_forms(rec, backends)
    if not built:
        why = "; ".join(f"{f} on {b}: {w}" for f, b, w in verify_grad.missing(rec, backends) if f == "recurrent")
        raise LinrecError(f"'{rec.name}' has no gradient form to verify: {why}")
    for form in args.form or ():
        if form not in {f for f, _ in built}:
            why = "; ".join(f"on {b}: {w}" for f, b, w in verify_grad.missing(rec, backends) if f == form)
            raise LinrecError(f"'{rec.name}' has no {form} gradient form to verify"
                              + (f" ({why})" if why else "") + "; the gradient forms built: "
                              + ", ".join(dict.fromkeys(f for f, _ in built)))
    if not args.json:
        first = verify_grad.reference_form(rec)
        print(f"{rec.name}: the {first} gradient against central finite differences of the float64 {first} "
              f"forward, the other gradient forms against it{_sizes_said(args.sizes)}")
        print(verify.HEADER)
    rows = verify_grad.run(rec, backends=backends, dtypes=tuple(args.dtype or ("float64", "float32")),
                           quick=args.quick, seed=args.seed, forms=args.form, sizes=args.sizes,
                           on_row=None if args.json else lambda r: print(verify.format_row(r), flush=True))
    failed = [r for r in rows if not r.passed]
    absent = verify_grad.missing(rec, backends)
    if args.json:
        print(json.dumps({"program": rec.name, "file": args.file, "passed": not failed,
                          "not_implemented": [{"form": f, "backend": b, "why": why} for f, b, why in absent],
                          "tolerance": {"finite differences": verify_grad.FD_TOLERANCE,
                                        "float32": verify_grad.FLOAT32_TOLERANCE},
                          "rows": [r.as_dict() for r in rows]}, indent=1))
    else:
        print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _sizes_said(sizes: dict | None) -> str:
    return "" if not sizes else "; in every case " + ", ".join(f"{name} = {size}" for name, size in sizes.items())


def _verify_sizes(rec, dims) -> dict | None:
    """verify --dim: the sizes for every case (a dimension the file lacks, or too large: an error). The
    sequence's bound (a header's `T = …`) is not one of them: each case has its own length."""
    if not dims:
        return None
    dims_with_overrides(rec.program, dims)
    if any(name == SEQ for name, _ in dims):
        raise LinrecError(f"--dim {SEQ}=…: verify runs each case at its own sequence length (T = 1 up to a long "
                          f"one, within the file's bound); leave it out, or change the bound in the file")
    return dict(dims)


def cmd_verify(args) -> int:
    """Check every form on every backend against the float64 recurrent form.

    Runs a battery of generated inputs that fit each input's declared range and prints one row per
    (form, backend, dtype, case) with its errors, its tolerance and pass or FAIL.
    """

    rec = _load(args.file)
    if args.seeds is not None and args.seeds > MAX_SEEDS:
        raise LinrecError(f"--seeds {args.seeds}: at most {MAX_SEEDS} seeds (each runs both programs over every "
                          f"feature count); ask for fewer")
    if args.seeds is not None and not args.against:
        raise LinrecError("--seeds goes with --against (the seeds it averages); leave it out")
    if args.grad and args.state_dtype == BFLOAT16:
        raise LinrecError("verify --grad checks gradients of float32 and float64 states; leave out --state-dtype")
    if args.grad and args.against:
        raise LinrecError("--grad and --against are two checks (the gradient forms; the outputs against another "
                          "program's): run them one at a time")
    ignored = [option for option, given in (("--quick", args.quick), ("--form", args.form), ("--backend", args.backend),
                                            ("--dtype", args.dtype), ("--state-dtype", args.state_dtype),
                                            ("--seed", args.seed != 0), ("--dim", args.dims)) if given]
    if args.against and ignored:  # (found by probing: they were silently ignored; --seed read as a change)
        raise LinrecError(f"--against compares the outputs on its own inputs (every feature count, --seeds "
                          f"seeds, float64 NumPy), which {', '.join(ignored)} would not change: leave "
                          f"{'it' if len(ignored) == 1 else 'them'} out")
    for repeatable in ("backend", "form", "dtype"):  # (a repeated choice once: each row was checked again)
        if getattr(args, repeatable):
            setattr(args, repeatable, list(dict.fromkeys(getattr(args, repeatable))))
    if args.state_dtype == BFLOAT16 and (args.dtype and "float32" not in args.dtype
                                         or args.form and "step" not in args.form):
        raise LinrecError("--state-dtype bfloat16 checks the decode step (form step) on float32 tokens with the "
                          "state kept in bfloat16; with this --dtype or --form there is no such row: add "
                          "--dtype float32 and --form step, or leave them out")
    if args.against:
        return _verify_against(rec, _load(args.against), args)
    args.sizes = _verify_sizes(rec, args.dims)
    if args.grad:
        return _verify_gradients(rec, args)
    backends = args.backend or _backend_names()
    forms = args.form or list(rec.forms) + verify.decode_forms(rec)
    for form in forms:
        why = verify.why_not(rec, form)
        if why:
            raise LinrecError(f"'{rec.name}' has no {form} form: {why}")
    printed_header = False

    def on_row(row):
        nonlocal printed_header
        if args.json:
            return
        if not printed_header:
            ref = verify.reference_form(rec)
            ref = "recurrent form as written (not stabilized)" if ref == DEFINITION else f"{ref} form"
            print(f"{rec.name}: every form against the float64 {ref} (numpy){_sizes_said(args.sizes)}")
            print(verify.HEADER)
            printed_header = True
        print(verify.format_row(row), flush=True)

    progress = verify.progress_to_stderr if (args.json or sys.stderr.isatty()) else None
    rows = verify.run(rec, backends=backends, forms=forms, dtypes=tuple(args.dtype or ("float64", "float32")),
                      quick=args.quick, seed=args.seed, on_row=on_row, on_progress=progress,
                      state_bf16=args.state_dtype == BFLOAT16, notes=(notes := []), sizes=args.sizes)
    if not rows:  # (a pass that checked nothing would read as a pass)
        raise LinrecError(f"nothing to check: with these options the only row would be the reference itself "
                          f"(the float64 {verify.reference_form(rec)} form on numpy); add a backend, a dtype or "
                          f"a form")
    failed = [r for r in rows if not r.passed]
    absent = verify.missing(rec, backends, forms)
    if args.json:
        print(json.dumps({"program": rec.name, "file": args.file, "passed": not failed,
                          "not_implemented": [{"form": f, "backend": b, "why": why} for f, b, why in absent],
                          "tolerance": verify.TOLERANCE, "notes": notes, "rows": [r.as_dict() for r in rows]},
                         indent=1))
    else:
        for note in notes:
            print(f"note: {note}")
        for form, backend, why in absent:
            print(f"note: the {backend} backend does not build the {form} form" + (f": {why}" if why else "")
                  + " (not checked)")
        skipped = sum(r.skipped for r in rows)
        print(f"{len(rows) - len(failed) - skipped} passed, {len(failed)} failed"
              + (f", {skipped} skipped (not comparable: see the notes)" if skipped else ""))
    return 1 if failed else 0


# ---- bench -----------------------------------------------------------------------------------
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _dk_dv(text: str) -> tuple[int, int]:
    """DKxDV (e.g. 128x64) → (128, 64)."""
    parts = text.lower().replace("×", "x").split("x")
    try:
        dk, dv = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DKxDV such as 128x64, got {text!r}") from None
    if dk < 1 or dv < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes in DKxDV, got {text!r}")
    return dk, dv


def _add_bench(parser: argparse.ArgumentParser):
    parser.add_argument("file", type=PROGRAM_PATH, metavar="FILE", help="a program file (.lin)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: T in {{{', '.join(map(str, bench.QUICK_TOKENS))}}}, "
                             f"{bench.QUICK_REPEATS} repeats, shorter timings")
    parser.add_argument("--T", dest="tokens", action="append", type=_positive_int, metavar="T",
                        help="a sequence length (repeatable; default: "
                             f"{', '.join(map(str, bench.DEFAULT_TOKENS))})")
    parser.add_argument("--form", action="append", choices=_form_names() + ["auto"],
                        help="time this form (repeatable; default: every form the program has); auto: the "
                             "form Recurrence.choose_form picks for each T and backend (--grad: and the backward "
                             "form=\"auto\" runs)")
    parser.add_argument("--backend", action="append", choices=_backend_names(),
                        help="time this backend (repeatable; default: every backend)")
    parser.add_argument("--state-dtype", choices=("float32", BFLOAT16), metavar="{float32,bfloat16}",
                        help="the decode rows' state between calls: bfloat16 halves the state bytes they move "
                             "and are bounded by (default: float32; the T sweep only, not --grad or --shapes)")
    parser.add_argument("--threads", type=_positive_int, metavar="N",
                        help="threads for the C kernels (LINREC_NUM_THREADS) and NumPy's BLAS (default: "
                             "LINREC_NUM_THREADS, else every core)")
    parser.add_argument("--repeats", type=_positive_int, metavar="R",
                        help=f"timed calls per row after the warm-up (default: {bench.REPEATS}; --quick: "
                             f"{bench.QUICK_REPEATS}); a slow row stops earlier, see --budget")
    parser.add_argument("--budget", type=_positive_float, metavar="SECONDS",
                        help=f"stop repeating a row once its timed calls took this long, after at least one "
                             f"(default: {bench.BUDGET_S:g}; --quick: {bench.QUICK_BUDGET_S:g})")
    parser.add_argument("--dim", dest="dims", action=_DimOnce, type=_dim, metavar="NAME=SIZE",
                        help="a dimension's size (default: dk = dv = 64 where declared, else the file's)")
    parser.add_argument("--plot", type=_path("the image file to write"), metavar="OUT.png",
                        help="write a log-log plot of time against T per form and backend (needs matplotlib; "
                             "its folder and format are checked before measuring)")
    parser.add_argument("--no-limits", dest="limits", action="store_false",
                        help="also run the parallel form above T = 4096 and the NumPy recurrent form above "
                             "T = 4096 (slow: T² work, per-token interpreter overhead)")
    parser.add_argument("--grad", action="store_true",
                        help=f"time the backward (Recurrence.vjp, which includes its forward recomputation) "
                             f"against the forward, per form and backend with a gradient form (the others listed "
                             f"with the reason): dk = dv in {{{', '.join(map(str, bench_grad.GRAD_DIMS))}}} (--dim "
                             f"sets one size), T in {{{', '.join(map(str, bench_grad.GRAD_TOKENS))}}} (--T "
                             f"overrides); each row: forward ms, backward ms, backward / fastest forward")
    grid = parser.add_argument_group(
        "the model grid", f"--shapes model: (dk, dv) in {' '.join(f'{a}x{b}' for a, b in bench_shapes.MODEL_DIMS)}, "
        f"H in {', '.join(map(str, bench_shapes.MODEL_HEADS))}, B in "
        f"{', '.join(map(str, bench_shapes.MODEL_BATCHES))}, T in {', '.join(map(str, bench_shapes.MODEL_TOKENS))} "
        f"(prefill; C backend unless --backend; {bench_shapes.GRID_REPEATS} repeats), and the decode step of "
        "one request at each (dk, dv) and H; these options keep parts of it")
    grid.add_argument("--shapes", choices=["model", "serving"],
                      help="model: run the model grid instead of the T sweep; serving: the slot-pool decode step "
                           "and the packed prefill (below)")
    grid.add_argument("--grid-dims", dest="grid_dims", action="append", type=_dk_dv, metavar="DKxDV",
                      help="only this (dk, dv), e.g. 128x64 (repeatable)")
    grid.add_argument("--heads", action="append", type=_positive_int, metavar="H", help="only this H (repeatable)")
    grid.add_argument("--batch", dest="batches", action="append", type=_positive_int, metavar="B",
                      help="only this B for the prefill (repeatable); --shapes serving: the number of sequences "
                           "packed")
    grid.add_argument("--no-decode", dest="decode", action="store_false", help="leave out the decode steps")
    serving = parser.add_argument_group(
        "serving", f"--shapes serving: the slot-pool decode step (Recurrence.bind_step(…, slots=idx)) of N in "
        f"{', '.join(map(str, bench_serving.REQUESTS))} requests in a pool of {bench_serving.POOL_SLOTS} slots, "
        f"tokens/s and µs against its state bytes at the memory bandwidth; and the prefill of "
        f"{bench_serving.PREFILL_SEQUENCES[0]} sequences of mixed lengths up to T_max = "
        f"{bench_serving.PREFILL_TOKENS[0]} packed (cu_seqlens) against the same padded to T_max (ratio of "
        f"times); H = {bench_serving.SERVING_HEADS[0]}, dk = dv = {bench_serving.SERVING_DIMS[0][0]}, C backend "
        f"unless --backend, forms {' and '.join(bench_serving.PREFILL_FORMS)} unless --form; --grid-dims, "
        f"--heads, --T (T_max), --batch (sequences) and --no-decode change it too")
    serving.add_argument("--requests", action="append", type=_positive_int, metavar="N",
                         help="with --shapes serving: this many active requests a decode step (repeatable)")
    serving.add_argument("--pool", type=_positive_int, metavar="P",
                         help=f"with --shapes serving: slots in the pool (default {bench_serving.POOL_SLOTS})")
    parser.epilog = """\
examples:
  linrec bench examples/gla.lin
  linrec bench examples/gated_deltanet.lin --threads 1 --json > gdn_1thread.json
  linrec bench examples/gla.lin --quick --backend c --form auto
  linrec bench examples/gla.lin --T 4096 --form recurrent --form chunkwise --plot gla.png
  linrec bench examples/gla.lin --shapes model --grid-dims 128x128 --heads 16 --T 4096 --form recurrent
  linrec bench examples/gated_deltanet.lin --shapes serving --requests 64 --json
  linrec bench examples/gla.lin --grad --dim dk=64 --dim dv=64 --T 4096

B = 1, H = 8, dk = dv = 64, float32. Each row is the median wall time of Recurrence.run (after one
warm-up call) and its useful GFLOP/s — the recurrent form's flops per token and head (2·dk·dv per
rank-one update, terms with the same left vector counted once; 2·dk·dv per correction wᵀS and per
readout; nothing for a diagonal or scalar decay, applied lazily), the same count for every form — against
its bound: the time those flops take at the cores' float32 multiply-add peak, measured in the same run
(12 independent register chains per thread). The decode step is held against the time its state bytes
(read and written) take at the memory bandwidth measured in the same run (STREAM's triad over arrays
larger than the last-level cache). An extra column gives the fraction of a float32 NumPy matmul timed
in the same run (OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset; the BLAS kernel shown when threadpoolctl
is installed): it moves with the OpenBLAS build. The parallel form (T² work, every backend) and the NumPy
recurrent form are not run above T = 4096 unless --no-limits. Also: state bytes against a softmax KV
cache, what --form auto picks, the C kernel's first build and cached load.
pip install 'linrec[bench]' adds threadpoolctl and matplotlib."""


def cmd_bench(args) -> int:
    """Time every form on every backend against the machine's limits measured in the same run.

    Reports median ms, tokens/s, useful GFLOP/s and their fraction of the multiply-add-peak bound (and
    of a same-run matmul) for each form, backend and sequence length, the decode-step time per token
    against its memory-bandwidth bound, state against KV-cache bytes, the automatic form choice and the
    C kernel's build and cached-load times; with --shapes model, the model grid of shapes; with --shapes
    serving, the slot-pool decode step and the packed prefill against the padded one; with --grad, the
    backward (Recurrence.vjp) against the forward.
    """
    grid_only = [name for name, given in (("--grid-dims", args.grid_dims), ("--heads", args.heads),
                                          ("--batch", args.batches), ("--no-decode", not args.decode)) if given]
    if grid_only and not args.shapes:
        raise LinrecError(f"{', '.join(grid_only)} keep parts of the model grid: add --shapes model (or serving)")
    serving_only = [name for name, given in (("--requests", args.requests), ("--pool", args.pool)) if given]
    if serving_only and args.shapes != "serving":
        raise LinrecError(f"{', '.join(serving_only)} set the slot-pool decode step: add --shapes serving")
    if args.shapes and (args.plot or args.dims):
        raise LinrecError(f"--shapes {args.shapes} sets dk and dv itself and has no --plot: use --grid-dims"
                          + (", and benchmarks/model_shapes.py plot for a plot" if args.shapes == "model" else ""))
    if args.grad and (args.shapes or args.plot):
        raise LinrecError("--grad has its own sizes and no plot: leave out --shapes and --plot (--dim and --T "
                          "choose the sizes)")
    if args.state_dtype == BFLOAT16 and (args.grad or args.shapes):
        # only the T sweep's decode rows keep a state between calls that could be bfloat16
        raise LinrecError(f"--state-dtype bfloat16 sets the T sweep's decode rows; {'--grad' if args.grad else '--shapes ' + args.shapes} "
                          f"times float32 states only: leave out --state-dtype")
    _load(args.file)  # its warnings, as every command gives them (the run compiles the file again: milliseconds)
    opts = bench.Options(file=args.file, quick=args.quick, forms=args.form, backends=args.backend,
                         threads=args.threads, repeats=args.repeats, budget_s=args.budget,
                         dims=dict(args.dims or []), plot=args.plot, limits=args.limits, shapes=args.shapes,
                         grid_dims=args.grid_dims, heads=args.heads, batches=args.batches, decode=args.decode,
                         state_dtype=args.state_dtype if args.state_dtype == BFLOAT16 else None,
                         requests=args.requests, pool=args.pool)
    if args.tokens:
        opts.tokens = list(args.tokens)
    elif args.shapes == "model":
        opts.tokens = list(bench_shapes.MODEL_TOKENS)
    elif args.shapes == "serving":
        opts.tokens = list(bench_serving.PREFILL_TOKENS)
    elif args.grad:
        opts.tokens = list(bench.QUICK_TOKENS if args.quick else bench_grad.GRAD_TOKENS)
    elif args.quick:
        opts.tokens = list(bench.QUICK_TOKENS)
    progress = None
    if args.json or sys.stderr.isatty():
        def progress(text):
            print(f"{PROG} bench: {text}", file=sys.stderr, flush=True)
    module = bench_grad if args.grad else {"model": bench_shapes, "serving": bench_serving}.get(args.shapes, bench)
    report = module.run(opts, progress)
    if args.json:
        print(json.dumps(report, indent=1, ensure_ascii=False))
        if report.get("plot"):
            print(f"{PROG}: {report['plot']}", file=sys.stderr)
    else:
        print(module.format_report(report))
    if report.get("plot_error"):  # the report above stands; only the plot is missing
        print(f"{PROG}: {report['plot_error']}", file=sys.stderr)
        return 1
    return 0


# ---- cache -----------------------------------------------------------------------------------
def _add_cache(parser: argparse.ArgumentParser):
    parser.add_argument("action", choices=("info", "clear"),
                        help="info: where the cache is, its entries and their sizes and ages; clear: delete "
                             "every cached kernel")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.epilog = """\
examples:
  linrec cache info
  linrec cache clear
  LINREC_CACHE_DIR=/tmp/k linrec cache info --json

The cache is $LINREC_CACHE_DIR, else $XDG_CACHE_HOME/linrec, else ~/.cache/linrec. An entry is one
built kernel (the extension, its C source and a checksum), named by a hash of the source, compiler,
flags, target and linrec's version; a corrupted entry is rebuilt when next used. Clearing is safe:
kernels are rebuilt on demand, and builds in progress in other processes are left alone. Exit status 1
when the cache cannot be used (info) or something could not be deleted (clear)."""


def cmd_cache(args) -> int:
    """Show or clear the C backend's on-disk kernel cache.

    `info` lists the cache directory, its entries (built kernels) with their sizes, ages and checksum
    status, and the total bytes; `clear` deletes every entry (kernels are rebuilt when next used).
    """
    if args.action == "info":
        data = c_cache.info()
        print(json.dumps(data, indent=1) if args.json else c_cache.format_info(data))
        if data["problem"]:
            print(f"{PROG}: error: {c_cache.problem_message(data)}", file=sys.stderr)
            return 1
        return 0
    data = c_cache.clear()
    print(json.dumps(data, indent=1) if args.json else c_cache.format_clear(data))
    if data["failed"]:
        print(f"{PROG}: error: {c_cache.failure_message(data)}", file=sys.stderr)
        return 1
    return 0


# ---- the command table and main --------------------------------------------------------------
Handler = Callable[[argparse.Namespace], int]
AddArguments = Callable[[argparse.ArgumentParser], None]

COMMANDS: dict[str, tuple[AddArguments, Handler]] = {
    "check": (_add_check, cmd_check),
    "emit": (_add_emit, cmd_emit),
    "run": (_add_run, cmd_run),
    "verify": (_add_verify, cmd_verify),
    "bench": (_add_bench, cmd_bench),
    "cache": (_add_cache, cmd_cache),
}

EPILOG = """\
first steps:
  linrec check examples/gla.lin       what the compiler understood; which forms exist
  linrec run examples/gla.lin         run it on seeded random inputs
  linrec emit examples/gla.lin        the generated NumPy code

Run `linrec COMMAND --help` for a command's options and examples.
Errors in a program or in arrays print one message and exit with status 1;
set LINREC_DEBUG=1 to see the traceback of an internal error."""


class _Parser(argparse.ArgumentParser):
    """Usage errors are bad input like any other: one message (and where to look), exit status 1. A
    single-valued option is given once (_Once)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name in (None, "store"):  # (add_argument's default action, and the same asked by name)
            self.register("action", name, _Once)

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")

    def _print_message(self, message, file=None):
        """As argparse's, but a write that fails is not dropped: --help and --version into a full disk or a
        closed stdout exited 0 having said nothing (a probe's finding); main() says so, exit status 1."""
        if message:
            (file or sys.stderr).write(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="linrec: a compiler for linear-attention recurrences.\nWrite the per-token update "
                    "rule in a small DSL; get its recurrent, parallel and\nchunkwise forms as readable NumPy "
                    "and as SIMD C kernels (prefill and\none-token decode), each verified against the others.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (add_arguments, handler) in COMMANDS.items():
        doc = textwrap.dedent(handler.__doc__ or "").strip()
        summary, _, rest = doc.partition("\n")
        rest = textwrap.dedent(rest).strip()
        cmd = sub.add_parser(name, help=summary.rstrip("."), formatter_class=argparse.RawDescriptionHelpFormatter,
                             description=summary + ("\n\n" + textwrap.fill(" ".join(rest.split()), 88)
                                                    if rest else ""))
        add_arguments(cmd)
        cmd.set_defaults(handler=handler, command_parser=cmd)
    return parser


def _error(err: LinrecError):
    text = str(err)
    if err.filename is None and err.span is None and text.startswith("error: "):
        text = f"{PROG}: {text}"
    print(text, file=sys.stderr)


# the errors of a write that did not reach its file: a full disk or quota, a file too large, a device's failure,
# a closed descriptor (`linrec emit FILE >&-`: _ClosedOutput)
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF})


class _ClosedOutput:
    """sys.stdout where the process started without one (`>&-`: Python sets it to None, and print() then drops
    everything silently): a command that prints nothing still succeeds, and the first write fails as a write to a
    closed descriptor does, to be said as 'cannot write the output' (exit 1)."""

    def write(self, text: str) -> int:
        if text:
            raise OSError(errno.EBADF, "standard output is closed")
        return 0

    def flush(self) -> None:
        pass


def _output_failed(err: Exception) -> bool:
    """Whether the error is the output's write failing (`linrec check FILE > /dev/full`): the machine's
    condition, not a bug in linrec. A write to a stream raises without a file name; opening or reading a file
    names it."""
    return isinstance(err, OSError) and err.errno in OUTPUT_ERRNOS and err.filename is None


def _say_output_failed(err: OSError) -> None:
    """Say so, and silence stdout: its unwritten rest would fail again as Python exits."""
    print(f"{PROG}: cannot write the output: {err.strerror or os.strerror(err.errno)}", file=sys.stderr)
    try:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
    except OSError:
        pass


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """linrec's own warnings (their text starts "linrec: ") as the command's other messages are, one line on
    stderr — not with the Python file and source line that raised them; any other warning as Python shows it."""
    text = str(message)
    if text.startswith(f"{PROG}: "):
        print(f"{PROG}: warning: {text[len(PROG) + 2:]}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:
        sys.stdout = _ClosedOutput()
    for stream in (sys.stdout, sys.stderr):  # never crash on a terminal that cannot show ·, ⊗ or −
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError):
            pass
    parser = build_parser()
    # (a command's unknown option is the command's usage error: its name and its --help, not the top level's)
    try:  # --help and --version print, then exit here: their output is checked as any other's
        try:
            args, unknown = parser.parse_known_args(argv)
        except SystemExit as done:
            if done.code in (0, None):
                sys.stdout.flush()  # (a buffered stdout fails here, an unbuffered one in _Parser._print_message)
            raise
    except OSError as err:
        if not _output_failed(err):
            raise
        _say_output_failed(err)
        return 1
    if unknown:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 1
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            _refuse_oversized(args)
            status = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handling below
        return status
    except LinrecError as err:
        _error(err)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except MemoryError as err:  # sizes too large for this machine: bad input, not a bug
        print(f"{PROG}: error: out of memory ({err or 'an allocation failed'}); the program's dimensions or "
              f"--batch/--tokens/--heads ask for more than this machine has: make them smaller "
              f"(--dim NAME=SIZE overrides a dimension)", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `linrec emit FILE | head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return 0
    except Exception as err:  # noqa: BLE001 - the last line of defence: no traceback unless asked
        if _output_failed(err):  # (not a bug: the output's disk is full, say)
            _say_output_failed(err)
            return 1
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            traceback.print_exc()
        else:
            print(f"{PROG}: internal error: {type(err).__name__}: {err}\n"
                  f"(this is a bug in linrec; set {DEBUG_VARIABLE}=1 to see the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Programs that read other tokens directly — seq(x), parameters over the sequence axis, lsh_attention —
instead of carrying a state: softmax attention and its sequence-level relatives. Which forms they have
follows from how the sequence is used:

* attention: seq(…) of per-token values only. Recurrent (a KV cache: the visible keys and values),
  parallel (dense, masked) and — when every contraction over the sequence is softmax(s)·V — chunkwise
  (blocked online softmax, flash-attention style).
* mixing: a parameter spans the sequence axis (Linformer's E·seq(k)): every output depends on every
  position, future ones included — parallel only, and only non-causal.
* lsh: lsh_attention(q, v) (Reformer) — the bucketed form (chunkwise) and its dense reference (parallel).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..dsl.errors import LinrecError

from . import ir
from .analysis import inline_lets, rebuild, to_text, walk
from .builtins import BUILTINS, SEQ, SEQUENCE


@dataclass(frozen=True)
class SoftmaxReadout:
    """softmax(scores)·values, both over the sequence axis: blocked with an online softmax."""

    index: int
    scores: ir.Expr   # shape (T,)
    values: ir.Expr   # shape (T, *)


@dataclass(frozen=True)
class SequencePlan:
    kind: str                                   # "attention" | "mixing" | "lsh"
    window: int                                 # 0: every visible position
    softmax_readouts: tuple[SoftmaxReadout, ...]
    outputs: tuple[tuple[str, ir.Expr], ...]    # outputs with softmax readouts as ReadoutRef
    unavailable: tuple[tuple[str, str], ...]


def applications(e: ir.Expr, function: str) -> list[ir.Apply]:
    """The calls of a builtin (`seq`, `lsh_attention`, …) in an expression."""
    return [n for n in walk(e) if isinstance(n, ir.Apply) and n.function == function]


def _reads_sequence(e: ir.Expr) -> bool:
    return bool(applications(e, "seq")) or any(isinstance(n, ir.ParamRef) and SEQ in n.shape for n in walk(e))


def _mixes_positions(e: ir.Expr) -> ir.Expr | None:
    """The first part of e (softmax's scores s or its values V) that combines different positions' values —
    a builtin over the sequence axis (softmax, l2norm, mean, … of a [T] vector) or a contraction over it —
    else None. The chunkwise form computes s and V one block of keys at a time, so each position's entries must
    follow from that position's values alone."""
    for n in walk(e):
        if isinstance(n, ir.Apply) and n.function in BUILTINS and BUILTINS[n.function].kind != "elementwise" \
                and n.args[0].shape[-1:] == (SEQ,):
            return n
        if isinstance(n, ir.Dot) and n.left.shape[-1:] == (SEQ,) and n.right.shape:  # (by a scalar: a scaling)
            return n
    return None


def _sequence_reads(program: ir.Program) -> list[ir.Apply]:
    """Every seq(…) and lsh_attention(…) of the program's outputs, named values and state updates, in order."""
    return [a for step in program.steps for a in walk(step.value)
            if isinstance(a, ir.Apply) and a.function in SEQUENCE]


def inline_sequence_lets(program: ir.Program) -> ir.Program:
    """The program with each named value that reads the sequence (`a = softmax(seq(k)·q)·seq(v)`) written into
    the steps that use it, and dropped: such a value is no value of one token that the forms compute before
    the outputs — plan() finds the attention readouts in the outputs, with the named values inlined — so the
    backends never meet it on its own."""
    inlined: dict[str, ir.Expr] = {}
    steps = []

    def substitute(node: ir.Expr) -> ir.Expr:
        return inlined[node.name] if isinstance(node, ir.LetRef) and node.name in inlined else node

    for step in program.steps:
        value = rebuild(step.value, substitute)
        if isinstance(step, ir.Let) and _reads_sequence(value):
            inlined[step.name] = value
            continue
        steps.append(dataclasses.replace(step, value=value))
    return dataclasses.replace(program, steps=tuple(steps)) if inlined else program


def is_sequence_program(program: ir.Program) -> bool:
    """Whether the program reads the sequence: a seq(…) or lsh_attention(…) anywhere in it — a state's update
    too, which plan() then refuses — or a param over the sequence axis."""
    return bool(_sequence_reads(program)) or any(SEQ in p.shape for p in program.params)


def plan(program: ir.Program) -> SequencePlan:
    outputs = [(o.name, inline_lets(o.value, program.lets), o.value) for o in program.outputs]
    reads = _sequence_reads(program)
    spanning = [p for p in program.params if SEQ in p.shape]
    if program.states:  # (pointed at the first read of the sequence, else the first param over it)
        raise LinrecError(f"a program with states ({', '.join(s.name for s in program.states)}) cannot also "
                          f"read the sequence (seq, lsh_attention, params over '{SEQ}'); write them as two "
                          f"programs", reads[0].span if reads else spanning[0].span)
    seqs = [a for a in reads if a.function == "seq"]
    windows = [int(dict(a.options)["window"]) for a in seqs]
    if len(set(windows)) > 1:
        other = next(a for a, w in zip(seqs, windows) if w != windows[0])
        raise LinrecError(f"every seq(…) of a program must use the same window (found {sorted(set(windows))}); "
                          f"this one differs from the first", other.span)
    window = windows[0] if windows else 0
    lsh = any(a.function == "lsh_attention" for a in reads)
    if spanning:
        kind = "mixing"
        names = ", ".join(p.name for p in spanning)
        if window:  # (the forms would each take the window their own way: the forward ignored it)
            windowed = next(a for a in seqs if dict(a.options)["window"])
            raise LinrecError(f"parameter(s) {names} span the sequence axis '{SEQ}' and mix every position, so a "
                              f"window of seq(…), which limits the positions a token sees, has nothing to limit; "
                              f"leave out `window=`", windowed.span)
        if program.causal:
            raise LinrecError(f"parameter(s) {names} span the sequence axis '{SEQ}' and mix every position, "
                              f"future ones included: there is no causal form — declare the recurrence "
                              f"`noncausal` in its header", spanning[0].span)
        why = (f"{names} mix(es) every position of the sequence, future ones included: there is no recurrent "
               f"state, and no chunk can be finished before the whole sequence is seen")
        unavailable = [("recurrent", why), ("chunkwise", why)]
    elif lsh:
        kind = "lsh"
        unavailable = [("recurrent", "LSH buckets are formed by sorting the whole sequence: there is no "
                                     "recurrent state (the chunkwise form is the bucketed O(T log T) one)")]
    else:
        kind = "attention"
        unavailable = []
    readouts: list[SoftmaxReadout] = []
    extracted: list[ir.Expr] = []  # (each readout as written)
    problems: list[str] = []

    def extract(node: ir.Expr) -> ir.Expr:
        if isinstance(node, ir.Dot) and isinstance(node.left, ir.Apply) and node.left.function == "softmax" \
                and len(node.left.shape) == 1 and node.right.shape[:1] == node.left.shape \
                and _reads_sequence(node):
            inner = next((n for n in walk(node) if isinstance(n, ir.ReadoutRef)), None)  # (extracted: bottom-up)
            if inner is not None:
                raise LinrecError("an attention readout's scores or values use another attention readout (`"
                                  f"{to_text(extracted[inner.index])}`), a second attention over the "
                                  "first one's results; write them as two programs, the first one's output an "
                                  "input of the second", node.left.span)
            r = SoftmaxReadout(len(readouts), node.left.args[0], node.right)
            readouts.append(r)
            extracted.append(node)
            return ir.ReadoutRef(node.shape, r.index)
        return node

    planned = []
    for name, e, original in outputs:
        found = len(readouts)
        replaced = rebuild(e, extract)
        for n in walk(replaced):
            if SEQ in n.shape and not isinstance(n, ir.ReadoutRef):
                problems.append(f"`{to_text(original)}` uses the sequence other than in softmax(s)·V")
                break
        for r in readouts[found:]:
            for part, what in ((r.scores, "scores"), (r.values, "values")):
                mixing = _mixes_positions(part)
                if mixing is not None:
                    problems.append(f"in `{to_text(original)}`, `{to_text(mixing)}` combines the {what} of "
                                    f"different positions, which a block of keys does not hold alone")
        planned.append((name, replaced))
    if kind == "attention" and problems:
        unavailable.append(("chunkwise", "; ".join(dict.fromkeys(problems)) + " — only softmax(s)·V "
                            "contractions are blocked with an online softmax"))
    return SequencePlan(kind, window, tuple(readouts), tuple(planned), tuple(unavailable))

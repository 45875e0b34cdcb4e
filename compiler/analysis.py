"""Small pure functions over IR expressions: children, rebuilding, what an expression depends on."""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable, Iterator

from . import ir
from .builtins import BUILTINS, SEQUENCE

_CHILD_FIELDS = {
    ir.Apply: ("args",), ir.Neg: ("operand",), ir.Arith: ("left", "right"), ir.Dot: ("left", "right"),
    ir.Outer: ("left", "right"), ir.Diag: ("operand",),
}


def children(e: ir.Expr) -> tuple[ir.Expr, ...]:
    if isinstance(e, ir.Apply):
        return e.args
    return tuple(getattr(e, f) for f in _CHILD_FIELDS.get(type(e), ()))


def rebuild(e: ir.Expr, fn: Callable[[ir.Expr], ir.Expr]) -> ir.Expr:
    """Apply `fn` bottom-up: children first, then the node rebuilt from the new children."""
    if isinstance(e, ir.Apply):
        e = dataclasses.replace(e, args=tuple(rebuild(a, fn) for a in e.args))
    elif type(e) in _CHILD_FIELDS:
        e = dataclasses.replace(e, **{f: rebuild(getattr(e, f), fn) for f in _CHILD_FIELDS[type(e)]})
    return fn(e)


def walk(e: ir.Expr) -> Iterator[ir.Expr]:
    yield e
    for c in children(e):
        yield from walk(c)


def inline_lets(e: ir.Expr, lets: dict[str, ir.Expr]) -> ir.Expr:
    """Replace every LetRef by its definition (recursively)."""
    def sub(node):
        if isinstance(node, ir.LetRef):
            return inline_lets(lets[node.name], lets)
        return node
    return rebuild(e, sub)


def product_factors(e: ir.Expr, divisions: bool = False) -> list[ir.Expr]:
    """The factors of a product (nested multiplications, and products with a scalar written `s·x`, flattened),
    in order — with `divisions`, a quotient's numerator's and denominator's too; e itself if it is none."""
    ops = ("mul", "div") if divisions else ("mul",)
    if (isinstance(e, ir.Arith) and e.op in ops) or (isinstance(e, ir.Dot) and not (e.left.shape and e.right.shape)):
        return product_factors(e.left, divisions) + product_factors(e.right, divisions)
    return [e]


def states_in(e: ir.Expr) -> set[str]:
    return {n.name for n in walk(e) if isinstance(n, ir.StateRef)}


def contains_state(e: ir.Expr, state: str | None = None) -> bool:
    return any(isinstance(n, ir.StateRef) and (state is None or n.name == state) for n in walk(e))


def variance(e: ir.Expr, lets: dict[str, ir.Expr] | None = None) -> str:
    """What a state-free expression varies over: "const", "head" or "token"."""
    level = "const"
    for n in walk(e if lets is None else inline_lets(e, lets)):
        if isinstance(n, (ir.InputRef, ir.StateRef, ir.ReadoutRef, ir.LetRef)):  # a LetRef left: assume the most
            return "token"
        if isinstance(n, ir.HeadIndex) or (isinstance(n, ir.ParamRef) and n.per_head):
            level = "head"
    return level


def refs(e: ir.Expr, kind: type) -> list[str]:
    """Names referenced by nodes of `kind` (InputRef, ParamRef, LetRef, StateRef), in first-seen order."""
    seen: dict[str, None] = {}
    for n in walk(e):
        if isinstance(n, kind):
            seen.setdefault(n.name, None)
    return list(seen)


def to_text(e: ir.Expr) -> str:
    """The expression in the DSL's own notation (for `check` and for comments in generated code)."""
    prec = {"add": 1, "sub": 1, "mul": 2, "div": 2, "dot": 2, "outer": 2, "neg": 3, "pow": 4}

    def p(node, outer_prec=0):
        if isinstance(node, ir.Const):
            v = node.value
            return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else f"{v:g}"
        if isinstance(node, ir.DimSize):
            return node.dim
        if isinstance(node, ir.HeadIndex):
            return "h"
        if isinstance(node, ir.HeadCount):
            return "H"
        if isinstance(node, (ir.InputRef, ir.ParamRef, ir.LetRef)):
            return node.name
        if isinstance(node, ir.StateRef):
            return node.name
        if isinstance(node, ir.ReadoutRef):
            return f"r{node.index}"
        if isinstance(node, ir.Identity):
            return "I"
        if isinstance(node, ir.Random):
            args = ", ".join([f"seed={node.seed}"] + [f"{k}={v:g}" for k, v in node.options])
            name = {"normal": "randn", "features": "random_features"}.get(node.kind, node.kind)
            return f"{name}({args})"
        extreme = as_extremum(node)
        if extreme:  # (written max(a, b) or min(a, b), read back as such)
            return f"{extreme[0]}({p(extreme[1])}, {p(extreme[2])})"
        if isinstance(node, ir.Apply):
            defaults = dict(BUILTINS[node.function].options) if node.function in BUILTINS else \
                dict(SEQUENCE.get(node.function, (0, ()))[1])
            args = [p(a) for a in node.args] + [f"{k}={v:g}" for k, v in node.options if defaults.get(k) != v]
            return f"{node.function}({', '.join(args)})"
        if isinstance(node, ir.Diag):
            return f"diag({p(node.operand)})"
        if isinstance(node, ir.Neg):
            s = "−" + p(node.operand, prec["neg"])
            return f"({s})" if outer_prec > prec["neg"] else s
        if isinstance(node, (ir.Arith, ir.Dot, ir.Outer)):
            op = node.op if isinstance(node, ir.Arith) else ("dot" if isinstance(node, ir.Dot) else "outer")
            sym = {"add": " + ", "sub": " − ", "mul": "*", "div": "/", "pow": "^", "dot": "·", "outer": "⊗"}[op]
            mine = prec[op]
            right_prec = mine + 1 if op != "pow" else mine
            s = p(node.left, mine if op != "pow" else mine + 1) + sym + p(node.right, right_prec)
            return f"({s})" if outer_prec > mine else s
        raise TypeError(type(node))
    return p(e)


def extremum(function: str, a: ir.Expr, b: ir.Expr, span=None) -> ir.Expr:
    """max(a, b) as b + relu(a − b), min(a, b) as a − relu(a − b): relu's kernels, bounds and derivative (at
    a = b its subgradient 0: the gradient goes to b for max, to a for min). as_extremum reads it back."""
    shape = a.shape or b.shape
    excess = ir.Apply(shape, "relu", (ir.Arith(shape, "sub", a, b, span=span),), (), span=span)
    return ir.Arith(shape, "add", b, excess, span=span) if function == "max" else \
        ir.Arith(shape, "sub", a, excess, span=span)


def as_extremum(e: ir.Expr) -> tuple[str, ir.Expr, ir.Expr] | None:
    """("max", a, b) or ("min", a, b) for an expression `extremum` made (or written the same way), else None."""
    excess = e.right if isinstance(e, ir.Arith) and e.op in ("add", "sub") else None
    if not (isinstance(excess, ir.Apply) and excess.function == "relu"
            and isinstance(excess.args[0], ir.Arith) and excess.args[0].op == "sub"):
        return None
    a, b = excess.args[0].left, excess.args[0].right
    if e.op == "add" and e.left == b:
        return "max", a, b
    if e.op == "sub" and e.left == a:
        return "min", a, b
    return None


def occurrences(e: ir.Expr) -> Counter:
    """How often each input and param occurs in e as written: max(a, b) and min(a, b) count each operand once,
    as their bounds take them (intervals._extreme), where the b + relu(a − b) they are built as holds one twice."""
    extreme = as_extremum(e)
    if extreme:
        return occurrences(extreme[1]) + occurrences(extreme[2])
    if isinstance(e, (ir.InputRef, ir.ParamRef)):
        return Counter([e.name])
    return sum((occurrences(c) for c in children(e)), Counter())

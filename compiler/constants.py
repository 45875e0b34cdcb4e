"""Constant folding, checked: every part of a program built from numbers and dimension sizes alone must be
a finite real number.

`1e999`, `dk^1000`, `1/0`, `(0.1 − dk)^0.5` or `log(0)` would otherwise reach the generated code as an
infinity, a Python exception (float division by zero, an overflow), or a complex number NumPy casts back
to real. `check_constants` folds each expression at the program's sizes and raises a LinrecError at the
innermost part that has no finite real value, saying why; the driver calls it again with a call's sizes
when they differ from the header's (a size can make `dk^8` overflow that did not at the default).
"""
from __future__ import annotations

import math

from ..dsl.errors import LinrecError

from . import ir
from .analysis import children, to_text, walk
from .intervals import sigmoid

_UNARY = {
    "exp": math.exp, "log": math.log, "sqrt": math.sqrt, "abs": abs, "tanh": math.tanh,
    "cos": math.cos, "sin": math.sin,
    "relu": lambda x: max(x, 0.0),
    "sigmoid": sigmoid,
    "logsigmoid": lambda x: min(x, 0.0) - math.log1p(math.exp(-abs(x))),
    "softplus": lambda x: max(x, 0.0) + math.log1p(math.exp(-abs(x))),
    "elu": lambda x: x if x > 0 else math.expm1(x),
    "silu": lambda x: x * sigmoid(x),
}


def check_constants(e: ir.Expr, dims: dict[str, int], error=LinrecError) -> None:
    """Raise `error` (a LinrecError class) at the innermost part of `e` built from numbers and sizes alone
    whose value at `dims` is not a finite real number."""
    _fold(e, dims, error)


def program_expressions(program: ir.Program):
    """Every expression the program's text holds: param defaults, values, updates and outputs."""
    for prm in program.params:
        if prm.default is not None:
            yield prm.default
    for step in program.steps:
        yield step.value


def _fold(e: ir.Expr, dims: dict[str, int], error) -> float | None:
    """The value of e if it is built from numbers and sizes alone, else None (its parts are checked either
    way)."""
    kids = [_fold(c, dims, error) for c in children(e)]
    if isinstance(e, ir.Const):
        if not math.isfinite(e.value):
            raise error("this number is too large: it is not a finite double-precision number (the largest is "
                    "about 1.8e308)", e.span)
        return float(e.value)
    if isinstance(e, ir.DimSize):
        return float(dims[e.dim])
    if isinstance(e, ir.Arith) and e.op == "div" and kids[1] == 0:  # (whatever it divides)
        raise error(f"`{to_text(e)}` divides by zero{_at(e, dims)}", e.span)
    if not kids or any(k is None for k in kids) or e.shape:
        return None
    if isinstance(e, ir.Neg):
        return -kids[0]
    if isinstance(e, (ir.Arith, ir.Dot)):
        a, b = kids
        op = e.op if isinstance(e, ir.Arith) else "mul"
        if op == "pow" and a == 0 and b < 0:
            raise error(f"`{to_text(e)}` divides by zero{_at(e, dims)}", e.span)
        if op == "pow" and a < 0 and b != int(b):
            raise error(f"`{to_text(e)}` has no real value: a negative number ({a:g}) to a fractional power "
                        f"({b:g}){_at(e, dims)}", e.span)
        try:
            value = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "div": lambda: a / b,
                     "pow": lambda: math.pow(a, b)}[op]()
        except OverflowError:
            value = math.inf
        return _finite(e, value, dims, error)
    if isinstance(e, ir.Apply) and e.function in _UNARY:
        x = kids[0]
        if e.function == "log" and x <= 0:
            raise error(f"`{to_text(e)}` has no finite real value: the logarithm of "
                        f"{'zero' if x == 0 else f'a negative number ({x:g})'}{_at(e, dims)}", e.span)
        if e.function == "sqrt" and x < 0:
            raise error(f"`{to_text(e)}` has no real value: the square root of a negative number "
                        f"({x:g}){_at(e, dims)}", e.span)
        try:
            value = _UNARY[e.function](x)
        except OverflowError:
            value = math.inf
        return _finite(e, value, dims, error)
    return None


def _finite(e: ir.Expr, value: float, dims: dict[str, int], error) -> float:
    if not math.isfinite(value):
        raise error(f"`{to_text(e)}` overflows: its value is too large for a double-precision number"
                    f"{_at(e, dims)}", e.span)
    return value


def _at(e: ir.Expr, dims: dict[str, int]) -> str:
    """Where sizes enter the value: at which of them it was folded."""
    used = sorted({n.dim for n in walk(e) if isinstance(n, ir.DimSize)})
    return f" (at {', '.join(f'{d} = {dims[d]}' for d in used)})" if used else ""

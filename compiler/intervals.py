"""The values an expression can take, as one interval for all its elements: from the inputs' declared
ranges, the params' defaults, the builtins' ranges, and interval arithmetic over the rest.

The parallel and chunkwise forms carry a decay as its logarithm. Where the compiler cannot take the
logarithm symbolically (log(exp(x)) = x, log(sigmoid(x)) = logsigmoid(x), …) it is taken of the values, and
those must be positive: `positive` says whether the program guarantees it. Everything here is conservative:
an interval may be wider than the values, never narrower (a state, a readout or a random draw is any real;
a size is any whole number ≥ 1, since a call may choose it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import ir
from .analysis import as_extremum, children

INF = math.inf


@dataclass(frozen=True)
class Interval:
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    @property
    def positive(self) -> bool:
        return self.lo > 0 or (self.lo == 0 and self.lo_open)

    @property
    def negative(self) -> bool:
        return self.hi < 0 or (self.hi == 0 and self.hi_open)

    def __str__(self) -> str:
        def end(x):
            return "−∞" if x == -INF else "∞" if x == INF else f"{x + 0.0:g}".replace("-", "−")  # (no −0)
        return f"{'(' if self.lo_open else '['}{end(self.lo)}, {end(self.hi)}{')' if self.hi_open else ']'}"


ANY = Interval(-INF, INF, True, True)


def point(v: float) -> Interval:
    return Interval(v, v) if not math.isnan(v) else ANY


def _make(lo: float, hi: float, lo_open: bool, hi_open: bool) -> Interval:
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        return ANY
    return Interval(lo, hi, lo_open or lo == -INF, hi_open or hi == INF)


def _neg(a: Interval) -> Interval:
    return Interval(-a.hi, -a.lo, a.hi_open, a.lo_open)


def _add(a: Interval, b: Interval) -> Interval:
    return _make(a.lo + b.lo, a.hi + b.hi, a.lo_open or b.lo_open, a.hi_open or b.hi_open)


def _times(x: float, x_open: bool, y: float, y_open: bool) -> tuple[float, bool]:
    """An end of a product: x·y (0·∞ = 0), open unless a closed zero makes it attained."""
    value = 0.0 if x == 0 or y == 0 else x * y
    attained_zero = (x == 0 and not x_open) or (y == 0 and not y_open)
    return value, (x_open or y_open) and not attained_zero


def _mul(a: Interval, b: Interval) -> Interval:
    ends = [_times(x, xo, y, yo) for x, xo in ((a.lo, a.lo_open), (a.hi, a.hi_open))
            for y, yo in ((b.lo, b.lo_open), (b.hi, b.hi_open))]
    lo = min(v for v, _ in ends)
    hi = max(v for v, _ in ends)
    return _make(lo, hi, all(o for v, o in ends if v == lo), all(o for v, o in ends if v == hi))


def _reciprocal(b: Interval) -> Interval:
    if not (b.positive or b.negative):
        return ANY  # (it may be zero)
    def inv(x):
        return 0.0 if math.isinf(x) else INF if x == 0 else 1 / x
    return _make(inv(b.hi), inv(b.lo), b.hi_open or b.hi == 0, b.lo_open or b.lo == 0)


def _hull(a: Interval, b: Interval) -> Interval:
    lo = min(a.lo, b.lo)
    hi = max(a.hi, b.hi)
    return Interval(lo, hi, all(i.lo_open for i in (a, b) if i.lo == lo), all(i.hi_open for i in (a, b) if i.hi == hi))


def _summed(a: Interval) -> Interval:
    """A sum of one or more elements each in `a` (the count is a size: any number ≥ 1)."""
    lo, lo_open = (a.lo, a.lo_open) if a.lo >= 0 else (-INF, True)
    hi, hi_open = (a.hi, a.hi_open) if a.hi <= 0 else (INF, True)
    return _make(lo, hi, lo_open, hi_open)


def _extreme(kind: str, a: Interval, b: Interval) -> Interval:
    """The bounds of max(x, y) (kind "max") or min(x, y) for x in a, y in b: the larger or smaller operand's
    ends. (Taken term by term from b + relu(a − b), each occurrence of a on its own, min(a, 0.9) with a in
    (0, 1) spanned (−0.1, 1), no decay — a probe's finding —, where it lies in (0, 0.9].)"""
    pick = max if kind == "max" else min

    def end(x: float, x_open: bool, y: float, y_open: bool) -> tuple[float, bool]:
        value = pick(x, y)
        return value, (x_open if x == value else True) and (y_open if y == value else True)
    lo, lo_open = end(a.lo, a.lo_open, b.lo, b.lo_open)
    hi, hi_open = end(a.hi, a.hi_open, b.hi, b.hi_open)
    return _make(lo, hi, lo_open, hi_open)


def _monotone(f, a: Interval, increasing: bool = True) -> Interval:
    def at(x):
        try:
            return f(x)
        except OverflowError:
            return INF
    lo, hi = (at(a.lo), at(a.hi)) if increasing else (at(a.hi), at(a.lo))
    lo_open, hi_open = (a.lo_open, a.hi_open) if increasing else (a.hi_open, a.lo_open)
    return _make(lo, hi, lo_open, hi_open)


def _periodic(f, peak: float, a: Interval) -> Interval:
    """cos or sin (f) over a: from its values at the ends, widened to 1 where a holds a maximum (peak + 2πk)
    and to −1 where it holds a minimum (peak + π + 2πk), closed there; [−1, 1] for an unbounded a. (A point
    within rounding of an end counts as held: a bound a little wide is sound, one a little narrow is not.)"""
    if not (math.isfinite(a.lo) and math.isfinite(a.hi)):
        return Interval(-1.0, 1.0)

    def holds(x0: float) -> bool:  # a point x0 + 2πk inside a
        x = x0 + 2 * math.pi * math.ceil((a.lo - x0) / (2 * math.pi))
        return x <= a.hi + 1e-12 * max(1.0, abs(x))
    ends = ((f(a.lo), a.lo_open), (f(a.hi), a.hi_open))
    lo = -1.0 if holds(peak + math.pi) else min(v for v, _ in ends)
    hi = 1.0 if holds(peak) else max(v for v, _ in ends)
    return _make(lo, hi, lo > -1 and all(o for v, o in ends if v == lo), hi < 1 and all(o for v, o in ends if v == hi))


def sigmoid(x: float) -> float:
    """1/(1 + e^−x), as e^x/(1 + e^x) below 0: far below 0 its value to the last digits (0.5·(tanh(x/2) + 1)
    cancelled to 0 from x = −38, a bound of 0 that a decay sigmoid(a)^p does not reach). ±∞ and NaN as the
    formula gives them. (compiler.constants folds sigmoid and silu with it too.)"""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _softplus(x: float) -> float:
    return x if x == INF else max(x, 0.0) + math.log1p(math.exp(-abs(x)))


_SILU_MIN = -0.2784645427610738  # x·sigmoid(x) at its minimum, x ≈ −1.2785


def _apply(name: str, a: Interval) -> Interval:
    if name == "exp":  # positive however negative its argument
        r = _monotone(math.exp, a)
        return Interval(r.lo, r.hi, True if r.lo == 0 else r.lo_open, r.hi_open)
    if name == "sigmoid":
        r = _monotone(sigmoid, a)
        return Interval(r.lo, r.hi, True if r.lo == 0 else r.lo_open, True if r.hi == 1 else r.hi_open)
    if name == "softplus":
        r = _monotone(_softplus, a)
        return Interval(r.lo, r.hi, True if r.lo == 0 else r.lo_open, r.hi_open)
    if name == "logsigmoid":
        return _neg(_apply("softplus", _neg(a)))
    if name == "tanh":
        return _monotone(math.tanh, a)
    if name in ("cos", "sin"):
        return _periodic(math.cos if name == "cos" else math.sin, 0.0 if name == "cos" else math.pi / 2, a)
    if name == "log":
        if a.lo > 0:
            return _monotone(math.log, a)
        return ANY if a.hi <= 0 else _make(-INF, math.log(a.hi) if a.hi < INF else INF, True, a.hi_open)
    if name == "sqrt":
        if a.hi < 0:
            return ANY
        clipped = a if a.lo >= 0 else Interval(0.0, a.hi, False, a.hi_open)
        return _monotone(math.sqrt, clipped)
    if name == "abs":
        if a.lo >= 0:
            return a
        if a.hi <= 0:
            return _neg(a)
        return _make(0.0, max(-a.lo, a.hi), False, (a.lo_open if -a.lo >= a.hi else a.hi_open))
    if name == "relu":
        return _make(max(a.lo, 0.0), max(a.hi, 0.0), a.lo_open and a.lo > 0, a.hi_open and a.hi > 0)
    if name == "elu":
        return _monotone(lambda x: x if x > 0 else (-1.0 if x == -INF else math.expm1(x)), a)
    if name == "silu":
        if a.lo >= -1.2785:
            return _monotone(lambda x: x * sigmoid(x) if x != INF else INF, a)
        hi = max(0.0 if a.lo == -INF else a.lo * sigmoid(a.lo), a.hi * sigmoid(a.hi) if a.hi < INF else INF)
        return _make(_SILU_MIN, hi, False, a.hi == INF)
    if name == "l2norm":
        return Interval(0.0, 1.0, a.positive, False) if a.lo >= 0 else Interval(-1.0, 1.0)
    if name == "rmsnorm":
        return Interval(0.0, INF, a.positive, True) if a.lo >= 0 else ANY
    if name == "softmax":
        return Interval(0.0, 1.0, True, False)
    if name == "sum":
        return _summed(a)
    if name == "mean":
        return a
    if name == "norm":
        return Interval(0.0, INF, a.positive or a.negative, True)
    return ANY  # groupnorm, and the sequence builtins


def _pow_or_inf(x: float, c: float) -> float:
    """x^c for x ≥ 0 (±∞ included), +∞ where math.pow raises: past the largest float, and 0^c for c < 0."""
    if x == 0 and c < 0:
        return INF
    try:
        return math.pow(x, c)
    except OverflowError:
        return INF


def _power(a: Interval, b: Interval) -> Interval:
    if b.lo == b.hi and not math.isinf(b.lo):  # a constant exponent c
        c = b.lo
        if c == 0:
            return point(1.0)
        if a.positive or (a.lo >= 0 and c > 0):
            r = _monotone(lambda x: _pow_or_inf(x, c), a, increasing=c > 0)
            return r if not a.positive else Interval(r.lo, r.hi, True if r.lo == 0 else r.lo_open, r.hi_open)
        if c == int(c) and (a.hi < 0 or (a.hi == 0 and a.hi_open)):  # a negative base: (−1)^c·(−x)^c, where
            r = _power(_neg(a), b)  # (exp(g) − 2)^2 for g <= 0 lies in [1, 4), not [0, 4)
            return _neg(r) if int(c) % 2 else r
        if c == int(c):
            # (with x's sign: past the largest float −x^3 is −∞, where _monotone takes an overflow for +∞)
            odd = _monotone(lambda x: math.copysign(_pow_or_inf(abs(x), c), x), a) if c > 0 else ANY
            if int(c) % 2:
                return odd
            if c > 0:  # an even power of a range with 0 in it (a negative one is above): ≥ 0
                top = max(abs(a.lo), abs(a.hi))
                top_open = all(o for x, o in ((a.lo, a.lo_open), (a.hi, a.hi_open)) if abs(x) == top)
                return _make(0.0, _pow_or_inf(top, c), False, top_open)
        return ANY
    if a.lo == a.hi and a.lo > 0:  # a positive constant base: exp(b·log a)
        base = a.lo
        if base == 1:
            return point(1.0)
        r = _apply("exp", _mul(b, point(math.log(base))))
        return Interval(r.lo, r.hi, True if r.lo == 0 else r.lo_open, r.hi_open)
    if a.positive:  # a positive base to any exponent (an elementwise power): exp(b·log a) > 0
        r = _apply("exp", _mul(b, _apply("log", a)))
        return Interval(r.lo, r.hi, True if r.lo == 0 else r.lo_open, r.hi_open)
    return ANY


class Bounds:
    """Intervals of the expressions of one program (params and named values computed once each)."""

    def __init__(self, program: ir.Program):
        self.program = program
        self.inputs = {x.name: x for x in program.inputs}
        self.params = {p.name: p for p in program.params}
        self.lets = program.lets
        self._known: dict[str, Interval] = {}

    def of(self, e: ir.Expr) -> Interval:
        if isinstance(e, ir.Const):
            return point(e.value)
        if isinstance(e, ir.DimSize):
            return Interval(1.0, INF, False, True)
        if isinstance(e, ir.HeadIndex):
            return Interval(0.0, INF, False, True)
        if isinstance(e, ir.HeadCount):
            return Interval(1.0, INF, False, True)
        if isinstance(e, ir.InputRef):
            x = self.inputs[e.name]
            return _make(-INF if x.low is None else x.low, INF if x.high is None else x.high,
                         x.low is None or x.low_open, x.high is None or x.high_open)
        if isinstance(e, ir.ParamRef):
            return self._named(("param", e.name), lambda: self._param(e.name))
        if isinstance(e, ir.LetRef):
            return self._named(("let", e.name), lambda: self.of(self.lets[e.name]))
        if isinstance(e, ir.Random):
            opts = dict(e.options)
            if e.kind == "uniform":
                return _make(opts["low"], opts["high"], False, opts["high"] > opts["low"])
            return point(0.0) if e.kind == "normal" and opts.get("std") == 0 else ANY
        if isinstance(e, ir.Neg):
            return _neg(self.of(e.operand))
        if isinstance(e, ir.Arith):
            extreme = as_extremum(e)
            if extreme is not None:
                kind, x, y = extreme
                return _extreme(kind, self.of(x), self.of(y))
            a, b = self.of(e.left), self.of(e.right)
            if e.op == "add":
                return _add(a, b)
            if e.op == "sub":
                return _add(a, _neg(b))
            if e.op == "mul":
                return _mul(a, b)
            if e.op == "div":
                return _mul(a, _reciprocal(b))
            return _power(a, b)
        if isinstance(e, (ir.Dot, ir.Outer)):
            product = _mul(self.of(e.left), self.of(e.right))
            summed = isinstance(e, ir.Dot) and e.left.shape and e.right.shape
            return _summed(product) if summed else product
        if isinstance(e, ir.Diag):  # its diagonal, and zeros
            return _hull(self.of(e.operand), point(0.0))
        if isinstance(e, ir.Identity):
            return Interval(0.0, 1.0)
        if isinstance(e, ir.Apply):
            return _apply(e.function, self.of(e.args[0])) if len(e.args) == 1 else ANY
        return ANY  # states, readouts: any real

    def _named(self, key: tuple, compute) -> Interval:
        if key not in self._known:
            self._known[key] = ANY  # (while it is being computed)
            self._known[key] = compute()
        return self._known[key]

    def _param(self, name: str) -> Interval:
        p = self.params[name]
        return ANY if p.default is None else self.of(p.default)


def undefaulted_params(e: ir.Expr, program: ir.Program) -> list[str]:
    """The params without a default `e` depends on (directly, or through other params' defaults and named
    values): their values are the caller's, any real to the compiler."""
    params = {p.name: p for p in program.params}
    lets = program.lets
    found: dict[str, None] = {}
    seen: set[str] = set()
    stack = [e]
    while stack:
        node = stack.pop()
        if isinstance(node, (ir.ParamRef, ir.LetRef)) and node.name not in seen:
            seen.add(node.name)
            value = lets[node.name] if isinstance(node, ir.LetRef) else params[node.name].default
            if value is None:
                found[node.name] = None
            else:
                stack.append(value)
        stack.extend(children(node))
    return list(found)

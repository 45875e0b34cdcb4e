"""Print IR expressions as NumPy code over arrays with leading axes ([B, T, H, *] or [B, H, *]).

Every value is laid out as (leading axes…, element axes…). Elementwise operations align the element axes
explicitly with `[..., None]`, contractions use einsum with `...` so leading axes broadcast.
"""
from __future__ import annotations

import math
from typing import Callable

from ..compiler import ir
from ..compiler.analysis import variance
from ..compiler.linearity import neg

# Builtins that map to a NumPy expression; the others call linrec.numpy.runtime helpers.
_NUMPY_FUNCS = {"exp": "np.exp", "log": "np.log", "tanh": "np.tanh", "sqrt": "np.sqrt", "abs": "np.abs",
               "cos": "np.cos", "sin": "np.sin"}
_RUNTIME_FUNCS = {"sigmoid", "logsigmoid", "softplus", "elu", "silu", "relu", "l2norm", "groupnorm", "rmsnorm"}
_REDUCE = {"sum": "np.sum({x}, axis=-1)", "mean": "np.mean({x}, axis=-1)",
           "norm": "np.linalg.norm({x}, axis=-1)"}
_LETTERS = "ijklmn"

ATOM, POWER, UNARY, PRODUCT, SUM = 0, 1, 2, 3, 4


def _float(v: float) -> str:
    # (a product of large constants the compiler multiplied out may be infinite: `inf` is no Python name)
    return repr(float(v)) if math.isfinite(v) else f"float('{float(v)!r}')"


def _negated_scalar_factor(e: ir.Expr) -> ir.Expr | None:
    """−(s·x), s a scalar factor and x an array, as (−s)·x: the negation then costs a pass over the scalar
    ([B, T, H]) and none over the product ([B, T, H, d]; the delta rule's correction −(e^g·β)·kn); the same
    values, bit for bit. None where e is no such product."""
    if not e.shape or not ((isinstance(e, ir.Arith) and e.op == "mul")
                           or (isinstance(e, ir.Dot) and not (e.left.shape and e.right.shape))):
        return None
    if not e.left.shape:
        return ir.Arith(e.shape, "mul", neg(e.left), e.right)
    if not e.right.shape:
        return ir.Arith(e.shape, "mul", e.left, neg(e.right))
    return None


class NumpyPrinter:
    """`ref(node)` gives the code for a leaf (InputRef, ParamRef, StateRef, LetRef, ReadoutRef, DimSize)."""

    def __init__(self, ref: Callable[[ir.Expr], str]):
        self.ref = ref
        self.helpers: set[str] = set()  # runtime helpers the printed code calls

    def __call__(self, e: ir.Expr) -> str:
        return self._p(e)[0]

    # each case returns (code, precedence of its top operator)
    def _p(self, e: ir.Expr) -> tuple[str, int]:
        if isinstance(e, ir.Const):
            v = e.value
            return (_float(v), ATOM) if v >= 0 else (_float(v), UNARY)
        if isinstance(e, (ir.InputRef, ir.ParamRef, ir.StateRef, ir.LetRef, ir.ReadoutRef, ir.DimSize,
                          ir.HeadIndex, ir.HeadCount)):
            return self.ref(e), ATOM
        if isinstance(e, ir.Neg):
            scaled = _negated_scalar_factor(e.operand)
            if scaled is not None:
                return self._p(scaled)
            return "-" + self._wrap(e.operand, UNARY), UNARY
        if isinstance(e, ir.Arith):
            return self._arith(e)
        if isinstance(e, ir.Dot):
            return self._dot(e)
        if isinstance(e, ir.Outer):
            return f"{self._wrap(e.left, ATOM)}[..., :, None] * {self._wrap(e.right, ATOM)}[..., None, :]", PRODUCT
        if isinstance(e, ir.Diag):
            self.helpers.add("diag_matrix")
            return f"diag_matrix({self(e.operand)})", ATOM
        if isinstance(e, ir.Identity):
            return f"np.eye({self.ref(ir.DimSize((), e.shape[0]))}, dtype=dtype)", ATOM
        if isinstance(e, ir.Apply):
            return self._apply(e)
        if isinstance(e, ir.Random):
            raise TypeError("random defaults are printed by the parameter printer")
        raise TypeError(f"cannot print {type(e).__name__}")

    def factor(self, e: ir.Expr) -> str:
        """e's code as a factor of a product, for code that writes `… * factor` itself (in parentheses where e's top
        operator binds less tightly than a product: a sum)."""
        return self._wrap(e, PRODUCT)

    def _wrap(self, e: ir.Expr, max_prec: int) -> str:
        code, prec = self._p(e)
        return f"({code})" if prec > max_prec else code

    def _expand(self, e: ir.Expr, rank: int) -> str:
        """e's code with element axes padded to `rank` (scalars broadcast; vectors get trailing None)."""
        missing = rank - len(e.shape)
        if missing <= 0 or (not e.shape and variance(e) == "const"):
            return None  # constant scalars broadcast by themselves (and may be plain Python numbers)
        return self._wrap(e, ATOM) + "[..., " + ", ".join(["None"] * missing) + "]"

    def _arith(self, e: ir.Arith) -> tuple[str, int]:
        rank = len(e.shape)
        if e.op == "add" and isinstance(e.right, ir.Const) and e.right.value == 1.0 \
                and isinstance(e.left, ir.Apply) and e.left.function == "elu":
            # elu(x) + 1 cancels to 0 for very negative x in low precision: compute it directly
            self.helpers.add("elu_plus_one")
            return f"elu_plus_one({self(e.left.args[0])})", ATOM
        if e.op == "mul":
            one = next((x for x in (e.left, e.right) if _is_one(x)), None)
            if one is not None and len((other := e.right if one is e.left else e.left).shape) == rank:
                # × 1 (the chain rule's way of giving a product its shape, compiler.adjoint._product): the same
                # values bit for bit and, a scalar broadcasting nothing in NumPy, the same shape — one pass less;
                # still printed as a product (a sum in parentheses), as it was with its `* 1.0`
                return self._wrap(other, PRODUCT), PRODUCT
            if isinstance(e.right, ir.Arith) and e.right.op == "div" and _is_one(e.right.left) \
                    and self._expand(e.right, rank) is None:
                # x·(1/c), printed x * 1.0 / c (which Python reads as (x·1)/c): x / c, the same values bit for
                # bit, a pass over x less (the derivative of x/c for a constant c, which the program holds as x·(1/c))
                return self._arith(ir.Arith(e.shape, "div", e.left, e.right.right))
        op, prec = {"add": (" + ", SUM), "sub": (" - ", SUM), "mul": (" * ", PRODUCT),
                    "div": (" / ", PRODUCT), "pow": (" ** ", POWER)}[e.op]
        left = self._expand(e.left, rank) or self._wrap(e.left, prec if e.op != "pow" else ATOM)
        right_max = prec - 1 if e.op in ("sub", "div") else prec
        if e.op == "pow":
            right_max = UNARY
        right = self._expand(e.right, rank) or self._wrap(e.right, right_max)
        return left + op + right, prec

    def _dot(self, e: ir.Dot) -> tuple[str, int]:
        a, b = e.left, e.right
        if not a.shape or not b.shape:
            return self._arith(ir.Arith(e.shape, "mul", a, b))
        if isinstance(a, ir.Identity):
            return self._p(b)
        if isinstance(b, ir.Identity):
            return self._p(a)
        if isinstance(a, ir.Diag):  # diag(d)·X scales X's rows
            d = self._wrap(a.operand, ATOM)
            return (f"{d}[..., :, None] * {self._wrap(b, PRODUCT)}" if len(b.shape) == 2
                    else f"{d} * {self._wrap(b, PRODUCT)}"), PRODUCT
        if isinstance(b, ir.Diag):  # X·diag(d) scales X's columns
            col = "[..., None, :]" if len(a.shape) == 2 else ""
            return f"{self._wrap(a, PRODUCT)} * {self._wrap(b.operand, ATOM)}{col}", PRODUCT
        if (len(a.shape), len(b.shape)) in ((2, 1), (1, 2)):  # one BLAS product when the matrix is shared
            helper = "matvec" if len(a.shape) == 2 else "vecmat"
            self.helpers.add(helper)
            return f"{helper}({self(a)}, {self(b)})", ATOM
        la, lb = _LETTERS[:len(a.shape)], _LETTERS[len(a.shape) - 1:len(a.shape) - 1 + len(b.shape)]
        out = la[:-1] + lb[1:]
        return f"np.einsum('...{la},...{lb}->...{out}', {self(a)}, {self(b)})", ATOM

    def _apply(self, e: ir.Apply) -> tuple[str, int]:
        f, x = e.function, self(e.args[0])
        opts = "".join(f", {k}={_float(v)}" for k, v in e.options)
        if f in _NUMPY_FUNCS:
            if not e.shape and variance(e.args[0]) == "const":
                # a number of sizes and constants (sqrt(m)): as a Python float it takes the arrays' dtype, where
                # NumPy's own scalar, a float64, makes float32 arrays float64
                return f"float({_NUMPY_FUNCS[f]}({x}))", ATOM
            return f"{_NUMPY_FUNCS[f]}({x})", ATOM
        if f in _REDUCE:
            return _REDUCE[f].format(x=x), ATOM
        if f in _RUNTIME_FUNCS:
            self.helpers.add(f)
            return f"{f}({x}{opts})", ATOM
        if f == "softmax":  # of a per-token vector, over its last axis (the attention helpers' one)
            self.helpers.add("softmax")
            return f"softmax({x})", ATOM
        raise TypeError(f"no NumPy spelling for builtin {f}")


def _is_one(e: ir.Expr) -> bool:
    return isinstance(e, ir.Const) and not e.shape and e.value == 1.0

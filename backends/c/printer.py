"""Lower per-token IR expressions to C statements.

Scalars become `const T` locals, vectors become small local arrays filled by a `#pragma omp simd` loop over
their dimension. Elementwise arithmetic on vectors is fused into the loop of the value that uses it;
builtin calls, reductions and every subexpression used more than once are computed once into a local
(common subexpressions are found by IR equality). Values that do not vary per token (per-head parameters,
constants) are computed once per head, outside the token loop.

Sizes are compile-time constants: the printer is built for one assignment of dimension sizes. `T` is the
scalar type of the generated file (float or double); the `lr_*` helpers are defined by the template.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ..compiler import ir
from ..compiler.analysis import children, rebuild, to_text, walk
from ..templating import c_comment_text


def c_literal(v: float, ctype: str) -> str:
    """A number as a C expression of type T (ctype "float" or "double"): NaN and the infinities by name (a repr of
    them, "inf", is no C), a negative one in parentheses."""
    if math.isnan(v):
        return "((T)NAN)"
    if math.isinf(v):
        return "((T)INFINITY)" if v > 0 else "(-(T)INFINITY)"
    text = repr(float(v))
    text = text if ctype == "double" else text + "f"
    return text if v >= 0 else f"({text})"


@dataclass(frozen=True)
class Local(ir.Expr):
    """A value the kernel itself computed before this expression runs (e.g. p = wᵀS): a C local of this
    name, a scalar or an indexable array."""

    name: str


# elementwise builtins → C helper of the template (each numerically careful; see c_common.h.j2)
_ELEMENTWISE = {"exp": "lr_exp", "log": "lr_log", "sigmoid": "lr_sigmoid", "logsigmoid": "lr_logsigmoid",
                "softplus": "lr_softplus", "relu": "lr_relu", "elu": "lr_elu", "silu": "lr_silu",
                "tanh": "lr_tanh", "sqrt": "lr_sqrt", "abs": "lr_abs",
                "cos": "lr_cos", "sin": "lr_sin"}
# elementwise builtins with a helper over a whole row (whole registers at a time, see c_common.h.j2): used
# for vectors, where the scalar helper in a vectorized loop costs about twice the instructions
_ROWS = {"exp": "lr_exp_row", "sigmoid": "lr_sigmoid_row", "silu": "lr_silu_row", "log": "lr_log_row",
         "softplus": "lr_softplus_row", "logsigmoid": "lr_logsigmoid_row", "tanh": "lr_tanh_row", "elu": "lr_elu_row",
         "sin": "lr_sin_row", "cos": "lr_cos_row"}
# … and over one register (c_printer.lanes)
_REGISTER = {"exp": "lr_exp_v", "sigmoid": "lr_sigmoid_v", "silu": "lr_silu_v", "log": "lr_log_v",
             "softplus": "lr_softplus_v", "logsigmoid": "lr_logsigmoid_v", "tanh": "lr_tanh_v", "elu": "lr_elu_v",
             "sin": "lr_sin_v", "cos": "lr_cos_v"}
# x^y with these constant exponents, written out (y any other: lr_pow, lr_pow_v)
_POWERS = {1.0: "{a}", 2.0: "({a} * {a})", 3.0: "({a} * {a} * {a})", 0.5: "lr_sqrt({a})",
           -0.5: "(1 / lr_sqrt({a}))", -1.0: "(1 / {a})", 0.0: "((T)1)"}
_VECTOR = {"l2norm", "groupnorm", "rmsnorm", "softmax"}
_REDUCE = {"sum", "mean", "norm"}
_LEAVES = (ir.InputRef, ir.ParamRef, ir.ReadoutRef, ir.StateRef, ir.LetRef, Local)
# the leaves a matrix per token can be (StatementPrinter, statements.py: the statement kernel's buffers)
MATRIX_LEAVES = (ir.InputRef, ir.ParamRef, ir.StateRef, ir.LetRef)


def by_registers(target: str, n: int, index: str, register: str, element: str) -> list[str]:
    """Statements that store target[0 … n−1] a register at a time (register: C of type vec for the elements at
    `index`), the elements past the last whole register one by one (element: the same arithmetic for one)."""
    return ["{", f"    int {index} = 0;",
            f"    for (; {index} + VW <= {n}; {index} += VW) lr_store({target} + {index}, {register});",
            f"    for (; {index} < {n}; ++{index}) {target}[{index}] = {element};", "}"]


class UnprintableError(Exception):
    """The printer met an expression it has no C for. linrec.c.support decides from the program's structure
    which kernel takes a program, with the printers' own dispatch and tables, before any code is generated:
    this is a bug (the two disagree, see tests/test_c_support.py), never a routine answer about a program."""


def elu_plus_one(e: ir.Expr) -> ir.Expr | None:
    """x when e is elu(x) + 1 (the Linear Transformer's feature map: computed directly, see lr_elu_plus_one)."""
    if isinstance(e, ir.Arith) and e.op == "add" and isinstance(e.right, ir.Const) and e.right.value == 1.0 \
            and isinstance(e.left, ir.Apply) and e.left.function == "elu":
        return e.left.args[0]
    return None


def matrix_vector(e: ir.Expr) -> bool:
    """`e` is W·x or x·W with W a matrix parameter and x a vector: lr_matvec / lr_vecmat over W's rows."""
    if not isinstance(e, ir.Dot):
        return False
    ranks = (len(e.left.shape), len(e.right.shape))
    matrix = e.left if ranks == (2, 1) else e.right if ranks == (1, 2) else None
    return isinstance(matrix, ir.ParamRef)


def vector_product(e: ir.Expr) -> bool:
    """`e` is a·M or M·a, a vector times a matrix that is neither diag(d) nor I (which CPrinter applies
    elementwise) nor a parameter (matrix_vector): StatementPrinter computes it by loops over M's elements."""
    if not (isinstance(e, ir.Dot) and len(e.shape) == 1) or matrix_vector(e):
        return False
    ranks = (len(e.left.shape), len(e.right.shape))
    matrix = e.right if ranks == (1, 2) else e.left if ranks == (2, 1) else None
    return matrix is not None and not isinstance(matrix, (ir.Diag, ir.Identity))


def token_variant(e: ir.Expr) -> bool:
    """True when `e` may change from one token to the next (it reads an input, a readout or a kernel
    local); otherwise it is fixed per head and computed once outside the token loop."""
    return any(isinstance(n, (ir.InputRef, ir.ReadoutRef, ir.StateRef, ir.LetRef, Local)) for n in walk(e))


def fold(e: ir.Expr, dims: dict[str, int]) -> float | None:
    """The value of an expression built only from numbers and sizes, else None."""
    if isinstance(e, ir.Const):
        return float(e.value)
    if isinstance(e, ir.DimSize):
        return float(dims[e.dim])
    if isinstance(e, ir.Neg):
        v = fold(e.operand, dims)
        return None if v is None else -v
    if isinstance(e, ir.Arith) or (isinstance(e, ir.Dot) and not e.left.shape and not e.right.shape):
        a, b = fold(e.left, dims), fold(e.right, dims)
        if a is None or b is None:
            return None
        op = e.op if isinstance(e, ir.Arith) else "mul"
        try:
            return {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
                    "div": lambda: a / b, "pow": lambda: float(a ** b)}[op]()
        except (ZeroDivisionError, OverflowError, TypeError):
            return None
    return None


def read_only_through_readouts(state: str) -> str:
    """What the C kernels can do with a state besides updating it (the wording of every error about it)."""
    return f"state '{state}' only through readouts such as q·{state} (a contraction with a state-free q)"


class CPrinter:
    """Prints expressions of one code region (one kernel body) into statement lists.

    `ref(node)` gives the C code of a leaf: for a scalar a C expression, for a vector an indexable base
    (`base[i]` is valid C). Statements go to `self.head` (per head, before the token loop) or
    `self.token` (per token); `take_token()` hands over the token statements written so far.
    """

    def __init__(self, ctype: str, dims: dict[str, int], ref: Callable[[ir.Expr], str], prefix: str = ""):
        self.ctype = ctype
        self.prefix = prefix
        self.dims = dims
        self.ref = ref
        self.head: list[str] = []
        self.token: list[str] = []
        self._cache: dict[ir.Expr, str] = {}
        self._uses: Counter = Counter()
        self._count = 0

    # ---- set-up ----
    def expect(self, *exprs: ir.Expr) -> None:
        """Declare expressions this region will print, so that shared subexpressions are computed once."""
        for e in exprs:
            for n in walk(e):
                if children(n):
                    self._uses[n] += 1

    def take_token(self) -> list[str]:
        lines, self.token = self.token, []
        return lines

    def take_head(self) -> list[str]:
        lines, self.head = self.head, []
        return lines

    # ---- helpers ----
    def size(self, dim: str) -> int:
        return self.dims[dim]

    def literal(self, v: float) -> str:
        return c_literal(v, self.ctype)

    def _name(self, e: ir.Expr, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self.prefix}{self._count}"

    def _sink(self, e: ir.Expr) -> list[str]:
        return self.token if token_variant(e) else self.head

    def _comment(self, e: ir.Expr) -> str:
        try:  # (a kernel local shows as its C name)
            text = to_text(rebuild(e, lambda n: ir.LetRef(n.shape, n.name) if isinstance(n, Local) else n))
        except TypeError:
            return ""
        return f"  /* {c_comment_text(text[:80])} */"

    # ---- public entry points ----
    def scalar(self, e: ir.Expr) -> str:
        """C code for a scalar expression (its statements are written first)."""
        if e.shape:
            raise TypeError(f"not a scalar: {to_text(e)}")
        if e in self._cache:
            return self._cache[e]
        v = fold(e, self.dims)
        if v is not None:
            return self.literal(v)
        code = self._scalar(e)
        if isinstance(e, _LEAVES) or isinstance(e, (ir.Const, ir.DimSize, ir.HeadIndex, ir.HeadCount)):
            return code
        if isinstance(e, ir.Apply) or self._uses[e] > 1:
            name = self._name(e, "s")
            self._sink(e).append(f"const T {name} = {code};{self._comment(e)}")
            self._cache[e] = name
            return name
        return code

    def elem(self, e: ir.Expr, i: str) -> str:
        """C code for element i of a vector expression (statements it needs are written first)."""
        if len(e.shape) != 1:
            raise self._unsupported(e)
        if e in self._cache:
            return f"{self._cache[e]}[{i}]"
        if isinstance(e, _LEAVES):
            return f"{self.ref(e)}[{i}]"
        if isinstance(e, ir.Apply) or self._general_pow(e) or (self._uses[e] > 1 and not isinstance(e, ir.Neg)):
            return f"{self.array(e)}[{i}]"
        return self._elem(e, i)

    def array(self, e: ir.Expr) -> str:
        """An indexable C name holding the vector e (inputs and params are used in place)."""
        if len(e.shape) != 1:
            raise self._unsupported(e)
        if e in self._cache:
            return self._cache[e]
        if isinstance(e, _LEAVES):
            return self.ref(e)
        n = self.size(e.shape[0])
        name = self._name(e, "v")
        if isinstance(e, ir.Apply) and e.function in _VECTOR:
            lines = self._vector_builtin(e, name, n)
        elif matrix_vector(e):
            partner = self._partner(e)
            if partner is None:
                lines = [f"T {name}[{n}];{self._comment(e)}", self._matrix_vector(e, name)]
            else:  # both products in one pass over W
                other = self._name(partner, "v")
                rows, cols = (self.size(d) for d in e.left.shape)
                call = (f"lr_matvec2({name}, {other}, {self.ref(e.left)}, {self.array(e.right)}, "
                        f"{self.array(partner.right)}, {rows}, {cols});")
                lines = [f"T {name}[{n}];{self._comment(e)}", f"T {other}[{n}];{self._comment(partner)}", call]
                self._cache[partner] = other
        elif self._row_call(e, name, n, check=True):
            lines = [f"T {name}[{n}];{self._comment(e)}", self._row_call(e, name, n)]
        elif self._general_pow(e):
            lines = [f"T {name}[{n}];{self._comment(e)}"] + self._pow_by_registers(e, name, n)
        elif isinstance(e, ir.Apply):
            lines = [f"T {name}[{n}];{self._comment(e)}", "#pragma omp simd",
                     f"for (int i = 0; i < {n}; ++i) {name}[i] = {self._apply_elementwise(e, 'i')};"]
        else:
            code = self._elem(e, "i")
            lines = [f"T {name}[{n}];{self._comment(e)}", "#pragma omp simd",
                     f"for (int i = 0; i < {n}; ++i) {name}[i] = {code};"]
        self._sink(e).extend(lines)
        self._cache[e] = name
        return name

    def fill(self, e: ir.Expr, target: str, n: int | None = None, keep: bool = False,
             scale: str | None = None) -> list[str]:
        """Statements that store vector e into the indexable `target` (elements 0..n−1). keep=True: later
        uses of e in this region may read `target` (it must then hold e's value until the region ends).
        scale: C code (of i) of a factor each element is multiplied by as it is stored."""
        n = self.size(e.shape[0]) if n is None else n
        if scale is not None:
            return ["#pragma omp simd", f"for (int i = 0; i < {n}; ++i) {target}[i] = {self.elem(e, 'i')} * {scale};"]
        if keep and e not in self._cache and (isinstance(e, ir.Apply) and e.function in _ELEMENTWISE
                                               or self._row_call(e, target, n, check=True)) \
                and n == self.size(e.shape[0]):  # computed straight into the target
            if self._row_call(e, target, n, check=True):
                body = [self._row_call(e, target, n)]
            else:
                code = self._apply_elementwise(e, "i")
                body = ["#pragma omp simd", f"for (int i = 0; i < {n}; ++i) {target}[i] = {code};"]
            if token_variant(e):  # (a value fixed per head is printed before the token loop wherever another
                # value uses it, and there a per-token target, blk[u], names nothing: such uses compute it there)
                self._cache[e] = target
            return [f"/* {target} = {self._comment(e).strip()[3:-3].strip()} */"] + body
        code = self.elem(e, "i")
        return ["#pragma omp simd", f"for (int i = 0; i < {n}; ++i) {target}[i] = {code};"]

    # ---- scalars ----
    def _scalar(self, e: ir.Expr) -> str:
        if isinstance(e, ir.Const):
            return self.literal(e.value)
        if isinstance(e, ir.DimSize):
            return self.literal(float(self.size(e.dim)))
        if isinstance(e, ir.HeadIndex):
            return "((T)h)"
        if isinstance(e, ir.HeadCount):
            return "((T)H)"
        if isinstance(e, _LEAVES):
            return self.ref(e)
        if isinstance(e, ir.Neg):
            return f"(-{self.scalar(e.operand)})"
        if isinstance(e, ir.Arith):
            return self._binary(e.op, self.scalar(e.left), self.scalar(e.right), e.right)
        if isinstance(e, ir.Dot):
            a, b = e.left, e.right
            if not a.shape or not b.shape:
                return self._binary("mul", self.scalar(a), self.scalar(b), b)
            if len(a.shape) == 1 and len(b.shape) == 1:
                return self._reduce(e, lambda i: f"{self.elem(a, i)} * {self.elem(b, i)}", self.size(a.shape[0]))
            raise self._unsupported(e)
        if isinstance(e, ir.Apply):
            if e.function in _ELEMENTWISE:
                return self._call(e.function, self.scalar(e.args[0]))
            if e.function in _REDUCE:
                x = e.args[0]
                n = self.size(x.shape[0])
                if e.function == "sum":
                    return self._reduce(e, lambda i: self.elem(x, i), n)
                if e.function == "mean":
                    return f"({self._reduce(e, lambda i: self.elem(x, i), n)} / {self.literal(float(n))})"
                arr = self.array(x)
                return f"lr_sqrt(lr_dot({arr}, {arr}, {n}))"  # (the sum of squares as l2norm's)
            raise self._unsupported(e)
        raise self._unsupported(e)

    def _reduce(self, e: ir.Expr, term: Callable[[str], str], n: int) -> str:
        """Σ_i term(i) into a fresh local; returns its name."""
        code = term("i")
        name = self._name(e, "acc")
        self._sink(e).extend([f"T {name} = 0;", f"#pragma omp simd reduction(+:{name})",
                              f"for (int i = 0; i < {n}; ++i) {name} += {code};"])
        return name

    def _binary(self, op: str, a: str, b: str, right: ir.Expr) -> str:
        if op == "pow":
            exponent = fold(right, self.dims)
            if exponent in _POWERS:
                return _POWERS[exponent].format(a=a)
            return f"lr_pow({a}, {b})"
        sym = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[op]
        return f"({a} {sym} {b})"

    def _call(self, function: str, x: str) -> str:
        return f"{_ELEMENTWISE[function]}({x})"

    # ---- vectors ----
    def _elem(self, e: ir.Expr, i: str) -> str:
        if isinstance(e, ir.Const):  # (a vector of one value: state_terms.ones, a scalar write's left vector)
            return self.literal(e.value)
        if isinstance(e, ir.Neg):
            return f"(-{self.elem(e.operand, i)})"
        if isinstance(e, ir.Arith):
            if e.op == "add" and isinstance(e.right, ir.Const) and e.right.value == 1.0 \
                    and isinstance(e.left, ir.Apply) and e.left.function == "elu":
                return self._elu_plus_one(e.left.args[0], i)
            return self._binary(e.op, self._part(e.left, i), self._part(e.right, i), e.right)
        if isinstance(e, ir.Dot):
            a, b = e.left, e.right
            if not a.shape or not b.shape:
                return self._binary("mul", self._part(a, i), self._part(b, i), b)
            if isinstance(a, ir.Identity):
                return self.elem(b, i)
            if isinstance(b, ir.Identity):
                return self.elem(a, i)
            if isinstance(a, ir.Diag) and len(b.shape) == 1:
                return f"({self.elem(a.operand, i)} * {self.elem(b, i)})"
            if isinstance(b, ir.Diag) and len(a.shape) == 1:
                return f"({self.elem(a, i)} * {self.elem(b.operand, i)})"
            if matrix_vector(e):
                return f"{self.array(e)}[{i}]"
            raise self._unsupported(e)
        if isinstance(e, ir.Apply):
            return f"{self.array(e)}[{i}]"
        if isinstance(e, _LEAVES):
            return f"{self.ref(e)}[{i}]"
        raise self._unsupported(e)

    def _part(self, e: ir.Expr, i: str) -> str:
        return self.scalar(e) if not e.shape else self.elem(e, i)

    def _elu_plus_one(self, x: ir.Expr, i: str) -> str:
        # elu(x) + 1 cancels to 0 for very negative x in low precision: compute it directly
        if not x.shape:
            return f"lr_elu_plus_one({self.scalar(x)})"
        return f"lr_elu_plus_one({self.elem(x, i)})"

    def _apply_elementwise(self, e: ir.Apply, i: str) -> str:
        if e.function not in _ELEMENTWISE:
            raise self._unsupported(e)
        return self._call(e.function, self.elem(e.args[0], i))

    # ---- whole registers ----
    def lanes(self, e: ir.Expr, i: str, whole: bool = True) -> str:
        """C code of type `vec` for elements i … i+VW−1 of vector e, computed a register at a time (GCC's
        vector arithmetic, scalars broadcast, builtins through _REGISTER's helpers); whole=False: the same
        arithmetic for element i alone (a row's elements past its last whole register). Only for e with
        has_lanes(e).
        A subexpression used more than once is computed into a local first, as elem() does."""
        if not e.shape:
            code = self.scalar(e)
            return f"(T){code}" if whole else code  # broadcast by the arithmetic it meets
        if e in self._cache or isinstance(e, _LEAVES) or self._shared(e) or matrix_vector(e):
            base = self.array(e)
            return f"lr_load({base} + {i})" if whole else f"{base}[{i}]"
        if isinstance(e, ir.Neg):
            return f"(-{self.lanes(e.operand, i, whole)})"
        if elu_plus_one(e) is not None:
            return f"{'lr_elu_plus_one_v' if whole else 'lr_elu_plus_one'}({self.lanes(elu_plus_one(e), i, whole)})"
        if isinstance(e, ir.Apply):
            helper = _REGISTER[e.function] if whole else _ELEMENTWISE[e.function]
            return f"{helper}({self.lanes(e.args[0], i, whole)})"
        if self._general_pow(e):
            return self._pow_lanes(e, i, whole)
        if isinstance(e, ir.Arith):
            sym = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[e.op]
            return f"({self.lanes(e.left, i, whole)} {sym} {self.lanes(e.right, i, whole)})"
        a, b = (x.operand if isinstance(x, ir.Diag) else x for x in (e.left, e.right))  # a Dot
        if isinstance(a, ir.Identity) or isinstance(b, ir.Identity):
            return self.lanes(b if isinstance(a, ir.Identity) else a, i, whole)
        return f"({self.lanes(a, i, whole)} * {self.lanes(b, i, whole)})"

    def has_lanes(self, e: ir.Expr) -> bool:
        """lanes() can compute e: elementwise arithmetic, builtins with a register helper (_REGISTER),
        scalars and values at hand"""
        if not e.shape:
            return True
        if len(e.shape) != 1:
            return False
        if e in self._cache or isinstance(e, _LEAVES) or self._shared(e) or matrix_vector(e):
            return True
        if isinstance(e, ir.Neg):
            return self.has_lanes(e.operand)
        if elu_plus_one(e) is not None:
            return self.has_lanes(elu_plus_one(e))
        if isinstance(e, ir.Apply):
            return e.function in _REGISTER and self.has_lanes(e.args[0])
        if isinstance(e, ir.Arith):
            return (e.op != "pow" or self._general_pow(e)) and self.has_lanes(e.left) and self.has_lanes(e.right)
        if isinstance(e, ir.Dot):
            a, b = (x.operand if isinstance(x, ir.Diag) else x for x in (e.left, e.right))
            if isinstance(a, ir.Identity) or isinstance(b, ir.Identity):
                return self.has_lanes(b if isinstance(a, ir.Identity) else a)
            diag = isinstance(e.left, ir.Diag) or isinstance(e.right, ir.Diag)
            return (diag or not (a.shape and b.shape)) and self.has_lanes(a) and self.has_lanes(b)
        return False

    def _general_pow(self, e: ir.Expr, rank: int = 1) -> bool:
        """e is an x^y of `rank` axes whose exponent is not one of the powers written out as products (_POWERS):
        it goes a register at a time through lr_pow_v (powf, a call per element, vectorizes in no loop)."""
        return (isinstance(e, ir.Arith) and e.op == "pow" and len(e.shape) == rank
                and fold(e.right, self.dims) not in _POWERS)

    def _pow_by_registers(self, e: ir.Expr, target: str, n: int) -> list[str]:
        """Statements that store e, a general x^y (_general_pow), into target a register at a time, its operands
        that have no register form (lanes()) computed into rows first."""
        for x in (e.left, e.right):
            if x.shape and not self.has_lanes(x):
                self.array(x)
        return by_registers(target, n, "i", self._pow_lanes(e, "i", True), self._pow_lanes(e, "i", False))

    def _pow_lanes(self, e: ir.Arith, i: str, whole: bool) -> str:
        """lanes() of a general x^y (_general_pow): lr_pow_v of its operands' registers, a scalar in every lane"""
        if not whole:
            return f"lr_pow({self.lanes(e.left, i, False)}, {self.lanes(e.right, i, False)})"
        a, b = (self.lanes(x, i) if x.shape else f"lr_splat({self.scalar(x)})" for x in (e.left, e.right))
        return f"lr_pow_v({a}, {b})"

    def _shared(self, e: ir.Expr) -> bool:
        return self._uses[e] > 1 and not isinstance(e, ir.Neg)

    def _row_call(self, e: ir.Expr, target: str, n: int, check: bool = False) -> str | bool:
        """The row helper's call that stores e, an elementwise builtin of a vector with a row helper (or
        elu(x) + 1), into target; check=True: only whether there is one (nothing printed)."""
        if isinstance(e, ir.Apply) and e.function in _ROWS:
            return True if check else f"{_ROWS[e.function]}({target}, {self.array(e.args[0])}, {n});"
        x = elu_plus_one(e) if e.shape else None
        if x is None:
            return False
        return True if check else f"lr_elu_plus_one_row({target}, {self.array(x)}, {n});"

    def _partner(self, e: ir.Dot) -> ir.Dot | None:
        """Another W·x' with e's matrix W that this region will print and has not yet, computed where e is
        (token or head) from inputs, params and constants alone (so it can be computed here): lr_matvec2
        then reads W once for both (Performer's W·k and W·q). Not one inside the other (W·(W·k)), nor one
        whose vector holds such products itself: those are computed first, each on its own."""
        if len(e.left.shape) != 2:
            return None
        for n in self._uses:
            if isinstance(n, ir.Dot) and n != e and matrix_vector(n) and len(n.left.shape) == 2 \
                    and n.left == e.left and n not in self._cache and token_variant(n) == token_variant(e) \
                    and n not in walk(e.right) and not any(matrix_vector(x) for x in walk(n.right)) \
                    and all(isinstance(leaf, (ir.InputRef, ir.ParamRef, ir.Const, ir.DimSize, ir.HeadIndex))
                            for leaf in walk(n.right) if not children(leaf)):
                return n
        return None

    def _matrix_vector(self, e: ir.Dot, name: str) -> str:
        """The call that stores W·x (or x·W) into name: W a parameter, row-major at its C reference."""
        if len(e.left.shape) == 2:
            w, x = e.left, e.right
            rows, cols = (self.size(d) for d in w.shape)
            return f"lr_matvec({name}, {self.ref(w)}, {self.array(x)}, {rows}, {cols});"
        x, w = e.left, e.right
        rows, cols = (self.size(d) for d in w.shape)
        return f"lr_vecmat({name}, {self.array(x)}, {self.ref(w)}, {rows}, {cols});"

    def _vector_builtin(self, e: ir.Apply, name: str, n: int) -> list[str]:
        x = self.array(e.args[0])
        eps = self.literal(dict(e.options).get("eps", 0.0))
        nn = self.literal(float(n))
        lines = [f"T {name}[{n}];{self._comment(e)}"]
        s = f"{name}_s"
        if e.function == "l2norm":
            lines += [f"const T {s} = lr_dot({x}, {x}, {n});",
                      f"const T {name}_inv = 1 / lr_sqrt({s} + {eps});", "#pragma omp simd",
                      f"for (int i = 0; i < {n}; ++i) {name}[i] = {x}[i] * {name}_inv;"]
        elif e.function == "rmsnorm":
            lines += [f"const T {s} = lr_dot({x}, {x}, {n});",
                      f"const T {name}_inv = 1 / lr_sqrt({s} / {nn} + {eps});", "#pragma omp simd",
                      f"for (int i = 0; i < {n}; ++i) {name}[i] = {x}[i] * {name}_inv;"]
        elif e.function == "groupnorm":
            # x read back through a pointer the compiler cannot see through, once it is stored: where x is a
            # product, GCC (-ffp-contract=fast) makes x − mean one multiply-add of the unrounded product, whose
            # difference from the mean of the rounded one is the product's rounding — not the 0 of one element
            # (or of equal ones), and 1/√eps times that after the division (1e-13 in float64, up to 1e-4 in float32)
            xs = f"{name}_x"
            lines += [f"const T *{xs} = {x};  /* (read back as stored: no x − mean contracted into a multiply-add) */",
                      f'__asm__("" : "+r"({xs}) : : "memory");',
                      f"T {s} = 0;", f"#pragma omp simd reduction(+:{s})",
                      f"for (int i = 0; i < {n}; ++i) {s} += {xs}[i];",
                      f"const T {name}_mean = {s} / {nn};", f"T {name}_var = 0;",
                      f"#pragma omp simd reduction(+:{name}_var)",
                      f"for (int i = 0; i < {n}; ++i) {{ const T c = {xs}[i] - {name}_mean; "
                      f"{name}[i] = c; {name}_var += c * c; }}",
                      f"const T {name}_inv = 1 / lr_sqrt({name}_var / {nn} + {eps});", "#pragma omp simd",
                      f"for (int i = 0; i < {n}; ++i) {name}[i] *= {name}_inv;"]
        elif e.function == "softmax":  # shifted by the maximum: every exponent ≤ 0, the sum ≥ 1
            # (each step a loop that vectorizes: the exponentials by the row helper, a register at a time; a NaN
            # makes the maximum NaN and so every weight, as NumPy's)
            lines += [f"const T {name}_max = lr_max_row({x}, {n});", "#pragma omp simd",
                      f"for (int i = 0; i < {n}; ++i) {name}[i] = {x}[i] - {name}_max;",
                      f"lr_exp_row({name}, {name}, {n});",
                      f"T {s} = 0;", f"#pragma omp simd reduction(+:{s})",
                      f"for (int i = 0; i < {n}; ++i) {s} += {name}[i];",
                      f"const T {name}_inv = 1 / {s};", "#pragma omp simd",
                      f"for (int i = 0; i < {n}; ++i) {name}[i] *= {name}_inv;"]
        else:
            raise self._unsupported(e)
        return lines

    def _unsupported(self, e: ir.Expr) -> UnprintableError:
        try:
            text = to_text(e)
        except TypeError:
            text = type(e).__name__
        return UnprintableError(f"the C printer has no C for `{text}` (shape {list(e.shape)}) per token, which "
                                f"linrec.c.support let through")

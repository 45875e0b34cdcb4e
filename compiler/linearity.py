"""The algebra of expressions linear in a state: write one as Σ coef·L·S·R + (a state-free remainder).

L and R are *factors*: the identity, diag(d), an outer product u⊗w, or a dense matrix; and on its own, with
no other factor, an elementwise (Hadamard) product X⊙S with a matrix X (Mamba-1's exp(Δ·A)*S). Products of factors
collapse to a single factor (diag(a)·diag(b) = diag(a⊙b), diag(d)·(u⊗w) = (d⊙u)⊗w, (u1⊗w1)·(u2⊗w2) =
(w1·u2)·u1⊗w2, …), so every update reduces to a short list of terms whatever way the user wrote it.

A linear expression of lower rank than the state is a term with a vector at one end: a row read q·S·R has
the *covector* q as its left factor (qᵀ·), a column S·x the *vector* x as its right factor (·x), and a scalar
q·S·x both. So `k⊗(v − p·S)` is k⊗v plus the term −(k⊗p)·S, and `q·(S·diag(w))` the term (q)ᵀ·S·diag(w):
the same terms whichever way the products were written or nested.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..dsl.errors import LinrecError

from . import ir
from .analysis import contains_state, inline_lets, to_text

ONE = ir.Const((), 1.0)
ZERO = ir.Const((), 0.0)


# ---- small expression builders that keep the tree tidy ----------------------------------------
def mul(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    if a == ONE:
        return b
    if b == ONE:
        return a
    if isinstance(a, ir.Const) and isinstance(b, ir.Const):
        return ir.Const((), a.value * b.value)
    if isinstance(a, ir.Const) and a.value == -1.0:
        return neg(b)
    if isinstance(b, ir.Const) and b.value == -1.0:
        return neg(a)
    if isinstance(a, ir.Neg):
        return neg(mul(a.operand, b))
    if isinstance(b, ir.Neg):
        return neg(mul(a, b.operand))
    return ir.Arith(a.shape or b.shape, "mul", a, b)


def neg(a: ir.Expr) -> ir.Expr:
    if isinstance(a, ir.Const):
        return ir.Const((), -a.value)
    if isinstance(a, ir.Neg):
        return a.operand
    return ir.Neg(a.shape, a)


def add(a: ir.Expr | None, b: ir.Expr) -> ir.Expr:
    if a is None:
        return b
    if isinstance(a, ir.Const) and isinstance(b, ir.Const) and not a.shape and not b.shape:
        return ir.Const((), a.value + b.value)
    if isinstance(b, ir.Neg):
        return ir.Arith(a.shape or b.shape, "sub", a, b.operand)
    return ir.Arith(a.shape or b.shape, "add", a, b)


def vdot(a: ir.Expr, b: ir.Expr) -> ir.Expr:
    return ir.Dot((), a, b)


# ---- factors and terms ------------------------------------------------------------------------
@dataclass(frozen=True)
class Factor:
    kind: str                # "identity" | "diag" | "outer" | "dense" | "covector" (left) | "vector" (right)
    #                          | "hadamard" (X⊙S: elementwise, as the term's only factor)
    u: ir.Expr | None = None  # diag: the diagonal; outer: the left vector; dense, hadamard: the matrix; (co)vector: it
    w: ir.Expr | None = None  # outer: the right vector


IDENTITY = Factor("identity")


@dataclass(frozen=True)
class Term:
    """coef · left · S · right (right None means no right factor)."""

    coef: ir.Expr
    left: Factor
    right: Factor | None = None

    def scaled(self, c: ir.Expr) -> "Term":
        return Term(mul(c, self.coef), self.left, self.right)


def as_matrix(f: Factor, n: str) -> ir.Expr:
    """The factor as a matrix expression (`n`: the size of an identity's axes); messages print terms with it."""
    if f.kind == "identity":
        return ir.Identity((n, n))
    if f.kind == "diag":
        return ir.Diag((f.u.shape[0],) * 2, f.u)
    if f.kind == "outer":
        return ir.Outer((f.u.shape[0], f.w.shape[0]), f.u, f.w)
    return f.u


def compose(a: Factor, b: Factor) -> tuple[ir.Expr, Factor]:
    """a·b as (scalar coefficient, factor). A covector on the left stays one (qᵀ·M = (Mᵀq)ᵀ), as does a
    vector on the right (M·x)."""
    if a.kind == "covector":
        return _covector_times(a.u, b)
    if b.kind == "vector":
        return _times_vector(a, b.u)
    if a.kind == "identity":
        return ONE, b
    if b.kind == "identity":
        return ONE, a
    if per_column(a) or per_column(b):  # (its vectors differ by column: no product with another factor)
        raise _elementwise_beside_a_factor()
    if a.kind == "outer" and b.kind == "hadamard":  # (u⊗w)·(X⊙S): column c reads (w⊙X[:, c])·S[:, c]
        return ONE, Factor("outer", a.u, rows_scaled(a.w, b.u))
    if "hadamard" in (a.kind, b.kind):  # M·(X⊙S) is no product of factors: the forms take X⊙S alone
        raise _elementwise_beside_a_factor()
    if a.kind == "diag" and b.kind == "diag":
        return ONE, Factor("diag", mul(a.u, b.u))
    if a.kind == "diag" and b.kind == "outer":
        return ONE, Factor("outer", mul(a.u, b.u), b.w)
    if a.kind == "outer" and b.kind == "diag":
        return ONE, Factor("outer", a.u, mul(a.w, b.u))
    if a.kind == "outer" and b.kind == "outer":
        return vdot(a.w, b.u), Factor("outer", a.u, b.w)
    left, right = as_matrix(a, "n"), as_matrix(b, "n")
    return ONE, Factor("dense", ir.Dot((left.shape[0], right.shape[-1]), left, right))


def per_column(f: Factor) -> bool:
    """An outer factor whose vectors differ by column of the state: u⊗w with a matrix u or w [rows, cols], the
    correction of an elementwise decay that reads or writes the decayed state (rows_scaled)."""
    return f.kind == "outer" and (len(f.u.shape) == 2 or len(f.w.shape) == 2)


def rows_scaled(d: ir.Expr, x: ir.Expr) -> ir.Expr:
    """diag(d)·X: the matrix d[r]·X[r, c], column c the vector d⊙X[:, c]."""
    return ir.Dot(x.shape, ir.Diag((x.shape[0],) * 2, d), x)


def _covector_times(q: ir.Expr, f: Factor) -> tuple[ir.Expr, Factor]:
    if f.kind == "hadamard" or per_column(f):
        raise Unfactorable(f"`{to_text(q)}` contracts an elementwise product with the state (`X*S`), which the "
                           f"forms take only as a transition")
    if f.kind == "identity":
        return ONE, Factor("covector", q)
    if f.kind == "diag":
        return ONE, Factor("covector", mul(q, f.u))
    if f.kind == "outer":  # q·(u⊗w) = (q·u)·w
        return vdot(q, f.u), Factor("covector", f.w)
    if f.kind == "dense":
        return ONE, Factor("covector", ir.Dot(f.u.shape[1:], q, f.u))
    raise Unfactorable(f"`{to_text(q)}` contracts a {f.kind}")


def _times_vector(f: Factor, x: ir.Expr) -> tuple[ir.Expr, Factor]:
    if per_column(f):
        raise Unfactorable(f"a correction of an elementwise product with the state contracts `{to_text(x)}`")
    if f.kind == "identity":
        return ONE, Factor("vector", x)
    if f.kind == "diag":
        return ONE, Factor("vector", mul(f.u, x))
    if f.kind == "outer":  # (u⊗w)·x = (w·x)·u
        return vdot(f.w, x), Factor("vector", f.u)
    if f.kind == "dense":
        return ONE, Factor("vector", ir.Dot(f.u.shape[:1], f.u, x))
    raise Unfactorable(f"a {f.kind} contracts `{to_text(x)}`")


def operator_terms(m: ir.Expr) -> list[tuple[ir.Expr, Factor]]:
    """A state-free matrix expression as a sum of coef·factor."""
    if isinstance(m, ir.Identity):
        return [(ONE, IDENTITY)]
    if isinstance(m, ir.Diag):
        return [(ONE, Factor("diag", m.operand))]
    if isinstance(m, ir.Outer):
        return [(ONE, Factor("outer", m.left, m.right))]
    if isinstance(m, ir.Neg):
        return [(neg(c), f) for c, f in operator_terms(m.operand)]
    if isinstance(m, ir.Arith) and m.op in ("add", "sub"):
        right = operator_terms(m.right)
        if m.op == "sub":
            right = [(neg(c), f) for c, f in right]
        return operator_terms(m.left) + right
    if isinstance(m, (ir.Arith, ir.Dot)) and (not m.left.shape or not m.right.shape):
        if isinstance(m, ir.Arith) and m.op not in ("mul", "div"):
            return [(ONE, Factor("dense", m))]
        scalar, matrix = (m.left, m.right) if not m.left.shape else (m.right, m.left)
        if isinstance(m, ir.Arith) and m.op == "div":
            if not m.right.shape:
                scalar = ir.Arith((), "div", ONE, m.right)
            else:
                return [(ONE, Factor("dense", m))]
        return [(mul(scalar, c), f) for c, f in operator_terms(matrix)]
    if isinstance(m, ir.Dot) and len(m.left.shape) == 2 and len(m.right.shape) == 2:
        left, right = operator_terms(m.left), operator_terms(m.right)
        if len(left) * len(right) > MAX_TERMS:  # (a product of sums multiplies out: bounded as linear_terms is)
            raise Unfactorable(f"a product of matrices multiplies out into more than {MAX_TERMS} terms, where the "
                               f"forms take a decay and a few rank-one terms")
        out = []
        for ca, fa in left:
            for cb, fb in right:
                c, f = compose(fa, fb)
                out.append((mul(mul(ca, cb), c), f))
        return out
    return [(ONE, Factor("dense", m))]


def vector_terms(v: ir.Expr) -> list[tuple[ir.Expr, ir.Expr]]:
    """A state-free vector expression as a sum of coef·vector (splitting sums and scalar factors)."""
    if isinstance(v, ir.Neg):
        return [(neg(c), x) for c, x in vector_terms(v.operand)]
    if isinstance(v, ir.Arith) and v.op in ("add", "sub") and v.left.shape and v.right.shape:
        right = vector_terms(v.right)
        if v.op == "sub":
            right = [(neg(c), x) for c, x in right]
        return vector_terms(v.left) + right
    return [(ONE, v)]


class NotLinear(LinrecError):
    pass


class Unfactorable(Exception):
    """Linear, but not in a shape the derived forms handle; the message says why."""


# The most terms linear in the state an update may split into: assignments composed in steps multiply out, each
# (I − a⊗b)·S step doubling them (found by probing: 18 steps took minutes to classify); a decay plus a few
# rank-one terms, what the forms take, is far below it
MAX_TERMS = 256


def _bounded(terms: list, state: str) -> list:
    if len(terms) > MAX_TERMS:
        raise Unfactorable(f"its update multiplies out into more than {MAX_TERMS} terms linear in '{state}' (each "
                           f"assignment step of the form (I − a⊗b)·{state} doubles them), where the forms take a "
                           f"decay and a few rank-one terms")
    return terms


def linear_terms(e: ir.Expr, state: str) -> tuple[list[Term], ir.Expr | None]:
    """Split `e` (lets already inlined) into terms linear in `state` and a state-free remainder.

    Raises NotLinear when the state enters non-linearly, Unfactorable when it enters linearly in a way
    the forms do not decompose (then only the recurrent form exists).
    """
    if not contains_state(e, state):
        return [], e
    if isinstance(e, ir.StateRef):
        return [Term(ONE, IDENTITY)], None
    if isinstance(e, ir.Neg):
        terms, rem = linear_terms(e.operand, state)
        return [t.scaled(ir.Const((), -1.0)) for t in terms], (neg(rem) if rem is not None else None)
    if isinstance(e, ir.Arith) and e.op in ("add", "sub"):
        lt, lr = linear_terms(e.left, state)
        rt, rr = linear_terms(e.right, state)
        if e.op == "sub":
            rt = [t.scaled(ir.Const((), -1.0)) for t in rt]
            rr = neg(rr) if rr is not None else None
        rem = lr if rr is None else add(lr, rr)
        return _bounded(lt + rt, state), rem
    if _is_sum(e):
        return _summed(e, state)
    if isinstance(e, (ir.Arith, ir.Dot, ir.Outer)):
        in_left = _side_with_state(e, state)
        other = e.right if in_left else e.left
        inner = e.left if in_left else e.right
        terms, rem = linear_terms(inner, state)

        def rebuilt(r):
            if r is None:
                return None
            return type(e)(e.shape, *((e.op,) if isinstance(e, ir.Arith) else ()),
                           *((r, other) if in_left else (other, r)))
        if not other.shape:  # a scalar factor
            c = ir.Arith((), "div", ONE, other) if isinstance(e, ir.Arith) and e.op == "div" else other
            return [t.scaled(c) for t in terms], rebuilt(rem)
        if rem is not None and not rem.shape and inner.shape and not isinstance(e, ir.Arith):
            raise _broadcast_under_a_map(e, inner, state)
        return _bounded([t for term in terms for t in _product(e, term, inner, other, in_left, state)], state), \
            rebuilt(rem)
    raise _applies_a_function(e, state)


def _is_sum(e: ir.Expr) -> bool:
    """sum(x) or mean(x) of a vector x."""
    return isinstance(e, ir.Apply) and e.function in ("sum", "mean") and len(e.args) == 1 and len(e.args[0].shape) == 1


def _summed(e: ir.Apply, state: str) -> tuple[list[Term], ir.Expr | None]:
    """sum(x) and mean(x) of a vector x linear in a vector state: the contraction 1·x (over n for mean), its
    terms those of a readout by the vector of ones (`sum(kn*z)` is kn·z). Of a row read of a matrix state,
    Unfactorable: a readout's query takes no vector of ones (the readouts take such an output as computed from
    its reads, as before)."""
    (x,) = e.args
    ones = ir.Const(x.shape, 1.0)
    scale = ONE if e.function == "sum" else ir.Arith((), "div", ONE, ir.DimSize((), x.shape[0]))
    terms, rem = linear_terms(x, state)
    if any(t.left.kind == "covector" or t.right is not None for t in terms):
        raise Unfactorable(f"`{to_text(e)}` sums a read of a matrix state, which the forms take as it is computed "
                           f"from the read, not as a read of its own")
    contraction = ir.Dot((), ones, x)
    out = [t.scaled(scale) for term in terms for t in _product(contraction, term, x, ones, False, state)]
    return _bounded(out, state), (None if rem is None else ir.Apply((), e.function, (rem,), e.options))


def _product(e: ir.Arith | ir.Dot | ir.Outer, t: Term, inner: ir.Expr, other: ir.Expr, in_left: bool,
             state: str) -> list[Term]:
    """The terms of `e`, a product of the state-free `other` (not a scalar) with the term t of `inner`.
    inner's rank says which ends of t are open: a matrix (L·S·R), a row (qᵀ·S·R, its left a covector), a
    column (L·S·x, its right a vector; for a vector state z, L·z) or a scalar (qᵀ·S·x)."""
    row = t.left.kind == "covector"
    column = len(inner.shape) == 1 and not row
    if isinstance(e, ir.Arith) and e.op == "mul" and len(other.shape) == 2 and len(inner.shape) == 2:
        if t.right is None and t.left.kind == "outer":  # X⊙(u⊗(w·S)): column c writes X[:, c]⊙u
            return [Term(t.coef, Factor("outer", rows_scaled(t.left.u, other), t.left.w))]
        if t.right is not None or t.left.kind not in ("identity", "hadamard"):
            raise _elementwise_beside_a_factor(e)
        # X ⊙ (c·S) or X ⊙ (Y ⊙ S): an elementwise transition, one scalar recurrence per element
        return [Term(t.coef, Factor("hadamard", other if t.left.kind == "identity" else mul(other, t.left.u)))]
    if isinstance(e, ir.Arith):
        if e.op not in ("mul", "div") or len(other.shape) != 1 or (e.op == "div" and not in_left):
            raise _unfactorable(e, state)
        d = other if e.op == "mul" else ir.Arith(other.shape, "div", ONE, other)
        if not inner.shape:  # d * (qᵀ·S·x) = (d⊗q)·S·x
            return [Term(t.coef, Factor("outer", d, t.left.u), t.right)]
        if row:  # (qᵀ·S·R) ⊙ d = qᵀ·S·R·diag(d)
            return [_right(t, Factor("diag", d))]
        return [_left(Factor("diag", d), t)]  # d ⊙ (L·S·x) = diag(d)·L·S·x (d*z for a vector state)
    if isinstance(e, ir.Outer):
        if not in_left and row:
            return [Term(t.coef, Factor("outer", other, t.left.u), t.right)]  # u⊗(qᵀ·S·R) = (u⊗q)·S·R
        if in_left and column and t.right is not None and t.right.kind == "vector":
            return [Term(t.coef, t.left, Factor("outer", t.right.u, other))]  # (L·S·x)⊗w = L·S·(x⊗w)
        raise _unfactorable(e, state)
    if not inner.shape:  # a scalar times a vector: d·(qᵀ·S·x)
        if len(other.shape) != 1:
            raise _unfactorable(e, state)
        return [Term(t.coef, Factor("outer", other, t.left.u), t.right)]
    if not in_left:  # other·inner
        if len(other.shape) == 2:  # M·X: a left factor
            if row:
                raise _unfactorable(e, state)
            return [_left(f, t.scaled(c)) for c, f in operator_terms(other)]
        if row:  # x·(qᵀ·S·R) = qᵀ·S·(R·x)
            return [_right(t, Factor("vector", other))]
        if t.right is not None and t.right.kind != "vector" and column:
            raise _unfactorable(e, state)
        return [_left(Factor("covector", other), t)]  # x·(L·S·R) = (Lᵀx)ᵀ·S·R
    if len(other.shape) == 2:  # X·M: a right factor
        if t.right is not None and t.right.kind == "vector":
            raise _unfactorable(e, state)
        return [_right(t.scaled(c), f) for c, f in operator_terms(other)]
    if column:  # (L·S·x)·y = (Lᵀy)ᵀ·S·x
        if t.right is not None and t.right.kind != "vector":
            raise _unfactorable(e, state)
        return [_left(Factor("covector", other), t)]
    return [_right(t, Factor("vector", other))]  # (qᵀ·S·R)·x and (L·S·R)·x: R·x


def _left(f: Factor, t: Term) -> Term:
    c, ff = compose(f, t.left)
    return Term(mul(c, t.coef), ff, t.right)


def _right(t: Term, f: Factor) -> Term:
    c, ff = compose(t.right or IDENTITY, f)
    return Term(mul(c, t.coef), t.left, ff)


def _elementwise_beside_a_factor(e: ir.Expr | None = None) -> "Unfactorable":
    where = f" in `{to_text(e)}`" if e is not None else ""
    return Unfactorable(f"an elementwise product with the state (`X*S`) meets another factor of it{where}; the "
                        f"forms take an elementwise decay only as the whole factor of its term (`exp(X)*S`), and a "
                        f"rank-one correction beside it on the state as it was (`exp(X)*S − u⊗(w·S)` or "
                        f"`exp(X)*S − (S·a)⊗b`)")


def _broadcast_under_a_map(e: ir.Expr, inner: ir.Expr, state: str) -> "Unfactorable":
    """A scalar added to the state (`z + s`, the same value in every element) inside a product that contracts it
    (`kn·(z + s)`, `M·(z + s)`, `diag(d)·(z + s)`: a later step of an update in steps, composed). Split off as the
    remainder, the scalar would meet the product as a scalar, which scales rather than contracts (kn·s, where the
    program means kn·(s, s, …)); only an elementwise product keeps its meaning. A probe found the forms raising
    NumPy errors on it."""
    return Unfactorable(f"a scalar is added to '{state}' in `{to_text(inner)}` before `{to_text(e)}` maps it (the "
                        f"steps of an update composed): the derived forms take a scalar only as a term of its own; "
                        f"add it after the step that maps '{state}', or write it as a vector")


def _unfactorable(e: ir.Expr, state: str) -> "Unfactorable":
    return Unfactorable(f"`{to_text(e)}` is linear in '{state}' but not a product the forms can factor "
                        f"(left factors such as a·S, diag(d)·S, (I − u⊗w)·S)")


def check_linear(value: ir.Expr, state: str, lets: dict[str, ir.Expr]) -> None:
    """Raise NotLinear (with the span of the offending part) unless `value` is affine in `state`. Decided on
    the whole expression, apart from how the derived forms factor it: a term they cannot factor (then only
    the recurrent form exists) must not hide a square of the state in a later term."""
    _require_affine(inline_lets(value, lets), state)


def _require_affine(e: ir.Expr, state: str) -> None:
    """The walk linear_terms makes, with its NotLinear cases and none of its Unfactorable ones: every term
    of a sum, and the side of a product that holds the state."""
    if not contains_state(e, state) or isinstance(e, ir.StateRef):
        return
    if isinstance(e, ir.Neg):
        _require_affine(e.operand, state)
        return
    if isinstance(e, ir.Arith) and e.op in ("add", "sub"):
        _require_affine(e.left, state)
        _require_affine(e.right, state)
        return
    if isinstance(e, (ir.Arith, ir.Dot, ir.Outer)):
        _require_affine(e.left if _side_with_state(e, state) else e.right, state)
        return
    if _is_sum(e):  # (a contraction with ones: linear)
        _require_affine(e.args[0], state)
        return
    raise _applies_a_function(e, state)


def _side_with_state(e: ir.Arith | ir.Dot | ir.Outer, state: str) -> bool:
    """Whether the state is in the left operand of a product that holds it (else the right); NotLinear when
    the product is not linear in it: the state times itself, a division by it, a power of it."""
    in_left, in_right = contains_state(e.left, state), contains_state(e.right, state)
    if isinstance(e, ir.Arith) and e.op == "div" and in_right:
        raise NotLinear(f"the update is not linear in '{state}': `{to_text(e)}` divides by the state", e.span)
    if in_left and in_right:
        raise NotLinear(f"the update is not linear in '{state}': `{to_text(e)}` multiplies the state by itself",
                        e.span)
    if isinstance(e, ir.Arith) and e.op == "pow":
        raise NotLinear(f"the update is not linear in '{state}': `{to_text(e)}`", e.span)
    return in_left


def _applies_a_function(e: ir.Expr, state: str) -> NotLinear:
    return NotLinear(f"the update is not linear in '{state}': `{to_text(e)}` applies a function to the state",
                     e.span)


def split_scalar(e: ir.Expr) -> tuple[ir.Expr, ir.Expr]:
    """A vector expression as (scalar coefficient, vector base): −(a·(b·k)) → (−(a·b), k)."""
    if isinstance(e, ir.Neg):
        c, base = split_scalar(e.operand)
        return neg(c), base
    if isinstance(e, (ir.Arith, ir.Dot)) and (not isinstance(e, ir.Arith) or e.op in ("mul", "div")):
        a, b = e.left, e.right
        if isinstance(e, ir.Arith) and e.op == "div":
            if not b.shape and a.shape:
                c, base = split_scalar(a)
                return ir.Arith((), "div", c, b), base
            return ONE, e
        if not a.shape and b.shape:
            c, base = split_scalar(b)
            return mul(a, c), base
        if not b.shape and a.shape:
            c, base = split_scalar(a)
            return mul(c, b), base
    return ONE, e

"""Readouts by linearity: an output's reads of a matrix state brought to the readout shape q·S.

The derived forms compute r = q·S (S_(t−1) or S_t) for a state-free query q, and the outputs over r. Any
part of an output that is linear in S is such a read, however it is written: `q·(S·diag(w))` is (q·S)*w,
`(q + p)·S·W + p·S` is (q·S)·W + (p·S)·W + p·S, `q·(S + k⊗v)` is q·S + q·(k⊗v), `(q·S)·x` stays a readout
contracted with x. compiler.linearity writes such a part as Σ coef·qᵀ·S·R (a covector on the left, a factor
or a vector on the right), and `in_readout_shape` rebuilds it as Σ coef·(R applied to q·S). A part already
in the readout shape is left as written (its code stays the user's), and a part that is not linear in S
— `groupnorm(q·S)` — keeps its shape, with its linear parts rewritten inside it.
"""
from __future__ import annotations

import dataclasses

from . import ir
from .analysis import children, rebuild, states_in, walk
from .linearity import (IDENTITY, NotLinear, Term, Unfactorable, add, linear_terms, mul, vdot)

_MARK = "\0read"  # the version of the state being rewritten, named apart from its other version


def in_readout_shape(e: ir.Expr, states: tuple[ir.State, ...]) -> ir.Expr:
    """`e` (named values written out) with each linear read of a matrix state in the readout shape q·S,
    where the math allows; what cannot be brought to it is left as written."""
    for st in states:
        if len(st.shape) != 2:  # a vector state's value is itself a readout (an elementwise read)
            continue
        for version in ("prev", "new"):
            e = _rewrite(e, ir.StateRef(st.shape, st.name, version))
    return e


def read_side(n: ir.Expr) -> tuple[ir.StateRef, ir.Expr, str] | None:
    """(the matrix state, the vector query, the side it reads from) when `n` is a readout q·S ("left") or S·q
    ("right": the transposed convention's readout); else None."""
    if not isinstance(n, ir.Dot):
        return None
    if isinstance(n.right, ir.StateRef) and len(n.right.shape) == 2 and len(n.left.shape) == 1:
        return n.right, n.left, "left"
    if isinstance(n.left, ir.StateRef) and len(n.left.shape) == 2 and len(n.right.shape) == 1:
        return n.left, n.right, "right"
    return None


def _is_read(node: ir.Expr, state: ir.StateRef) -> bool:
    return isinstance(node, ir.StateRef) and (node.name, node.version) == (state.name, state.version)


def _in_shape(e: ir.Expr, state: ir.StateRef) -> bool:
    """Every read of `state` in `e` is q·S with a state-free vector q."""
    reads = sum(_is_read(n, state) for n in walk(e))
    readouts = sum(isinstance(n, ir.Dot) and _is_read(n.right, state) and len(n.left.shape) == 1
                   and not states_in(n.left) for n in walk(e))
    return reads == readouts


def _rewrite(e: ir.Expr, state: ir.StateRef) -> ir.Expr:
    if _in_shape(e, state):
        return e
    if len(e.shape) <= 1:
        rewritten = _as_readouts(e, state)
        if rewritten is not None:
            return rewritten
    fields = {ir.Apply: ("args",), ir.Neg: ("operand",), ir.Diag: ("operand",)}.get(type(e), ("left", "right"))
    if isinstance(e, ir.Apply):
        return dataclasses.replace(e, args=tuple(_rewrite(a, state) for a in e.args))
    if not children(e):
        return e
    return dataclasses.replace(e, **{f: _rewrite(getattr(e, f), state) for f in fields})


def _as_readouts(e: ir.Expr, state: ir.StateRef) -> ir.Expr | None:
    """`e` as Σ coef·R(q·S) + remainder when it is linear in `state` and every term reads S from the left
    with a state-free query; None otherwise."""
    marked = _mark(e, state, _MARK)
    try:
        terms, remainder = linear_terms(marked, state.name + _MARK)
    except (NotLinear, Unfactorable):
        return None
    if not terms or any(t.left.kind != "covector" or states_in(t.left.u) for t in terms):
        return None
    out = None
    for t in terms:
        out = add(out, _term(t, state))
    if remainder is not None:
        out = add(out, _mark(remainder, state, None))
    return out


def _term(t: Term, state: ir.StateRef) -> ir.Expr:
    q = t.left.u
    read = ir.Dot(state.shape[1:], q, state)
    right = t.right or IDENTITY
    if right.kind == "identity":
        value = read
    elif right.kind == "diag":
        value = mul(read, right.u)
    elif right.kind == "outer":  # (q·S)·(a⊗b) = ((q·S)·a)·b
        value = mul(vdot(read, right.u), right.w)
    elif right.kind == "vector":
        value = vdot(read, right.u)
    else:  # dense
        value = ir.Dot(right.u.shape[1:], read, right.u)
    return mul(t.coef, value)


def _mark(e: ir.Expr, state: ir.StateRef, mark: str | None) -> ir.Expr:
    """Rename the reads of this version of the state apart (mark), or back (None)."""
    def visit(node: ir.Expr) -> ir.Expr:
        if mark is not None and _is_read(node, state):
            return dataclasses.replace(node, name=state.name + mark)
        if mark is None and isinstance(node, ir.StateRef) and node.name == state.name + _MARK:
            return dataclasses.replace(node, name=state.name)
        return node
    return rebuild(e, visit)

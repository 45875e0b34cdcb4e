"""A matrix state multiplied and read from the right, carried transposed.

The source document writes the delta rule in the transposed convention, S ∈ R^(dv×dk):
S_t = S_(t−1)·(I − β k⊗k) + β v⊗k, read as S·q. Its transpose Sᵀ_t = (I − β k⊗k)·Sᵀ_(t−1) + β k⊗v, read
as q·Sᵀ, has the left-factored shape the derived forms need. So decompose() classifies the program with such a
state replaced by its transpose, and the forms carry Sᵀ, transposing the initial and final state at the
boundary (the recurrent form runs the statements as written).

`transposed` rewrites every expression so that no transpose operator is needed: (A·B)ᵀ = Bᵀ·Aᵀ,
(u⊗w)ᵀ = w⊗u, diag(d)ᵀ = diag(d), Iᵀ = I, elementwise operations and scalar factors commute with it, and
v·M = Mᵀ·v. Anything else that would have to be transposed — a parameter or input matrix meeting the
state, say — leaves the state as written.
"""
from __future__ import annotations

import dataclasses

from . import ir
from .analysis import contains_state, inline_lets


class NotTransposable(Exception):
    pass


def _flip(shape: ir.Shape) -> ir.Shape:
    return tuple(reversed(shape))


def _matrix(e: ir.Expr, state: str) -> ir.Expr:
    """Mᵀ for a matrix expression M in which `state` stands for Sᵀ."""
    if isinstance(e, ir.StateRef) and e.name == state:
        return dataclasses.replace(e, shape=_flip(e.shape))
    if isinstance(e, ir.Identity):
        return e
    if isinstance(e, ir.Diag):
        return ir.Diag(e.shape, _value(e.operand, state), span=e.span)
    if isinstance(e, ir.Outer):
        return ir.Outer(_flip(e.shape), _value(e.right, state), _value(e.left, state), span=e.span)
    if isinstance(e, ir.Neg):
        return ir.Neg(_flip(e.shape), _matrix(e.operand, state), span=e.span)
    if isinstance(e, ir.Apply) and len(e.args) == 1:  # elementwise on a matrix
        return dataclasses.replace(e, shape=_flip(e.shape), args=(_matrix(e.args[0], state),))
    if isinstance(e, (ir.Arith, ir.Dot)) and (not e.left.shape or not e.right.shape):  # a scalar factor
        part = lambda x: _value(x, state) if not x.shape else _matrix(x, state)  # noqa: E731
        return dataclasses.replace(e, shape=_flip(e.shape), left=part(e.left), right=part(e.right))
    if isinstance(e, ir.Arith):  # elementwise between matrices
        return dataclasses.replace(e, shape=_flip(e.shape), left=_matrix(e.left, state),
                                   right=_matrix(e.right, state))
    if isinstance(e, ir.Dot):  # (A·B)ᵀ = Bᵀ·Aᵀ
        return ir.Dot(_flip(e.shape), _matrix(e.right, state), _matrix(e.left, state), span=e.span)
    raise NotTransposable(e)


def _value(e: ir.Expr, state: str) -> ir.Expr:
    """A scalar or vector expression with `state` standing for Sᵀ (its value is unchanged)."""
    if not contains_state(e, state):
        return e
    if isinstance(e, ir.Dot) and len(e.left.shape) == 1 and len(e.right.shape) == 2 \
            and contains_state(e.right, state):  # v·M = Mᵀ·v
        return ir.Dot(e.shape, _matrix(e.right, state), _value(e.left, state), span=e.span)
    if isinstance(e, ir.Dot) and len(e.left.shape) == 2 and len(e.right.shape) == 1 \
            and contains_state(e.left, state):  # M·v = v·Mᵀ
        return ir.Dot(e.shape, _value(e.right, state), _matrix(e.left, state), span=e.span)
    if isinstance(e, (ir.StateRef, ir.Diag, ir.Identity, ir.Outer)):
        raise NotTransposable(type(e).__name__)
    if isinstance(e, ir.Apply):
        return dataclasses.replace(e, args=tuple(_value(a, state) for a in e.args))
    if isinstance(e, ir.Neg):
        return dataclasses.replace(e, operand=_value(e.operand, state))
    if isinstance(e, (ir.Arith, ir.Dot)) and len(e.left.shape) < 2 and len(e.right.shape) < 2:
        return dataclasses.replace(e, left=_value(e.left, state), right=_value(e.right, state))
    if isinstance(e, ir.Dot):  # a vector and a matrix without the state: only the vector can hold it
        vec = "left" if len(e.left.shape) == 1 else "right"
        return dataclasses.replace(e, **{vec: _value(getattr(e, vec), state)})
    raise NotTransposable(type(e).__name__)


def transposed(program: ir.Program, state: str) -> ir.Program | None:
    """The program with matrix state `state` replaced by its transpose (declared with its axes swapped), named
    values inlined; None when some expression would need the transpose of anything but the state and the
    structured factors."""
    st = program.state(state)
    if len(st.shape) != 2:
        return None
    lets = program.lets
    steps = []
    try:
        for s in program.steps:
            if isinstance(s, ir.Let):
                continue
            value = inline_lets(s.value, lets)
            if isinstance(s, ir.Update):
                value = _matrix(value, state) if s.state == state else _value(value, state)
            else:
                value = _value(value, state)
            steps.append(dataclasses.replace(s, value=value))
    except NotTransposable:
        return None
    states = tuple(ir.State(s.name, _flip(s.shape)) if s.name == state else s for s in program.states)
    return dataclasses.replace(program, states=states, steps=tuple(steps))


def obstacle(program: ir.Program, state: str) -> ir.Expr | None:
    """The input or param matrix that keeps matrix state `state` from being carried transposed (its update would
    need its transpose: `exp(X)*S` with S read from the right), or None when there is none such."""
    update = program.updates.get(state)
    if update is None or len(program.state(state).shape) != 2:
        return None
    try:
        _matrix(inline_lets(update.value, program.lets), state)
    except NotTransposable as why:
        found = why.args[0] if why.args else None
        if isinstance(found, (ir.InputRef, ir.ParamRef)) and len(found.shape) == 2:
            return found
    return None

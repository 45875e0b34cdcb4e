"""The terms of a state's update as the fused kernels run them (fused.py): every update of a factorable
recurrence (compiler.transitions) brought to

    S_t = D_t·S_(t−1) + Σ_g x_g ⊗ y_g

a decay D per row (one scalar or a vector) and rank-one terms grouped by their left vector x_g; y_g adds up
the written values and, for the delta rule, the corrections' p_r = w_rᵀ·S_(t−1) (C locals the kernel
computes first). Stabilized states (stabilize.Scales) come with their rescale in the decay and their keys
shifted."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..compiler import ir
from ..compiler.decompose import Readout
from ..compiler.linearity import ONE, mul, split_scalar
from ..dsl.errors import LinrecError

from .kernel_source import KernelSource
from .printer import Local
from .stabilize import Scales


@dataclass(frozen=True)
class Correction:
    """A rank-one correction u ⊗ (wᵀ·S_(t−1)): its w, and p = wᵀ·S_(t−1), a local of the kernel."""

    w: ir.Expr
    p: Local


@dataclass(frozen=True)
class Term:
    """One term of a group's right vector: coefficient × (the p of correction `correction`, or `value`)."""

    coefficient: ir.Expr
    correction: int | None = None
    value: ir.Expr | None = None


@dataclass(frozen=True)
class WriteGroup:
    """The rank-one terms of an update that share their left vector x: x ⊗ y, y the sum of their terms."""

    x: ir.Expr
    y: ir.Expr
    terms: tuple[Term, ...]


@dataclass(frozen=True)
class StateTerms:
    """A state's update as the fused kernel runs it, and the readouts of the state (queries as Scales
    rewrites them). `decay` is None for a state that does not decay (or a region that does not update)."""

    decay: ir.Expr | None
    corrections: tuple[Correction, ...]
    groups: tuple[WriteGroup, ...]
    readouts: tuple[Readout, ...]

    def queries(self) -> list[ir.Expr]:
        """The queries of the readouts (a read of the state as it is has none)."""
        return [r.query for r in self.readouts if not r.is_value]


def state_terms(kernel: KernelSource, scales: Scales, st: ir.State, *, updates: bool,
                readouts: bool) -> StateTerms:
    """The terms of state st's update (when `updates`) and its readouts (when `readouts`), rank-one terms
    grouped by their left vector."""
    matrix = len(st.shape) == 2
    right_shape = (st.shape[1],) if matrix else ()
    decay, corrections, groups = None, [], []
    if updates:
        tr = kernel.decomposition.transition(st.name)
        decay, writes = scales.transition(tr)
        sums: dict[ir.Expr, list[ir.Expr]] = {}   # left vector → the terms of its right vector, as IR …
        terms: dict[ir.Expr, list[Term]] = {}     # … and as Terms
        for r, (u, w) in enumerate(tr.corrections):
            p = Local(right_shape, kernel.local("p", kernel.cstate(st.name), r))
            corrections.append(Correction(w, p))
            coef, base = _over_rows(split_scalar(u), st)
            sums.setdefault(base, []).append(_scaled(coef, p, right_shape))
            terms.setdefault(base, []).append(Term(coef, correction=r))
        for key, value in writes:
            coef, base = _over_rows(split_scalar(key), st)
            rhs = value if value is not None else ONE
            if matrix and not rhs.shape:
                raise LinrecError(f"state '{st.name}': a write with a scalar value")
            sums.setdefault(base, []).append(_scaled(coef, rhs, right_shape))
            terms.setdefault(base, []).append(Term(coef, value=rhs))
        groups = [WriteGroup(x, _sum(sums[x], right_shape), tuple(terms[x])) for x in sums]
    reads = [replace(r, query=scales.query(r)) for r in kernel.decomposition.readouts if r.state == st.name] \
        if readouts else []
    return StateTerms(decay, tuple(corrections), tuple(groups), tuple(reads))


def _over_rows(split: tuple[ir.Expr, ir.Expr], st: ir.State) -> tuple[ir.Expr, ir.Expr]:
    """(coefficient, left vector) of a rank-one term, the left vector over the state's rows: a scalar one — a
    vector state's write `z = z + beta`, the same value added to every element — is the coefficient of a vector
    of ones (which the printer writes as the literal 1)."""
    coef, base = split
    if base.shape:
        return coef, base
    return mul(coef, base), ir.Const((st.shape[0],), 1.0)


def _sum(terms: list[ir.Expr], shape) -> ir.Expr:
    out = terms[0]
    for t in terms[1:]:
        if isinstance(t, ir.Neg):
            out = ir.Arith(shape, "sub", out, t.operand)
        else:
            out = ir.Arith(shape, "add", out, t)
    return out


def _scaled(coef: ir.Expr, x: ir.Expr, shape) -> ir.Expr:
    if coef == ONE:
        return x
    if isinstance(coef, ir.Neg):
        return ir.Neg(shape, _scaled(coef.operand, x, shape))
    return ir.Arith(shape, "mul", coef, x)

"""Classify each state's transition and decompose its update for the derived forms.

Every factorable update is brought to

    S_t = D_t·S_(t−1)·E_t + Σ_r u_r⊗(w_r·S_(t−1)·E_t) + Σ_r (D_t·S_(t−1)·a_r)⊗b_r + Σ_j key_j⊗value_j

with D_t a positive scalar or diagonal decay carried in log space — or an elementwise one, D_t⊙S_(t−1) with a
matrix D_t (Mamba-1's exp(Δ·A)*S: one scalar recurrence per element; then with no E_t, and its corrections
read S_(t−1) itself: a key-side one acts on each column apart, a value-side one on each row; a key-side one
written on the decayed state, (u⊗w)·(X⊙S) or X⊙(u⊗(w·S)), has a w or u per column, the matrix diag(w)·X or
diag(u)·X), E_t a diagonal
decay of the value axis (the columns of a matrix state: `S·diag(d)`; absent unless written), a few rank-one
corrections on the key side (u, w), or on the value side (a, b: `S·(I − a⊗b)`, the gated Oja rule), and
rank-one writes (key, value). A correction is taken with the decay of the other axis applied (the factor it
cannot absorb), so a state with value-side corrections has a D_t that is a vector or none: a scalar decay
commutes with everything and is moved to E_t. Corrections on both sides at once are no such form (their
pseudo-values and pseudo-keys would be coupled through scalars of both). Nothing here knows a variant by
name: the class follows from the terms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import ir
from .analysis import inline_lets, occurrences, product_factors, refs, states_in, to_text, variance, walk
from .intervals import Bounds, undefaulted_params
from .linearity import (ONE, ZERO, Factor, NotLinear, Term, Unfactorable, add, as_matrix, compose, linear_terms, mul,
                        operator_terms, split_scalar, vector_terms)


@dataclass(frozen=True)
class Transition:
    state: str
    kind: str                                   # human-readable class, e.g. "diagonal decay"
    decay: ir.Expr | None                       # D_t: scalar (), vector [n] or, elementwise, matrix [n, m]; None: I
    log_decay: ir.Expr | None                   # log D_t, simplified symbolically where possible
    log_is_exact: bool                          # False: log(D) computed numerically (needs D > 0)
    corrections: tuple[tuple[ir.Expr, ir.Expr], ...]  # (u, w): + u⊗(wᵀS_(t−1)); beside an elementwise decay u
    #                                                   or w may be a matrix [n, m], a vector per column of S
    writes: tuple[tuple[ir.Expr, ir.Expr | None], ...]  # (key, value); value None for a vector state
    reasons: tuple[str, ...]                    # why the parallel/chunkwise forms do not exist, if so
    value_decay: ir.Expr | None = None          # E_t: a vector [dv] on the columns (S·diag(E)); None: none
    value_log_decay: ir.Expr | None = None      # log E_t, simplified as log_decay is
    value_log_is_exact: bool = True
    value_corrections: tuple[tuple[ir.Expr, ir.Expr], ...] = ()  # (a, b): + (D_t·S_(t−1)·a)⊗b, D_t: the decay
    #                                                               (of the rows; an elementwise one is not applied)
    signed: bool = False  # D_t (a scalar or one per row) may be negative: log_decay is log |D_t| (see magnitude)
    value_signed: bool = False  # E_t may be negative: value_log_decay is log |E_t| (see value_magnitude)

    @property
    def factorable(self) -> bool:
        return not self.reasons

    @property
    def decays_as_values(self) -> bool:
        """A decay (of the rows or of the columns) whose log is computed numerically: its value's gradient is
        the log-decay's divided by it (∂a = ∂l / a), which a small or zero decay makes ill-conditioned — or
        whose exact log divides by what it is computed from: exp(log(a)), sigmoid(log(a)) (logsigmoid(log a)),
        exp(−c/a) give ∂a = ∂l / a (c·∂l / a²), the same division where the decay is small (found by probing:
        a = 1e-12 made the C backward's ∂a 2.5e-5 off in float64, and 1e-300 with sigmoid(log(a)) 1e283)."""
        return (self.log_decay is not None and (not self.log_is_exact or _divides(self.log_decay))) or \
            (self.value_log_decay is not None and (not self.value_log_is_exact or _divides(self.value_log_decay)))

    @property
    def magnitude(self) -> ir.Expr | None:
        """The decay whose logarithm the forms take: |D_t| for a decay of either sign, else D_t. A decay of
        either sign is |D_t| times a sign s_t: with σ_t = s_1 ⋯ s_t (per row; a decay of 0 counts +1), S̃_t =
        σ_t ⊙ S_t follows the same update with the decay |D_t| and the keys and u taken times σ_t, the w
        times σ_(t−1), the queries read after the update times σ_t and those before it times σ_(t−1); the
        state is σ_T ⊙ S̃_T (backends/numpy/scan.py's running_signs, with_signs)."""
        return _abs(self.decay) if self.signed else self.decay

    @property
    def value_magnitude(self) -> ir.Expr | None:
        """The decay of the value axis whose logarithm the forms take: |E_t| for one of either sign, else E_t.
        As magnitude's, on the columns: with τ_t the running product of E's signs, S̃_t = S_t·diag(τ_t) decays
        by |E_t|, the values (of the writes, and the b of value-side corrections) taken times τ_t, the a of
        value-side corrections times τ_(t−1), every readout q·S̃ times τ_t (τ_(t−1) before the update), and
        the state is S̃_T·diag(τ_T) (backends/numpy/scan.py's with_value_signs)."""
        return _abs(self.value_decay) if self.value_signed else self.value_decay

    @property
    def elementwise(self) -> bool:
        """D_t⊙S_(t−1): a decay per element of a matrix state (its log-decay has the state's shape)."""
        return self.decay is not None and len(self.decay.shape) == 2


def _abs(e: ir.Expr) -> ir.Expr:
    """|e|: the decay of either sign whose logarithm the forms take."""
    return ir.Apply(e.shape, "abs", (e,))


def _divides(log_decay: ir.Expr) -> bool:
    """Whether a log-decay's derivative divides by a value it is computed from: a log, a quotient or a negative
    power of something with a gradient (an input, a param, a named value)."""
    def varies(e: ir.Expr) -> bool:
        return any(isinstance(n, (ir.InputRef, ir.ParamRef, ir.LetRef, ir.StateRef, ir.ReadoutRef)) for n in walk(e))
    for n in walk(log_decay):
        if isinstance(n, ir.Apply) and n.function == "log" and varies(n.args[0]):
            return True
        if isinstance(n, ir.Arith) and n.op == "div" and varies(n.right):
            return True
        if isinstance(n, ir.Arith) and n.op == "pow" and varies(n.left) and \
                not (isinstance(n.right, ir.Const) and n.right.value >= 1):
            return True
    return False


def log_of(e: ir.Expr, bounds: Bounds | None = None) -> tuple[ir.Expr, bool]:
    """log(e) simplified so that strong decays stay exact (log(exp(x)) = x, not log of an underflow), and
    whether it is: a product or quotient taken factor by factor, log(a·b) = log a + log b, only where it is
    elementwise (not a contraction a·b of two vectors, whose log is no sum of logs) and `bounds` find both
    factors positive (−a·−b is positive, its factors' logs NaN); a power's, y·log x, only for a positive x.
    Elsewhere the log of the values (not exact). bounds None: the factors are taken as positive."""
    def positive(x: ir.Expr) -> bool:
        return bounds is None or bounds.of(x).positive
    if isinstance(e, ir.Apply) and e.function == "exp":
        return e.args[0], True
    if isinstance(e, ir.Apply) and e.function == "sigmoid":
        return ir.Apply(e.shape, "logsigmoid", e.args), True
    if isinstance(e, ir.Const) and e.value > 0:
        return ir.Const((), math.log(e.value)), True
    elementwise = (isinstance(e, ir.Arith) and e.op in ("mul", "div")
                   and (not e.left.shape or not e.right.shape or e.left.shape == e.right.shape)) \
        or (isinstance(e, ir.Dot) and not (e.left.shape and e.right.shape))
    if elementwise and positive(e.left) and positive(e.right):
        (la, ea), (lb, eb) = log_of(e.left, bounds), log_of(e.right, bounds)
        op = "sub" if isinstance(e, ir.Arith) and e.op == "div" else "add"
        return ir.Arith(la.shape or lb.shape, op, la, lb), ea and eb
    if isinstance(e, ir.Arith) and e.op == "pow" and positive(e.left):  # log(x^y) = y·log x, elementwise
        la, ea = log_of(e.left, bounds)
        return mul(e.right, la), ea
    return ir.Apply(e.shape, "log", (e,)), False


def _describe(decay: ir.Expr | None, corrections, value_decay: ir.Expr | None = None, value_side: bool = False,
              signed: bool = False, value_signed: bool = False) -> str:
    if decay is None:
        base = "identity" if value_decay is None else ""
    elif decay == ZERO:
        base = "a decay of 0"
    elif len(decay.shape) == 2:
        base = "elementwise decay"
    elif decay.shape:
        base = "diagonal decay"
    else:
        base = {"const": "constant scalar decay", "head": "per-head scalar decay",
                "token": "data-dependent scalar decay"}[variance(decay)]
    base += " of either sign" if signed else ""
    if value_decay == ZERO:  # (no term of the state: the 0 moves to the value axis)
        base = "a decay of 0"
    elif value_decay is not None:
        base = (base + " and a " if base else "") + \
            ("diagonal decay on the value axis" if value_decay.shape else "scalar decay") + \
            (" of either sign" if value_signed else "")
    if not corrections:
        return base
    rank = "rank-one correction" if len(corrections) == 1 else f"{len(corrections)} rank-one corrections"
    rank += " on the value side" if value_side else ""
    return rank + ("" if base == "identity" else f" with {base}")


def classify(program: ir.Program, update: ir.Update) -> Transition:
    state = program.state(update.state)
    value = inline_lets(update.value, program.lets)
    reasons: list[str] = []
    try:
        terms, remainder = linear_terms(value, state.name)
    except Unfactorable as why:
        return Transition(state.name, "general linear map", None, None, True, (), (), (str(why),))
    except NotLinear as why:  # checked at resolve time already; kept for direct callers
        return Transition(state.name, "not linear", None, None, True, (), (), (why.message,))

    general = False  # a reason below is that the map is no decay plus rank-one terms at all
    value_decay: ir.Expr | None = None
    value_side: list[tuple[Factor, ir.Expr, ir.Expr]] = []  # (left factor, a, b) of each coef·L·S·(a⊗b)
    if len(state.shape) == 2:
        terms, value_side, both_sides = _split_value_side(terms)
        reasons.extend(_both_sides(state.name) for _ in both_sides[:1])
        general = bool(both_sides)
    rights = {t.right for t in terms if t.right is not None and t.right.kind != "identity"}
    if rights and len(state.shape) == 1:  # z·diag(d) = diag(d)·z: for a vector state a diagonal either side
        def to_left(t: Term) -> Term:
            if t.right is None or t.right.kind != "diag":
                return t
            c, f = compose(t.right, t.left)
            return Term(mul(c, t.coef), f)
        terms = [to_left(t) for t in terms]
    elif len(rights) == 1 and next(iter(rights)).kind == "diag" and all(t.right in rights for t in terms):
        # one diagonal on the right of every S term: D·S·diag(E), E decays the value axis
        value_decay = next(iter(rights)).u
        terms = [Term(t.coef, t.left) for t in terms]
    reasons.extend(_value_axis_mismatch(state.name, terms))
    scalar: ir.Expr | None = None
    diagonal: ir.Expr | None = None
    elementwise: ir.Expr | None = None
    corrections = []
    for t in terms:
        if t.left.kind == "hadamard" and t.right is not None and t.right.kind != "identity":
            reasons.append(f"an elementwise decay of '{state.name}' (`X*{state.name}`) meets a factor on its right "
                           f"(`(X*{state.name})·M`); the forms take a correction beside it on the state as it "
                           f"was, `X*{state.name} − ({state.name}·a)⊗b`")
            general = True
            continue
        if t.right is not None and t.right.kind == "diag" and t.left.kind in ("identity", "diag", "outer"):
            general = True  # terms scaled per value column differently: one reason for the update, below
            continue
        if t.right is not None and t.right.kind != "identity":
            reasons.append(f"the term `{_term_text(t, state.name)}` multiplies '{state.name}' from the right by "
                           f"`{to_text(as_matrix(t.right, state.shape[-1]))}`{_at(t.right.u)}, which is no "
                           f"diagonal decay of its value axis (`{state.name}·diag(e)`) and no value-side "
                           f"correction (`{state.name}·(I − a⊗b)`): the forms take no other factor on the right")
            general = True
            continue
        kind = t.left.kind
        if kind == "identity":
            scalar = t.coef if scalar is None else add(scalar, t.coef)
        elif kind == "diag":
            diagonal = mul(t.coef, t.left.u) if diagonal is None else add(diagonal, mul(t.coef, t.left.u))
        elif kind == "hadamard":
            elementwise = mul(t.coef, t.left.u) if elementwise is None else add(elementwise, mul(t.coef, t.left.u))
        elif kind == "outer":
            corrections.append((mul(t.coef, t.left.u), t.left.w))
        elif kind == "covector":  # w·S, lower in rank than the state, added to each of its rows: u⊗(w·S) with
            corrections.append((t.coef, t.left.u))  # the scalar u = coef at every row, as a scalar write's key
        else:
            reasons.append(f"the transition contains the dense matrix `{to_text(t.left.u)}`, which has no "
                           f"decay-plus-rank-one structure")
            general = True
    corrections = _merged(corrections)
    if scalar == ZERO:  # (S − S: terms that add up to no term, as none beside an elementwise decay)
        scalar = None
    if elementwise is None and any(len(u.shape) == 2 or len(w.shape) == 2 for u, w in corrections):
        reasons.append(f"a rank-one correction of '{state.name}' reads or writes an elementwise product with it "
                       f"(`u⊗(w·(X*{state.name}))`) without an elementwise decay of '{state.name}' (`X*{state.name}`)")
    if elementwise is not None:
        reasons.extend(_beside_elementwise(state.name, scalar is not None or diagonal is not None,
                                           value_decay is not None))
        decay = elementwise
    elif scalar is not None and diagonal is not None:
        decay = add(diagonal, scalar)
    else:
        decay = diagonal if diagonal is not None else scalar
    if decay is None and not reasons:
        # no term of the state itself: a decay of 0, as `0·S + …` writes it — a log-decay of −∞ at every token,
        # which the forms take as a reset (a state that holds this token's write only, or carries over through
        # its corrections alone, of either side: beside value-side ones the 0 is the value axis's decay below;
        # left None, it would be read as the identity, S·(I + a⊗b) for S·(a⊗b))
        decay = ZERO
    if decay == ONE:
        decay = None
    value_corrections: list[tuple[ir.Expr, ir.Expr]] = []
    if value_side:
        if corrections:
            reasons.append(_both_sides(state.name))
            general = True
        if decay is not None and not decay.shape:  # a scalar commutes: carried on the value axis
            value_decay = decay if value_decay is None else mul(decay, value_decay)
            decay = None
        for left, a, b in value_side:
            if elementwise is not None and left.kind != "identity":
                reasons.append(_value_side_beside_elementwise(state.name, left))
            elif elementwise is None and not _acts_as(left, decay):
                reasons.append(_value_side_under(state.name, left, decay))
            value_corrections.append((a, b))
    bounds = Bounds(program)
    log_decay, exact = (None, True) if decay is None else log_of(decay, bounds)
    value_log, value_exact = (None, True) if value_decay is None else log_of(value_decay, bounds)
    # a decay of the rows (one per token or per row) or of the value axis that may be negative: the forms take
    # log |D| and the signs apart (Transition.magnitude, value_magnitude); an elementwise one is refused, for
    # σ ⊙ k⊗v is no rank-one write (_not_positive says why)
    negative = [] if decay is None or exact else _not_positive(decay, state.name, program)
    signed = bool(negative) and len(decay.shape) < 2
    value_signed = value_decay is not None and not value_exact and bool(_not_positive(value_decay, state.name,
                                                                                      program))
    if signed:
        log_decay = ir.Apply(decay.shape, "log", (_abs(decay),))
    if value_signed:
        value_log = ir.Apply(value_decay.shape, "log", (_abs(value_decay),))
    if negative and not signed:
        reasons.extend(r + " (a decay elementwise is taken positive: the signs of a decay of the rows or of the value "
                           "axis are taken apart)" for r in negative)
    if value_decay is not None and states_in(value_decay):
        reasons.append(f"the decay of '{state.name}' depends on a state")

    writes = []
    if remainder is not None:
        others = states_in(remainder) - {state.name}
        if others:
            reasons.append(f"the update of '{state.name}' reads state(s) {', '.join(sorted(others))}")
        elif len(state.shape) == 1:
            writes = [(mul(c, x), None) for c, x in vector_terms(remainder)]
        else:
            for c, f in operator_terms(remainder):
                if f.kind == "outer":
                    writes.append((mul(c, f.u), f.w))
                else:
                    reasons.append(f"the added term `{to_text(remainder)}` is not a sum of outer products k⊗v")
                    break
    for u, w in corrections + value_corrections:
        if states_in(u) | states_in(w):
            reasons.append(f"a correction of '{state.name}' depends on a state")
    if decay is not None and states_in(decay):
        reasons.append(f"the decay of '{state.name}' depends on a state")
    kind = "general linear map" if general else \
        _describe(decay, corrections or value_corrections, value_decay, bool(value_corrections), signed, value_signed)
    return Transition(state.name, kind, decay, log_decay, exact, tuple(corrections), tuple(writes),
                      tuple(dict.fromkeys(reasons)), value_decay, value_log, value_exact, tuple(value_corrections),
                      signed, value_signed)


def _merged(corrections: list[tuple[ir.Expr, ir.Expr]]) -> list[tuple[ir.Expr, ir.Expr]]:
    """Corrections whose u is the same vector up to a scalar, as one: c₁·n⊗w₁ + c₂·n⊗w₂ = n⊗(c₁·w₁ + c₂·w₂).
    A product of n rank-one steps written as such multiplies out to 2ⁿ − 1 terms — DeltaProduct's
    (I − b₂·n₂⊗n₂)·(I − b₁·n₁⊗n₁) = I − b₁·n₁⊗n₁ − b₂·n₂⊗n₂ + b₁b₂(n₂·n₁)·n₂⊗n₁ — but they share n vectors u:
    merged, n corrections (the WY representation's n₂⊗(n₂ − b₁(n₁·n₂)·n₁)), the rank of the product, where
    each correction costs the forms a pass over the state per token (found by probing: six steps ran as 63
    corrections, the C chunkwise form 1.4 s for 256 tokens). Vectors only: a u or w per column (beside an
    elementwise decay) stays as written."""
    groups: dict[object, list[tuple[ir.Expr, ir.Expr]]] = {}  # u's vector (an index: as written) → (u, w)s
    for index, (u, w) in enumerate(corrections):
        vectors = len(u.shape) == 1 and len(w.shape) == 1  # (a u or w per column stays as written)
        groups.setdefault(split_scalar(u)[1] if vectors else index, []).append((u, w))
    merged = []
    for base, members in groups.items():
        if len(members) == 1:
            merged.extend(members)
            continue
        w = None
        for u, wi in members:
            term = mul(split_scalar(u)[0], wi)
            w = term if w is None else add(w, term)
        merged.append((base, w))
    return merged


def _value_axis_mismatch(state: str, terms: list[Term]) -> list[str]:
    """Why the terms of an update do not share one factor on the value axis, or nothing. The forms take a
    diagonal E_t on the right of the state only as the decay of its value axis, the same in every term
    (D_t·S·E_t and each key-side correction u⊗(w·S·E_t)), or in none. A key-side correction scaled per value
    column by its own diag(d) — a rank-one step of a different strength in each column — is none of these;
    nor is a decay term scaled otherwise than the others. (Value-side corrections are split off before.)"""
    def right(t: Term) -> Factor | None:
        return None if t.right is None or t.right.kind == "identity" else t.right

    decays = [t for t in terms if t.left.kind in ("identity", "diag")]
    corrections = [t for t in terms if t.left.kind == "outer"]
    if not any(right(t) is not None and right(t).kind == "diag" for t in decays + corrections):
        return []
    decay_rights = list(dict.fromkeys(right(t) for t in decays))
    if len(decay_rights) > 1:
        return [_decays_differ_on_the_right(state, decays, [right(t) for t in decays])]
    own = decay_rights[0] if decay_rights else None
    reasons = []
    for t in corrections:
        mine = right(t)
        if mine == own:
            continue
        if own is None:
            where = "its value axis does not decay" + \
                (f" (`{_term_text(decays[0], state)}` has no factor on the right)" if decays else "")
        else:
            where = f"its value axis decays by `diag({to_text(own.u)})`"
        what = "has no factor on its right" if mine is None else \
            f"is scaled per value column by `{to_text(mine.u)}`{_at(mine.u)}, `diag({to_text(mine.u)})` on its right"
        reasons.append(f"the key-side correction `{_term_text(t, state)}` of '{state}' {what}, where {where}: "
                       f"the forms take a key-side correction whose factor on the right is the state's own "
                       f"decay of the value axis, `(I − u⊗w)·D·{state}·diag(e)`, or none where that axis does "
                       f"not decay; a correction scaled per value column otherwise (a rank-one step of a "
                       f"different strength in each column), or one that skips that decay, has no such form")
    return reasons


def _decays_differ_on_the_right(state: str, decays: list[Term], rights: list[Factor | None]) -> str:
    """Why decay terms with different factors on the right (0.5·diag(a)·S + 0.5·S·diag(e)) have no parallel or
    chunkwise form, and what would: their sum decays element (i, j) by a sum of products, a_i/2 + e_j/2, which
    no single product d_i·e_j of a key-axis and a value-axis decay equals — so the advice is a decay that is one
    product, made of the factors the user wrote (writing "the same factor once" cannot be followed here)."""
    listed = ", ".join(f"`{_term_text(t, state)}`" for t in decays)
    left = next((t.left for t in decays if t.left.kind == "diag"), None)
    on_right = next((r for r in rights if r is not None), None)
    product = "·".join(([to_text(as_matrix(left, "n"))] if left is not None else []) + [state] +
                       ([to_text(as_matrix(on_right, "n"))] if on_right is not None else []))
    return (f"the decay terms of '{state}' differ in their factor on the right ({listed}): their sum decays "
            f"each element of '{state}' by a sum of products, which is no one product `D·{state}·diag(e)` of a "
            f"key-axis and a value-axis decay — the decay the parallel and chunkwise forms take, with the same "
            f"factor on the right of every term; only the recurrent form runs this update. For those forms, "
            f"decay by one product, such as `{product}`")


def _term_text(t: Term, state: str) -> str:
    """coef·L·S·R in the DSL's notation (the state as it was, by its name)."""
    def factor(f: Factor) -> str:
        text = to_text(as_matrix(f, "n"))
        return f"({text})" if f.kind == "outer" else text

    coef, negative = (t.coef.operand, True) if isinstance(t.coef, ir.Neg) else (t.coef, False)
    if isinstance(coef, ir.Const) and coef.value < 0:
        coef, negative = ir.Const((), -coef.value), not negative
    wrap = isinstance(coef, ir.Arith) and coef.op in ("add", "sub")
    parts = [] if coef == ONE else [f"({to_text(coef)})" if wrap else to_text(coef)]
    parts += [] if t.left.kind == "identity" else [factor(t.left)]
    parts += [state] + ([] if t.right is None or t.right.kind == "identity" else [factor(t.right)])
    return ("−" if negative else "") + "·".join(parts)


def _at(e: ir.Expr) -> str:
    span = e.span
    return f" (line {span.line}, column {span.column})" if span is not None else ""


def _split_value_side(terms: list[Term]) -> tuple[list[Term], list[tuple[Factor, ir.Expr, ir.Expr]], list[Term]]:
    """The terms coef·L·S·(a⊗b) with L the identity or a diagonal — corrections on the value side, each as
    (L, a, coef·b): L·S·(a⊗b) = (L·S·a)⊗b — apart from the others; and the terms with a rank-one factor on
    both sides, (u⊗w)·S·(a⊗b), which no correction of one side is."""
    rest, value_side, both = [], [], []
    for t in terms:
        if t.right is None or t.right.kind != "outer":
            rest.append(t)
        elif t.left.kind in ("identity", "diag"):
            value_side.append((t.left, t.right.u, mul(t.coef, t.right.w)))
        elif t.left.kind == "outer":
            both.append(t)
        else:
            rest.append(t)
    return rest, value_side, both


def _acts_as(left: Factor, decay: ir.Expr | None) -> bool:
    """A value-side correction L·S·(a⊗b) is (D_t·S·a)⊗b when L is the state's decay D_t of the key axis (the
    identity where it has none): the decay its pseudo-key S·a is read under."""
    if decay is None:
        return left.kind == "identity"
    return left.kind == "diag" and left.u == decay


def _value_side_under(state: str, left: Factor, decay: ir.Expr | None) -> str:
    what = "without a factor on the left" if left.kind == "identity" else f"under `diag({to_text(left.u)})`"
    has = f"`diag({to_text(decay)})·{state}`" if decay is not None else "none"
    return (f"a rank-one correction on the value side of '{state}' (`{state}·(a⊗b)`) is written {what}, and "
            f"the key axis decays by {has}: the forms take such a correction under the state's own decay of "
            f"the key axis, `diag(d)·{state}·(I − a⊗b)`")


def _value_side_beside_elementwise(state: str, left: Factor) -> str:
    return (f"a rank-one correction on the value side of '{state}' is written under `diag({to_text(left.u)})` "
            f"beside its elementwise decay (`X*{state}`): the forms take such a correction on the state as it "
            f"was, `{state}·(a⊗b)`, each row's pseudo-key then a triangular system of that row's decays")


def _both_sides(state: str) -> str:
    return (f"'{state}' has rank-one corrections on both sides (`(I − u⊗w)·{state}·(I − a⊗b)` or both kinds "
            f"of terms): the pseudo-values of one side and the pseudo-keys of the other would be coupled, and "
            f"the forms take corrections on one side")


def _beside_elementwise(state: str, other_decay: bool, value_decay: bool) -> list[str]:
    """Why an elementwise decay X⊙S cannot be taken with the rest of the update, or nothing: a decay of
    another shape beside it (a·S + X⊙S, S·diag(e)) is to be written inside the elementwise one. Rank-one
    corrections of one side are taken: a key-side one u⊗(wᵀS) acts on each column of S apart, whose rows
    decay by that column of X (one triangular system per column), a value-side one (S·a)⊗b on each row
    apart (one per row); both read S_(t−1) itself, as written beside X⊙S."""
    reasons = []
    if value_decay:
        reasons.append(f"'{state}' has an elementwise decay (`X*{state}`) and a decay of its value axis "
                       f"(`{state}·diag(e)`); write both into the one elementwise factor")
    if other_decay:
        reasons.append(f"'{state}' has an elementwise decay (`X*{state}`) beside a scalar or diagonal one; write "
                       f"them as one elementwise factor, (X + a)*{state}")
    return reasons


def _not_positive(decay: ir.Expr, state: str, program: ir.Program) -> list[str]:
    """Why the derived forms cannot take the logarithm of a decay the compiler has no symbolic logarithm of
    (its values must then be positive), or nothing. A param without a default may be any real; one with a
    default is taken at its default (a caller who passes values that make the decay non-positive is refused
    when the form runs, as for an input outside its declared range)."""
    known = Bounds(program)
    bounds = known.of(decay)
    if bounds.lo >= 0:  # (a decay of exactly 0: a log-decay of −∞, which the forms take as a reset)
        return []
    hints = []
    if bounds.hi > 0:  # it can be positive: what keeps it so is for the program to say
        # (of a product, the factors without a symbolic logarithm that can be non-positive: exp(g)·gamma's gamma,
        # not g, which no range fixes)
        factors = [f for f in product_factors(decay, divisions=True)
                   if not log_of(f, known)[1] and not known.of(f).positive] or [decay]
        inputs = list(dict.fromkeys(name for f in factors for name in refs(f, ir.InputRef)))
        free = list(dict.fromkeys(name for f in factors for name in undefaulted_params(f, program)))
        hints += [f"declare ranges of {', '.join(inputs)} that keep it positive"] if inputs else []
        hints += [f"give {', '.join(free)} a default that keeps it positive"] if free else []
        hints += [] if inputs or free else ["change the defaults it is computed from"]
    hints.append("write it as exp(…) or sigmoid(…)")
    fix = ", ".join(hints[:-1]) + (", or " if len(hints) > 1 else "") + hints[-1]
    # (bounds take each occurrence of a value on its own: lb + (1 − lb)*sigmoid(f) spans (−∞, ∞) for lb ≥ 0, where
    # the same value written lb*(1 − sigmoid(f)) + sigmoid(f) is seen positive — say so rather than only ask for
    # ranges that cannot help)
    repeated = [name for name, count in occurrences(decay).items() if count > 1]
    if repeated and bounds.hi > 0:
        fix += (f" (the bounds take each occurrence of {', '.join(repeated)} on its own: written with "
                f"{'each' if len(repeated) > 1 else 'it'} once, the same decay may be seen positive)")
    sign = "is negative" if bounds.negative else "can be zero or negative"
    return [f"the decay `{to_text(decay)}` of '{state}' {sign} (its values lie in {bounds}), and the "
            f"parallel and chunkwise forms work with its logarithm; {fix}"]


def split_exp(e: ir.Expr) -> tuple[ir.Expr, ir.Expr | None]:
    """Write e = c·exp(α) with α collecting every exponential factor (α None when there is none).
    Exponential feature maps (FAVOR+'s exp(W·x − ‖x‖²/2)/√m) are stabilized by shifting α."""
    if isinstance(e, ir.Apply) and e.function == "exp":
        return ONE, e.args[0]
    if isinstance(e, ir.Neg):
        c, a = split_exp(e.operand)
        return ir.Neg(c.shape, c) if a is not None else e, a
    if isinstance(e, (ir.Arith, ir.Dot)) and (not isinstance(e, ir.Arith) or e.op in ("mul", "div")) \
            and (not e.left.shape or not e.right.shape or isinstance(e, ir.Arith)):
        (cl, al), (cr, ar) = split_exp(e.left), split_exp(e.right)
        if al is None and ar is None:
            return e, None
        divide = isinstance(e, ir.Arith) and e.op == "div"
        c = ir.Arith(cl.shape or cr.shape, "div" if divide else "mul", cl, cr)
        if ar is not None and divide:
            ar = ir.Neg(ar.shape, ar)
        a = al if ar is None else ar if al is None else ir.Arith(al.shape or ar.shape, "add", al, ar)
        return c, a
    return e, None

"""A state's key-side vectors as per-token scalars times the vectors they share.

    factors = key_factors(t)     # KeyFactors, or None where factoring gains nothing
    spares_arrays(factors, lets) # whether a backward without corrections gains by them (a scalar of the token)

The key-side vectors of a decomposed update (compiler.transitions) — each correction's u and w, each write's key
— are often one vector times scalars of the token: the delta rule's u = −β·k̂, w = k̂ and key = β·k̂ (gated
DeltaNet's u = −(e^g·(β·k̂))). A backward that takes them as three arrays [B, T, H, dk] gives three gradients
of that size, which the chain rule then reduces to the scalars' gradients (a dot product per token) and adds
into ∂k̂: passes over [B, T, H, dk] arrays that took a quarter of gated DeltaNet's C backward at dk = dv = 64.
Factored, a backward reads each vector once with its scalars and gives the vector's gradient summed over the
slots that use it, and each scalar's gradient.

The slots are taken in the order the kernels take them — each correction's (u, w), then each write's key — and
the first slot of a vector is its owner: the gradient of the vector goes with that slot (the others give only
their scalars'). The factoring follows from the expressions (linearity.split_scalar), never from a variant.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ir
from .analysis import variance
from .linearity import ONE, split_scalar
from .transitions import Transition


@dataclass(frozen=True)
class Slot:
    """One key-side vector of the update: bases[base] times scale (None: 1)."""

    base: int
    scale: ir.Expr | None
    owner: bool  # the first slot of its base: its gradient carries the base's


@dataclass(frozen=True)
class KeyFactors:
    """A transition's key-side vectors factored: the vectors they share, and each slot."""

    bases: tuple[ir.Expr, ...]
    corrections: tuple[tuple[Slot, Slot], ...]  # per correction: (u, w)
    writes: tuple[Slot, ...]                    # per write: its key


def key_factors(t: Transition) -> KeyFactors | None:
    """The transition's key-side vectors factored, or None: where one is not a vector over the rows (beside an
    elementwise decay u or w may be a matrix), or where no slot has a scalar and no two share a vector."""
    vectors = [x for u, w in t.corrections for x in (u, w)] + [key for key, _ in t.writes]
    if not vectors or any(len(x.shape) != 1 for x in vectors):
        return None
    bases: list[ir.Expr] = []
    slots = []
    for x in vectors:
        scale, base = split_scalar(x)
        owner = base not in bases
        if owner:
            bases.append(base)
        slots.append(Slot(bases.index(base), None if scale == ONE else scale, owner))
    if len(bases) == len(slots) and all(s.scale is None for s in slots):
        return None
    n = 2 * len(t.corrections)
    return KeyFactors(tuple(bases), tuple(zip(slots[0:n:2], slots[1:n:2])), tuple(slots[n:]))


def spares_arrays(factors: KeyFactors, lets: dict[str, ir.Expr]) -> bool:
    """Whether taking the slots factored spares a backward arrays: a slot's scalar varies by token (its product
    with the vector is otherwise a [B, T, H, dk] array made, and its gradient one taken apart again), or two slots
    share a vector (read once). A lone vector times a constant (Performer's exp(…)/√m) spares none."""
    slots = [s for pair in factors.corrections for s in pair] + list(factors.writes)
    return any(s.scale is not None and variance(s.scale, lets) == "token" for s in slots) or \
        len(factors.bases) < len(slots)

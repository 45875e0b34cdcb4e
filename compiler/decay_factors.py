"""An elementwise log-decay as a rate that is the same for every token times a step per token.

    factors = decay_factors(t, lets)     # DecayFactors, or None where the log-decay is not such a product

An elementwise decay (compiler.transitions: `exp(X)*S`, one decay per element of a matrix state) has a log-decay
L_t [rows, cols] per token. Often it is a matrix P that no token changes (params, sizes, constants) scaled along
one axis by a vector of the token: Mamba-1's A·diag(Δ), L[i, j] = A[i, j]·Δ[j]; or diag(u)·P, L[i, j] = u[i]·P[i, j].
A backward that takes L as an array [B, T, H, rows, cols] makes it (rows·cols values per token where the inputs
have rows or cols) and gives back ∂L of that size, which the chain rule then contracts to ∂P and ∂u: Mamba-1's
C backward spent most of its time on those arrays. Factored, a kernel computes L_t from P and u_t as it runs
and gives ∂u_t per token and ∂P summed over the tokens.

The factoring follows from the expression (a product with a diagonal matrix, the other factor reading nothing
that varies by token), never from a variant.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ir
from .analysis import variance
from .linearity import neg
from .transitions import Transition


@dataclass(frozen=True)
class DecayFactors:
    """L_t = rate ⊙ (step_t along one axis): rate·diag(step) (the step per column) or diag(step)·rate (per row)."""

    rate: ir.Expr   # [rows, cols], the same for every token
    step: ir.Expr   # [cols], or [rows] where `rows`
    rows: bool      # the step scales the rows (diag(step)·rate)


def decay_factors(t: Transition, lets: dict[str, ir.Expr]) -> DecayFactors | None:
    """The transition's elementwise log-decay factored, or None: no elementwise decay, a log computed numerically
    (its gradient divides by the decay: c.small_decays' conditions), a decay of either sign, or a log-decay that
    is not a token-free matrix times diag(a vector)."""
    if not t.elementwise or t.log_decay is None or t.decays_as_values or t.signed:
        return None
    return _factored(t.log_decay, lets)


def _factored(e: ir.Expr, lets: dict[str, ir.Expr]) -> DecayFactors | None:
    if isinstance(e, ir.Neg):  # −(P·diag(u)) = (−P)·diag(u)
        inner = _factored(e.operand, lets)
        return None if inner is None else DecayFactors(neg(inner.rate), inner.step, inner.rows)
    if not isinstance(e, ir.Dot) or len(e.shape) != 2:
        return None
    for diagonal, other, rows in ((e.right, e.left, False), (e.left, e.right, True)):
        if isinstance(diagonal, ir.Diag) and len(other.shape) == 2 and variance(other, lets) != "token":
            return DecayFactors(other, diagonal.operand, rows)
    return None

"""Key-side vectors and queries the recurrent backward with corrections normalizes itself (templates/c_grad.c.j2,
NORM_OF): where a factored key-side vector or a readout's query is l2norm(x) (gated DeltaNet's k̂ and q̂), the
kernel takes x raw, normalizes each token's row as it reads it, and gives the gradient with respect to x.

    l2norm_argument(expr)            (x, eps) where the expression is l2norm(x), else None   (c.grad's module)
    normalized(x, eps)               the generated module's helper: a Normalized, as the scans take it
    buffers(arrays), raw(x)          a kernel's normalized rows (c.grad_kernels' Structure), the arrays it reads
    any_normalized(corrections, writes, queries)
    plain(corrections, writes, queries)          every Normalized made its array l2norm(x)
    fold(grads, corrections, writes, queries)    the gradients of plain()'s arrays taken back to x

So the module makes no [B, T, H, dk] array of l2norm(x) before the kernel and none of its gradient after it,
where each was a pass over such arrays at the memory's speed (gated DeltaNet's four: about a tenth of its
backward at dk = dv = 64). A Normalized comes as a factored slot's vector (c.scaled_keys.Scaled's base) or as a
query's array; c.grad_scans gives it to c.grad_kernels' backward with corrections as it is, and to every other
kernel, and every forward, plain — its gradient folded back through linrec.numpy.vjp.vjp_l2norm's formula.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..compiler import ir
from . import rows, scaled_keys


class Normalized(NamedTuple):
    """l2norm(array) over the last axis: array / sqrt(array·array + eps)."""

    array: np.ndarray
    eps: float


def normalized(x, eps: float) -> Normalized:
    """The generated module's helper: x as the scans take a vector they normalize themselves."""
    return Normalized(x, float(eps))


def l2norm_argument(expr: ir.Expr) -> tuple[ir.Expr, float] | None:
    """(x, eps) where the expression is l2norm(x) over a vector, else None (its options are resolved: eps is
    there, the default where the program gives none, as the C printer reads it)."""
    if not (isinstance(expr, ir.Apply) and expr.function == "l2norm" and len(expr.args) == 1):
        return None
    return expr.args[0], float(dict(expr.options)["eps"])


def raw(x):
    """The array a kernel reads for x: a Normalized's own, else x."""
    return x.array if isinstance(x, Normalized) else x


def buffers(arrays: list) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """For a kernel's per-token arrays in its order: per array the buffer of its normalized row (one per Normalized
    object, so slots that share a vector share one), −1 for a row taken as it is; and each buffer's eps (grad_kernels'
    Structure.normalized and norm_eps). ((), ()) where none is normalized."""
    given = {id(a): a for a in arrays if isinstance(a, Normalized)}
    order = list(given)
    if not order:
        return (), ()
    return tuple(order.index(id(a)) if id(a) in given else -1 for a in arrays), tuple(given[i].eps for i in order)


def _bases(corrections, writes) -> list:
    return [x.base for x in scaled_keys.key_slots(corrections, writes) if isinstance(x, scaled_keys.Scaled)]


def any_normalized(corrections, writes, queries) -> bool:
    """Whether a factored slot's vector or a query is a Normalized."""
    return any(isinstance(b, Normalized) for b in _bases(corrections, writes)) or \
        any(isinstance(q[0], Normalized) for q in queries)


def plain(corrections, writes, queries):
    """(corrections, writes, queries) with each Normalized its array l2norm(x): made once for all the slots that
    share it, so that they still share one array (c.scaled_keys.owners goes by the array)."""
    made: dict[int, np.ndarray] = {}

    def own(x):
        if not isinstance(x, Normalized):
            return x
        if id(x) not in made:
            made[id(x)] = rows.l2norm(x.array, x.eps)
        return made[id(x)]
    slots = [scaled_keys.Scaled(own(x.base), x.scale) if isinstance(x, scaled_keys.Scaled) else x
             for x in scaled_keys.key_slots(corrections, writes)]
    corrections, writes = scaled_keys.rebuilt(corrections, writes, slots)
    return corrections, writes, [(own(q[0]),) + tuple(q[1:]) for q in queries]


def fold(grads, corrections, writes, queries):
    """The gradients (ScanGrads) of plain()'s arrays taken back to each Normalized's array: the vector's (given
    with the slot that holds it, c.scaled_keys.ScaledGrad) and each query's, through l2norm's vector–Jacobian
    product."""
    def back(x, d):
        return rows.vjp_l2norm(x.array, d, x.eps) if isinstance(x, Normalized) and d is not None else d
    slots = scaled_keys.key_slots(corrections, writes)
    given = scaled_keys.key_slots(grads.corrections, grads.writes)
    folded = [d._replace(base=back(x.base, d.base)) if isinstance(x, scaled_keys.Scaled) else d
              for x, d in zip(slots, given)]
    d_corrections, d_writes = scaled_keys.rebuilt(grads.corrections, grads.writes, folded)
    return grads._replace(corrections=d_corrections, writes=d_writes,
                          queries=[back(q[0], d) for q, d in zip(queries, grads.queries)])

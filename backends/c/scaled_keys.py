"""Key-side vectors taken factored by the backward on C (compiler.key_factors; c.grad and c.grad_chunk emit them).

In the generated module a factored slot — a correction's u or w, a write's key — is `scaled(base, scale)`: the
vector shared by the slots that use it [B, T, H, K] (the same array object for each of them) times a scalar per
token [B, T, H, 1] (None: 1). Its gradient in the scan's results is a ScaledGrad: `.scale`, the scalar's [B, T,
H, 1] (None without one), and `.base`, the shared vector's summed over all its slots — given with the first of
them in the kernels' order (each correction's u, w, then each write's key), None with the others.

The recurrent backward of c.grad_kernels (with corrections and without) and the chunk kernels
(c.grad_chunk_kernels) take them so; for any other kernel, and for every forward, expand() gives each slot its
own array and fold() takes their gradients back to this form.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Scaled(NamedTuple):
    base: np.ndarray
    scale: np.ndarray | None


class ScaledGrad(NamedTuple):
    base: np.ndarray | None
    scale: np.ndarray | None


def scaled(base, scale) -> Scaled:
    """A factored key-side vector (the generated module's helper)."""
    return Scaled(base, scale)


def key_slots(corrections, writes) -> list:
    """The key-side slots in the kernels' order: each correction's u and w, then each write's key."""
    return [x for pair in corrections for x in pair] + [key for key, _ in writes]


def any_scaled(corrections, writes) -> bool:
    """Whether any key-side slot is factored."""
    return any(isinstance(x, Scaled) for x in key_slots(corrections, writes))


def owners(slots: list) -> list[int]:
    """Per slot, the slot that holds its vector: the first factored slot with the same base array (itself for
    an unfactored one)."""
    first: dict[int, int] = {}
    return [first.setdefault(id(x.base), i) if isinstance(x, Scaled) else i for i, x in enumerate(slots)]


def rebuilt(corrections, writes, slots: list):
    """corrections and writes with their key-side slots replaced by `slots` (in key_slots' order)."""
    n = 2 * len(corrections)
    return ([(slots[2 * r], slots[2 * r + 1]) for r in range(len(corrections))],
            [(k, value) for k, (_, value) in zip(slots[n:], writes)])


def expand(corrections, writes):
    """corrections and writes with every factored slot its own array, base × scale."""
    def own(x):
        if not isinstance(x, Scaled):
            return x
        return x.base if x.scale is None else x.base * x.scale
    return rebuilt(corrections, writes, [own(x) for x in key_slots(corrections, writes)])


def fold(grads, corrections, writes):
    """A scan's gradients (ScanGrads) of expand()'s arrays taken to the factored slots' (see the module's
    docstring): for each, the scalar's gradient Σ ∂slot·base, and the base's Σ over its slots of scale·∂slot."""
    slots = key_slots(corrections, writes)
    given = key_slots(grads.corrections, grads.writes)
    of = owners(slots)
    out = list(given)
    for i, x in enumerate(slots):
        if isinstance(x, Scaled):
            d = given[i]
            part = d if x.scale is None else d * x.scale
            if of[i] == i:
                out[i] = ScaledGrad(part, None)
            else:
                out[of[i]] = out[of[i]]._replace(base=out[of[i]].base + part)
                out[i] = ScaledGrad(None, None)
    for i, x in enumerate(slots):
        if isinstance(x, Scaled) and x.scale is not None:
            out[i] = out[i]._replace(scale=np.einsum('...k,...k->...', given[i], x.base)[..., None])
    d_corrections, d_writes = rebuilt(grads.corrections, grads.writes, out)
    return grads._replace(corrections=d_corrections, writes=d_writes)

"""An elementwise log-decay taken factored by the recurrent backward on C (compiler.decay_factors; c.grad emits it).

In the generated module a log-decay L_t = rate ⊙ (step_t along one axis) — Mamba-1's A·diag(Δ) — is
`factored_decay(rate, step, (heads, K, V), rows)`: the rate [H, K, V] (the same for every token; a param shared
by the heads broadcast over them) and the step [B, T, H, V] (per column), or [B, T, H, K] where `rows` (per row:
diag(step)·rate). c.grad_elementwise's kernels compute L_t from the two as they run, so no [B, T, H, K, V]
array of log-decays is made, nor one of their gradients. The gradient in the scan's results is a FactoredDecay
too: `.rate` [H, K, V], summed over the batch rows and the tokens, and `.step`, per token.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class FactoredDecay(NamedTuple):
    rate: np.ndarray   # [H, K, V]
    step: np.ndarray   # [B, T, H, V], or [B, T, H, K] where rows
    rows: bool


def factored_decay(rate, step, shape: tuple[int, int, int], rows: bool) -> FactoredDecay:
    """A factored log-decay (the generated module's helper): the rate broadcast to [H, K, V]."""
    return FactoredDecay(np.broadcast_to(rate, shape), step, rows)

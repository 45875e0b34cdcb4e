"""The adjoint scans' array helpers, shared by adjoint_scan, adjoint_elementwise and adjoint_frames: per-token
arrays between the callers' layout [B, T, H, *] and the scans' head-major one [B, H, T, *], and the refusal
of decays given as values below the normal range."""
from __future__ import annotations

import numpy as np

from ..dsl.errors import RuntimeInputError


def heads(x, width=None):
    """[B, T, H, …] → [B, H, T, …] (a copy: the chunks slice it), the last axis broadcast to `width` if given."""
    x = np.moveaxis(np.asarray(x), 1, 2)
    if width is not None:
        x = np.broadcast_to(x, x.shape[:-1] + (width,))
    return np.ascontiguousarray(x)


def tokens_major(x):
    """[B, H, T, …] → [B, T, H, …]: the callers' layout again."""
    return np.moveaxis(x, 2, 1)


class BelowNormalRange(RuntimeInputError):
    """A decay given as a value (its log computed numerically) below the normal range of its dtype: its
    subnormal value keeps too few bits for the log-space backward, whose gradient ∂a = ∂l / a is then off
    (5e-324 in float64: 0.74 of ∂a; 1e-43 in float32: 1.5e-2 — found by probing); one of exactly 0 has no
    gradient in log space at all (0 / 0). gradients.vjp runs the statements as written instead (NumPy's
    recurrent backward), where the product a·S is differentiated directly."""


def refuse_subnormal_decays(*log_decays) -> None:
    """BelowNormalRange where a log-decay lies below the log of its dtype's smallest normal value, −∞ (a decay
    of exactly 0) included (the log-decays of decays given as values; None: none on that axis). A log-decay
    written as one, exp(g)'s g, may be −∞: a reset, which every form takes (adjoint_scan.ScanGrads.at_resets)."""
    for d in log_decays:
        if d is None or not np.size(d):
            continue
        d = np.asarray(d)
        floor = float(np.log(np.finfo(d.dtype if d.dtype.kind == "f" else np.float64).tiny))
        if np.any(d < floor):
            raise BelowNormalRange(f"a decay given as a value below {d.dtype}'s normal range (its log under "
                                   f"{floor:.1f}): the log-space backward cannot give its gradient")


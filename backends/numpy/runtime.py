"""Helpers that generated NumPy code calls: numerically careful versions of the DSL's builtins.

All work on the last axis (the element axis) and keep the input's dtype.
"""
from __future__ import annotations

import numpy as np


def sigmoid(x):
    """1/(1 + e^−x), as e^x/(1 + e^x) below 0: no overflow for large |x|, and the small values far below 0 kept to
    their last digits (0.5·(tanh(x/2) + 1) cancelled there: 0 from x = −38 in float64 and −17 in float32, which a
    gate's power sigmoid(a)^(1/16) or its log then made a wrong decay, NaN, or an infinite slope; a probe found
    it). In the dtype of x, as the other builtins.

    The numerator, 1 from 0 on and e below, is max(e, [x ≥ 0]) since e ≤ 1: the same values as np.where would
    pick, without its loop's branch on every element, which data with random signs mispredicts half the time
    ([1, 4096, 8, 64] float32: 15.4 ms with np.where, 2.2 ms so)."""
    x = np.asarray(x)
    e = np.exp(-np.abs(x))  # (≤ 1: no overflow)
    return (np.maximum(e, x >= 0) / (1 + e))[()]


def logsigmoid(x):
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


def softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def relu(x):
    return np.maximum(x, 0)


def elu(x):
    """x from 0 on, e^x − 1 below: max(x, 0) + expm1(min(x, 0)), one of the terms 0 (branch-free: see sigmoid)."""
    return np.maximum(x, 0) + np.expm1(np.minimum(x, 0))


def elu_plus_one(x):
    """elu(x) + 1 without the cancellation of expm1(x) + 1 for very negative x: max(x, 0) + e^min(x, 0), x + 1 from 0
    on and e^x below (branch-free: see sigmoid)."""
    return np.maximum(x, 0) + np.exp(np.minimum(x, 0))


def silu(x):
    return x * sigmoid(x)


def l2norm(x, eps=1e-6):
    return x / np.sqrt(np.einsum("...i,...i->...", x, x)[..., None] + eps)  # (no [..., n] temporary x·x)


def groupnorm(x, eps=1e-5):
    """Per token and head: zero mean and unit variance over the vector, no affine."""
    mean = np.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = np.mean(centered * centered, axis=-1, keepdims=True)
    return centered / np.sqrt(var + eps)


def rmsnorm(x, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def matvec(a, x):
    """a·x: a [..., m, n], x [..., n] → [..., m]. One matrix shared by every token and head (a param such
    as random features) is one BLAS product over all of them; np.einsum would loop in C without BLAS
    (~30× slower for Performer's W·k at T = 4096)."""
    if a.ndim == 2 and x.size:
        return (np.reshape(x, (-1, x.shape[-1])) @ a.T).reshape(x.shape[:-1] + (a.shape[0],))
    return np.einsum("...ij,...j->...i", a, x)


def vecmat(x, a):
    """x·a: x [..., m], a [..., m, n] → [..., n] (see matvec)."""
    if a.ndim == 2 and x.size:
        return (np.reshape(x, (-1, x.shape[-1])) @ a).reshape(x.shape[:-1] + (a.shape[1],))
    return np.einsum("...i,...ij->...j", x, a)


def diag_matrix(d):
    return d[..., :, None] * np.eye(d.shape[-1], dtype=d.dtype)


def random_features(seed: int, shape: tuple, orthogonal: bool = True) -> np.ndarray:
    """Performer's projections W [..., m, d] (FAVOR+): rows ~ N(0, I). With `orthogonal`, each block of d
    rows is orthogonalized (QR of a Gaussian matrix) and every row rescaled to the length of an
    independent Gaussian vector, so rows keep the Gaussian length distribution with less variance."""
    rng = np.random.default_rng(seed)
    *lead, m, d = shape
    out = np.empty(shape)
    for index in np.ndindex(*lead):
        if not orthogonal:
            out[index] = rng.standard_normal((m, d))
            continue
        blocks = []
        for _ in range(-(-m // d)):
            qmat, rmat = np.linalg.qr(rng.standard_normal((d, d)))
            qmat = qmat * np.sign(np.diag(rmat))  # fix the signs: uniformly (Haar) distributed rotations
            blocks.append(qmat.T)
        rows = np.concatenate(blocks)[:m]
        lengths = np.linalg.norm(rng.standard_normal((m, d)), axis=1)
        out[index] = rows * lengths[:, None]
    return out

"""Helpers that generated NumPy code calls: numerically careful versions of the DSL's builtins.

All work on the last axis (the element axis) and keep the input's dtype.
"""
from __future__ import annotations

import numpy as np


def sigmoid(x):
    return 0.5 * (np.tanh(0.5 * x) + 1.0)  # no overflow for large |x|


def logsigmoid(x):
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


def softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def relu(x):
    return np.maximum(x, 0)


def elu(x):
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0)))


def elu_plus_one(x):
    """elu(x) + 1 without the cancellation of expm1(x) + 1 for very negative x."""
    return np.where(x >= 0, x + 1, np.exp(np.minimum(x, 0)))


def silu(x):
    return x * sigmoid(x)


def l2norm(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def groupnorm(x, eps=1e-5):
    """Per token and head: zero mean and unit variance over the vector, no affine."""
    mean = np.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = np.mean(centered * centered, axis=-1, keepdims=True)
    return centered / np.sqrt(var + eps)


def rmsnorm(x, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def diag_matrix(d):
    return d[..., :, None] * np.eye(d.shape[-1], dtype=d.dtype)

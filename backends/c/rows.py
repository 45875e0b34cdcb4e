"""The row builtins — l2norm, rmsnorm, groupnorm — and their vector–Jacobian products over the last axis in one
pass of C (templates/c_rows.c.j2), for the C backward's generated chain rule: the same names and arguments as
linrec.numpy.runtime's and linrec.numpy.vjp's, which the C backend's backward modules import from here instead.
NumPy makes an array and a pass over [B, T, H, d] for each operation (five in vjp_l2norm, about ten in
vjp_groupnorm); this reads each row into L1 and writes the result. (RetNet's groupnorm and its product took 7 ms
of its 26 ms `vjp` at dk = dv = 64, T = 4096, H = 8 in NumPy.)

An argument the kernel does not take as it is — another dtype than float32 or float64, a gradient of
another shape or dtype than x (broadcast), rows that are not contiguous, an empty array — goes to the NumPy
helper. The threads: c.build.num_threads(), one below ROWS_PER_THREAD rows a thread.
"""
from __future__ import annotations

import numpy as np

from ..arrays import fits_out
from ..numpy import runtime as numpy_runtime
from ..numpy import vjp as numpy_vjps
from ..templating import environment
from ..version import VERSION
from . import build as c_build
from .buffers import RecycledArrays
from .build import CTYPES
from .scan_kernels import cached_kernel

ROWS_PER_THREAD = 4096  # rows below which a second thread costs more than it saves (a few µs each)
# The results are recycled once their holders have dropped them (buffers.RecycledArrays): the backward's l2norm of
# the queries and keys, and their gradients, are [B, T, H, d] arrays it drops when it returns, and a fresh one
# pays a page fault per 4 KiB page at its first touch — l2norm of [1, 4096, 8, 128] float32 took 5 ms in fresh
# memory, several times its pass over the values. The price: the RESULT_ARRAYS most recent stay allocated.
RESULT_ARRAYS = 4
_results = RecycledArrays(keep=RESULT_ARRAYS)
_KEY = "rows"  # one kernel: every function for both types
_ROW_BUILTINS = ("l2norm", "rmsnorm", "groupnorm")  # (each with its vjp_ twin, for float and double)


def _kernel():
    cdef = "".join(f"void lr_{b}_{t}(const {t} *x, {t} *out, int64_t rows, int n, double eps, int nthreads);\n"
                   f"void lr_vjp_{b}_{t}(const {t} *x, const {t} *g, {t} *out, int64_t rows, int n, double eps, "
                   f"int nthreads);\n" for b in _ROW_BUILTINS for t in ("float", "double"))
    return cached_kernel(_KEY, "rows", "rows",
                         lambda: environment(__package__).get_template("c_rows.c.j2").render(version=VERSION), cdef)


def _rows(*arrays: np.ndarray) -> bool:
    """Whether the kernel takes these arrays as they are: one shape and dtype (float32 or float64), C order."""
    a = arrays[0]
    return (a.dtype in CTYPES and a.ndim >= 1 and a.size > 0
            and all(b.shape == a.shape and b.dtype == a.dtype and b.flags.c_contiguous for b in arrays))


def row_threads(rows: int) -> int:
    """The threads for a pass over `rows` rows (linrec.c.chain_rows' too)."""
    return max(1, min(c_build.num_threads(), rows // ROWS_PER_THREAD))


def _row_builtin(builtin: str, x, eps: float) -> np.ndarray:
    """lr_<builtin>_T over x's rows, or NumPy's builtin where the kernel does not take x as it is."""
    x = np.asarray(x)
    if not _rows(x):
        return getattr(numpy_runtime, builtin)(x, eps=eps)
    k, t = _kernel(), CTYPES[x.dtype]
    out = _results.take(x.shape, x.dtype)
    rows, n = x.size // x.shape[-1], x.shape[-1]
    getattr(k.lib, f"lr_{builtin}_{t}")(k.ffi.from_buffer(t + " *", x), k.ffi.from_buffer(t + " *", out), rows, n,
                                        float(eps), row_threads(rows))
    return out


def _row_vjp(builtin: str, x, g, eps: float, out=None) -> np.ndarray:
    """lr_vjp_<builtin>_T over the rows of x and g, in `out` where it fits (it may be g: the kernel reads a row of
    g before writing the row's result, no restrict pointers); NumPy's where the kernel does not take them."""
    x, g = np.asarray(x), np.asarray(g)
    if not _rows(x, g):
        where = {} if out is None else {"out": out}  # (only vjp_l2norm takes one)
        return getattr(numpy_vjps, f"vjp_{builtin}")(x, g, eps=eps, **where)
    k, t = _kernel(), CTYPES[x.dtype]
    out = out if fits_out(out, x.shape, x.dtype) else _results.take(x.shape, x.dtype)
    rows, n = x.size // x.shape[-1], x.shape[-1]
    ptr = t + " *"
    getattr(k.lib, f"lr_vjp_{builtin}_{t}")(k.ffi.from_buffer(ptr, x), k.ffi.from_buffer(ptr, g),
                                            k.ffi.from_buffer(ptr, out), rows, n, float(eps), row_threads(rows))
    return out


def l2norm(x, eps=1e-6):
    """linrec.numpy.runtime.l2norm: x / sqrt(x·x + eps) over the last axis."""
    return _row_builtin("l2norm", x, eps)


def vjp_l2norm(x, g, eps=1e-6, out=None):
    """linrec.numpy.vjp.vjp_l2norm: the gradient with respect to x of Σ g·l2norm(x), in `out` where it fits."""
    return _row_vjp("l2norm", x, g, eps, out)


def rmsnorm(x, eps=1e-6):
    """linrec.numpy.runtime.rmsnorm: x / sqrt(mean(x²) + eps) over the last axis."""
    return _row_builtin("rmsnorm", x, eps)


def vjp_rmsnorm(x, g, eps=1e-6):
    """linrec.numpy.vjp.vjp_rmsnorm: the gradient with respect to x of Σ g·rmsnorm(x)."""
    return _row_vjp("rmsnorm", x, g, eps)


def groupnorm(x, eps=1e-5):
    """linrec.numpy.runtime.groupnorm: zero mean and unit variance over the last axis, no affine."""
    return _row_builtin("groupnorm", x, eps)


def vjp_groupnorm(x, g, eps=1e-5):
    """linrec.numpy.vjp.vjp_groupnorm: the gradient with respect to x of Σ g·groupnorm(x)."""
    return _row_vjp("groupnorm", x, g, eps)


HELPERS = frozenset(_ROW_BUILTINS) | {f"vjp_{b}" for b in _ROW_BUILTINS}

"""The builtins' vector–Jacobian products, which generated backward code calls (compiler.adjoint.Vjp):
vjp_f(x, g) is the gradient with respect to x of Σ g·f(x), over the last axis for the vector builtins.

Where a builtin has no derivative: relu and abs at 0 take the subgradient 0, and norm at the zero vector the
subgradient 0 (PyTorch's choices). sqrt, and a power below 1, at 0 have an infinite slope, and so has log (at
any upstream gradient: see vjp_log). Used there with a
nonzero upstream gradient, in a backward linrec runs (gradients.vjp, INFINITE_SLOPES), the slope is ±∞ and
flows on as in PyTorch, so that a later subgradient can stop it (relu's 0 below 0: sqrt(relu(k))); the call
fails, with a RuntimeInputError naming the place in the program (`site`), only where a gradient it returns is
not finite. A backward module run on its own fails at the first such point.
"""
from __future__ import annotations

import contextvars
import weakref

import numpy as np

from ..arrays import fits_out
from ..dsl.errors import RuntimeInputError
from .attention import lsh_attention_backward, lsh_attention_bucketed_backward
from .runtime import sigmoid


# Arrays a kernel made and handed to the generated code as its own, though views: the C kernels write some
# results into cache-line aligned memory (linrec.c.buffers.aligned_empty: a view into a larger buffer, so that
# whole lines can be streamed past the caches), which no one else holds. By id, each entry dropped with its array.
_HANDED_OVER: dict[int, weakref.ref] = {}


def hand_over(array: np.ndarray) -> np.ndarray:
    """Mark a new array the caller made (a view of memory of its own) as one own_array and in_place may keep
    and write into, as they do an array that is not a view."""
    key = id(array)
    _HANDED_OVER[key] = weakref.ref(array, lambda _, key=key: _HANDED_OVER.pop(key, None))
    return array


def _owns_memory(v: np.ndarray) -> bool:
    """Not a view of another array's memory — or a view hand_over was given."""
    if v.base is None:
        return True
    ref = _HANDED_OVER.get(id(v))
    return ref is not None and ref() is v


# own_array's `keep` for an array the code only reads, never changes nor hands back
READ = "read"


def own_array(value, shape, dtype, keep: bool | str) -> np.ndarray:
    """`value` as an array of `shape` and `dtype`, where generated code would fill zeros and add it (a
    gradient's first contribution) or broadcast and convert it (an output from a readout): value itself when
    the code may keep it (`keep`: a new array the code made, or one it only reads) and it already has that
    shape and dtype, else a copy broadcast to the shape. Over [B, T, H, *] arrays this saves a pass of zeros
    and one of adds, or a copy. A view is kept only where the code only reads it (keep=READ, and C-contiguous
    as the kernels read it): an array the code may change or hand back must be its own, and a view of the
    caller's memory would be changed under the caller, or a gradient handed back would share it. (linrec.torch
    hands the upstream gradients over as views of autograd's tensors: copied, GLA's training step at
    dk = dv = 64, T = 4096 took 0.6 ms more.)"""
    v = np.asarray(value)
    if keep and v.shape == tuple(shape) and v.dtype == dtype and \
            (_owns_memory(v) or keep == READ and v.flags.c_contiguous):
        return v
    out = np.empty(shape, dtype)
    out[...] = v
    return out


_UFUNCS = {"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.true_divide}


def in_place(array, op: str, other):
    """`array op other`, written into array's own memory where the result has its shape and dtype — generated
    code calls it at the last read of an array it made (numpy.adjoint_in_place), so a [B, T, H, *] product
    costs no new array (nor the page faults of one). Elsewhere (a view, a result that broadcasts wider or
    converts to another dtype) a new array, as the operator gives it; either way the values are the operator's."""
    ufunc = _UFUNCS[op]
    if _writable_as(array, other):
        return ufunc(array, other, out=array)
    return ufunc(array, other)


def negated(array):
    """−array, in array's own memory where it has one (in_place's conditions)."""
    if _writable_as(array, None):
        return np.negative(array, out=array)
    return -array


def _writable_as(array, other) -> bool:
    """Whether `array op other` fits array's memory: an array of its own (not a view), writeable, float, which
    the result neither outgrows (broadcast) nor converts (dtype)."""
    if not (isinstance(array, np.ndarray) and _owns_memory(array) and array.flags.writeable and array.ndim
            and array.dtype.kind == "f"):
        return False
    if other is None:
        return True
    return np.result_type(array, other) == array.dtype and \
        np.broadcast_shapes(array.shape, np.shape(other)) == array.shape


def unbroadcast(g, shape):
    """g summed over the axes a value of `shape` was broadcast along (leading axes, and axes of size 1): the
    gradient of a per-head or shared param (or value) from contributions per token and head."""
    g = np.asarray(g)
    if g.shape == tuple(shape):
        return g
    extra = g.ndim - len(shape)
    if extra < 0:
        return np.broadcast_to(g, shape)
    g = g.sum(axis=tuple(range(extra))) if extra else g
    ones = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=ones, keepdims=True) if ones else g


def outer_sum(a, b, shape):
    """unbroadcast(a[..., :, None] * b[..., None, :], shape) — a param's gradient from the outer products of
    every token's vectors (W·x's W) — as matrix products over the tokens, without the [B, T, H, m, n] array of
    products (Performer's W [256, 64] at T = 4096, H = 8: 2 GB of them, most of its backward's time). Where the
    target's shape is not the products' with leading axes summed (an axis of size 1 it sums too), the products
    after all."""
    a, b = np.asarray(a), np.asarray(b)
    lead = np.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    kept = len(shape) - 2  # (the leading axes the target keeps, its first: a per-head param's H)
    if kept < 0 or kept > len(lead) or tuple(shape[kept:]) != (a.shape[-1], b.shape[-1]) or \
            tuple(shape[:kept]) != lead[len(lead) - kept:]:
        return unbroadcast(a[..., :, None] * b[..., None, :], shape)
    rows = []
    for x in (a, b):  # [*summed, *kept, n] → [*kept, N, n]: the summed axes one, after the kept ones
        x = np.broadcast_to(x, lead + x.shape[-1:]).reshape((-1,) + lead[len(lead) - kept:] + x.shape[-1:])
        rows.append(np.moveaxis(x, 0, -2))
    return np.swapaxes(rows[0], -1, -2) @ rows[1]


# the infinite slopes met by the backward gradients.vjp runs: a list it reads afterwards (None: fail at once)
INFINITE_SLOPES: contextvars.ContextVar[list | None] = contextvars.ContextVar("linrec_infinite_slopes", default=None)


def _infinite_slope(where, x, g, site: str, builtin: str, token=None) -> np.ndarray:
    """Where the slope is infinite and the upstream gradient is not 0 (returned: the caller puts ±∞ there): the
    error that names it at its [B, T, H, *] index (a backward token by token passes its token: its arrays are
    [B, H, *]), noted in INFINITE_SLOPES, or raised when there is none."""
    bad = where & (g != 0)
    _note_infinite_slope(bad, site, builtin, token)
    return bad


def _note_infinite_slope(bad, site: str, builtin: str, token=None) -> None:
    """_infinite_slope's error where `bad` holds, noted or raised."""
    if np.any(bad):
        index = [int(i) for i in np.argwhere(bad)[0]]
        if token is not None:
            index.insert(1, int(token))
        error = RuntimeInputError(f"{builtin} has no derivative at 0 (its slope is infinite), and the gradient "
                                  f"needs it there: {site}, at index {index} of its argument. Keep the argument "
                                  f"away from 0 (e.g. add a small constant)")
        met = INFINITE_SLOPES.get()
        if met is None:
            raise error
        met.append(error)


def vjp_sigmoid(x, g):
    return g * sigmoid(x) * sigmoid(-x)


def vjp_logsigmoid(x, g):
    return g * sigmoid(-x)


def vjp_softplus(x, g):
    return g * sigmoid(x)


def vjp_relu(x, g):
    return np.where(x > 0, g, 0.0)  # subgradient 0 at 0; 0 below it whatever g is (an infinite slope's ±∞ too)


def vjp_elu(x, g):
    return g * np.exp(np.minimum(x, 0))  # (1 from 0 on: elu's slope, x's sign not branched on, as runtime.sigmoid)


def vjp_silu(x, g):
    s = sigmoid(x)
    return g * s * (1 + x * sigmoid(-x))


def vjp_tanh(x, g):
    y = np.tanh(x)
    return g * (1 - y * y)


def vjp_cos(x, g):
    return -g * np.sin(x)


def vjp_sin(x, g):
    return g * np.cos(x)


def vjp_sqrt(x, g, site="", token=None):
    x, g = np.broadcast_arrays(x, g)
    infinite = _infinite_slope(x == 0, x, g, site, "sqrt", token)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(infinite, np.copysign(np.inf, g), np.where(g == 0, 0.0, g / (2 * np.sqrt(np.where(x == 0, 1.0, x)))))


def vjp_log(x, g, site="", token=None):
    """∂log(x)/∂x = 1/x, infinite at x = 0 — where log(x) is −∞, which the forward can still carry to a finite
    value (exp, sigmoid, a softmax's weight 0), and the gradient arriving there is then 0: its product with
    the slope, 0·∞, is no number (the limit depends on what came after log; compiler.adjoint takes the one of
    softmax(s + log(w)) without it). So at 0 whatever the upstream gradient: ±∞ where it is not 0, NaN where it
    is, noted as an infinite slope (an error where it reaches a returned gradient)."""
    x, g = np.broadcast_arrays(x, g)
    zero = x == 0
    _note_infinite_slope(zero, site, "log", token)
    with np.errstate(divide="ignore", invalid="ignore"):
        return g / x


def vjp_pow(x, g, p, site="", token=None):
    """∂(x^p)/∂x = p·x^(p−1); at x = 0: 0 for p = 0 and p ≥ 1, infinite for 0 < p < 1 and p < 0.

    Where no base is 0 (checked on x as given: a param's few values, not broadcast), the same values without the
    special points' passes over the whole array (Preconditioned DeltaNet's x^(−r/(1 + |r|)): 26 → 13 ms at
    [1, 4096, 8, 64])."""
    if not np.any(np.asarray(x) == 0):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            slope = p * x ** (p - 1)
            return g * (np.where(p == 0, 0.0, slope) if np.any(np.asarray(p) == 0) else slope)
    x, g, p = np.broadcast_arrays(x, g, p)
    infinite = _infinite_slope((x == 0) & (p < 1) & (p != 0), x, g, site, "a power below 1", token)
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = np.where(p == 0, 0.0, p * np.where(x == 0, 0.0, x) ** (p - 1))
        slope = np.where((x == 0) & (p == 1), 1.0, np.where((x == 0) & (p > 1), 0.0, slope))
        return np.where(infinite, g * np.copysign(np.inf, p), g * slope)


def vjp_pow_exponent(x, g, p, power):
    """∂(x^p)/∂p = x^p·log(x) (`power` is x^p); at x = 0 with p ≥ 0, 0 (x^p·log x is 0·(−∞) there, and x^p stays
    0 or 1 whatever p ≥ 0 does: PyTorch's choice) instead of NaN. Where no base is 0, log(x) of x as given (a
    param's value once, not once per element of the broadcast)."""
    if not np.any(np.asarray(x) == 0):
        with np.errstate(divide="ignore", invalid="ignore"):
            return g * power * np.log(x)
    x, g, p, power = np.broadcast_arrays(x, g, p, power)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((x == 0) & (p >= 0), 0.0, g * power * np.log(x))


def vjp_abs(x, g):
    return g * np.sign(x)  # subgradient 0 at 0


def vjp_l2norm(x, g, eps=1e-6, out=None):
    """`out`: an array the result may be written in (g itself, say, where the caller reads g no more: see
    numpy.adjoint_in_place), used where it has the result's shape and dtype, else a new array."""
    # (the sums over the short last axis as einsum: no [..., n] temporary x·x or x·g, and a third less time
    # than np.sum(…, axis=-1) at n = 64 — the C backward's chain rule calls this on [B, T, H, dk] arrays)
    r = np.sqrt(np.einsum("...i,...i->...", x, x)[..., None] + eps)
    xg = np.einsum("...i,...i->...", x, g)[..., None]  # (before out, which may be g, is written)
    if fits_out(out, np.broadcast_shapes(np.shape(g), np.shape(r)), np.result_type(g, r)):
        np.divide(g, r, out=out)
    else:
        out = g / r
    out -= x * (xg / r ** 3)
    return out


def vjp_rmsnorm(x, g, eps=1e-6):
    r = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return g / r - x * (np.mean(x * g, axis=-1, keepdims=True) / r ** 3)


def vjp_groupnorm(x, g, eps=1e-5):
    centered = x - np.mean(x, axis=-1, keepdims=True)
    r = np.sqrt(np.mean(centered * centered, axis=-1, keepdims=True) + eps)
    y = centered / r
    return (g - np.mean(g, axis=-1, keepdims=True) - y * np.mean(g * y, axis=-1, keepdims=True)) / r


def vjp_softmax(x, g, rest=None):
    """The gradient with respect to x of Σ g·softmax(x); given `rest`, the one with respect to w where
    x = rest + log(w) (compiler.adjoint: a softmax of weighted scores): softmax(x)/w times the former's factor,
    with softmax(x)_j/w_j = e^(rest_j − max x) / Σ e^(x − max x) — finite at w = 0, where log(w) is −∞."""
    top = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - top)
    total = np.sum(e, axis=-1, keepdims=True)
    y = e / total
    over = y if rest is None else np.exp(rest - top) / total
    return over * (g - np.sum(g * y, axis=-1, keepdims=True))


def vjp_sum(x, g):
    return np.expand_dims(g, -1) * np.ones_like(x)


def vjp_mean(x, g):
    return np.expand_dims(g, -1) * np.ones_like(x) / np.shape(x)[-1]


def vjp_norm(x, g):
    r = np.linalg.norm(x, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.expand_dims(g, -1) * np.where(r == 0, 0.0, x / np.where(r == 0, 1.0, r))  # 0 at 0


def vjp_lsh_attention(q, v, g, causal: bool, buckets, rounds, chunk, seed):
    """(∂q, ∂v) of lsh_attention(q, v) with upstream gradient g, the buckets held fixed (attention's
    lsh_attention_backward: the hashing is piecewise constant)."""
    return lsh_attention_backward(q, v, g, causal, int(buckets), int(rounds), int(chunk), int(seed))


def vjp_lsh_attention_bucketed(q, v, g, causal: bool, buckets, rounds, chunk, seed):
    """(∂q, ∂v) of lsh_attention's bucketed form (the chunkwise one) with upstream gradient g, the buckets held
    fixed, by its blocks (attention's lsh_attention_bucketed_backward)."""
    return lsh_attention_bucketed_backward(q, v, g, causal, int(buckets), int(rounds), int(chunk), int(seed))


def pad_to(g, shape):
    """The gradient g of a param cut to its first positions (a param over the sequence axis, of which a call uses
    the first T), zero-padded at the end of each axis to the param's whole `shape`."""
    return np.pad(g, [(0, whole - part) for part, whole in zip(np.shape(g), shape)])


HELPERS = frozenset(name for name in globals() if name.startswith("vjp_")) | {
    "unbroadcast", "outer_sum", "pad_to", "own_array", "in_place", "negated"}

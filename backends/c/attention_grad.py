"""Flash attention with its log-sum-exp, and its backward, and the parallel (score-matrix) backward of softmax
attention, in C (templates/c_attention_grad.c.j2): what the backwards of softmax attention call on the C
backend (c.attention_backward).

    out, lse = flash_attention(q, k, v, causal, window, block)                          [B, T, H, dv], [B, T, H]
    d_q, d_k, d_v = flash_attention_backward(q, k, v, out, lse, d_out, causal, window, block)
    out = parallel_attention(q, k, v, causal, window)                                   [B, T, H, dv]
    d_q, d_k, d_v = parallel_attention_backward(q, k, v, d_out, causal, window)
    d_q, d_v = vjp_lsh_attention(q, v, d_out, causal, buckets, rounds, chunk, seed)             (and _bucketed)

The flash pair is what the chunkwise backward of softmax attention calls on the C backend, and its recurrent
backward too (c.attention_backward: the flash kernels go query by query over the keys each query sees, with
its log-sum-exp kept — the KV-cache backward): the twins of linrec.numpy.attention's functions of those
names. Both take the queries in tiles of 16, each key row loaded once per tile; the forward runs each query
over the keys it sees in blocks of `block` with an online softmax; the backward recomputes each probability
from its score and the query's log-sum-exp. The parallel pair is the parallel backward's: the parallel forward
(c.attention's dense rows of scores), and the backward from the score matrix (per tile of queries, the
probabilities recomputed from the scores, ∂S = P ⊙ (∂P − rowsum(P ⊙ ∂P))), whose keys may be fewer or more
than the queries (Linformer's projected sequence). vjp_lsh_attention is Reformer's backward (the parallel
one, the buckets held fixed), vjp_lsh_attention_bucketed its chunkwise one: linrec.numpy.vjp's twins.

All take arrays [B, T, H, *] of float32 or float64 (strided views, e.g. broadcast queries, read in place)
and give linrec.numpy's results to rounding. One extension per dtype (d and dv are arguments), built by
c_build and cached. OpenMP threads over (batch row, head), each pair on one thread: the results are
bit-identical whatever the number of threads (LINREC_NUM_THREADS, or num_threads=).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dsl.errors import RuntimeInputError
from ..templating import environment
from ..version import VERSION
from . import build as c_build
from .attention import _as4d, _common_dtype, _pointer, _strides, attention, lsh_rounds
from .buffers import require_c_int_sizes
from .build import CTYPES
from .kernel_source import Target, common_context
from .scan_kernels import cached_kernel

_CDEF = """
int la_flash_forward(const {T} *q, const {T} *k, const {T} *v, {T} *out, {T} *lse, const int64_t *st, int B,
                     int ntok, int H, int d, int dv, int causal, int64_t window, int64_t block, int nthreads);
int la_flash_backward(const {T} *q, const {T} *k, const {T} *v, const {T} *out, const {T} *lse,
                      const {T} *d_out, {T} *d_q, {T} *d_k, {T} *d_v, const int64_t *st, int B, int ntok, int H,
                      int d, int dv, int causal, int64_t window, int nthreads);
int la_parallel_backward(const {T} *q, const {T} *k, const {T} *v, const {T} *d_out, {T} *d_q, {T} *d_k,
                         {T} *d_v, const int64_t *st, int B, int nq, int nk, int H, int d, int dv, int causal,
                         int64_t window, int nthreads);
int la_lsh_backward(int dense, const {T} *q, const {T} *v, const {T} *d_out, const int32_t *buckets,
                    const int32_t *order, {T} *d_q, {T} *d_v, const int64_t *st, int B, int ntok, int H, int R,
                    int d, int dv, int64_t chunk, int causal, int nthreads);
"""


@dataclass(frozen=True)
class _Kernel:
    """What one extension is built for (its repr keys the disk cache)."""

    ctype: str
    vector_bytes: int


def _kernel(dtype: np.dtype):
    s = _Kernel(CTYPES[dtype], c_build.vector_bytes())

    def source() -> str:
        return environment(__package__).get_template("c_attention_grad.c.j2").render(
            **common_context(Target(s.ctype, s.vector_bytes)), block_tokens=1, inputs=[], checks_inputs=False,
            version=VERSION)
    return cached_kernel(s, "c_attention_grad", f"attention_grad_{s.ctype}", source,
                         _CDEF.replace("{T}", s.ctype))


def _positive(what: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise RuntimeInputError(f"{what} must be a positive integer, got {x!r}")
    return int(x)


def _threads(num_threads) -> int:
    return c_build.thread_count(None if num_threads is None else _positive("num_threads", num_threads))


def _options(causal, window, block, num_threads) -> tuple[int, int, int, int]:
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise RuntimeInputError(f"window must be a non-negative integer (0: no window), got {window!r}")
    return int(bool(causal)), int(window), _positive("block (the chunk size)", block), _threads(num_threads)


def _inputs(q, k, v, extra=(), what="flash attention", key_tokens=None):
    """q, k, v (and the backward's out, d_out) as arrays of one C dtype, [B, T, H, *] and agreeing in size (k
    and v of key_tokens positions when given, else q's T)."""
    named = {"q": q, "k": k, "v": v, **dict(extra)}
    dtype = _common_dtype([np.asarray(a) for a in named.values()], what)
    a = {name: _as4d(x, name, dtype) for name, x in named.items()}
    batch, tokens, heads, d = a["q"].shape
    dv = a["v"].shape[-1]
    keys = tokens if key_tokens is None else key_tokens
    for name, x in a.items():
        width = d if name in ("q", "k") else dv
        length = keys if name in ("k", "v") else tokens
        if x.shape != (batch, length, heads, width):
            source = "q's [B, T, H]" if length == tokens else "q's B and H, k's T"
            raise RuntimeInputError(f"{what}: '{name}' should have shape {[batch, length, heads, width]} "
                                    f"({source} and its width), got {list(x.shape)}")
    require_c_int_sizes(batch=batch, tokens=tokens, keys=keys, heads=heads, d=d, dv=dv)
    return dtype, a


def flash_attention(q, k, v, causal: bool, window: int, block: int, *, num_threads: int | None = None):
    """softmax(K·q_t)·V over the keys each query sees, and each query's log-sum-exp: (out [B, T, H, dv],
    lse [B, T, H]). q, k [B, T, H, d]; v [B, T, H, dv]."""
    causal, window, block, threads = _options(causal, window, block, num_threads)
    dtype, a = _inputs(q, k, v)
    batch, tokens, heads, d = a["q"].shape
    dv = a["v"].shape[-1]
    out = np.zeros((batch, tokens, heads, dv), dtype)
    lse = np.zeros((batch, tokens, heads), dtype)
    if batch * tokens * heads == 0:
        return out, lse
    mod = _kernel(dtype)
    ffi, ctype = mod.ffi, CTYPES[dtype]
    st = np.array(sum((_strides(x) for x in (a["q"], a["k"], a["v"], out)), []) +
                  [s // lse.itemsize for s in lse.strides], np.int64)
    rc = mod.lib.la_flash_forward(*(_pointer(ffi, ctype, x) for x in (a["q"], a["k"], a["v"], out, lse)),
                                  ffi.from_buffer("int64_t[]", st), batch, tokens, heads, d, dv, causal, window,
                                  min(block, tokens), threads)
    if rc != 0:
        raise MemoryError("the flash attention kernel could not allocate its buffers")
    return out, lse


def flash_attention_backward(q, k, v, out, lse, d_out, causal: bool, window: int, block: int, *,
                             num_threads: int | None = None):
    """The backward of flash_attention: (∂q, ∂k, ∂v), from its out and lse and the outputs' gradient d_out
    [B, T, H, dv]. Each probability is recomputed from its score and the log-sum-exp, P = exp(S − lse); with
    D = rowsum(∂O ⊙ O), ∂S = P ⊙ (∂O·Vᵀ − D): ∂q = ∂S·K, ∂k = ∂Sᵀ·Q, ∂v = Pᵀ·∂O. (block is checked and not
    otherwise needed: the kernel goes key by key, and no block changes the sums but by rounding.)"""
    causal, window, block, threads = _options(causal, window, block, num_threads)
    dtype, a = _inputs(q, k, v, (("out", out), ("d_out", d_out)))
    batch, tokens, heads, d = a["q"].shape
    dv = a["v"].shape[-1]
    stats = np.asarray(lse)
    if stats.shape != (batch, tokens, heads):
        raise RuntimeInputError(f"flash attention: 'lse' should have shape {[batch, tokens, heads]}, got "
                                f"{list(stats.shape)}")
    stats = np.ascontiguousarray(stats, dtype)
    grads = [np.zeros(a[name].shape, dtype) for name in ("q", "k", "v")]
    if batch * tokens * heads == 0:
        return tuple(grads)
    mod = _kernel(dtype)
    ffi, ctype = mod.ffi, CTYPES[dtype]
    st = np.array(sum((_strides(x) for x in (a["q"], a["k"], a["v"], a["out"])), []) +
                  [s // stats.itemsize for s in stats.strides] +
                  sum((_strides(x) for x in [a["d_out"]] + grads), []), np.int64)
    arrays = (a["q"], a["k"], a["v"], a["out"], stats, a["d_out"], *grads)
    mod.lib.la_flash_backward(*(_pointer(ffi, ctype, x) for x in arrays), ffi.from_buffer("int64_t[]", st),
                              batch, tokens, heads, d, dv, causal, window, threads)
    return tuple(grads)


def parallel_attention(q, k, v, causal: bool, window: int, *, num_threads: int | None = None):
    """softmax(K·q_t)·V over the keys each query sees, by c.attention's parallel form (dense rows of scores):
    the parallel backward's forward. q [B, Tq, H, d], k [B, Tk, H, d], v [B, Tk, H, dv] → [B, Tq, H, dv]."""
    return attention(q, k, v, causal, window, "parallel", num_threads=num_threads)


def parallel_attention_backward(q, k, v, d_out, causal: bool, window: int, *, num_threads: int | None = None):
    """The backward of parallel_attention from the score matrix: (∂q, ∂k, ∂v). Per query its row of scores
    S = K·q, P = softmax(S) over the keys it sees, ∂P = V·∂o, ∂S = P ⊙ (∂P − Σ_j P_j ∂P_j); ∂q = ∂S·K,
    ∂k = ∂Sᵀ·Q, ∂v = Pᵀ·∂O. q, d_out [B, Tq, H, *]; k, v [B, Tk, H, *] (Tk = Tq when causal or windowed)."""
    causal, window, _, threads = _options(causal, window, 1, num_threads)  # (no blocks: the whole row of scores)
    keys = np.asarray(k)
    if keys.ndim != 4:
        raise RuntimeInputError(f"'k' should have shape [B, T, H, *] (4 axes), got {list(keys.shape)}")
    key_tokens = keys.shape[1]
    dtype, a = _inputs(q, k, v, (("d_out", d_out),), "parallel attention backward", key_tokens)
    batch, tokens, heads, d = a["q"].shape
    dv = a["v"].shape[-1]
    if (causal or window) and key_tokens != tokens:
        raise RuntimeInputError(f"parallel attention backward: causal or windowed attention needs as many keys as "
                                f"queries, got {key_tokens} keys for {tokens} queries")
    grads = [np.zeros(a[name].shape, dtype) for name in ("q", "k", "v")]
    if batch * tokens * heads == 0 or key_tokens == 0:
        return tuple(grads)
    mod = _kernel(dtype)
    ffi, ctype = mod.ffi, CTYPES[dtype]
    st = np.array(sum((_strides(x) for x in [a["q"], a["k"], a["v"], a["d_out"]] + grads), []), np.int64)
    arrays = (a["q"], a["k"], a["v"], a["d_out"], *grads)
    rc = mod.lib.la_parallel_backward(*(_pointer(ffi, ctype, x) for x in arrays), ffi.from_buffer("int64_t[]", st),
                                      batch, tokens, key_tokens, heads, d, dv, causal, window, threads)
    if rc != 0:
        raise MemoryError("the parallel attention backward kernel could not allocate its buffers")
    return tuple(grads)


def vjp_lsh_attention(q, v, g, causal: bool, buckets, rounds, chunk, seed, *, num_threads: int | None = None):
    """(∂q, ∂v) of lsh_attention(q, v) (c.attention.lsh_attention_dense) with upstream gradient g [B, T, H,
    dv], the buckets held fixed: linrec.numpy.vjp.vjp_lsh_attention's twin (its lsh_attention_backward's
    results to rounding)."""
    return _lsh_backward(True, q, v, g, causal, buckets, rounds, chunk, seed, num_threads)


def vjp_lsh_attention_bucketed(q, v, g, causal: bool, buckets, rounds, chunk, seed, *,
                               num_threads: int | None = None):
    """The same for the bucketed form (c.attention.lsh_attention_bucketed): each query's candidates found in
    its chunk and the previous one of each round's sorted order, O(T·chunk) per round; the same set as the
    dense form's, in another order (linrec.numpy.vjp.vjp_lsh_attention_bucketed's twin)."""
    return _lsh_backward(False, q, v, g, causal, buckets, rounds, chunk, seed, num_threads)


def _lsh_backward(dense: bool, q, v, g, causal, buckets, rounds, chunk, seed, num_threads):
    for name, x in (("buckets", buckets), ("rounds", rounds), ("chunk", chunk)):
        _positive(f"lsh_attention: {name}", x)
    threads = _threads(num_threads)
    dtype, a = _inputs(q, q, v, (("d_out", g),), "lsh attention backward")
    batch, tokens, heads, d = a["q"].shape
    dv = a["v"].shape[-1]
    grads = [np.zeros(a[name].shape, dtype) for name in ("q", "v")]
    if batch * tokens * heads == 0:
        return tuple(grads)
    bk, order = lsh_rounds(a["q"], buckets, rounds, seed)
    mod = _kernel(dtype)
    ffi, ctype = mod.ffi, CTYPES[dtype]
    st = np.array(sum((_strides(x) for x in [a["q"], a["v"], a["d_out"]] + grads), []), np.int64)
    rc = mod.lib.la_lsh_backward(int(dense), *(_pointer(ffi, ctype, x) for x in (a["q"], a["v"], a["d_out"])),
                                 ffi.from_buffer("int32_t[]", bk), ffi.from_buffer("int32_t[]", order),
                                 *(_pointer(ffi, ctype, x) for x in grads), ffi.from_buffer("int64_t[]", st),
                                 batch, tokens, heads, int(rounds), d, dv, int(chunk), int(bool(causal)), int(threads))
    if rc != 0:
        raise MemoryError("the LSH attention backward kernel could not allocate its buffers")
    return tuple(grads)

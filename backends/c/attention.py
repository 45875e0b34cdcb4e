"""C kernels for programs that read the sequence: exact softmax attention in three forms, and Reformer's
LSH attention (its bucketed form and its dense reference).

    attention(queries, keys, values, causal, window, form="parallel", chunk_size=None)   -> [B, Tq, H, dv]
    lsh_attention_dense(q, v, causal, buckets, rounds, chunk, seed)                      -> [B, T, H, dv]
    lsh_attention_bucketed(q, v, causal, buckets, rounds, chunk, seed)                   -> [B, T, H, dv]

The twins of numpy_attention.attention / lsh_attention_*: the same arguments and results (to rounding), on
arrays [B, T, H, *] of float32 or float64. The kernels come from templates/c_attention.c.j2, one extension
per (dtype, d, dv) holding every form (d and dv are compile-time constants), built by c_build (cffi API
mode, cached on disk) at the first call with those sizes and memoized here. They run OpenMP threads over
(batch row, head, block of queries): LINREC_NUM_THREADS of them, else one per available core.

Reformer's hashing (seeded rotations) and the sort by (bucket, position) stay in NumPy —
numpy_attention.lsh_buckets and _round_order, so both backends hash identically; the per-round masked
softmax, the self-only-when-nothing-else rule and the log-sum-exp combination of the rounds run in C.
"""
from __future__ import annotations


import numpy as np

from ..dsl.errors import LinrecError, RuntimeInputError

from .. import arrays
from . import build as c_build
from . import fork
from ..numpy import attention as numpy_attention
from .build import CTYPE_BYTES, CTYPES
from ..version import VERSION
from ..templating import environment

FORMS = {"recurrent": 0, "parallel": 1, "chunkwise": 2}
BLOCK = 64  # the chunkwise form's query and key block, unless chunk_size is given
# The recurrent form's queries walk the keys in step, a segment at a time: a segment's keys and values
# (this many bytes) stay in cache while every query of a block passes over them.
SEGMENT_BYTES = 32 * 1024

_CDEF = """
int la_attention(int form, const {T} *q, const {T} *k, const {T} *v, {T} *out, const int64_t *sh, int causal,
                 int64_t window, int64_t offset, int64_t block, int nthreads);
int la_lsh(int dense, const {T} *q, const {T} *v, const int32_t *buckets, const int32_t *order, {T} *out,
           const int64_t *sh, int64_t chunk, int causal, int nthreads);
"""

_kernels: dict[tuple, object] = {}
_lock = fork.Lock()  # (free in a forked child: fork.py)

# the generator's own files: a change to any of them rebuilds its cached kernels


# ---- building -----------------------------------------------------------------------------------------
def _layout(ctype: str, vector_bytes: int) -> dict:
    """Register tiles for the target: TR query rows × tile_vectors registers of keys for Q·Kᵀ (with AVX-512's
    32 registers 4×4 accumulators, else 4×2), and groups of value registers for P·V."""
    lanes = max(1, vector_bytes // CTYPE_BYTES[ctype])
    wide = vector_bytes >= 64
    tile_vectors = 4 if wide else 2
    width = tile_vectors * lanes
    return {"lanes": lanes, "vector_bytes": vector_bytes, "tile_rows": 4, "tile_vectors": tile_vectors,
            "tile_width": width, "pv_group": 4 if wide else 2, "key_block": -(-64 // width) * width}


def source(dtype, d: int, dv: int) -> str:
    """The generated C for one dtype and (d, dv)."""
    ctype = CTYPES[np.dtype(dtype)]
    lay = _layout(ctype, c_build.vector_bytes())
    lanes = lay["lanes"]
    dp, dvp = -(-d // lanes) * lanes, -(-dv // lanes) * lanes
    nvv, g = dvp // lanes, lay["pv_group"]
    groups = [(g0, min(g, nvv - g0)) for g0 in range(0, nvv, g)]
    width = lay["tile_width"]
    size = CTYPE_BYTES[ctype]
    segment = max(width, min(1024, SEGMENT_BYTES // ((dp + dvp) * size)) // width * width)
    return environment(__package__).get_template("c_attention.c.j2").render(
        version=VERSION, ctype=ctype, d=d, dv=dv, dp=dp, dvp=dvp, pv_groups=groups, segment=segment, **lay)


def cdef(dtype) -> str:
    return _CDEF.replace("{T}", CTYPES[np.dtype(dtype)])


def kernel(dtype, d: int, dv: int):
    """The built extension (its .ffi and .lib) for one dtype and (d, dv): from memory, else the disk cache
    (found by an alias of the sizes, without rendering), else built now."""
    dtype = np.dtype(dtype)
    key = (dtype.str, int(d), int(dv), c_build.target_key())
    mod = _kernels.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _kernels.get(key)
        if mod is None:
            ctype = CTYPES[dtype]
            alias = c_build.alias_key("c_attention", ctype, str(d), str(dv), str(c_build.vector_bytes()))
            mod = c_build.load_alias(alias)
            if mod is None:
                mod = c_build.build(source(dtype, d, dv), cdef(dtype), f"attention_{ctype}_d{d}_dv{dv}", alias)
            _kernels[key] = mod
    return mod


# ---- arrays -------------------------------------------------------------------------------------------
def _common_dtype(arrays, what: str) -> np.dtype:
    dtype = np.result_type(*arrays)
    if dtype not in CTYPES:
        if dtype.kind in "biu" or dtype == np.float16:
            return np.dtype(np.float64) if dtype.kind in "biu" else np.dtype(np.float32)
        raise RuntimeInputError(f"{what}: the C kernels take float32 or float64 arrays, got {dtype}")
    return dtype


def _as4d(x, name: str, dtype) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 4:
        raise RuntimeInputError(f"'{name}' should have shape [B, T, H, *] (4 axes), got {list(x.shape)}")
    if x.dtype != dtype:
        x = x.astype(dtype)
    item = x.itemsize
    if (x.shape[-1] > 1 and x.strides[-1] != item) or any(s % item for s in x.strides) or not x.flags.aligned:
        x = np.ascontiguousarray(x)
    return x


def _pointer(ffi, ctype: str, x: np.ndarray):
    """A zero-copy pointer to x's first element (from_buffer for contiguous arrays; strided views, e.g.
    broadcast or sliced, by address — the caller keeps x alive for the call)."""
    if x.flags.c_contiguous:
        return ffi.from_buffer(ctype + "[]", x)
    return ffi.cast(ctype + " *", x.ctypes.data)


def _strides(x: np.ndarray) -> list[int]:
    """(batch, token, head) strides in elements."""
    return [s // x.itemsize for s in x.strides[:3]]


# ---- softmax attention --------------------------------------------------------------------------------
def attention(queries, keys, values, causal: bool, window: int = 0, form: str = "parallel", chunk_size=None, *,
              query_offset: int = 0, num_threads: int | None = None) -> np.ndarray:
    """o_t = Σ_j softmax_j(queries_t·keys_j)·values_j over the keys j each query sees — no scaling (fold
    d^(−1/2) into the queries). queries [B, Tq, H, d], keys [B, Tk, H, d], values [B, Tk, H, dv] → [B, Tq,
    H, dv] of their dtype (float32 or float64; strided views are read in place).

    Query t sits at position p = t + query_offset and sees keys j with j ≤ p if causal (then Tq +
    query_offset must equal Tk: the queries are the last Tq positions — Tq == Tk by default, 1 for a decode
    step over a KV cache of Tk tokens) and |p − j| < window if window > 0. form: "recurrent" (per query
    one pass with an online softmax), "parallel" (dense rows of scores) or "chunkwise" (flash attention,
    query and key blocks of chunk_size, default 64). All forms agree to rounding."""
    if form not in FORMS:
        raise LinrecError(f"unknown attention form '{form}'; choose one of {', '.join(FORMS)}")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise RuntimeInputError(f"window must be a non-negative integer (0: no window), got {window!r}")
    chunk = arrays.check_chunk_size(chunk_size)
    if isinstance(query_offset, bool) or not isinstance(query_offset, (int, np.integer)) or query_offset < 0:
        raise RuntimeInputError(f"query_offset must be a non-negative integer, got {query_offset!r}")
    dtype = _common_dtype([np.asarray(a) for a in (queries, keys, values)], "attention")
    q, k, v = _as4d(queries, "queries", dtype), _as4d(keys, "keys", dtype), _as4d(values, "values", dtype)
    batch, tq, heads, d = q.shape
    tk, dv = k.shape[1], v.shape[-1]
    if k.shape[0] != batch or v.shape[0] != batch or k.shape[2] != heads or v.shape[2] != heads:
        raise RuntimeInputError(f"queries {list(q.shape)}, keys {list(k.shape)} and values {list(v.shape)} "
                                f"must agree on the batch (axis 0) and head (axis 2) sizes")
    if k.shape[3] != d:
        raise RuntimeInputError(f"queries and keys must have the same width, got {d} and {k.shape[3]}")
    if v.shape[1] != tk:
        raise RuntimeInputError(f"keys and values must have the same length, got {tk} and {v.shape[1]}")
    if causal and tq + query_offset != tk:
        raise RuntimeInputError(f"causal attention needs as many keys as query positions (Tq + query_offset "
                                f"= {tq} + {query_offset}, Tk = {tk}): the queries are the last Tq positions")
    out = np.empty((batch, tq, heads, dv), dtype)
    if batch * tq * heads == 0 or dv == 0:
        return out
    if tk == 0 or (window and query_offset + tq - 1 >= tk + window - 1):
        raise RuntimeInputError(f"a query sees no key (Tq = {tq}, Tk = {tk}, window = {window}, query_offset = "
                                f"{query_offset}): its softmax is undefined")
    if d == 0:
        raise RuntimeInputError("queries and keys have width 0")
    mod = kernel(dtype, d, dv)
    ffi, ctype = mod.ffi, CTYPES[dtype]
    sh = np.array([batch, tq, tk, heads] + _strides(q) + _strides(k) + _strides(v) + _strides(out), np.int64)
    threads = c_build.thread_count(num_threads)
    if threads < 1:
        raise RuntimeInputError(f"num_threads must be a positive integer, got {num_threads!r}")
    block = min(BLOCK if chunk is None else chunk, max(tq, tk))  # a block longer than the sequence changes nothing
    rc = mod.lib.la_attention(FORMS[form], _pointer(ffi, ctype, q), _pointer(ffi, ctype, k),
                              _pointer(ffi, ctype, v), ffi.from_buffer(ctype + "[]", out),
                              ffi.from_buffer("int64_t[]", sh), int(bool(causal)), int(window),
                              int(query_offset), block, threads)
    if rc != 0:
        raise MemoryError("the attention kernel could not allocate its buffers")
    return out


# ---- Reformer -----------------------------------------------------------------------------------------
def _lsh(dense: bool, q, v, causal: bool, buckets: int, rounds: int, chunk: int, seed: int) -> np.ndarray:
    q, v = np.asarray(q), np.asarray(v)
    for name, x in (("buckets", buckets), ("rounds", rounds), ("chunk", chunk)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
            raise RuntimeInputError(f"lsh_attention: {name} must be a positive integer, got {x!r}")
    dtype = _common_dtype([q, v], "lsh_attention")
    qc, vc = _as4d(q, "q", dtype), _as4d(v, "v", dtype)
    batch, tokens, heads, dk = qc.shape
    if vc.shape[:3] != (batch, tokens, heads):
        raise RuntimeInputError(f"q {list(qc.shape)} and v {list(vc.shape)} must agree on [B, T, H]")
    dv = vc.shape[-1]
    out = np.empty((batch, tokens, heads, dv), dtype)
    if batch * tokens * heads == 0 or dv == 0:
        return out
    bk, order = lsh_rounds(q, buckets, rounds, seed)
    mod = kernel(dtype, dk, dv)
    ffi, ctype = mod.ffi, CTYPES[dtype]
    sh = np.array([batch, tokens, heads, int(rounds)] + _strides(qc) + _strides(vc) + _strides(out), np.int64)
    rc = mod.lib.la_lsh(int(dense), _pointer(ffi, ctype, qc), _pointer(ffi, ctype, vc),
                        ffi.from_buffer("int32_t[]", bk), ffi.from_buffer("int32_t[]", order),
                        ffi.from_buffer(ctype + "[]", out), ffi.from_buffer("int64_t[]", sh), int(chunk),
                        int(bool(causal)), c_build.num_threads())
    if rc != 0:
        raise MemoryError("the LSH attention kernel could not allocate its buffers")
    return out


def lsh_rounds(q, buckets: int, rounds: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each round's buckets and sorted order, [R, B, H, T] int32 each, as the kernels take them: hashed and
    sorted as numpy_attention does it, on the caller's q (same dtype, same buckets)."""
    bucket_of = numpy_attention.lsh_buckets(q, int(buckets), int(rounds), int(seed))      # [R, B, T, H]
    order = np.stack([numpy_attention._round_order(b, q.shape[1]) for b in bucket_of])     # [R, B, H, T]
    return (np.ascontiguousarray(np.moveaxis(bucket_of, 2, -1), dtype=np.int32),
            np.ascontiguousarray(order, dtype=np.int32))


def lsh_attention_dense(q, v, causal: bool, buckets: int, rounds: int, chunk: int, seed: int):
    """numpy_attention.lsh_attention_dense in C: per round, every position tested against the mask 'same
    bucket, same chunk of the sorted order or the previous one, causal', self only when nothing else; the
    rounds combined by log-sum-exp. q [B, T, H, dk], v [B, T, H, dv] → [B, T, H, dv] of their dtype."""
    return _lsh(True, q, v, causal, buckets, rounds, chunk, seed)


def lsh_attention_bucketed(q, v, causal: bool, buckets: int, rounds: int, chunk: int, seed: int):
    """numpy_attention.lsh_attention_bucketed in C: per round, each query's candidates are its chunk of the
    sorted order and the previous one (O(T·chunk) after the O(T log T) sort in NumPy)."""
    return _lsh(False, q, v, causal, buckets, rounds, chunk, seed)

"""What the C scan kernels share — those of the contractions q·S (c.scan) and those of a vector state read as
it is (c.values): the forms they build, the chunk a call runs with, the memo of built kernels, the arrays
they read and the call itself."""
from __future__ import annotations


import numpy as np

from .. import arrays
from ..dsl.errors import RuntimeInputError
from . import build as c_build
from . import fork, stack
from .buffers import require_c_int_sizes
from .build import CTYPES

DEFAULT_CHUNK = 64  # tokens per chunk of lr_chunkwise when the call gives none
SMALL_WORK = 1 << 20  # multiply-adds (roughly) below which a call runs on one thread
FORMS = ("parallel", "chunkwise")


_kernels: dict[object, object] = {}
_lock = fork.Lock()  # (free in a forked child: fork.py)


def cached_kernel(s, kind: str, label: str, source, declarations: str):
    """The built extension (ffi, lib) for a kernel structure `s` (hashable, its repr a key): memoized, else
    from the disk cache by an alias of (kind, s), else built from source() — rendered only then, and refused
    where its sizes would overflow a thread's stack (_stack_checked)."""
    k = _kernels.get(s)
    if k is None:
        with _lock:
            k = _kernels.get(s)
            if k is None:
                alias = c_build.alias_key(kind, repr(s))
                k = c_build.load_alias(alias)
                if k is None:
                    k = c_build.build(_stack_checked(s, kind, source()), declarations, label, alias)
                _kernels[s] = k
    return k


def _stack_checked(s, kind: str, text: str) -> str:
    """A kernel's source, refused (c.stack) where the state's sizes it is specialized for would put more on a
    thread's stack than a call may: the recurrent kernels' check (kernel_source), for the scan, elementwise and
    gradient kernels, which keep a row of the state or a token's vector on the stack too (a state of 2,000,000
    rows was a SIGSEGV in the parallel and chunkwise forms). Their sizes are the state's rows and columns."""
    ctype = getattr(s, "ctype", None)
    if ctype in ("float", "double") and hasattr(s, "dk"):
        sizes = {"dk (the state's rows)": s.dk, "dv (the state's columns)": getattr(s, "dv", 1)}
        lanes = s.lanes if hasattr(s, "lanes") else 1
        stack.check(text, ctype, sizes, lanes, f"the C {kind} kernel ({ctype})")
    return text


def operand(x, dtype: np.dtype, shape: tuple, what: str) -> np.ndarray:
    """x as an array of `shape` and `dtype` whose last axis is contiguous (other strides are free)."""
    a = np.asarray(x)
    if a.dtype != dtype:
        a = a.astype(dtype)
    if a.shape != shape:
        try:
            a = np.broadcast_to(a, shape)
        except ValueError:
            raise RuntimeInputError(f"{what} should have shape {list(shape)} but has shape {list(a.shape)}") from None
    item = dtype.itemsize
    if (shape[-1] > 1 and a.strides[-1] != item) or any(st % item for st in a.strides) or not a.flags.aligned:
        a = np.ascontiguousarray(a)
    return a


def chunk_of(chunk_size, tokens: int) -> int:
    """The chunk of a chunkwise call over `tokens` tokens: chunk_size (checked: arrays.check_chunk_size), else
    DEFAULT_CHUNK, clamped to the sequence — a longer chunk is the sequence as one chunk — so that it fits the
    kernels' int."""
    chunk = arrays.check_chunk_size(chunk_size)
    return min(DEFAULT_CHUNK if chunk is None else chunk, max(tokens, 1))


def call(k, function: str, state: np.ndarray, ops: list, outs: list, work: int, num_threads, *extra) -> np.ndarray:
    """Runs `function` of the built extension k: (s0, sT, inputs, their strides, outputs, B, T, H, threads,
    *extra) with state [B, H, …] and ops [B, T, H, n]; an output None is passed as NULL (the kernel writes none).
    Returns the final state. A call with less than SMALL_WORK multiply-adds runs on one thread (waking others
    costs more); at most one per (batch row, head)."""
    ffi = k.ffi
    given = [o for o in outs if o is not None]
    batch, tokens, heads = (given[0] if given else ops[0]).shape[:3]
    require_c_int_sizes(batch=batch, tokens=tokens, heads=heads)
    ctype = CTYPES[state.dtype]
    ptr = ctype + " *"
    item = state.dtype.itemsize
    c_in = ffi.new(ctype + " *[]", [ffi.cast(ptr, a.__array_interface__["data"][0]) for a in ops] or 1)
    c_st = ffi.new("int64_t[]", [a.strides[i] // item for a in ops for i in range(3)] or 1)
    c_out = ffi.new(ctype + " *[]", [ffi.NULL if o is None else ffi.from_buffer(ptr, o) for o in outs] or 1)
    final = np.empty_like(state)
    threads = c_build.thread_count(num_threads)
    threads = 1 if work < SMALL_WORK else min(threads, batch * heads)
    rc = getattr(k.lib, function)(ffi.from_buffer(ptr, state), ffi.from_buffer(ptr, final), c_in, c_st, c_out,
                                  batch, tokens, heads, max(1, threads), *extra)
    if rc:
        raise MemoryError(f"the C kernel {function} could not allocate its scratch memory")
    return final

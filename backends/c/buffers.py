"""Arrays for the C kernels: checked and made C-contiguous at the boundary (never a segfault), output and
state buffers that start on a cache line, and output arrays recycled between calls."""
from __future__ import annotations

import sys
from math import prod

import cffi
import numpy as np

from ..arrays import bits_hint, native
from ..dsl.errors import RuntimeInputError
from . import fork

_FFI = cffi.FFI()  # only to read an array's address cheaply


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """A C-contiguous array whose data starts on a cache line (whole-register loads of the state rows then
    never straddle two lines)."""
    dtype = np.dtype(dtype)
    n = prod(int(d) for d in shape) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    start = (-int(_FFI.cast("uintptr_t", _FFI.from_buffer(raw)))) % align
    return raw[start:start + n].view(dtype).reshape(shape)


class RecycledArrays:
    """Output arrays for lr_forward: cache-line aligned (the kernel streams whole lines into them), and
    recycled once nobody but this object holds them. A fresh array of tens of MB pays a page fault and
    the zeroing of every 4 KiB page at first touch — at T = 16384 a third of the kernel's own time — while
    an array no one else references can be written again without anyone seeing it. Only arrays (and the
    buffers under them) whose reference counts are back at what they were when made are reused, so a
    caller still holding a result, or any view of it, keeps it intact."""

    def __init__(self, keep: int):
        self.keep = keep  # arrays kept for reuse, the most recent (idle ones hold memory until reused or replaced)
        self._entries: list[list] = []  # [array, its memory's owner, reference counts when idle]
        self._lock = fork.Lock()  # (free in a forked child: fork.py)

    @staticmethod
    def _refs(entry) -> tuple[int, int]:
        return sys.getrefcount(entry[0]), sys.getrefcount(entry[1])

    def take(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        with self._lock:
            for i, entry in enumerate(self._entries):
                if entry[0].shape == shape and entry[0].dtype == dtype and self._refs(entry) == entry[2]:
                    self._entries.append(self._entries.pop(i))
                    return entry[0]
            arr = aligned_empty(shape, dtype)
            entry = [arr, arr.base if arr.base is not None else arr, None]
            del arr
            entry[2] = self._refs(entry)
            self._entries.append(entry)
            if len(self._entries) > self.keep:
                self._entries.pop(0)
            return entry[0]


def aligned_zeros(shape, dtype) -> np.ndarray:
    out = aligned_empty(shape, dtype)
    out.fill(0)
    return out


def aligned_copy(arr: np.ndarray) -> np.ndarray:
    out = aligned_empty(arr.shape, arr.dtype)
    np.copyto(out, arr)
    return out


C_INT_MAX = 2**31 - 1  # the kernels take the batch, token and head counts as C ints


def require_c_int_sizes(**sizes: int) -> None:
    """The counts a kernel takes as C ints (batch, tokens, heads) within their range: an error naming the
    one that is not, rather than cffi's OverflowError (an internal error) or a wrapped-around count."""
    for name, n in sizes.items():
        if n > C_INT_MAX:
            raise RuntimeInputError(f"{name} = {n}: the C kernels take at most {C_INT_MAX} (2³¹ − 1); split the "
                                    f"call, or use the NumPy backend (backend='numpy')")


def checked(value, shape: tuple, dtype, what: str) -> np.ndarray:
    """`value` as a C-contiguous array of `shape` (and `dtype`): converted when only the layout differs,
    rejected when the shape or the dtype is wrong."""
    arr = native(value if isinstance(value, np.ndarray) else np.asarray(value))  # (>f8: a layout, converted)
    if tuple(arr.shape) != tuple(shape):
        raise RuntimeInputError(f"{what} should have shape {list(shape)} but has shape {list(arr.shape)}")
    if dtype is not None and arr.dtype != dtype:
        raise RuntimeInputError(f"{what} has dtype {arr.dtype} but the call runs in {np.dtype(dtype)}; pass "
                                f"every array in one dtype (float32 or float64)")
    if dtype is None and arr.dtype.type not in (np.float32, np.float64):
        bits = bits_hint(arr) if "state" in what else ""  # (the words of NumPy's check: arrays._float_array)
        raise RuntimeInputError(f"{what} has dtype {arr.dtype}; pass float32 or float64{bits}")
    if not arr.flags.c_contiguous or not arr.flags.aligned:
        arr = np.ascontiguousarray(arr)
    return arr

"""What a process forked from one that ran the C kernels needs (os.fork, multiprocessing's "fork" start method,
PyTorch's DataLoader workers on Linux).

GNU OpenMP's threads do not survive a fork: in the child, the first parallel region of a team the parent had
started waits for them forever. A child forked after its parent loaded a kernel therefore runs every kernel on
one thread (`single_threaded`: build.num_threads and build.thread_count say 1, whatever asks for more; the
'spawn' and 'forkserver' start methods give workers their threads). And a lock that another thread of the
parent held at the fork — through a kernel's build, seconds of gcc — would stay held in the child, where that
thread does not exist: the C backend's locks are `Lock`s, which the child gets free."""
from __future__ import annotations

import os
import threading
import weakref

_locks: weakref.WeakSet = weakref.WeakSet()
_kernels_loaded = False   # this process has loaded a kernel (and with it the OpenMP runtime)
_single_threaded = False  # this process was forked from one that had


class Lock:
    """A threading.Lock, as a context manager, that a forked child gets free."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self):
        self._lock = threading.Lock()
        _locks.add(self)

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()


def kernel_loaded() -> None:
    """Called as a kernel is loaded: a child forked from now on runs its kernels on one thread."""
    global _kernels_loaded
    _kernels_loaded = True


def single_threaded() -> bool:
    """Whether this process was forked from one that had loaded kernels: its kernels run on one thread."""
    return _single_threaded


def _in_child() -> None:
    global _single_threaded
    _single_threaded = _single_threaded or _kernels_loaded
    for lock in list(_locks):
        lock._lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # (not on Windows, which has no fork)
    os.register_at_fork(after_in_child=_in_child)

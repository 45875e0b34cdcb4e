"""Locks that a process forked from this one gets free (os.fork, multiprocessing's "fork" start method,
PyTorch's DataLoader workers on Linux).

A lock that another thread of the parent held at the fork — through a kernel's build, seconds of gcc — would
stay held in the child, where that thread does not exist, and the child's first kernel would wait for it
forever: the C backend's locks are `Lock`s, made new in the child. (The kernels' thread count in such a child:
build.num_threads.)"""
from __future__ import annotations

import os
import threading
import weakref

_locks: weakref.WeakSet = weakref.WeakSet()


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


def _in_child() -> None:
    for lock in list(_locks):
        lock._lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # (not on Windows, which has no fork)
    os.register_at_fork(after_in_child=_in_child)

"""Build generated C through cffi (API mode) and cache the extensions on disk.

The cache lives in $LINREC_CACHE_DIR, else $XDG_CACHE_HOME/linrec, else ~/.cache/linrec. An entry is a
directory named by the build key — sha256 of the generated source, the cffi declarations, the compiler's
path and `--version`, the flags, the target (architecture and CPU features), linrec's version, the Python
ABI and cffi's version — holding the extension, its C source and a checksum file. Builds happen in a
temporary directory inside the cache and are renamed into place atomically, so two processes building the
same kernel at once both succeed (the loser uses the winner's entry). An entry whose extension does not
match its checksum (truncated, corrupted) is detected at load time and rebuilt.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import io
import importlib.resources
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import uuid
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..dsl.errors import LinrecError

from ..version import VERSION

# the scalar types the C kernels are built for: NumPy's dtype → the C type, and its bytes
CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
CTYPE_BYTES = {"float": 4, "double": 8}

_NO_COMPILER = ("no C compiler found (looked for $CC, cc, gcc and clang): the C backend needs one to build "
                "its kernels; install gcc (with OpenMP) or use the NumPy backend (backend='numpy'), which "
                "still works")
_loaded: dict[str, object] = {}
_lock = threading.Lock()


# ---- where and with what ------------------------------------------------------------------------------
def cache_dir() -> Path:
    env = os.environ.get("LINREC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "linrec"


def compiler() -> str:
    """Path of the C compiler: $CC, else cc, gcc or clang on PATH."""
    candidates = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for c in candidates:
        path = shutil.which(c.split()[0]) if c.strip() else None
        if path:
            return path
    raise LinrecError(_NO_COMPILER)


@lru_cache(maxsize=None)
def _compiler_version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        raise LinrecError(f"the C compiler {path} does not run ({err}); use the NumPy backend "
                          f"(backend='numpy'), which still works") from None
    return out.stdout.strip()


@lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _target() -> str:
    """LINREC_C_TARGET: "native" (default: build for this CPU), "avx512", "avx2" or "portable"."""
    t = os.environ.get("LINREC_C_TARGET", "native").strip().lower() or "native"
    if t not in ("native", "avx512", "avx2", "portable"):
        raise LinrecError(f"LINREC_C_TARGET must be native, avx512, avx2 or portable, got {t!r}")
    return t


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def vector_bytes() -> int:
    """Width of the SIMD registers the kernels are written for (64: AVX-512, 32: AVX2, else 16)."""
    t, flags = _target(), _cpu_flags()
    if not _x86() or t == "portable":
        return 16
    if t == "avx512" or (t == "native" and "avx512f" in flags):
        return 64
    if t == "avx2" or (t == "native" and "avx2" in flags):
        return 32
    return 16


def flags() -> list[str]:
    t, base = _target(), ["-O3", "-std=gnu11", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-semantic-interposition"]
    if t == "portable":
        return base
    if t == "native":
        arch = ["-march=native"]
        if vector_bytes() == 64:
            arch.append("-mprefer-vector-width=512")
        return base + arch
    if t == "avx512":
        return base + ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma",
                       "-mprefer-vector-width=512"]
    return base + ["-mavx2", "-mfma"]


@lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name (part of the cache key: -march=native code is built for it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def target_key() -> str:
    """The chosen target, for keys: the same source is rebuilt when the target changes."""
    return _target_key(os.environ.get("LINREC_C_TARGET", ""))


@lru_cache(maxsize=None)
def _target_key(setting: str) -> str:
    """target_key for one value of LINREC_C_TARGET (every kernel lookup asks: hashing ~100 CPU flags costs
    ~0.1 ms)."""
    desc = [platform.machine(), _target(), str(vector_bytes())]
    if _target() == "native":
        desc += [cpu_model(), ",".join(sorted(_cpu_flags()))]
    return hashlib.sha256("|".join(desc).encode()).hexdigest()[:16]


def build_key(source: str, cdef: str) -> str:
    import cffi
    cc = compiler()
    parts = [source, cdef, cc, _compiler_version(cc), " ".join(flags()), target_key(), VERSION,
             sys.implementation.cache_tag or "", sysconfig.get_config_var("EXT_SUFFIX") or "", cffi.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


# ---- build ------------------------------------------------------------------------------------------
def _module_name(key: str) -> str:
    return f"_linrec_{key[:24]}"


def _ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _compile(source: str, cdef: str, name: str, where: Path) -> Path:
    """cffi's API-mode C file for `source`, compiled with our flags into an extension in `where`."""
    import cffi
    cc = compiler()
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source(name, source)
    c_file = where / f"{name}.c"
    with contextlib.redirect_stdout(io.StringIO()):  # cffi says "generating …"
        ffi.emit_c_code(str(c_file))
    (where / "kernel.c").write_text(source, encoding="utf-8")
    out = where / f"{name}{_ext_suffix()}"
    include = sysconfig.get_paths()["include"]
    cmd = [cc, *flags(), "-shared", "-I", include, str(c_file), "-o", str(out), "-lm"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0 and "-fopenmp" in cmd and "omp" in (res.stderr or "").lower():
            # a compiler without OpenMP (e.g. Apple clang): build single-threaded, the pragmas are ignored
            res = subprocess.run([c for c in cmd if c != "-fopenmp"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as err:
        raise LinrecError(f"could not run the C compiler {cc}: {err}; the NumPy backend (backend='numpy') "
                          f"still works") from None
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-30:])
        raise LinrecError(f"building the C kernel failed ({' '.join(cmd[:1] + cmd[1:6])} …):\n{tail}\n"
                          f"The NumPy backend (backend='numpy') still works.")
    return out


def _valid(entry: Path, name: str) -> bool:
    so = entry / f"{name}{_ext_suffix()}"
    meta = entry / "checksum.json"
    try:
        info = json.loads(meta.read_text(encoding="utf-8"))
        return so.stat().st_size == info["size"] and _sha256_file(so) == info["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _discard(path: Path) -> None:
    """Move a directory out of the way atomically, then delete it."""
    trash = path.parent / f".trash-{uuid.uuid4().hex}"
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _build_entry(source: str, cdef: str, name: str, entry: Path) -> None:
    root = entry.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        so = _compile(source, cdef, name, tmp)
        (tmp / "checksum.json").write_text(json.dumps({"sha256": _sha256_file(so), "size": so.stat().st_size}),
                                           encoding="utf-8")
        for _ in range(5):
            try:
                os.rename(tmp, entry)  # atomic; fails if another process put an entry there first
                return
            except OSError:
                if _valid(entry, name):
                    return  # someone else built the same kernel: use theirs
                _discard(entry)  # a broken entry: replace it
        raise LinrecError(f"could not place the built kernel in the cache {root}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _alias_path(alias: str) -> Path:
    return cache_dir() / "aliases" / alias


def load_alias(alias: str):
    """The extension an earlier build() recorded under `alias` (a cheap key for its source: the generated
    source need not even be rendered), or None when there is none or its entry is gone or broken."""
    try:
        key = _alias_path(alias).read_text(encoding="ascii").strip()
    except OSError:
        return None
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        return None
    with _lock:
        if key in _loaded:
            return _loaded[key]
        name, entry = _module_name(key), cache_dir() / key
        if not _valid(entry, name):
            return None
        try:
            module = _import(name, entry / f"{name}{_ext_suffix()}")
        except ImportError:
            return None
        _loaded[key] = module
        return module


def _write_alias(alias: str, key: str) -> None:
    path = _alias_path(alias)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{alias}.{uuid.uuid4().hex}")
        tmp.write_text(key, encoding="ascii")
        os.replace(tmp, path)  # atomic: readers see the old key or the new one
    except OSError:
        pass  # the alias only saves time


def build(source: str, cdef: str, label: str = "kernel", alias: str | None = None):
    """The loaded extension for `source` (its functions declared by `cdef`): from this process's memo,
    else from the disk cache (checksum verified), else built now. `alias`: also record it under this key."""
    key = build_key(source, cdef)
    if alias:
        _write_alias(alias, key)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        name = _module_name(key)
        entry = cache_dir() / key
        for attempt in range(2):
            if not _valid(entry, name):
                _build_entry(source, cdef, name, entry)  # replaces a broken entry atomically
            try:
                module = _import(name, entry / f"{name}{_ext_suffix()}")
                break
            except ImportError as err:
                if attempt:
                    raise LinrecError(f"the built C kernel for {label} does not load ({err}); the NumPy "
                                      f"backend (backend='numpy') still works") from None
                _discard(entry)
        try:
            (entry / "label").write_text(label, encoding="utf-8")
        except OSError:
            pass
        _loaded[key] = module
        return module


@lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """A hash of linrec's own code — every module and template of the installed package, the language and the
    compiler included: part of every alias key, so that any change to what generates a kernel's source
    rebuilds it, although a cached alias skips rendering that source."""
    package = __name__.split(".")[0]
    roots = {Path(str(importlib.resources.files(p))).resolve()
             for p in (package, f"{package}.dsl", f"{package}.compiler")}
    files = sorted({p.resolve() for root in roots for p in root.rglob("*")
                    if p.suffix in (".py", ".j2", ".lark") and p.is_file()})
    h = hashlib.sha256()
    for path in files:
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


# ---- `linrec cache info|clear` ------------------------------------------------------------------------
def alias_key(*parts: str) -> str:
    """A key for a kernel's inputs (program, sizes, dtype, code generator…) plus everything build_key
    covers except the source itself, for load_alias."""
    cc = compiler()
    import cffi
    fixed = [cc, _compiler_version(cc), " ".join(flags()), target_key(), VERSION, code_fingerprint(),
             sys.implementation.cache_tag or "",
             sysconfig.get_config_var("EXT_SUFFIX") or "", cffi.__version__]
    return hashlib.sha256("\0".join(list(parts) + fixed).encode()).hexdigest()


def _entries(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and len(p.name) == 64 and not p.name.startswith(".")]


def directory_bytes(path: Path) -> int:
    """The size of every file under `path` (files that vanish meanwhile count 0)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return total


def cache_info() -> dict:
    """{"dir": path, "entries": number of built kernels, "bytes": total size on disk}."""
    root = cache_dir()
    total = directory_bytes(root) if root.is_dir() else 0
    return {"dir": str(root), "entries": len(_entries(root)), "bytes": total}


def cache_clear() -> int:
    """Delete every cached kernel (and leftovers of interrupted builds); returns how many entries went."""
    root = cache_dir()
    if not root.is_dir():
        return 0
    n = 0
    for p in list(root.iterdir()):
        if p.is_dir():
            if p in _entries(root):
                n += 1
            _discard(p) if not p.name.startswith(".") else shutil.rmtree(p, ignore_errors=True)
    with _lock:
        _loaded.clear()
    return n


# The most threads a kernel is given: a larger count (LINREC_NUM_THREADS=99999999999, threads=10**6) is
# taken as this many. The kernels use at most one thread per (batch row, head) and never more than there is
# work for; past the cores, threads only take turns; and the count is a C int.
MAX_THREADS = 1024

# a thread count for the calls made inside `threads(n)` (Recurrence.run(threads=n)); None: the default rule
_thread_override: contextvars.ContextVar[int | None] = contextvars.ContextVar("linrec_threads", default=None)


@contextlib.contextmanager
def threads(n: int | None):
    """Run the compiled kernels called in this block on n threads (None: whatever holds around the block —
    an enclosing threads(m), else the default rule)."""
    if n is None:
        yield
        return
    if not isinstance(n, int) or n < 1:
        raise LinrecError(f"the thread count must be a positive integer, got {n!r}")
    token = _thread_override.set(min(n, MAX_THREADS))
    try:
        yield
    finally:
        _thread_override.reset(token)


def num_threads() -> int:
    """Threads for the compiled kernels: threads(n) around the call, else LINREC_NUM_THREADS, else every
    core this process may use; at most MAX_THREADS."""
    if _thread_override.get() is not None:
        return _thread_override.get()
    env = os.environ.get("LINREC_NUM_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise LinrecError(f"LINREC_NUM_THREADS must be a positive integer, got {env!r}")
        return min(n, MAX_THREADS)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1

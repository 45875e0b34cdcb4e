"""Build generated C through cffi (API mode) and cache the extensions on disk.

The cache lives in $LINREC_CACHE_DIR, else $XDG_CACHE_HOME/linrec, else ~/.cache/linrec:

    <cache>/<build key>/               one kernel: the extension, its C source, checksum.json, label, and
                aliases/<alias>        a record of each alias build() wrote for it (empty files)
    <cache>/aliases/<alias>            a cheap key (program, sizes, dtype, linrec's code …) → its entry's key
    <cache>/headers/<key>.h, .h.gch    the kernels' system headers, precompiled per compiler and flags (_prelude)
    <cache>/.tmp-*, .trash-*           builds in progress (locked) or interrupted, entries being deleted

The build key is sha256 of the generated source, the cffi declarations, the compiler's path and `--version`,
the flags, the target (architecture and CPU features), linrec's version, the Python ABI and cffi's version:
whatever changes the binary changes the key. An alias key stands for the source without rendering it: the
kernel's inputs plus the same build parameters, a hash of all of linrec's code and the versions of the
libraries that render the source. load_alias trusts an alias only when the entry it names records that alias
(written by the process that rendered the source and hashed it to that entry's key); else the caller renders
and builds, which puts the alias right.

Builds happen in a temporary directory inside the cache, locked (flock) while it is in use, and are renamed
into place atomically: two processes building the same kernel at once both succeed (the loser uses the
winner's entry), `cache clear` leaves locked builds alone, and a build whose directory vanishes all the same
starts again. An entry whose extension does not match its checksum (truncated, corrupted) is detected at load
time and rebuilt. A cache that cannot be written (a file in the way, read-only, a full disk) still serves the
kernels it holds; others are built in a temporary directory of the process's own, deleted at exit, with an
UnwritableCacheWarning that says to set LINREC_CACHE_DIR to a writable directory.
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import errno
import hashlib
import io
import importlib.metadata
import importlib.resources
import importlib.util
import json
import numbers
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import cffi
import numpy as np

from ..dsl.errors import LinrecError, RuntimeInputError

from ..version import VERSION
from . import fork

try:
    import fcntl  # advisory locks on build directories
except ImportError:  # Windows: no locks; a clear may then delete a build in progress, which starts again
    fcntl = None

# the scalar types the C kernels are built for: NumPy's dtype → the C type, and its bytes
CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
CTYPE_BYTES = {"float": 4, "double": 8}

_NO_COMPILER = ("no C compiler found ({looked}): the C backend needs one to build its kernels; install gcc "
                "(with OpenMP; and Python's headers, python3-dev on Debian or Ubuntu) or use the NumPy backend "
                "(backend='numpy'), which still works")
_BUILD_ATTEMPTS = 3  # builds of one kernel whose directory a concurrent clear deleted, before giving up
_loaded: dict[str, object] = {}  # build key → the extension loaded in this process
_lock = fork.Lock()  # (free in a forked child: fork.py)
_private: list[Path] = []  # this process's own kernel directory, once a cache could not be written
_warned: set[Path] = set()  # caches this process has warned about


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
    looked = f"CC={os.environ['CC']!r} is not on PATH; set CC to a compiler, or unset it" if os.environ.get("CC") \
        else "looked for cc, gcc and clang on PATH"
    raise LinrecError(_NO_COMPILER.format(looked=looked))


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
    """The compiler's flags: linrec's, the target's, then $LINREC_CFLAGS (extra flags, e.g. the sanitizers'
    in tests/test_sanitizers.py; part of every cache key like the rest)."""
    extra = os.environ.get("LINREC_CFLAGS", "")
    try:
        return _target_flags() + shlex.split(extra)
    except ValueError as err:  # (an unbalanced quote: shlex's "No closing quotation" was an internal error)
        raise LinrecError(f"LINREC_CFLAGS={extra!r} cannot be split into compiler flags ({err}); quote it as a "
                          f"shell would, or unset it") from None


def _target_flags() -> list[str]:
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
    cc = compiler()
    parts = [source, cdef, cc, _compiler_version(cc), " ".join(flags()), target_key(), VERSION,
             sys.implementation.cache_tag or "", sysconfig.get_config_var("EXT_SUFFIX") or "", cffi.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


# ---- build ------------------------------------------------------------------------------------------
def _module_name(key: str) -> str:
    return f"_linrec_{key[:24]}"


def _ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _is_key(text: str) -> bool:
    """A build or alias key: 64 hex digits (also what makes it safe as a file name)."""
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _compile(source: str, cdef: str, name: str, where: Path) -> Path:
    """cffi's API-mode extension for `source`, built in `where` from two objects compiled at once: the kernel
    (kernel.c, at -O3 for the target) and cffi's glue — the Python wrappers of the entry points `cdef` declares,
    which see them as prototypes. The glue needs neither -O3 nor the kernel's text, so while one core compiles
    the kernel the other compiles the glue: a build takes ~0.7 s of the ~1 s one file took. (cdef and the
    kernel's definitions are rendered from the same signatures, kernel_source.entry_points.)"""
    cc = compiler()
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source(name, "#include <stddef.h>\n#include <stdint.h>\n" + cdef)
    glue_c, kernel_c = where / f"{name}.c", where / "kernel.c"
    with contextlib.redirect_stdout(io.StringIO()):  # cffi says "generating …"
        ffi.emit_c_code(str(glue_c))
    kernel_c.write_text(source, encoding="utf-8")
    out = where / f"{name}{_ext_suffix()}"
    include = sysconfig.get_paths()["include"]
    fl = flags()
    glue_flags = ["-O1" if f == "-O3" else f for f in fl]  # (where $LINREC_CFLAGS sets a level, it still wins)
    # the kernel's symbols stay inside the extension: only the glue's PyInit_ is exported
    objects = [[cc, *fl, "-fvisibility=hidden", "-c", str(kernel_c), "-o", str(where / "kernel.o")],
               [cc, *glue_flags, "-I", include, "-c", str(glue_c), "-o", str(where / f"{name}.o")]]
    link = [cc, *fl, "-shared", str(where / "kernel.o"), str(where / f"{name}.o"), "-o", str(out), "-lm"]
    try:
        prelude, making = _prelude(cc, fl, where.parent)
        if prelude is not None:
            res = _failed(_run_together([objects[0][:1] + ["-include", str(prelude)] + objects[0][1:]] + objects[1:]))
            if res is not None:  # (a prelude deleted meanwhile by `cache clear`, or unreadable?): without it
                res = _failed(_run_together(objects))
                if res is None:  # it was the prelude: made again by the next build
                    prelude.with_name(prelude.name + ".gch").unlink(missing_ok=True)
        else:  # (the prelude precompiled beside the first build, for the next ones)
            done = _run_together(objects + ([making.command] if making else []))
            if making:
                making.finish(done[-1])
            res = _failed(done[:2])
        res = res or _failed(_run_together([link]))
        if res is not None and "-fopenmp" in fl and "omp" in (res.stderr or "").lower():
            # a compiler without OpenMP (e.g. Apple clang): build single-threaded, the pragmas are ignored
            serial = [[c for c in cmd if c != "-fopenmp"] for cmd in objects + [link]]
            res = _failed(_run_together(serial[:-1])) or _failed(_run_together(serial[-1:]))
    except (OSError, subprocess.SubprocessError) as err:
        raise LinrecError(f"could not run the C compiler {cc}: {err}; the NumPy backend (backend='numpy') "
                          f"still works") from None
    if res is not None:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-30:])
        raise LinrecError(f"building the C kernel failed ({' '.join(res.args[:1] + res.args[1:6])} …):\n{tail}\n"
                          f"The NumPy backend (backend='numpy') still works.")
    for obj in objects:  # (the cache keeps the sources and the extension)
        Path(obj[-1]).unlink(missing_ok=True)
    return out


# ---- the prelude: the kernels' system headers, precompiled -------------------------------------------------
# Every kernel starts with the same system headers, and under -march=native <immintrin.h> alone is ~62,000
# lines: parsing them was a quarter of a kernel's compile. The cache keeps them precompiled (GCC's .gch), once
# per compiler and flags, in <cache>/headers/, and each kernel is compiled with `-include` of them (a kernel's
# own #include of a header already read is then skipped by the header's guard). A precompiled header only saves
# time: GCC uses it when it fits the compilation and otherwise reads the text, and a compile that fails with it
# (say, a `cache clear` deleted it meanwhile) runs again without it. Any other compiler reads the text. The first
# build that finds it missing compiles without it, and precompiles it at the same time for the builds after.
PRELUDE = """\
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif
"""


@dataclass
class _Precompiling:
    """The prelude's precompiled form being made: the command, and the name it is written under until done."""
    command: list[str]
    part: Path
    compiled: Path

    def finish(self, result: subprocess.CompletedProcess) -> None:
        """Rename it into place (atomic: no process reads half of one), or drop it when the compiler failed (and
        do not ask that compiler again in this process)."""
        if result.returncode != 0:
            _cannot_precompile.add(self.compiled.name)
        try:
            if result.returncode == 0:
                os.replace(self.part, self.compiled)
            self.part.unlink(missing_ok=True)
        except OSError:
            pass


_cannot_precompile: set[str] = set()  # the preludes (by file name) this process's compiler failed to precompile


def _prelude(cc: str, fl: list[str], root: Path) -> tuple[Path | None, _Precompiling | None]:
    """(the prelude header in `root`/headers, when its precompiled form is there; else None, and how to make
    it: run beside the build that found it missing, for the builds after). (None, None) when it cannot be
    made (a cache that cannot be written): kernels then build without it. (Called under _lock, as every build
    is: one thread of a process makes it.)"""
    key = hashlib.sha256("\0".join([PRELUDE, cc, _compiler_version(cc), *fl, target_key()]).encode()).hexdigest()
    header = root / "headers" / f"{key}.h"
    compiled = header.with_name(header.name + ".gch")
    if compiled.is_file():
        return header, None
    if compiled.name in _cannot_precompile:
        return None, None
    try:
        header.parent.mkdir(exist_ok=True)
        part = header.with_name(f".{header.name}.{uuid.uuid4().hex}")
        part.write_text(PRELUDE, encoding="utf-8")
        os.replace(part, header)
    except OSError:
        return None, None
    part = compiled.with_name(f".{compiled.name}.{uuid.uuid4().hex}")
    return None, _Precompiling([cc, *fl, "-x", "c-header", str(header), "-o", str(part)], part, compiled)


def _run_together(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run the compiler commands at once; their results (output captured)."""
    running, done = [], []
    try:
        for cmd in commands:
            running.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in running:
            out, err = p.communicate(timeout=600)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in running:  # (a compiler that hung, or the one beside a command that could not start)
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def _failed(results: list[subprocess.CompletedProcess]) -> subprocess.CompletedProcess | None:
    """The first result of a command that failed, else None."""
    return next((r for r in results if r.returncode != 0), None)


def _valid(entry: Path, name: str) -> bool:
    so = entry / f"{name}{_ext_suffix()}"
    meta = entry / "checksum.json"
    try:
        info = json.loads(meta.read_text(encoding="utf-8"))
        return so.stat().st_size == info["size"] and _sha256_file(so) == info["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _delete_tree(path: Path) -> OSError | None:
    """shutil.rmtree: None when all of `path` went, else the first error (files another process deleted
    first are no error: two processes may delete the same leftovers)."""
    errors: list[OSError] = []

    def note(function, name, exc):  # exc: the exception (onexc), or sys.exc_info() (onerror)
        err = exc if isinstance(exc, BaseException) else exc[1]
        if not isinstance(err, FileNotFoundError):
            errors.append(err)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=note)
    else:
        shutil.rmtree(path, onerror=note)
    return errors[0] if errors else None


def _set_aside(path: Path) -> Path:
    """Rename a directory of the cache to a .trash-* name (atomic: no reader sees half an entry) and return
    the new path; OSError when it cannot be moved."""
    trash = path.parent / f".trash-{uuid.uuid4().hex}"
    os.rename(path, trash)
    return trash


def _discard(path: Path) -> None:
    """Move a broken entry out of the way and delete it, where the cache allows (else it stays: it is rebuilt
    or refused again later, never loaded unchecked)."""
    try:
        _delete_tree(_set_aside(path))
    except OSError:
        pass


def _lock_directory(path: Path) -> int | None:
    """An open descriptor of the directory `path` holding an exclusive advisory lock (released when closed),
    or None where there are no such locks (no fcntl; file systems that refuse flock on a directory)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def _build_in_progress(path: Path) -> bool:
    """Whether a build holds the lock of the temporary directory `path` (in this process or another)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (releases the lock, when this call took it)


@contextlib.contextmanager
def _build_directory(root: Path):
    """A new temporary directory in `root` for one build, locked for the block so that `cache clear` leaves
    it alone, and removed after it unless the build renamed it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    fd = _lock_directory(tmp)
    try:
        yield tmp
    finally:
        if tmp.exists():
            _delete_tree(tmp)
        if fd is not None:
            os.close(fd)


def _build_into(source: str, cdef: str, name: str, where: Path) -> None:
    so = _compile(source, cdef, name, where)
    (where / "checksum.json").write_text(json.dumps({"sha256": _sha256_file(so), "size": so.stat().st_size}),
                                         encoding="utf-8")


def _place(tmp: Path, entry: Path, name: str) -> bool:
    """Rename the finished build `tmp` to `entry` (atomic: readers see no entry or a whole one). True when
    `entry` then holds the kernel — this build, or the same kernel another process placed first; False when
    `tmp` vanished (build again); OSError when the cache refuses the rename."""
    for _ in range(5):
        try:
            os.rename(tmp, entry)
            return True
        except OSError as err:
            if not tmp.is_dir():
                return False
            if _valid(entry, name):
                return True  # someone else built the same kernel: use theirs
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            _discard(entry)  # a broken entry: replace it
    raise LinrecError(f"could not place the built kernel in the cache {entry.parent}: its entry {entry.name} "
                      f"was broken again each time; run `linrec cache clear`")


def _build_entry(source: str, cdef: str, name: str, entry: Path) -> None:
    """Build the kernel in a temporary directory beside `entry` and rename it into place. OSError: the cache
    cannot be written (not a directory, read-only, full)."""
    root = entry.parent
    for _ in range(_BUILD_ATTEMPTS):
        root.mkdir(parents=True, exist_ok=True)  # (again after a retry: someone may have deleted the whole cache)
        with _build_directory(root) as tmp:
            try:
                _build_into(source, cdef, name, tmp)
            except (OSError, LinrecError):
                if tmp.is_dir():
                    raise
                continue  # its directory was deleted under the build (a clear that saw no lock): build again
            if _place(tmp, entry, name):
                return
    raise LinrecError(f"the kernel cache {root} was emptied during each of {_BUILD_ATTEMPTS} builds of {name}; "
                      f"run again once nothing else clears it")


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    # (an extension module is loaded — dlopen, and with it the OpenMP runtime it links — by module_from_spec,
    # not by exec_module: the environment must be set around both)
    with _threads_that_sleep():
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


# ---- how OpenMP's threads wait ----------------------------------------------------------------------------
# OpenMP's runtime reads its settings from the environment once, when it is loaded into the process — with
# the first kernel, unless another library loaded it before. By default its threads spin for a while (GCC's
# libgomp: up to ~300000 pauses, milliseconds) at the end of a parallel region and between regions: on a core
# another program holds, that spinning takes that program's time, and a thread of the team that waits for
# such a core waits a whole time slice while its team-mate keeps the other core busy spinning (GLA's prefill
# took 4× its quiet time with one other program busy). So the first kernel loads with OMP_WAIT_POLICY=passive
# — waiting threads sleep at once; waking them costs a few µs, and the kernels start threads only for work
# that takes much longer (lr_threads_for) — unless the environment sets how OpenMP waits itself.
OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so")
_openmp_wait: list[str] = []  # how this process's OpenMP threads wait, once the first kernel loaded


def _openmp_runtime_loaded() -> bool:
    """Whether an OpenMP runtime the kernels link (GCC's or LLVM's) is in this process already."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any(line.rstrip().rsplit("/", 1)[-1] in OPENMP_RUNTIMES for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def _threads_that_sleep():
    """Around the first kernel's import: OMP_WAIT_POLICY=passive while it loads the OpenMP runtime (then the
    environment as it was: child processes get the user's), unless the environment sets how OpenMP waits or
    the runtime is loaded already (openmp_wait_policy says which)."""
    if _openmp_wait:
        yield
        return
    given = {v: os.environ[v] for v in OPENMP_WAIT_VARIABLES if v in os.environ}
    if given:
        _openmp_wait.append("as the environment sets it: " + ", ".join(f"{k}={v}" for k, v in given.items()))
        yield
    elif _openmp_runtime_loaded():
        _openmp_wait.append("the OpenMP runtime's default (it was loaded before linrec's first kernel, by another "
                            "library: its threads spin a while before they sleep; set OMP_WAIT_POLICY=passive "
                            "before starting Python to change that)")
        yield
    else:
        os.environ["OMP_WAIT_POLICY"] = "passive"
        try:
            yield
        finally:
            os.environ.pop("OMP_WAIT_POLICY", None)
        _openmp_wait.append("passive (set by linrec as the OpenMP runtime loaded with its first kernel): waiting "
                            "threads sleep at once")


def openmp_wait_policy() -> str:
    """How the OpenMP threads of the kernels wait in this process (set when the first kernel loads)."""
    return _openmp_wait[0] if _openmp_wait else "not known yet: no kernel has been loaded in this process"


def _load_or_build_in(root: Path, key: str, source: str, cdef: str, label: str):
    """The extension for `key` from the entry root/key, built there first when missing or broken."""
    name, entry = _module_name(key), root / key
    for attempt in range(2):
        if not _valid(entry, name):
            _build_entry(source, cdef, name, entry)  # replaces a broken entry atomically
        try:
            module = _import(name, entry / f"{name}{_ext_suffix()}")
            break
        except ImportError as err:  # (also an entry that another process's clear deleted since)
            if attempt:
                raise LinrecError(f"the built C kernel for {label} does not load ({err}); the NumPy "
                                  f"backend (backend='numpy') still works") from None
            _discard(entry)
    try:
        (entry / "label").write_text(label, encoding="utf-8")
    except OSError:
        pass  # the label only describes the entry in `linrec cache info`
    return module


# ---- a cache that cannot be written ---------------------------------------------------------------------
class UnwritableCacheWarning(RuntimeWarning):
    """The kernel cache cannot be written: kernels are built in a temporary directory for one process."""


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


def _file_in_the_way(root: Path) -> Path | None:
    """The file at `root` or at the nearest existing one of its parents, which stops `root` from being a
    directory; None when there is none."""
    for path in (root, *root.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def _why_unwritable(root: Path, err: OSError) -> str:
    blocker = _file_in_the_way(root)
    return f"{blocker} is a file, not a directory" if blocker is not None else _reason(err)


def cache_problem(root: Path) -> str | None:
    """What stops `root` from serving as the kernel cache (a phrase), or None when nothing seems to."""
    blocker = _file_in_the_way(root)
    if blocker is not None:
        return f"{blocker} is a file, not a directory"
    existing = next(p for p in (root, *root.parents) if p.exists())
    if existing == root:
        try:
            os.listdir(root)
        except OSError as err:
            return f"it cannot be read ({_reason(err)})"
    if not os.access(existing, os.W_OK | os.X_OK):  # (root may write anywhere but on a read-only file system)
        return "it is not writable" if existing == root else f"it cannot be created: {existing} is not writable"
    return None


def _private_dir() -> Path:
    """This process's own directory of kernels, for when the cache cannot be written: made once, in the
    system's temporary directory, and deleted at exit (OSError when it cannot be made)."""
    if not _private:
        path = Path(tempfile.mkdtemp(prefix="linrec-kernels-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _private.append(path)
    return _private[0]


def _warn_unwritable(root: Path, why: str, private: Path) -> None:
    if root in _warned:
        return  # once per cache and process, not once per kernel
    _warned.add(root)
    warnings.warn(f"linrec: the kernel cache {root} cannot be written ({why}): C kernels are built in {private} "
                  f"for this process only, and built again by the next; set LINREC_CACHE_DIR to a writable "
                  f"directory to keep them", UnwritableCacheWarning, stacklevel=4)


def _load_or_build(key: str, source: str, cdef: str, label: str):
    """The extension for `key` from the cache, else built into it; where the cache cannot be written (a file
    in the way, read-only, a full disk), built in this process's private directory, with a warning."""
    root = cache_dir()
    try:
        return _load_or_build_in(root, key, source, cdef, label)
    except OSError as err:
        why = _why_unwritable(root, err)
    try:
        private = _private_dir()
        module = _load_or_build_in(private, key, source, cdef, label)
    except OSError as err:
        raise LinrecError(f"cannot build the C kernel {label}: the kernel cache {root} cannot be written ({why}), "
                          f"nor a temporary directory ({_reason(err)}); set LINREC_CACHE_DIR to a writable "
                          f"directory with free space. The NumPy backend (backend='numpy') still works.") from None
    _warn_unwritable(root, why, private)
    return module


# ---- aliases: a kernel found without rendering its source ---------------------------------------------
def _alias_path(root: Path, alias: str) -> Path:
    return root / "aliases" / alias


def _alias_record(root: Path, key: str, alias: str) -> Path:
    """The entry's own record of an alias: written only by build(), in a process that rendered the source
    and hashed it to `key` — so an alias file that names another entry (tampered with, or left by another
    kernel) finds no record there."""
    return root / key / "aliases" / alias


def _aliased_key(root: Path, alias: str) -> str | None:
    """The key of the entry aliases/<alias> names, provided that the entry records the alias; else None."""
    if not _is_key(alias):
        return None
    try:
        key = _alias_path(root, alias).read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None
    if not _is_key(key) or not _alias_record(root, key, alias).is_file():
        return None
    return key


def load_alias(alias: str):
    """The extension an earlier build() recorded under `alias` (a cheap key for its source: the generated
    source need not even be rendered), or None when there is none, when its entry does not record the alias
    (then the caller renders the source and builds: build() puts the alias right), or when the entry is gone
    or broken."""
    root = cache_dir()
    key = _aliased_key(root, alias)
    if key is None:
        return None
    with _lock:
        if key in _loaded:
            return _loaded[key]
        name, entry = _module_name(key), root / key
        if not _valid(entry, name):
            return None
        try:
            module = _import(name, entry / f"{name}{_ext_suffix()}")
        except ImportError:
            return None
        _loaded[key] = module
        return module


def _record_alias(alias: str, key: str) -> None:
    """Record `alias` for the entry `key`: in the entry (what load_alias checks), then under aliases/ (where
    it looks). Only for an entry in the cache (not one built in a private directory)."""
    if not _is_key(alias):
        return
    root = cache_dir()
    path = _alias_path(root, alias)
    tmp = path.with_name(f".{alias}.{uuid.uuid4().hex}")
    try:
        record = _alias_record(root, key, alias)
        record.parent.mkdir(exist_ok=True)  # FileNotFoundError where the entry is not in the cache
        record.touch()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(key, encoding="ascii")
        os.replace(tmp, path)  # atomic: readers see the old key or the new one
    except OSError:
        pass  # an alias only saves rendering the source next time
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def build(source: str, cdef: str, label: str = "kernel", alias: str | None = None):
    """The loaded extension for `source` (its functions declared by `cdef`): from this process's memo,
    else from the disk cache (checksum verified), else built now. `alias`: also record it under this key."""
    key = build_key(source, cdef)
    with _lock:
        module = _loaded.get(key)
        if module is None:
            module = _loaded[key] = _load_or_build(key, source, cdef, label)
    if alias:
        _record_alias(alias, key)
    return module


# ---- what the aliases cover -----------------------------------------------------------------------------
def code_roots() -> list[Path]:
    """The folders of linrec's code: the package (driver, backends and their templates), its language and its
    compiler — one folder in an installed package, three in a development install; none inside another."""
    package = __name__.split(".")[0]
    roots = {Path(str(importlib.resources.files(p))).resolve()
             for p in (package, f"{package}.dsl", f"{package}.compiler")}
    return sorted(r for r in roots if not any(o != r and o in r.parents for o in roots))


def _code_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".py", ".j2", ".lark") and p.is_file())


def code_files() -> list[Path]:
    """Every module, template and grammar of linrec."""
    return [p for root in code_roots() for p in _code_files(root)]


def fingerprint(roots: list[Path]) -> str:
    """A hash of the code under `roots`: each file's path inside its root and its bytes."""
    h = hashlib.sha256()
    for root in roots:
        for path in _code_files(root):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


@lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """A hash of linrec's own code — every module and template of the installed package, the language and the
    compiler included: part of every alias key, so that any change to what generates a kernel's source
    rebuilds it, although a cached alias skips rendering that source."""
    return fingerprint(code_roots())


@lru_cache(maxsize=None)
def _renderers() -> str:
    """The versions of the libraries that shape a kernel's source besides linrec's code (Jinja renders the
    templates, NumPy's scalars print constants, Lark parses the program)."""
    versions = []
    for name in ("jinja2", "numpy", "lark"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} ?")
    return ", ".join(versions)


def alias_key(*parts: str) -> str:
    """A key for a kernel's inputs (program, sizes, dtype, code generator…) plus everything build_key
    covers except the source itself — and all that makes the source instead: linrec's code and the
    libraries that render it — for load_alias."""
    cc = compiler()
    fixed = [cc, _compiler_version(cc), " ".join(flags()), target_key(), VERSION, code_fingerprint(), _renderers(),
             sys.implementation.cache_tag or "",
             sysconfig.get_config_var("EXT_SUFFIX") or "", cffi.__version__]
    return hashlib.sha256("\0".join(list(parts) + fixed).encode()).hexdigest()


# ---- `linrec cache info|clear` ------------------------------------------------------------------------
def _entries(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if p.is_dir() and _is_key(p.name)]
    except OSError:  # missing, a file, unreadable (cache_problem says which)
        return []


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


def _clearable(path: Path) -> bool:
    """Whether `cache clear` deletes this directory of the cache: entries, aliases and the leftovers of builds
    and removals — nothing else (a cache directory set by mistake to a folder of other things keeps them)."""
    return _is_key(path.name) or path.name in ("aliases", "headers") or path.name.startswith((".tmp-", ".trash-"))


def _remove(path: Path) -> OSError | None:
    """Delete one directory of the cache; None, or the error that left (some of) it in place. Entries and
    aliases are first set aside atomically, so that no reader sees half of one."""
    if not path.name.startswith("."):
        try:
            path = _set_aside(path)
        except FileNotFoundError:
            return None  # another process removed it first
        except OSError as err:
            return err
    return _delete_tree(path)


def cache_clear() -> dict:
    """Delete every cached kernel, the aliases and the leftovers of interrupted builds, but no build another
    process (or thread) has in progress: {"removed": kernels deleted, "in_progress": [temporary directories
    left alone], "failed": [{"path", "error"}] — what could not be deleted, and why}."""
    root = cache_dir()
    result: dict = {"removed": 0, "in_progress": [], "failed": []}
    blocker = _file_in_the_way(root)
    if blocker is not None:
        raise LinrecError(f"cannot clear the kernel cache {root}: {blocker} is a file, not a directory (set "
                          f"LINREC_CACHE_DIR to a directory)")
    if not root.exists():
        return result
    try:
        children = sorted(root.iterdir())
    except OSError as err:
        raise LinrecError(f"cannot clear the kernel cache {root}: it cannot be read ({_reason(err)})") from None
    for path in children:
        if not path.is_dir() or not _clearable(path):
            continue
        if path.name.startswith(".tmp-") and _build_in_progress(path):
            result["in_progress"].append(path.name)
            continue
        err = _remove(path)
        if err is not None:
            result["failed"].append({"path": str(err.filename or path), "error": _reason(err)})
        if _is_key(path.name) and not path.exists():
            result["removed"] += 1
    with _lock:
        _loaded.clear()
    return result


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
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:  # (NumPy's integers are Integral)
        raise RuntimeInputError(f"the thread count must be a positive integer, got {n!r}")
    token = _thread_override.set(min(int(n), MAX_THREADS))
    try:
        yield
    finally:
        _thread_override.reset(token)


def num_threads() -> int:
    """Threads for the compiled kernels: threads(n) around the call, else LINREC_NUM_THREADS, else every
    core this process may use; at most MAX_THREADS. 1 in a process forked after its parent loaded kernels
    (_forked_after_kernels)."""
    if _forked_after_kernels:
        return 1
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


def thread_count(asked=None) -> int:
    """A kernel call's threads: `asked` (its num_threads argument, checked by the caller) or num_threads(); 1
    in a process forked after its parent loaded kernels (_forked_after_kernels)."""
    if asked is None or _forked_after_kernels:
        return num_threads()
    return int(asked)


# GNU OpenMP's threads do not survive a fork: in the child, the first parallel region of a team the parent had
# started waits for them forever. A process forked after its parent had loaded a kernel (and with it the OpenMP
# runtime, likely its team too) runs every kernel on one thread; 'spawn' and 'forkserver' workers keep theirs.
_forked_after_kernels = False


def _after_fork_in_child() -> None:
    global _forked_after_kernels
    _forked_after_kernels = _forked_after_kernels or bool(_loaded)


if hasattr(os, "register_at_fork"):  # (not on Windows, which has no fork)
    os.register_at_fork(after_in_child=_after_fork_in_child)

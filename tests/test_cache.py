"""The C backend's kernel cache under stress (issue 20, items 5 and 10): keys that cover all of linrec's code,
aliases verified against their entries, builds that survive a concurrent `linrec cache clear`, and caches
that cannot be written (a path under a file, a full disk, a read-only directory).

The tests run as root here, so chmod does not make a directory read-only: a cache path under a regular file
is a real unwritable cache; a full disk and a read-only file system are simulated by making the writes into
the cache raise OSError(ENOSPC) or OSError(EROFS).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import cffi
import pytest

from linrec.cli import main
from linrec.c import build as c_build
from linrec.dsl.errors import LinrecError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

PROGRAM = """\
recurrence NAME(dk = 3, dv = 9)
input q[dk], k[dk], v[dv], g[dk] <= 0
state S[dk, dv]
S = diag(exp(g))·S + k⊗v
output o = q·S
"""

# a child process: runs PROGRAM (renamed) at the sizes given with the C backend and prints its largest
# relative difference from the NumPy backend
_COMPARE = """\
import json, sys
import numpy as np
import linrec
name, dims = sys.argv[1], json.loads(sys.argv[2])
rec = linrec.compile(PROGRAM.replace("NAME", name))
x = rec.random_inputs(batch=1, tokens=6, heads=2, dims=dims, seed=3)
c = rec.run(x, form="recurrent", backend="c").outputs["o"]
n = rec.run(x, form="recurrent", backend="numpy").outputs["o"]
print(float(np.max(np.abs(c - n)) / np.max(np.abs(n))))
"""


def _compare_in_child(cache: Path, name: str, dims: dict, prelude: str = "", args=()) -> subprocess.Popen:
    code = f"PROGRAM = {PROGRAM!r}\n{prelude}\n{_COMPARE}"
    env = dict(os.environ, LINREC_CACHE_DIR=str(cache))
    return subprocess.Popen([sys.executable, "-c", code, name, json.dumps(dims), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(child: subprocess.Popen, timeout: float = 300) -> float:
    out, err = child.communicate(timeout=timeout)
    assert child.returncode == 0, err
    return float(out.strip().splitlines()[-1])


_counter = iter(range(1, 10 ** 6))


def _tiny(tag: str) -> tuple[str, str, int]:
    """A kernel of one function, lr_value() → a number of its own, and the source no other test builds."""
    n = next(_counter)
    return (f"/* {tag} {time.time_ns()} */\nint lr_value(void) {{ return {n}; }}\n", "int lr_value(void);", n)


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if len(p.name) == 64) if cache.is_dir() else []


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("LINREC_CACHE_DIR", str(path))
    return path


# ---- item 5: keys ------------------------------------------------------------------------------------
def test_the_code_fingerprint_covers_the_compiler_the_language_and_the_templates():
    files = {(p.parent.name, p.name) for p in c_build.code_files()}
    assert {("compiler", "identifiers.py"), ("compiler", "decompose.py"), ("dsl", "grammar.lark"),
            ("templates", "c_fused.c.j2"), ("templates", "module.py.j2"), ("c", "fused.py")} <= files


def test_a_change_to_a_compiler_module_changes_the_alias_key(tmp_path, monkeypatch):
    """The fingerprint of a copy of the package's code changes when one compiler module changes, and the alias
    keys follow the fingerprint: a kernel cached under the old code is not found by its alias."""
    copies = []
    for root in c_build.code_roots():
        copy = tmp_path / root.name
        shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(copy)
    before = c_build.fingerprint(copies)
    assert before == c_build.code_fingerprint()  # the same files: the same hash
    module = next(p for copy in copies for p in copy.rglob("identifiers.py") if p.parent.name == "compiler")
    module.write_text(module.read_text(encoding="utf-8") + "\n# a change\n", encoding="utf-8")
    after = c_build.fingerprint(copies)
    assert after != before

    key = c_build.alias_key("recurrent", "program", "sizes")
    monkeypatch.setattr(c_build, "code_fingerprint", lambda: after)
    assert c_build.alias_key("recurrent", "program", "sizes") != key


# ---- item 5: aliases verified ------------------------------------------------------------------------
def test_an_alias_pointing_at_another_entry_is_not_loaded(cache):
    source1, cdef1, n1 = _tiny("first")
    source2, cdef2, n2 = _tiny("second")
    alias1, alias2 = "a" * 64, "b" * 64
    assert c_build.build(source1, cdef1, "first", alias1).lib.lr_value() == n1
    assert c_build.build(source2, cdef2, "second", alias2).lib.lr_value() == n2
    assert c_build.load_alias(alias1).lib.lr_value() == n1
    key2 = (cache / "aliases" / alias2).read_text(encoding="ascii")
    (cache / "aliases" / alias1).write_text(key2, encoding="ascii")  # tampered: the second kernel's entry
    assert c_build.load_alias(alias1) is None
    assert c_build.load_alias(alias2).lib.lr_value() == n2
    # rendering and building again puts the alias right
    assert c_build.build(source1, cdef1, "first", alias1).lib.lr_value() == n1
    assert c_build.load_alias(alias1).lib.lr_value() == n1
    (cache / "aliases" / alias1).write_bytes(b"\xff\xfe not a key")
    assert c_build.load_alias(alias1) is None


def test_swapped_aliases_still_give_correct_results(tmp_path):
    """Two kernels of different sizes, their aliases pointed at each other's entries by hand: the next
    processes load neither wrong kernel (a crash, `malloc(): invalid size`, or wrong numbers before) but
    render, build and agree with NumPy."""
    cache = tmp_path / "cache"
    small, large = {"dk": 3, "dv": 9}, {"dk": 16, "dv": 33}
    assert _finish(_compare_in_child(cache, "swap", small)) < 1e-10
    aliases_small, entries_small = set((cache / "aliases").iterdir()), set(_entries(cache))
    assert _finish(_compare_in_child(cache, "swap", large)) < 1e-10
    aliases_large = set((cache / "aliases").iterdir()) - aliases_small
    entries_large = set(_entries(cache)) - entries_small
    assert aliases_small and aliases_large and entries_small and entries_large
    for alias in aliases_small:
        alias.write_text(next(iter(entries_large)).name, encoding="ascii")
    for alias in aliases_large:
        alias.write_text(next(iter(entries_small)).name, encoding="ascii")
    assert _finish(_compare_in_child(cache, "swap", small)) < 1e-10
    assert _finish(_compare_in_child(cache, "swap", large)) < 1e-10


# ---- item 10: concurrent clear -------------------------------------------------------------------------
_SLOW_BUILD = """\
import sys, time
from pathlib import Path
from linrec.c import build as c_build
_started, _go = Path(sys.argv[3]), Path(sys.argv[4])
_compile = c_build._compile
def _slow_compile(*args):
    _started.write_text(str(args[3]))  # the build's temporary directory
    deadline = time.time() + 120
    while not _go.exists() and time.time() < deadline:
        time.sleep(0.02)
    return _compile(*args)
c_build._compile = _slow_compile
"""


def test_clear_leaves_a_build_in_progress_alone(tmp_path):
    cache, started, go = tmp_path / "cache", tmp_path / "started", tmp_path / "go"
    child = _compare_in_child(cache, "slow", {"dk": 3, "dv": 9}, _SLOW_BUILD, (str(started), str(go)))
    try:
        deadline = time.time() + 120
        while not started.exists() and child.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert started.exists(), child.communicate()[1]
        building = Path(started.read_text())
        assert building.is_dir() and building.name.startswith(".tmp-")
        cleared = subprocess.run([sys.executable, "-m", "linrec", "cache", "clear"], cwd=ROOT, text=True,
                                 capture_output=True, env=dict(os.environ, LINREC_CACHE_DIR=str(cache)), timeout=120)
        assert cleared.returncode == 0, cleared.stderr
        assert "1 build in progress" in cleared.stdout
        assert building.is_dir()
    finally:
        go.touch()
    assert _finish(child) < 1e-10
    assert len(_entries(cache)) == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


def test_a_build_survives_its_directory_vanishing(cache, monkeypatch):
    """Where a build's directory is removed all the same (no lock: another system, a cleaner), the build
    starts again."""
    compile_ = c_build._compile
    calls = []

    def vanishing(source, cdef, name, where):
        calls.append(where)
        if len(calls) == 1:
            shutil.rmtree(where)
        return compile_(source, cdef, name, where)

    monkeypatch.setattr(c_build, "_compile", vanishing)
    source, cdef, n = _tiny("vanishing")
    assert c_build.build(source, cdef, "vanishing").lib.lr_value() == n
    assert len(calls) == 2 and len(_entries(cache)) == 1


def test_the_precompiled_prelude_saves_time_only(cache):
    """The kernels' system headers are precompiled once into <cache>/headers; a kernel compiled with them
    runs; a precompiled header that cannot be read (truncated) costs a second compile, not the build, and is
    deleted (made again by the next build); `cache clear` deletes them."""
    source, cdef, n = _tiny("prelude")
    assert c_build.build(source, cdef, "prelude").lib.lr_value() == n
    found = list((cache / "headers").glob("*.h.gch"))
    if not found:
        pytest.skip("the compiler made no precompiled header")
    (compiled,) = found
    from linrec.c import cache as c_cache
    data = c_cache.info()
    assert data["header_bytes"] == compiled.stat().st_size + (cache / "headers" / compiled.stem).stat().st_size
    assert "of it the kernels' precompiled headers" in c_cache.format_info(data)
    compiled.write_bytes(compiled.read_bytes()[:100_000])  # GCC refuses a truncated one outright
    source, cdef, n = _tiny("prelude-truncated")
    assert c_build.build(source, cdef, "prelude-truncated").lib.lr_value() == n
    assert not compiled.exists()
    source, cdef, n = _tiny("prelude-again")
    assert c_build.build(source, cdef, "prelude-again").lib.lr_value() == n
    assert compiled.stat().st_size > 100_000
    c_build.cache_clear()
    assert not (cache / "headers").exists()


def test_a_compiler_that_cannot_precompile_still_builds(cache, tmp_path, monkeypatch):
    """A compiler that fails to precompile the prelude: every kernel builds without it, and the process asks
    that compiler to precompile once, not at every build."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc")
    log = tmp_path / "precompiles.log"
    cc = tmp_path / "cc-without-pch"
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do if [ "$a" = c-header ]; then echo x >> {log}; '
                  f'echo "no precompiled headers" >&2; exit 1; fi; done\nexec {gcc} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    for tag in ("no-pch-1", "no-pch-2", "no-pch-3"):
        source, cdef, n = _tiny(tag)
        assert c_build.build(source, cdef, tag).lib.lr_value() == n
    assert not list((cache / "headers").glob("*.gch"))
    assert log.read_text().count("x") == 1


# ---- item 10: caches that cannot be written ----------------------------------------------------------
def _file_in_the_way(tmp_path: Path) -> Path:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file\n")
    return blocker


def test_a_cache_under_a_file_still_runs_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("LINREC_CACHE_DIR", str(_file_in_the_way(tmp_path) / "cache"))
    source, cdef, n = _tiny("under a file")
    with pytest.warns(RuntimeWarning, match=r"not-a-directory is a file.*LINREC_CACHE_DIR"):
        assert c_build.build(source, cdef, "under a file").lib.lr_value() == n


def test_cli_run_with_a_cache_that_is_a_file(tmp_path):
    """The whole command: exit status 0, the kernel built in a temporary directory that goes at exit, one
    warning that names the cache and the fix (exit status 2, an internal error, before)."""
    blocker = _file_in_the_way(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, LINREC_CACHE_DIR=str(blocker), TMPDIR=str(tmp))
    res = subprocess.run([sys.executable, "-m", "linrec", "run", str(EXAMPLES / "gla.lin"), "--backend", "c",
                          "--form", "recurrent", "--tokens", "3", "--dim", "dk=3", "--dim", "dv=7", "-q"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert str(blocker) in res.stderr and "LINREC_CACHE_DIR" in res.stderr and "internal error" not in res.stderr
    # one line, as the command's other messages (not Python's file:line and the source line that warned)
    assert res.stderr.splitlines() == [line for line in res.stderr.splitlines() if line.startswith("linrec: warning: ")]
    assert len(res.stderr.splitlines()) == 1, res.stderr
    assert blocker.read_text() == "a file\n"
    assert not list(tmp.iterdir())  # the private kernels removed at exit


def _enospc_under(root: Path, monkeypatch):
    """Writes of cffi's C file under `root` fail as on a full disk."""
    emit = cffi.FFI.emit_c_code

    def full(self, filename, *args, **kwargs):
        if str(filename).startswith(str(root)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return emit(self, filename, *args, **kwargs)

    monkeypatch.setattr(cffi.FFI, "emit_c_code", full)


def test_a_full_cache_disk_still_runs_the_kernel(cache, monkeypatch):
    _enospc_under(cache, monkeypatch)
    source, cdef, n = _tiny("full cache")
    with pytest.warns(RuntimeWarning, match="No space left on device.*LINREC_CACHE_DIR"):
        assert c_build.build(source, cdef, "full cache").lib.lr_value() == n
    assert not _entries(cache) and not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


def test_a_full_disk_everywhere_is_a_clear_error(tmp_path, cache, monkeypatch, capsys):
    _enospc_under(Path("/"), monkeypatch)
    source, cdef, _ = _tiny("full disk")
    with pytest.raises(LinrecError, match=r"No space left on device.*LINREC_CACHE_DIR"):
        c_build.build(source, cdef, "full disk")
    program = tmp_path / "fulldisk.lin"
    program.write_text(PROGRAM.replace("NAME", "fulldisk"), encoding="utf-8")
    assert main(["run", str(program), "--backend", "c", "--form", "recurrent", "--tokens", "2", "-q"]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "LINREC_CACHE_DIR" in err and "internal error" not in err


def _read_only(root: Path, monkeypatch):
    """Renames and removals under `root` fail as on a read-only file system (root ignores chmod)."""
    rename, rmdir, unlink = os.rename, os.rmdir, os.unlink

    def guard(fn):
        def wrapped(path, *args, **kwargs):
            if str(path).startswith(str(root)) or kwargs.get("dir_fd") is not None:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
            return fn(path, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(os, "rename", guard(rename))
    monkeypatch.setattr(os, "rmdir", guard(rmdir))
    monkeypatch.setattr(os, "unlink", guard(unlink))


def test_clear_on_a_read_only_cache_says_what_it_could_not_remove(cache, monkeypatch, capsys):
    source, cdef, _ = _tiny("read-only")
    c_build.build(source, cdef, "read-only", "d" * 64)
    (cache / ".tmp-leftover").mkdir()
    with monkeypatch.context() as patch:
        _read_only(cache, patch)
        assert main(["cache", "clear"]) == 1
    out, err = capsys.readouterr()
    assert "removed 0 entries" in out and "Read-only file system" in err and str(cache) in err
    assert len(_entries(cache)) == 1 and (cache / ".tmp-leftover").is_dir()
    assert main(["cache", "clear", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["removed"] == 1 and not data["failed"] and not _entries(cache)


def test_cache_commands_on_a_file(tmp_path, monkeypatch, capsys):
    blocker = _file_in_the_way(tmp_path)
    for path in (blocker, blocker / "cache"):
        monkeypatch.setenv("LINREC_CACHE_DIR", str(path))
        assert main(["cache", "info"]) == 1
        out, err = capsys.readouterr()
        assert f"{blocker} is a file" in out + err and "LINREC_CACHE_DIR" in err
        assert main(["cache", "info", "--json"]) == 1
        assert f"{blocker} is a file" in json.loads(capsys.readouterr().out)["problem"]
        assert main(["cache", "clear"]) == 1
        err = capsys.readouterr().err
        assert f"{blocker} is a file" in err and "internal error" not in err
    assert blocker.read_text() == "a file\n"


def test_cache_info_on_a_missing_and_an_unreadable_cache(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "missing"
    monkeypatch.setenv("LINREC_CACHE_DIR", str(missing))
    assert main(["cache", "info"]) == 0
    assert "does not exist yet" in capsys.readouterr().out
    missing.mkdir()
    listdir, scandir = os.listdir, os.scandir

    def unreadable(fn):
        def wrapped(path=".", *args):
            if str(path).startswith(str(missing)):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return fn(path, *args)
        return wrapped

    monkeypatch.setattr(os, "listdir", unreadable(listdir))
    monkeypatch.setattr(os, "scandir", unreadable(scandir))
    assert main(["cache", "info"]) == 1
    out, err = capsys.readouterr()
    assert "cannot be read" in out + err and "Permission denied" in out + err and "internal error" not in err

"""`linrec cache info|clear`: what the C backend's on-disk kernel cache holds, and emptying it.

Built on c_build (its cache_dir(), cache_info(), cache_problem() and cache_clear()); the layout is c_build's:

    <cache dir>/<64 hex digits>/    one built kernel: the extension (.so), its C sources, checksum.json, label,
                                    aliases/ (the aliases recorded for it)
    <cache dir>/aliases/<key>       a cheap key (program, sizes, dtype, generator …) → the entry's key
    <cache dir>/headers/            the kernels' system headers, precompiled (c_build._prelude)
    <cache dir>/.tmp-*, .trash-*    builds in progress (locked: clear leaves them), or leftovers of interrupted
                                    builds or removals

This module only reads the layout to describe it; building, validating and deleting stay in c_build.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from . import build as c_build

FIX = "set LINREC_CACHE_DIR to a writable directory"


def _is_entry(p: Path) -> bool:
    return p.is_dir() and len(p.name) == 64 and all(c in "0123456789abcdef" for c in p.name)


def _size(path: Path) -> int:
    return c_build.directory_bytes(path)


def _status(entry: Path) -> str:
    """"ok" when the extension matches checksum.json, else what is wrong (c_build rebuilds such an entry)."""
    try:
        info = json.loads((entry / "checksum.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "no checksum (interrupted?)"
    sos = [p for p in entry.iterdir() if p.name.startswith("_linrec_") and p.suffix in (".so", ".pyd", ".dylib")]
    if len(sos) != 1:
        return "no extension" if not sos else "several extensions"
    so = sos[0]
    try:
        if so.stat().st_size != info.get("size"):
            return "truncated or corrupted (size differs from checksum)"
        h = hashlib.sha256()
        with open(so, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return "ok" if h.hexdigest() == info.get("sha256") else "corrupted (checksum differs)"
    except OSError as err:
        return f"unreadable ({err.strerror or err})"


def _kernel(entry: Path, now: float) -> dict | None:
    """One entry described, or None when it vanished meanwhile (a clear in another process)."""
    try:
        label = (entry / "label").read_text(encoding="utf-8").strip()
    except OSError:
        label = "?"
    try:
        try:
            mtime = (entry / "checksum.json").stat().st_mtime
        except OSError:
            mtime = entry.stat().st_mtime
        status = _status(entry)
    except OSError:
        return None
    return {"key": entry.name, "label": label, "bytes": _size(entry), "age_s": max(0.0, now - mtime),
            "built": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime)), "status": status}


def _children(root: Path) -> list[Path]:
    try:
        return sorted(root.iterdir(), key=lambda q: q.name)
    except OSError:  # missing, a file or unreadable: info's "problem" says which
        return []


def info() -> dict:
    """{"dir", "exists", "problem", "entries", "bytes", "aliases", "leftovers", "header_bytes" (the precompiled
    headers, c_build._prelude), "kernels": [{key, label, bytes, age_s, built, status}]} — entries and bytes as c_build.cache_info() counts them; problem: what stops the
    directory from serving as the cache (None when nothing does)."""
    base = c_build.cache_info()
    root = Path(base["dir"])
    kernels, aliases, leftovers, headers = [], 0, [], 0
    now = time.time()
    for p in _children(root):
        if _is_entry(p):
            kernel = _kernel(p, now)
            if kernel is not None:
                kernels.append(kernel)
        elif p.name == "aliases" and p.is_dir():
            aliases = sum(1 for q in _children(p) if not q.name.startswith("."))
        elif p.name == "headers" and p.is_dir():
            headers = _size(p)
        elif p.name.startswith((".tmp-", ".trash-")):
            leftovers.append(p.name)
    kernels.sort(key=lambda k: k["age_s"])
    return {"dir": str(root), "exists": root.is_dir(), "problem": c_build.cache_problem(root),
            "entries": base["entries"], "bytes": base["bytes"], "aliases": aliases, "leftovers": leftovers,
            "header_bytes": headers, "kernels": kernels}


def clear() -> dict:
    """Delete every cached kernel, the aliases and leftovers, but not builds in progress in other processes:
    {"dir", "removed" (kernels), "bytes_freed", "in_progress" (builds left alone), "failed" ([{path, error}]:
    what could not be deleted)}."""
    before = c_build.cache_info()
    result = c_build.cache_clear()
    after = c_build.cache_info()
    return {"dir": before["dir"], "removed": result["removed"],
            "bytes_freed": max(0, before["bytes"] - after["bytes"]),
            "in_progress": result["in_progress"], "failed": result["failed"]}


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


def problem_message(data: dict) -> str:
    """The error for info()'s problem: what is wrong, what happens meanwhile and the fix."""
    held = " (the kernels the cache holds still load)" if data["entries"] else ""
    return (f"the kernel cache {data['dir']} cannot be used: {data['problem']}; the C backend builds kernels in "
            f"a temporary directory for each process{held}; {FIX}")


def format_info(data: dict) -> str:
    if data["problem"] and not data["exists"]:
        return f"cache: {data['dir']} ({data['problem']})\n0 entries, 0 bytes"
    if not data["exists"]:
        return f"cache: {data['dir']} (does not exist yet: no kernel built)\n0 entries, 0 bytes"
    lines = [f"cache: {data['dir']}" + (f" ({data['problem']})" if data["problem"] else ""),
             f"{data['entries']} entr{'y' if data['entries'] == 1 else 'ies'}, {human_bytes(data['bytes'])} "
             f"({data['bytes']} bytes) in total; {data['aliases']} alias(es)"
             + (f"; {human_bytes(data['header_bytes'])} of it the kernels' precompiled headers"
                if data.get("header_bytes") else "")
             + (f"; {len(data['leftovers'])} leftover(s) of interrupted builds" if data["leftovers"] else "")]
    if data["kernels"]:
        rows = [["key", "label", "size", "age", "built", "status"]]
        rows += [[k["key"][:16] + "…", k["label"], human_bytes(k["bytes"]), _age(k["age_s"]), k["built"], k["status"]]
                 for k in data["kernels"]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.rjust(w) if i in (2, 3) else c.ljust(w) for i, (c, w) in
                                   enumerate(zip(r, widths))).rstrip() for r in rows]
    return "\n".join(lines)


def format_clear(data: dict) -> str:
    n, busy = data["removed"], data["in_progress"]
    text = f"removed {n} entr{'y' if n == 1 else 'ies'} ({human_bytes(data['bytes_freed'])}) from {data['dir']}"
    if busy:
        text += (f"; left {len(busy)} build{'' if len(busy) == 1 else 's'} in progress alone (another process "
                 f"is building there)")
    return text


def failure_message(data: dict) -> str:
    """The error for what clear() could not delete: each path and why, and what to do."""
    failed = data["failed"]
    shown = "; ".join(f"{f['path']}: {f['error']}" for f in failed[:5]) + ("; …" if len(failed) > 5 else "")
    return (f"could not delete {len(failed)} item(s) of the kernel cache {data['dir']}, which stay: {shown}. "
            f"Clear it as a user who may write there; to use another cache, {FIX}")

"""`linrec cache info|clear`: what the C backend's on-disk kernel cache holds, and emptying it.

Built on c_build (its cache_dir(), cache_info() and cache_clear()); the layout is c_build's:

    <cache dir>/<64 hex digits>/    one built kernel: the extension (.so), its C sources, checksum.json, label
    <cache dir>/aliases/<key>       a cheap key (program, sizes, dtype, generator …) → the entry's key
    <cache dir>/.tmp-*, .trash-*    leftovers of interrupted builds or removals

This module only reads the layout to describe it; building, validating and deleting stay in c_build.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from . import build as c_build


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


def info() -> dict:
    """{"dir", "exists", "entries", "bytes", "aliases", "leftovers", "kernels": [{key, label, bytes, age_s,
    built, status}]} — entries and bytes as c_build.cache_info() counts them."""
    base = c_build.cache_info()
    root = Path(base["dir"])
    kernels, aliases, leftovers = [], 0, []
    now = time.time()
    if root.is_dir():
        for p in sorted(root.iterdir(), key=lambda q: q.name):
            if _is_entry(p):
                try:
                    label = (p / "label").read_text(encoding="utf-8").strip()
                except OSError:
                    label = "?"
                try:
                    mtime = (p / "checksum.json").stat().st_mtime
                except OSError:
                    mtime = p.stat().st_mtime
                kernels.append({"key": p.name, "label": label, "bytes": _size(p), "age_s": max(0.0, now - mtime),
                                "built": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime)),
                                "status": _status(p)})
            elif p.name == "aliases" and p.is_dir():
                aliases = sum(1 for q in p.iterdir() if not q.name.startswith("."))
            elif p.name.startswith((".tmp-", ".trash-")):
                leftovers.append(p.name)
    kernels.sort(key=lambda k: k["age_s"])
    return {"dir": str(root), "exists": root.is_dir(), "entries": base["entries"], "bytes": base["bytes"],
            "aliases": aliases, "leftovers": leftovers, "kernels": kernels}


def clear() -> dict:
    """Delete every cached kernel, the aliases and leftovers: {"dir", "removed" (kernels), "bytes_freed"}."""
    before = c_build.cache_info()
    removed = c_build.cache_clear()
    after = c_build.cache_info()
    return {"dir": before["dir"], "removed": removed, "bytes_freed": max(0, before["bytes"] - after["bytes"])}


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


def format_info(data: dict) -> str:
    if not data["exists"]:
        return f"cache: {data['dir']} (does not exist yet: no kernel built)\n0 entries, 0 bytes"
    lines = [f"cache: {data['dir']}",
             f"{data['entries']} entr{'y' if data['entries'] == 1 else 'ies'}, {human_bytes(data['bytes'])} "
             f"({data['bytes']} bytes) in total; {data['aliases']} alias(es)"
             + (f"; {len(data['leftovers'])} leftover(s) of interrupted builds" if data["leftovers"] else "")]
    if data["kernels"]:
        rows = [["key", "label", "size", "age", "built", "status"]]
        rows += [[k["key"][:16] + "…", k["label"], human_bytes(k["bytes"]), _age(k["age_s"]), k["built"], k["status"]]
                 for k in data["kernels"]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.rjust(w) if i in (2, 3) else c.ljust(w) for i, (c, w) in
                                   enumerate(zip(r, widths))).rstrip() for r in rows]
    return "\n".join(lines)

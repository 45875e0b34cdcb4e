"""The stack a kernel's calls use, read from its source, and the sizes refused for it.

The kernels keep a token's vectors on the stack (`T v1[1000];` from the printers: c.printer, c.block_region,
c.passes): cheap to make, but a size is a compile-time constant there, and a dimension of millions puts
megabytes in one frame, which overflows the thread's stack — a SIGSEGV, not an error. The threads the kernels
run on have the smallest stacks: OpenMP's workers and the decode step's helpers get the system's default thread
stack (glibc: the `ulimit -s` limit, usually 8 MiB, but 2 MiB when that is unlimited; libgomp sets no size of
its own unless OMP_STACKSIZE does), and a caller's own threads the same. So a kernel whose largest frame's
arrays exceed STACK_BUDGET, half of those 2 MiB (the rest: the frame's other locals, spills, libm and libgomp),
is refused when its source is rendered — KernelSource.source for the recurrent kernels (building, `linrec
emit`, the standalone export), scan_kernels.cached_kernel for the scan, elementwise and gradient ones — naming
the dimension that makes it so. (A kernel the cache finds by its alias is not rendered again: the code that
wrote the alias rendered and checked it, and the alias holds a hash of that code: c.build.) Moving the arrays
to the heap would lift the limit at a cost to every call of the common small sizes; the NumPy backend runs any
size.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..dsl.errors import LinrecError

STACK_BUDGET = 1 << 20  # bytes of local arrays one call's frame may hold (see above)
SMALLEST_THREAD_STACK = "2 MiB"  # (for the message: glibc's default thread stack under `ulimit -s unlimited`)

# comments and string or character literals: blanked before the source is read (braces and `T x[` in them)
_NOISE = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+([^\n]+)$", re.M)
# the start of a declaration of local arrays: `T v1[`, `const T x[` (_is_static: those are not on the stack)
_ARRAYS = re.compile(r"(?<![\w.>])(?:const\s+)?(T|float|double|uint16_t|int32_t|int64_t|int)\s+(?=\w+\s*\[)")
_DECLARATOR = re.compile(r"\s*(\w+)\s*((?:\[[^\]]*\]\s*)+)")
_BYTES = {"float": 4, "double": 8, "uint16_t": 2, "int32_t": 4, "int64_t": 8, "int": 4}


@dataclass(frozen=True)
class Frame:
    """One function's local arrays, (name, elements, bytes) each, and the functions of the file it calls."""

    function: str
    arrays: tuple[tuple[str, int, int], ...]
    calls: frozenset[str] = frozenset()

    @property
    def bytes(self) -> int:
        return sum(b for _, _, b in self.arrays)


def frames(source: str, ctype: str) -> list[Frame]:
    """The local arrays of each function the C source defines, with sizes the source fixes (literals and
    integer #defines; T is `ctype`). Arrays whose size it does not fix are left out: none is a dimension's."""
    text = _NOISE.sub(lambda m: " " * len(m.group(0)), source)
    macros = {name: value.strip() for name, value in _DEFINE.findall(text)}
    sizes = dict(_BYTES, T=_BYTES[ctype])
    out = []
    bodies = _function_bodies(text)
    defined = {name for name, _ in bodies}
    for name, body in bodies:
        arrays = []
        for m in _ARRAYS.finditer(body):
            if _is_static(body, m.start()):
                continue
            statement = body[m.end():body.find(";", m.end())]
            for declarator in _top_level_split(statement):
                d = _DECLARATOR.match(declarator.split("=", 1)[0])
                if d is None:
                    continue
                elements = 1
                for bound in re.findall(r"\[([^\]]*)\]", d.group(2)):
                    elements *= _integer(bound, macros) or 0
                if elements:
                    arrays.append((d.group(1), elements, elements * sizes[m.group(1)]))
        calls = frozenset(g for g in defined if g != name and re.search(rf"\b{g}\s*\(", body))
        out.append(Frame(name, tuple(arrays), calls))
    return out


def deepest(frames_: list[Frame]) -> Frame | None:
    """The chain of calls whose frames hold the most bytes of arrays together (a function, and the deepest
    chain among those it calls), as one Frame named "f → g"; None for a file without functions."""
    by_name = {f.function: f for f in frames_}
    memo: dict[str, Frame] = {}

    def chain(f: Frame, seen: frozenset[str]) -> Frame:
        if f.function not in memo:
            below = [chain(by_name[g], seen | {f.function}) for g in sorted(f.calls) if g not in seen]
            worst = max(below, key=lambda c: c.bytes, default=None)
            memo[f.function] = f if worst is None or not worst.bytes else \
                Frame(f"{f.function} → {worst.function}", f.arrays + worst.arrays)
        return memo[f.function]
    return max((chain(f, frozenset()) for f in frames_), key=lambda c: c.bytes, default=None)


def _function_bodies(text: str) -> list[tuple[str, str]]:
    """(name, body) of each function defined at file scope: a `{` at depth 0 after a `)`."""
    out, depth, start, header_from = [], 0, 0, 0
    for m in re.finditer(r"[{};]", text):
        c = m.group(0)
        if c == "{":
            if depth == 0:
                header = text[header_from:m.start()]
                start = m.end() if re.search(r"\)\s*(__attribute__\s*\(\(.*\)\)\s*)?$", header, re.S) else -1
                # (the name, not the attribute list before it: `static __attribute__((noinline)) void lr_gemm(`
                # was a function "__attribute__", and every such function one frame, the first one's)
                name = re.search(r"(\w+)\s*\(", _without_attributes(header))
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                if start >= 0 and name is not None:
                    out.append((name.group(1), text[start:m.start()]))
                header_from = m.end()
        elif depth == 0:
            header_from = m.end()
    return out


def _without_attributes(header: str) -> str:
    """A declaration's text without its `__attribute__((…))` lists (their parentheses balanced)."""
    out, at = [], 0
    for m in re.finditer(r"__attribute__\s*\(", header):
        if m.start() < at:
            continue
        depth, i = 1, m.end()
        while i < len(header) and depth:
            depth += {"(": 1, ")": -1}.get(header[i], 0)
            i += 1
        out.append(header[at:m.start()])
        at = i
    return "".join(out) + header[at:]


def _is_static(body: str, at: int) -> bool:
    """The declaration starting at `at` has static storage (not on the stack): `static` since the last statement."""
    return "static" in re.split(r"[;{}]", body[:at])[-1].split()


def _top_level_split(statement: str) -> list[str]:
    """A declaration's declarators: split at commas outside brackets and braces (`T a[4] = {0, 1}, b[4]`)."""
    parts, depth, last = [], 0, 0
    for i, c in enumerate(statement):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            parts.append(statement[last:i])
            last = i + 1
    return parts + [statement[last:]]


def _integer(expr: str, macros: dict[str, str], depth: int = 0) -> int | None:
    """An array bound's value: integer literals and #defines of them, with + − * / and parentheses."""
    if depth > 8:
        return None

    def value(m: re.Match) -> str:
        v = _integer(macros[m.group(0)], macros, depth + 1) if m.group(0) in macros else None
        return "x" if v is None else str(v)
    expr = re.sub(r"\b[A-Za-z_]\w*\b", value, expr)
    expr = re.sub(r"\b(\d+)[uUlL]+\b", r"\1", expr)
    if not expr.strip() or not re.fullmatch(r"[\d\s+\-*/()]+", expr) or "**" in expr:  # (C has no **)
        return None
    try:
        return int(eval(expr.replace("/", "//"), {"__builtins__": {}}))  # (digits and operators only)
    except (SyntaxError, ZeroDivisionError):
        return None


def check(source: str, ctype: str, dims: dict[str, int], lanes: int, what: str) -> None:
    """Refuse a kernel source whose largest frame's arrays exceed STACK_BUDGET, naming the dimension that
    makes them so, its size, the size that fits and what to do instead. `what`: the kernel, for the message."""
    frame = deepest(frames(source, ctype))
    if frame is None or frame.bytes <= STACK_BUDGET:
        return
    dim, powers = _culprit(frame, dims, lanes)
    mib = frame.bytes / 2**20
    if dim is None:  # (no dimension's size divides the arrays: say the bytes alone)
        raise LinrecError(f"with these sizes {what} would keep {mib:.1f} MiB of arrays on the stack of one call "
                          f"(in {frame.function}), above the {STACK_BUDGET >> 20} MiB the C kernels allow "
                          f"({_why()}); use the NumPy backend (backend='numpy'), or smaller sizes")
    size = dims[dim]
    vectors = sum(1 for p in powers if p)
    fits = _largest_fitting(frame, powers, size)
    arrays = f"{vectors} array{'s' if vectors > 1 else ''} of {dim} values"
    raise LinrecError(
        f"{dim} = {size} is too large for {what}: it would keep {mib:.1f} MiB of per-token arrays on the stack of "
        f"one call ({arrays}, in {frame.function}), above the {STACK_BUDGET >> 20} MiB the C kernels allow "
        f"({_why()}); {dim} up to {fits} fits with the other sizes as they are. Use the NumPy backend "
        f"(backend='numpy'), which runs any size, or a smaller {dim}")


def _why() -> str:
    return (f"a thread's stack can be as small as {SMALLEST_THREAD_STACK}: OpenMP's threads get the system's "
            f"default thread stack, unless OMP_STACKSIZE sets it")


def _culprit(frame: Frame, dims: dict[str, int], lanes: int) -> tuple[str | None, list[int]]:
    """The dimension most of the frame's bytes grow with, and the power of its size in each array's elements
    (_powers); None when no array's size is made of the dimensions'."""
    powers = [_powers(n, dims, lanes) for _, n, _ in frame.arrays]
    grown = {d: sum(b for (_, _, b), p in zip(frame.arrays, powers) if p.get(d)) for d in dims}
    dim = max(grown, key=lambda d: grown[d], default=None)
    if dim is None or not grown[dim]:
        return None, []
    return dim, [p.get(dim, 0) for p in powers]


def _powers(elements: int, dims: dict[str, int], lanes: int) -> dict[str, int]:
    """The sizes an array's elements are a product of, each with its power (dk·dv: one each; a row padded to
    `lanes`: its size rounded up). Tried largest first, so that m = 524288 is not taken for a power of dk = 16
    that happens to divide it; sizes up to `lanes` are left out (no such size fills a stack)."""
    out, n = {}, elements
    for dim, size in sorted(dims.items(), key=lambda kv: -kv[1]):
        if size <= lanes:
            continue
        for s in (size, -(-size // lanes) * lanes):
            while n % s == 0 and n >= s:
                n //= s
                out[dim] = out.get(dim, 0) + 1
    return out


def _largest_fitting(frame: Frame, powers: list[int], size: int) -> int:
    """The largest size of the dimension whose frame stays within STACK_BUDGET, each array's bytes scaled
    as its power of the size: a bisection, the bytes growing with the size."""
    def frame_bytes(x: int) -> float:
        return sum(b * (x / size) ** p for (_, _, b), p in zip(frame.arrays, powers))
    lo, hi = 0, size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if frame_bytes(mid) <= STACK_BUDGET:
            lo = mid
        else:
            hi = mid - 1
    return lo

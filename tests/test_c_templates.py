"""Rules the C templates keep that no numerical test can see.

A prefetch changes no value, so gcc counts a function whose only effect is prefetching as having none: a call
to it that is not inlined is deleted (at -O1 and above), with its prefetches. The recurrent backward's,
the chunkwise backward's and the scans' prefetches were all gone from their kernels so, while their comments
credited them — every result the same, only slower (the recurrent backward waited on memory for a quarter of
its time). So every template function that prefetches is always inlined, or does something else besides.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).resolve().parent.parent / "backends" / "c" / "templates"


def functions(source: str):
    """(name, declaration, body) of each function defined at the top level of a C source (template)."""
    for m in re.finditer(r"^static [^;{=]*?\b(lr_\w+)\s*\(([^;{]*?)\)\s*\{", source, re.M | re.S):
        depth, i = 1, m.end()
        while depth and i < len(source):
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            i += 1
        yield m.group(1), m.group(0), source[m.end():i - 1]


def only_prefetches(body: str) -> bool:
    """The body prefetches and has no other effect: no store through a pointer, no call but the prefetch
    builtin's and the address helpers' (an assignment to a local is no effect)."""
    if "__builtin_prefetch" not in body:
        return False
    code = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    code = re.sub(r"\b\w+\s*\*+\s*(const\s+)?\w+\s*=", "=", code)  # (a pointer's declaration writes nothing)
    writes = re.search(r"(\*\w+|\w+\[[^\]]*\]|->\w+)\s*(\+\+|--|[-+*/]?=(?!=))|\(\*\w+\)\s*\+\+", code)
    calls = {c for c in re.findall(r"\b(\w+)\s*\(", code) if not c.isupper()}  # (macros: LR_MIN)
    calls -= {"__builtin_prefetch", "for", "if", "while", "sizeof", "lr_at", "lr_row"}  # (lr_at, lr_row: addresses)
    return not writes and not calls


@pytest.mark.parametrize("template", sorted(p.name for p in TEMPLATES.glob("*.j2")))
def test_a_function_that_only_prefetches_is_always_inlined(template):
    source = (TEMPLATES / template).read_text()
    bad = [name for name, decl, body in functions(source)
           if only_prefetches(body) and "always_inline" not in decl]
    assert not bad, f"{template}: {bad} only prefetch; gcc deletes a call to such a function unless inlined"


def test_the_rule_finds_a_prefetching_function_that_may_not_be_inlined():
    source = ("static void lr_prefetch(const char *p, int n)\n{\n"
              "    for (int i = 0; i < n; ++i) __builtin_prefetch(p + 64 * i, 0, 2);\n}\n"
              "static inline void lr_counted(const char *p, int *next)\n{\n"
              "    __builtin_prefetch(p + 64 * (*next)++, 0, 2);\n}\n")
    found = {name: only_prefetches(body) for name, _, body in functions(source)}
    assert found == {"lr_prefetch": True, "lr_counted": False}

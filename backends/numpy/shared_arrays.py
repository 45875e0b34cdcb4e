"""Per-token arrays that a generated module computes more than once, computed once: the linear transformer's
φ(k) is the key of S and of its normalizer z, φ(q) the query of both, and each state's part of the module
wrote `per_token(elu_plus_one(k), …)` again (an elementwise pass over [B, T, H, dk] per copy).

    shared_per_token(lines)    the lines, each per_token(…) call that computes something (its first argument not
                               a bare name or number) and appears more than once bound to a name before the line
                               of its first use, every use reading the name

The lines are a function's body before it is indented into the module. A call is shared only where every line
it appears on is at the body's outer level (not inside an `if`, whose branch may not run), and no line from its
first appearance to its last assigns a name it reads (the same text would be another value after it). The scans
read the arrays they are handed and write none of them (a per_token of an input is that input itself), so one
array may serve several states.
"""
from __future__ import annotations

import ast
import re

from .adjoint_in_place import assigned_names


def shared_per_token(lines: list[str]) -> list[str]:
    uses: dict[str, list[int]] = {}  # a call's text → the lines it appears on (once per appearance)
    for j, line in enumerate(lines):
        for call in _computing_calls(line):
            uses.setdefault(call, []).append(j)
    shared = {call: at for call, at in uses.items()
              if len(at) > 1 and all(_outer(lines[j]) for j in at)
              and not _names_read(call) & set().union(*(_names_assigned(lines[j]) for j in range(at[0], at[-1] + 1)))}
    if not shared:
        return list(lines)
    taken = set(re.findall(r"[A-Za-z_]\w*", "\n".join(lines)))
    names = {}
    for call in sorted(shared, key=lambda c: shared[c][0]):
        names[call] = _name_for(call, taken)
        taken.add(names[call])
    first = {}
    for call, at in shared.items():
        first.setdefault(at[0], []).append(call)
    out = []
    for j, line in enumerate(lines):
        for call in first.get(j, ()):
            out.append(f"{names[call]} = {call}  # (read more than once below: computed once)")
        for call in sorted(shared, key=len, reverse=True):  # (a longer call may hold a shorter one)
            line = line.replace(call, names[call])
        out.append(line)
    return out


def _outer(line: str) -> bool:
    return not line.startswith((" ", "\t"))


def _parsed(line: str) -> ast.Module | None:
    code = line.strip()
    if not code or code.startswith("#"):
        return None
    try:
        return ast.parse(code)
    except SyntaxError:  # (a line of a block: `if …:`, `else:`)
        return None


def _names_read(call: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(call)) if isinstance(n, ast.Name)}


def _names_assigned(line: str) -> set[str]:
    tree = _parsed(line)
    return assigned_names(tree.body[0]) if tree is not None and tree.body else set()


def _computing_calls(line: str) -> list[str]:
    """The texts of the line's per_token(…) calls whose first argument computes something."""
    tree = _parsed(line)
    if tree is None:
        return []
    code, found = line.strip(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "per_token" \
                and node.args and not isinstance(node.args[0], (ast.Name, ast.Constant)):
            found.append(ast.get_source_segment(code, node))
    return found


def _name_for(call: str, taken: set[str]) -> str:
    """A name from the computed argument's text (`elu_plus_one(k)` → elu_plus_one_k), or `shared` where that text
    makes a long or unclear one; never one the module uses (then with _1, _2, … after it)."""
    argument = ast.get_source_segment(call, ast.parse(call).body[0].value.args[0])
    base = re.sub(r"\W+", "_", argument).strip("_")
    if not base or len(base) > 24 or not base[0].isalpha():
        base = "shared"
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name

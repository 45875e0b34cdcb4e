"""Products of a generated backward module computed in the memory of an array the module made and reads no
more, rather than in a new one: over [B, T, H, d] arrays each new array costs a pass over fresh pages
(page faults and the zeroing of every page, several times the arithmetic), and the chain rule makes one
per product. The module's lines are straight code (no loop), so "reads no more" is that no later line
names the array, nor a name that may hold it.

    in_place_products(lines, owned)    the lines, with `a op b` as in_place(a, "op", b) and `−a` as
                                       negated(a) (linrec.numpy.vjp) where `a` may be changed, and
                                       vjp_l2norm(x, g) as vjp_l2norm(x, g, out=g) where `g` may

An array may be changed at a line when the line reads it once, as an operand of the product, and

    it is a new array: an operator's result, an einsum, a vector–Jacobian product, l2norm, in_place's or
                       negated's — written in the line itself, or a name such a line assigned (at the top
                       level: not inside an `if`, whose other branch may have assigned it another array);
                       or a scan's gradient (`owned`: prefixes such as `S_grads.`, arrays of their own);
    it is read no more: no later line names it, nor any name a line before gave it to without consuming
                       it (an operator's or einsum's operand is consumed; an argument of another call, an
                       element of a list, a value assigned as it is may be the array itself).

Why a name's memory is its own: a name is a candidate only where assigned a new array, or the array of
in_place, negated or own_array, which take it over at the last read of the one before (own_array(a, …) of
an `a` that may be changed there); a name handed an array otherwise (`h = a`, `h = own_array(a, …)` with `a`
read on, `h = [a]`) is no candidate itself, and holds `a` (then read no more).
in_place itself goes on in the array only where the result keeps its shape and dtype, so the values are the
operator's in every case: the generated code is the same computation with fewer arrays.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize

# the calls whose result is an array the call made (never one of its arguments)
_NEW_ARRAY_CALLS = re.compile(r"^(np\.einsum|vjp_\w+|l2norm|in_place|negated)$")
_CONSUMING_CALLS = re.compile(r"^(np\.einsum|vjp_\w+|l2norm)$")  # (read their arguments, keep none)
# the helpers that may write their result into an argument (its position), which they read before writing
# each element of it: `out=` that argument where it may be changed
_WRITES_INTO = {"vjp_l2norm": 1}
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_COMMUTING = (ast.Add, ast.Mult)


def in_place_products(lines: list[str], owned: tuple[str, ...] = ()) -> list[str]:
    if any(re.match(r"\s*(for|while|def|with)\b", x) for x in lines):
        return list(lines)  # (not straight code: the pass does not apply)
    out = list(lines)
    codes = [split_comment(x.strip())[0] for x in lines]  # (comments name arrays too, and read none)
    made: set[str] = set()  # names a top-level line assigned a new array
    holders: dict[str, set[str]] = {}  # an array (a name or a scan's gradient) → names that may hold it
    for j, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        code, comment = split_comment(line.strip())
        try:
            stmt = ast.parse(code).body[0]
        except SyntaxError:
            continue
        targets = assigned_names(stmt)
        if line[0].isspace() or not isinstance(stmt, (ast.Assign, ast.AugAssign, ast.Expr)):
            made -= targets  # (assigned in a branch or a compound statement: not known to be new)
            _record_holders(stmt, targets, holders, owned)
            continue
        later = codes[j + 1:]
        # own_array(a, …) of an array a that may be changed here: the name is a's from now on (or a copy's)
        handed_over = _owned_copy(stmt.value) and \
            _free(stmt.value.args[0], stmt, later, made, holders, owned)
        rewriter = _Rewriter(lambda a: _free(a, stmt, later, made, holders, owned))
        value = stmt.value
        new_value = rewriter.visit(value)
        if rewriter.changed:
            stmt.value = new_value
            code = ast.unparse(stmt)
            out[j] = code + comment
            stmt = ast.parse(code).body[0]
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            made.add(name) if _new_array(stmt.value) or handed_over else made.discard(name)
        elif not isinstance(stmt, ast.AugAssign):  # (`a += b` changes a's own memory: a stays a candidate)
            made -= targets
        _record_holders(stmt, targets, holders, owned)
    return out


class _Rewriter(ast.NodeTransformer):
    """Bottom-up: a product whose operand may be changed becomes in_place(operand, op, other); a negation,
    negated(operand)."""

    def __init__(self, free):
        self.free, self.changed = free, False

    def visit_BinOp(self, node):
        self.generic_visit(node)
        if type(node.op) not in _OPS:
            return node
        sides = [(node.left, node.right)] + ([(node.right, node.left)] if isinstance(node.op, _COMMUTING) else [])
        # (a named array first: an intermediate of the statement is often the narrower operand, broadcast)
        for array, other in sorted(sides, key=lambda side: _new_array(side[0])):
            if self.free(array):
                self.changed = True
                return ast.Call(ast.Name("in_place"), [array, ast.Constant(_OPS[type(node.op)]), other], [])
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        index = _WRITES_INTO.get(ast.unparse(node.func))
        if index is not None and len(node.args) > index and not any(k.arg == "out" for k in node.keywords):
            array = node.args[index]
            # (a name or a scan's gradient, not an expression: `out=` names the array the argument gives)
            if isinstance(array, (ast.Name, ast.Attribute, ast.Subscript)) and self.free(array):
                self.changed = True
                node.keywords.append(ast.keyword("out", array))
        return node

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.USub) and self.free(node.operand):
            self.changed = True
            return ast.Call(ast.Name("negated"), [node.operand], [])
        return node


def _free(node, stmt, later: list[str], made: set[str], holders: dict[str, set[str]], owned) -> bool:
    """Whether the array `node` gives may be changed at this statement (the module's docstring)."""
    if _new_array(node):
        return True  # (an intermediate result of the statement itself)
    key = _array_key(node, owned)
    if key is None or (isinstance(node, ast.Name) and key not in made):
        return False
    # (what holds the array: holders of it, of what contains it — `h = S_grads` holds S_grads.writes[0][0] —
    # and theirs)
    others = set().union(*(_closure(k, holders) for k in _containers(key))) - {key}
    value = ast.unparse(stmt.value)
    if _count(key, value) != 1 or any(_count(h, value) for h in others):
        return False  # (read again in the statement itself, which may see it changed)
    if isinstance(stmt, ast.AugAssign) and assigned_names(stmt) & (others | {key}):
        return False  # (the target that is added to holds it)
    # (a name this statement assigns holds its new value from here on)
    assigned = assigned_names(stmt) - {key} if isinstance(stmt, ast.Assign) else set()
    return not any(_count(n, x) for n in ({key} | others) - assigned for x in later)


def _owned_copy(node) -> bool:
    """own_array(a, …): a itself or a copy of it."""
    return isinstance(node, ast.Call) and ast.unparse(node.func) == "own_array" and bool(node.args)


def _new_array(node) -> bool:
    """Whether the expression makes a new array (where it gives an array at all; in_place copes with a scalar):
    an operator over something other than constants, or a call of _NEW_ARRAY_CALLS."""
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS or \
            isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return any(isinstance(n, (ast.Name, ast.Call)) for n in ast.walk(node))
    if _owned_copy(node) and _new_array(node.args[0]):
        return True  # (the new array itself, or a copy)
    return isinstance(node, ast.Call) and bool(_NEW_ARRAY_CALLS.match(ast.unparse(node.func)))


def _array_key(node, owned) -> str | None:
    """A name, or a scan's gradient `S_grads.writes[0][0]` (owned), as the text that names the array."""
    if isinstance(node, ast.Name):
        return node.id
    text = ast.unparse(node)
    if owned and text.startswith(owned) and re.fullmatch(r"\w+(\.\w+|\[\d+\])+", text):
        return text
    return None


def _count(key: str, text: str) -> int:
    """The reads of the array `key` names in `text`: each use of its root name whose access path (`.x`, `[0]`)
    leads to it, or to what contains it (`S_grads` itself, or `S_grads.writes`), or into it."""
    root = re.match(r"\w+", key).group(0)
    paths = re.findall(rf"(?<![\w.\"']){root}(?!\w)((?:\.\w+|\[\d+\])*)", text)
    return sum(1 for p in paths if (root + p).startswith(key) or key.startswith(root + p))


def _containers(key: str) -> list[str]:
    """key and what contains it: S_grads.writes[0][0], S_grads.writes[0], S_grads.writes, S_grads."""
    parts = re.findall(r"^\w+|\.\w+|\[\d+\]", key)
    return ["".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _closure(key: str, holders: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [key]
    while todo:
        for h in holders.get(todo.pop(), ()):
            if h not in seen:
                seen.add(h)
                todo.append(h)
    return seen


def _record_holders(stmt, targets: set[str], holders: dict[str, set[str]], owned) -> None:
    """The names this statement assigns may hold every array it reads without consuming it."""
    if not targets:
        return
    for key in _kept(stmt.value if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.Expr)) else stmt, owned):
        holders.setdefault(key, set()).update(targets)


def _kept(node, owned) -> set[str]:
    """The arrays an expression may hand on as they are: every name or scan gradient in it that is not only an
    operand of an operator or of a call that consumes its arguments."""
    if node is None:
        return set()
    if isinstance(node, ast.AugAssign):  # (adds the value's elements: keeps none of its arrays)
        return set()
    if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp)):
        return set()
    if isinstance(node, ast.Call):  # (the arguments of a call that may hand one back as it is)
        if _CONSUMING_CALLS.match(ast.unparse(node.func)):
            return set()
        return set().union(*(_kept(a, owned) for a in [*node.args, *(k.value for k in node.keywords)]))
    key = _array_key(node, owned)
    if key is not None:
        return {key}
    found = set()
    if isinstance(node, ast.Subscript):  # (a view of the array)
        return _kept(node.value, owned)
    for child in ast.iter_child_nodes(node):
        found |= _kept(child, owned)
    return found


def assigned_names(stmt) -> set[str]:
    """The names a statement binds or changes: its targets, and the arrays a subscript or attribute of a target is
    assigned in."""
    nodes = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(
        stmt, (ast.AugAssign, ast.AnnAssign, ast.For)) else []
    return {n.id for t in nodes for n in ast.walk(t) if isinstance(n, ast.Name)}


def split_comment(code: str) -> tuple[str, str]:
    """(the code, its trailing comment with the spaces before it, or '')."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.COMMENT:
                start = tok.start[1]
                stripped = code[:start].rstrip()
                return stripped, code[len(stripped):]
    except (tokenize.TokenError, IndentationError):
        pass
    return code, ""

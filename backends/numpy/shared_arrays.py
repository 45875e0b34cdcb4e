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

    shared_calls(lines)        the lines, each call of a pure function (NumPy's, or a builtin of
                               linrec.numpy.runtime) that appears more than once, every time as an operand —
                               of an arithmetic operator or of another such call — bound to a name before the
                               line of its first use: the chain rule's copy of a value the forward computed
                               (Performer's features exp(W·x − |x|²/2), recomputed for their own derivative)

An operand is only read: the operator or the pure call makes a new array of it and keeps no reference, so the
bound array is never changed and no other name holds it (the later passes change in place only arrays that a
line made as an operator's or a vector–Jacobian product's result, adjoint_in_place). The same rules as above
keep a call's text one value (outer level, no name it reads assigned between its uses); a call that reads only
the sizes and the module's constants is left as it is (a scalar, as cheap to compute again).
"""
from __future__ import annotations

import ast
import inspect
import re

from . import runtime
from .adjoint_in_place import assigned_names, split_comment

# the builtins' functions (pure: a new array from their arguments, which they do not change)
_BUILTINS = frozenset(name for name, f in vars(runtime).items()
                      if inspect.isfunction(f) and f.__module__ == runtime.__name__ and name != "random_features")
# NumPy functions that change an argument or draw random numbers
_NOT_PURE = re.compile(r"^np\.(random\.|copyto$|put|place$|fill_diagonal$|\w+\.at$)")
# names of sizes and of the call's shape, which the prologue binds (dk = dims["dk"], batch, tokens, heads = …)
_SIZES = re.compile(r"^(\w+) = dims\[")


def shared_per_token(lines: list[str]) -> list[str]:
    uses: dict[str, list[int]] = {}  # a call's text → the lines it appears on (once per appearance)
    for j, line in enumerate(lines):
        for call in _computing_calls(line):
            uses.setdefault(call, []).append(j)
    shared = {call: at for call, at in uses.items() if _one_value(call, at, lines)}
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
            line = _replaced(line, call, names[call])
        out.append(line)
    return out


def _replaced(line: str, call: str, name: str) -> str:
    """The line with the call's text read as `name`: in its code, not its comment, and not where the text ends a
    longer name (sigmoid(beta) in logsigmoid(beta))."""
    indent = line[:len(line) - len(line.lstrip())]
    code, comment = split_comment(line.strip())
    return indent + re.sub(rf"(?<![\w.]){re.escape(call)}", lambda _: name, code) + comment


def _one_value(call: str, at: list[int], lines: list[str]) -> bool:
    """Whether a call's text that appears on lines `at` (more than once) is one value: every line at the body's
    outer level, and no line from the first to the last assigns a name the call reads."""
    return len(at) > 1 and all(_outer(lines[j]) for j in at) and not _names_read(call) & set().union(
        *(_names_assigned(lines[j]) for j in range(at[0], at[-1] + 1)))


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


def _operand_names(call: str) -> set[str]:
    """The names a call's text reads as values (not the functions it calls)."""
    tree = ast.parse(call)
    functions = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in functions}


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


def _name_for(call: str, taken: set[str], whole: list[str] | None = None) -> str:
    """A name from the computed argument's text (`elu_plus_one(k)` → elu_plus_one_k), or `shared` where that text
    makes a long or unclear one; `whole`: the names the call reads but sizes, for a name from the function and
    them (np.exp(g) → exp_g, np.exp(matvec(W, c·k) − …) → exp_W_k). Never one the module uses (then with _1,
    _2, … after it)."""
    tree = ast.parse(call).body[0].value
    if whole is not None:
        function = ast.unparse(tree.func).split(".")[-1]
        base = "_".join([function, *whole])
        base = base if len(base) <= 24 else function
    else:
        base = re.sub(r"\W+", "_", ast.get_source_segment(call, tree.args[0])).strip("_")
        if not base or len(base) > 24 or not base[0].isalpha():
            base = "shared"
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    return name


def shared_calls(lines: list[str]) -> list[str]:
    scalars = {"np", "float", "int", "dtype", "batch", "tokens", "heads"} | \
        {m.group(1) for m in map(_SIZES.match, lines) if m}
    lines = list(lines)
    taken = set(re.findall(r"[A-Za-z_]\w*", "\n".join(lines)))
    while True:  # one call at a time, the longest first (its inner calls then appear once, inside it)
        call, at = _longest_shared_call(lines, scalars)
        if call is None:
            return lines
        name = _name_for(call, taken, whole=sorted(_operand_names(call) - scalars))
        taken.add(name)
        # (replaced on the lines where it was found an operand only: elsewhere its text stays as it was)
        lines = lines[:at[0]] + [f"{name} = {call}  # (read more than once below: computed once)"] + \
            [_replaced(line, call, name) if j in at else line for j, line in enumerate(lines) if j >= at[0]]


def _longest_shared_call(lines: list[str], scalars: set[str]) -> tuple[str | None, list[int]]:
    uses: dict[str, list[int]] = {}  # a pure call's text → the lines it appears on, once per appearance
    others: set[str] = set()  # calls that appear somewhere other than as an operand
    for j, line in enumerate(lines):
        for call, operand in _pure_calls(line):
            (uses.setdefault(call, []).append(j) if operand else others.add(call))
    for call in sorted(uses, key=len, reverse=True):
        if call not in others and _operand_names(call) - scalars and _one_value(call, uses[call], lines):
            return call, uses[call]
    return None, []


def _pure_calls(line: str) -> list[tuple[str, bool]]:
    """The texts of the line's calls of pure functions, each with whether it is an operand (of an arithmetic
    operator, or an argument of another pure call): only read, its array held by nothing the line makes."""
    tree = _parsed(line)
    if tree is None:
        return []
    code, found = line.strip(), []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _pure(node):
            parent = parents.get(node)
            operand = isinstance(parent, (ast.BinOp, ast.UnaryOp)) or \
                (isinstance(parent, ast.Call) and _pure(parent) and node in parent.args)
            found.append((ast.get_source_segment(code, node), operand))
    return found


def _pure(call: ast.Call) -> bool:
    name = ast.unparse(call.func)
    if any(k.arg == "out" for k in call.keywords):
        return False
    return name in _BUILTINS or (name.startswith("np.") and not _NOT_PURE.match(name))

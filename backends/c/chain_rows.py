"""The C backward's chain rule over the tokens' rows in one pass of C: consecutive statements of the generated
module that each make or add to a [B, T, H, *] array (or a param's gradient, summed over the tokens) from
arithmetic on arrays, run as one loop over the (batch row, token, head) rows instead of NumPy's pass and array per
operation (docs/gradients.md, "Beyond the kernels").

    fused_lines(lines)                  the module's lines with such runs of statements as chain_rows calls
    chain_rows(source, scope, helpers)  runs them: their new bindings, in the order of chain_targets(source)

A run is found in the module's text (as numpy.adjoint_in_place finds its products), so it is the generated
NumPy statements themselves, written once, that the module hands over:

    d_D, d_x = chain_rows('''
        d_D += unbroadcast(np.einsum('...i,...i->...', d_y, x), d_D.shape)
        d_x = own_array(d_y * D[..., None], x.shape, x.dtype, True)
    ''', locals(), {"own_array": own_array, "unbroadcast": unbroadcast, "np": np})

chain_rows parses them once (a Program), evaluates their operands (`leaves`: names, attributes, calls that write
nothing — a NumPy pass each, as before), infers every value's shape as NumPy would broadcast it, and runs a C
kernel specialized for the statements' structure and dtype; where it does not take them — another dtype, a shape
that is not rows of the tokens, an operand whose last axis is neither contiguous nor broadcast — it runs the
statements as NumPy would (exec), so the values are NumPy's in every case (rounded once per operation the same
way; a row's sums, NumPy's einsum, in double here).

The statements a run takes: `name = own_array(value, shape, dtype, keep)` and `name = value` (a new array),
`name += value`, `name -= value` (an array of the rows, changed in place), and `name += unbroadcast(value,
name.shape)` (a param's gradient: summed over the rows in double, per thread, then added). A value is numbers
and operands under + − × ÷, negation, in_place and negated (their arithmetic: C changes nothing in place),
`np.einsum('...i,...i->...', a, b)` and `np.einsum('...i->...', a)` (a row's dot product and sum), and `[..., None]`.
Every statement runs row by row in the order written, so a later statement reads what an earlier one wrote to
the same row, as it reads it after NumPy's whole pass.

The kernel (templates/c_chain_rows.c.j2) takes each operand as a pointer with its strides over (batch row,
token, head) and one over the row's values, 0 (broadcast) or 1, built into the kernel; the rows are split over
the threads as linrec.c.rows splits its rows (rows.row_threads).
"""
from __future__ import annotations

import ast
import builtins
import textwrap
from dataclasses import dataclass

import numpy as np

from ..numpy.adjoint_in_place import assigned_names, split_comment
from ..templating import environment
from ..version import VERSION
from . import fork
from .build import CTYPES
from .grad_calls import gradient_array
from .rows import row_threads
from .scan_kernels import cached_kernel

# A run whose widest statement has fewer values than this (rows × the row's values) runs in NumPy: the kernel's
# call costs ~0.1 ms of Python, about what a few NumPy passes over [B, T, H] numbers take (gated DeltaNet's
# scalars per token at T = 4096, H = 8: 32K values; Mamba-2's rows at d = 64: 2M)
MIN_ROW_VALUES = 1 << 18
LAYOUTS = 64  # the layouts a run keeps (one per shapes and strides of its arrays: a training run has a few)

# the calls a value is made of (the rest of a value are operands, evaluated as they are)
_STRUCTURE = {"own_array", "unbroadcast", "in_place", "negated", "np.einsum"}
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_ROW_DOT, _ROW_SUM = "...i,...i->...", "...i->..."


# ---- the statements as a tree ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Leaf:
    """An operand: code evaluated as it is (a name, an attribute, a number of sizes, a call that writes nothing),
    or `target`: a new array an earlier statement of the run made (read row by row as the run writes it)."""
    code: str
    target: bool = False


@dataclass(frozen=True)
class Const:
    value: float


@dataclass(frozen=True)
class Bin:
    op: str
    left: object
    right: object


@dataclass(frozen=True)
class Neg:
    operand: object


@dataclass(frozen=True)
class RowDot:
    """einsum('...i,...i->...', a, b), or with b None einsum('...i->...', a): a row's sum, in double."""
    a: object
    b: object | None


@dataclass(frozen=True)
class Expand:
    """x[..., None]: a value per row, broadcast along the row's values."""
    operand: object


@dataclass(frozen=True)
class Statement:
    kind: str       # "new" (own_array or a plain assignment), "add", "sub" (in place), "param" (unbroadcast)
    target: str
    value: object
    sign: str = "+"  # a param's: += or -=
    shape: str | None = None  # own_array's shape and dtype (code)
    dtype: str | None = None
    text: str = ""


class NotTaken(Exception):
    """A statement (or at run time, its arrays) that a run does not take."""


def _writes_into_an_array(e: ast.AST) -> bool:
    """Whether evaluating e may write into an array it reads: in_place, negated, or a call given out=."""
    return any(isinstance(n, ast.Call) and (ast.unparse(n.func) in ("in_place", "negated")
                                            or any(k.arg == "out" for k in n.keywords)) for n in ast.walk(e))


def _writes_nothing(e: ast.AST) -> bool:
    """Whether e is an operand's code as it is: it writes into no array, and calls none of the calls a value's
    structure is made of."""
    return not _writes_into_an_array(e) and not any(
        isinstance(n, ast.Call) and ast.unparse(n.func) in _STRUCTURE
        or isinstance(n, (ast.Lambda, ast.NamedExpr, ast.Yield, ast.Await, ast.comprehension)) for n in ast.walk(e))


def _is_none_axis(s: ast.AST) -> bool:
    """The subscript `[..., None]`."""
    return isinstance(s, ast.Tuple) and len(s.elts) == 2 and isinstance(s.elts[0], ast.Constant) and \
        s.elts[0].value is Ellipsis and isinstance(s.elts[1], ast.Constant) and s.elts[1].value is None


class _Parser:
    """The statements of a run as trees; `new`: the names earlier statements made (read as targets), `params`:
    the params' gradients they added to (which no later statement may read: they hold partial sums)."""

    def __init__(self):
        self.new: set[str] = set()
        self.written: set[str] = set()
        self.params: set[str] = set()
        # whether a statement so far changed in place an array made before the run, which another name may hold:
        # an operand computed from arrays (a call) is evaluated before the run, and would not see the change
        self.changed_in_place = False

    def copy(self) -> "_Parser":
        other = _Parser()
        other.new, other.written, other.params = set(self.new), set(self.written), set(self.params)
        other.changed_in_place = self.changed_in_place
        return other

    def statement(self, stmt: ast.stmt, text: str) -> Statement:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            target, v = stmt.targets[0].id, stmt.value
            if isinstance(v, ast.Call) and ast.unparse(v.func) == "own_array" and len(v.args) == 4 and \
                    not v.keywords:
                s = Statement("new", target, self.value(v.args[0]), shape=ast.unparse(v.args[1]),
                              dtype=ast.unparse(v.args[2]), text=text)
            else:
                s = Statement("new", target, self.value(v), text=text)
            if isinstance(s.value, Leaf):
                raise NotTaken("an array as it is: nothing to compute")
            if target in self.written:
                raise NotTaken("a name made again")
            self.new.add(target)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and \
                type(stmt.op) in (ast.Add, ast.Sub):
            target, v, sign = stmt.target.id, stmt.value, _OPS[type(stmt.op)]
            if isinstance(v, ast.Call) and ast.unparse(v.func) == "unbroadcast":
                if len(v.args) != 2 or v.keywords or ast.unparse(v.args[1]) != f"{target}.shape":
                    raise NotTaken("unbroadcast to another shape")
                if target in self.new:
                    raise NotTaken("a param's gradient made in the run")
                s = Statement("param", target, self.value(v.args[0]), sign=sign, text=text)
                self.params.add(target)
            else:
                if target in self.params:
                    raise NotTaken("a param's gradient added to as an array")
                s = Statement("add" if sign == "+" else "sub", target, self.value(v), text=text)
                self.changed_in_place |= target not in self.new
        else:
            raise NotTaken("not an assignment the run takes")
        self.written.add(s.target)
        return s

    def value(self, e: ast.AST):
        if isinstance(e, ast.Constant) and isinstance(e.value, (int, float)) and not isinstance(e.value, bool):
            return Const(float(e.value))
        if isinstance(e, ast.BinOp) and type(e.op) in _OPS:
            return Bin(_OPS[type(e.op)], self.value(e.left), self.value(e.right))
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.USub, ast.UAdd)):
            inner = self.value(e.operand)
            return Neg(inner) if isinstance(e.op, ast.USub) else inner
        if isinstance(e, ast.Call):
            f = ast.unparse(e.func)
            if f == "in_place" and len(e.args) == 3 and not e.keywords and isinstance(e.args[1], ast.Constant) \
                    and e.args[1].value in ("+", "-", "*", "/"):
                return Bin(e.args[1].value, self.value(e.args[0]), self.value(e.args[2]))
            if f == "negated" and len(e.args) == 1 and not e.keywords:
                return Neg(self.value(e.args[0]))
            if f == "np.einsum" and e.args and isinstance(e.args[0], ast.Constant) and not e.keywords:
                spec, operands = e.args[0].value, e.args[1:]
                if spec == _ROW_DOT and len(operands) == 2:
                    return RowDot(self.value(operands[0]), self.value(operands[1]))
                if spec == _ROW_SUM and len(operands) == 1:
                    return RowDot(self.value(operands[0]), None)
                raise NotTaken(f"einsum {spec!r}")
        if isinstance(e, ast.Subscript) and _is_none_axis(e.slice) and not self._operand(e.value):
            return Expand(self.value(e.value))
        if self._operand(e):
            names = {n.id for n in ast.walk(e) if isinstance(n, ast.Name)}
            bare = e if isinstance(e, ast.Name) else e.value if isinstance(e, ast.Subscript) and \
                isinstance(e.value, ast.Name) and _is_none_axis(e.slice) else None
            if bare is not None and bare.id in self.written:
                if bare.id in self.params:
                    raise NotTaken("a param's gradient read while the run sums it")
                if bare.id in self.new:  # (the array the run made, read row by row as it writes it)
                    leaf = Leaf(bare.id, target=True)
                    return leaf if bare is e else Expand(leaf)
                return Leaf(ast.unparse(e))  # (an array changed in place: the same array, read as it is changed)
            if names & self.written:  # (evaluated before the run, it would see what was there before)
                raise NotTaken("an operand computed from what the run writes")
            if self.changed_in_place and any(isinstance(n, (ast.Call, ast.BinOp)) for n in ast.walk(e)):
                raise NotTaken("an operand computed after an array was changed in place")
            return Leaf(ast.unparse(e))
        raise NotTaken(f"no C for {ast.unparse(e)}")

    @staticmethod
    def _operand(e: ast.AST) -> bool:
        """Whether e is an operand as it is: a name, an attribute or a subscript of one, or a call that writes
        nothing (not one of the calls a value is made of)."""
        if isinstance(e, ast.Call):
            return ast.unparse(e.func) not in _STRUCTURE and _writes_nothing(e)
        if isinstance(e, (ast.Name, ast.Attribute)):
            return _writes_nothing(e)
        if isinstance(e, ast.Subscript):
            return _Parser._operand(e.value) and _writes_nothing(e.slice)
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Pow):  # (a power of sizes: dk ** (-1.0 / 2.0))
            return _writes_nothing(e)
        return False


def _statements(source: str) -> list[Statement]:
    parser = _Parser()
    out = []
    for line in textwrap.dedent(source).splitlines():
        code = split_comment(line.strip())[0]
        if not code:
            continue
        out.append(parser.statement(ast.parse(code).body[0], code))
    return out


def chain_targets(source: str) -> list[str]:
    """The names a run binds, in the order they are first written."""
    return list(dict.fromkeys(s.target for s in _statements(source)))


# ---- the module's lines ---------------------------------------------------------------------------------------
def _names(code: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}


def _helpers(source: str) -> list[str]:
    """The module's names the statements call (and `np`): handed to chain_rows by name, so that what reads the
    module's code (the merging of a staged program's modules, which keeps and renames its imports) sees them."""
    tree = ast.parse(textwrap.dedent(source))
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    numpy = any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "np"
                for n in ast.walk(tree))
    return sorted(called - set(dir(builtins))) + (["np"] if numpy else [])


def _movable(code: str, parser: _Parser, reads: set[str]) -> bool:
    """Whether a line may run before the run's statements so far: an assignment that changes no array in place
    (no in_place, negated, out=), names nothing the run writes, binds nothing the run reads, and the run has
    changed in place no array made before it (which the line may read under another name) — a param's gradient
    aside, the module's own zeros that only its name reaches. (The module's other calls write into no argument:
    the kernels' take their inputs and give new arrays.)"""
    try:
        stmt = ast.parse(code).body[0]
    except SyntaxError:
        return False
    if not isinstance(stmt, ast.Assign) or parser.changed_in_place or _writes_into_an_array(stmt):
        return False  # (a bare call may write into its arguments)
    return not (_names(code) & parser.written) and not (assigned_names(stmt) & reads)


HELPERS = frozenset({"chain_rows"})  # (what a module that calls it imports from here)


def fused_body(emitter, lines: list[str]) -> list[str]:
    """A C backward emitter's body with its runs as chain_rows calls (fused_lines), and chain_rows among the
    helpers the module imports where it calls it."""
    lines = fused_lines(lines)
    if any(' = chain_rows("""' in x for x in lines):
        emitter.helpers |= HELPERS
    return lines


def fused_lines(lines: list[str]) -> list[str]:
    """The module's lines with each run of statements chain_rows takes as one chain_rows call. A run goes on past
    a line it does not take where that line may run before it (_movable: the kernel's call between the outputs'
    adjoints and the per-token arrays', say), which then stands before the call. A line inside a block, or one
    that opens a block, ends a run."""
    out: list[str] = []
    run: list[str] = []  # the run's lines (its statements and the comments before them)
    moved: list[str] = []  # lines that now run before it
    held: list[str] = []  # comments (and blank lines) waiting for the line they come before
    parser, reads = _Parser(), set()

    def close():
        nonlocal run, moved, parser, reads
        out.extend(moved)
        if parser.written:
            targets = chain_targets("\n".join(run))
            out.append(", ".join(targets) + ("," if len(targets) == 1 else "") + ' = chain_rows("""')
            out.extend("    " + x if x.strip() else "" for x in run)
            out.append('""", locals(), {' + ", ".join(f'"{h}": {h}' for h in _helpers("\n".join(run))) + "})")
        run, moved, parser, reads = [], [], _Parser(), set()

    for line in lines:
        stripped = line.strip()
        top = not line[:1].isspace()
        if top and (not stripped or stripped.startswith("#")):
            held.append(line)
            continue
        code = split_comment(stripped)[0]
        statement, trial = None, parser.copy()
        if top and not code.endswith(":"):
            try:
                statement = trial.statement(ast.parse(code).body[0], code)
            except (NotTaken, SyntaxError, IndexError):
                statement = None
        if statement is not None:
            parser = trial
            reads |= _names(code) - {statement.target}
            run.extend(held + [line])
        elif parser.written and top and not code.endswith(":") and _movable(code, parser, reads):
            moved.extend(held + [line])
        else:
            close()
            out.extend(held + [line])
        held = []
    close()
    return out + held


# ---- running a run ----------------------------------------------------------------------------------------------
class _Program:
    """A run's statements, parsed once, and its NumPy statements compiled for exec."""

    def __init__(self, source: str):
        self.source = textwrap.dedent(source)
        self.code = compile(self.source, "<chain_rows>", "exec")
        self.statements = _statements(self.source)
        self.targets = list(dict.fromkeys(s.target for s in self.statements))
        self.leaves: list[str] = []  # the operands' code, each once
        for s in self.statements:
            for leaf in _leaves(s.value):
                if not leaf.target and leaf.code not in self.leaves:
                    self.leaves.append(leaf.code)
        self.leaf_code = [compile(c, "<chain_rows operand>", "eval") for c in self.leaves]
        self.shapes = [(compile(s.shape, "<shape>", "eval"), compile(s.dtype, "<dtype>", "eval"))
                       if s.shape else None for s in self.statements]
        self.layouts: dict[tuple, _Layout] = {}  # by the arrays' dtype, shapes and strides (_Plan)

    def numpy(self, scope: dict, glob: dict) -> tuple:
        env = dict(scope)
        exec(self.code, glob, env)
        return tuple(env[t] for t in self.targets)


def _leaves(node):
    if isinstance(node, Leaf):
        yield node
    elif isinstance(node, Bin):
        yield from _leaves(node.left)
        yield from _leaves(node.right)
    elif isinstance(node, (Neg, Expand)):
        yield from _leaves(node.operand)
    elif isinstance(node, RowDot):
        yield from _leaves(node.a)
        if node.b is not None:
            yield from _leaves(node.b)


_programs: dict[str, _Program] = {}
_programs_lock = fork.Lock()  # (free in a forked child: fork.py)


def _program(source: str) -> _Program:
    p = _programs.get(source)
    if p is None:
        with _programs_lock:
            p = _programs.setdefault(source, _Program(source))
    return p


def chain_rows(source: str, scope: dict, glob: dict) -> tuple:
    """The run's statements (see the module's docstring) on the arrays of `scope` (the module's locals) and `glob`
    (the module's helpers they call, by name): the values of the names they bind, in their order (chain_targets)."""
    p = _program(source)
    try:
        plan = _Plan(p, scope, glob)
    except NotTaken:
        return p.numpy(scope, glob)
    return plan.run()


class _Plan:
    """One call of a run: its operands, shapes, new arrays and the kernel for them (NotTaken where there is none)."""

    def __init__(self, p: _Program, scope: dict, glob: dict):
        self.p = p
        values = {}
        for code, compiled in zip(p.leaves, p.leaf_code):
            v = eval(compiled, glob, scope)
            if not isinstance(v, (np.ndarray, float, int)) or isinstance(v, bool):
                if isinstance(v, np.generic) and v.dtype.kind in "fi":
                    v = np.asarray(v)
                else:
                    raise NotTaken("an operand that is no array")
            values[code] = v
        # the dtype and the rows: from the arrays the statements write into or make
        dtype, lead = None, None
        targets: dict[str, np.ndarray] = {}  # the arrays made before the run that it adds to
        made: dict[str, tuple] = {}  # own_array's shape and dtype of the arrays it makes
        new: set[str] = set()
        for s, sd in zip(p.statements, p.shapes):
            if s.kind == "new":
                new.add(s.target)
            if s.kind in ("add", "sub", "param"):
                if s.target in new:
                    continue
                t = scope.get(s.target)
                if not isinstance(t, np.ndarray) or not t.flags.c_contiguous or not t.flags.writeable:
                    raise NotTaken("an array to add to that the kernel cannot write")
                targets[s.target] = t
                if s.kind != "param":
                    dtype, lead = _rows(t.shape, t.dtype, dtype, lead)
            elif sd is not None:
                shape, dt = eval(sd[0], glob, scope), np.dtype(eval(sd[1], glob, scope))
                made[s.target] = (tuple(int(n) for n in shape), dt)
                dtype, lead = _rows(made[s.target][0], dt, dtype, lead)
        for v in values.values():
            if isinstance(v, np.ndarray) and v.ndim >= 3 and lead is None:
                dtype, lead = _rows(v.shape, v.dtype, dtype, lead)
        if dtype is None or dtype not in CTYPES or lead is None or 0 in lead:
            raise NotTaken("no rows")
        self.dtype, self.lead = dtype, lead
        for code, v in values.items():  # (numbers and small arrays of another float dtype: NumPy's weak scalars)
            if isinstance(v, np.ndarray) and v.dtype != dtype:
                if v.dtype.kind not in "fiu" or (v.ndim >= 3 and v.dtype.kind == "f"):
                    raise NotTaken("an operand of another dtype")
                values[code] = v.astype(dtype)
            elif not isinstance(v, np.ndarray):
                values[code] = np.asarray(v, dtype)
        # the shapes, statement by statement; the arrays a statement makes
        shapes: dict[str, tuple] = {}  # a new array's shape, for the statements that read it
        self.frames = []  # per statement: the shape its loop runs over (lead, or lead + (width,))
        for s in p.statements:
            v = _shape(s.value, values, shapes)
            if s.kind == "new":
                shape = made[s.target][0] if s.target in made else v
                frame = _frame(shape, lead)
                if _broadcast(v, shape) != shape:
                    raise NotTaken("a value that does not broadcast to its array")
                shapes[s.target] = shape
            elif s.kind in ("add", "sub"):
                shape = shapes.get(s.target) or targets[s.target].shape
                frame = _frame(shape, lead)
                if _broadcast(v, shape) != shape:
                    raise NotTaken("a value that does not broadcast to its array")
            else:
                frame = _frame(v, lead)
                t = targets[s.target]
                if t.ndim > len(v) or _broadcast(t.shape, v) != v or t.dtype.kind != "f":
                    raise NotTaken("a param's gradient of another shape")
            self.frames.append(frame)
        if max(int(np.prod(f, dtype=np.int64)) for f in self.frames) < MIN_ROW_VALUES:
            raise NotTaken("too little to be worth a kernel")
        self.values, self.shapes, self.targets = values, shapes, targets
        # the kernel and its operands' layout, for arrays of these shapes and strides (made once per them)
        key = (dtype, lead, tuple((np.shape(v), getattr(v, "strides", None)) for v in values.values()),
               tuple(sorted(shapes.items())), tuple((n, t.shape) for n, t in targets.items()))
        self.layout = p.layouts.get(key)
        if self.layout is None:
            if len(p.layouts) >= LAYOUTS:
                p.layouts.clear()
            self.layout = p.layouts[key] = _Layout(self)

    def run(self) -> tuple:
        p, lay = self.p, self.layout
        arrays = {}
        for s in p.statements:
            if s.kind == "new" and s.target not in arrays:
                arrays[s.target] = gradient_array(self.shapes[s.target], self.dtype)  # (recycled, as the kernels')
        for name, t in self.targets.items():
            arrays.setdefault(name, t)
        k, t = lay.kernel, CTYPES[self.dtype]
        ptr = k.ffi.new(f"{t} *[]", max(1, len(lay.pointers)))
        for i, (kind, key) in enumerate(lay.pointers):  # (by address: an operand may be a strided or broadcast view)
            a = arrays[key] if kind == "target" else self.values[key]
            ptr[i] = k.ffi.cast(f"{t} *", a.__array_interface__["data"][0])
        threads = row_threads(int(np.prod(self.lead)))
        sums = np.zeros((threads, max(1, lay.sum_size)), np.float64)
        B, T, H = self.lead
        k.lib.lr_chain_rows(ptr, k.ffi.from_buffer("int64_t *", lay.strides), k.ffi.from_buffer("double *", sums),
                            k.ffi.from_buffer("int64_t *", lay.widths), B, T, H, threads, sums.shape[1])
        total = sums.sum(axis=0)
        for s, (start, shape) in lay.param_sums.items():
            part = total[start:start + int(np.prod(shape, dtype=np.int64))].reshape(shape)
            t = arrays[s]
            with np.errstate(over="ignore"):
                t += part.astype(t.dtype)
        return tuple(arrays[name] for name in p.targets)


def _rows(shape, dtype, dtype0, lead0):
    """(dtype, lead): an array of the rows [B, T, H] or [B, T, H, n] agrees with what is known."""
    shape = tuple(shape)
    if len(shape) not in (3, 4):
        raise NotTaken("an array that is not rows of the tokens")
    if (dtype0 is not None and np.dtype(dtype) != dtype0) or (lead0 is not None and shape[:3] != lead0):
        raise NotTaken("arrays of other rows or dtypes")
    return np.dtype(dtype), shape[:3]


def _broadcast(*shapes) -> tuple:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise NotTaken("shapes that do not broadcast") from None


def _frame(shape, lead) -> tuple:
    shape = tuple(shape)
    if shape[:3] != lead or len(shape) not in (3, 4):
        raise NotTaken("a value that is not rows of the tokens")
    return shape


def _shape(node, values, shapes) -> tuple:
    if isinstance(node, Leaf):
        return tuple(shapes[node.code]) if node.target else np.shape(values[node.code])
    if isinstance(node, Const):
        return ()
    if isinstance(node, Bin):
        return _broadcast(_shape(node.left, values, shapes), _shape(node.right, values, shapes))
    if isinstance(node, Neg):
        return _shape(node.operand, values, shapes)
    if isinstance(node, Expand):
        return _shape(node.operand, values, shapes) + (1,)
    a = _shape(node.a, values, shapes)
    both = a if node.b is None else _broadcast(a, _shape(node.b, values, shapes))
    if len(both) != 4:
        raise NotTaken("a row's sum of what is not rows")
    return both[:-1]


# ---- the kernel -------------------------------------------------------------------------------------------------
class _Layout:
    """The kernel's source for one plan: its operands' pointers and strides (over batch row, token, head and the
    row's values), the widths of its loops and where the params' sums go."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.pointers: list[tuple[str, str]] = []  # ("leaf" | "target", key), in the kernel's order
        self.strides: list[int] = []  # 3 per pointer (its row's offset), then its step along the row
        self.widths: list[int] = []  # per loop
        self.sum_size = 0
        self.param_sums: dict[str, tuple[int, tuple]] = {}
        self.body: list[str] = []
        self._index: dict[tuple, int] = {}
        self._loops = 0
        self._dots = 0
        for s, frame in zip(plan.p.statements, plan.frames):
            self.body.append(f"/* {s.text} */")
            self.body += self.statement(s, frame)
        self.kernel = _kernel(self.source(), self.cdef())
        self.strides = np.array(self.strides, dtype=np.int64)
        self.widths = np.array(self.widths or [0], dtype=np.int64)
        self.plan = None  # (kept by the program for other calls: no arrays of this one)

    def pointer(self, kind: str, key: str, frame: tuple) -> tuple[int, bool]:
        """The index of an operand's pointer read over `frame`, and whether it steps along the row (its step there
        is 1; broadcast, 0)."""
        plan = self.plan
        item = plan.dtype.itemsize
        if kind == "target":
            steps = _contiguous_steps(plan.shapes.get(key) or plan.targets[key].shape, frame)
        else:
            a = plan.values[key]
            if any(x % item for x in a.strides):
                raise NotTaken("an operand not aligned to its elements")
            steps = _steps(a.shape, [x // item for x in a.strides], frame)
        inner = steps[3] if len(frame) == 4 and frame[3] > 1 else 0
        if inner not in (0, 1):
            raise NotTaken("an operand whose row is not contiguous")
        ident = (kind, key, steps[:3], inner)
        i = self._index.get(ident)
        if i is None:
            i = self._index[ident] = len(self.pointers)
            self.pointers.append((kind, key))
            self.strides += [*steps[:3], inner]
        return i, inner == 1

    def expr(self, node, frame: tuple, var: str | None) -> str:
        """node's C (type T) at the element `var` of a row of `frame` (None: a value per row)."""
        if isinstance(node, Const):
            return f"(T){node.value!r}"
        if isinstance(node, _Local):
            return node.code
        if isinstance(node, Leaf):
            i, steps = self.pointer("target" if node.target else "leaf", node.code, frame)
            return f"p{i}[{var}]" if steps and var else f"p{i}[0]"
        if isinstance(node, Bin):
            return f"({self.expr(node.left, frame, var)} {node.op} {self.expr(node.right, frame, var)})"
        if isinstance(node, Neg):
            return f"(-{self.expr(node.operand, frame, var)})"
        if isinstance(node, Expand):
            return self.expr(node.operand, frame[:3], None)
        raise NotTaken("a row's sum inside a row")  # (RowDot: hoisted by statement())

    def hoist(self, node, frame: tuple, pre: list[str]):
        """node with its row's sums computed first (into pre's locals): a RowDot becomes a Leaf-like local."""
        if isinstance(node, RowDot):
            operand = _shape(node.a, self.plan.values, self.plan.shapes)
            if node.b is not None:
                operand = _broadcast(operand, _shape(node.b, self.plan.values, self.plan.shapes))
            inner = frame[:3] + (operand[3],)
            loop, name = self._loops, f"s{self._dots}"
            self._loops += 1
            self._dots += 1
            self.widths.append(operand[3])
            a = self.expr(self.hoist(node.a, inner, pre), inner, "j")
            term = a if node.b is None else f"(double){a} * {self.expr(self.hoist(node.b, inner, pre), inner, 'j')}"
            # (omp simd: the sum's order may change, as NumPy's einsum changes it; else gcc keeps one lane)
            pre += [f"double {name} = 0;", f"#pragma omp simd reduction(+:{name})",
                    f"for (int64_t j = 0; j < n[{loop}]; ++j)", f"    {name} += {term};"]
            return _Local(f"(T){name}")
        if isinstance(node, Bin):
            return Bin(node.op, self.hoist(node.left, frame, pre), self.hoist(node.right, frame, pre))
        if isinstance(node, Neg):
            return Neg(self.hoist(node.operand, frame, pre))
        if isinstance(node, Expand):
            return Expand(self.hoist(node.operand, frame[:3], pre))
        return node

    def statement(self, s: Statement, frame: tuple) -> list[str]:
        pre: list[str] = []
        value = self.hoist(s.value, frame, pre)
        wide = len(frame) == 4
        loop = self._loops
        if wide:
            self._loops += 1
            self.widths.append(frame[3])
        var = "i" if wide else None
        e = self.expr(value, frame, var)
        if s.kind == "param":
            t = self.plan.targets[s.target]
            start = self.param_sums.setdefault(s.target, (self.sum_size, t.shape))[0]
            if start == self.sum_size:
                self.sum_size += t.size
            steps = _contiguous_steps(t.shape, frame)
            at = " + ".join([str(start)] + [v if x == 1 else f"{v} * {x}" for v, x in zip(("b", "t", "h", "i"), steps)
                                            if x])
            store = f"sum[{at}] {s.sign}= (double){e};"
        else:
            i, _ = self.pointer("target", s.target, frame)
            op = {"new": "=", "add": "+=", "sub": "-="}[s.kind]
            store = f"p{i}[{'i' if wide else '0'}] {op} {e};"
        # (omp simd: an element reads and writes its own index only — an array the statement writes may be one it
        # reads, never another part of it)
        body = pre + (["#pragma omp simd", f"for (int64_t i = 0; i < n[{loop}]; ++i)", "    " + store] if wide
                      else [store])
        return ["{"] + ["    " + x for x in body] + ["}"]

    def source(self) -> str:
        ctype = CTYPES[self.plan.dtype]
        return environment(__package__).get_template("c_chain_rows.c.j2").render(
            version=VERSION, ctype=ctype, pointers=len(self.pointers), body=self.body)

    def cdef(self) -> str:
        t = CTYPES[self.plan.dtype]
        return (f"void lr_chain_rows({t} *const *ptr, const int64_t *st, double *sums, const int64_t *n, int64_t B, "
                f"int64_t NT, int64_t H, int nthreads, int64_t sum_stride);\n")


class _Local(Leaf):
    """A row's sum computed before the statement's loop (its C name)."""


def _kernel(source: str, cdef: str):
    """The built kernel of a source (memoized and cached on disk by it, as every kernel of c.scan_kernels)."""
    return cached_kernel(("chain_rows", source), "chain_rows", "chain_rows", lambda: source, cdef)


def _steps(shape, strides, frame) -> tuple:
    """The steps (in elements) of an array of `shape` and `strides` read broadcast over `frame` (NumPy's rule:
    axes aligned from the right, an axis of 1 or a missing one repeated): four, over (batch row, token, head, the
    row's values), the last 0 for a frame of one value per row."""
    shape, frame = tuple(shape), tuple(frame)
    if len(shape) > len(frame):
        raise NotTaken("an operand of more axes than its value")
    out = []
    for k in range(1, len(frame) + 1):
        if k > len(shape) or shape[-k] == 1:
            out.append(0)
        elif shape[-k] == frame[-k]:
            out.append(int(strides[-k]))
        else:
            raise NotTaken("shapes that do not broadcast")
    return tuple(reversed(out)) + ((0,) if len(frame) == 3 else ())


def _contiguous_steps(shape, frame) -> tuple:
    """_steps of a C-contiguous array of `shape` (a target: made by the run, or checked contiguous)."""
    return _steps(shape, np.cumprod((1,) + tuple(shape)[:0:-1])[::-1], frame)

"""Name resolution and shape checking: dsl.ast.Program → compiler.ir.Program.

Every error points at the offending source span and says how to fix it.
"""
from __future__ import annotations

import dataclasses
import difflib
import math

from ..dsl import ast
from ..dsl.errors import LinrecError, LinrecWarning, Span
from ..dsl.parser import LOOKALIKES

from . import ir
from .analysis import children, extremum, rebuild, refs, to_text, variance, walk
from .builtins import BUILTINS, RANDOM, SEQ, SEQUENCE, STRUCTURAL
from .constants import check_constants
from .linearity import NotLinear, check_linear
from .steps import StepValues

SQUARE = "?"  # placeholder dimension of `I` until its context fixes it
# How deep an expression may nest with its named values written out: the analyses and code generators walk
# expressions recursively (the parser bounds each expression as written: dsl.parser.MAX_NESTING)
MAX_INLINED_NESTING = 128
# How many operations an expression may hold with its named values, functions and composed assignments written
# out: the analyses walk it so, and a value used twice in each of a chain of named values (x2 = x1 + x1, …) or
# functions doubles it at every link — 2²⁴ operations took minutes to compile (found by probing). The examples
# hold at most a few hundred.
MAX_INLINED_SIZE = 50_000
# Counts in options (seq's window, lsh_attention's buckets, rounds and chunk) reach the kernels as C ints
MAX_COUNT = 2 ** 31
# The largest size of a dimension (the header's, --dim's, dims='s) and of a call's batch, tokens and heads as
# the command line takes them: the kernels count sizes in C ints, and the loops of emitted C in ints
SIZE_LIMIT = MAX_COUNT - 1


def too_large(what: str) -> str:
    """The message for a size above SIZE_LIMIT; `what` names it with its value ("--dim dk=10000000000")."""
    return (f"{what} is too large: sizes go up to {SIZE_LIMIT} (2³¹ − 1; the kernels count them in C ints); "
            f"make it smaller")
# The builtin names that are values, not functions: what each is and how it is used. A call of one says so
# (the name cannot be defined either, so "unknown function, define it first" sent the writer in a circle)
VALUES = {"I": ("the identity matrix", "use it in a product, where the matrix it meets gives its size, e.g. "
                                       "`(I − beta·k⊗k)·S`"),
          "h": ("the head index, a number", "use it in a per-head parameter's default, e.g. "
                                            "`param gamma per head = 1 − 2^(−5 − h)`")}
RESERVED = set(VALUES) | set(BUILTINS) | set(STRUCTURAL) | set(RANDOM) | set(SEQUENCE)
# What each kind of statement declares, as a message names it
_DECLARES = {ast.InputDecl: "input", ast.ParamDecl: "parameter", ast.StateDecl: "state",
             ast.FunctionDef: "function", ast.OutputDef: "output", ast.Assignment: "value"}


def _a(word: str) -> str:
    """The word with its indefinite article ("an input", "a state")."""
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _read_in_its_definition(name: str) -> str:
    return f"'{name}' is defined here from itself; define it from other names"


def _output_read(name: str, where: str = "") -> str:
    """An output read as a value (`where`: its line, when it comes later)."""
    return (f"'{name}' is an output{where} and cannot be read; define the value with `{name}_value = …` and output "
            f"that")


def _fmt(shape: ir.Shape) -> str:
    return "scalar" if not shape else "[" + ", ".join(shape) + "]"


def _settle(e: ir.Expr, n: str) -> ir.Expr:
    """Give every placeholder-shaped node inside `e` (from `I`) the concrete size n."""
    def fix(node):
        if SQUARE in node.shape:
            return dataclasses.replace(node, shape=tuple(n if d == SQUARE else d for d in node.shape))
        return node
    return rebuild(e, fix)


class _Resolver:
    def __init__(self, program: ast.Program):
        self.p = program
        self.dims: dict[str, ir.Dim] = {}
        self.inputs: dict[str, ir.Input] = {}
        self.params: dict[str, ir.Param] = {}
        self.states: dict[str, ir.State] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        self.lets: dict[str, ir.Expr] = {}
        self.let_written: dict[str, tuple[int, int]] = {}  # each value's depth and size written out (_written_out)
        self.step_written: dict[tuple[str, str], tuple[int, int]] = {}  # (state, version) → its value's
        self.outputs: dict[str, ir.Expr] = {}
        self.assigned = StepValues()  # each state's value after each of its assignments (compiler.steps)
        self.defined_at: dict[str, Span] = {}
        self.steps: list[ir.Step] = []
        self.step_spans: list[Span] = []  # where each step is written
        self.used: set[str] = set()  # inputs, params, values and functions some expression refers to
        self.warnings: tuple[LinrecWarning, ...] = ()  # set by run()
        # each name's first declaration in the whole program, and what it declares: a name used before it is
        # told where it comes, not called unknown
        self.declarations: dict[str, tuple[Span, str]] = {}
        for st in program.statements:
            name = st.target if isinstance(st, ast.Assignment) else st.name
            self.declarations.setdefault(name, (st.span, _DECLARES[type(st)]))

    # ---- names ----
    def _define(self, name: str, span: Span, what: str):
        if name in RESERVED:
            raise LinrecError(f"'{name}' is a builtin name and cannot name {what}; choose another name", span)
        if name in self.defined_at:
            prev = self.defined_at[name]
            raise LinrecError(f"'{name}' is already defined (line {prev.line}); each name is defined once"
                              + (" — a state is updated by `NAME = …` after `state NAME[…]`"
                                 if what == "a state" else ""), span)
        self.defined_at[name] = span

    def _check_shape(self, shape: tuple[str, ...], span: Span, what: str = "input"):
        for d in shape:
            if d == SEQ and what != "param":
                raise LinrecError(f"'{SEQ}' is the sequence axis: {_a(what)} is per token and cannot span it; "
                                  f"read other tokens with seq(x)", span)
            if d == SEQ and d not in self.dims:
                raise LinrecError(f"a parameter over the sequence axis needs its maximum length: declare it in "
                                  f"the header, e.g. `recurrence {self.p.name}(…, {SEQ} = 4096)`", span)
            if d not in self.dims:
                known = ", ".join(self.dims) or "none"
                raise LinrecError(f"unknown dimension '{d}' (declared: {known}); add it to the header, "
                                  f"e.g. `recurrence {self.p.name}(…, {d} = 64)`", span)

    # ---- program ----
    def run(self) -> ir.Program:
        for name, default, span in self.p.dims:
            if name in self.dims:
                raise LinrecError(f"dimension '{name}' is declared twice", span)
            if default <= 0:
                raise LinrecError(f"dimension '{name}' must have a positive default size", span)
            if default > SIZE_LIMIT:
                raise LinrecError(too_large(f"dimension '{name}' = {default}"), span)
            self._define(name, span, "a dimension")
            self.dims[name] = ir.Dim(name, default)
        for st in self.p.statements:
            getattr(self, "_" + type(st).__name__)(st)
        for f in self.functions.values():  # a function body is only resolved where it is called
            self._check_function_names(f)
        for name, st in self.states.items():
            if not self.assigned.assignments(name):
                raise LinrecError(f"state '{name}' is never updated; add a line `{name} = …` that says how it "
                                  f"evolves per token", self.defined_at[name])
        if not self.outputs:
            raise LinrecError("the program has no output; add a line such as `output o = q·S`", self.p.span)
        self.warnings = tuple(self._unused())
        return ir.Program(self.p.name, self.p.causal, tuple(self.dims.values()), tuple(self.inputs.values()),
                          tuple(self.params.values()), tuple(self.states.values()), self._settled_steps())

    def _settled_steps(self) -> tuple[ir.Step, ...]:
        """The steps with every state read as S_(t−1) or S_t (compiler.steps): a read between two assignments
        of a state holds the intermediate value written over S_(t−1), which must still be there where the
        step runs."""
        updated_at = {s.state: i for i, s in enumerate(self.steps) if isinstance(s, ir.Update)}
        settled = []
        held: dict[str, set[str]] = {}  # named value → the states it reads between two of their assignments
        for i, (step, span) in enumerate(zip(self.steps, self.step_spans)):
            value, between = self.assigned.settle(step.value)
            if isinstance(step, ir.Let):
                held[step.name] = between.union(*(held[n] for n in refs(step.value, ir.LetRef)))
            elif isinstance(step, ir.Output) and not self.p.causal:
                read = between.union(*(held[n] for n in refs(step.value, ir.LetRef)))
                if read:
                    state = min(read)
                    raise LinrecError(f"this reads '{state}' between two of its assignments, but a non-causal "
                                      f"program's outputs read each state after every token has updated it; "
                                      f"read '{state}' after its last assignment", span)
            late = next((n.name for n in walk(value) if isinstance(n, ir.StateRef) and n.version == "prev"
                         and updated_at[n.name] < i), None)
            if late is not None:  # (only a value carried from an earlier assignment can be late)
                holder = sorted(between)[0] if between else step.state
                how = (f"this reads '{holder}' between two of its assignments, and that value reads"
                       if between else f"an earlier assignment of '{holder}' reads")
                raise LinrecError(
                    f"{how} '{late}' before its update (line {self.step_spans[updated_at[late]].line}); linrec "
                    f"composes the assignments of '{holder}' into one update at its last (line "
                    f"{self.step_spans[updated_at[holder]].line}), where '{late}' is already updated: update "
                    f"'{late}' before the first assignment of '{holder}' or after its last", span)
            settled.append(dataclasses.replace(step, value=value))
        return tuple(settled)

    def _unused(self):
        """Declared inputs, params, values and functions that nothing reads, in source order. An unused input
        is a trap: every call must still pass its array."""
        kinds = [("input", self.inputs, "every call must still pass its array; remove it or use it"),
                 ("parameter", self.params, "remove it or use it"),
                 ("value", self.lets, "remove it or use it in an update or an output"),
                 ("function", self.functions, "remove it or call it")]
        found = [(self.defined_at[name], f"{what} '{name}' is declared but never used; {fix}")
                 for what, names, fix in kinds for name in names if name not in self.used]
        for span, message in sorted(found, key=lambda f: (f[0].line, f[0].column)):
            yield LinrecWarning(message, span)

    def _InputDecl(self, st: ast.InputDecl):
        self._define(st.name, st.span, "an input")
        self._check_shape(st.shape, st.span)
        c = st.constraint
        self.inputs[st.name] = ir.Input(st.name, st.shape, *(
            (c.low, c.high, c.low_open, c.high_open) if c else ()))

    def _ParamDecl(self, st: ast.ParamDecl):
        self._define(st.name, st.span, "a parameter")
        self._check_shape(st.shape, st.span, "param")
        default = None
        if st.default is not None:
            self._param_shape = st.shape
            default = self.expr(st.default, in_param=True)
            if SQUARE in default.shape and len(st.shape) == 2 and st.shape[0] == st.shape[1]:
                default = _settle(default, st.shape[0])  # (I takes its size from the declaration, as in an update)
            if default.shape and default.shape != st.shape:  # a scalar default fills the shape
                raise LinrecError(f"the default of '{st.name}' has shape {_fmt(default.shape)} but the "
                                  f"parameter is declared {_fmt(st.shape)}", st.default.span)
            if not st.per_head and any(isinstance(n, ir.HeadIndex) for n in walk(default)):
                raise LinrecError(f"'{st.name}' uses the head index h; declare it `param {st.name} per head`",
                                  st.default.span)
            per_head = next((n for n in walk(default) if isinstance(n, ir.ParamRef) and n.per_head), None)
            if not st.per_head and per_head is not None:  # (its value would have a head axis it is declared without)
                raise LinrecError(f"'{st.name}' is computed from the per-head parameter '{per_head.name}', so it "
                                  f"differs per head too; declare it `param {st.name} per head`", per_head.span)
        self.params[st.name] = ir.Param(st.name, st.shape, st.per_head, default, span=st.span)

    def _StateDecl(self, st: ast.StateDecl):
        self._define(st.name, st.span, "a state")
        self._check_shape(st.shape, st.span, "state")
        if len(st.shape) not in (1, 2):
            raise LinrecError(f"state '{st.name}' must be a vector or a matrix, e.g. `state S[dk, dv]`", st.span)
        self.states[st.name] = ir.State(st.name, st.shape, span=st.span)

    def _FunctionDef(self, st: ast.FunctionDef):
        self._define(st.name, st.span, "a function")
        if len(set(st.params)) != len(st.params):
            raise LinrecError(f"function '{st.name}' repeats a parameter name", st.span)
        self.functions[st.name] = st

    def _check_function_names(self, f: ast.FunctionDef):
        """Unknown names in a function body are errors even when the function is never called."""
        known = set(f.params) | set(self.defined_at) | set(self.dims) | {"I", "h"}
        callable_ = set(self.functions) | set(BUILTINS) | set(STRUCTURAL) | set(RANDOM) | set(SEQUENCE)

        for e in ast.walk(f.body):
            if isinstance(e, ast.Name) and e.name not in known and e.name not in callable_:
                hint = _closest(e.name, sorted(known) + list(BUILTINS))
                raise LinrecError(f"unknown name '{e.name}' in the body of '{f.name}'"
                                  + (f"; did you mean '{hint}'?" if hint else
                                     f"; the parameters of '{f.name}' are {', '.join(f.params)}"), e.span)
            if isinstance(e, ast.Call) and e.function not in callable_:
                raise self._no_function(e)

    def _at_the_call(self, err: LinrecError, value: ast.Expr, state: str) -> LinrecError:
        """An error at a place inside a function's definition, moved to the update's call of that function (the
        definition is right for every other call): `phi(q·S)`, not `elu(x) + 1`, is what is not linear."""
        def inside(span: Span | None, outer: Span | None) -> bool:
            return span is not None and outer is not None and \
                (outer.line, outer.column) <= (span.line, span.column) and \
                (span.end_line, span.end_column) <= (outer.end_line, outer.end_column)
        if inside(err.span, value.span):
            return err
        calls = [e for e in ast.walk(value) if isinstance(e, ast.Call) and e.function in self.functions
                 and inside(err.span, self.functions[e.function].body.span)]
        if not calls:
            return err
        # (the call whose arguments read the state: phi(q·S), not phi(k))
        call = next((c for c in calls if any(isinstance(n, ast.Name) and n.name == state
                                             for a in c.args for n in ast.walk(a))), calls[0])
        f = self.functions[call.function]
        return type(err)(f"{err.message} (through '{f.name}', defined at line {f.span.line})", call.span)

    def _Assignment(self, st: ast.Assignment):
        value = self.expr(st.value)
        if st.target in self.states:
            state = self.states[st.target]
            if SQUARE in value.shape and len(state.shape) == 2 and state.shape[0] == state.shape[1]:
                value = _settle(value, state.shape[0])
            if value.shape != state.shape:
                raise LinrecError(f"the update of '{st.target}' has shape {_fmt(value.shape)} but the state is "
                                  f"declared {_fmt(state.shape)}", st.value.span)
            try:
                check_linear(value, st.target, self.lets)
            except NotLinear as err:
                raise self._at_the_call(err, st.value, st.target) from None
            self._assign(st.target, value, st.span)
            return
        if st.target in self.inputs or st.target in self.params or st.target in self.dims:
            raise LinrecError(f"'{st.target}' is an input, parameter or dimension and cannot be assigned; "
                              f"give the new value another name", st.span)
        self._define(st.target, st.span, "a value")
        if SQUARE in value.shape:
            raise LinrecError("cannot tell the size of I here; write it inside an expression with a sized "
                              "matrix", st.value.span)
        self.lets[st.target] = value
        depth, size = self._written_out(value)
        # (a value that is another's name adds no operation, but writing it out recurses once more: found by
        # probing, 400 such aliases in a row exhausted Python's stack)
        self.let_written[st.target] = depth + isinstance(value, ir.LetRef), size
        self._step(ir.Let(st.target, value), st.span)

    def _assign(self, state: str, value: ir.Expr, span: Span):
        """An assignment of a state. A later one composes with the ones before it (compiler.steps): the
        composed update replaces the earlier one and takes the place of this one."""
        earlier = next((i for i, s in enumerate(self.steps) if isinstance(s, ir.Update) and s.state == state),
                       None)
        assignments = ()
        if earlier is not None:
            assignments = self.steps[earlier].assignments
            del self.steps[earlier], self.step_spans[earlier]
        composed = self.assigned.assign(state, value)
        depth, size = self._written_out(composed)
        if depth > MAX_INLINED_NESTING:
            raise LinrecError(f"with the assignments of '{state}' composed, its update nests {depth} levels "
                              f"deep; linrec's analyses take at most {MAX_INLINED_NESTING}", span)
        if size > MAX_INLINED_SIZE:
            raise LinrecError(f"with the assignments of '{state}' composed, its update holds {size} operations "
                              f"(each assignment repeats the state's value in every term that reads it); "
                              f"linrec's analyses take at most {MAX_INLINED_SIZE}: assign it in fewer steps",
                              span)
        self.step_written[(state, self.assigned.version(state))] = depth, size  # (a later read may hold this value)
        self._step(ir.Update(state, composed, span, assignments + (span,)), span)

    def _step(self, step: ir.Step, span: Span):
        self.steps.append(step)
        self.step_spans.append(span)

    def _OutputDef(self, st: ast.OutputDef):
        self._define(st.name, st.span, "an output")
        value = self.expr(st.value)
        if len(value.shape) > 1:
            raise LinrecError(f"output '{st.name}' has shape {_fmt(value.shape)}; outputs are scalars or "
                              f"vectors per token and head", st.value.span)
        if SEQ in value.shape:  # (a vector over the sequence is no value of one token, [B, T, H, T])
            raise LinrecError(f"output '{st.name}' has shape {_fmt(value.shape)}, over the sequence axis '{SEQ}'; "
                              f"an output is a scalar or a vector per token and head: contract it over the "
                              f"sequence, e.g. softmax(seq(k)·q)·seq(v)", st.value.span)
        self.outputs[st.name] = value
        self._step(ir.Output(st.name, value), st.span)

    # ---- expressions ----
    def expr(self, e: ast.Expr, *, in_param: bool = False, bound=None) -> ir.Expr:
        resolved = self._expr(e, in_param, bound or {}, ())
        depth, size = self._written_out(resolved)
        if depth > MAX_INLINED_NESTING:
            raise LinrecError(f"with its named values and functions written out, this expression nests {depth} "
                              f"levels deep; linrec's analyses take at most {MAX_INLINED_NESTING}", e.span)
        if size > MAX_INLINED_SIZE:
            raise LinrecError(f"with its named values and functions written out, this expression holds {size} "
                              f"operations (a value used twice in each of a chain of definitions doubles at "
                              f"every link); linrec's analyses take at most {MAX_INLINED_SIZE}", e.span)
        check_constants(resolved, {name: dim.default for name, dim in self.dims.items()})
        return resolved

    def _written_out(self, e: ir.Expr) -> tuple[int, int]:
        """How deep `e` nests and how many operations it holds once its named values are written out (the
        analyses inline them), counted without recursion and once per shared node (an argument a function
        uses twice is one node twice: its size counts twice, its walk here once)."""
        measure: dict[int, tuple[int, int]] = {}
        stack = [(e, False)]
        while stack:
            node, done = stack.pop()
            kids = children(node)
            if done:
                if isinstance(node, ir.LetRef):
                    measure[id(node)] = self.let_written.get(node.name, (0, 1))
                elif isinstance(node, ir.StateRef):  # between assignments, it stands for their value
                    measure[id(node)] = self.step_written.get((node.name, node.version), (0, 1))
                else:  # (a leaf is no level)
                    measure[id(node)] = (1 + max((measure[id(k)][0] for k in kids), default=-1),
                                         1 + sum(measure[id(k)][1] for k in kids))
            elif id(node) not in measure:
                stack.append((node, True))
                stack.extend((k, False) for k in kids)
        return measure[id(e)]

    def _expr(self, e, in_param, bound, stack) -> ir.Expr:
        rec = lambda x: self._expr(x, in_param, bound, stack)  # noqa: E731
        sp = e.span
        if isinstance(e, ast.Number):
            return ir.Const((), e.value, span=sp)
        if isinstance(e, ast.Name):
            return self._name(e, in_param, bound)
        if isinstance(e, ast.Unary):
            x = rec(e.operand)
            return ir.Neg(x.shape, x, span=sp)
        if isinstance(e, ast.Binary):
            return self._binary(e, rec(e.left), rec(e.right))
        if isinstance(e, ast.Call):
            return self._call(e, in_param, bound, stack)
        raise TypeError(e)

    def _name(self, e: ast.Name, in_param, bound) -> ir.Expr:
        n, sp = e.name, e.span
        if n in bound:
            return bound[n]
        if n == "I":
            return ir.Identity((SQUARE, SQUARE), span=sp)
        if n == "h":
            if not in_param:
                raise LinrecError("the head index 'h' may only appear in a per-head parameter's default", sp)
            return ir.HeadIndex((), span=sp)
        if n in self.dims:
            return ir.DimSize((), n, span=sp)
        if n in self.params:
            self.used.add(n)
            p = self.params[n]
            return ir.ParamRef(p.shape, n, p.per_head, span=sp)
        # (one declared later, too: moving it up, as an out-of-order name is told, would not help)
        per_token = n in (self.inputs.keys() | self.states.keys() | self.lets.keys())
        if in_param and (per_token or self.declarations.get(n, (None, ""))[1] in ("input", "state", "value")):
            raise LinrecError(f"a parameter's default may use only numbers, dimensions, h and other "
                              f"parameters, not '{n}'", sp)
        if n in self.inputs:
            self.used.add(n)
            return ir.InputRef(self.inputs[n].shape, n, span=sp)
        if n in self.states:
            return ir.StateRef(self.states[n].shape, n, self.assigned.version(n), span=sp)
        if n in self.lets:
            self.used.add(n)
            return ir.LetRef(self.lets[n].shape, n, span=sp)
        if n in self.functions:
            raise LinrecError(f"'{n}' is a function; call it, e.g. `{n}(x)`", sp)
        if n in self.outputs:
            raise LinrecError(_output_read(n), sp)
        if n in BUILTINS or n in STRUCTURAL or n in RANDOM:
            raise LinrecError(f"'{n}' is a builtin function; call it, e.g. `{n}(x)`", sp)
        if n == "H":  # (after the program's own names: a dim or an input may be called H)
            if not in_param:
                raise LinrecError("the number of heads 'H' may only appear in a parameter's default", sp)
            return ir.HeadCount((), span=sp)
        lookalike = next((hint for chars, hint in LOOKALIKES if any(c in chars for c in n)), None)
        if lookalike:  # (½ is a letter to the lexer, as to Python: a name)
            raise LinrecError(f"unknown name '{n}'{lookalike}", sp)
        if n in self.defined_at:  # (its own definition, being read: `param a = a + 1` said "did you mean 'a'?")
            raise LinrecError(_read_in_its_definition(n), sp)
        out_of_order = self._out_of_order(n, sp)
        if out_of_order:
            raise LinrecError(out_of_order, sp)
        hint = _closest(n, list(self.defined_at) + list(BUILTINS))
        raise LinrecError(f"unknown name '{n}'" + (f"; did you mean '{hint}'?" if hint else
                                                   "; declare it as an input, param, state or value first"), sp)

    def _binary(self, e: ast.Binary, a: ir.Expr, b: ir.Expr) -> ir.Expr:
        sp, op = e.span, e.op
        sa, sb = a.shape, b.shape
        if SQUARE in sa and sb and SQUARE not in sb and len(sb) == 2 and op in ("add", "sub", "mul"):
            a, sa = _settle(a, sb[0]), (sb[0], sb[0])
        if SQUARE in sb and sa and SQUARE not in sa and len(sa) == 2 and op in ("add", "sub", "mul"):
            b, sb = _settle(b, sa[0]), (sa[0], sa[0])
        if op in ("add", "sub", "mul", "div"):
            if sa == sb or not sa or not sb:
                if op in ("add", "sub") and (sa != sb) and (SQUARE in sa or SQUARE in sb):
                    raise LinrecError("cannot tell the size of I here: add it to a sized matrix", sp)
                if op in ("add", "sub") and sa != sb and (len(sa) == 2 or len(sb) == 2):
                    raise LinrecError(f"cannot add a scalar to a matrix ({_fmt(sa)} and {_fmt(sb)}); "
                                      f"write `c·I` for a multiple of the identity", sp)
                return ir.Arith(sa or sb, op, a, b, span=sp)
            vector, matrix = (sa, sb) if len(sa) == 1 else (sb, sa)
            ways = [f"its {axis}: {how}" for axis, how, d in (("rows", "diag(v)·M", 0), ("columns", "M·diag(v)", 1))
                    if op == "mul" and len(vector) == 1 and len(matrix) == 2 and vector[0] == matrix[d]]
            hint = f"; to scale a matrix by a vector, write for {' or '.join(ways)}" if ways else ""
            if op in ("add", "sub") and any(isinstance(x, ir.Dot) and len(x.left.shape) == 1 and
                                            x.right.shape in (sa, sb) for x in (a, b)):
                # (`sigmoid(f)·S + k⊗v`, meant as a decay of the rows: the dot is a readout, a vector)
                hint = "; `v·M` contracts the matrix M with the vector v, giving a vector: to scale M's rows by v, " \
                       "write diag(v)·M"
            raise LinrecError(f"shape mismatch in '{_opname(op)}': {_fmt(sa)} and {_fmt(sb)}{hint}", sp)
        if op == "pow":  # elementwise: a scalar on either side broadcasts
            if sa and sb and sa != sb:
                raise LinrecError(f"shape mismatch in '^': {_fmt(sa)} and {_fmt(sb)}; the exponent is a scalar "
                                  f"or has the base's shape (elementwise powers)", sp)
            return ir.Arith(sa or sb, op, a, b, span=sp)
        if op == "outer":
            if len(sa) != 1 or len(sb) != 1:
                # (a scalar side is most often precedence: `k⊗s·v` is `(k⊗s)·v`, the operators binding equally)
                hint = "; `·`, `⊗`, `*` and `/` bind equally, left to right: `k⊗s·v` is `(k⊗s)·v`, so write " \
                    "`k⊗(s·v)` or `(s·k)⊗v`" if not sa or not sb else ""
                raise LinrecError(f"'⊗' takes two vectors, got {_fmt(sa)} and {_fmt(sb)}{hint}", sp)
            return ir.Outer((sa[0], sb[0]), a, b, span=sp)
        assert op == "dot"
        if not sa or not sb:
            return ir.Dot(sa or sb, a, b, span=sp)
        if SQUARE in sa and SQUARE not in sb:
            a, sa = _settle(a, sb[0]), (sb[0], sb[0])
        if SQUARE in sb and SQUARE not in sa:
            b, sb = _settle(b, sa[-1]), (sa[-1], sa[-1])
        if sa[-1] != sb[0]:
            raise LinrecError(f"shape mismatch in '·': {_fmt(sa)}·{_fmt(sb)} contracts '{sa[-1]}' with "
                              f"'{sb[0]}', which are different dimensions", sp)
        shape = sa[:-1] + sb[1:]
        # a negated matrix times a vector, −W·x (the minus binds tighter: (−W)·x), is −(W·x): the product of the
        # matrix itself, which the kernels compute over a param's rows (the C fused kernel took no other)
        if isinstance(a, ir.Neg) and len(sa) == 2 and len(sb) == 1:
            return ir.Neg(shape, ir.Dot(shape, a.operand, b, span=sp), span=sp)
        if isinstance(b, ir.Neg) and len(sa) == 1 and len(sb) == 2:
            return ir.Neg(shape, ir.Dot(shape, a, b.operand, span=sp), span=sp)
        return ir.Dot(shape, a, b, span=sp)

    def _call(self, e: ast.Call, in_param, bound, stack) -> ir.Expr:
        fn, sp = e.function, e.span
        rec = lambda x: self._expr(x, in_param, bound, stack)  # noqa: E731
        if fn in self.functions:
            self.used.add(fn)
            f = self.functions[fn]
            if fn in stack:  # (through others: say which, `f → g → f`, where the error points into g)
                cycle = stack[stack.index(fn):] + (fn,)
                how = "calls itself" if len(cycle) == 2 else f"calls itself through {' → '.join(cycle)}"
                raise LinrecError(f"function '{fn}' {how}; recursion is not supported", sp)
            if len(stack) >= MAX_INLINED_NESTING:  # (here, before the compiler's own recursion runs out)
                raise LinrecError(f"functions call each other {len(stack) + 1} deep here; linrec writes each call "
                                  f"out and takes at most {MAX_INLINED_NESTING}", sp)
            if e.keywords:
                raise LinrecError(f"'{fn}' takes its arguments by position, `{fn}({', '.join(f.params)})`, not by "
                                  f"name", sp)
            if len(e.args) != len(f.params):
                raise LinrecError(f"'{fn}' takes {len(f.params)} argument(s) ({', '.join(f.params)}), "
                                  f"got {len(e.args)}", sp)
            args = {p: rec(a) for p, a in zip(f.params, e.args)}
            return self._expr(f.body, in_param, args, stack + (fn,))
        if fn in RANDOM:
            if not in_param:
                raise LinrecError(f"'{fn}' draws random numbers and may only give a parameter's default", sp)
            kind, defaults = RANDOM[fn]
            opts = self._options(e, dict(defaults) | {"seed": 0.0}, positional=[k for k, _ in defaults])
            seed = opts.pop("seed")
            if opts.get("std", 0.0) < 0:
                raise LinrecError(f"randn's std must be ≥ 0, got {opts['std']:g}", sp)
            if opts.get("low", 0.0) > opts.get("high", 1.0):
                raise LinrecError(f"uniform's low ({opts['low']:g}) is above its high ({opts['high']:g})", sp)
            if kind == "features" and len(self._param_shape) != 2:
                raise LinrecError(f"random_features draws the rows of a projection matrix, but this param has "
                                  f"shape {_fmt(self._param_shape)}: declare it as a matrix [features, input size], "
                                  f"e.g. `param W[m, dk] = random_features(seed=0)`", sp)
            return ir.Random(self._param_shape, kind, int(seed), tuple(opts.items()), span=sp)
        if fn in SEQUENCE:
            return self._sequence_call(e, rec)
        if fn in STRUCTURAL:
            if e.keywords or len(e.args) != STRUCTURAL[fn]:
                raise LinrecError(f"'{fn}' takes {STRUCTURAL[fn]} argument(s)", sp)
            args = [rec(a) for a in e.args]
            if fn == "diag":
                if len(args[0].shape) != 1:
                    raise LinrecError(f"diag takes a vector, got {_fmt(args[0].shape)}", e.args[0].span)
                n = args[0].shape[0]
                return ir.Diag((n, n), args[0], span=sp)
            return self._binary(ast.Binary(sp, "outer", e.args[0], e.args[1]), *args)
        if fn in ("max", "min"):  # (a program's own function of that name came first)
            if e.keywords or len(e.args) != 2:
                raise LinrecError(f"'{fn}' takes two arguments, `{fn}(a, b)`: the elementwise {fn}imum", sp)
            a, b = (rec(x) for x in e.args)
            if a.shape and b.shape and a.shape != b.shape:
                raise LinrecError(f"'{fn}' takes two values of one shape, or a scalar beside either: got "
                                  f"{_fmt(a.shape)} and {_fmt(b.shape)}", sp)
            return extremum(fn, a, b, span=sp)
        if fn in BUILTINS:
            b = BUILTINS[fn]
            if len(e.args) != b.arity:
                raise LinrecError(f"'{fn}' takes {b.arity} argument(s), got {len(e.args)}", sp)
            opts = self._options(e, dict(b.options), positional=[])
            args = tuple(rec(a) for a in e.args)
            x = args[0]
            if b.kind == "elementwise":
                shape = x.shape
            else:
                if len(x.shape) != 1:
                    raise LinrecError(f"'{fn}' works on a vector, got {_fmt(x.shape)}", e.args[0].span)
                shape = x.shape if b.kind == "vector" else ()
            return ir.Apply(shape, fn, args, tuple(opts.items()), span=sp)
        raise self._no_function(e)

    def _no_function(self, e: ast.Call) -> LinrecError:
        """The error for a call whose name is no function (defined so far)."""
        fn, sp = e.function, e.name_span or e.span
        if fn in VALUES:
            what, use = VALUES[fn]
            return LinrecError(f"'{fn}' is {what}, not a function: {use}", sp)
        if fn in self.defined_at or fn in self.dims:
            return LinrecError(f"'{fn}' is not a function", sp)
        out_of_order = self._out_of_order(fn, sp)
        if out_of_order:
            return LinrecError(out_of_order, sp)
        hint = _closest(fn, list(self.functions) + list(BUILTINS) + list(STRUCTURAL))
        return LinrecError(f"unknown function '{fn}'" + (f"; did you mean '{hint}'?" if hint else
                           "; define it first, e.g. `phi(x) = elu(x) + 1`"), sp)

    def _out_of_order(self, name: str, use: Span) -> str | None:
        """The message for a name read before the statement that declares it, or in its own definition (a
        value's name is defined once its value is resolved), if a statement declares it."""
        if name not in self.declarations:
            return None
        at, what = self.declarations[name]
        if (at.line, at.column) <= (use.line, use.column):  # (the statement being resolved: `x = 2*x`)
            return _read_in_its_definition(name)
        if what == "output":  # (moving it up would not help)
            return _output_read(name, f" (line {at.line})")
        return (f"'{name}' is used before its declaration: it is {_a(what)} declared later, on line {at.line}; move "
                f"that declaration above its first use (line {use.line})")

    def _sequence_call(self, e: ast.Call, rec) -> ir.Expr:
        arity, defaults = SEQUENCE[e.function]
        if len(e.args) != arity:
            raise LinrecError(f"'{e.function}' takes {arity} argument(s), got {len(e.args)}", e.span)
        opts = self._options(e, dict(defaults), positional=[])
        args = tuple(rec(a) for a in e.args)
        for a, src in zip(args, e.args):
            if len(a.shape) > 1:
                raise LinrecError(f"'{e.function}' takes per-token scalars or vectors, got {_fmt(a.shape)}",
                                  src.span)
            if any(isinstance(n, (ir.StateRef, ir.Apply)) and getattr(n, "function", None) in SEQUENCE
                   for n in walk(a)):
                raise LinrecError(f"'{e.function}' cannot take another sequence expression", src.span)
            if variance(a, self.lets) != "token":  # (a constant or a param is the same at every position)
                raise LinrecError(f"'{e.function}' reads values that change from token to token (inputs, or "
                                  f"values computed from them); `{to_text(a)}` is the same at every position: "
                                  f"use it as it is", src.span)
        if e.function == "seq":
            if opts["window"] < 0 or opts["window"] != int(opts["window"]) or opts["window"] >= MAX_COUNT:
                raise LinrecError(f"window must be a whole number of positions from 0 (every position) up to "
                                  f"{MAX_COUNT - 1}", e.span)
            return ir.Apply((SEQ,) + args[0].shape, "seq", args, tuple(opts.items()), span=e.span)
        q, v = args
        if len(q.shape) != 1:
            raise LinrecError("lsh_attention hashes a vector of queries, got a scalar", e.args[0].span)
        if len(v.shape) != 1:
            raise LinrecError("lsh_attention averages vectors of values, got a scalar: give it a vector, "
                              "e.g. an input v[dv]", e.args[1].span)
        for name in ("buckets", "rounds", "chunk"):
            if opts[name] < 1 or opts[name] != int(opts[name]) or opts[name] >= MAX_COUNT:
                raise LinrecError(f"lsh_attention's {name} must be a whole number from 1 up to {MAX_COUNT - 1}",
                                  e.span)
        if int(opts["buckets"]) % 2:
            raise LinrecError("lsh_attention's buckets must be even (hashes are argmax over [xR; −xR])", e.span)
        return ir.Apply(v.shape, "lsh_attention", args, tuple(opts.items()), span=e.span)

    def _options(self, e: ast.Call, defaults: dict, positional: list[str]) -> dict:
        """Keyword options must be numbers; `positional` names the options that may also come by position."""
        opts = dict(defaults)
        values = list(e.args) if positional else []
        if len(values) > len(positional):
            raise LinrecError(f"'{e.function}' takes at most {len(positional)} positional argument(s)", e.span)
        pairs = list(zip(positional, values)) + [(k.name, k.value) for k in e.keywords]
        for name, value in pairs:
            if name not in defaults:
                raise LinrecError(f"'{e.function}' has no option '{name}'" + (f" (options: {', '.join(defaults)})"
                                  if defaults else "; it takes none"), e.span)
            v = _number(value)
            if v is None:
                raise LinrecError(f"option '{name}' must be a number", value.span)
            if not math.isfinite(v):
                raise LinrecError(f"option '{name}' must be a finite number, got {v:g}", value.span)
            if name == "seed" and not (v == int(v) and 0 <= v < 2 ** 63):
                raise LinrecError(f"option 'seed' must be a whole number ≥ 0, got {v:g}", value.span)
            if name == "eps" and not v >= 0:  # inside a square root
                raise LinrecError(f"option 'eps' must be ≥ 0, got {v:g}", value.span)
            if name == "orthogonal" and v not in (0, 1):
                raise LinrecError(f"option 'orthogonal' is 0 (i.i.d. rows) or 1 (orthogonal blocks), got {v:g}",
                                  value.span)
            opts[name] = v
        return opts


def _number(e: ast.Expr) -> float | None:
    if isinstance(e, ast.Number):
        return e.value
    if isinstance(e, ast.Unary) and isinstance(e.operand, ast.Number):
        return -e.operand.value
    return None


def _opname(op: str) -> str:
    return {"add": "+", "sub": "−", "mul": "*", "div": "/"}.get(op, op)


def _closest(name: str, candidates: list[str]) -> str | None:
    found = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return found[0] if found else None


def resolve(program: ast.Program) -> tuple[ir.Program, tuple[LinrecWarning, ...]]:
    """Check names and shapes: the typed IR, and warnings (declared names that nothing uses). Raises
    LinrecError pointing at the problem."""
    resolver = _Resolver(program)
    return resolver.run(), resolver.warnings

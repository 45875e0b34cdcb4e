"""Parse linrec source text into the syntax tree of dsl.ast (lark LALR, positions kept)."""
from __future__ import annotations

import math
import re
from functools import lru_cache
from importlib import resources

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from . import ast
from .errors import LinrecError, Span

# Readable names for the grammar's terminals, used in "expected ..." messages.
_TERMINAL_NAMES = {
    "NAME": "a name", "NUMBER": "a number", "INT": "an integer", "LPAR": "'('", "RPAR": "')'",
    "LSQB": "'['", "RSQB": "']'", "COMMA": "','", "EQUAL": "'='", "PLUS": "'+'", "MINUS": "'-'",
    "STAR": "'*'", "SLASH": "'/'", "CIRCUMFLEX": "'^'", "DOT": "'·'", "OUTER": "'⊗'", "_NL": "end of line",
    "MODE": "'causal' or 'noncausal'", "PER_HEAD": "'per head'", "COMPARE": "a comparison",
    "IN": "'in'", "RECURRENCE": "'recurrence'", "$END": "end of file",
}


@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files(__package__).joinpath("grammar.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def _span(meta_or_token) -> Span:
    m = meta_or_token
    if isinstance(m, Token):
        return Span(m.line, m.column, m.end_line, m.end_column)
    return Span(m.line, m.column, m.end_line, m.end_column)


@v_args(meta=True)
class _ToAst(Transformer):
    def start(self, meta, children):
        header, *statements = children
        name, dims, causal, span = header
        flat = []
        for s in statements:  # `input a, b` and `state S, z` declare several names at once
            flat.extend(s if isinstance(s, list) else [s])
        return ast.Program(span, name, dims, causal, tuple(flat))

    def header(self, meta, children):
        name, *rest = children
        mode = rest.pop() if rest else None
        dims = tuple(d for d in rest if d is not None)
        return (str(name), dims, mode != "noncausal", _span(meta))

    def dim_default(self, meta, children):
        name, value = children
        return (str(name), int(value), _span(name))

    # ---- declarations ----
    def shape(self, meta, children):
        return tuple(str(c) for c in children if c is not None)

    def input_decl(self, meta, children):
        return children

    def input_item(self, meta, children):
        name, shape, constraint = children
        return ast.InputDecl(_span(name), str(name), shape or (), constraint)

    def signed_number(self, meta, children):
        sign, number = children
        value = float(number)
        if not math.isfinite(value):  # (1e999: a range's end must be a number a comparison can use)
            raise LinrecError("this number is too large: it is not a finite double-precision number (the largest "
                              "is about 1.8e308)", _span(number))
        return -value if sign is not None else value

    def interval(self, meta, children):
        lo_br, lo, hi, hi_br = children
        return (lo, hi, lo_br == "(", hi_br == ")")

    def range_constraint(self, meta, children):
        lo, hi, lo_open, hi_open = children[0]
        if not lo < hi:
            raise LinrecError(f"empty interval: the lower end {lo:g} must be below the upper end {hi:g}",
                              _span(meta))
        return ast.Constraint(_span(meta), lo, hi, lo_open, hi_open)

    def bound_constraint(self, meta, children):
        op, value = children
        op = {"≤": "<=", "≥": ">="}.get(str(op), str(op))
        if op in ("<", "<="):
            return ast.Constraint(_span(meta), None, value, True, op == "<")
        return ast.Constraint(_span(meta), value, None, op == ">", True)

    def param_decl(self, meta, children):
        name, shape, per_head, default = children
        return ast.ParamDecl(_span(name), str(name), shape or (), per_head is not None, default)

    def state_decl(self, meta, children):
        return children

    def state_item(self, meta, children):
        name, shape = children
        return ast.StateDecl(_span(name), str(name), shape or ())

    def function_def(self, meta, children):
        name, *params, body = children
        return ast.FunctionDef(_span(name), str(name), tuple(str(p) for p in params), body)

    def output_def(self, meta, children):
        name, value = children
        return ast.OutputDef(_span(name), str(name), value)

    def assignment(self, meta, children):
        name, value = children
        return ast.Assignment(_span(name), str(name), value)

    # ---- expressions ----
    def number(self, meta, children):
        return ast.Number(_span(meta), float(children[0]))

    def name(self, meta, children):
        return ast.Name(_span(meta), str(children[0]))

    def neg(self, meta, children):
        return ast.Unary(_span(meta), "neg", children[-1])

    def _binary(op):  # noqa: N805 - a factory for the methods below
        def method(self, meta, children):
            return ast.Binary(_span(meta), op, children[0], children[-1])
        return method

    add = _binary("add")
    sub = _binary("sub")
    mul = _binary("mul")
    div = _binary("div")
    pow = _binary("pow")
    dot = _binary("dot")
    outer = _binary("outer")

    def keyword(self, meta, children):
        name, value = children
        return ast.Keyword(_span(meta), str(name), value)

    def call(self, meta, children):
        name, *arguments = children
        arguments = [a for a in arguments if a is not None]
        args = tuple(a for a in arguments if not isinstance(a, ast.Keyword))
        keywords = tuple(a for a in arguments if isinstance(a, ast.Keyword))
        seen_keyword = False
        named: set[str] = set()
        for a in arguments:
            if isinstance(a, ast.Keyword):
                seen_keyword = True
                if a.name in named:  # (found by probing: the last one silently won)
                    raise LinrecError(f"option '{a.name}' is given twice; give it once", a.span)
                named.add(a.name)
            elif seen_keyword:
                raise LinrecError("a positional argument cannot follow a keyword argument", a.span)
        return ast.Call(_span(meta), str(name), args, keywords, _span(name))


def _expected(tokens) -> str:
    # The end of a line is usually the most useful alternative, so it comes first and is never cut off.
    names = {_TERMINAL_NAMES.get(t, repr(t) if len(t) < 3 else repr(t.lower())) for t in tokens}
    first = [n for n in ("end of line", "end of file") if n in names]
    rest = sorted(names - set(first))
    return ", ".join(first + rest[:12])


def _unclosed(source: str | None, line: int, column: int) -> tuple[str, int, int] | None:
    """The innermost bracket still open at (line, column) in the statement there: (bracket, line, column)."""
    if source is None:
        return None
    lines = source.splitlines()
    if not 0 < line <= len(lines):
        return None
    first = line  # a statement may continue over lines ending in a backslash
    while first > 1 and lines[first - 2].rstrip().endswith("\\"):
        first -= 1
    stack = []
    for n in range(first, line + 1):
        text = lines[n - 1].split("#", 1)[0]
        if n == line:
            text = text[:max(column - 1, 0)]
        for c, ch in enumerate(text, start=1):
            if ch in "([":
                stack.append((ch, n, c))
            elif ch in ")]" and stack:
                stack.pop()
    return stack[-1] if stack else None


# characters that look like an operator the language has (pasted from a paper or a word processor), and what to
# write instead
LOOKALIKES = [
    ("×∗", " (write '*' for an elementwise product, '·' or '@' for a contraction)"),
    ("∙•", " (write '·' or '@' for a contraction, '*' for an elementwise product)"),
    ("‐‑‒–—﹣－", " (a dash: write '−' or '-' for a minus)"),
    ("½⅓⅔¼¾⅕⅛", " (write a fraction as a division, e.g. (1/2))"),
    ("√", " (write sqrt(x))"),
    ("\r", " (a carriage return alone: old Macs' line ends; save the file with \\n or \\r\\n line ends)"),
    ("\ufeff\u200b\u200c\u200d\u2060", " (an invisible character — a byte-order mark or a zero-width space, often "
                                    "pasted along with text: delete it)"),
]


def _syntax_error(err: UnexpectedInput, source: str | None = None) -> LinrecError:
    line, column = max(err.line, 1), max(err.column, 1)
    if isinstance(err, UnexpectedCharacters):
        char = err.char if hasattr(err, "char") else "?"
        msg = f"unexpected character {char!r}"
        msg += next((hint for chars, hint in LOOKALIKES if char in chars), "")
        return LinrecError(msg, Span(line, column, line, column + 1))
    if isinstance(err, UnexpectedEOF):
        return LinrecError("unexpected end of file: the last statement is incomplete",
                           Span(line, column, line, column + 1))
    assert isinstance(err, UnexpectedToken)
    tok = err.token
    width = max(1, len(str(tok)))
    if tok.type == "_NL" or tok.type == "$END":
        what = "end of line" if tok.type == "_NL" else "end of file"
        width = 1
    else:
        what = repr(str(tok))
    hint = ""
    if "RECURRENCE" in err.expected and tok.type != "_NL":
        return LinrecError(f"a program starts with its header, e.g. `recurrence NAME(dk = 64, dv = 64)`; "
                           f"found {what}", Span(line, column, line, column + width))
    if tok.type in ("_NL", "$END") and ({"RPAR", "RSQB"} & set(err.expected)):
        opened = _unclosed(source, line, column)
        if opened is not None:
            bracket, at_line, at_col = opened
            where = f"column {at_col}" if at_line == line else f"line {at_line}, column {at_col}"
            hint = f" (the '{bracket}' at {where} is never closed)"
    lines = source.splitlines() if source else []
    statement = lines[line - 1].lstrip() if line <= len(lines) else ""
    if tok.type == "$END" and statement.rstrip().endswith("\\"):
        hint = (" (the line ends in '\\', which continues the statement onto the next line, but the file ends "
                "there: finish the statement or remove the '\\')")
    if not hint and "LSQB" in err.expected and statement.startswith("state"):
        hint = " (a state has a shape: a vector such as z[dk] or a matrix such as S[dk, dv])"
    if not hint and tok.type == "NAME" and "EQUAL" in err.expected:
        hint = " (each statement goes on its own line)"
    elif not hint and str(tok) in ("recurrence", "input", "param", "state", "output"):
        hint = f" ('{tok}' starts a statement of its own line)"
    msg = f"unexpected {what}; expected {_expected(err.expected)}{hint}"
    return LinrecError(msg, Span(line, column, line, column + width))


# How deeply an expression may nest (operators and calls; parentheses make no node): every stage after the parser walks
# expressions recursively, and a few hundred levels exhaust Python's stack (a RecursionError, not an answer).
MAX_NESTING = 64
_EXPRESSIONS = {"add", "sub", "mul", "div", "pow", "dot", "outer", "neg", "call", "keyword"}


def _check_nesting(tree: Tree) -> None:
    """A LinrecError at the first part of an expression nested more than MAX_NESTING levels deep (the walk
    is iterative: the syntax tree itself may be deeper than the stack allows)."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, Tree):
            continue
        depth += node.data in _EXPRESSIONS
        if depth > MAX_NESTING:
            raise LinrecError(f"this expression nests more than {MAX_NESTING} levels deep (each operator or call "
                              f"applied to another's result is a level: a sum of {MAX_NESTING + 1} terms is that "
                              f"deep; parentheses alone add none); give some of its parts names of their own, e.g. "
                              f"`x1 = …`", _span(node.meta))
        stack.extend((child, depth) for child in node.children)


def _blank(source: str) -> bool:
    """Whether the source holds no statement: only whitespace and `#` comments (the grammar's COMMENT)."""
    return not re.sub(r"#[^\n]*", "", source).strip()


def parse(source: str, filename: str = "<source>") -> ast.Program:
    """Parse a program. Raises LinrecError (with file, line, column and caret) on bad syntax."""
    text = source if source.endswith("\n") else source + "\n"
    try:
        tree = _parser().parse(text)
        _check_nesting(tree)
        return _ToAst().transform(tree)
    except VisitError as err:
        inner = err.orig_exc
        if isinstance(inner, LinrecError):
            raise inner.located(source, filename) from None
        raise
    except LinrecError as err:
        raise err.located(source, filename) from None
    except UnexpectedInput as err:
        if _blank(source):  # (whatever token the parser stopped at: the end, or a comment's end of line)
            raise LinrecError("empty program: start with `recurrence NAME(dk = 64, dv = 64)`",
                              Span(1, 1, 1, 2)).located(source, filename) from None
        raise _syntax_error(err, text).located(source, filename) from None


"""Parse linrec source text into the syntax tree of dsl.ast (lark LALR, positions kept)."""
from __future__ import annotations

import math
import re
from functools import lru_cache
from importlib import resources

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError
from lark.lexer import PatternStr

from . import ast
from .errors import LinrecError, Span, source_lines

# Readable names for the grammar's terminals that are patterns, used in "expected ..." messages (a terminal of
# one fixed text, `(` or `input`, is shown as that text: _readable)
_TERMINAL_NAMES = {
    "NAME": "a name", "NUMBER": "a number", "INT": "an integer", "MINUS": "'-'", "DOT": "'·'",
    "_NL": "end of line", "MODE": "'causal' or 'noncausal'", "PER_HEAD": "'per head'", "COMPARE": "a comparison",
    "LBRACKET": "'(' or '['", "RBRACKET": "')' or ']'", "$END": "end of file",
}

# The words the grammar keeps from names (its NAME excludes them), and the statement each belongs in: a program
# that uses one as a name is told so
KEYWORDS = {
    "recurrence": "the header, `recurrence NAME(dk = 64)`",
    "input": "`input q[dk]`", "param": "`param w[dk] = 1`", "state": "`state S[dk, dv]`",
    "output": "`output o = q·S`", "per": "`param NAME per head`", "in": "a range, `input beta in (0, 1)`",
    "causal": "the header, `recurrence NAME(dk = 64) causal`",
    "noncausal": "the header, `recurrence NAME(dk = 64) noncausal`",
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


def _value(number: Token) -> float:
    """A NUMBER's value (its exponent's sign may be written −, which float() does not read)."""
    return float(str(number).replace("−", "-"))


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
        value = _value(number)
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
        return ast.Number(_span(meta), _value(children[0]))

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


def _readable(terminal: str) -> str | None:
    """How a terminal is written: its text when it has one, else its description (None for a pattern without
    one, which is left out of a message rather than shown by its internal name; a test keeps that from
    happening)."""
    if terminal in _TERMINAL_NAMES:
        return _TERMINAL_NAMES[terminal]
    pattern = next((t.pattern for t in _parser().terminals if t.name == terminal), None)
    return repr(pattern.value) if isinstance(pattern, PatternStr) else None


def _accepted(err: UnexpectedInput, text: str) -> set[str]:
    """The terminals that can come where the parser stopped. Lark's `expected` is a row of the LALR table,
    which names tokens that cannot come there (states merged: `,` and `)` after `x = a`), and when the bad
    token was a lookahead that reduced first, misses some that can (`*` after `x = a )`); the parser run
    again on the text before the place, and asked which terminals it would take next, gives exactly those."""
    at_end = isinstance(err, UnexpectedToken) and err.token.type == "$END"
    start = len(text) if at_end else err.pos_in_stream
    try:
        parser = _parser().parse_interactive(text[:start])
        parser.exhaust_lexer()
        accepted = parser.accepts()
    except UnexpectedInput:  # (not expected: the text before the place parsed once already)
        return set(getattr(err, "expected", None) or getattr(err, "allowed", None) or ())
    # (accepts() feeds each candidate alone, and the end of the file only ends a program fed as the end)
    if "$END" in parser.choices() and not at_end:
        accepted.add("$END")
    return accepted


def _expected(tokens) -> str:
    # The end of a line is usually the most useful alternative, and a closing bracket the likeliest one missing
    # (before `(`, which may follow any name as a call), so they come first and are never cut off.
    names = {n for n in map(_readable, tokens) if n is not None}
    first = [n for n in ("end of line", "end of file", "')'", "']'", "')' or ']'") if n in names]
    rest = sorted(names - set(first))
    return ", ".join(first + rest[:12])


def _unclosed(source: str | None, line: int, column: int) -> tuple[str, int, int] | None:
    """The innermost bracket still open at (line, column) in the statement there: (bracket, line, column)."""
    if source is None:
        return None
    lines = source_lines(source)
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
    ("⊙∘", " (write '*' for an elementwise product)"),
    ("‖", " (write norm(x) for ‖x‖)"),
    ("ᵀ⊤", " (there is no transpose: write k⊗v for the outer product k·vᵀ, and q·S to read a state S[dk, dv]; "
           "a state declared S[dv, dk] is read S·q — docs/forms.md, the transposed convention)"),
    ("\r", " (a carriage return alone: old Macs' line ends; save the file with \\n or \\r\\n line ends)"),
    ("\ufeff\u200b\u200c\u200d\u2060", " (an invisible character — a byte-order mark or a zero-width space, often "
                                    "pasted along with text: delete it)"),
]


def _syntax_error(err: UnexpectedInput, source: str) -> LinrecError:
    line, column = max(err.line, 1), max(err.column, 1)
    if isinstance(err, UnexpectedEOF):
        return LinrecError("unexpected end of file: the last statement is incomplete",
                           Span(line, column, line, column + 1))
    accepted = _accepted(err, source)
    if isinstance(err, UnexpectedCharacters):
        # (a keyword that is no token alone — `per` — reaches the lexer as characters no terminal takes)
        word = _word_at(source, err.pos_in_stream)
        if word not in KEYWORDS:
            char = err.char if hasattr(err, "char") else "?"
            msg = f"unexpected character {char!r}"
            msg += next((hint for chars, hint in LOOKALIKES if char in chars), "")
            return LinrecError(msg, Span(line, column, line, column + 1))
        kind, what = "NAME", repr(word)
    else:
        assert isinstance(err, UnexpectedToken)
        word = str(err.token)
        kind = err.token.type
        what = {"_NL": "end of line", "$END": "end of file"}.get(kind, repr(word))
    width = 1 if kind in ("_NL", "$END") else max(1, len(word))
    span = Span(line, column, line, column + width)
    if "RECURRENCE" in accepted and kind != "_NL":
        return LinrecError(f"a program starts with its header, e.g. `recurrence NAME(dk = 64, dv = 64)`; "
                           f"found {what}", span)
    if kind not in ("_NL", "$END") and word in KEYWORDS:
        message = _misplaced_keyword(word, accepted, source, err.pos_in_stream)
        if message:
            return LinrecError(message, span)
    msg = f"unexpected {what}; expected {_expected(accepted)}{_hint(err, kind, accepted, source, line, column)}"
    return LinrecError(msg, span)


def _word_at(source: str, position: int) -> str:
    """The word (a name or keyword) that starts at `position`, or ""."""
    word = re.match(r"[^\W\d]\w*", source[position:])
    return word.group() if word else ""


def _misplaced_keyword(word: str, accepted: set[str], source: str, position: int) -> str | None:
    """What is wrong with a keyword where the parser cannot take it, when that can be told: `per` not followed
    by `head` where `per head` may come, or a keyword where a name goes."""
    if word == "per" and "PER_HEAD" in accepted:
        rest = source[position + len(word):].split("\n", 1)[0].split("#", 1)[0].strip()
        after = repr(_word_at(rest, 0) or rest[:1]) if rest else "the end of the line"
        return (f"'per' is followed here by {after}, but it is one half of the keyword 'per head', as in "
                f"`param NAME per head`: write 'head' after it on the same line (or continue the line with "
                f"'\\' first)")
    if word == "recurrence" and "INPUT" in accepted:  # (at the start of a statement: a second header)
        return ("a file holds one recurrence, and its header is the first statement; this is a second header: "
                "put each recurrence in a file of its own")
    if "NAME" in accepted:
        return (f"'{word}' is a keyword (of {KEYWORDS[word]}) and cannot be a name; choose another name, "
                f"e.g. '{word}_'")
    return None


def _hint(err: UnexpectedInput, kind: str, accepted: set[str], source: str, line: int, column: int) -> str:
    """A guess at the cause of an unexpected token, in parentheses after the message, or ""."""
    lines = source_lines(source)
    statement = lines[line - 1].lstrip() if line <= len(lines) else ""
    if kind == "$END" and statement.rstrip().endswith("\\"):
        return (" (the line ends in '\\', which continues the statement onto the next line, but the file ends "
                "there: finish the statement or remove the '\\')")
    if kind in ("_NL", "$END") and ({"RPAR", "RSQB", "RBRACKET"} & accepted):
        opened = _unclosed(source, line, column)
        if opened is not None:
            bracket, at_line, at_col = opened
            where = f"column {at_col}" if at_line == line else f"line {at_line}, column {at_col}"
            return f" (the '{bracket}' at {where} is never closed)"
    if statement.startswith("param") and re.match(r"(in\b|[<>≤≥])", source[err.pos_in_stream:]):
        return (" (a param declares no range: ranges are for inputs, checked at every call; a param's value is its "
                "default or what the caller passes — to keep a learned one in a range, compute it from an "
                "unconstrained param, e.g. `param a per head` and `gamma = sigmoid(a)`)")
    if "LSQB" in accepted and statement.startswith("state"):
        return (" (a state has a shape: a vector such as z[dk] or a matrix such as S[dk, dv]; for a scalar, declare a "
                "dim of size 1 in the header, `one = 1`, write c[one], and read it as sum(c))")
    # a name glued to a number: starting with e, an exponent its sign is missing from (`1e–3`, a dash); else
    # a product written as in mathematics (`2x`, `0.5k`)
    if kind == "NAME" and err.pos_in_stream and source[err.pos_in_stream - 1] in "0123456789.":
        if source[err.pos_in_stream] in "eE":
            return " (a number's exponent is written as in 1e-3 or 1e−3)"
        number = re.search(r"[\d.]+$", source[:err.pos_in_stream]).group(0)
        name = _word_at(source, err.pos_in_stream)
        return f" (a product is written with an operator: {number}*{name} or {number}·{name})"
    # a name where the line could have ended, followed by what begins a definition: a second statement
    rest = source[err.pos_in_stream:].split("\n", 1)[0]
    if kind == "NAME" and "_NL" in accepted and re.match(r"[^\W\d]\w*\s*(\([^()]*\)\s*)?=", rest):
        return " (each statement goes on its own line)"
    if kind in ("RECURRENCE", "INPUT", "PARAM", "STATE", "OUTPUT"):
        return f" ('{kind.lower()}' starts a statement of its own line)"
    return ""


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


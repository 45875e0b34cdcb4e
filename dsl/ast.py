"""The syntax tree of a linrec program. Every node carries the span of the text it came from."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Span


@dataclass(frozen=True)
class Node:
    span: Span = field(compare=False, repr=False)


# ---- expressions -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Number(Node):
    value: float


@dataclass(frozen=True)
class Name(Node):
    name: str


@dataclass(frozen=True)
class Unary(Node):
    op: str  # "neg"
    operand: "Expr"


@dataclass(frozen=True)
class Binary(Node):
    op: str  # add, sub, mul, div, pow, dot, outer
    left: "Expr"
    right: "Expr"


@dataclass(frozen=True)
class Keyword(Node):
    name: str
    value: "Expr"


@dataclass(frozen=True)
class Call(Node):
    function: str
    args: tuple["Expr", ...]
    keywords: tuple[Keyword, ...]
    name_span: Span = field(compare=False, repr=False, default=None)


Expr = Number | Name | Unary | Binary | Call


# ---- statements --------------------------------------------------------------------------------
def walk(e: Expr):
    """e and every expression inside it, each before its parts (a call's arguments, then its keywords' values)."""
    yield e
    parts = (e.operand,) if isinstance(e, Unary) else (e.left, e.right) if isinstance(e, Binary) else \
        (*e.args, *(k.value for k in e.keywords)) if isinstance(e, Call) else ()
    for part in parts:
        yield from walk(part)


@dataclass(frozen=True)
class Constraint(Node):
    """Where an input's values live: an interval with open/closed ends (None = unbounded)."""

    low: float | None
    high: float | None
    low_open: bool = True
    high_open: bool = True


@dataclass(frozen=True)
class InputDecl(Node):
    name: str
    shape: tuple[str, ...]
    constraint: Constraint | None


@dataclass(frozen=True)
class ParamDecl(Node):
    name: str
    shape: tuple[str, ...]
    per_head: bool
    default: Expr | None


@dataclass(frozen=True)
class StateDecl(Node):
    name: str
    shape: tuple[str, ...]


@dataclass(frozen=True)
class FunctionDef(Node):
    name: str
    params: tuple[str, ...]
    body: Expr


@dataclass(frozen=True)
class Assignment(Node):
    """`x = expr`: a state update when x is a state, otherwise a named intermediate value."""

    target: str
    value: Expr


@dataclass(frozen=True)
class OutputDef(Node):
    name: str
    value: Expr


Statement = InputDecl | ParamDecl | StateDecl | FunctionDef | Assignment | OutputDef


@dataclass(frozen=True)
class Program(Node):
    name: str
    dims: tuple[tuple[str, int, Span], ...]
    causal: bool
    statements: tuple[Statement, ...]
